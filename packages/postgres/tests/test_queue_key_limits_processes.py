"""Per-key limits across worker processes: four real processes share each key's limits.

Handlers record, in server time, when they start and end, with the task's key, and sample
what the database says of the key runs when they start; the checks run on those records
after the work is done. One key is saturated with a long backlog ahead of every other
key's work in claim order: the others must run beside it, not after it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import defaultdict
from collections.abc import AsyncIterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from queue_support import (
    QueueFixture,
    all_succeeded,
    most_at_once,
    wait_until,
    worker_processes,
)
from steeple.postgres.queue import EnqueueOptions, Task, enqueue_many, limit_queue, limit_task

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
            f'INSERT INTO "{schema}".observed (task_id, task_name, queue, limit_key, started,'
            " key_running) SELECT $1, $2, $3, t.limit_key, clock_timestamp(), "
            f'(SELECT count(*) FROM "{schema}".tasks r WHERE r.queue = t.queue '
            "AND r.limit_key = t.limit_key AND r.state = 'running') "
            f'FROM "{schema}".tasks t WHERE t.id = $1', ctx.task_id, ctx.task_name, ctx.queue)
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
        "queue text, limit_key text, started timestamptz, ended timestamptz, key_running int)"
    )
    return queue


@contextlib.asynccontextmanager
async def workers(
    tmp_path: Path, dsn: str, schema: str, queues: str
) -> AsyncIterator[list[asyncio.subprocess.Process]]:
    script = tmp_path / "keyed_worker.py"
    script.write_text(WORKER_SCRIPT)
    async with worker_processes(script, WORKERS, dsn, schema, queues) as procs:
        yield procs


async def _enqueue_keyed(
    conn: asyncpg.Connection, schema: str, task: str, queue: str, key: str, n: int, work: float
) -> None:
    options = EnqueueOptions(queue=queue, limit_key=key)
    await enqueue_many(conn, Task(task), [{"work": work}] * n, options, schema=schema)


async def test_four_worker_processes_hold_every_key_to_its_limit_and_skip_a_full_key(
    queue: QueueFixture, tmp_path: Path
) -> None:
    dsn, schema, conn = queue
    # Queue "imports": one task per customer at once. Task "b": two per customer at once,
    # in whichever queue (it also has tasks in the queue "other", which has no limits).
    await limit_queue(conn, "imports", max_running_per_key=1, schema=schema)
    await limit_task(conn, "b", max_running_per_key=2, schema=schema)
    customers = [f"customer-{i}" for i in range(16)]
    async with workers(tmp_path, dsn, schema, '["imports", "other"]'):
        async with conn.transaction():  # all at once, once every process is claiming
            # The saturated key's backlog comes first in claim order.
            await _enqueue_keyed(conn, schema, "a", "imports", "big", 24, 0.03)
            for key in customers:
                await _enqueue_keyed(conn, schema, "a", "imports", key, 3, 0.03)
            for key in customers[:4]:
                await _enqueue_keyed(conn, schema, "b", "imports", key, 3, 0.03)
                await _enqueue_keyed(conn, schema, "b", "other", key, 3, 0.03)
        total = 24 + 16 * 3 + 4 * 6
        await wait_until(lambda: all_succeeded(conn, schema, total), timeout=120, interval=0.1)
    rows = await conn.fetch(f'SELECT * FROM "{schema}".observed')
    assert len(rows) == total  # each task ran once
    per_key: dict[str, list[tuple[datetime, datetime]]] = defaultdict(list)
    b_per_key: dict[str, list[tuple[datetime, datetime]]] = defaultdict(list)
    for r in rows:
        if r["queue"] == "imports":
            per_key[r["limit_key"]].append((r["started"], r["ended"]))
            # Sampled from the database by every handler as it started.
            assert r["key_running"] <= 1, r
        if r["task_name"] == "b":
            b_per_key[r["limit_key"]].append((r["started"], r["ended"]))
    # Recorded by the handlers: never more of a key at once than its limits...
    assert max(most_at_once(spans) for spans in per_key.values()) == 1
    assert max(most_at_once(spans) for spans in b_per_key.values()) == 2
    # ...while the queue as a whole ran many keys at once.
    everything = [span for spans in per_key.values() for span in spans]
    assert most_at_once(everything) > 4
    # No head-of-line blocking: the other keys ran while the saturated key's backlog
    # (ahead of them in claim order) still waited, most of them before its last start.
    last_big = max(start for start, _end in per_key["big"])
    others = [start for key, spans in per_key.items() if key != "big" for start, _ in spans]
    assert sum(start < last_big for start in others) > len(others) // 2


async def test_four_worker_processes_share_a_per_key_rate_and_keys_do_not_wait_for_each_other(
    queue: QueueFixture, tmp_path: Path
) -> None:
    dsn, schema, conn = queue
    count, period = 3, timedelta(milliseconds=400)
    await limit_queue(conn, "mail", rate_limit_per_key=count, per_key=period, schema=schema)
    tenants = [f"tenant-{i}" for i in range(6)]
    async with workers(tmp_path, dsn, schema, '["mail"]'):
        async with conn.transaction():  # all at once, once every process is claiming
            for key in tenants:
                await _enqueue_keyed(conn, schema, "a", "mail", key, 9, 0)
        await wait_until(lambda: all_succeeded(conn, schema, 54), timeout=120, interval=0.1)
    starts: dict[str, list[Any]] = defaultdict(list)
    for r in await conn.fetch(
        f'SELECT limit_key, started_at FROM "{schema}".tasks ORDER BY started_at'
    ):
        starts[r["limit_key"]].append(r["started_at"])
    # The claim's own start instants: in any window of one period, at most `count` starts
    # of one key, whichever worker made them.
    for key, at in starts.items():
        gaps = [later - earlier for earlier, later in zip(at, at[count:], strict=False)]
        assert min(gaps) >= period, (key, min(gaps))
    # Every key made its first starts in the first period (no key waited for another's
    # window), and several processes claimed.
    first = min(at[0] for at in starts.values())
    assert all(at[count - 1] < first + period for at in starts.values())
    workers_seen = await conn.fetchval(f'SELECT count(DISTINCT worker_id) FROM "{schema}".tasks')
    assert workers_seen > 1
