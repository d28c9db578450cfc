"""Workers as real processes: SIGKILL recovery, SIGSTOP fencing, several workers at once."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg
import pytest

import queue_support
from queue_support import QueueFixture
from steeple.core.tasks import TaskState
from steeple.postgres.queue import (
    EnqueueOptions,
    JobContext,
    Scheduler,
    Task,
    cancel,
    enqueue,
    enqueue_many,
    run_state,
)

pytestmark = pytest.mark.slow

PROC: Task[Any] = Task("proc")

WORKER_SCRIPT = """
import asyncio, json, os, signal, sys
import asyncpg, attrs
from steeple.postgres.queue import Scheduler, Task

class Connection(asyncpg.Connection):
    completed = False  # it ran a completion since it was last given back

    async def fetch(self, query, *args, **kwargs):
        rows = await super().fetch(query, *args, **kwargs)
        self.completed = self.completed or "complete_tasks(" in query
        return rows

async def main() -> None:
    dsn, schema, worker_id = sys.argv[1:4]
    hold = os.environ.get("HOLD_COMPLETION_UNTIL_EXECUTIONS")

    async def reset(conn):
        # With HOLD_COMPLETION_UNTIL_EXECUTIONS=n: the connection that ran a completion
        # comes back to the pool (after its commit, before the completion goes on) only
        # once n executions are logged (or after 30 s): what a slow reset round trip
        # there lets the worker's other tasks do meanwhile.
        if hold and conn.completed:
            for _ in range(3000):
                if await conn.fetchval(f'SELECT count(*) FROM "{schema}".executions') >= int(hold):
                    break
                await asyncio.sleep(0.01)
        conn.completed = False
        await conn.reset()

    pool = await asyncpg.create_pool(dsn, min_size=2, max_size=10, connection_class=Connection,
                                     reset=reset)
    worker = Scheduler(pool, worker_id=worker_id, schema=schema, poll_interval=0.1,
                       maintenance_interval=0.2, concurrency=8)

    async def handler(ctx, args):
        await pool.execute(
            f'INSERT INTO "{schema}".executions (task_id, run_id, attempt, worker_id) '
            "VALUES ($1, $2, $3, $4)", ctx.task_id, ctx.run_id, ctx.attempt, worker_id)
        await asyncio.sleep(args.get("sleep", 0))
        if ctx.attempt == 1:
            await asyncio.sleep(args.get("sleep_first", 0))

    worker.register(Task("proc"), handler)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    print("ready", flush=True)
    await worker.run_until_shutdown(stop, drain_timeout=5)
    print("stats " + json.dumps(attrs.asdict(worker.stats)), flush=True)
    await pool.close()

asyncio.run(main())
"""


@pytest.fixture
async def queue(
    queue: tuple[str, str, asyncpg.Connection],
) -> tuple[str, str, asyncpg.Connection]:
    """The shared ``queue`` (conftest.py) with a table the worker script logs executions to."""
    _dsn, schema, conn = queue
    await conn.execute(
        f'CREATE TABLE "{schema}".executions (task_id bigint, run_id uuid, attempt int, '
        "worker_id text, at timestamptz NOT NULL DEFAULT clock_timestamp(), "
        "UNIQUE (run_id, attempt))"
    )
    return queue


class WorkerProcess:
    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    async def ready(self) -> None:
        assert self.proc.stdout is not None
        line = await asyncio.wait_for(self.proc.stdout.readline(), 60)
        assert line.strip() == b"ready", line

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    async def stop(self) -> dict[str, int]:
        self.signal(signal.SIGTERM)
        assert self.proc.stdout is not None
        out = await asyncio.wait_for(self.proc.stdout.read(), 30)
        await self.proc.wait()
        for line in out.decode().splitlines():
            if line.startswith("stats "):
                return dict(json.loads(line[6:]))
        raise AssertionError(f"no stats from the worker: {out!r}")

    async def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        await self.proc.wait()


@contextlib.asynccontextmanager
async def worker_process(
    tmp_path: Path,
    dsn: str,
    schema: str,
    worker_id: str,
    *,
    crash_at: str | None = None,
    env: dict[str, str] | None = None,
) -> AsyncIterator[WorkerProcess]:
    """Start a worker process; ``crash_at``: the crash point where it SIGKILLs itself.

    ``env``: more environment variables for it (``HOLD_COMPLETION_UNTIL_EXECUTIONS``: see
    the script).
    """
    script = tmp_path / "queue_worker.py"
    script.write_text(WORKER_SCRIPT)
    environ = {**os.environ, **(env or {})}
    if crash_at is not None:
        environ["STEEPLE_CRASH_AT"] = crash_at
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(script), dsn, schema, worker_id,
        stdout=asyncio.subprocess.PIPE, env=environ,
    )  # fmt: skip
    worker = WorkerProcess(proc)
    try:
        await worker.ready()
        yield worker
    finally:
        if proc.returncode is None:
            # a stopped process must be continued before it can terminate cleanly
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGCONT)
            await worker.kill()


wait_until = functools.partial(queue_support.wait_until, interval=0.05)


def in_process_worker(dsn: str, schema: str, worker_id: str) -> tuple[Scheduler, list[Any]]:
    ran: list[Any] = []
    worker = Scheduler(
        dsn, worker_id=worker_id, schema=schema, poll_interval=0.1, maintenance_interval=0.2
    )

    async def handler(ctx: JobContext, args: Any) -> None:
        ran.append((ctx.task_id, ctx.attempt))

    worker.register(PROC, handler)
    return worker, ran


async def _executions(conn: asyncpg.Connection, schema: str) -> list[tuple[int, int, str]]:
    rows = await conn.fetch(
        f'SELECT task_id, attempt, worker_id FROM "{schema}".executions ORDER BY task_id, attempt'
    )
    return [(r[0], r[1], r[2]) for r in rows]


async def test_sigkilled_worker_mid_task_is_recovered_by_another(
    queue: QueueFixture, tmp_path: Path
) -> None:
    dsn, schema, conn = queue
    options = EnqueueOptions(lease_duration=timedelta(seconds=1))
    ids = [
        (await enqueue(conn, PROC, {"sleep_first": 60}, options, schema=schema)).id
        for _ in range(5)
    ]
    async with worker_process(tmp_path, dsn, schema, "doomed") as doomed:
        await wait_until(lambda: _count_execs(conn, schema, 5))
        doomed.signal(signal.SIGKILL)
        await doomed.proc.wait()
    survivor, ran = in_process_worker(dsn, schema, "survivor")
    stop = asyncio.Event()
    task = asyncio.create_task(survivor.run_until_shutdown(stop))
    try:
        await wait_until(lambda: len(ran) == 5)
        await wait_until(lambda: survivor.stats.succeeded == 5)
    finally:
        stop.set()
        await task
    assert sorted(ran) == [(i, 2) for i in ids]
    assert survivor.stats.recovered == 5
    for task_id in ids:
        row = await run_state(conn, task_id, schema=schema)
        assert (row.state.value, row.attempts, row.worker_id) == ("succeeded", 2, "survivor")
        history = await conn.fetch(
            f'SELECT attempt, outcome, worker_id FROM "{schema}".attempts '
            "WHERE task_id = $1 ORDER BY attempt",
            task_id,
        )
        assert [tuple(h) for h in history] == [
            (1, "lease_expired", "doomed"),
            (2, "succeeded", "survivor"),
        ]


async def test_sigkilled_worker_running_a_parent_leaves_its_dependent_waiting(
    queue: QueueFixture, tmp_path: Path
) -> None:
    """The worker running a workflow's parent dies: the dependent waits (no completion,
    no release); once another worker runs the parent again, it is released and runs once."""
    dsn, schema, conn = queue
    options = EnqueueOptions(lease_duration=timedelta(seconds=1))
    parent = await enqueue(conn, PROC, {"sleep_first": 60}, options, schema=schema)
    child = await enqueue(conn, PROC, {}, schema=schema, after=[parent])
    async with worker_process(tmp_path, dsn, schema, "doomed") as doomed:
        await wait_until(lambda: _count_execs(conn, schema, 1))
        doomed.signal(signal.SIGKILL)
        await doomed.proc.wait()
    assert (await run_state(conn, child.id, schema=schema)).state.value == "waiting"
    survivor, ran = in_process_worker(dsn, schema, "survivor")
    stop = asyncio.Event()
    task = asyncio.create_task(survivor.run_until_shutdown(stop))
    try:
        await wait_until(lambda: survivor.stats.succeeded == 2)
    finally:
        stop.set()
        await task
    assert ran == [(parent.id, 2), (child.id, 1)]
    states = [(await run_state(conn, t.id, schema=schema)).state.value for t in (parent, child)]
    assert states == ["succeeded", "succeeded"]


@pytest.mark.parametrize(
    ("point", "dependent_started"),
    [
        ("queue.complete.before", False),
        ("queue.complete.committed", False),
        ("queue.complete.committed", True),
    ],
    ids=[
        "queue.complete.before",
        "queue.complete.committed",
        "queue.complete.committed-dependent-started",
    ],
)
async def test_sigkilled_while_completing_a_parent_its_dependent_runs_once_after_it(
    queue: QueueFixture, tmp_path: Path, point: str, dependent_started: bool
) -> None:
    """The worker dies completing a parent: before the completion is sent it releases
    nothing (the parent runs again once its lease lapses, then the dependent); once it has
    committed, the dependent is released and the parent does not run again. Either way the
    dependent succeeds exactly once, after the parent's success.

    Once the completion has committed, the dying worker's claim loop (woken by the release,
    or by its poll) may lease the dependent and start it before the crash: that attempt is
    cut by the crash like any other, recorded as lapsed, and run again by the survivor.
    ``dependent_started`` makes that order certain: the completion's connection comes back
    to the dying worker's pool only once the dependent's execution is logged.
    """
    dsn, schema, conn = queue
    # A lease no stall of a loaded machine outlasts: one that lapsed between the handler
    # and its completion would let the dying worker's own maintenance take the parent
    # back, fencing the completion this test means to cut. The dead worker's leases are
    # lapsed below, once it is gone, for the survivor to recover them.
    options = EnqueueOptions(lease_duration=timedelta(minutes=5))
    parent = await enqueue(conn, PROC, {}, options, schema=schema)
    child = await enqueue(conn, PROC, {}, options, schema=schema, after=[parent])
    env = {"HOLD_COMPLETION_UNTIL_EXECUTIONS": "2"} if dependent_started else None
    async with worker_process(tmp_path, dsn, schema, "doomed", crash_at=point, env=env) as doomed:
        assert await doomed.proc.wait() == -signal.SIGKILL  # it killed itself at the point
    await _lapse_leases_of(conn, schema, "doomed")
    committed = point == "queue.complete.committed"
    states = [(await run_state(conn, t.id, schema=schema)).state.value for t in (parent, child)]
    # Committed: released; the dying worker may even have leased it (its claim loop woke
    # on the release) and started it.
    expected = (
        [["succeeded", "pending"], ["succeeded", "running"]]
        if committed
        else [["running", "waiting"]]
    )
    assert states in (expected[1:] if dependent_started else expected)
    survivor, ran = in_process_worker(dsn, schema, "survivor")
    stop = asyncio.Event()
    task = asyncio.create_task(survivor.run_until_shutdown(stop))
    try:
        await wait_until(lambda: _succeeded(conn, schema, child.id))
    finally:
        stop.set()
        await task
    evidence = await _evidence(conn, schema)
    parent_done = (await run_state(conn, parent.id, schema=schema)).finished_at
    assert parent_done is not None
    executions = await _executions_at(conn, schema)
    history = await _history(conn, schema)
    # The doomed worker's executions (the survivor's are in ``ran``): the parent once,
    # attempt 1.
    assert [e[:3] for e in executions if e[0] == parent.id] == [(parent.id, 1, "doomed")], evidence
    if committed:
        assert history[parent.id] == [(1, "succeeded", "doomed")], evidence
    else:
        assert history[parent.id] == [
            (1, "lease_expired", "doomed"),
            (2, "succeeded", "survivor"),
        ], evidence
    # The dependent: leased by the doomed worker only if it was running when that worker
    # died (its attempt 1 then lapsed, perhaps started: the crash cut it), succeeded once,
    # by the survivor, in the next attempt; never started before the parent's success.
    lapsed = [(1, "lease_expired", "doomed")] if states[1] == "running" else []
    assert history[child.id] == [*lapsed, (len(lapsed) + 1, "succeeded", "survivor")], evidence
    survivor_ran = [(child.id, len(lapsed) + 1)]
    assert ran == (survivor_ran if committed else [(parent.id, 2), *survivor_ran]), evidence
    cut = [e[1] for e in executions if e[0] == child.id]
    assert cut in ([[1]] if dependent_started else [[], [1]] if lapsed else [[]]), evidence
    assert all(e[3] >= parent_done for e in executions if e[0] == child.id), evidence


async def _executions_at(
    conn: asyncpg.Connection, schema: str
) -> list[tuple[int, int, str, datetime]]:
    """The logged executions, in the order they started: task, attempt, worker, when."""
    rows = await conn.fetch(
        f'SELECT task_id, attempt, worker_id, at FROM "{schema}".executions ORDER BY at'
    )
    return [(r[0], r[1], r[2], r[3]) for r in rows]


async def _history(conn: asyncpg.Connection, schema: str) -> dict[int, list[tuple[int, str, str]]]:
    """Each task's recorded attempts, in order: attempt, outcome, worker."""
    history: dict[int, list[tuple[int, str, str]]] = {}
    rows = await conn.fetch(
        f'SELECT task_id, attempt, outcome, worker_id FROM "{schema}".attempts ORDER BY id'
    )
    for r in rows:
        history.setdefault(r[0], []).append((r[1], r[2], r[3]))
    return history


async def _evidence(conn: asyncpg.Connection, schema: str) -> str:
    """What a failed assertion shows: executions, attempts and tasks, with their times."""
    queries = {
        "executions": "SELECT task_id, run_id, attempt, worker_id, at FROM {}.executions "
        "ORDER BY at",
        "attempts": "SELECT task_id, attempt, outcome, worker_id, started_at, finished_at "
        "FROM {}.attempts ORDER BY id",
        "tasks": "SELECT id, state, attempts, worker_id, started_at, finished_at FROM {}.tasks "
        "ORDER BY id",
    }
    lines = []
    for name, sql in queries.items():
        lines.append(f"{name}:")
        lines += [f"  {tuple(r)}" for r in await conn.fetch(sql.format(f'"{schema}"'))]
    return "\n".join(lines)


async def _lapse_leases_of(conn: asyncpg.Connection, schema: str, worker_id: str) -> None:
    """Let the leases of a worker that is gone run out now (the time passes, in effect)."""
    await conn.execute(
        f'UPDATE "{schema}".tasks SET lease_expires_at = clock_timestamp() '
        "- interval '1 second' WHERE state = 'running' AND worker_id = $1",
        worker_id,
    )


async def _succeeded(conn: asyncpg.Connection, schema: str, task_id: int) -> bool:
    return (await run_state(conn, task_id, schema=schema)).state.value == "succeeded"


async def _count_execs(conn: asyncpg.Connection, schema: str, n: int) -> bool:
    return bool(await conn.fetchval(f'SELECT count(*) FROM "{schema}".executions') >= n)


async def test_a_stopped_workers_late_completion_is_rejected(
    queue: QueueFixture, tmp_path: Path
) -> None:
    dsn, schema, conn = queue
    done = await enqueue(
        conn,
        PROC,
        {"sleep_first": 1.0},
        EnqueueOptions(lease_duration=timedelta(milliseconds=500)),
        schema=schema,
    )
    async with worker_process(tmp_path, dsn, schema, "stale") as stale:
        await wait_until(lambda: _count_execs(conn, schema, 1))
        stale.signal(signal.SIGSTOP)
        fresh, ran = in_process_worker(dsn, schema, "fresh")
        stop = asyncio.Event()
        task = asyncio.create_task(fresh.run_until_shutdown(stop))
        try:
            await wait_until(lambda: fresh.stats.succeeded == 1)
        finally:
            stop.set()
            await task
        stale.signal(signal.SIGCONT)
        await asyncio.sleep(1.5)  # its handler finishes and tries to complete
        stats = await stale.stop()
    assert ran == [(done.id, 2)]
    assert stats["rejected_completions"] == 1
    assert stats["succeeded"] == 0
    row = await run_state(conn, done.id, schema=schema)
    assert (row.state.value, row.worker_id, row.attempts) == ("succeeded", "fresh", 2)
    outcomes = await conn.fetch(
        f'SELECT attempt, outcome, worker_id FROM "{schema}".attempts WHERE task_id = $1 '
        "ORDER BY id",
        done.id,
    )
    assert [tuple(o) for o in outcomes] == [
        (1, "lease_expired", "stale"),
        (2, "succeeded", "fresh"),
    ]


async def test_several_worker_processes_never_run_a_task_twice(
    queue: QueueFixture, tmp_path: Path
) -> None:
    dsn, schema, conn = queue
    async with contextlib.AsyncExitStack() as stack:
        workers = [
            await stack.enter_async_context(worker_process(tmp_path, dsn, schema, f"p{i}"))
            for i in range(3)
        ]
        ids: list[int] = []
        for chunk in range(3):
            ids += await enqueue_many(
                conn,
                PROC,
                [{"sleep": 0.01}] * 100,
                EnqueueOptions(lease_duration=timedelta(seconds=10)),
                schema=schema,
            )
            del chunk
        await wait_until(
            lambda: _all_succeeded(conn, schema, len(ids)),
            timeout=60,
        )
        stats = [await w.stop() for w in workers]
    executions = await _executions(conn, schema)
    assert len(executions) == 300
    assert sorted(e[0] for e in executions) == sorted(ids)
    assert {e[1] for e in executions} == {1}
    assert sum(s["succeeded"] for s in stats) == 300
    assert sum(s["rejected_completions"] for s in stats) == 0
    assert len({e[2] for e in executions}) >= 2  # the work really was shared


async def _all_succeeded(conn: asyncpg.Connection, schema: str, n: int) -> bool:
    count = await conn.fetchval(
        f"SELECT count(*) FROM \"{schema}\".tasks WHERE state = 'succeeded'"
    )
    return bool(count == n)


async def _finished(conn: asyncpg.Connection, schema: str, ids: list[int]) -> list[Any]:
    rows = await conn.fetch(
        f'SELECT id, state, attempts, finished_at, lease_token FROM "{schema}".tasks '
        "WHERE id = ANY($1::bigint[]) ORDER BY id",
        ids,
    )
    return [tuple(r) for r in rows]


async def test_cancelling_finished_tasks_changes_nothing_while_worker_processes_run(
    queue: QueueFixture, tmp_path: Path
) -> None:
    dsn, schema, conn = queue
    options = EnqueueOptions(lease_duration=timedelta(seconds=10))
    async with contextlib.AsyncExitStack() as stack:
        workers = [
            await stack.enter_async_context(worker_process(tmp_path, dsn, schema, f"p{i}"))
            for i in range(2)
        ]
        done = await enqueue_many(conn, PROC, [{}] * 20, options, schema=schema)
        await wait_until(lambda: _all_succeeded(conn, schema, len(done)), timeout=60)
        before = await _finished(conn, schema, done)
        # More work, so the workers claim, run and complete while the finished are cancelled.
        busy = await enqueue_many(conn, PROC, [{"sleep": 0.05}] * 40, options, schema=schema)

        async def some_busy_work_ran() -> bool:
            ran = await conn.fetchval(
                f'SELECT count(*) FROM "{schema}".executions WHERE task_id = ANY($1::bigint[])',
                busy,
            )
            return bool(ran)

        await wait_until(some_busy_work_ran, timeout=60)
        states = [await cancel(conn, task_id, schema=schema) for task_id in done]
        await wait_until(lambda: _all_succeeded(conn, schema, len(done) + len(busy)), timeout=60)
        stats = [await w.stop() for w in workers]
    assert states == [TaskState.SUCCEEDED] * len(done)
    assert await _finished(conn, schema, done) == before
    executions = await _executions(conn, schema)
    assert sorted(e[0] for e in executions) == sorted(done + busy)  # each ran once
    assert sum(s["succeeded"] for s in stats) == len(done) + len(busy)
