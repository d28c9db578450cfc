"""The recurring pipeline to NATS JetStream beside APScheduler 4, in one run.

    python benchmarks/bench_recurring_pipeline.py [--samples 3] [--definitions 200]
        [--minutes 11] [--relays 4] [--namespaces 1,2,4] [--nats nats://127.0.0.1:4222]

Everything runs on a PRIVATE pgserver cluster started for the run (never a shared server:
the schemas are created and dropped here) and on the NATS JetStream server at ``--nats``
(one stream per system and run, deleted at the end). Each measurement runs in a fresh
worker process (this script with ``--worker``): it prepares, reports ready, waits for the
go, works, and reports wall-clock start and end; the parent starts every worker of a
measurement at once, so namespaces run side by side.

Measured, alternating the systems sample by sample (medians and min-max spread printed):

- **pipeline** (occurrences or jobs per second): ``--definitions`` calendars
  ``* * * * *`` that are ``--minutes`` minutes behind (catch-up), ticked, claimed and
  relayed to NATS JetStream by ``--relays`` :class:`RecurringRelay` tasks per namespace
  (each claimed batch with ``relay_many``), until every caught-up occurrence is published;
  with 1, 2 and 4 namespaces (one worker process each, one store and its relay tasks).
  APScheduler 4: the same schedules (``CronTrigger`` from the same crontab, the same
  start, ``CoalescePolicy.all`` so that every missed run fires, no misfire limit) in its
  ``SQLAlchemyDataStore`` on asyncpg on the same cluster, one ``AsyncScheduler`` (role
  both, its default 100 concurrent jobs); each job publishes the same payload to NATS
  JetStream with ``Nats-Msg-Id`` = the job id; measured until every job ran.
- **create** (definitions or schedules per second): steeple ``create_many`` in batches of
  100 and ``create`` one by one; APScheduler ``add_schedule`` one by one (it has no bulk
  call).
- **tick(100)** latency: 100 catching-up definitions, each tick materializing 100.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._run_names import drop_schemas, run_name

PAYLOAD = os.urandom(256)


def _log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


# --- workers (each in its own process) -------------------------------------------------------


def _first_after(minutes: int) -> datetime:
    now = datetime.now(UTC).replace(second=0, microsecond=0)
    return now - timedelta(minutes=minutes)


async def _steeple_pipeline(args: argparse.Namespace) -> dict[str, Any]:
    from steeple.brokers.nats import JetStreamBroker
    from steeple.core import (
        MissedRunPolicy,
        RecurringConfig,
        RecurringDefinition,
        ScheduledMessage,
        SystemClock,
    )
    from steeple.engine import RecurringRelay, RelayStatistics
    from steeple.keyring import Keyring, StorageKey
    from steeple.postgres import PostgresRecurringStore

    keyring = Keyring(StorageKey.from_base64("bench", args.key))
    config = RecurringConfig(args.namespace, 10_000, 100_000)
    store = await PostgresRecurringStore.initialize(
        args.dsn, config, keyring, SystemClock(), schema=args.schema
    )
    broker = await JetStreamBroker.connect(args.nats, stream=args.stream, subject=args.subject)
    try:
        if args.seed:
            first_after = _first_after(args.minutes)
            definitions = [
                RecurringDefinition(
                    f"def-{i:04d}",
                    "* * * * *",
                    first_after,
                    MissedRunPolicy.CATCH_UP,
                    ScheduledMessage("bench", "tick", PAYLOAD),
                )
                for i in range(args.definitions)
            ]
            for start in range(0, len(definitions), 100):
                await store.create_many(definitions[start : start + 100])
        stats = RelayStatistics()
        relays = [
            RecurringRelay(store, broker, idle_interval=0.01, statistics=stats)
            for _ in range(args.relays)
        ]
        last = 0.0

        async def work(relay: RecurringRelay) -> None:
            # Until a round finds nothing to tick or claim: every caught-up occurrence is
            # published or held by another task (or process) that publishes it.
            nonlocal last
            while True:
                before = stats.published
                busy = await relay.run_once()
                if stats.published > before:
                    last = time.time()
                if not busy:
                    return

        print("ready", flush=True)
        sys.stdin.readline()
        started = time.time()
        async with asyncio.TaskGroup() as group:
            for relay in relays:
                group.create_task(work(relay))
        return {
            "started": started,
            "ended": last,
            "done": stats.published,
            "ticks": stats.ticks,
            "claimed": stats.claimed,
            "relay_failures": stats.relay_failures,
            "storage_failures": stats.storage_failures,
        }
    finally:
        await broker.close()
        await store.close()


_APS: dict[str, Any] = {}
"""The APScheduler worker's NATS context and counters (its jobs are module functions)."""


async def aps_job() -> None:
    """An APScheduler job: publish the payload to NATS JetStream, deduplicated by job id."""
    from apscheduler import current_job

    await _APS["js"].publish(
        _APS["subject"], PAYLOAD, headers={"Nats-Msg-Id": str(current_job.get().id)}
    )


async def _aps_pipeline(args: argparse.Namespace) -> dict[str, Any]:
    import nats
    from apscheduler import AsyncScheduler, CoalescePolicy, JobOutcome, JobReleased
    from apscheduler.datastores.sqlalchemy import SQLAlchemyDataStore
    from apscheduler.triggers.cron import CronTrigger
    from sqlalchemy.ext.asyncio import create_async_engine

    nc = await nats.connect(args.nats)
    _APS["js"], _APS["subject"] = nc.jetstream(), args.subject
    engine = create_async_engine(_sqlalchemy_url(args.dsn))
    try:
        first_after = _first_after(args.minutes)
        target = args.definitions * args.minutes
        outcomes: dict[str, int] = {}
        finished = asyncio.Event()

        def released(event: Any) -> None:
            outcome = event.outcome.name
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
            if sum(outcomes.values()) >= target:
                finished.set()

        async with AsyncScheduler(SQLAlchemyDataStore(engine, schema=args.schema)) as scheduler:
            # APScheduler's start_time is inclusive, steeple's first_after exclusive: the
            # same 11 fire times per schedule.
            trigger_start = first_after + timedelta(seconds=1)
            for i in range(args.definitions):
                await scheduler.add_schedule(
                    aps_job,
                    CronTrigger.from_crontab("* * * * *", start_time=trigger_start, timezone="UTC"),
                    id=f"def-{i:04d}",
                    coalesce=CoalescePolicy.all,
                    misfire_grace_time=None,
                )
            scheduler.subscribe(released, {JobReleased})
            print("ready", flush=True)
            await asyncio.to_thread(sys.stdin.readline)
            started = time.time()
            await scheduler.start_in_background()
            await finished.wait()
            ended = time.time()
            await scheduler.stop()
        return {
            "started": started,
            "ended": ended,
            "done": outcomes.get(JobOutcome.success.name, 0),
            "outcomes": outcomes,
        }
    finally:
        await engine.dispose()
        await nc.close()


def _sqlalchemy_url(dsn: str) -> str:
    return dsn.replace("postgresql://", "postgresql+asyncpg://", 1)


async def _steeple_create(args: argparse.Namespace) -> dict[str, Any]:
    from steeple.core import (
        MissedRunPolicy,
        RecurringConfig,
        RecurringDefinition,
        ScheduledMessage,
        SystemClock,
    )
    from steeple.keyring import Keyring, StorageKey
    from steeple.postgres import PostgresRecurringStore

    keyring = Keyring(StorageKey.from_base64("bench", args.key))
    config = RecurringConfig(args.namespace, 10_000, 100_000)
    store = await PostgresRecurringStore.initialize(
        args.dsn, config, keyring, SystemClock(), schema=args.schema
    )
    try:
        first_after = _first_after(1)

        def definition(prefix: str, i: int) -> RecurringDefinition:
            return RecurringDefinition(
                f"{prefix}-{i:05d}",
                "*/5 * * * *",
                first_after,
                MissedRunPolicy.CATCH_UP,
                ScheduledMessage("bench", "tick", PAYLOAD),
            )

        bulk = [definition("bulk", i) for i in range(args.creates)]
        single = [definition("one", i) for i in range(args.creates // 3)]
        await store.create(definition("warm", 0))
        print("ready", flush=True)
        sys.stdin.readline()
        started = time.perf_counter()
        for start in range(0, len(bulk), 100):
            await store.create_many(bulk[start : start + 100])
        bulk_s = time.perf_counter() - started
        started = time.perf_counter()
        for d in single:
            await store.create(d)
        single_s = time.perf_counter() - started
        return {"create_many": len(bulk) / bulk_s, "create": len(single) / single_s}
    finally:
        await store.close()


async def _aps_create(args: argparse.Namespace) -> dict[str, Any]:
    from apscheduler import AsyncScheduler
    from apscheduler.datastores.sqlalchemy import SQLAlchemyDataStore
    from apscheduler.triggers.cron import CronTrigger
    from sqlalchemy.ext.asyncio import create_async_engine

    engine = create_async_engine(_sqlalchemy_url(args.dsn))
    try:
        async with AsyncScheduler(SQLAlchemyDataStore(engine, schema=args.schema)) as scheduler:
            count = args.creates // 3
            await scheduler.add_schedule(
                aps_job, CronTrigger.from_crontab("*/5 * * * *", timezone="UTC"), id="warm"
            )
            print("ready", flush=True)
            await asyncio.to_thread(sys.stdin.readline)
            started = time.perf_counter()
            for i in range(count):
                await scheduler.add_schedule(
                    aps_job,
                    CronTrigger.from_crontab("*/5 * * * *", timezone="UTC"),
                    id=f"one-{i:05d}",
                )
            return {"add_schedule": count / (time.perf_counter() - started)}
    finally:
        await engine.dispose()


async def _steeple_tick(args: argparse.Namespace) -> dict[str, Any]:
    from steeple.core import (
        MissedRunPolicy,
        RecurringConfig,
        RecurringDefinition,
        ScheduledMessage,
        SystemClock,
    )
    from steeple.keyring import Keyring, StorageKey
    from steeple.postgres import PostgresRecurringStore

    keyring = Keyring(StorageKey.from_base64("bench", args.key))
    config = RecurringConfig(args.namespace, 10_000, 100_000)
    store = await PostgresRecurringStore.initialize(
        args.dsn, config, keyring, SystemClock(), schema=args.schema
    )
    try:
        first_after = _first_after(2 * 24 * 60)
        await store.create_many(
            [
                RecurringDefinition(
                    f"def-{i:03d}",
                    "* * * * *",
                    first_after,
                    MissedRunPolicy.CATCH_UP,
                    ScheduledMessage("bench", "tick", PAYLOAD),
                )
                for i in range(100)
            ]
        )
        for _ in range(3):
            await store.tick(100)
        print("ready", flush=True)
        sys.stdin.readline()
        samples = []
        for _ in range(args.ticks):
            started = time.perf_counter()
            result = await store.tick(100)
            samples.append(time.perf_counter() - started)
            assert result.materialized == 100
        return {"tick_ms": [s * 1000 for s in samples]}
    finally:
        await store.close()


WORKERS = {
    "steeple-pipeline": _steeple_pipeline,
    "aps-pipeline": _aps_pipeline,
    "steeple-create": _steeple_create,
    "aps-create": _aps_create,
    "steeple-tick": _steeple_tick,
}


def _worker_main(args: argparse.Namespace) -> None:
    result = asyncio.run(WORKERS[args.worker](args))
    print("result " + json.dumps(result), flush=True)


# --- the parent: cluster, streams, schedule of samples -------------------------------------


class Run:
    def __init__(self, dsn: str, nats_url: str, key: str, args: argparse.Namespace) -> None:
        self.dsn = dsn
        self.nats = nats_url
        self.key = key
        self.args = args
        self.tag = uuid.uuid4().hex[:8]
        self.schemas: list[str] = []
        self.streams: list[str] = []
        self.aps_outcomes: dict[str, int] = {}

    def new_schema(self, prefix: str) -> str:
        schema = run_name(f"{prefix}_{len(self.schemas)}")
        self.schemas.append(schema)
        return schema

    async def new_stream(self, prefix: str) -> tuple[str, str]:
        import nats
        from nats.js.api import StorageType, StreamConfig

        name = f"BENCH_{prefix}_{self.tag}_{len(self.streams)}"
        subject = f"bench.{prefix.lower()}.{self.tag}.{len(self.streams)}"
        nc = await nats.connect(self.nats)
        try:
            await nc.jetstream().add_stream(
                StreamConfig(
                    name=name,
                    subjects=[subject],
                    duplicate_window=86_400,
                    storage=StorageType.FILE,
                )
            )
        finally:
            await nc.close()
        self.streams.append(name)
        return name, subject

    async def workers(self, specs: list[list[str]]) -> list[dict[str, Any]]:
        """Start one process per spec, wait until all are ready, start them together."""
        procs = [
            await asyncio.create_subprocess_exec(
                sys.executable,
                __file__,
                "--worker",
                *spec,
                "--dsn",
                self.dsn,
                "--nats",
                self.nats,
                "--key",
                self.key,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
            )
            for spec in specs
        ]
        for proc in procs:
            assert proc.stdout is not None
            line = await proc.stdout.readline()
            if line.strip() != b"ready":
                raise RuntimeError(f"worker failed to start: {line!r}")
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write(b"go\n")
            await proc.stdin.drain()
        results = []
        for proc in procs:
            assert proc.stdout is not None
            out = (await proc.stdout.read()).decode()
            await proc.wait()
            lines = [x for x in out.splitlines() if x.startswith("result ")]
            if proc.returncode != 0 or not lines:
                raise RuntimeError(f"worker failed ({proc.returncode}): {out[-2000:]}")
            results.append(json.loads(lines[-1][len("result ") :]))
        return results

    async def steeple_pipeline(self, namespaces: int, processes: int, tasks: int) -> float:
        """Occurrences per second: ``namespaces`` side by side, each worked by
        ``processes`` worker processes of ``tasks`` relay tasks."""
        schema = self.new_schema("stp")
        specs = []
        for n in range(namespaces):
            stream, subject = await self.new_stream("STP")
            for p in range(processes):
                specs.append(
                    [
                        "steeple-pipeline",
                        *(["--seed"] if p == 0 else []),
                        "--schema",
                        schema,
                        "--namespace",
                        f"bench-{n}",
                        "--stream",
                        stream,
                        "--subject",
                        subject,
                        "--definitions",
                        str(self.args.definitions),
                        "--minutes",
                        str(self.args.minutes),
                        "--relays",
                        str(tasks),
                    ]
                )
        # The schema is created once before the namespaces start side by side.
        await _initialize_schema(self.dsn, schema, self.key)
        results = await self.workers(specs)
        done = sum(r["done"] for r in results)
        expected = namespaces * self.args.definitions * self.args.minutes
        if done < expected:
            _log(f"  note: {done} of {expected} occurrences published")
        span = max(r["ended"] for r in results) - min(r["started"] for r in results)
        for r in results:
            if r["relay_failures"] or r["storage_failures"]:
                _log(f"  note: {r}")
        return float(done / span)

    async def aps_pipeline(self) -> float:
        schema = self.new_schema("aps")
        await _create_schema(self.dsn, schema)
        stream, subject = await self.new_stream("APS")
        (result,) = await self.workers(
            [
                [
                    "aps-pipeline",
                    "--schema",
                    schema,
                    "--stream",
                    stream,
                    "--subject",
                    subject,
                    "--definitions",
                    str(self.args.definitions),
                    "--minutes",
                    str(self.args.minutes),
                ]
            ]
        )
        self.aps_outcomes = result["outcomes"]
        return float(result["done"] / (result["ended"] - result["started"]))

    async def creates(self) -> dict[str, float]:
        schema = self.new_schema("stc")
        await _initialize_schema(self.dsn, schema, self.key)
        common = ["--creates", str(self.args.creates)]
        (stp,) = await self.workers(
            [["steeple-create", "--schema", schema, "--namespace", "create", *common]]
        )
        schema = self.new_schema("apc")
        await _create_schema(self.dsn, schema)
        (aps,) = await self.workers([["aps-create", "--schema", schema, *common]])
        return {**stp, **aps}

    async def ticks(self) -> list[float]:
        schema = self.new_schema("stt")
        await _initialize_schema(self.dsn, schema, self.key)
        (result,) = await self.workers(
            [
                [
                    "steeple-tick",
                    "--schema",
                    schema,
                    "--namespace",
                    "tick",
                    "--ticks",
                    str(self.args.ticks),
                ]
            ]
        )
        return list(result["tick_ms"])

    async def cleanup(self) -> None:
        import nats

        await drop_schemas(self.dsn, *self.schemas)
        nc = await nats.connect(self.nats)
        try:
            for stream in self.streams:
                try:
                    await nc.jetstream().delete_stream(stream)
                except Exception as exc:  # report, keep deleting the others
                    _log(f"could not delete stream {stream}: {exc!r}")
        finally:
            await nc.close()


async def _create_schema(dsn: str, schema: str) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(f'CREATE SCHEMA "{schema}"')
    finally:
        await conn.close()


async def _initialize_schema(dsn: str, schema: str, key: str) -> None:
    from steeple.core import RecurringConfig, SystemClock
    from steeple.keyring import Keyring, StorageKey
    from steeple.postgres import PostgresRecurringStore

    keyring = Keyring(StorageKey.from_base64("bench", key))
    store = await PostgresRecurringStore.initialize(
        dsn, RecurringConfig("setup", 1, 1), keyring, SystemClock(), schema=schema
    )
    await store.close()


def _spread(values: list[float], fmt: str = "{:,.0f}") -> str:
    return (
        f"{fmt.format(statistics.median(values))} "
        f"({fmt.format(min(values))}-{fmt.format(max(values))})"
    )


async def _parent(args: argparse.Namespace) -> None:
    from pgserver.postgres_server import get_server

    from steeple.keyring import StorageKey

    key = StorageKey.generate("bench").to_base64()
    server = get_server(Path(tempfile.mkdtemp(prefix="steeple-pipeline-")), cleanup_mode="delete")
    dsn = server.get_uri()
    run = Run(dsn, args.nats, key, args)
    namespaces = [int(n) for n in args.namespaces.split(",")]
    layouts = [
        (int(p), int(t)) for p, t in (layout.split("x") for layout in args.layouts.split(","))
    ]
    cases = [(n, p, t) for p, t in layouts for n in namespaces]
    pipeline: dict[tuple[int, int, int], list[float]] = {case: [] for case in cases}
    aps: list[float] = []
    creates: dict[str, list[float]] = {"create_many": [], "create": [], "add_schedule": []}
    ticks: list[float] = []
    load_before = os.getloadavg()
    when = datetime.now(UTC)
    try:
        for sample in range(args.samples):
            _log(f"sample {sample + 1}/{args.samples}")
            for case in cases:
                pipeline[case].append(await run.steeple_pipeline(*case))
                n, p, t = case
                _log(
                    f"  steeple pipeline, {n} namespace(s), {p} process(es) x {t} task(s): "
                    f"{pipeline[case][-1]:,.0f}/s"
                )
            if not args.skip_apscheduler:
                aps.append(await run.aps_pipeline())
                _log(f"  APScheduler pipeline: {aps[-1]:,.1f} jobs/s")
                _log(f"  APScheduler outcomes: {run.aps_outcomes}")
            for name, value in (await run.creates()).items():
                creates[name].append(value)
            _log(f"  creates: { {k: round(v[-1]) for k, v in creates.items()} }")
            ticks.extend(await run.ticks())
    finally:
        await run.cleanup()
        server.cleanup()
    load_after = os.getloadavg()
    print(
        f"steeple recurring pipeline vs APScheduler {_version('apscheduler')}, "
        f"{when:%Y-%m-%d %H:%M} UTC, {args.samples} samples (median, min-max)"
    )
    print(
        f"load average {load_before[0]:.1f} before, {load_after[0]:.1f} after; "
        f"{os.cpu_count()} CPUs; private pgserver PostgreSQL, NATS JetStream {args.nats}"
    )
    print(
        f"workload: {args.definitions} definitions x {args.minutes} caught-up minutes "
        "per namespace; relay tasks per namespace as worker processes x tasks"
    )
    print()
    print("| metric | steeple | APScheduler 4 | ratio |")
    print("|---|---|---|---|")
    aps_median = statistics.median(aps) if aps else float("nan")
    for n, p, t in cases:
        values = pipeline[(n, p, t)]
        ratio = statistics.median(values) / aps_median if aps else float("nan")
        scale = statistics.median(values) / statistics.median(pipeline[(namespaces[0], p, t)])
        label = (
            f"pipeline to NATS, {n} namespace{'s' if n > 1 else ''}, {p} process"
            f"{'es' if p > 1 else ''} x {t} relay task{'s' if t > 1 else ''} each "
            "(occurrences/s)"
        )
        aps_cell = _spread(aps, "{:,.1f}") if aps else "-"
        print(
            f"| {label} | {_spread(values)} | {aps_cell} | "
            f"{ratio:,.1f}x APScheduler, {scale:.2f}x {namespaces[0]} namespace |"
        )
    add = statistics.median(creates["add_schedule"])
    print(
        f"| create, create_many of 100 (definitions/s) | {_spread(creates['create_many'])} | "
        f"{_spread(creates['add_schedule'])} (add_schedule) | "
        f"{statistics.median(creates['create_many']) / add:,.1f}x |"
    )
    print(
        f"| create, one by one (definitions/s) | {_spread(creates['create'])} | "
        f"{_spread(creates['add_schedule'])} (add_schedule) | "
        f"{statistics.median(creates['create']) / add:,.1f}x |"
    )
    ordered = sorted(ticks)
    print(
        f"| tick(100) latency (ms) | p50 {statistics.median(ticks):.1f}, "
        f"p90 {ordered[int(len(ordered) * 0.9) - 1]:.1f} | - | - |"
    )


def _version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--samples", type=int, default=3)
    parser.add_argument("--definitions", type=int, default=200)
    parser.add_argument("--minutes", type=int, default=11)
    parser.add_argument("--relays", type=int, default=4)
    parser.add_argument(
        "--layouts",
        default="1x4,4x1",
        help="worker processes x relay tasks per namespace, e.g. 1x4 (one process, four "
        "tasks) and 4x1 (four processes, one task each)",
    )
    parser.add_argument("--namespaces", default="1,2,4")
    parser.add_argument("--creates", type=int, default=1000)
    parser.add_argument("--ticks", type=int, default=30)
    parser.add_argument("--nats", default="nats://127.0.0.1:4222")
    parser.add_argument("--skip-apscheduler", action="store_true")
    # worker mode (internal)
    parser.add_argument("--worker", choices=sorted(WORKERS))
    parser.add_argument("--seed", action="store_true")
    parser.add_argument("--dsn")
    parser.add_argument("--key")
    parser.add_argument("--schema")
    parser.add_argument("--namespace")
    parser.add_argument("--stream")
    parser.add_argument("--subject")
    args = parser.parse_args()
    if args.worker:
        _worker_main(args)
    else:
        asyncio.run(_parent(args))


if __name__ == "__main__":
    main()
