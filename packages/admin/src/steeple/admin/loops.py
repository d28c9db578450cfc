"""The recurring store's work loops (tick, claim + relay), with counters for live displays."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import attrs

from steeple.core.errors import RecurringClockError, RecurringRelayError, RecurringStorageError
from steeple.core.ports import MessageBroker, RecurringStore

__all__ = ["RelayCounters", "relay_forever", "sleep_until", "tick_forever"]

_log = logging.getLogger("steeple.admin")

T = TypeVar("T")


@attrs.define
class RelayCounters:
    """What the loops did so far."""

    ticks: int = 0
    materialized: int = 0
    claims: int = 0
    relays: int = 0
    duplicates: int = 0
    relay_failures: int = 0
    storage_errors: int = 0


async def sleep_until(stop: asyncio.Event, seconds: float) -> None:
    """Sleep ``seconds`` or until ``stop`` is set, whichever comes first."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            await stop.wait()


async def _or_back_off(
    op: Callable[[], Awaitable[T]],
    what: str,
    stop: asyncio.Event,
    counters: RelayCounters,
    interval: float,
) -> T | None:
    """Run ``op``; on a storage or clock error count and log it, wait ``interval``, give None."""
    try:
        return await op()
    except (RecurringStorageError, RecurringClockError) as exc:
        counters.storage_errors += 1
        _log.warning("%s failed, retrying: %s", what, exc)
        await sleep_until(stop, interval)
        return None


async def tick_forever(
    store: RecurringStore,
    stop: asyncio.Event,
    counters: RelayCounters,
    *,
    budget: int = 100,
    interval: float = 1.0,
) -> None:
    """Tick until ``stop``; a full budget ticks again at once (a backlog is being caught up).

    Storage errors are counted and retried after ``interval``; anything else propagates.
    """
    while not stop.is_set():
        result = await _or_back_off(lambda: store.tick(budget), "tick", stop, counters, interval)
        if result is None:
            continue
        counters.ticks += 1
        counters.materialized += result.materialized
        if result.materialized < budget:
            await sleep_until(stop, interval)


async def relay_forever(
    store: RecurringStore,
    broker: MessageBroker,
    stop: asyncio.Event,
    counters: RelayCounters,
    *,
    batch: int = 20,
    interval: float = 1.0,
) -> None:
    """Claim and relay until ``stop``; an in-flight batch is finished before returning.

    A failed relay is recorded by the store (retry with backoff, or dead); the loop goes on.
    """
    while not stop.is_set():
        leases = await _or_back_off(lambda: store.claim(batch), "claim", stop, counters, interval)
        if leases is None:
            continue
        counters.claims += len(leases)
        for lease in leases:
            try:
                receipt: Any = await store.relay(lease, broker)
            except RecurringRelayError as exc:
                counters.relay_failures += 1
                _log.info("relay of %s failed: %s", lease.occurrence_id, type(exc).__name__)
                continue
            except (RecurringStorageError, RecurringClockError) as exc:
                counters.storage_errors += 1
                _log.warning("relay of %s hit storage: %s", lease.occurrence_id, exc)
                continue
            counters.relays += 1
            counters.duplicates += int(bool(receipt.duplicate))
        if len(leases) < batch:
            await sleep_until(stop, interval)
