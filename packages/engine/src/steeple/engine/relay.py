"""The relay loop every worker runs: tick, claim, relay, with backoff and graceful shutdown."""

from __future__ import annotations

import asyncio
import logging
from datetime import timedelta

import attrs

from steeple.core.backoff import Backoff
from steeple.core.entropy import SystemRandom
from steeple.core.errors import (
    KeyringError,
    RecurringCapacityError,
    RecurringClockError,
    RecurringRelayError,
    RecurringStorageError,
)
from steeple.core.policies import validate_budget
from steeple.core.ports import MessageBroker, RandomSource, RecurringStore

__all__ = ["RecurringRelay"]

_log = logging.getLogger("steeple.engine.relay")

_STORAGE_BACKOFF = Backoff(
    initial=timedelta(milliseconds=500), maximum=timedelta(seconds=30), factor=2, jitter=0.5
)


@attrs.define
class RecurringRelay:
    """Runs a store's work: tick, claim, relay each lease, repeat until told to stop.

    Relay failures are recorded by the store (retry with backoff, dead letters) and only
    logged here: whatever a broker raises reaches the loop as a relay error, so no broker
    can stop it, and the next leases are relayed. Storage and clock errors back off
    exponentially (0.5 s doubling to 30 s, with jitter) and the loop keeps going;
    configuration and keyring errors stop it (they need an operator). A capacity error
    skips ticking but still relays existing work.

    Attributes:
        store: the recurring store (PostgreSQL, in memory, or any composed on the engine).
        broker: where occurrences are published.
        tick_budget: occurrences materialized per tick (1-100).
        claim_limit: leases claimed per round (1-100).
        idle_interval: seconds to wait when a round found nothing to do.
        published: publications recorded so far (receipts returned by ``relay``).
        failed: relay attempts that raised a relay error.

    Raises:
        RecurringConfigurationError: ``tick_budget`` or ``claim_limit`` outside 1..100, or
            a non-positive ``idle_interval``.
    """

    store: RecurringStore
    broker: MessageBroker
    tick_budget: int = attrs.field(default=100, kw_only=True)
    claim_limit: int = attrs.field(default=100, kw_only=True)
    idle_interval: float = attrs.field(default=1.0, kw_only=True)
    random: RandomSource = attrs.field(factory=SystemRandom, kw_only=True)
    published: int = attrs.field(default=0, init=False)
    failed: int = attrs.field(default=0, init=False)
    storage_failures: int = attrs.field(default=0, init=False)

    def __attrs_post_init__(self) -> None:
        validate_budget(self.tick_budget, "tick_budget")
        validate_budget(self.claim_limit, "claim_limit")
        if not self.idle_interval > 0:
            from steeple.core.errors import RecurringConfigurationError

            raise RecurringConfigurationError("idle_interval must be a positive number")

    async def run_once(self, stop: asyncio.Event | None = None) -> int:
        """Run one round: tick, claim, relay every lease; return how much work was seen.

        Raises:
            RecurringStorageError, RecurringClockError: the store failed (``run`` backs off).
            RecurringConfigurationError, KeyringError: configuration needs an operator.
        """
        done = 0
        try:
            done += (await self.store.tick(self.tick_budget)).materialized
        except RecurringCapacityError as exc:
            _log.warning("tick skipped: %s", exc)
        leases = await self.store.claim(self.claim_limit)
        for lease in leases:
            if stop is not None and stop.is_set():
                break  # unpublished leases lapse and are reclaimed by another round
            try:
                await self.store.relay(lease, self.broker)
                self.published += 1
            except RecurringRelayError as exc:
                self.failed += 1
                _log.info("relay of %s failed: %s", lease.occurrence_id, type(exc).__name__)
            except KeyringError as exc:
                self.failed += 1
                _log.error(
                    "occurrence %s cannot be opened (%s); it is a dead letter until its key "
                    "is restored and an operator retries it",
                    lease.occurrence_id,
                    type(exc).__name__,
                )
        return done + len(leases)

    async def run(self, stop: asyncio.Event) -> None:
        """Work until ``stop`` is set; finish the current relay, then return.

        Raises:
            RecurringConfigurationError, KeyringError: configuration needs an operator.
        """
        failures = 0
        while not stop.is_set():
            try:
                busy = await self.run_once(stop)
            except (RecurringStorageError, RecurringClockError) as exc:
                failures += 1
                self.storage_failures += 1
                delay = _STORAGE_BACKOFF.delay(failures, self.random.random()).total_seconds()
                _log.warning(
                    "recurring relay round failed (%s: %s); retrying in %.2f s",
                    type(exc).__name__,
                    exc,
                    delay,
                )
                await self._sleep(stop, delay)
                continue
            failures = 0
            if not busy:
                await self._sleep(stop, self.idle_interval)

    @staticmethod
    async def _sleep(stop: asyncio.Event, seconds: float) -> None:
        try:
            async with asyncio.timeout(seconds):
                await stop.wait()
        except TimeoutError:
            pass
