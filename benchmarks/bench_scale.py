"""Scaling benchmark: N worker processes against one PostgreSQL primary, N = 1, 2, 4, 8.

Run:  .venv/bin/python benchmarks/bench_scale.py            (a private server, started here)
      .venv/bin/python benchmarks/bench_scale.py --dsn postgresql://postgres@127.0.0.1:5432/test

For each N, a fresh schema gets the same backlog of ``--tasks`` no-op tasks; then N
processes, each with its own event loop and its own ``Scheduler`` (as N ``steeple worker``
processes would be), start together and drain it. Printed per N: the wall time from the
start signal until every task is recorded succeeded, tasks/s, the ratio to N = 1, and the
CPU used meanwhile by the server's processes and by the worker processes, in cores
(CPU seconds per wall second, from ``/proc``; the server's share only for the private
server, whose processes are all this run's, on this host).

Not measured: network round trips (everything is on loopback), handlers that do work,
a server on its own machine, more than one host of workers.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import sys
import time
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any

import asyncpg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._private_pg import PrivateServer
from benchmarks._run_names import drop_schemas, run_name

# This run's own schema. Worker processes (spawned: they import this file afresh, with
# process ids of their own) are given it, never read it here.
SCHEMA = run_name("bench_scale")
CHUNK = 5000
TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pids: list[int]) -> float:
    """utime + stime of ``pids`` (those still alive), in seconds."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15)
    return total / TICK


def server_pids(data: Path) -> list[int]:
    """The postmaster of ``data`` and its children (backends, walwriter, ...)."""
    postmaster = int((data / "postmaster.pid").read_text().split()[0])
    pids = [postmaster]
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(fields[1]) == postmaster:  # ppid
            pids.append(int(entry.name))
    return pids


def worker_process(
    dsn: str,
    schema: str,
    index: int,
    settings: dict[str, Any],
    ready: Event,
    go: Event,
    stop: Event,
) -> None:
    asyncio.run(_worker(dsn, schema, index, settings, ready, go, stop))


async def _worker(
    dsn: str,
    schema: str,
    index: int,
    settings: dict[str, Any],
    ready: Event,
    go: Event,
    stop: Event,
) -> None:
    from steeple.postgres.queue import Scheduler, Task

    async def handler(ctx: Any, args: Any) -> None:
        return None

    worker = Scheduler(dsn, worker_id=f"scale-{index}", schema=schema, **settings)
    worker.register(Task("noop"), handler)
    ready.set()
    while not go.is_set():  # noqa: ASYNC110 (a cross-process flag, polled)
        await asyncio.sleep(0.005)
    shutdown = asyncio.Event()

    async def watch() -> None:
        while not stop.is_set():  # noqa: ASYNC110 (a cross-process flag, polled)
            await asyncio.sleep(0.05)
        shutdown.set()

    watcher = asyncio.create_task(watch())
    await worker.run_until_shutdown(shutdown)
    await watcher


async def prepare(dsn: str, tasks: int) -> None:
    from steeple.postgres.queue import Task, enqueue_many, install

    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(f'DROP SCHEMA IF EXISTS "{SCHEMA}" CASCADE')  # the previous N's
        await install(conn, schema=SCHEMA)
        noop: Task[dict[str, int]] = Task("noop")
        payloads = [{"i": i} for i in range(tasks)]
        for start in range(0, tasks, CHUNK):
            await enqueue_many(conn, noop, payloads[start : start + CHUNK], schema=SCHEMA)
        await conn.execute(f'ANALYZE "{SCHEMA}".tasks')
    finally:
        await conn.close()


async def wait_drained(dsn: str, tasks: int, timeout: float) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        deadline = time.monotonic() + timeout
        query = f"SELECT count(*) FROM \"{SCHEMA}\".tasks WHERE state = 'succeeded'"
        while await conn.fetchval(query) < tasks:
            if time.monotonic() > deadline:
                raise TimeoutError(f"backlog not drained within {timeout:.0f} s")
            await asyncio.sleep(0.05)
    finally:
        await conn.close()


def measure(
    dsn: str, n: int, tasks: int, settings: dict[str, Any], data: Path | None
) -> dict[str, float | None]:
    asyncio.run(prepare(dsn, tasks))
    context = multiprocessing.get_context("spawn")
    go, stop = context.Event(), context.Event()
    readies = [context.Event() for _ in range(n)]
    processes = [
        context.Process(
            target=worker_process,
            args=(dsn, SCHEMA, i, settings, readies[i], go, stop),
            daemon=True,
        )
        for i in range(n)
    ]
    for process in processes:
        process.start()
    try:
        for ready in readies:
            if not ready.wait(120):
                raise RuntimeError("a worker process did not start within 120 s")
        worker_pids = [p.pid for p in processes if p.pid is not None]
        pg_before = cpu_seconds(server_pids(data)) if data else None
        workers_before = cpu_seconds(worker_pids)
        t0 = time.perf_counter()
        go.set()
        asyncio.run(wait_drained(dsn, tasks, timeout=1800))
        elapsed = time.perf_counter() - t0
        workers_cpu = cpu_seconds(worker_pids) - workers_before
        pg_cpu = (
            cpu_seconds(server_pids(data)) - pg_before if data and pg_before is not None else None
        )
    finally:
        stop.set()
        for process in processes:
            process.join(30)
            if process.is_alive():
                process.kill()
                process.join()
    return {
        "seconds": elapsed,
        "rate": tasks / elapsed,
        "server_cores": None if pg_cpu is None else pg_cpu / elapsed,
        "worker_cores": workers_cpu / elapsed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dsn", help="an existing server (default: a private one)")
    parser.add_argument("--tasks", type=int, default=20_000, help="the backlog drained per N")
    parser.add_argument("--workers", default="1,2,4,8", help="the values of N")
    parser.add_argument("--concurrency", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=200)
    args = parser.parse_args()
    counts = [int(part) for part in args.workers.split(",")]
    settings: dict[str, Any] = {
        "concurrency": args.concurrency,
        "batch_size": args.batch_size,
        "poll_interval": 1.0,
        "maintenance_interval": 5.0,
        # On a loaded host the OS, not a handler, stalls the loops: no warnings for that.
        "loop_lag_threshold": None,
    }
    server = None
    dsn = args.dsn
    if dsn is None:
        server = PrivateServer({"shared_buffers": "128MB", "max_connections": "200"})
        dsn = server.dsn()
    data = server.data if server else None
    print(f"cores on this host: {os.cpu_count()}; load before: {os.getloadavg()}", flush=True)
    print(f"backlog {args.tasks} no-op tasks; per worker {settings}", flush=True)
    results: dict[int, dict[str, float | None]] = {}
    try:
        for n in counts:
            results[n] = measure(dsn, n, args.tasks, settings, data)
            load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
            row = results[n]
            print(
                f"  N={n}: {row['rate']:.0f} tasks/s ({row['seconds']:.1f} s), load {load}",
                flush=True,
            )
    finally:
        asyncio.run(drop_schemas(dsn, SCHEMA))
        if server:
            server.close()
    base = results[counts[0]]["rate"] or 1.0
    print()
    print(
        f"| N | tasks/s | vs N={counts[0]} | server CPU (cores) | workers CPU (cores) "
        "| server CPU per task | workers CPU per task |"
    )
    print("|---|---|---|---|---|---|---|")
    for n, row in results.items():
        server_cores = row["server_cores"]
        rate = row["rate"] or 1.0
        worker_cores = row["worker_cores"] or 0.0
        if server_cores is None:
            shown = per_task = "n/a (not a private server)"
        else:
            shown, per_task = f"{server_cores:.2f}", f"{server_cores / rate * 1e6:.0f} µs"
        print(
            f"| {n} | {rate:,.0f} | {rate / base:.2f}x | {shown} | {worker_cores:.2f} "
            f"| {per_task} | {worker_cores / rate * 1e6:.0f} µs |"
        )
    print(f"\nload after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
