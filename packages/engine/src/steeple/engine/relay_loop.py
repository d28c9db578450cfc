"""The relay loop every worker runs: tick, claim, relay, with backoff and graceful shutdown."""

from __future__ import annotations

import asyncio
import logging
from datetime import timedelta
from typing import Any

import attrs

from steeple.core.backoff import Backoff
from steeple.core.entropy import SystemRandom
from steeple.core.errors import (
    ConfigurationError,
    KeyringError,
    RecurringCapacityError,
    RecurringClockError,
    RecurringConfigurationError,
    RecurringRelayError,
    RecurringStorageError,
)
from steeple.core.policies import validate_budget
from steeple.core.ports import MessageBroker, RandomSource, RecurringStore
from steeple.core.records import RelayOutcome
from steeple.runtime.looplag import (
    DEFAULT_LOOP_LAG_THRESHOLD,
    LoopStall,
    check_loop_lag_threshold,
    watching_event_loop,
)

__all__ = ["RecurringRelay", "RelayStatistics"]

_log = logging.getLogger("steeple.engine.relay")

_STORAGE_BACKOFF = Backoff(
    initial=timedelta(milliseconds=500), maximum=timedelta(seconds=30), factor=2, jitter=0.5
)


@attrs.define
class RelayStatistics:
    """What a :class:`RecurringRelay` has done so far: counters for live displays and metrics.

    The relay only adds to them, between its awaits (one event loop: a reader never sees a
    half-updated round). Pass your own instance (``RecurringRelay(..., statistics=mine)``)
    to read it while the relay runs, or share one between relays to sum them.

    Attributes:
        ticks: ticks that returned (one per round that could tick).
        materialized: occurrences those ticks materialized.
        ticks_skipped: ticks refused because a quota is full (relaying went on).
        claimed: leases claimed.
        published: relays the broker accepted (a receipt was recorded), duplicates included.
        duplicates: of those, receipts where the broker recognised the idempotency key and
            kept no second copy (an earlier attempt had reached it).
        relay_failures: relays that raised a relay error (broker failure or timeout, lost
            lease, uncertain acknowledgement) or could not open the occurrence's content;
            the store recorded the retry or the dead letter.
        storage_failures: rounds that failed on a storage or clock error and backed off.
        loop_stalls: times the event loop stalled past the loop-lag threshold while the
            relay ran (see :mod:`steeple.runtime.looplag`).
    """

    ticks: int = 0
    materialized: int = 0
    ticks_skipped: int = 0
    claimed: int = 0
    published: int = 0
    duplicates: int = 0
    relay_failures: int = 0
    storage_failures: int = 0
    loop_stalls: int = 0


@attrs.define
class RecurringRelay:
    """Runs a store's work: tick, claim, relay the claimed batch, repeat until told to stop.

    Each claimed batch is relayed with the store's ``relay_many`` (one transaction checks
    the leases, the publications run concurrently, one transaction records the outcomes).

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
        loop_lag_threshold: seconds of event-loop lag that ``run`` reports as a stall,
            naming the code that blocked the loop (a broker's publish that blocks, say);
            ``None`` turns the detection off (see :mod:`steeple.runtime.looplag`).
        statistics: the counters this relay adds to (:class:`RelayStatistics`; a fresh
            one unless given).
        published: publications recorded so far (``statistics.published``).
        failed: relay attempts that raised a relay error (``statistics.relay_failures``).
        storage_failures: rounds that backed off (``statistics.storage_failures``).

    Raises:
        RecurringConfigurationError: ``tick_budget`` or ``claim_limit`` outside 1..100, or
            a non-positive ``idle_interval``, or a ``loop_lag_threshold`` outside
            0.01 .. 3600 s.
    """

    store: RecurringStore
    broker: MessageBroker
    tick_budget: int = attrs.field(default=100, kw_only=True)
    claim_limit: int = attrs.field(default=100, kw_only=True)
    idle_interval: float = attrs.field(default=1.0, kw_only=True)
    random: RandomSource = attrs.field(factory=SystemRandom, kw_only=True)
    statistics: RelayStatistics = attrs.field(factory=RelayStatistics, kw_only=True)
    loop_lag_threshold: float | None = attrs.field(default=DEFAULT_LOOP_LAG_THRESHOLD, kw_only=True)

    @property
    def published(self) -> int:
        """Publications recorded so far (receipts returned by ``relay``)."""
        return self.statistics.published

    @property
    def failed(self) -> int:
        """Relay attempts that raised a relay or keyring error."""
        return self.statistics.relay_failures

    @property
    def storage_failures(self) -> int:
        """Rounds that failed on storage or the clock and backed off."""
        return self.statistics.storage_failures

    def __attrs_post_init__(self) -> None:
        validate_budget(self.tick_budget, "tick_budget")
        validate_budget(self.claim_limit, "claim_limit")
        if not self.idle_interval > 0:
            raise RecurringConfigurationError("idle_interval must be a positive number")
        if self.loop_lag_threshold is not None:
            try:
                check_loop_lag_threshold(self.loop_lag_threshold)
            except ConfigurationError as exc:
                raise RecurringConfigurationError(str(exc)) from None

    async def run_once(self, stop: asyncio.Event | None = None) -> int:
        """Run one round: tick, claim, relay the batch; return how much work was seen.

        Raises:
            RecurringStorageError, RecurringClockError: the store failed (``run`` backs off).
            RecurringConfigurationError, KeyringError: configuration needs an operator.
        """
        stats = self.statistics
        done = 0
        try:
            materialized = (await self.store.tick(self.tick_budget)).materialized
        except RecurringCapacityError as exc:
            stats.ticks_skipped += 1
            _log.warning("tick skipped: %s", exc)
        else:
            stats.ticks += 1
            stats.materialized += materialized
            done += materialized
        if stop is not None and stop.is_set():
            return done
        outcomes = await self._claim_and_relay()
        stats.claimed += len(outcomes)
        trouble: Exception | None = None
        for outcome in outcomes:
            error = outcome.error
            if error is None:
                stats.published += 1
                stats.duplicates += bool(outcome.receipt is not None and outcome.receipt.duplicate)
            elif isinstance(error, RecurringRelayError):
                stats.relay_failures += 1
                _log.info("relay of %s failed: %s", outcome.occurrence_id, type(error).__name__)
            elif isinstance(error, KeyringError):
                stats.relay_failures += 1
                _log.error(
                    "occurrence %s cannot be opened (%s); it is a dead letter until its key "
                    "is restored and an operator retries it",
                    outcome.occurrence_id,
                    type(error).__name__,
                )
            elif trouble is None:
                # Recording a failed publication failed: the storage (or the clock) is in
                # trouble, and ``run`` backs off once the batch is counted. The lease
                # lapses and the occurrence is reclaimed.
                trouble = error
        if trouble is not None:
            raise trouble
        return done + len(outcomes)

    async def _claim_and_relay(self) -> list[RelayOutcome]:
        """Claim a batch and relay it with the store's batched calls.

        ``claim_and_relay`` (claim and check in one transaction, the publications
        concurrent, one transaction recording them) when the store has it.
        """
        store: Any = self.store
        if hasattr(store, "claim_and_relay"):
            outcomes: list[RelayOutcome] = await store.claim_and_relay(
                self.claim_limit, self.broker
            )
            return outcomes
        # A store written before the batched calls: claim, then one relay per lease.
        leases = await store.claim(self.claim_limit)
        if hasattr(store, "relay_many"):
            return list(await store.relay_many(leases, self.broker))
        results: list[RelayOutcome] = []
        for lease in leases:
            try:
                receipt = await store.relay(lease, self.broker)
            except (RecurringRelayError, KeyringError) as exc:
                results.append(RelayOutcome(lease.occurrence_id, error=exc))
            else:
                results.append(RelayOutcome(lease.occurrence_id, receipt=receipt))
        return results

    async def run(self, stop: asyncio.Event) -> None:
        """Work until ``stop`` is set; finish the current relay, then return.

        Raises:
            RecurringConfigurationError, KeyringError: configuration needs an operator.
        """
        async with watching_event_loop(self.loop_lag_threshold, on_stall=self._stalled):
            await self._run(stop)

    def _stalled(self, stall: LoopStall) -> None:
        del stall  # the monitor logged it, naming the culprit
        self.statistics.loop_stalls += 1

    async def _run(self, stop: asyncio.Event) -> None:
        failures = 0
        while not stop.is_set():
            try:
                busy = await self.run_once(stop)
            except (RecurringStorageError, RecurringClockError) as exc:
                failures += 1
                self.statistics.storage_failures += 1
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
