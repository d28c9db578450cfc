"""Global limits across worker processes: four real processes share each limit.

Handlers record, in server time, when they start and end, and sample what the database
says is running when they start; the checks run on those records after the work is done.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from queue_support import (
    QueueFixture,
    all_succeeded,
    most_at_once,
    wait_until,
    worker_processes,
)
from steeple.postgres.queue import Task, enqueue_many, limit_queue, limit_task

pytestmark = pytest.mark.slow

WORKERS = 4

WORKER_SCRIPT = """
import asyncio, json, signal, sys
import asyncpg
from steeple.postgres.queue import Health, Scheduler, Task

async def main() -> None:
    dsn, schema, worker_id, queues = sys.argv[1:5]
    pool = await asyncpg.create_pool(dsn, min_size=2, max_size=16)
    worker = Scheduler(pool, worker_id=worker_id, schema=schema, poll_interval=0.05,
                       maintenance_interval=0.5, concurrency=8, queues=json.loads(queues))

    async def handler(ctx, args):
        await pool.execute(
            f'INSERT INTO "{schema}".observed (task_id, task_name, queue, started, '
            "queue_running, name_running) SELECT $1, $2, $3, clock_timestamp(), "
            f'(SELECT count(*) FROM "{schema}".tasks WHERE queue = $3 AND state = \\'running\\'), '
            f'(SELECT count(*) FROM "{schema}".tasks WHERE task_name = $2 '
            "AND state = 'running')", ctx.task_id, ctx.task_name, ctx.queue)
        await asyncio.sleep(args.get("work", 0))
        await pool.execute(
            f'UPDATE "{schema}".observed SET ended = clock_timestamp() WHERE task_id = $1',
            ctx.task_id)

    worker.register(Task("a"), handler)
    worker.register(Task("b"), handler)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    run = asyncio.create_task(worker.run_until_shutdown(stop, drain_timeout=5))
    # Ready once claiming (so every process competes for the work enqueued after this).
    while worker.health() is Health.STARTING and not run.done():
        await asyncio.sleep(0.01)
    print("ready", flush=True)
    await run
    await pool.close()

asyncio.run(main())
"""


@pytest.fixture
async def queue(queue: QueueFixture) -> QueueFixture:
    """The shared ``queue`` (conftest.py) with the table the handlers record into."""
    _dsn, schema, conn = queue
    await conn.execute(
        f'CREATE TABLE "{schema}".observed (task_id bigint PRIMARY KEY, task_name text, '
        "queue text, started timestamptz, ended timestamptz, queue_running int, "
        "name_running int)"
    )
    return queue


@contextlib.asynccontextmanager
async def workers(
    tmp_path: Path, dsn: str, schema: str, queues: str
) -> AsyncIterator[list[asyncio.subprocess.Process]]:
    script = tmp_path / "limited_worker.py"
    script.write_text(WORKER_SCRIPT)
    async with worker_processes(script, WORKERS, dsn, schema, queues) as procs:
        yield procs


async def test_four_worker_processes_never_exceed_the_global_limits(
    queue: QueueFixture, tmp_path: Path
) -> None:
    dsn, schema, conn = queue
    # Queue "limited": at most 3 running in all workers. Task "b": at most 2 running, in
    # whichever queue (it also has tasks in the unlimited queue "other").
    await limit_queue(conn, "limited", max_running=3, schema=schema)
    await limit_task(conn, "b", max_running=2, schema=schema)
    work = {"work": 0.03}
    total = 120
    async with workers(tmp_path, dsn, schema, '["limited", "other"]'):
        async with conn.transaction():  # all at once, once every process is claiming
            await enqueue_many(conn, Task("a"), [work] * 40, schema=schema, queue="limited")
            await enqueue_many(conn, Task("b"), [work] * 20, schema=schema, queue="limited")
            await enqueue_many(conn, Task("b"), [work] * 20, schema=schema, queue="other")
            await enqueue_many(conn, Task("a"), [work] * 40, schema=schema, queue="other")
        await wait_until(lambda: all_succeeded(conn, schema, total), timeout=120, interval=0.1)
    rows = await conn.fetch(f'SELECT * FROM "{schema}".observed')
    assert len(rows) == total  # each task ran once
    limited = [(r["started"], r["ended"]) for r in rows if r["queue"] == "limited"]
    named_b = [(r["started"], r["ended"]) for r in rows if r["task_name"] == "b"]
    other = [(r["started"], r["ended"]) for r in rows if r["queue"] == "other"]
    # Sampled from the database by every handler as it started.
    assert max(r["queue_running"] for r in rows if r["queue"] == "limited") <= 3
    assert max(r["name_running"] for r in rows if r["task_name"] == "b") <= 2
    # Recorded by the handlers: never more at once than the limits...
    assert most_at_once(limited) <= 3
    assert most_at_once(named_b) <= 2
    # ...which were reached, while the unlimited queue ran wider (the limits did bite).
    assert most_at_once(limited) == 3
    assert most_at_once(named_b) == 2
    assert most_at_once(other) > 3


async def test_four_worker_processes_share_a_rate_limit(
    queue: QueueFixture, tmp_path: Path
) -> None:
    dsn, schema, conn = queue
    count, period = 5, timedelta(milliseconds=400)
    await limit_queue(conn, "rated", rate_limit=count, per=period, schema=schema)
    await limit_task(conn, "b", rate_limit=3, per=period, schema=schema)
    async with workers(tmp_path, dsn, schema, '["rated", "free"]'):
        async with conn.transaction():  # all at once, once every process is claiming
            await enqueue_many(conn, Task("a"), [{}] * 20, schema=schema, queue="rated")
            await enqueue_many(conn, Task("b"), [{}] * 9, schema=schema, queue="free")
            # Unlimited work that no single process can take alone (8 at once each).
            await enqueue_many(conn, Task("a"), [{"work": 0.2}] * 20, schema=schema, queue="free")
        await wait_until(lambda: all_succeeded(conn, schema, 49), timeout=120, interval=0.1)
    # The claim's own start instants (tasks.started_at): in any window of one period, at
    # most `count` starts, whichever worker made them.
    for queue_name, limit, name in (("rated", count, "a"), ("free", 3, "b")):
        starts: list[Any] = [
            r[0]
            for r in await conn.fetch(
                f'SELECT started_at FROM "{schema}".tasks WHERE queue = $1 AND task_name = $2 '
                "ORDER BY started_at",
                queue_name,
                name,
            )
        ]
        gaps = [later - earlier for earlier, later in zip(starts, starts[limit:], strict=False)]
        assert gaps, starts
        assert min(gaps) >= period, (queue_name, min(gaps))
    # Several processes claimed (which one wins each rate window is a race, and may repeat).
    workers_seen = await conn.fetchval(f'SELECT count(DISTINCT worker_id) FROM "{schema}".tasks')
    assert workers_seen > 1
