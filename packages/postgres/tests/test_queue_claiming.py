"""What a worker claims: only what it can start, and free slots that follow demand.

A worker claims no more sync tasks than it has free threads, and hands back (pending,
attempt refunded) a claimed sync task that gets no thread in time, so an idle worker runs
it. A worker serving several queues gives the slots of a queue that answered short (empty,
paused) to the others at once: an extra idle queue costs no poll waits and few rounds.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import pytest

from queue_support import QueueFixture, wait_until
from steeple.postgres.queue import (
    EnqueueOptions,
    JobContext,
    Scheduler,
    Task,
    enqueue,
    enqueue_many,
    pause_queue,
    run_state,
)
from steeple.postgres.queue._claiming import _share_out, _ThreadGate

SYNC: Task[Any] = Task("claiming-sync")
ASYNC: Task[Any] = Task("claiming-async")
NOOP: Task[Any] = Task("claiming-noop")


def _worker(dsn: str, schema: str, worker_id: str, **kw: Any) -> Scheduler:
    kw.setdefault("poll_interval", 0.05)
    kw.setdefault("maintenance_interval", 0.05)
    return Scheduler(dsn, worker_id=worker_id, schema=schema, **kw)


@contextlib.asynccontextmanager
async def _running(worker: Scheduler, drain_timeout: float = 10.0) -> AsyncIterator[asyncio.Event]:
    stop = asyncio.Event()
    run = asyncio.create_task(worker.run_until_shutdown(stop, drain_timeout=drain_timeout))
    try:
        await wait_until(lambda: worker.stats.claim_rounds > 0 or run.done())
        if run.done():
            run.result()
        yield stop
    finally:
        stop.set()
        await asyncio.wait_for(run, 30)


async def _states(conn: Any, schema: str) -> dict[str, int]:
    rows = await conn.fetch(f'SELECT state, count(*) FROM "{schema}".tasks GROUP BY 1')
    return {r[0]: r[1] for r in rows}


# --- a worker claims only what it can start -------------------------------------------------


async def test_a_worker_whose_one_thread_is_stuck_leaves_queued_sync_tasks_to_an_idle_one(
    queue: QueueFixture,
) -> None:
    """Before: worker A (threads=1, a stuck handler) claimed the queued tasks and renewed
    their leases forever without starting them; idle worker B got none."""
    dsn, schema, conn = queue
    stuck = threading.Event()
    release = threading.Event()
    ran_by: dict[int, str] = {}

    def handle(ctx: JobContext, args: Any) -> None:
        if args == "stuck":
            stuck.set()
            release.wait(60)
            return
        ran_by[ctx.task_id] = ctx.worker_id

    held = await enqueue(conn, SYNC, "stuck", schema=schema)
    a = _worker(dsn, schema, "a", threads=1, concurrency=16)
    a.register(SYNC, handle)
    try:
        async with _running(a):
            await wait_until(stuck.is_set)
            queued = await enqueue_many(conn, SYNC, [i for i in range(5)], schema=schema)
            b = _worker(dsn, schema, "b")
            b.register(SYNC, handle)
            async with _running(b):
                await wait_until(lambda: len(ran_by) == 5)
                await wait_until(lambda: b.stats.succeeded == 5)
            assert ran_by == {task_id: "b" for task_id in queued}
            # A claimed only the task it could start, and kept only that lease.
            assert (a.stats.claimed, a.stats.not_started) == (1, 0)
            assert (await run_state(conn, held.id, schema=schema)).state.value == "running"
            release.set()
            await wait_until(lambda: a.stats.succeeded == 1)
    finally:
        release.set()
    for task_id in queued:
        run = await run_state(conn, task_id, schema=schema)
        assert (run.state.value, run.attempts, run.worker_id) == ("succeeded", 1, "b")


async def test_a_sync_task_that_gets_no_thread_in_time_is_handed_back_without_an_attempt(
    queue: QueueFixture,
) -> None:
    """Before: the second sync task waited for the worker's one thread (stuck) while the
    worker renewed its lease forever; no other worker could run it."""
    dsn, schema, conn = queue
    stuck = threading.Event()
    release = threading.Event()
    ran_by: dict[int, str] = {}

    def handle(ctx: JobContext, args: Any) -> None:
        if args == "stuck":
            stuck.set()
            release.wait(60)
            return
        ran_by[ctx.task_id] = ctx.worker_id

    async def handle_async(ctx: JobContext, args: Any) -> None:
        ran_by[ctx.task_id] = ctx.worker_id

    # A 1 s lease: a task with no thread is handed back after a quarter of it.
    short = EnqueueOptions(lease_duration=timedelta(seconds=1))
    held = await enqueue(conn, SYNC, "stuck", short, schema=schema)
    waiting = await enqueue(conn, SYNC, "second", short, schema=schema)
    # With an async handler registered the worker claims beyond its threads (it cannot
    # tell the task names before claiming): both sync tasks come in one claim.
    a = _worker(dsn, schema, "a", threads=1, concurrency=4)
    a.register(SYNC, handle)
    a.register(ASYNC, handle_async)
    try:
        async with _running(a):
            await wait_until(stuck.is_set)
            await wait_until(lambda: a.stats.not_started == 1)
            assert a.stats.claimed == 2
            run = await run_state(conn, waiting.id, schema=schema)
            assert (run.state.value, run.attempts) == ("pending", 0)
            assert [(h.outcome, h.worker_id) for h in run.history] == [("released", "a")]
            # While its thread is taken, A still claims and runs what runs on its loop,
            # and leaves the sync task it cannot start to others.
            on_loop = await enqueue(conn, ASYNC, None, schema=schema)
            await wait_until(lambda: on_loop.id in ran_by)
            assert ran_by[on_loop.id] == "a"
            rounds = a.stats.claim_rounds
            await wait_until(lambda: a.stats.claim_rounds >= rounds + 3)
            assert (await run_state(conn, waiting.id, schema=schema)).state.value == "pending"
            b = _worker(dsn, schema, "b")
            b.register(SYNC, handle)
            b.register(ASYNC, handle_async)
            async with _running(b):
                await wait_until(lambda: waiting.id in ran_by)
                await wait_until(lambda: b.stats.succeeded == 1)
            assert ran_by[waiting.id] == "b"
            assert (await run_state(conn, held.id, schema=schema)).state.value == "running"
            release.set()
            await wait_until(lambda: a.stats.succeeded == 2)
    finally:
        release.set()
    run = await run_state(conn, waiting.id, schema=schema)
    # The hand-back cost no attempt: the run by B is its first.
    assert (run.state.value, run.attempts) == ("succeeded", 1)
    assert [(h.attempt, h.outcome, h.worker_id) for h in run.history] == [
        (1, "released", "a"),
        (1, "succeeded", "b"),
    ]
    assert a.stats.released == 1


async def test_a_stopping_worker_hands_back_at_once_the_sync_tasks_it_has_not_started(
    queue: QueueFixture,
) -> None:
    """Before: the unstarted task waited through the drain for the stuck thread."""
    dsn, schema, conn = queue
    stuck = threading.Event()
    release = threading.Event()

    def handle(ctx: JobContext, args: Any) -> None:
        if args == "stuck":
            stuck.set()
            release.wait(60)

    async def handle_async(ctx: JobContext, args: Any) -> None:
        return None

    await enqueue(conn, SYNC, "stuck", schema=schema)  # a 60 s lease: 15 s to get a thread
    waiting = await enqueue(conn, SYNC, "second", schema=schema)
    a = _worker(dsn, schema, "a", threads=1, concurrency=4)
    a.register(SYNC, handle)
    a.register(ASYNC, handle_async)
    stop = asyncio.Event()
    run = asyncio.create_task(a.run_until_shutdown(stop, drain_timeout=60))
    try:
        await wait_until(stuck.is_set)
        await wait_until(lambda: a.stats.claimed == 2)
        stop.set()
        # The drain waits for the stuck handler; the unstarted task is back already.
        await wait_until(lambda: a.stats.not_started == 1)
        state = await run_state(conn, waiting.id, schema=schema)
        assert (state.state.value, state.attempts) == ("pending", 0)
        assert not run.done()
    finally:
        release.set()
        await asyncio.wait_for(run, 30)
    assert (a.stats.succeeded, a.stats.released) == (1, 1)


# --- free slots follow demand ----------------------------------------------------------------


async def _drain_counts(
    dsn: str, schema: str, conn: Any, queues: list[str], n: int
) -> tuple[int, int]:
    """Claim rounds and idle waits of one worker draining ``n`` no-op tasks of queue ``b``."""
    await enqueue_many(conn, NOOP, [{}] * n, schema=schema, queue="b")

    async def handle(ctx: JobContext, args: Any) -> None:
        return None

    # No NOTIFY and a long poll: nothing but the claim loop's own decisions drives rounds
    # (before, each round given to the idle queue waited the whole poll interval).
    worker = _worker(dsn, schema, "w", queues=queues, poll_interval=10.0, listen=False)
    worker.register(NOOP, handle)
    async with _running(worker):
        await wait_until(lambda: worker.stats.claimed == n, timeout=60)
        counts = (worker.stats.claim_rounds, worker.stats.idle_waits)
        await wait_until(lambda: worker.stats.succeeded == n)
    return counts


async def test_an_idle_or_paused_extra_queue_costs_no_poll_waits_and_few_claim_rounds(
    queue: QueueFixture,
) -> None:
    """Before: half the rounds gave every slot to the empty queue, claimed nothing and
    waited a whole poll interval (200 tasks took minutes at a 10 s poll)."""
    dsn, schema, conn = queue
    n = 200
    alone_rounds, alone_waits = await _drain_counts(dsn, schema, conn, ["b"], n)
    idle_rounds, idle_waits = await _drain_counts(dsn, schema, conn, ["a", "b"], n)
    await pause_queue(conn, "a", schema=schema)
    kept = await enqueue_many(conn, NOOP, [{}] * 20, schema=schema, queue="a")
    paused_rounds, paused_waits = await _drain_counts(dsn, schema, conn, ["a", "b"], n)
    counts = {
        "alone": (alone_rounds, alone_waits),
        "idle": (idle_rounds, idle_waits),
        "paused": (paused_rounds, paused_waits),
    }
    # Only the last round (b drained too) may wait for the poll, in every case.
    assert max(alone_waits, idle_waits, paused_waits) <= 1, counts
    assert idle_rounds <= 1.2 * alone_rounds, counts
    assert paused_rounds <= 1.2 * alone_rounds, counts
    assert await _states(conn, schema) == {"succeeded": 3 * n, "pending": len(kept)}


async def test_a_queue_at_its_own_limit_is_claimed_again_when_one_of_its_handlers_ends(
    queue: QueueFixture,
) -> None:
    """Before: the round that filled queue a's one slot found b empty and waited a whole
    poll interval (10 s here) before a's next task."""
    dsn, schema, conn = queue
    ids = await enqueue_many(conn, NOOP, [{}] * 5, schema=schema, queue="a")

    async def handle(ctx: JobContext, args: Any) -> None:
        return None

    worker = _worker(dsn, schema, "w", queues={"a": 1, "b": 16}, poll_interval=10.0, listen=False)
    worker.register(NOOP, handle)
    async with _running(worker):
        await wait_until(lambda: worker.stats.succeeded == 5)
        # Every round claimed a's next task; none waited for the poll to do it.
        assert worker.stats.claimed == 5
    states = {(await run_state(conn, i, schema=schema)).state.value for i in ids}
    assert states == {"succeeded"}


# --- the pieces, without a database -----------------------------------------------------------


@pytest.mark.parametrize(
    ("left", "names", "room", "shares", "rest"),
    [
        (16, ["a", "b"], {"a": 16, "b": 16}, {"a": 8, "b": 8}, 0),
        (15, ["a", "b"], {"a": 16, "b": 16}, {"a": 8, "b": 7}, 0),  # the first gets the rest
        (10, ["a", "b"], {"a": 2, "b": 16}, {"a": 2, "b": 8}, 0),  # what a cannot take: b
        (10, ["a", "b"], {"a": 2, "b": 3}, {"a": 2, "b": 3}, 5),
        (3, ["a", "b", "c", "d"], {"a": 9, "b": 9, "c": 9, "d": 9}, {"a": 1, "b": 1, "c": 1}, 0),
        (5, ["a"], {"a": 0}, {}, 5),
    ],
)
def test_slots_are_shared_evenly_within_each_queues_room(
    left: int, names: list[str], room: dict[str, int], shares: dict[str, int], rest: int
) -> None:
    got: collections.Counter[str] = collections.Counter()
    assert _share_out(left, names, dict(room), got) == rest
    assert {k: v for k, v in got.items() if v} == shares


async def test_the_thread_gate_passes_a_freed_thread_to_the_oldest_waiter() -> None:
    gate = _ThreadGate(1)
    never: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    assert await gate.take(0.0, never)
    # No thread within the time: refused, and the refused waiter never gets one later.
    assert not await gate.take(0.01, never)
    first = asyncio.create_task(gate.take(30.0, never))
    second = asyncio.create_task(gate.take(30.0, never))
    await asyncio.sleep(0)
    gate.give_back()
    assert await first
    assert not second.done()
    # A waiter cancelled after it was handed the thread passes it on.
    gate.give_back()
    second.cancel()
    with pytest.raises(asyncio.CancelledError):
        await second
    assert gate.busy == 0
    # Stopping ends a wait with no thread.
    assert await gate.take(0.0, never)
    stopping: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    stopping.set_result(None)
    assert not await gate.take(30.0, stopping)
    gate.give_back()
    assert gate.busy == 0
