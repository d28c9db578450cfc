"""The vacuum horizon held while the queue churns: throughput, claim latency, bloat.

Run:  .venv/bin/python benchmarks/bench_bloat.py [--short] [--holders idle,rr,slot]
      (or ``nox -s bloat`` / ``nox -s bloat -- --short``)

A private PostgreSQL server (initdb in a temporary directory, ``wal_level = logical`` so a
logical replication slot can be made; its binaries from ``STEEPLE_PG_BIN``) runs one queue
worker under a steady offered load (``--rate`` tasks/s, each ``--work-ms`` of work) while
finished tasks are pruned every 5 s once 30 s old, as in production. Phases: a baseline,
then for each horizon holder a hold and a recovery after its release:

- ``idle``: a session idle in a transaction that has an XID (``BEGIN; SELECT
  txid_current();``);
- ``rr``: four REPEATABLE READ transactions, each counting the queue's tables every second;
- ``slot``: a logical replication slot (``test_decoding``) that nobody consumes.

Every ``--sample`` seconds a row: throughput (tasks finished per second), the worker's claim
round-trip p50/p99 (the claim statement, timed around the driver call), pending tasks, the
age of the oldest transaction snapshot, WAL kept by slots, and per table ``n_dead_tup`` and
heap + index size. The summary compares each hold and each recovery with the baseline
against the targets: during a hold throughput >= 80% of the baseline's and claim p99 <= 5x;
after release, p99 back within 2x of the baseline's and the total size no longer growing
(less than 2% growth in the last half of the recovery), within 2 minutes.

The full run holds each holder 10 minutes (about 45 minutes in all); ``--short`` holds 90 s
with a 120 s recovery (about 12 minutes).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import asyncpg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks._private_pg import PrivateServer
from benchmarks._run_names import drop_schemas, run_name

# This run's own schema and slot: with --dsn, the server may be serving other runs.
SCHEMA = run_name("bench_bloat")
TABLES = ("tasks", "attempts", "jobs", "settings", "schema_migrations")
SLOT = run_name("bench_bloat_slot")


@dataclass
class Sample:
    at: float
    phase: str
    throughput: float
    p50_ms: float | None
    p99_ms: float | None
    pending: int
    xmin_age: int | None
    slot_wal_mb: float | None
    tables: dict[str, dict[str, float]]
    latencies: list[float] = field(default_factory=list, repr=False)

    @property
    def total_mb(self) -> float:
        return sum(t["heap_mb"] + t["index_mb"] for t in self.tables.values())


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] * 1000


class Load:
    """The worker, the producer, the pruner, and what they observed."""

    def __init__(self, dsn: str, rate: int, work_ms: float) -> None:
        self.dsn = dsn
        self.rate = rate
        self.work = work_ms / 1000
        self.finished = 0
        self.claim_times: list[float] = []
        self.stop = asyncio.Event()
        self.tasks: list[asyncio.Task[Any]] = []

    def _time_claims(self) -> None:
        from steeple.postgres.queue import _db

        original = _db._AsyncpgDb.fetch
        times = self.claim_times

        async def timed(self: Any, sql: str, *args: Any, timeout: float) -> Any:
            if ".claim(" not in sql:
                return await original(self, sql, *args, timeout=timeout)
            t0 = time.perf_counter()
            try:
                return await original(self, sql, *args, timeout=timeout)
            finally:
                times.append(time.perf_counter() - t0)

        _db._AsyncpgDb.fetch = timed  # type: ignore[method-assign]

    async def start(self) -> None:
        from steeple.postgres.queue import Scheduler, Task

        self._time_claims()
        worker = Scheduler(
            self.dsn,
            worker_id="bloat",
            schema=SCHEMA,
            concurrency=32,
            batch_size=32,
            maintenance_interval=1.0,
        )

        async def handler(ctx: Any, args: Any) -> None:
            await asyncio.sleep(self.work)
            self.finished += 1

        worker.register(Task("work"), handler)
        self.tasks.append(asyncio.create_task(worker.run_until_shutdown(self.stop)))
        self.tasks.append(asyncio.create_task(self._produce()))
        self.tasks.append(asyncio.create_task(self._prune()))

    async def _produce(self) -> None:
        from steeple.postgres.queue import Task, enqueue_many

        pool = await asyncpg.create_pool(self.dsn, min_size=1, max_size=2)
        task: Task[Any] = Task("work")
        tick = 0.1
        per_tick = max(1, round(self.rate * tick))
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        try:
            while not self.stop.is_set():
                await enqueue_many(pool, task, [{"n": i} for i in range(per_tick)], schema=SCHEMA)
                next_at += tick
                await asyncio.sleep(max(0.0, next_at - loop.time()))
        finally:
            await pool.close()

    async def _prune(self) -> None:
        from steeple.postgres.queue import prune_terminal

        pool = await asyncpg.create_pool(self.dsn, min_size=1, max_size=1)
        try:
            while not self.stop.is_set():
                while (
                    await prune_terminal(pool, timedelta(seconds=30), 10_000, schema=SCHEMA)
                    == 10_000
                ):
                    pass
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.stop.wait(), 5)
        finally:
            await pool.close()

    async def close(self) -> None:
        self.stop.set()
        await asyncio.gather(*self.tasks, return_exceptions=True)


class Holder:
    """One way of holding the vacuum horizon, held from :meth:`hold` to :meth:`release`."""

    def __init__(self, kind: str, dsn: str) -> None:
        self.kind = kind
        self.dsn = dsn
        self.conns: list[asyncpg.Connection] = []
        self.readers: list[asyncio.Task[None]] = []
        self.done = asyncio.Event()
        self.slot = False

    async def hold(self) -> None:
        if self.kind == "idle":
            conn = await asyncpg.connect(self.dsn, server_settings={"application_name": "idle"})
            await conn.execute("BEGIN")
            await conn.fetchval("SELECT txid_current()")
            self.conns.append(conn)
        elif self.kind == "rr":
            for i in range(4):
                conn = await asyncpg.connect(
                    self.dsn, server_settings={"application_name": f"reader-{i}"}
                )
                await conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
                self.conns.append(conn)
                self.readers.append(asyncio.create_task(self._read(conn)))
        elif self.kind == "slot":
            conn = await asyncpg.connect(self.dsn)
            self.conns.append(conn)
            await conn.execute(
                f"SELECT pg_create_logical_replication_slot('{SLOT}', 'test_decoding')"
            )
            self.slot = True
        else:
            raise ValueError(self.kind)

    async def _read(self, conn: asyncpg.Connection) -> None:
        while not self.done.is_set():
            for table in ("tasks", "attempts"):
                await conn.fetchval(f"SELECT count(*) FROM {SCHEMA}.{table}")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.done.wait(), 1.0)

    async def release(self) -> None:
        self.done.set()
        await asyncio.gather(*self.readers, return_exceptions=True)
        try:
            if self.slot:
                await self.conns[0].execute(f"SELECT pg_drop_replication_slot('{SLOT}')")
        finally:
            for conn in self.conns:
                await conn.close()


async def observe(
    conn: asyncpg.Connection, load: Load, phase: str, since: float, done: int, claims: int
) -> Sample:
    now = time.monotonic()
    rows = await conn.fetch(
        """SELECT c.relname, coalesce(s.n_dead_tup, 0) AS dead, coalesce(s.n_live_tup, 0) AS live,
                  coalesce(s.n_tup_upd, 0) AS upd, coalesce(s.n_tup_hot_upd, 0) AS hot,
                  pg_relation_size(c.oid) AS heap, pg_indexes_size(c.oid) AS idx,
                  coalesce(s.autovacuum_count, 0) + coalesce(s.vacuum_count, 0) AS vacuums
           FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
           LEFT JOIN pg_stat_user_tables s ON s.relid = c.oid
           WHERE n.nspname = $1 AND c.relkind = 'r'""",
        SCHEMA,
    )
    tables = {
        r["relname"]: {
            "dead": r["dead"],
            "live": r["live"],
            "upd": r["upd"],
            "hot": r["hot"],
            "vacuums": r["vacuums"],
            "heap_mb": r["heap"] / 2**20,
            "index_mb": r["idx"] / 2**20,
        }
        for r in rows
    }
    pending = await conn.fetchval(f"SELECT count(*) FROM {SCHEMA}.tasks WHERE state = 'pending'")
    xmin_age = await conn.fetchval(
        """SELECT max(greatest(age(backend_xmin), age(backend_xid)))
           FROM pg_stat_activity WHERE pid <> pg_backend_pid()"""
    )
    slot_wal = await conn.fetchval(
        "SELECT max(pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)) FROM pg_replication_slots"
    )
    lat = load.claim_times[claims:]
    return Sample(
        at=now,
        phase=phase,
        throughput=(load.finished - done) / (now - since),
        p50_ms=pct(lat, 0.5),
        p99_ms=pct(lat, 0.99),
        pending=int(pending),
        xmin_age=None if xmin_age is None else int(xmin_age),
        slot_wal_mb=None if slot_wal is None else float(slot_wal) / 2**20,
        tables=tables,
        latencies=list(lat),
    )


def row(s: Sample, t0: float) -> str:
    def f(v: float | None, fmt: str = "7.2f") -> str:
        return format(v, fmt) if v is not None else " " * (int(fmt.split(".")[0]) - 1) + "-"

    t, a = s.tables.get("tasks", {}), s.tables.get("attempts", {})
    return (
        f"{s.at - t0:6.0f} {s.phase:<14} {s.throughput:7.1f} {f(s.p50_ms)} {f(s.p99_ms)} "
        f"{s.pending:7d} {s.xmin_age or 0:7d} {f(s.slot_wal_mb, '7.1f')} "
        f"{int(t.get('dead', 0)):8d} {t.get('heap_mb', 0):7.1f} {t.get('index_mb', 0):7.1f} "
        f"{int(a.get('dead', 0)):8d} {a.get('heap_mb', 0) + a.get('index_mb', 0):7.1f} "
        f"{s.total_mb:7.1f} {int(t.get('hot', 0)):8d}/{int(t.get('upd', 0)):<8d}"
    )


HEADER = (
    "     t phase             tput   p50ms   p99ms pending xminage slotWAL "
    "tasksDead heapMB  idxMB attDead  attMB totalMB  HOT/upd(tasks)"
)


def summarize(samples: list[Sample], holders: list[str], recovery: float) -> dict[str, Any]:
    base = [s for s in samples if s.phase == "baseline"][1:]  # the first sample warms up
    base_lat = [x for s in base for x in s.latencies]
    b_tput = statistics.mean(s.throughput for s in base)
    b_p50, b_p99 = pct(base_lat, 0.5) or 0.0, pct(base_lat, 0.99) or 0.0
    out: dict[str, Any] = {
        "baseline": {"throughput": b_tput, "p50_ms": b_p50, "p99_ms": b_p99},
    }
    for kind in holders:
        hold = [s for s in samples if s.phase == f"hold:{kind}"]
        rec = [s for s in samples if s.phase == f"recover:{kind}"]
        lat = [x for s in hold for x in s.latencies]
        tput = statistics.mean(s.throughput for s in hold)
        p99 = pct(lat, 0.99) or 0.0
        released = hold[-1].at if hold else 0.0
        back = next(
            (
                s.at - released
                for s in rec
                if (s.p99_ms or 0) <= 2 * b_p99 and s.throughput >= 0.9 * b_tput
            ),
            None,
        )
        half = [s for s in rec if s.at - released >= recovery / 2]
        growth = (half[-1].total_mb / half[0].total_mb - 1) if len(half) >= 2 else None
        out[kind] = {
            "hold_throughput_ratio": tput / b_tput,
            "hold_p50_ms": pct(lat, 0.5),
            "hold_p99_ms": p99,
            "hold_p99_ratio": p99 / b_p99 if b_p99 else None,
            "hold_tasks_dead_max": max(int(s.tables["tasks"]["dead"]) for s in hold),
            "hold_total_mb_start_end": (hold[0].total_mb, hold[-1].total_mb),
            "latency_back_after_s": back,
            "size_growth_last_half_of_recovery": growth,
            "met": {
                "throughput>=80%": tput / b_tput >= 0.8,
                "p99<=5x": bool(b_p99) and p99 <= 5 * b_p99,
                "latency back within 120 s": back is not None and back <= 120,
                "size stopped growing": growth is not None and growth < 0.02,
            },
        }
    return out


async def run(args: argparse.Namespace) -> None:
    server = None
    dsn = args.dsn
    if dsn is None:
        server = PrivateServer(
            {
                "wal_level": "logical",
                "max_replication_slots": "4",
                "max_wal_senders": "4",
                "shared_buffers": "128MB",
                "max_connections": "50",
            }
        )
        dsn = server.dsn()
    load = Load(dsn, args.rate, args.work_ms)
    held: list[Holder] = []
    try:
        from steeple.postgres.queue import install

        conn = await asyncpg.connect(dsn)
        await conn.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")
        await install(conn, schema=SCHEMA)
        await load.start()
        plan: list[tuple[str, float, str | None]] = [("baseline", args.baseline, None)]
        for kind in args.holders:
            plan += [(f"hold:{kind}", args.hold, kind), (f"recover:{kind}", args.recovery, None)]
        samples: list[Sample] = []
        t0 = time.monotonic()
        print(
            f"offered {args.rate} tasks/s of {args.work_ms} ms; sample every {args.sample} s; "
            f"baseline {args.baseline} s, hold {args.hold} s, recovery {args.recovery} s",
            flush=True,
        )
        print(HEADER, flush=True)
        for phase, seconds, kind in plan:
            while held:
                await held.pop().release()
            if kind is not None:
                held.append(Holder(kind, dsn))
                await held[-1].hold()
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                since, done, claims = time.monotonic(), load.finished, len(load.claim_times)
                await asyncio.sleep(min(args.sample, max(0.5, end - time.monotonic())))
                sample = await observe(conn, load, phase, since, done, claims)
                samples.append(sample)
                print(row(sample, t0), flush=True)
        while held:
            await held.pop().release()
        summary = summarize(samples, args.holders, args.recovery)
        print(json.dumps(summary, indent=2, default=str))
        if args.json:
            Path(args.json).write_text(  # noqa: ASYNC240 - once, at the end
                json.dumps(
                    {
                        "summary": summary,
                        "samples": [
                            {k: v for k, v in vars(s).items() if k != "latencies"} for s in samples
                        ],
                    },
                    default=str,
                )
            )
        await conn.close()
    finally:
        try:
            await load.close()
            while held:  # a failure or Ctrl-C while held: the slot goes too
                await held.pop().release()
            await drop_schemas(dsn, SCHEMA)
        finally:
            if server is not None:
                server.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dsn", help="an existing server (default: a private one)")
    parser.add_argument("--short", action="store_true", help="90 s holds, 120 s recoveries")
    parser.add_argument("--rate", type=int, default=300)
    parser.add_argument("--work-ms", type=float, default=3.0)
    parser.add_argument("--sample", type=float, default=5.0)
    parser.add_argument("--baseline", type=float)
    parser.add_argument("--hold", type=float)
    parser.add_argument("--recovery", type=float)
    parser.add_argument("--holders", default="idle,rr,slot")
    parser.add_argument("--json", help="write the samples and summary here")
    args = parser.parse_args()
    args.holders = [h for h in args.holders.split(",") if h]
    args.baseline = args.baseline or (60.0 if args.short else 120.0)
    args.hold = args.hold or (90.0 if args.short else 600.0)
    args.recovery = args.recovery or (120.0 if args.short else 180.0)
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
