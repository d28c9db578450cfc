"""Successes written and the next tasks claimed in one call (``complete_and_claim``).

A worker whose last claim a limit held writes its buffered successes in its next claim's
transaction, before the claim: the claim counts the slots they freed. The fence is the
plain completion's: only a success whose lease token still matches moves its task,
records its attempt and releases its dependents; the commit stays durable.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import asyncpg
import pytest

from queue_support import QueueFixture, wait_until
from steeple.postgres._arrays import array_literal, text_array
from steeple.postgres.queue import Scheduler, Task, _claiming, enqueue, enqueue_many, limit_queue
from steeple.postgres.queue._completions import Completions
from steeple.postgres.queue._sql import queue_sql

NAMES = ["parent", "child", "job"]


async def _combined(
    conn: asyncpg.Connection, schema: str, done: list[tuple[int, Any]], want: int
) -> tuple[list[int], list[int], bool]:
    """Complete ``done`` (id, token) and claim up to ``want``: (claimed, succeeded, held)."""
    give_up = await conn.fetchval(
        "SELECT extract(epoch FROM clock_timestamp())::double precision + 60"
    )
    rows = await conn.fetch(
        queue_sql(schema).complete_and_claim,
        array_literal([i for i, _ in done]),
        array_literal([t for _, t in done]),
        None,
        None,
        ["default"],
        text_array([want]),
        NAMES,
        "w",
        give_up,
        *([None],) * 3,
    )
    claimed = [r[1] for r in rows if r[1] is not None]
    held = any(r[1] is None and r[17] for r in rows)
    [succeeded] = [r[19] for r in rows if r[19] is not None]
    return claimed, list(succeeded), held


async def _claim(conn: asyncpg.Connection, schema: str, name: str, n: int) -> list[Any]:
    give_up = await conn.fetchval(
        "SELECT extract(epoch FROM clock_timestamp())::double precision + 60"
    )
    rows = await conn.fetch(queue_sql(schema).claim, [name], n, "w", give_up)
    return [(r["id"], r["lease_token"]) for r in rows]


async def _state(conn: asyncpg.Connection, schema: str, task_id: int) -> str:
    return str(await conn.fetchval(f'SELECT state FROM "{schema}".tasks WHERE id = $1', task_id))


async def test_a_stale_success_moves_nothing_and_releases_no_dependent(
    queue: QueueFixture,
) -> None:
    _, schema, conn = queue
    parent = (await enqueue(conn, Task("parent"), {}, schema=schema)).id
    child = (await enqueue(conn, Task("child"), {}, schema=schema, after=[parent])).id
    [(claimed, token)] = await _claim(conn, schema, "parent", 1)
    assert claimed == parent

    taken, succeeded, _ = await _combined(conn, schema, [(parent, uuid.uuid4())], 5)
    assert (taken, succeeded) == ([], [])
    assert await _state(conn, schema, parent) == "running"
    assert await _state(conn, schema, child) == "waiting"
    history = f'SELECT count(*) FROM "{schema}".attempts WHERE task_id = $1'
    assert await conn.fetchval(history, parent) == 0

    # The holder's success moves it, records the attempt, and the claim after it in the
    # same call takes the dependent it released.
    taken, succeeded, _ = await _combined(conn, schema, [(parent, token)], 5)
    assert (taken, succeeded) == ([child], [parent])
    assert await _state(conn, schema, parent) == "succeeded"
    assert await conn.fetchval(history, parent) == 1


async def test_the_claim_counts_the_slots_its_successes_freed_and_no_more(
    queue: QueueFixture,
) -> None:
    _, schema, conn = queue
    await limit_queue(conn, "default", max_running=2, schema=schema)
    ids = await enqueue_many(conn, Task("job"), [{}] * 6, schema=schema)
    first, second = await _claim(conn, schema, "job", 5)
    # A stale success frees no slot: the limit still holds with both running.
    assert await _combined(conn, schema, [(first[0], uuid.uuid4())], 5) == ([], [], True)
    # One success frees one slot: the claim in the same call takes one task, not more.
    taken, succeeded, held = await _combined(conn, schema, [first], 5)
    assert (len(taken), succeeded, held) == (1, [first[0]], True)
    running = f"SELECT count(*) FROM \"{schema}\".tasks WHERE state = 'running'"
    assert await conn.fetchval(running) == 2
    assert set(taken) < set(ids) - {first[0], second[0]}


async def test_the_combined_call_commits_durably(queue: QueueFixture) -> None:
    _, schema, conn = queue
    await enqueue(conn, Task("job"), {}, schema=schema)
    [done] = await _claim(conn, schema, "job", 1)
    await enqueue(conn, Task("job"), {}, schema=schema)
    async with conn.transaction():
        taken, succeeded, _ = await _combined(conn, schema, [done], 5)
        assert (len(taken), succeeded) == (1, [done[0]])
        # The claim alone commits asynchronously; with a success in it, never.
        assert await conn.fetchval("SHOW synchronous_commit") == "on"


async def test_a_worker_under_a_limit_never_runs_more_than_it(
    queue: QueueFixture,
) -> None:
    dsn, schema, conn = queue
    await limit_queue(conn, "default", max_running=3, schema=schema)
    await enqueue_many(conn, Task("job"), [{}] * 60, schema=schema)
    seen: list[int] = []
    running = 0
    most = 0

    async def handler(ctx: Any, args: Any) -> None:
        nonlocal running, most
        running += 1
        most = max(most, running)
        await asyncio.sleep(0)
        running -= 1

    worker = Scheduler(dsn, schema=schema, worker_id="limited", concurrency=20, poll_interval=0.05)
    worker.register(Task("job"), handler)
    stop = asyncio.Event()
    watch = asyncio.create_task(_watch_running(dsn, schema, seen))
    run = asyncio.create_task(worker.run_until_shutdown(stop))
    try:
        await wait_until(lambda: worker.stats.succeeded == 60, timeout=60)
    finally:
        stop.set()
        await run
        watch.cancel()
    assert most <= 3
    assert seen
    assert max(seen) <= 3
    history = f"SELECT count(*) FROM \"{schema}\".attempts WHERE outcome = 'succeeded'"
    assert await conn.fetchval(history) == 60


async def _watch_running(dsn: str, schema: str, seen: list[int]) -> None:
    """Append how many tasks run, as the database says, until cancelled."""
    conn = await asyncpg.connect(dsn)
    try:
        while True:
            seen.append(
                await conn.fetchval(
                    f"SELECT count(*) FROM \"{schema}\".tasks WHERE state = 'running'"
                )
            )
    finally:
        await conn.close()


async def test_a_stale_success_a_worker_carries_with_its_claim_is_refused(
    queue: QueueFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    dsn, schema, conn = queue
    await limit_queue(conn, "default", max_running=1, schema=schema)
    first, _ = await enqueue_many(conn, Task("job"), [{}, {}], schema=schema)
    carried: list[int] = []
    write = _claiming._complete_and_claim

    async def counted(env: Any, batch: list[Any], *claim: object) -> Any:
        carried.extend(c.ctx.task_id for c in batch)
        return await write(env, batch, *claim)

    monkeypatch.setattr(_claiming, "_complete_and_claim", counted)
    outcomes: list[Completions] = []
    carry = Completions.carry

    def seen(self: Completions, on: bool) -> None:
        outcomes.append(self)
        carry(self, on)

    monkeypatch.setattr(Completions, "carry", seen)
    started = asyncio.Event()
    go = asyncio.Event()

    async def handler(ctx: Any, args: Any) -> None:
        started.set()
        await go.wait()

    # A long poll, no NOTIFY and no maintenance pass: nothing but its own outcome wakes the
    # waiting claim loop, so the success rides on the next claim (the path under test).
    worker = Scheduler(
        dsn,
        schema=schema,
        worker_id="carrier",
        concurrency=4,
        poll_interval=60,
        maintenance_interval=3600,
        listen=False,
    )
    worker.register(Task("job"), handler)
    stop = asyncio.Event()
    run = asyncio.create_task(worker.run_until_shutdown(stop))
    try:
        await wait_until(started.is_set)
        # The claim loop waits for a slot, carrying what succeeds with its next claim.
        await wait_until(lambda: worker.stats.idle_waits >= 1 and outcomes[-1].carrier)
        # Another holder took the task over: this worker's success is stale.
        await conn.execute(
            f'UPDATE "{schema}".tasks SET lease_token = gen_random_uuid() WHERE id = $1', first
        )
        go.set()
        await wait_until(lambda: worker.stats.rejected_completions == 1)
    finally:
        stop.set()
        await run
    assert carried == [first]
    assert await _state(conn, schema, first) == "running"
    history = f'SELECT count(*) FROM "{schema}".attempts WHERE task_id = $1'
    assert await conn.fetchval(history, first) == 0
    assert worker.stats.succeeded == 0
