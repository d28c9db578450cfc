"""Where an idle pickup's milliseconds go: a traced run of one steeple worker.

Run:  .venv/bin/python benchmarks/bench_pickup_trace.py --dsn postgresql://postgres@127.0.0.1:5432/test

One task at a time is enqueued on an idle queue (the worker waiting on its LISTEN), as
``bench_queue.py`` measures pickup latency, and each step is stamped on this process's
clock (the enqueuer and the worker share it): the enqueue call returned (its durable
commit acknowledged), the worker's listener heard the NOTIFY, the claim was sent, its
answer came back, the handler started. Printed: each step's p50/p90/p99 from just before
the enqueue call, and the median of each interval. Then, on two idle connections of their
own, the median round trip of ``SELECT 1``, of a one-row insert with a durable commit and
with ``synchronous_commit = off`` (the difference is the commit's WAL flush), of the
enqueue statement and of the worker's claim statement taking one task, each with the CPU
its server backend spent (``/proc/PID/schedstat``; only when PostgreSQL runs on this
machine).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import asyncpg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._run_names import drop_schemas, run_name

SCHEMA = run_name("bench_pickup_trace")  # this run's own: runs at once do not mix
STEPS = ("enqueue returned", "notify heard", "claim sent", "claim answered", "handler started")


def _cpu_ns(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/schedstat") as f:
            return int(f.read().split()[0])
    except OSError:
        return None


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def traced_pickups(dsn: str, samples: int) -> list[dict[str, float]]:
    """Stamp each step of ``samples`` idle pickups (ms from just before the enqueue call)."""
    from steeple.postgres.queue import Scheduler, Task, _claiming, _wakeups, enqueue

    marks: dict[str, float] = {}
    on_notify = _wakeups.Wakeups.on_notify
    send = _claiming.Claimer._send

    def heard(self: Any, payload: str) -> None:
        marks.setdefault("notify heard", time.perf_counter())
        on_notify(self, payload)

    async def sent(self: Any, *args: Any, **kwargs: Any) -> Any:
        marks.setdefault("claim sent", time.perf_counter())
        answer = await send(self, *args, **kwargs)
        if answer and any(row[1] is not None for row in answer):
            marks.setdefault("claim answered", time.perf_counter())
        return answer

    _wakeups.Wakeups.on_notify = heard  # type: ignore[method-assign]
    _claiming.Claimer._send = sent  # type: ignore[method-assign]
    conn = await asyncpg.connect(dsn)
    started: asyncio.Queue[float] = asyncio.Queue()
    noop: Task[dict[str, int]] = Task("noop")

    async def handler(ctx: Any, args: Any) -> None:
        started.put_nowait(time.perf_counter())

    worker = Scheduler(
        dsn, worker_id="trace", schema=SCHEMA, concurrency=200, batch_size=200,
        poll_interval=1.0, maintenance_interval=5.0,
    )  # fmt: skip
    worker.register(noop, handler)
    stop = asyncio.Event()
    run = asyncio.create_task(worker.run_until_shutdown(stop))
    rows = []
    try:
        await asyncio.sleep(1.0)
        for i in range(samples + 5):
            await asyncio.sleep(0.02)  # idle: the worker is waiting, not mid-poll
            marks.clear()
            t0 = time.perf_counter()
            await enqueue(conn, noop, {}, schema=SCHEMA)
            marks["enqueue returned"] = time.perf_counter()
            marks["handler started"] = await asyncio.wait_for(started.get(), 30)
            if i >= 5 and all(step in marks for step in STEPS):
                rows.append({step: (marks[step] - t0) * 1000 for step in STEPS})
    finally:
        stop.set()
        await run
        await conn.close()
        _wakeups.Wakeups.on_notify = on_notify  # type: ignore[method-assign]
        _claiming.Claimer._send = send  # type: ignore[method-assign]
    return rows


async def round_trips(dsn: str, rounds: int) -> dict[str, tuple[float, float | None]]:
    """Median round trip (ms) and backend CPU (ms) of each statement of the pickup path."""
    from steeple.postgres.queue import Task
    from steeple.postgres.queue._enqueue import _params
    from steeple.postgres.queue._sql import queue_sql
    from steeple.postgres.queue.tasks import EnqueueOptions

    sql = queue_sql(SCHEMA)
    params = _params(sql, Task("noop"), "{}", EnqueueOptions(), None)
    producer, claimer = await asyncpg.connect(dsn), await asyncpg.connect(dsn)
    pids = {id(c): int(await c.fetchval("SELECT pg_backend_pid()")) for c in (producer, claimer)}
    table = f'"{SCHEMA}".flush_probe'
    await producer.execute(f"CREATE TABLE {table} (x int)")
    relaxed = "(SELECT set_config('synchronous_commit', 'off', true)) AS r"
    statements: list[tuple[str, asyncpg.Connection, str, Any]] = [
        ("SELECT 1", claimer, "SELECT 1", ()),
        ("insert, durable commit", producer, f"INSERT INTO {table} VALUES (1)", ()),
        ("insert, commit not flushed", producer,
         f"INSERT INTO {table} SELECT 1 FROM {relaxed}", ()),
        ("enqueue (durable)", producer, sql.enqueue, params),
        ("claim of one task", claimer, sql.claim_timed, None),
    ]  # fmt: skip
    walls: dict[str, list[float]] = {s[0]: [] for s in statements}
    cpus: dict[str, list[float]] = {s[0]: [] for s in statements}
    try:
        for i in range(rounds + 5):
            for label, conn, text, args in statements:
                await asyncio.sleep(0.005)
                if args is None:  # the claim: the task the enqueue above made
                    args = (["default"], ["1"], ["noop"], "trace", time.time() + 30,
                            [None], [None], [None])  # fmt: skip
                cpu0, t0 = _cpu_ns(pids[id(conn)]), time.perf_counter()
                await conn.fetch(text, *args)
                wall, cpu1 = time.perf_counter() - t0, _cpu_ns(pids[id(conn)])
                if i >= 5:
                    walls[label].append(wall * 1000)
                    if cpu0 is not None and cpu1 is not None:
                        cpus[label].append((cpu1 - cpu0) / 1e6)
    finally:
        await producer.close()
        await claimer.close()
    medians: dict[str, tuple[float, float | None]] = {}
    for label, values in walls.items():
        medians[label] = (
            statistics.median(values),
            statistics.median(cpus[label]) if cpus[label] else None,
        )
    return medians


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", default=os.environ.get("STEEPLE_TEST_DSN"), required=True)
    parser.add_argument("--samples", type=int, default=200, help="traced pickups")
    args = parser.parse_args()
    from steeple.postgres.queue import install

    conn = await asyncpg.connect(args.dsn)
    try:
        await conn.execute(f'DROP SCHEMA IF EXISTS "{SCHEMA}" CASCADE')  # a killed run's leftover
        await install(conn, schema=SCHEMA)
        rows = await traced_pickups(args.dsn, args.samples)
        print(f"idle pickup, {len(rows)} traced tasks (ms from just before the enqueue call)")
        print(f"  {'step':<18} {'p50':>7} {'p90':>7} {'p99':>7}   median since the step before")
        before = None
        for step in STEPS:
            values = [r[step] for r in rows]
            gap = statistics.median(r[step] - (r[before] if before else 0.0) for r in rows)
            print(
                f"  {step:<18} {statistics.median(values):7.2f} {_pct(values, 0.9):7.2f}"
                f" {_pct(values, 0.99):7.2f}   {gap:+.2f}"
            )
            before = step
        trips = await round_trips(args.dsn, args.samples)
        print("statements on idle connections (median round trip, median backend CPU; ms)")
        for label, (wall, cpu) in trips.items():
            print(f"  {label:<28} {wall:6.2f}   {'-' if cpu is None else f'{cpu:.2f}'}")
    finally:
        await conn.close()
        await drop_schemas(args.dsn, SCHEMA)
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
