"""A backlog of millions: the claim, the operator calls and the dashboard on a huge queue.

Run:  .venv/bin/python benchmarks/bench_backlog.py [--big 10000000] [--others 1000000]
      (or ``nox -s backlog`` / ``nox -s backlog -- --big 1000000 --others 100000``)

A private PostgreSQL server (initdb in a temporary directory; binaries from
``STEEPLE_PG_BIN``) holds two queue schemas: ``small`` with a few thousand pending tasks,
and ``big`` with ``--big`` pending tasks in queue ``big``, ``--others`` spread over five
other queues and ``--finished`` succeeded tasks finished a day ago, all inserted with
``generate_series`` and never analyzed (autovacuum is off for the tasks table, so the
planner knows nothing of them, as right after a bulk load). Then, side by side on both
schemas (rounds interleaved, medians):

- the claim of batch 1 and of batch 100 (the claim function, as the worker calls it);
- the claim's plan with ``EXPLAIN (ANALYZE, BUFFERS)`` (``auto_explain`` of the function's
  statements): the buffers it read;
- pause, resume, queue and task limits, enqueue, enqueue of 100, run_state;
- the dashboard's calls: the overview (counts per state, throughput, queues), the queue
  list, the first page of tasks (newest first, and pending only: oldest and newest first);
- pruning: ``prune_terminal`` batches of 10,000 over the finished tasks (each batch one
  short transaction: time per batch and the longest), all of them with ``--prune-all``.

Then a recurring namespace holding ``--occurrences`` published occurrences (inserted the
same way) beside one holding none: claim 1 and 100, the first occurrences page, the first
schedules page and tick, each namespace with 2,880 occurrences to claim.

Targets: each claim within 3x of the small schema's; every dashboard call under 1 s.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import asyncpg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks._private_pg import PrivateServer

INSERT = """INSERT INTO {s}.tasks (task_name, args, max_attempts, lease_duration,
    backoff_initial_us, backoff_maximum_us, backoff_factor, backoff_jitter, queue, state,
    attempts, finished_at, created_at, run_at)
SELECT 'work', jsonb_build_object('i', i), 3, interval '5 min', 1000000, 60000000, 2, 0.1,
       {queue}, {state}, {attempts}, {finished}, {created}, {created}
FROM generate_series($1::bigint, $2::bigint) AS i"""
CHUNK = 1_000_000
CLAIM = """SELECT count(*) FROM {s}.claim(ARRAY[$1], ARRAY[$2]::integer[], ARRAY['work'],
    'bench', extract(epoch FROM clock_timestamp()) + 60) WHERE id IS NOT NULL"""


async def build(conn: asyncpg.Connection, s: str, big: int, others: int, finished: int) -> None:
    await conn.execute(f"ALTER TABLE {s}.tasks SET (autovacuum_enabled = false)")
    pending = ("'pending'", "0", "NULL", "clock_timestamp()")
    done = (
        "'succeeded'",
        "1",
        "now() - interval '1 day'",
        "now() - interval '1 day 1 minute'",
    )
    parts = [("'big'", big, pending), ("'q' || (i % 5)", others, pending)]
    parts.append(("'big'", finished, done))
    for queue, n, (state, attempts, fin, created) in parts:
        sql = INSERT.format(
            s=s, queue=queue, state=state, attempts=attempts, finished=fin, created=created
        )
        for lo in range(1, n + 1, CHUNK):
            t0 = time.perf_counter()
            await conn.execute(sql, lo, min(n, lo + CHUNK - 1))
            print(
                f"  {s}: {state} {queue} rows {lo:,}..{min(n, lo + CHUNK - 1):,} "
                f"in {time.perf_counter() - t0:.1f} s",
                flush=True,
            )


def load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


async def timed(fn: Callable[[], Awaitable[Any]], rounds: int) -> tuple[float, float]:
    """Median and max in ms."""
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        await fn()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times), max(times)


async def claim_plan(conn: asyncpg.Connection, s: str, queue: str, want: int) -> list[str]:
    """The claim's statements as auto_explain logs them, with their buffer counts."""
    lines: list[str] = []
    conn.add_log_listener(lambda c, m: lines.append(m.message))
    await conn.execute(
        "LOAD 'auto_explain'; SET auto_explain.log_min_duration = 0;"
        " SET auto_explain.log_analyze = on; SET auto_explain.log_buffers = on;"
        " SET auto_explain.log_nested_statements = on; SET client_min_messages = log"
    )
    try:
        await conn.fetchval(CLAIM.format(s=s), queue, want)
        await asyncio.sleep(0.1)
    finally:
        await conn.execute(
            "SET client_min_messages = notice; SET auto_explain.log_min_duration = -1"
        )
    return [
        ln
        for msg in lines
        for ln in msg.splitlines()
        if "Buffers" in ln or "Scan" in ln or "Query Text" in ln or "duration" in ln
    ]


HISTORY = """INSERT INTO {s}.recurring_occurrences (namespace, id, definition_name, due_at,
    state, attempts, window_ends_at, created_at, updated_at, finished_at)
SELECT 'bench', md5('h' || i), 'hist-' || (i % 100), $3::timestamptz - interval '1 s' * i,
       'published', 1, $3::timestamptz - interval '1 s' * i + interval '1 hour',
       $3::timestamptz - interval '1 s' * i, $3::timestamptz - interval '1 s' * i,
       $3::timestamptz - interval '1 s' * i
FROM generate_series($1::bigint, $2::bigint) AS i"""


async def recurring(dsn: str, occurrences: int, rounds: int) -> None:
    """A namespace holding ``occurrences`` published occurrences beside an empty one."""
    from datetime import UTC, datetime

    from steeple.core import MissedRunPolicy, RecurringConfig, RecurringDefinition, ScheduledMessage
    from steeple.keyring import Keyring, StorageKey
    from steeple.postgres import PostgresRecurringStore
    from steeple.testing import FakeClock

    now = datetime(2031, 3, 4, 5, 6, 7, tzinfo=UTC)
    stores = {}
    conn = await asyncpg.connect(dsn)
    for schema in ("rsmall", "rbig"):
        store = await PostgresRecurringStore.initialize(
            dsn,
            RecurringConfig("bench", 200, 100_000),
            Keyring(StorageKey.generate("bench")),
            FakeClock(now),
            schema=schema,
        )
        # Two days of a per-minute schedule caught up: 2,880 occurrences to claim.
        await store.create(
            RecurringDefinition(
                "every-minute",
                "* * * * *",
                now - timedelta(days=2),
                MissedRunPolicy.CATCH_UP,
                ScheduledMessage("bench", "tick", b"x" * 200),
            )
        )
        while (await store.tick(100)).materialized:
            pass
        stores[schema] = store
    await conn.execute("ALTER TABLE rbig.recurring_occurrences SET (autovacuum_enabled = false)")
    t0 = time.perf_counter()
    for lo in range(1, occurrences + 1, CHUNK):
        await conn.execute(HISTORY.format(s="rbig"), lo, min(occurrences, lo + CHUNK - 1), now)
    print(f"\nrecurring: {occurrences:,} published occurrences in {time.perf_counter() - t0:.0f} s")
    for label in ("no statistics", "after ANALYZE"):
        if label == "after ANALYZE":
            await conn.execute("ANALYZE rsmall.recurring_occurrences")
            await conn.execute("ANALYZE rbig.recurring_occurrences")
        results: dict[str, dict[str, list[float]]] = {"rsmall": {}, "rbig": {}}
        for _ in range(rounds):
            for schema, store in stores.items():
                for name, fn in {
                    "claim 1": lambda st=store: st.claim(1),
                    "claim 100": lambda st=store: st.claim(100),
                    "occurrences page (100)": lambda st=store: st.occurrences(limit=100),
                    "schedules page (100)": lambda st=store: st.schedules(limit=100),
                    "tick 100": lambda st=store: st.tick(100),
                }.items():
                    med, _ = await timed(fn, 1)
                    results[schema].setdefault(name, []).append(med)
        print(f"recurring, {label}: medians of {rounds} rounds (load {load()})")
        print(f"{'call':<30} {'empty ms':>10} {'big ms':>10} {'ratio':>7}")
        for name in results["rsmall"]:
            x = statistics.median(results["rsmall"][name])
            y = statistics.median(results["rbig"][name])
            print(f"{name:<30} {x:10.2f} {y:10.2f} {y / x:7.2f}", flush=True)
    for store in stores.values():
        await store.close()
    await conn.close()


async def run(args: argparse.Namespace) -> None:
    from steeple.admin.queue_admin import PostgresTaskAdmin
    from steeple.postgres.queue import (
        Task,
        admin,
        enqueue,
        enqueue_many,
        install,
        limit_queue,
        limit_task,
        pause_queue,
        prune_terminal,
        resume_queue,
        run_state,
    )

    server = PrivateServer(
        {
            "shared_buffers": "256MB",
            "max_wal_size": "4GB",
            "checkpoint_timeout": "30min",
            "max_connections": "30",
        }
    )
    try:
        dsn = server.dsn()
        conn = await asyncpg.connect(dsn)
        pool = await asyncpg.create_pool(dsn, min_size=1, max_size=4)
        t0 = time.perf_counter()
        for s in ("small", "big"):
            await install(conn, schema=s)
        await build(conn, "small", args.small, 0, 0)
        await build(conn, "big", args.big, args.others, args.finished)
        print(f"built in {time.perf_counter() - t0:.0f} s", flush=True)
        sizes = await conn.fetch(
            """SELECT n.nspname, pg_size_pretty(pg_total_relation_size(c.oid)) AS size
               FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
               WHERE c.relname = 'tasks' AND n.nspname IN ('small', 'big')"""
        )
        print("tasks table + indexes:", {r["nspname"]: r["size"] for r in sizes})
        task: Task[Any] = Task("work")
        queue_of = {"small": "big", "big": "big"}

        def calls(s: str) -> dict[str, Callable[[], Awaitable[Any]]]:
            q = queue_of[s]
            overview = PostgresTaskAdmin(pool, s)
            state: dict[str, int] = {}

            async def one_enqueue() -> None:
                state["id"] = (await enqueue(pool, task, {"x": 1}, schema=s, queue=q)).id

            return {
                "claim batch 1": lambda: pool.fetchval(CLAIM.format(s=s), q, 1),
                "claim batch 100": lambda: pool.fetchval(CLAIM.format(s=s), q, 100),
                "claim batch 1, other queue": lambda: pool.fetchval(
                    CLAIM.format(s=s), "q1" if s == "big" else q, 1
                ),
                "enqueue": one_enqueue,
                "enqueue_many 100": lambda: enqueue_many(
                    pool, task, [{"x": i} for i in range(100)], schema=s, queue=q
                ),
                "run_state": lambda: run_state(pool, state.get("id", 1), schema=s),
                "pause_queue": lambda: pause_queue(pool, q, schema=s),
                "resume_queue": lambda: resume_queue(pool, q, schema=s),
                "limit_queue": lambda: limit_queue(pool, q, max_running=10**6, schema=s),
                "limit_queue (remove)": lambda: limit_queue(pool, q, schema=s),
                "limit_task": lambda: limit_task(pool, "work", schema=s),
                "dashboard overview": overview.overview,
                "list_queues": lambda: admin.list_queues(pool, schema=s),
                "tasks page (newest)": lambda: overview.tasks(limit=50, newest_first=True),
                "tasks page (pending)": lambda: overview.tasks(limit=50, state="pending"),
                "tasks page (pending, newest)": lambda: overview.tasks(
                    limit=50, state="pending", newest_first=True
                ),
            }

        for label in ("no statistics", "after ANALYZE"):
            if label == "after ANALYZE":
                await conn.execute("ANALYZE small.tasks; ANALYZE big.tasks")
            results: dict[str, dict[str, list[float]]] = {"small": {}, "big": {}}
            for _ in range(args.rounds):
                for s in ("small", "big"):
                    for name, fn in calls(s).items():
                        med, _ = await timed(fn, 1)
                        results[s].setdefault(name, []).append(med)
            print(f"\n{label}: medians of {args.rounds} rounds (load {load()})")
            print(f"{'call':<30} {'small ms':>10} {'big ms':>10} {'ratio':>7}")
            for name in results["small"]:
                a = statistics.median(results["small"][name])
                b = statistics.median(results["big"][name])
                print(f"{name:<30} {a:10.2f} {b:10.2f} {b / a:7.2f}", flush=True)
        for want in (1, 100):
            print(f"\nclaim plan, batch {want}, big schema:")
            for line in await claim_plan(conn, "big", "big", want):
                print("   ", line)
        if args.finished:
            print("\npruning finished tasks in batches of 10,000:")
            batches: list[float] = []
            pruned = 0
            while True:
                t1 = time.perf_counter()
                n = await prune_terminal(pool, timedelta(hours=1), 10_000, schema="big")
                batches.append(time.perf_counter() - t1)
                pruned += n
                if n < 10_000 or (not args.prune_all and len(batches) >= 20):
                    break
            print(
                f"  {pruned:,} pruned in {len(batches)} batches: median "
                f"{statistics.median(batches) * 1000:.0f} ms, longest {max(batches) * 1000:.0f} ms"
                f" per batch (each its own transaction: locks held that long at most)"
            )
        await pool.close()
        await conn.close()
        if args.occurrences:
            await recurring(dsn, args.occurrences, args.rounds)
    finally:
        server.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--big", type=int, default=10_000_000)
    parser.add_argument("--others", type=int, default=1_000_000)
    parser.add_argument("--finished", type=int, default=1_000_000)
    parser.add_argument("--small", type=int, default=5_000)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--prune-all", action="store_true")
    parser.add_argument("--occurrences", type=int, default=1_000_000)
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
