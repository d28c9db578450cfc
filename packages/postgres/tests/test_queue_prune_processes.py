"""Pruning while real worker processes claim, run and finish tasks.

Two worker processes run the queue: they finish quick tasks all along, hold long-running
ones, wait out a retry's backoff and leave a dependent waiting on a parent that has not
finished. Meanwhile the operator's ``steeple purge --tasks`` runs as its own process, in
batches, with a retention of an hour. Tasks that finished more than an hour ago (their
finish time set back) must go, a batch at a time and never more than the limit; every
pending, running and retrying task (whatever its age), every task that finished within
the hour and every finished parent whose dependent still waits must stay as it was.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import re
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
from steeple.postgres.queue import EnqueueOptions, Task, enqueue, enqueue_many

pytestmark = pytest.mark.slow

WORK: Task[Any] = Task("work")
LIMIT = 3
"""The purge's batch size: fewer than the tasks it has to remove, so it runs in batches."""

# argv: DSN, schema, worker id. By args["do"], the handler returns at once ("quick"), runs
# until the process ends ("hold"), fails for retry an hour later ("retry") or for good
# ("fail").
WORKER = """
import asyncio, signal, sys
from datetime import timedelta
import asyncpg
from steeple.postgres.queue import JobError, Scheduler, Task

async def main() -> None:
    dsn, schema, worker_id = sys.argv[1:4]
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=6)
    worker = Scheduler(pool, worker_id=worker_id, schema=schema, poll_interval=0.1,
                       maintenance_interval=0.2, concurrency=8)

    async def handler(ctx, args):
        if args["do"] == "hold":
            await asyncio.sleep(3600)
        if args["do"] == "retry":
            raise JobError.retry("later", delay=timedelta(hours=1))
        if args["do"] == "fail":
            raise JobError.permanent("for good")

    worker.register(Task("work"), handler)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    print("ready", flush=True)
    await worker.run_until_shutdown(stop, drain_timeout=1)
    await pool.close()

asyncio.run(main())
"""

wait_until = functools.partial(queue_support.wait_until, interval=0.05, timeout=60)


@contextlib.asynccontextmanager
async def _worker(tmp_path: Path, dsn: str, schema: str, worker_id: str) -> AsyncIterator[None]:
    script = tmp_path / "prune_worker.py"
    script.write_text(WORKER)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(script), dsn, schema, worker_id, stdout=asyncio.subprocess.PIPE
    )
    try:
        assert proc.stdout is not None
        assert (await asyncio.wait_for(proc.stdout.readline(), 60)).strip() == b"ready"
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGKILL)
        await proc.wait()


async def _purge(dsn: str, schema: str) -> int:
    """Run ``steeple purge --tasks`` as a process; return how many tasks it removed."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEEPLE_")}
    env |= {"STEEPLE_DATABASE_URL": dsn, "STEEPLE_QUEUE_SCHEMA": schema}
    argv = ["purge", "--tasks", "--older-than", "1h", "--limit", str(LIMIT), "--yes"]
    steeple = Path(sys.executable).with_name("steeple")
    proc = await asyncio.create_subprocess_exec(
        str(steeple), *argv, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 0, (out, err)
    found = re.search(r"purged (\d+) terminal task", out.decode())
    assert found is not None, out
    return int(found[1])


async def _states(conn: asyncpg.Connection, schema: str) -> dict[int, tuple[str, int]]:
    rows = await conn.fetch(f'SELECT id, state, attempts FROM "{schema}".tasks')
    return {r["id"]: (r["state"], r["attempts"]) for r in rows}


async def _in_states(
    conn: asyncpg.Connection, schema: str, ids: list[int], state: str, attempts: int = 1
) -> bool:
    count = await conn.fetchval(
        f'SELECT count(*) FROM "{schema}".tasks WHERE id = ANY($1::bigint[]) '
        "AND state::text = $2 AND attempts = $3",
        ids,
        state,
        attempts,
    )
    return bool(count == len(ids))


async def _age(conn: asyncpg.Connection, schema: str, ids: list[int]) -> None:
    """Set these tasks' creation (and finish, if any) two hours back."""
    await conn.execute(
        f"UPDATE \"{schema}\".tasks SET created_at = created_at - interval '2 hours', "
        "finished_at = finished_at - interval '2 hours' WHERE id = ANY($1::bigint[])",
        ids,
    )


async def test_purge_removes_only_old_finished_tasks_while_worker_processes_run(
    queue: QueueFixture, tmp_path: Path
) -> None:
    dsn, schema, conn = queue
    once = EnqueueOptions(max_attempts=1)
    retried = EnqueueOptions(max_attempts=5)
    later = EnqueueOptions(delay=timedelta(hours=1))
    async with contextlib.AsyncExitStack() as stack:
        for i in range(2):
            await stack.enter_async_context(_worker(tmp_path, dsn, schema, f"w{i}"))
        old = await enqueue_many(conn, WORK, [{"do": "quick"}] * 4, schema=schema)
        old += await enqueue_many(conn, WORK, [{"do": "fail"}] * 1, once, schema=schema)
        held = await enqueue_many(conn, WORK, [{"do": "hold"}] * 3, schema=schema)
        retrying = await enqueue_many(conn, WORK, [{"do": "retry"}] * 2, retried, schema=schema)
        waiting = await enqueue_many(conn, WORK, [{"do": "quick"}] * 2, later, schema=schema)
        parent = (await enqueue(conn, WORK, {"do": "quick"}, schema=schema)).id
        blocker = (await enqueue(conn, WORK, {"do": "quick"}, later, schema=schema)).id
        child = (
            await enqueue(conn, WORK, {"do": "quick"}, schema=schema, after=[parent, blocker])
        ).id
        await wait_until(lambda: _in_states(conn, schema, [*old[:4], parent], "succeeded"))
        await wait_until(lambda: _in_states(conn, schema, old[4:], "failed"))
        await wait_until(lambda: _in_states(conn, schema, held, "running"))
        await wait_until(lambda: _in_states(conn, schema, retrying, "pending"))  # retried once
        live = held + retrying + waiting + [blocker, child]
        await _age(conn, schema, [*old, *live, parent])
        before = await _states(conn, schema)
        assert before[child][0] == "waiting"

        # Fresh work the workers finish while the purge runs: finished, but within the hour.
        fresh = await enqueue_many(conn, WORK, [{"do": "quick"}] * 30, schema=schema)
        batches = [await _purge(dsn, schema)]
        while batches[-1] == LIMIT:
            batches.append(await _purge(dsn, schema))
        await wait_until(lambda: _in_states(conn, schema, fresh, "succeeded"))
        after = await _states(conn, schema)

    assert batches == [LIMIT] * (len(old) // LIMIT) + [len(old) % LIMIT]
    assert not set(old) & set(after)  # every old finished task is gone
    assert {i: after[i] for i in [*live, parent]} == {i: before[i] for i in [*live, parent]}
    assert set(fresh) <= set(after)  # finished within the hour: kept
