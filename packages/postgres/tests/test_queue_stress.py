"""Stress (RELIABILITY row 17): 4 worker processes, 2,000 tasks, random SIGKILLs and restarts.

Then a checker in the manner of Jepsen's total-queue checker, over the tasks table, the
attempt history and an execution log the handler writes (task, run id, attempt, worker):

- every task reached ``succeeded``, and its history holds exactly one success;
- every task executed at least once, always under the task's own ``run_id``;
- no (task, attempt) executed twice: a claim is never handed to two workers;
- the success was recorded by the worker that executed that very attempt, the last one
  (nothing fenced out finalized anything);
- no connection is left ``idle in transaction``.

Besides SIGKILLs, a worker is sometimes frozen (SIGSTOP) past its leases and resumed, so
stale completions race the new holders and must be fenced out. Faults follow a seeded
random schedule; every wait is generous (leases are 1.5 s), so a slow
machine makes the test slower, never red.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import asyncpg
import pytest

from queue_support import check_total_queue
from steeple.postgres.queue import EnqueueOptions, Task, enqueue_many

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

TASKS = 2000
WORKERS = 4
KILL_PHASE = 25.0  # at most this long of random kills (the run stays around 20-40 s)
MIN_KILLS = 2  # ... but at least this many kills of a worker running tasks, however long
LEASE = timedelta(seconds=1.5)

WORKER_SCRIPT = """
import asyncio, json, signal, sys
import asyncpg, attrs
from steeple.postgres.queue import Scheduler, Task

async def main() -> None:
    dsn, schema, worker_id = sys.argv[1:4]
    log = await asyncpg.create_pool(
        dsn, min_size=1, max_size=4, server_settings={"application_name": "stress-log"})
    # The worker opens its own pool from the DSN (keepalives, application name).
    worker = Scheduler(dsn, worker_id=worker_id, schema=schema, poll_interval=0.2,
                       maintenance_interval=0.2, concurrency=8, query_timeout=10)

    async def handler(ctx, args):
        await log.execute(
            f'INSERT INTO "{schema}".executions (task_id, run_id, attempt, worker_id) '
            "VALUES ($1, $2, $3, $4)", ctx.task_id, ctx.run_id, ctx.attempt, worker_id)
        await asyncio.sleep(args["sleep"])

    worker.register(Task("stress"), handler)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    print("ready", flush=True)
    await worker.run_until_shutdown(stop, drain_timeout=10)
    print("stats " + json.dumps(attrs.asdict(worker.stats)), flush=True)
    await log.close()

asyncio.run(main())
"""


@pytest.fixture
async def stress_queue(
    queue: tuple[str, str, asyncpg.Connection],
) -> tuple[str, str, asyncpg.Connection]:
    """The shared ``queue`` (conftest.py) with the execution log the workers write."""
    _dsn, schema, conn = queue
    # No unique constraint: the checker, not the database, must find duplicates.
    await conn.execute(
        f'CREATE TABLE "{schema}".executions (task_id bigint NOT NULL, run_id uuid NOT NULL, '
        "attempt int NOT NULL, worker_id text NOT NULL)"
    )
    return queue


class Fleet:
    """Worker processes by slot; a killed slot is restarted under a new worker id."""

    def __init__(self, script: Path, dsn: str, schema: str) -> None:
        self.script, self.dsn, self.schema = script, dsn, schema
        self.procs: dict[int, asyncio.subprocess.Process] = {}
        self.ids: dict[int, str] = {}
        self.generation = 0
        self.kills = 0
        self.pauses = 0
        self.stats: list[dict[str, int]] = []

    async def start(self, slot: int) -> None:
        self.generation += 1
        self.ids[slot] = f"w{slot}-{self.generation}"
        proc = await asyncio.create_subprocess_exec(
            sys.executable, str(self.script), self.dsn, self.schema, self.ids[slot],
            stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 60)
        assert line.strip() == b"ready", line
        self.procs[slot] = proc

    async def kill(self, slot: int) -> None:
        proc = self.procs.pop(slot)
        with contextlib.suppress(ProcessLookupError):
            proc.kill()  # SIGKILL works on a stopped process too
        await proc.wait()
        self.kills += 1

    async def stop_all(self) -> None:
        for proc in self.procs.values():
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGCONT)
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            assert proc.stdout is not None
            out = await asyncio.wait_for(proc.stdout.read(), 60)
            await proc.wait()
            for line in out.decode().splitlines():
                if line.startswith("stats "):
                    self.stats.append(json.loads(line[6:]))
        self.procs.clear()
        self.ids.clear()

    async def kill_all(self) -> None:
        for slot in list(self.procs):
            await self.kill(slot)


async def test_random_kills_lose_nothing_and_run_nothing_twice(
    stress_queue: tuple[str, str, asyncpg.Connection], tmp_path: Path
) -> None:
    dsn, schema, conn = stress_queue
    s = f'"{schema}"'
    rng = random.Random(17)
    # ~0.2 s each at 4 x 8 in flight: the run lasts long enough for about ten kills.
    args = [{"sleep": rng.uniform(0.1, 0.3)} for _ in range(TASKS)]
    ids = await enqueue_many(
        conn,
        Task("stress"),
        args,
        EnqueueOptions(lease_duration=LEASE, max_attempts=100),
        schema=schema,
    )
    assert len(ids) == TASKS

    script = tmp_path / "stress_worker.py"
    script.write_text(WORKER_SCRIPT)
    fleet = Fleet(script, dsn, schema)
    started = time.monotonic()
    try:
        await asyncio.gather(*(fleet.start(slot) for slot in range(WORKERS)))
        kills_from = time.monotonic()  # a slow start must not eat the kill phase

        async def succeeded() -> int:
            return int(
                await conn.fetchval(f"SELECT count(*) FROM {s}.tasks WHERE state = 'succeeded'")
            )

        async def running_on(slot: int) -> int:
            return int(
                await conn.fetchval(
                    f"SELECT count(*) FROM {s}.tasks WHERE state = 'running' AND worker_id = $1",
                    fleet.ids[slot],
                )
            )

        # Every 0.3-1.0 s, while work remains: SIGKILL a random worker of slots 1-3 and
        # restart it, or (one time in four, three times at most) freeze slot 0 with work in
        # hand past its leases (SIGSTOP), then SIGCONT it: its late outcomes must be fenced
        # out. Slot 0 is never killed, so its counters (reported at the end) show it.
        # The schedule goes on, however slow the machine, until MIN_KILLS workers died with
        # work in hand: a kill is counted only when its victim was running tasks.
        while (
            fleet.kills < MIN_KILLS or time.monotonic() - kills_from < KILL_PHASE
        ) and await succeeded() < TASKS:
            await asyncio.sleep(rng.uniform(0.3, 1.0))
            if fleet.pauses < 3 and rng.random() < 0.25 and await running_on(0):
                fleet.procs[0].send_signal(signal.SIGSTOP)
                await asyncio.sleep(LEASE.total_seconds() + 1.0)
                fleet.procs[0].send_signal(signal.SIGCONT)
                fleet.pauses += 1
            else:
                slot = rng.randrange(1, WORKERS)
                if await running_on(slot):
                    await fleet.kill(slot)
                    await fleet.start(slot)
        kill_phase = time.monotonic() - kills_from

        deadline = time.monotonic() + 90
        while await succeeded() < TASKS:
            assert time.monotonic() < deadline, await conn.fetch(
                f"SELECT state, count(*) FROM {s}.tasks GROUP BY state"
            )
            await asyncio.sleep(0.2)
        await fleet.stop_all()
    finally:
        await fleet.kill_all()
    elapsed = time.monotonic() - started

    # --- the checker ------------------------------------------------------------------------
    checked = await check_total_queue(conn, schema)
    assert checked["tasks"] == TASKS
    # The log pool of the workers is not the queue's: it must not sit in a transaction either.
    assert not await conn.fetchval(
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'stress-log' "
        "AND state LIKE 'idle in transaction%'"
    )

    executions = await conn.fetchval(f"SELECT count(*) FROM {s}.executions")
    reruns = executions - TASKS
    recovered = await conn.fetchval(
        f"SELECT count(*) FROM {s}.attempts WHERE outcome = 'lease_expired'"
    )
    assert fleet.kills >= MIN_KILLS, "the kill schedule did not run"
    rejected = sum(st["rejected_completions"] for st in fleet.stats)
    lost = sum(st["lease_lost"] for st in fleet.stats)
    if fleet.pauses:
        # The frozen worker held work past its leases: it noticed, or was refused.
        assert rejected + lost >= 1, fleet.stats
    print(
        f"stress: {TASKS} tasks, {fleet.kills} kills, {fleet.pauses} pauses "
        f"({rejected} late outcomes fenced) in {kill_phase:.1f} s, "
        f"{reruns} re-executions, {recovered} expired leases recovered, "
        f"total {elapsed:.1f} s, worker stats {fleet.stats}"
    )
