"""A claim walks a queue's claim order from the claimer's position (schema 13).

The walk from a position skips the claim index's entries before it (the dead ones a held
vacuum horizon keeps among them), and work placed before the position (a higher priority,
a retry whose backoff ended) is still claimed within one poll interval: the claimer walks
from the front as ``steeple.core.claims.ClaimWalk`` says, which these tests drive with an
explicit clock.
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Sequence
from typing import Any

import asyncpg
import pytest

import queue_support
from queue_support import QueueFixture
from steeple.core.claims import ClaimPosition, ClaimWalk
from steeple.postgres.queue import EnqueueOptions, Health, JobContext, Scheduler, Task, enqueue
from steeple.postgres.queue._wakeups import Wakeups

pytestmark = pytest.mark.postgres

POLL = 1.0
wait_until = functools.partial(queue_support.wait_until, timeout=20.0)


async def _claim(
    conn: asyncpg.Connection, schema: str, want: int, after: ClaimPosition | None
) -> list[asyncpg.Record]:
    rows = await conn.fetch(
        f"SELECT * FROM \"{schema}\".claim(ARRAY['default'], ARRAY[$1::integer], ARRAY['t'],"
        " 'w', 4e9, ARRAY[$2::integer], ARRAY[$3::timestamptz], ARRAY[$4::bigint])",
        want,
        None if after is None else after.priority,
        None if after is None else after.run_at,
        None if after is None else after.id,
    )
    return [r for r in rows if r["id"] is not None]


def _places(rows: Sequence[asyncpg.Record]) -> list[ClaimPosition]:
    return [ClaimPosition(r["priority"], r["run_at"], r["id"]) for r in rows]


async def _round(
    conn: asyncpg.Connection, schema: str, walk: ClaimWalk, now: float, want: int
) -> tuple[ClaimWalk, list[int]]:
    start = walk.start(now, POLL)
    rows = await _claim(conn, schema, want, start)
    return walk.after(start, _places(rows), now), [r["id"] for r in rows]


async def _enqueue(conn: asyncpg.Connection, schema: str, priority: int) -> int:
    done = await enqueue(conn, Task("t"), {}, EnqueueOptions(priority=priority), schema=schema)
    return done.id


async def test_work_placed_before_the_position_is_claimed_within_one_poll_interval(
    queue: QueueFixture,
) -> None:
    _dsn, schema, conn = queue
    s = f'"{schema}"'
    retried = await _enqueue(conn, schema, 3)
    plain = [await _enqueue(conn, schema, 0) for _ in range(6)]

    walk, took = await _round(conn, schema, ClaimWalk(), 0.0, 1)
    assert took == [retried]
    # It fails and is retried after a backoff: pending again, due later.
    await conn.execute(
        f"UPDATE {s}.tasks SET state = 'pending', lease_token = NULL, lease_expires_at = NULL,"
        " worker_id = NULL, run_at = clock_timestamp() + interval '1 hour' WHERE id = $1",
        retried,
    )
    walk, took = await _round(conn, schema, walk, 0.1, 2)
    assert took == plain[:2]
    assert walk.position is not None
    assert walk.position.priority == 0
    # Behind the position now: work of a higher priority, and the retry whose backoff ended.
    urgent = await _enqueue(conn, schema, 5)
    await conn.execute(
        f"UPDATE {s}.tasks SET run_at = clock_timestamp() - interval '1 ms' WHERE id = $1",
        retried,
    )
    # Within the poll interval the claim walks on from its position ...
    walk, took = await _round(conn, schema, walk, 0.5, 2)
    assert took == plain[2:4]
    # ... and a poll interval after its last walk from the front, from the front: the
    # work placed before the position comes first, in claim order.
    walk, took = await _round(conn, schema, walk, 0.0 + POLL, 2)
    assert took == [urgent, retried]
    walk, took = await _round(conn, schema, walk, 1.1, 5)
    assert took == plain[4:]


async def _insert(conn: asyncpg.Connection, schema: str, count: int, priority: int) -> None:
    await conn.execute(
        f'INSERT INTO "{schema}".tasks (task_name, args, max_attempts, lease_duration,'
        " backoff_initial_us, backoff_maximum_us, backoff_factor, backoff_jitter, run_at,"
        " created_at, priority)"
        " SELECT 't', '{}', 3, interval '5 min', 1000000, 60000000, 2, 0.1,"
        " clock_timestamp() - interval '1 hour' + i * interval '1 ms',"
        " clock_timestamp() - interval '2 hours', $2"
        " FROM generate_series(1, $1::integer) AS i",
        count,
        priority,
    )


async def _walk_buffers(
    conn: asyncpg.Connection, schema: str, after: ClaimPosition | None
) -> tuple[int, int]:
    """Return the buffers one walk of 10 reads, and the tasks it took (rolled back)."""
    tx = conn.transaction()
    await tx.start()
    try:
        await conn.execute(
            "SET LOCAL enable_sort = off; SET LOCAL enable_bitmapscan = off;"
            " SET LOCAL enable_seqscan = off; SET LOCAL jit = off"
        )
        plan: Any = await conn.fetchval(
            f'EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) SELECT * FROM "{schema}".claim_walk('
            "'default', ARRAY['t'], 10, now(), $1::integer,"
            " $2::timestamptz, $3::bigint)",
            None if after is None else after.priority,
            None if after is None else after.run_at,
            None if after is None else after.id,
        )
    finally:
        await tx.rollback()
    top = (json.loads(plan) if isinstance(plan, str) else plan)[0]["Plan"]
    return top["Shared Hit Blocks"] + top["Shared Read Blocks"], top["Actual Rows"]


async def test_a_walk_from_the_position_skips_the_dead_entries_a_held_horizon_keeps(
    queue: QueueFixture,
) -> None:
    dsn, schema, conn = queue
    await _insert(conn, schema, 8_000, 1)
    await _insert(conn, schema, 100, 0)
    await conn.execute(f'VACUUM ANALYZE "{schema}".tasks')
    holder = await asyncpg.connect(dsn, server_settings={"application_name": "horizon holder"})
    try:
        # An idle transaction with an XID: no claimed task's pending version may go.
        await holder.execute("BEGIN")
        await holder.fetchval("SELECT txid_current()")
        walk = ClaimWalk()
        # Every task of priority 1 claimed: the next walk goes on at priority 0.
        for _ in range(16):
            start = walk.start(0.0, 3600.0)
            walk = walk.after(start, _places(await _claim(conn, schema, 500, start)), 0.0)
        assert walk.position is not None
        assert walk.position.priority == 1
        from_front, front_took = await _walk_buffers(conn, schema, None)
        from_position, position_took = await _walk_buffers(conn, schema, walk.position)
    finally:
        await holder.close()
    assert front_took == position_took == 10
    # The front's walk visits the 8,000 claimed tasks' dead entries (a heap page per run
    # of them); the position's starts after them, in the next priority.
    assert from_front > 100
    assert from_position * 5 < from_front, (from_position, from_front)


async def test_a_worker_claims_work_placed_before_its_position_without_waiting_for_a_poll(
    queue: QueueFixture,
) -> None:
    dsn, schema, conn = queue
    ran: list[int] = []

    async def handler(ctx: JobContext, args: Any) -> None:
        ran.append(ctx.task_id)

    # Polls an hour apart: only wake-ups (NOTIFY) and the claim rule bring work in.
    worker = Scheduler(dsn, worker_id="w", schema=schema, poll_interval=3600.0, concurrency=4)
    worker.register(Task("t"), handler)
    stop = asyncio.Event()
    run = asyncio.create_task(worker.run_until_shutdown(stop, drain_timeout=10))
    try:
        await wait_until(lambda: worker.health() is not Health.STARTING or run.done())
        first = await _enqueue(conn, schema, 0)
        await wait_until(lambda: ran == [first] or run.done())
        # Behind the worker's position (a higher priority): its wake-up's walk from the
        # position finds nothing, so the next claim walks from the front at once.
        urgent = await _enqueue(conn, schema, 5)
        await wait_until(lambda: ran == [first, urgent] or run.done())
        assert not run.done()
    finally:
        stop.set()
        await asyncio.wait_for(run, 30)


async def test_a_walk_from_the_position_that_finds_nothing_is_followed_at_once_from_the_front(
    queue: QueueFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    dsn, schema, conn = queue
    ran: list[int] = []
    wakeups: list[Wakeups] = []
    init = Wakeups.__init__

    def kept(self: Wakeups, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        wakeups.append(self)

    monkeypatch.setattr(Wakeups, "__init__", kept)

    async def handler(ctx: JobContext, args: Any) -> None:
        ran.append(ctx.task_id)

    # No NOTIFY, no maintenance pass, polls an hour apart: the one wake-up the test gives
    # is all that starts a claim, so nothing but the claim rule can bring in what follows.
    worker = Scheduler(
        dsn,
        worker_id="w",
        schema=schema,
        poll_interval=3600.0,
        maintenance_interval=3600,
        listen=False,
        concurrency=4,
    )
    worker.register(Task("t"), handler)
    stop = asyncio.Event()
    run = asyncio.create_task(worker.run_until_shutdown(stop, drain_timeout=10))
    try:
        await wait_until(lambda: worker.stats.idle_waits >= 1 or run.done())
        first = await _enqueue(conn, schema, 0)
        wakeups[0].wake.set()
        await wait_until(lambda: (ran == [first] and worker.stats.idle_waits >= 2) or run.done())
        # Behind the worker's position (a higher priority): the woken claim walks from the
        # position and finds nothing; the next walks from the front without another wake-up.
        urgent = await _enqueue(conn, schema, 5)
        wakeups[0].wake.set()
        await wait_until(lambda: ran == [first, urgent] or run.done())
        assert not run.done()
    finally:
        stop.set()
        await asyncio.wait_for(run, 30)


def test_each_queues_next_walk_starts_after_the_last_task_its_claim_took() -> None:
    """The claim answers in no particular order: the position kept per queue is the task
    last in claim order (lowest priority, latest due, then highest id), whatever the order
    of the rows."""
    import random
    import types
    from datetime import UTC, datetime, timedelta

    from steeple.postgres.queue._claiming import Claimer

    due = datetime(2031, 3, 8, 12, 0, tzinfo=UTC)
    taken = {
        "a": [ClaimPosition(p, due + timedelta(seconds=s), i)
              for i, (p, s) in enumerate([(5, 0), (5, 3), (1, 0), (1, 2), (1, 2)], start=10)],
        "b": [ClaimPosition(0, due, 7), ClaimPosition(0, due, 3)],
    }  # fmt: skip
    rows: list[tuple[Any, ...]] = []
    for queue, positions in taken.items():
        for p in positions:
            row: list[Any] = [None] * 18
            row[0], row[12], row[15], row[17] = p.id, p.run_at, queue, p.priority
            rows.append(tuple(row))
    for seed in range(5):
        random.Random(seed).shuffle(rows)
        holder: Any = types.SimpleNamespace(_walks={})
        walks = Claimer._walks_after(holder, ["a", "b", "c"], [None] * 3, rows, 1.0, held=False)
        assert walks["a"].position == ClaimPosition(1, due + timedelta(seconds=2), 14)
        assert walks["b"].position == ClaimPosition(0, due, 7)
        assert walks["c"].position is None
        assert not walks["c"].owed
