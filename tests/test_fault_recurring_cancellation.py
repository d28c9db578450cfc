"""CancelledError injected at the awaits of tick, claim and relay (RELIABILITY.md row 15).

Each call is cancelled after a spread of delays, through a proxy that adds a little
latency so cancellations land at different awaits (acquire, BEGIN, lock, statements,
COMMIT). After each: the step is wholly done or not done, and none of the store's
backends is left idle in a transaction or holding a lock.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import pytest

import faultprobe
from faultproxy import FaultProxy
from recurring_fault_support import store_behind_proxy
from steeple.core import (
    MissedRunPolicy,
    OccurrenceState,
    RecurringConfig,
    RecurringDefinition,
    ScheduledMessage,
)
from steeple.core.idempotency import PUBLISH_PURPOSE, idempotency_key
from steeple.core.records import Lease
from steeple.keyring import Keyring, StorageKey
from steeple.postgres import PostgresRecurringStore
from steeple.testing import FakeClock, MemoryBroker

pytestmark = [pytest.mark.postgres]

START = datetime(2031, 3, 4, 5, 6, 7, tzinfo=UTC)
KEYRING = Keyring(StorageKey("k1", b"\x08" * 32))
CONFIG = RecurringConfig("cancels", 20, 5000)
DELAYS = [0.0, 0.001, 0.002, 0.005, 0.01, 0.02, 0.035, 0.05, 0.08, 0.12, 0.2, 0.35, 0.6, 1.0]


class World:
    def __init__(
        self,
        dsn: str,
        schema: str,
        proxy: FaultProxy,
        clock: FakeClock,
        store: PostgresRecurringStore,
    ) -> None:
        self.dsn, self.schema, self.proxy, self.clock, self.store = (
            dsn,
            schema,
            proxy,
            clock,
            store,
        )

    async def counts(self) -> dict[str, int]:
        """Occurrences by state, checking the namespace's counter against the rows."""
        conn = await asyncpg.connect(self.dsn, timeout=10)
        try:
            rows = await conn.fetch(
                f'SELECT state, count(*) AS n FROM "{self.schema}".recurring_occurrences'
                " GROUP BY state"
            )
            counter = await conn.fetchval(
                f'SELECT occurrence_count FROM "{self.schema}".recurring_namespaces'
            )
        finally:
            await conn.close()
        by_state = {r["state"]: r["n"] for r in rows}
        assert counter == sum(by_state.values())
        return by_state

    async def clean(self) -> None:
        await faultprobe.wait_for_clean(self.dsn, self.proxy.backend_pids, timeout=3.0)


@pytest.fixture
async def world(pg_schema: tuple[str, str], fault_proxy: FaultProxy) -> AsyncIterator[World]:
    dsn, schema = pg_schema
    clock = FakeClock(START)
    async with store_behind_proxy(dsn, schema, fault_proxy, CONFIG, KEYRING, clock) as store:
        # a little latency spreads the cancellations over the transaction's awaits
        fault_proxy.delay(0.002)
        yield World(dsn, schema, fault_proxy, clock, store)


async def cancel_after(coro: Any, delay: float) -> Any:
    """Run ``coro``, cancel it after ``delay`` s; return its result, or None if cancelled."""
    task = asyncio.ensure_future(coro)
    await asyncio.sleep(delay)
    task.cancel()
    try:
        async with asyncio.timeout(15):
            return await task
    except asyncio.CancelledError:
        return None


def definition(name: str, minutes_back: int) -> RecurringDefinition:
    return RecurringDefinition(
        name,
        "* * * * *",
        START - timedelta(minutes=minutes_back),
        MissedRunPolicy.CATCH_UP,
        ScheduledMessage("cancels", "cancel.tested", name.encode()),
    )


async def test_cancelled_ticks_are_all_or_nothing(world: World) -> None:
    store = world.store
    await store.create(definition("a", 200))
    total = 0
    outcomes: list[str] = []
    for delay in DELAYS:
        result = await cancel_after(store.tick(20), delay)
        counts = await world.counts()
        stored = sum(counts.values())
        # this tick added its whole batch of 20 or nothing
        assert stored - total in (0, 20), (delay, stored, total)
        if result is not None:
            assert result.materialized == 20
            assert stored - total == 20
        outcomes.append("done" if stored > total else "not done")
        total = stored
        await world.clean()
    # the cancellations landed inside calls, and the longer delays let calls finish
    assert "not done" in outcomes
    assert "done" in outcomes
    # the cursor moved exactly as far as what was stored: the rest follows, no gap, no
    # duplicate
    while (result := await store.tick(100)).materialized:
        total += result.materialized
    assert total == 200
    conn = await asyncpg.connect(world.dsn, timeout=10)
    try:
        distinct = await conn.fetchval(
            f'SELECT count(DISTINCT due_at) FROM "{world.schema}".recurring_occurrences'
        )
    finally:
        await conn.close()
    assert distinct == 200


async def test_cancelled_claims_are_all_or_nothing(world: World) -> None:
    store = world.store
    await store.create(definition("a", 100))
    assert (await store.tick(100)).materialized == 100
    leased = 0
    outcomes: list[str] = []
    for delay in DELAYS:
        result = await cancel_after(store.claim(5), delay)
        now_leased = (await world.counts()).get("leased", 0)
        assert now_leased - leased in (0, 5), (delay, now_leased, leased)
        if result is not None:
            assert len(result) == 5
            assert now_leased - leased == 5
        outcomes.append("done" if now_leased > leased else "not done")
        leased = now_leased
        await world.clean()
    assert "not done" in outcomes
    assert "done" in outcomes
    # leases lost to a cancellation lapse and are claimed again, with a new revision
    world.clock.advance(timedelta(seconds=61))
    reclaimed = await store.claim(100)
    assert len(reclaimed) == 100
    assert sum(1 for lease in reclaimed if lease.revision == 2) == leased


async def test_cancelled_relays_publish_each_occurrence_under_one_key(world: World) -> None:
    store, clock = world.store, world.clock
    await store.create(definition("a", 40))
    assert (await store.tick(100)).materialized == 40
    broker = MemoryBroker(delay=0.003)
    interrupted = 0
    pending: list[Lease] = await store.claim(len(DELAYS) * 2)
    for i, lease in enumerate(pending):
        delay = DELAYS[i % len(DELAYS)]
        result = await cancel_after(store.relay(lease, broker), delay)
        if result is None:
            interrupted += 1
        state = OccurrenceState((await occurrence(world, lease.occurrence_id))["state"])
        # the outcome is recorded whole or not at all: still leased, or published with
        # the message in the broker
        assert state in (OccurrenceState.LEASED, OccurrenceState.PUBLISHED), state
        if result is not None:
            assert state is OccurrenceState.PUBLISHED
        if state is OccurrenceState.PUBLISHED:
            row = await occurrence(world, lease.occurrence_id)
            assert expected_key(row) in {key for _, key in broker.published}
        await world.clean()
    assert 0 < interrupted < len(pending)
    # every interrupted lease lapses; the work completes with one copy per key
    clock.advance(timedelta(seconds=61))
    broker.delay = 0
    while leases := await store.claim(100):
        for lease in leases:
            await store.relay(lease, broker)
    counts = await world.counts()
    assert counts == {"published": 40}
    keys = [key for _, key in broker.published]
    assert len(keys) == len(set(keys)) == 40
    # each occurrence under its own key, the same key at every attempt
    expected = {expected_key(r) for r in await all_occurrences(world)}
    assert set(keys) == expected
    assert set(broker.keys_attempted) == expected
    # and the pool is whole: calls at once all succeed
    pages = await asyncio.gather(*(store.schedules() for _ in range(8)))
    assert all(len(p.items) == 1 for p in pages)


async def occurrence(world: World, occurrence_id: str) -> asyncpg.Record:
    conn = await asyncpg.connect(world.dsn, timeout=10)
    try:
        row = await conn.fetchrow(
            f'SELECT * FROM "{world.schema}".recurring_occurrences WHERE id = $1', occurrence_id
        )
    finally:
        await conn.close()
    assert row is not None
    return row


async def all_occurrences(world: World) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(world.dsn, timeout=10)
    try:
        return list(
            await conn.fetch(
                f'SELECT id, definition_name, due_at FROM "{world.schema}".recurring_occurrences'
            )
        )
    finally:
        await conn.close()


def expected_key(row: asyncpg.Record) -> str:
    """The idempotency key an occurrence must always be published under."""
    return idempotency_key(
        purpose=PUBLISH_PURPOSE,
        namespace=CONFIG.namespace,
        definition_name=row["definition_name"],
        due_at=row["due_at"],
        generation=bytes.fromhex(row["id"]),
    )


async def test_cancelled_calls_never_break_the_store(world: World) -> None:
    """A storm of cancellations at random points, then every kind of call still works."""
    store = world.store
    await store.create(definition("a", 30))
    for delay in DELAYS[:10]:
        for call in (store.tick(3), store.claim(2), store.schedules(), store.occurrences()):
            await cancel_after(call, delay)
    await world.clean()
    await store.tick(100)
    assert sum((await world.counts()).values()) == 30
