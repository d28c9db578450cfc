"""A stale worker's outcome arrives while another worker holds the task: it is refused.

Real ``steeple worker`` processes. Worker A claims a task and freezes past its lease, at
a named step (``STEEPLE_CRASH_PAUSE``: its whole process stops, event loop included, so
it neither renews nor writes) or mid-handler (``SIGSTOP``). Worker B recovers the task,
claims it under a new lease token and is held running (its handler waits for a gate
file the test opens). Only then is A let go, so its completion, renewal, retry or
permanent failure reaches the database while B still runs the task. The database must
refuse it: the row stays ``running`` under B's token, the attempt history records A's
attempt as lost, never as A's outcome, and A's handler is told that its lease is gone.
B's outcome is the one recorded, exactly once. A cancel that lands while a handler's
success is on its way is kept the same way: the late success is refused.

Each wait is on state (a row, a trace row, the file a paused step writes), bounded.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import signal
from datetime import timedelta
from pathlib import Path
from typing import Any

import asyncpg
import pytest

import queue_support
from pg_cluster import Clusters
from steeple.core.tasks import TaskState
from steeple.postgres import queue as q
from worker_fault_support import WorkerProc, World, private_database, world

# Each test runs on a private cluster: worker processes and their pools only.
pytestmark = [pytest.mark.postgres, pytest.mark.slow]

wait_until = functools.partial(queue_support.wait_until, interval=0.05, timeout=60)

# Long enough that B, on a loaded machine, keeps renewing its own lease; short enough that
# A's lapses quickly while it is frozen.
LEASE = timedelta(seconds=2)

APP = """
import asyncio, os
from datetime import timedelta
from pathlib import Path

import asyncpg

from steeple.admin import WorkerApp
from steeple.postgres.queue import JobError, Task

DSN = os.environ["STEEPLE_DATABASE_URL"]
SCHEMA = os.environ["STEEPLE_QUEUE_SCHEMA"]
GATE = Path(os.environ["FAULT_GATE"])
WORKER = os.environ["FAULT_WORKER"]


async def trace(event, key):
    conn = await asyncpg.connect(DSN)
    try:
        await conn.execute(
            f'INSERT INTO "{SCHEMA}".fault_trace (worker, event, key) VALUES ($1, $2, $3)',
            WORKER, event, key,
        )
    finally:
        await conn.close()


async def fenced(ctx, args):
    # Runs until its gate opens, saying when it learns that its lease is gone; then the
    # first attempt ends as the test asked (args["first"]), any later one succeeds.
    key = f"{ctx.task_id}/{ctx.attempt}"
    await trace("start", key)
    told = False
    while not GATE.exists():
        if ctx.lease_lost.is_set() and not told:
            told = True
            await trace("cancelled" if ctx.cancelled.is_set() else "lease-lost", key)
        await asyncio.sleep(0.02)
    await trace("end", key)
    outcome = args.get("first", "succeed") if ctx.attempt == 1 else "succeed"
    if outcome == "retry":
        raise JobError.retry("stale retry", timedelta(0))
    if outcome == "fail":
        raise JobError.permanent("stale failure")
    return {"by": WORKER, "attempt": ctx.attempt}


def make():
    return WorkerApp(tasks=[(Task("fenced"), fenced)], worker_id=WORKER, drain_timeout=30)
"""


class Frozen:
    """Worker A's crash-pause directory: where it says it paused, and how to let it go."""

    def __init__(self, home: Path, point: str) -> None:
        self.point = point
        self.dir = home / "pause-a"
        self.dir.mkdir()
        os.mkfifo(self.dir / "release")

    def env(self) -> dict[str, str]:
        return {
            "STEEPLE_CRASH_PAUSE": self.point,
            "STEEPLE_CRASH_DIR": str(self.dir),
            "STEEPLE_CRASH_TRACE": str(self.dir / "reached"),
        }

    def paused(self) -> bool:
        return (self.dir / "paused").exists()

    def reached(self, point: str) -> bool:
        trace = self.dir / "reached"
        return trace.exists() and point in trace.read_text().split()

    async def release(self) -> None:
        await asyncio.to_thread((self.dir / "release").write_text, "go")


async def _enqueue(w: World, args: dict[str, Any]) -> int:
    conn = await asyncpg.connect(w.dsn, timeout=10)
    try:
        options = q.EnqueueOptions(lease_duration=LEASE)
        return (await q.enqueue(conn, q.Task("fenced"), args, options, schema=w.schema)).id
    finally:
        await conn.close()


async def _row(w: World, task_id: int) -> asyncpg.Record:
    [row] = await w.fetch(
        "SELECT state, attempts, worker_id, lease_token, result::text AS result "
        "FROM {s}.tasks WHERE id = $1",
        task_id,
    )
    return row


async def _traced(w: World, event: str, worker: str, key: str) -> bool:
    return key in await w.traces(event, worker)


async def _spawn(w: World, name: str, gate: Path, **extra: str) -> WorkerProc:
    return await w.spawn(name, "fenceapp:make", FAULT_GATE=str(gate), **extra)


async def _taken_over(w: World, task_id: int) -> tuple[WorkerProc, Any]:
    """With A frozen: start B, wait until it runs the task; return B and its lease token."""
    b = await _spawn(w, "B", w.home / "gate-b")

    async def b_runs_it() -> bool:
        row = await _row(w, task_id)
        return (row["state"], row["attempts"], row["worker_id"]) == ("running", 2, "B")

    await wait_until(b_runs_it)
    await wait_until(lambda: _traced(w, "start", "B", f"{task_id}/2"))
    return b, (await _row(w, task_id))["lease_token"]


async def _still_bs(w: World, task_id: int, token: Any) -> None:
    """The task is still B's: running, B's lease token, A's attempt recorded as lost only."""
    row = await _row(w, task_id)
    assert (row["state"], row["attempts"], row["worker_id"]) == ("running", 2, "B")
    assert row["lease_token"] == token
    assert row["result"] is None
    assert await w.attempts() == [(task_id, 1, "lease_expired", "A")]


async def _b_finishes(w: World, task_id: int, a: WorkerProc, b: WorkerProc) -> None:
    """Let B's handler end: its success is the one recorded, once; both workers stop."""
    (w.home / "gate-b").touch()

    async def succeeded() -> bool:
        return bool((await _row(w, task_id))["state"] == "succeeded")

    await wait_until(succeeded)
    for proc in (a, b):
        if proc.proc.returncode is None:
            proc.signal(signal.SIGTERM)
        assert await proc.exited() == 0, proc.stderr
    row = await _row(w, task_id)
    assert (row["state"], row["attempts"], row["worker_id"]) == ("succeeded", 2, "B")
    assert json.loads(row["result"]) == {"by": "B", "attempt": 2}
    assert await w.attempts() == [
        (task_id, 1, "lease_expired", "A"),
        (task_id, 2, "succeeded", "B"),
    ]
    assert "tasks: 1 succeeded, 0 retried, 0 failed" in b.stderr
    assert "1 outcomes rejected" in a.stderr, a.stderr
    assert "tasks: 0 succeeded, 0 retried, 0 failed" in a.stderr, a.stderr


@pytest.mark.parametrize(
    ("first", "point", "committed"),
    [
        ("succeed", "queue.complete.before", "queue.complete.committed"),
        ("retry", "queue.retry.before", "queue.retry.committed"),
    ],
    ids=["completion", "retry"],
)
async def test_a_stale_outcome_arriving_while_another_worker_runs_the_task_is_refused(
    pg_clusters: Clusters, tmp_path: Path, first: str, point: str, committed: str
) -> None:
    dsn, schema = private_database(pg_clusters)
    async with world(dsn, schema, tmp_path, lease=LEASE, occurrences=0) as w:
        (tmp_path / "fenceapp.py").write_text(APP)
        task_id = await _enqueue(w, {"first": first})
        frozen = Frozen(tmp_path, point)
        (tmp_path / "gate-a").touch()  # A's handler ends at once; its outcome then waits
        a = await _spawn(w, "A", tmp_path / "gate-a", **frozen.env())
        await wait_until(frozen.paused)
        assert (frozen.dir / "paused").read_text() == point
        b, token = await _taken_over(w, task_id)

        await frozen.release()  # A's outcome reaches the database while B runs the task
        await wait_until(lambda: frozen.reached(committed))
        await _still_bs(w, task_id, token)
        await _b_finishes(w, task_id, a, b)


async def test_a_stale_permanent_failure_arriving_while_another_worker_runs_the_task_is_refused(
    pg_clusters: Clusters, tmp_path: Path
) -> None:
    dsn, schema = private_database(pg_clusters)
    async with world(dsn, schema, tmp_path, lease=LEASE, occurrences=0) as w:
        (tmp_path / "fenceapp.py").write_text(APP)
        task_id = await _enqueue(w, {"first": "fail"})
        a = await _spawn(w, "A", tmp_path / "gate-a")
        await wait_until(lambda: _traced(w, "start", "A", f"{task_id}/1"))
        a.signal(signal.SIGSTOP)  # frozen mid-handler: no renewal, no outcome
        b, token = await _taken_over(w, task_id)

        (tmp_path / "gate-a").touch()
        a.signal(signal.SIGCONT)  # A's handler fails for good while B runs the task
        await wait_until(lambda: _traced(w, "end", "A", f"{task_id}/1"))
        # The graceful stop waits for A's failure to be written (and refused).
        a.signal(signal.SIGTERM)
        assert await a.exited() == 0, a.stderr
        await _still_bs(w, task_id, token)
        await _b_finishes(w, task_id, a, b)


async def test_a_stale_renewal_arriving_while_another_worker_runs_the_task_is_refused(
    pg_clusters: Clusters, tmp_path: Path
) -> None:
    dsn, schema = private_database(pg_clusters)
    async with world(dsn, schema, tmp_path, lease=LEASE, occurrences=0) as w:
        (tmp_path / "fenceapp.py").write_text(APP)
        task_id = await _enqueue(w, {})
        frozen = Frozen(tmp_path, "queue.renew.before")
        a = await _spawn(w, "A", tmp_path / "gate-a", **frozen.env())
        await wait_until(lambda: _traced(w, "start", "A", f"{task_id}/1"))
        await wait_until(frozen.paused)
        b, token = await _taken_over(w, task_id)

        await frozen.release()  # A's first renewal reaches the database while B runs it
        await wait_until(lambda: frozen.reached("queue.renew.committed"))
        # A's handler is told its lease is gone (and not that the task was cancelled).
        await wait_until(lambda: _traced(w, "lease-lost", "A", f"{task_id}/1"), timeout=30)
        await _still_bs(w, task_id, token)
        assert not await w.traces("cancelled")
        (tmp_path / "gate-a").touch()  # A's handler ends: its success is refused as well
        await wait_until(lambda: _traced(w, "end", "A", f"{task_id}/1"))
        await _b_finishes(w, task_id, a, b)


async def test_a_cancel_landing_while_a_success_is_on_its_way_is_kept(
    pg_clusters: Clusters, tmp_path: Path
) -> None:
    dsn, schema = private_database(pg_clusters)
    async with world(dsn, schema, tmp_path, lease=timedelta(minutes=5), occurrences=0) as w:
        (tmp_path / "fenceapp.py").write_text(APP)
        task_id = await _enqueue(w, {})
        frozen = Frozen(tmp_path, "queue.complete.before")
        (tmp_path / "gate-a").touch()
        a = await _spawn(w, "A", tmp_path / "gate-a", **frozen.env())
        await wait_until(frozen.paused)  # the handler returned; its success not yet written
        conn = await asyncpg.connect(dsn, timeout=10)
        try:
            assert await q.cancel(conn, task_id, schema=schema) is TaskState.CANCELLED
        finally:
            await conn.close()
        await frozen.release()
        await wait_until(lambda: frozen.reached("queue.complete.committed"))
        row = await _row(w, task_id)
        assert (row["state"], row["attempts"], row["worker_id"]) == ("cancelled", 1, "A")
        assert row["lease_token"] is None
        assert row["result"] is None
        assert await w.attempts() == []  # no success recorded for the cancelled attempt
        a.signal(signal.SIGTERM)
        assert await a.exited() == 0, a.stderr
        assert "tasks: 0 succeeded, 0 retried, 0 failed, 0 handed back, 1 outcomes rejected" in (
            a.stderr
        )
