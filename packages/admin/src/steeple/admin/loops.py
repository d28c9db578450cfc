"""The recurring store's work loops (tick, claim + relay), with counters for live displays."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import attrs

from steeple.core.errors import RecurringClockError, RecurringRelayError, RecurringStorageError
from steeple.core.ports import MessageBroker, RecurringStore

__all__ = ["RelayCounters", "relay_forever", "sleep_until", "tick_forever"]

_log = logging.getLogger("steeple.admin")


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
        try:
            result = await store.tick(budget)
        except (RecurringStorageError, RecurringClockError) as exc:
            counters.storage_errors += 1
            _log.warning("tick failed, retrying: %s", exc)
            await sleep_until(stop, interval)
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
        try:
            leases = await store.claim(batch)
        except (RecurringStorageError, RecurringClockError) as exc:
            counters.storage_errors += 1
            _log.warning("claim failed, retrying: %s", exc)
            await sleep_until(stop, interval)
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
