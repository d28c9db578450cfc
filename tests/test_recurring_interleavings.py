"""Concurrency specs of the recurring store's transactions: two sessions, explicit orders.

Two stores (two pools, two sessions) on one namespace. Operation A is paused at its k-th
suspension point (between two of its statements, its transaction open, see
``suspensions.Paused``); operation B then runs until it completes or its backend waits on
a lock (``pg_blocking_pids``); then A goes on and both finish. For every k until A
completes before reaching k, for tick x tick, claim x claim, tick x claim and
claim_and_relay x claim_and_relay, the result is one the model allows: the two
operations' effects add up exactly (no occurrence materialized, leased or published
twice, nothing lost), the tick cursor and the namespace's counter agree with the rows,
and no call fails.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Coroutine
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import pytest

from steeple.core import MissedRunPolicy, RecurringConfig, RecurringDefinition, ScheduledMessage
from steeple.keyring import Keyring, StorageKey
from steeple.postgres import PostgresRecurringStore
from steeple.testing import FakeClock, MemoryBroker
from suspensions import Paused

pytestmark = [pytest.mark.postgres]

START = datetime(2031, 3, 4, 5, 6, 7, tzinfo=UTC)
KEYRING = Keyring(StorageKey("k1", b"\x0e" * 32))
CONFIG = RecurringConfig("interleave", 20, 5000, lease_duration=timedelta(minutes=5))


class Pair:
    """Two stores on one namespace, and the rows as the model sees them."""

    def __init__(self, dsn: str, schema: str, a: PostgresRecurringStore, b: PostgresRecurringStore):
        self.dsn = dsn
        self.schema = schema
        self.a = a
        self.b = b

    async def counts(self) -> dict[str, int]:
        conn = await asyncpg.connect(self.dsn, timeout=10)
        s = f'"{self.schema}"'
        try:
            rows = await conn.fetch(
                f"SELECT state, count(*) AS n FROM {s}.recurring_occurrences GROUP BY state"
            )
            counter = await conn.fetchval(f"SELECT occurrence_count FROM {s}.recurring_namespaces")
            cursor_ok = await conn.fetchval(
                f"SELECT bool_and(ok) FROM (SELECT d.cursor_at = "
                f"coalesce(max(o.due_at), d.first_after) AS ok FROM {s}.recurring_definitions d "
                f"LEFT JOIN {s}.recurring_occurrences o ON o.definition_name = d.name "
                "GROUP BY d.name, d.cursor_at, d.first_after) per_definition"
            )
        finally:
            await conn.close()
        by_state = {r["state"]: r["n"] for r in rows}
        assert counter == sum(by_state.values()), (counter, by_state)
        assert cursor_ok, "the tick cursor and the stored occurrences disagree"
        return by_state

    async def b_is_waiting(self, watcher: asyncpg.Connection) -> bool:
        pool: Any = self.b._pool
        pids = [
            h._con.get_server_pid()
            for h in pool._holders
            if h._con is not None and not h._con.is_closed()
        ]
        waiting: int = await watcher.fetchval(
            "SELECT count(*) FROM unnest($1::int[]) AS p(pid) "
            "WHERE cardinality(pg_blocking_pids(pid)) > 0",
            pids,
        )
        return waiting > 0


@pytest.fixture
async def pair(pg_schema: tuple[str, str]) -> AsyncIterator[Pair]:
    dsn, schema = pg_schema
    clock = FakeClock(START)
    a = await PostgresRecurringStore.initialize(dsn, CONFIG, KEYRING, clock, schema=schema)
    b = await PostgresRecurringStore.connect(dsn, CONFIG, KEYRING, clock, schema=schema)
    async with a, b:
        for name in ("x", "y"):
            await a.create(
                RecurringDefinition(
                    name,
                    "* * * * *",
                    START - timedelta(minutes=400),
                    MissedRunPolicy.CATCH_UP,
                    ScheduledMessage("inter", "leave", name.encode()),
                )
            )
        yield Pair(dsn, schema, a, b)


Op = Callable[[PostgresRecurringStore], Coroutine[Any, Any, Any]]


async def _interleave(
    pair: Pair, op_a: Op, op_b: Op, check: Callable[[Any, Any], Any]
) -> tuple[int, int]:
    """Run A paused at k and B in between, for every k.

    Returns how many orders ran and in how many B waited for A's lock.
    """
    watcher = await asyncpg.connect(pair.dsn, timeout=10)
    waited = 0
    try:
        for k in range(1, 500):
            first = Paused(k, lambda: op_a(pair.a))
            reached = await first.reached()
            second = asyncio.create_task(op_b(pair.b))
            try:
                async with asyncio.timeout(20):
                    while not second.done():
                        if await pair.b_is_waiting(watcher):
                            waited += 1
                            break
                        await asyncio.sleep(0.002)
            finally:
                first.release()
            async with asyncio.timeout(30):
                result_a = await first.task
                result_b = await second
            await check(result_a, result_b)
            if not reached:
                return k, waited
    finally:
        await watcher.close()
    raise AssertionError("A never completed")


async def test_two_ticks_interleaved_at_every_step_add_up(pair: Pair) -> None:
    async def check(a: Any, b: Any) -> None:
        stored = sum((await pair.counts()).values())
        check.total += a.materialized + b.materialized  # type: ignore[attr-defined]
        assert stored == check.total  # type: ignore[attr-defined]
        assert a.materialized == 3  # the backlog is long: each tick takes its whole budget
        assert b.materialized == 3

    check.total = 0  # type: ignore[attr-defined]
    orders, waited = await _interleave(pair, lambda s: s.tick(3), lambda s: s.tick(3), check)
    assert orders >= 5
    assert waited >= 1  # A held the namespace's control row while B asked for it


async def test_two_claims_interleaved_at_every_step_never_share_an_occurrence(pair: Pair) -> None:
    await pair.a.tick(20)
    await pair.a.tick(20)
    await pair.a.tick(20)

    async def check(a: Any, b: Any) -> None:
        ids_a = {lease.occurrence_id for lease in a}
        ids_b = {lease.occurrence_id for lease in b}
        assert not ids_a & ids_b
        leased = (await pair.counts()).get("leased", 0)
        check.total += len(ids_a) + len(ids_b)  # type: ignore[attr-defined]
        assert leased == check.total  # type: ignore[attr-defined]
        assert len(ids_a) == len(ids_b) == 2

    check.total = 0  # type: ignore[attr-defined]
    orders, waited = await _interleave(pair, lambda s: s.claim(2), lambda s: s.claim(2), check)
    assert orders >= 5
    assert waited >= 1


async def test_a_tick_and_a_claim_interleaved_at_every_step(pair: Pair) -> None:
    await pair.a.tick(20)
    seen = {"stored": sum((await pair.counts()).values()), "leased": 0}

    async def check(a: Any, b: Any) -> None:
        counts = await pair.counts()
        assert sum(counts.values()) == seen["stored"] + a.materialized
        assert counts.get("leased", 0) == seen["leased"] + len(b)
        seen.update(stored=sum(counts.values()), leased=counts.get("leased", 0))

    _, waited = await _interleave(pair, lambda s: s.tick(3), lambda s: s.claim(1), check)
    assert waited >= 1


async def test_two_batched_relays_interleaved_at_every_step_publish_once(pair: Pair) -> None:
    for _ in range(4):
        await pair.a.tick(20)
    broker = MemoryBroker()

    async def check(a: Any, b: Any) -> None:
        ids = [o.occurrence_id for o in [*a, *b]]
        assert len(ids) == len(set(ids))
        assert all(o.error is None for o in [*a, *b]), [*a, *b]
        keys = [key for _, key in broker.published]
        assert len(keys) == len(set(keys))
        assert (await pair.counts()).get("published", 0) == len(keys)

    _, waited = await _interleave(
        pair,
        lambda s: s.claim_and_relay(2, broker),
        lambda s: s.claim_and_relay(2, broker),
        check,
    )
    assert waited >= 1
