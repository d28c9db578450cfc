"""Crash points of the work queue, systematically (RELIABILITY rows 1, 2, 3, 12).

For each named crash point of the queue's claim, renewal, completion, retry and
recurring-job materialization, a worker process either SIGKILLs itself there, or freezes
there while its PostgreSQL server is restarted with ``pg_ctl -m immediate`` and is then
let go. A fresh worker then finishes. The checker asserts:

- no task lost: every enqueued task and the one due occurrence of each recurring job (no
  more) end succeeded;
- no finished task run again after its completion was acknowledged: no execution of a
  task that had succeeded when the worker crashed, and each task's last execution is the
  attempt the database recorded as its success;
- fencing: the lease tokens held at the crash are refused by the completion and renewal
  statements afterwards, and (SIGKILL) each task held was re-claimed under a new attempt;
- no queue session idle in transaction; a frozen worker let go stops cleanly.

The matrix is sampled per run (see ``crash_matrix``); ``nox -s crashmatrix`` runs it all.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from crash_matrix import (
    SEED,
    Crashing,
    idle_in_transaction,
    read_lines,
    reproduce,
    sample,
    yearly_cron,
)
from crash_worker import append
from pg_cluster import Cluster, Clusters, poll
from queue_support import installed_queue
from steeple.postgres._arrays import array_literal, text_array
from steeple.postgres.queue import EnqueueOptions, JobContext, Scheduler, Task, enqueue, jobs
from steeple.postgres.queue._sql import queue_sql
from steeple.runtime.crashpoints import CRASH_POINTS
from steeple.testing import FakeClock

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

TASK: Task[dict[str, Any]] = Task("crash")
OPTIONS = EnqueueOptions.immediate(lease_duration=timedelta(seconds=1), max_attempts=20)
ARGS: list[dict[str, Any]] = [
    {},
    {},
    {"fail_first": True},
    {"fail_first": True},
    {"sleep": 0.8},  # runs past a third of its lease: renewed
    {"sleep": 0.8},
]
JOBS = ("every-minute-a", "every-minute-b")

QUEUE = [point for point in CRASH_POINTS if point.startswith("queue.")]
KILLS = sample(QUEUE, 3, "queue-kill")
RESTARTS = sample(QUEUE, 3, "queue-restart")


def _ids(point: str) -> str:
    return f"{point}-seed{SEED}"


@pytest.fixture(scope="module")
def private_server() -> Iterator[Cluster]:
    """One private cluster for the module's restart scenarios (each uses its own schema)."""
    clusters = Clusters()
    try:
        yield clusters.new("crashq")
    finally:
        clusters.cleanup()


async def _prepare(dsn: str, schema: str) -> None:
    async with installed_queue(dsn, schema, connect_timeout=30) as conn:
        for args in ARGS:
            await enqueue(conn, TASK, args, OPTIONS, schema=schema)
        # Created as if five minutes ago, due three minutes ago, next due a year later:
        # each job owes exactly one occurrence.
        now = datetime.now(UTC)
        past = FakeClock(now - timedelta(minutes=5))
        cron = yearly_cron(now - timedelta(minutes=3))
        for name in JOBS:
            await jobs.create(conn, name, TASK, cron, {}, OPTIONS, schema=schema, clock=past)


async def _tasks(dsn: str, schema: str) -> dict[int, tuple[str, int, Any, int | None]]:
    """task id -> (state, attempts, lease token, job id)."""
    conn = await asyncpg.connect(dsn, timeout=30)
    try:
        rows = await conn.fetch(
            f'SELECT id, state, attempts, lease_token, job_id FROM "{schema}".tasks'
        )
    finally:
        await conn.close()
    return {r["id"]: (r["state"], r["attempts"], r["lease_token"], r["job_id"]) for r in rows}


async def _finish(dsn: str, schema: str, journal: Path) -> None:
    """A fresh worker (in this process) runs until every task, and each job's one, succeeded."""
    worker = Scheduler(
        dsn, worker_id="fresh", schema=schema, poll_interval=0.1, maintenance_interval=0.2
    )
    pid = os.getpid()

    async def handler(ctx: JobContext, args: Any) -> None:
        append(str(journal), [ctx.task_id, str(ctx.run_id), ctx.attempt, pid])
        if args.get("fail_first") and ctx.attempt == 1:
            from steeple.postgres.queue import JobError

            raise JobError.retry("first attempt fails", timedelta(0))

    worker.register(TASK, handler)
    stop = asyncio.Event()
    runner = asyncio.create_task(worker.run_until_shutdown(stop, drain_timeout=5))

    async def done() -> bool:
        if runner.done():
            runner.result()
        tasks = (await _tasks(dsn, schema)).values()
        from_jobs = [t for t in tasks if t[3] is not None]
        return (
            len(tasks) >= len(ARGS) + len(JOBS)
            and len(from_jobs) >= len(JOBS)
            and all(t[0] == "succeeded" for t in tasks)
        )

    try:
        await poll("the fresh worker to finish every task", done, timeout=90)
    finally:
        stop.set()
        await runner


async def _check(
    dsn: str,
    schema: str,
    journal: Path,
    at_crash: dict[int, tuple[str, int, Any, int | None]],
    lines_at_crash: int,
    how: str,
) -> None:
    tasks = await _tasks(dsn, schema)
    assert len(tasks) == len(ARGS) + len(JOBS), (tasks, reproduce())
    assert sorted(t[3] for t in tasks.values() if t[3] is not None) == sorted(
        {t[3] for t in tasks.values() if t[3] is not None}
    )
    assert {t[0] for t in tasks.values()} == {"succeeded"}, reproduce()
    runs = [json.loads(line) for line in read_lines(journal)]
    finished = {task_id for task_id, t in at_crash.items() if t[0] == "succeeded"}
    rerun = [r for r in runs[lines_at_crash:] if r[0] in finished]
    assert not rerun, (rerun, reproduce())
    for task_id, (_, attempts, _, _) in tasks.items():
        mine = [r for r in runs if r[0] == task_id]
        assert mine, (task_id, reproduce())
        assert mine[-1][2] == attempts, (task_id, mine, attempts, reproduce())
    sql = queue_sql(schema)
    conn = await asyncpg.connect(dsn, timeout=30)
    try:
        for task_id, (state, attempts, token, _) in at_crash.items():
            if state != "running":
                continue
            assert (
                await conn.fetch(
                    sql.complete,
                    array_literal([task_id]),
                    array_literal([token]),
                    "stale",
                    [None],
                    [None],
                )
                == []
            )
            assert await conn.fetch(sql.renew, text_array([task_id]), text_array([token])) == []
            if how == "kill":
                assert tasks[task_id][1] > attempts, (task_id, reproduce())
    finally:
        await conn.close()


async def _scenario(
    dsn: str, schema: str, tmp_path: Path, point: str, how: str, cluster: Cluster | None
) -> None:
    await _prepare(dsn, schema)
    journal = tmp_path / "runs.jsonl"
    journal.touch()
    worker = Crashing(how, point, tmp_path)
    await worker.start("queue", dsn, schema, str(journal))
    seen: dict[str, Any] = {}

    async def snapshot() -> None:
        seen["tasks"] = await _tasks(dsn, schema)
        seen["lines"] = len(read_lines(journal))

    try:
        await worker.crash(cluster, snapshot)
        await _finish(dsn, schema, journal)
    finally:
        code = await worker.finish()
    if how == "restart":
        assert code == 0, (code, await worker.stderr(), reproduce())
    await _check(dsn, schema, journal, seen["tasks"], seen["lines"], how)
    assert await idle_in_transaction(dsn, "steeple-queue", schema) == 0


@pytest.mark.timeout(900)
@pytest.mark.parametrize("point", KILLS, ids=_ids)
async def test_sigkill_at_a_queue_crash_point_loses_and_repeats_nothing(
    point: str, pg_schema: tuple[str, str], tmp_path: Path
) -> None:
    dsn, schema = pg_schema
    await _scenario(dsn, schema, tmp_path, point, "kill", None)


@pytest.fixture
async def private_schema(
    private_server: Cluster, pg_name: Any
) -> AsyncIterator[tuple[str, str, Cluster]]:
    """A schema name on the private cluster, dropped afterwards."""
    schema = pg_name("crashq")
    dsn = private_server.dsn()
    try:
        yield dsn, schema, private_server
    finally:
        conn = await asyncpg.connect(dsn, timeout=30)
        try:
            await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        finally:
            await conn.close()


@pytest.mark.timeout(900)
@pytest.mark.parametrize("point", RESTARTS, ids=_ids)
async def test_immediate_restart_at_a_queue_crash_point_loses_and_repeats_nothing(
    point: str, private_schema: tuple[str, str, Cluster], tmp_path: Path
) -> None:
    dsn, schema, cluster = private_schema
    await _scenario(dsn, schema, tmp_path, point, "restart", cluster)
