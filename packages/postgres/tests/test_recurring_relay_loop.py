"""RecurringRelay: the ready worker loop over the PostgreSQL store."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from steeple.core import (
    MissedRunPolicy,
    OccurrenceState,
    RecurringConfig,
    RecurringConfigurationError,
    RecurringDeadlineError,
    RecurringDefinition,
    ScheduledMessage,
)
from steeple.core.errors import UnknownKeyIdError
from steeple.core.messages import BrokerReceipt
from steeple.keyring import Keyring, StorageKey
from steeple.postgres import PostgresRecurringStore, RecurringRelay, RelayStatistics
from steeple.testing import FakeClock, MemoryBroker

pytestmark = pytest.mark.postgres

START = datetime(2031, 3, 4, 5, 6, 7, 250000, tzinfo=UTC)
KEYRING = Keyring(StorageKey("k1", b"\x07" * 32))


def every_minute(name: str, minutes_back: int) -> RecurringDefinition:
    return RecurringDefinition(
        name,
        "* * * * *",
        START - timedelta(minutes=minutes_back),
        MissedRunPolicy.CATCH_UP,
        ScheduledMessage("t", "m", name.encode()),
    )


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(START)


@pytest.fixture
async def store(
    pg_schema: tuple[str, str], clock: FakeClock
) -> AsyncIterator[PostgresRecurringStore]:
    dsn, schema = pg_schema
    s = await PostgresRecurringStore.initialize(
        dsn, RecurringConfig("relay", 10, 60), KEYRING, clock, schema=schema
    )
    async with s:
        yield s


async def run_until(relay: RecurringRelay, done: Any, timeout: float = 30) -> None:
    stop = asyncio.Event()
    task = asyncio.create_task(relay.run(stop))
    try:
        async with asyncio.timeout(timeout):
            while not done():  # noqa: ASYNC110 - polls an outside predicate
                await asyncio.sleep(0.01)
    finally:
        stop.set()
        async with asyncio.timeout(5):
            await task


async def test_loop_publishes_everything_once_and_stops(store: PostgresRecurringStore) -> None:
    await store.create(every_minute("a", 30))
    await store.create(every_minute("b", 20))
    broker = MemoryBroker()
    relay = RecurringRelay(store, broker, tick_budget=7, claim_limit=5, idle_interval=0.05)
    await run_until(relay, lambda: len(broker.published) == 50)
    assert relay.published == 50
    assert relay.failed == 0
    keys = [k for _, k in broker.published]
    assert len(set(keys)) == 50
    states = {o.state for o in (await store.occurrences(limit=100)).items}
    assert states == {OccurrenceState.PUBLISHED}


async def test_loop_relays_failures_later(store: PostgresRecurringStore, clock: FakeClock) -> None:
    await store.create(every_minute("a", 3))
    broker = MemoryBroker()
    broker.fail_next(2)
    relay = RecurringRelay(store, broker, idle_interval=0.02)

    def advanced() -> bool:
        clock.advance(timedelta(milliseconds=200))  # lets the 1 s backoff pass quickly
        return len(broker.published) == 3

    await run_until(relay, advanced)
    assert relay.failed == 2
    assert relay.published == 3


class FlakyStore:
    """The real store behind a proxy whose first calls fail with a storage deadline."""

    def __init__(self, inner: PostgresRecurringStore, failures: int) -> None:
        self.inner = inner
        self.failures = failures

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if name not in {"tick", "claim"}:
            return attr

        async def call(*args: Any, **kw: Any) -> Any:
            if self.failures > 0:
                self.failures -= 1
                raise RecurringDeadlineError("injected: lock wait exceeded")
            return await attr(*args, **kw)

        return call


async def test_storage_errors_back_off_then_recover(store: PostgresRecurringStore) -> None:
    await store.create(every_minute("a", 2))
    broker = MemoryBroker()
    relay = RecurringRelay(FlakyStore(store, 3), broker, idle_interval=0.02)
    started = time.monotonic()
    await run_until(relay, lambda: len(broker.published) == 2)
    assert relay.storage_failures == 3
    # 0.5 s, 1 s, 2 s doubling with up to 50 % jitter: at least 1.75 s in total
    assert time.monotonic() - started >= 1.7


async def test_keyring_trouble_stops_the_loop(
    store: PostgresRecurringStore, pg_schema: tuple[str, str], clock: FakeClock
) -> None:
    dsn, schema = pg_schema
    await store.create(every_minute("a", 2))
    newer = Keyring(StorageKey("k2", b"\x08" * 32), StorageKey("k1", b"\x07" * 32))
    cfg = RecurringConfig("relay", 10, 60)
    async with await PostgresRecurringStore.connect(dsn, cfg, newer, clock, schema=schema) as s2:
        await s2.schedules()  # re-seals the binding under k2
    # the first store's keyring lacks k2: it fails closed, the loop stops
    relay = RecurringRelay(store, MemoryBroker(), idle_interval=0.02)
    with pytest.raises(RecurringConfigurationError) as info:
        await asyncio.wait_for(relay.run(asyncio.Event()), 10)
    assert isinstance(info.value.__cause__, UnknownKeyIdError)


async def test_graceful_shutdown_finishes_the_current_batch(
    store: PostgresRecurringStore,
) -> None:
    await store.create(every_minute("a", 10))
    started = asyncio.Event()

    class Slow(MemoryBroker):
        async def publish(
            self, message: ScheduledMessage, *, idempotency_key: str, timeout: float
        ) -> BrokerReceipt:
            started.set()
            await asyncio.sleep(0.3)
            return await super().publish(message, idempotency_key=idempotency_key, timeout=timeout)

    broker = Slow()
    stop = asyncio.Event()
    # The claimed batch is relayed at once (relay_many): the in-flight batch completes,
    # no new round claims more.
    relay = RecurringRelay(store, broker, claim_limit=4, idle_interval=0.02)
    task = asyncio.create_task(relay.run(stop))
    await started.wait()
    stop.set()
    async with asyncio.timeout(5):
        await task
    assert len(broker.published) == 4
    states = sorted(o.state.value for o in (await store.occurrences()).items)
    assert states.count("published") == 4
    assert states.count("pending") == 6


def test_relay_arguments_validated() -> None:
    for bad in ({"tick_budget": 0}, {"claim_limit": 101}, {"idle_interval": 0}):
        with pytest.raises(RecurringConfigurationError):
            RecurringRelay(None, MemoryBroker(), **bad)  # type: ignore[arg-type]


async def test_statistics_count_ticks_leases_receipts_duplicates_and_failures(
    store: PostgresRecurringStore, clock: FakeClock
) -> None:
    await store.create(every_minute("a", 5))
    broker = MemoryBroker()
    broker.lose_ack_next(1)  # stored, but the relay hears "uncertain": retried, then duplicate
    broker.fail_next(1)  # refused: retried, then published
    mine = RelayStatistics()
    relay = RecurringRelay(store, broker, idle_interval=0.02, statistics=mine)
    assert relay.statistics is mine

    def advanced() -> bool:
        clock.advance(timedelta(milliseconds=200))  # lets the 1 s backoff pass quickly
        return mine.published == 5

    await run_until(relay, advanced)
    assert mine.materialized == 5
    assert mine.ticks >= 1
    assert mine.ticks_skipped == 0
    assert mine.relay_failures == 2
    assert mine.duplicates == 1
    assert mine.claimed == mine.published + mine.relay_failures
    assert mine.storage_failures == 0
    assert len(broker.published) == 5  # the duplicate was not stored twice
    # the loop's own attributes read the same counters
    assert (relay.published, relay.failed, relay.storage_failures) == (5, 2, 0)


async def test_statistics_count_skipped_ticks_and_storage_failures(
    store: PostgresRecurringStore,
) -> None:
    await store.create(every_minute("a", 100))  # 100 due at once: over the quota of 60
    stats = RelayStatistics()
    relay = RecurringRelay(store, MemoryBroker(), tick_budget=100, statistics=stats)
    assert await relay.run_once() == 0
    assert (stats.ticks, stats.ticks_skipped, stats.materialized, stats.claimed) == (0, 1, 0, 0)

    flaky = RecurringRelay(FlakyStore(store, 1), MemoryBroker(), statistics=stats)
    stop = asyncio.Event()
    task = asyncio.create_task(flaky.run(stop))
    async with asyncio.timeout(10):
        while stats.storage_failures == 0:  # noqa: ASYNC110 - polls the counter under test
            await asyncio.sleep(0.01)
    stop.set()
    await asyncio.wait_for(task, 5)
    assert stats.storage_failures == 1  # shared: both relays add to the same counters


def test_statistics_are_exported_where_the_relay_is() -> None:
    import steeple.engine
    from steeple.postgres import RelayStatistics as from_package
    from steeple.postgres.recurring import RecurringRelay as relay_class
    from steeple.postgres.recurring import RelayStatistics as from_module
    from steeple.postgres.recurring._relay import RelayStatistics as from_old_path

    assert from_package is from_module is from_old_path is RelayStatistics
    assert steeple.engine.RelayStatistics is RelayStatistics  # one class, in the engine
    assert relay_class is RecurringRelay is steeple.engine.RecurringRelay
    assert RelayStatistics() == RelayStatistics(0, 0, 0, 0, 0, 0, 0, 0)
