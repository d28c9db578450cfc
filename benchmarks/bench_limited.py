"""A queue under a global running limit beside the same queue without one, in ONE run.

Run:  .venv/bin/python benchmarks/bench_limited.py --private [--n 30000] [--rounds 5]
      [--workers 1] [--limit 50] [--trace] [--statements]

Each round drains N no-op tasks twice, unlimited then limited (``limit_queue(...,
max_running=LIMIT)``), each time in a fresh schema, by ``--workers`` worker processes
(``Scheduler(concurrency=200, batch_size=200)``, as bench_queue's tuned run). A drain's rate
is N over the time from the first handler call to the last, over every worker. The table
shows each mode's median and limited/unlimited, plus per drain: claims per 1000 tasks,
tasks per claim, and (``--trace``) the worker's claim round trip and its gap between a
claim's answer and the next claim sent, medians in ms. ``--statements`` prints the
statements (pg_stat_statements, nested ones included) that took the most server time in
the last round's drains (needs ``--private``: the cluster is started with the extension).

``--private`` starts a private PostgreSQL cluster (see ``_private_pg``) so other load on
the shared server does not enter the ratio; otherwise ``--dsn`` / ``STEEPLE_TEST_DSN``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._run_names import drop_schemas, run_name

WORKER: dict[str, Any] = {
    "concurrency": 200,
    "batch_size": 200,
    "poll_interval": 1.0,
    "maintenance_interval": 5.0,
}
CHUNK = 5000
_THIS = os.path.abspath(__file__)


# --- one worker process ----------------------------------------------------------------


async def _work(dsn: str, schema: str, ident: str, trace: bool) -> dict[str, Any]:
    from steeple.postgres.queue import Scheduler, Task
    from steeple.postgres.queue import _db as db_module

    calls: list[tuple[str, float, float, int]] = []
    if trace:
        original = db_module._AsyncpgDb.fetch

        async def traced(self: Any, sql: str, *args: Any, timeout: float) -> Any:
            kind = (
                "carry"
                if "complete_and_claim(" in sql
                else "claim"
                if ".claim(" in sql
                else "complete"
                if "complete_tasks(" in sql
                else None
            )
            t0 = time.monotonic()
            rows = await original(self, sql, *args, timeout=timeout)
            if kind is not None:
                calls.append((kind, t0, time.monotonic(), len(rows)))
            return rows

        db_module._AsyncpgDb.fetch = traced  # type: ignore[method-assign]

    first = last = 0.0
    count = 0

    async def handler(ctx: Any, args: Any) -> None:
        nonlocal first, last, count
        now = time.monotonic()
        if not count:
            first = now
        last = now
        count += 1

    cpu0 = time.process_time()
    worker = Scheduler(dsn, worker_id=ident, schema=schema, **WORKER)
    worker.register(Task("noop"), handler)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_reader(sys.stdin.fileno(), stop.set)  # the harness closes stdin: stop
    print("ready", flush=True)
    await worker.run_until_shutdown(stop)
    claims = [c for c in calls if c[0] in ("claim", "carry")]
    gaps = [b[1] - a[2] for a, b in itertools.pairwise(claims)]
    return {
        "cpu": time.process_time() - cpu0,
        "first": first,
        "last": last,
        "count": count,
        "claim_rounds": worker.stats.claim_rounds,
        "claimed": worker.stats.claimed,
        "carried_claims": sum(1 for c in claims if c[0] == "carry"),
        "flushes": sum(1 for c in calls if c[0] == "complete"),
        "rtt_ms": [1000 * (c[2] - c[1]) for c in claims],
        "gap_ms": [1000 * g for g in gaps],
    }


# --- the harness -----------------------------------------------------------------------


async def _prepare(dsn: str, schema: str, n: int, limit: int | None) -> None:
    import asyncpg

    from steeple.postgres.queue import Task, enqueue_many, install, limit_queue

    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        await conn.execute(f'CREATE SCHEMA "{schema}"')
        await install(conn, schema=schema)
        payloads = [{"i": i} for i in range(n)]
        for start in range(0, n, CHUNK):
            await enqueue_many(conn, Task("noop"), payloads[start : start + CHUNK], schema=schema)
        if limit is not None:
            await limit_queue(conn, "default", max_running=limit, schema=schema)
        await conn.execute(f'VACUUM ANALYZE "{schema}".tasks')
    finally:
        await conn.close()


async def _statements(dsn: str, reset: bool) -> list[tuple[str, int, float, float]]:
    import asyncpg

    conn = await asyncpg.connect(dsn)
    try:
        if reset:
            await conn.execute("SELECT pg_stat_statements_reset()")
            return []
        rows = await conn.fetch(
            "SELECT regexp_replace(query, '\\s+', ' ', 'g') AS q, calls, total_exec_time,"
            " mean_exec_time FROM pg_stat_statements ORDER BY total_exec_time DESC LIMIT 30"
        )
        return [(r["q"], r["calls"], r["total_exec_time"], r["mean_exec_time"]) for r in rows]
    finally:
        await conn.close()


async def _drain(
    dsn: str, schema: str, n: int, workers: int, trace: bool, monitor: bool, postmaster: int
) -> dict[str, Any]:
    import asyncpg
    from benchmarks.bench_compare import _server_cpu_seconds

    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            _THIS,
            "--worker",
            "--dsn",
            dsn,
            "--schema",
            schema,
            "--ident",
            f"w{i}",
            *(["--trace"] if trace else []),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        for i in range(workers)
    ]
    for proc in procs:
        assert proc.stdout is not None
        line = await proc.stdout.readline()
        if line.strip() != b"ready":
            raise RuntimeError(f"worker failed to start: {line!r}")
    server0 = _server_cpu_seconds(postmaster) if postmaster else 0.0
    conn = await asyncpg.connect(dsn)
    peak = 0
    try:
        while True:
            row = await conn.fetchrow(
                f"SELECT count(*) FILTER (WHERE state = 'running') AS running,"
                f" count(*) FILTER (WHERE state IN ('pending', 'running')) AS left"
                f' FROM "{schema}".tasks WHERE state IN (\'pending\', \'running\')'
            ) if monitor else await conn.fetchrow(
                f"SELECT 0 AS running, count(*) AS left FROM (SELECT 1 FROM \"{schema}\".tasks"
                f" WHERE state IN ('pending', 'running') LIMIT 1) AS x"
            )  # fmt: skip
            assert row is not None
            peak = max(peak, row["running"])
            if not row["left"]:
                break
            await asyncio.sleep(0.02)
    finally:
        await conn.close()
    server = _server_cpu_seconds(postmaster) - server0 if postmaster else 0.0
    outs = []
    for proc in procs:
        assert proc.stdin is not None
        assert proc.stdout is not None
        proc.stdin.close()
        out = await proc.stdout.read()
        await proc.wait()
        outs.append(json.loads(out.decode().strip().splitlines()[-1]))
    first = min(o["first"] for o in outs if o["count"])
    last = max(o["last"] for o in outs)
    count = sum(o["count"] for o in outs)
    rounds = sum(o["claim_rounds"] for o in outs)
    result = {
        "rate": count / (last - first),
        "count": count,
        "claims_per_1000": 1000 * rounds / count,
        "per_claim": sum(o["claimed"] for o in outs) / max(rounds, 1),
        "carried": sum(o["carried_claims"] for o in outs),
        "flushes": sum(o["flushes"] for o in outs),
        "worker_cpu_us": 1e6 * sum(o["cpu"] for o in outs) / count,
        # The share of the tasks the busiest worker ran (1/workers: an even split).
        "top_share": max(o["count"] for o in outs) / count,
    }
    if monitor:
        result["peak_running_seen"] = peak
    if postmaster:
        # The whole cluster's CPU while the workers ran (start-up included) per task.
        result["server_cpu_us"] = 1e6 * server / count
    if trace:
        rtt = [x for o in outs for x in o["rtt_ms"]]
        gap = [x for o in outs for x in o["gap_ms"]]
        result["rtt_ms"] = statistics.median(rtt) if rtt else 0.0
        result["gap_ms"] = statistics.median(gap) if gap else 0.0
    return result


async def _run(args: argparse.Namespace) -> None:
    samples: dict[str, list[dict[str, Any]]] = {"unlimited": [], "limited": []}
    statements: dict[str, list[tuple[str, int, float, float]]] = {}
    # This run's own schemas, dropped however the run ends.
    schemas = {mode: run_name(f"bench_limited_{mode}") for mode in ("unlimited", "limited")}
    try:
        for i in range(args.rounds):
            for mode, limit in (("unlimited", None), ("limited", args.limit)):
                schema = schemas[mode]
                await _prepare(args.dsn, schema, args.n, limit)
                if args.statements:
                    await _statements(args.dsn, reset=True)
                got = await _drain(
                    args.dsn,
                    schema,
                    args.n,
                    args.workers,
                    args.trace,
                    args.monitor,
                    args.postmaster,
                )
                if args.statements:
                    statements[mode] = await _statements(args.dsn, reset=False)
                if got["count"] != args.n:
                    raise RuntimeError(f"{mode}: {got['count']} of {args.n} tasks ran")
                samples[mode].append(got)
                shown = ", ".join(
                    f"{k} {v:,.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in got.items()
                )
                print(f"round {i + 1}/{args.rounds} {mode}: {shown}", flush=True)
    finally:
        await drop_schemas(args.dsn, *schemas.values())
    print(f"\nN = {args.n:,}, workers = {args.workers}, limit = {args.limit}, medians:")
    keys = [k for k in samples["limited"][0] if k != "count"]
    print(f"{'metric':<20}{'unlimited':>12}{'limited':>12}")
    for key in keys:
        u = statistics.median(s[key] for s in samples["unlimited"])
        lim = statistics.median(s[key] for s in samples["limited"])
        print(f"{key:<20}{u:>12,.2f}{lim:>12,.2f}")
    rates = [s["rate"] for s in samples["limited"]], [s["rate"] for s in samples["unlimited"]]
    ratio = statistics.median(rates[0]) / statistics.median(rates[1])
    print(f"limited/unlimited (medians of rate): {ratio:.2f}x")
    print("rates unlimited: " + ", ".join(f"{r:,.0f}" for r in rates[1]))
    print("rates limited:   " + ", ".join(f"{r:,.0f}" for r in rates[0]))
    for mode, rows in statements.items():
        print(f"\nlast {mode} drain, pg_stat_statements by total time (calls, total ms, mean ms):")
        for q, calls, total, mean in rows:
            print(f"  {calls:>7} {total:>9.1f} {mean:>8.3f}  {q[:150]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", default=os.environ.get("STEEPLE_TEST_DSN"))
    parser.add_argument("--private", action="store_true", help="a private PostgreSQL cluster")
    parser.add_argument("--n", type=int, default=30_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--limit", type=int, default=50)
    parser.add_argument("--trace", action="store_true", help="time the worker's claims")
    parser.add_argument("--statements", action="store_true", help="pg_stat_statements")
    parser.add_argument("--monitor", action="store_true", help="sample running tasks")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--schema", help=argparse.SUPPRESS)
    parser.add_argument("--ident", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(asyncio.run(_work(args.dsn, args.schema, args.ident, args.trace))))
        return 0
    server = None
    args.postmaster = 0
    if args.private or not args.dsn:
        from benchmarks._private_pg import PrivateServer

        settings = {"max_connections": "100"}
        if args.statements:
            settings["shared_preload_libraries"] = "'pg_stat_statements'"
            settings["pg_stat_statements.track"] = "all"
        server = PrivateServer(settings)
        args.dsn = server.dsn()
        args.postmaster = int((server.data / "postmaster.pid").read_text().split()[0])
        if args.statements:
            import asyncpg

            async def create() -> None:
                conn = await asyncpg.connect(args.dsn)
                await conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
                await conn.close()

            asyncio.run(create())
    try:
        asyncio.run(_run(args))
    finally:
        if server is not None:
            server.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
