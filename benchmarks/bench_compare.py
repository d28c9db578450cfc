"""Work-queue speed of two builds, measured interleaved in one run: a base and the work tree.

Run through nox, which builds the base commit in a scratch environment first::

    nox -s bench-compare -- BASE [--rounds 5] [--n 20000] [--threshold 0.10]

or directly, given the two environments' interpreters::

    python benchmarks/bench_compare.py --base-python /tmp/base/.venv/bin/python \\
        --head-python .venv/bin/python [--rounds 5] [--n 20000]

Each round runs the base and then the work tree (A B A B ...), each in a fresh process of
its own interpreter (``--measure``: this file, run from outside the source tree so only
the environment's packages are importable) against the same PostgreSQL: ``--dsn``,
``STEEPLE_TEST_DSN``, or a private pgserver cluster started for the run. A measurement
installs the queue in a schema of its own, enqueues N no-op tasks with ``enqueue_many``
(chunks of 5,000), drains them with one ``Scheduler(concurrency=200, batch_size=200)``,
enqueues N more and times the one-off claim statement taking them all (200 a claim, the
claim path alone), and drops the schema. The table shows each metric's median per side
and head/base; a median more than ``--threshold`` worse than the base's exits with status
1 (only the metrics named by ``--gate``, when given).

Only the public API that every version since named queues and before shares is used
(``install``, ``Task``, ``enqueue_many``, ``Scheduler``, ``register``,
``run_until_shutdown``), so old commits can be measured with this file as it is now.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

CHUNK = 5000
CLAIM_BATCH = 200
WORKER: dict[str, Any] = {
    "concurrency": 200,
    "batch_size": 200,
    "poll_interval": 1.0,
    "maintenance_interval": 5.0,
}
# metric -> unit; every metric is a rate: higher is better.
# process_cpu: tasks per CPU second of the worker's process while it drains (the harness
# and the worker share the process, the harness idles meanwhile); far less sensitive to
# other jobs on the machine than the wall-clock rate, but blind to the server's share.
# server_cpu: tasks per CPU second of the whole PostgreSQL cluster while the worker drains
# (only on a private cluster, where nothing else runs: see _server_cpu_seconds).
# enqueue_cpu: tasks per CPU second of the enqueue, this process and its connection's
# server backend together (only when PostgreSQL runs on this machine: see _backend_cpu);
# the wall-clock enqueue rate of a 1-2 s window swings by 2x with other jobs' load.
# claim: tasks per second the one-off claim statement takes from a backlog of N no-op
# tasks of a queue with no workflow and no limit (batches of CLAIM_BATCH, nothing
# completed): the claim path alone, which workflows and per-key limits must leave as fast
# as it was; claim_server_cpu: the same per CPU second of the cluster (private only).
METRICS = {
    "enqueue": "tasks/s",
    "enqueue_cpu": "tasks/CPU s",
    "process": "tasks/s",
    "claim": "tasks/s",
    "claim_server_cpu": "tasks/server CPU s",
    "process_cpu": "tasks/CPU s",
    "server_cpu": "tasks/server CPU s",
}


@dataclass(frozen=True)
class Comparison:
    """One metric's medians on both sides, and whether the head fell behind the base."""

    metric: str
    base: float
    head: float
    ratio: float  # head / base: above 1 is faster
    regressed: bool


def compare(
    base: Mapping[str, Sequence[float]],
    head: Mapping[str, Sequence[float]],
    *,
    threshold: float = 0.10,
) -> list[Comparison]:
    """Compare the medians of each metric measured on both sides (rates: higher is better).

    A metric regressed when the head's median is below ``(1 - threshold)`` times the
    base's. Metrics measured on one side only are left out.

    Raises:
        ValueError: ``threshold`` is not in [0, 1), or a metric has no sample or a
            base median that is not positive.
    """
    if not 0 <= threshold < 1:
        raise ValueError(f"threshold must be in [0, 1), got {threshold}")
    out = []
    for metric in sorted(base.keys() & head.keys()):
        if not base[metric] or not head[metric]:
            raise ValueError(f"{metric}: no samples on one side")
        b = statistics.median(base[metric])
        h = statistics.median(head[metric])
        if b <= 0:
            raise ValueError(f"{metric}: base median {b} is not positive")
        ratio = h / b
        out.append(Comparison(metric, b, h, ratio, ratio < 1 - threshold))
    return out


def format_table(rows: Sequence[Comparison], rounds: int, threshold: float) -> str:
    head = ["metric", "base (median)", "head (median)", "head/base", ""]
    lines = [
        [
            f"{r.metric} ({METRICS.get(r.metric, '')})",
            f"{r.base:,.0f}",
            f"{r.head:,.0f}",
            f"{r.ratio:.3f}x",
            f"REGRESSED (more than {threshold:.0%} slower)" if r.regressed else "ok",
        ]
        for r in rows
    ]
    widths = [max(len(x[i]) for x in [head, *lines]) for i in range(len(head))]
    text = ["  ".join(c.ljust(w) for c, w in zip(x, widths, strict=True)) for x in [head, *lines]]
    text.insert(1, "-" * len(text[0]))
    text.append(f"({rounds} rounds, base and head alternating, each run in its own process)")
    return "\n".join(line.rstrip() for line in text)


# --- one measurement, in its own process ----------------------------------------------------


def _proc_stat(pid: int | str) -> list[str]:
    """Fields 3 on of ``/proc/<pid>/stat`` (after "pid (comm)"): [1] is the parent's pid."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        return f.read().rsplit(")", 1)[1].split()


def _server_cpu_seconds(postmaster: int) -> float:
    """CPU seconds a PostgreSQL on this machine has used: its postmaster, the backends and
    helpers it runs now, and those it already reaped (their time is in its ``cutime``)."""

    fields = _proc_stat(postmaster)
    total = sum(int(x) for x in fields[11:15])  # utime, stime, cutime, cstime
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                child = _proc_stat(entry)
            except OSError:  # gone meanwhile: reaped, so counted in cutime
                continue
            if int(child[1]) == postmaster:
                total += int(child[11]) + int(child[12])
    return total / os.sysconf("SC_CLK_TCK")


def _backend_cpu(pid: int) -> float | None:
    """CPU seconds the server backend ``pid`` has used; None when it is not on this machine."""
    try:
        fields = _proc_stat(pid)
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _claim_rate(
    conn: Any, schema: str, task: Any, payloads: list[Any], postmaster: int
) -> dict[str, float]:
    """Enqueue ``payloads`` again and claim them all; return tasks claimed per second.

    With ``postmaster`` (a private cluster) also per CPU second of the whole cluster.

    The one-off claim statement (``queue_sql(schema).claim``: names, limit, worker, give-up
    time) is the same in every version since named queues.
    """
    from steeple.postgres.queue import enqueue_many
    from steeple.postgres.queue._sql import queue_sql

    for start in range(0, len(payloads), CHUNK):
        await enqueue_many(conn, task, payloads[start : start + CHUNK], schema=schema)
    claim = queue_sql(schema).claim
    give_up = await conn.fetchval("SELECT extract(epoch FROM clock_timestamp()) + 3600")
    claimed = 0
    server0 = _server_cpu_seconds(postmaster) if postmaster else 0.0
    t0 = time.perf_counter()
    while rows := await conn.fetch(claim, [task.name], CLAIM_BATCH, "bench", give_up):
        claimed += len(rows)
    spent = time.perf_counter() - t0
    if claimed != len(payloads):
        raise RuntimeError(f"claimed {claimed} of {len(payloads)} tasks")
    rates = {"claim": claimed / spent}
    if postmaster:
        rates["claim_server_cpu"] = claimed / max(_server_cpu_seconds(postmaster) - server0, 1e-9)
    return rates


async def _measure(
    dsn: str, schema: str, n: int, profile: str | None, server_cpu: bool
) -> dict[str, float]:
    import asyncpg

    from steeple.postgres.queue import Scheduler, Task, enqueue_many, install

    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        await conn.execute(f'CREATE SCHEMA "{schema}"')
        await install(conn, schema=schema)
        postmaster = 0
        if server_cpu:
            backend = await conn.fetchval("SELECT pg_backend_pid()")
            try:
                postmaster = int(_proc_stat(backend)[1])  # the backend's parent
            except OSError:
                raise RuntimeError("server CPU needs a PostgreSQL on this machine") from None
        noop: Any = Task("noop")
        payloads = [{"i": i} for i in range(n)]
        backend = await conn.fetchval("SELECT pg_backend_pid()")
        backend0 = _backend_cpu(backend)
        t0 = time.perf_counter()
        cpu0 = time.process_time()
        for start in range(0, n, CHUNK):
            await enqueue_many(conn, noop, payloads[start : start + CHUNK], schema=schema)
        enqueue = n / (time.perf_counter() - t0)
        enqueue_cpu = time.process_time() - cpu0
        backend1 = _backend_cpu(backend)

        done = asyncio.Event()
        count = 0

        async def handler(ctx: Any, args: Any) -> None:
            nonlocal count
            count += 1
            if count >= n:
                done.set()

        worker = Scheduler(dsn, worker_id="bench-compare", schema=schema, **WORKER)
        worker.register(noop, handler)
        stop = asyncio.Event()
        profiler = cProfile.Profile() if profile else None
        t0 = time.perf_counter()
        cpu0 = time.process_time()
        server0 = _server_cpu_seconds(postmaster) if postmaster else 0.0
        if profiler is not None:
            profiler.enable()
        run = asyncio.create_task(worker.run_until_shutdown(stop))
        await asyncio.wait_for(done.wait(), 3600)
        while worker.stats.succeeded < n:  # noqa: ASYNC110 (a counter, polled)
            await asyncio.sleep(0.001)
        if profiler is not None and profile:
            profiler.disable()
            profiler.dump_stats(profile)
        process = n / (time.perf_counter() - t0)
        process_cpu = n / (time.process_time() - cpu0)
        server = _server_cpu_seconds(postmaster) - server0 if postmaster else 0.0
        stop.set()
        await run
        left = await conn.fetchval(
            f"SELECT count(*) FROM \"{schema}\".tasks WHERE state <> 'succeeded'"
        )
        if left:
            raise RuntimeError(f"{left} tasks did not succeed")
        rates = {"enqueue": enqueue, "process": process, "process_cpu": process_cpu}
        if backend0 is not None and backend1 is not None:
            rates["enqueue_cpu"] = n / max(enqueue_cpu + backend1 - backend0, 1e-9)
        if postmaster:
            rates["server_cpu"] = n / max(server, 1e-9)
        rates.update(await _claim_rate(conn, schema, noop, payloads, postmaster))
        return rates
    finally:
        await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        await conn.close()


# Not passed to a measurement: another tree's modules (PYTHONPATH, VIRTUAL_ENV), and
# PYTHONDONTWRITEBYTECODE: without cached bytecode every measurement compiles the modules
# the first enqueue imports lazily (OpenTelemetry's API: 0.12 s of CPU, as much as the
# enqueue of 10,000 tasks itself), inside the enqueue's timed window.
_UNINHERITED = frozenset({"PYTHONPATH", "VIRTUAL_ENV", "PYTHONDONTWRITEBYTECODE"})


def _run_one(python: str, dsn: str, schema: str, n: int, server_cpu: bool) -> dict[str, float]:
    """One measurement in a fresh process of ``python``, run from an empty directory."""
    finished = False
    try:
        with tempfile.TemporaryDirectory(prefix="steeple-bench-compare-") as cwd:
            env = {k: v for k, v in os.environ.items() if k not in _UNINHERITED}
            done = subprocess.run(
                [python, os.path.abspath(__file__), "--measure", "--dsn", dsn,
                 "--schema", schema, "--n", str(n), *(["--server-cpu"] if server_cpu else [])],
                cwd=cwd, env=env, capture_output=True, text=True, timeout=3600, check=False,
            )  # fmt: skip
        finished = done.returncode == 0
    finally:
        if not finished:  # killed (Ctrl-C, timeout) or failed: its own cleanup may not have run
            _drop_schema(dsn, schema)
    if done.returncode != 0:
        raise RuntimeError(f"measurement with {python} failed:\n{done.stdout}{done.stderr}")
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _run_schema(side: str) -> str:
    """This run's own schema for ``side``'s measurements (not needed by a measurement)."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from benchmarks._run_names import run_name

    return run_name(f"bench_compare_{side}")


def _drop_schema(dsn: str, schema: str) -> None:
    """Drop a failed measurement's schema; if that fails too, say so (the first failure counts)."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from benchmarks._run_names import drop_schemas

    try:
        asyncio.run(drop_schemas(dsn, schema))
    except Exception as exc:  # the measurement's own failure is the one to raise
        print(f"could not drop schema {schema}: {type(exc).__name__}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", default=os.environ.get("STEEPLE_TEST_DSN"))
    parser.add_argument("--n", type=int, default=20_000, help="tasks per measurement")
    parser.add_argument("--rounds", type=int, default=5, help="base/head pairs")
    parser.add_argument("--threshold", type=float, default=0.10, help="allowed median drop")
    parser.add_argument(
        "--gate",
        choices=sorted(METRICS),
        action="append",
        help="a metric whose regression fails the run (repeatable; default: every metric)",
    )
    parser.add_argument("--base-python", help="interpreter of the base build's environment")
    parser.add_argument("--head-python", default=sys.executable)
    parser.add_argument("--base-label", default="base")
    parser.add_argument(
        "--private",
        action="store_true",
        help="use a private PostgreSQL cluster even if a DSN is set, and measure its CPU",
    )
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--server-cpu", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--schema", help=argparse.SUPPRESS)
    parser.add_argument(
        "--profile", metavar="FILE", help="with --measure: cProfile the drain into FILE"
    )
    args = parser.parse_args(argv)
    if args.n < 1 or args.rounds < 1:
        parser.error("--n and --rounds must be at least 1")
    if args.measure:
        if not args.schema:
            parser.error("--measure needs --schema")
        print(
            json.dumps(
                asyncio.run(_measure(args.dsn, args.schema, args.n, args.profile, args.server_cpu))
            )
        )
        return 0
    if not args.base_python:
        parser.error("--base-python is required (nox -s bench-compare -- BASE builds one)")
    server = None
    if args.private or not args.dsn:
        # A private PostgreSQL (pgserver), as the test suite does without a DSN: nothing
        # else runs on it, so its CPU time is this run's (the server_cpu metric).
        from pgserver.postgres_server import get_server

        print("starting a private PostgreSQL (pgserver)", file=sys.stderr)
        server = get_server(tempfile.mkdtemp(prefix="steeple-bench-"), cleanup_mode="delete")
        args.dsn = server.get_uri()
    schemas = {side: _run_schema(side) for side in ("base", "head")}
    try:
        samples: dict[str, dict[str, list[float]]] = {"base": {}, "head": {}}
        for i in range(args.rounds):
            for side, python in (("base", args.base_python), ("head", args.head_python)):
                got = _run_one(python, args.dsn, schemas[side], args.n, server is not None)
                for metric, value in got.items():
                    samples[side].setdefault(metric, []).append(value)
                shown = ", ".join(f"{m} {v:,.0f}" for m, v in got.items())
                print(f"round {i + 1}/{args.rounds} {side}: {shown}", flush=True)
    finally:
        if server is not None:
            server.cleanup()
    rows = compare(samples["base"], samples["head"], threshold=args.threshold)
    print(f"\nbase: {args.base_label}   head: the work tree   N = {args.n:,} tasks per run")
    print(format_table(rows, args.rounds, args.threshold))
    for side in ("base", "head"):
        for metric, values in samples[side].items():
            print(f"  {side} {metric}: " + ", ".join(f"{v:,.0f}" for v in values))
    gated = set(args.gate or METRICS)
    failed = [r.metric for r in rows if r.regressed and r.metric in gated]
    if failed:
        print(f"FAILED: {', '.join(failed)} more than {args.threshold:.0%} below the base")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
