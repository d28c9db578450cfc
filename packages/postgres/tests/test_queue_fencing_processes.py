"""A stale worker process's writes while another worker holds its task are all refused.

The stale worker is a real process, stopped (SIGSTOP) while its handler runs until its
lease lapses and another worker has claimed the task and is still running it. Then it is
continued: its renewal, its success, its retry, its permanent failure and its hand-back at
shutdown each carry the old lease token and must change nothing of the new holder's task
(a check on the task's state alone would pass, since the task is running again).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import signal
import sys
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import asyncpg
import pytest

import queue_support
from queue_support import QueueFixture
from steeple.postgres.queue import EnqueueOptions, JobContext, Scheduler, Task, enqueue, run_state

pytestmark = pytest.mark.slow

FENCED: Task[Any] = Task("fenced")

# argv: DSN, schema, worker id, drain timeout. The handler of the first attempt logs that
# it started, then (by args["outcome"]) waits for the test's "go" and succeeds, retries or
# fails; or waits to learn its lease is lost ("renew"); or runs until the drain cancels it
# ("hand-back"). The stats are printed at the end.
STALE_WORKER = """
import asyncio, json, signal, sys
from datetime import timedelta
import asyncpg, attrs
from steeple.postgres.queue import JobError, Scheduler, Task

async def main() -> None:
    dsn, schema, worker_id, drain = sys.argv[1:5]
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=4)
    worker = Scheduler(pool, worker_id=worker_id, schema=schema, poll_interval=0.1,
                       maintenance_interval=0.2, concurrency=1)

    async def log(ctx, what):
        await pool.execute(f'INSERT INTO "{schema}".stale_log VALUES ($1, $2)', ctx.task_id, what)

    async def handler(ctx, args):
        await log(ctx, "started")
        outcome = args["outcome"]
        if outcome == "renew":
            await asyncio.wait_for(ctx.lease_lost.wait(), 120)
            await log(ctx, "lease lost")
            return
        if outcome == "hand-back":
            await asyncio.sleep(3600)
        while not await pool.fetchval(f'SELECT count(*) FROM "{schema}".go'):
            await asyncio.sleep(0.05)
        if outcome == "retry":
            raise JobError.retry("stale retry", delay=timedelta(0))
        if outcome == "fail":
            raise JobError.permanent("stale failure")

    worker.register(Task("fenced"), handler)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    print("ready", flush=True)
    await worker.run_until_shutdown(stop, drain_timeout=float(drain))
    print("stats " + json.dumps(attrs.asdict(worker.stats)), flush=True)
    await pool.close()

asyncio.run(main())
"""

wait_until = functools.partial(queue_support.wait_until, interval=0.05, timeout=60)


@contextlib.asynccontextmanager
async def stale_worker(
    tmp_path: Path, dsn: str, schema: str, drain: float
) -> AsyncIterator[asyncio.subprocess.Process]:
    """The worker process named ``stale``; continued and killed at the end if still alive."""
    script = tmp_path / "stale_worker.py"
    script.write_text(STALE_WORKER)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(script), dsn, schema, "stale", str(drain),
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 60)
        assert line.strip() == b"ready", line
        yield proc
    finally:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGCONT)
                proc.kill()
            await proc.wait()


async def _stats_at_exit(proc: asyncio.subprocess.Process) -> dict[str, int]:
    """Stop the worker (SIGTERM: it drains and writes what it buffered); return its stats."""
    proc.send_signal(signal.SIGTERM)
    assert proc.stdout is not None
    out = await asyncio.wait_for(proc.stdout.read(), 60)
    await proc.wait()
    for line in out.decode().splitlines():
        if line.startswith("stats "):
            return dict(json.loads(line[6:]))
    raise AssertionError(f"no stats from the stale worker: {out!r}")


async def _logged(conn: asyncpg.Connection, schema: str, what: str) -> bool:
    return bool(
        await conn.fetchval(f'SELECT count(*) FROM "{schema}".stale_log WHERE what = $1', what)
    )


async def _history(conn: asyncpg.Connection, schema: str, task_id: int) -> list[tuple[Any, ...]]:
    rows = await conn.fetch(
        f'SELECT attempt, outcome, worker_id FROM "{schema}".attempts WHERE task_id = $1 '
        "ORDER BY id",
        task_id,
    )
    return [tuple(r) for r in rows]


@pytest.mark.parametrize("outcome", ["succeed", "retry", "fail", "hand-back", "renew"])
async def test_a_stale_workers_writes_change_nothing_while_another_worker_holds_the_task(
    queue: QueueFixture, tmp_path: Path, outcome: str
) -> None:
    dsn, schema, conn = queue
    await conn.execute(f'CREATE TABLE "{schema}".stale_log (task_id bigint, what text)')
    await conn.execute(f'CREATE TABLE "{schema}".go (at timestamptz)')
    # A lease of 6 s gives a renewal 3 s to answer: one that fails while the lease has
    # lapsed by the worker's own clock also loses the lease, without asking the database.
    task = await enqueue(
        conn,
        FENCED,
        {"outcome": outcome},
        EnqueueOptions(lease_duration=timedelta(seconds=6)),
        schema=schema,
    )
    hold = asyncio.Event()
    ran: list[int] = []

    async def holder(ctx: JobContext, args: Any) -> None:
        ran.append(ctx.attempt)
        await hold.wait()

    fresh = Scheduler(
        dsn,
        worker_id="fresh",
        schema=schema,
        poll_interval=0.1,
        maintenance_interval=0.2,
        concurrency=1,
    )
    fresh.register(FENCED, holder)
    stop = asyncio.Event()
    async with stale_worker(tmp_path, dsn, schema, 0.5 if outcome == "hand-back" else 30) as stale:
        await wait_until(lambda: _logged(conn, schema, "started"))
        stale.send_signal(signal.SIGSTOP)
        running = asyncio.create_task(fresh.run_until_shutdown(stop))
        try:
            await wait_until(lambda: ran == [2])  # the lease lapsed; the new holder runs it
            await conn.execute(f'INSERT INTO "{schema}".go VALUES (now())')
            stale.send_signal(signal.SIGCONT)
            if outcome == "renew":
                await wait_until(lambda: _logged(conn, schema, "lease lost"))
            stats = await _stats_at_exit(stale)
            row = await run_state(conn, task.id, schema=schema)
            assert (row.state.value, row.worker_id, row.attempts) == ("running", "fresh", 2)
            assert await _history(conn, schema, task.id) == [(1, "lease_expired", "stale")]
            hold.set()
            await wait_until(lambda: fresh.stats.succeeded == 1)
        finally:
            hold.set()
            stop.set()
            await running
    assert fresh.stats.rejected_completions == 0
    assert stats["succeeded"] == stats["released"] == 0
    if outcome == "succeed":
        assert stats["rejected_completions"] == 1
    if outcome == "renew":
        assert stats["lease_lost"] == 1
    row = await run_state(conn, task.id, schema=schema)
    assert (row.state.value, row.worker_id, row.attempts) == ("succeeded", "fresh", 2)
    assert await _history(conn, schema, task.id) == [
        (1, "lease_expired", "stale"),
        (2, "succeeded", "fresh"),
    ]
