"""Per-key limits: the claim's cost with 10,000 distinct keys in the backlog, side by side.

Run:  .venv/bin/python benchmarks/bench_keys.py --dsn postgresql://postgres@127.0.0.1:5432/test
      (options: --keys 10000 --per-key 2 --rounds 300 --batch 10 --full 1000)

One schema, one run, four queues with the same backlog (``--keys`` x ``--per-key`` due
tasks, inserted with ``generate_series``, analyzed):

- ``plain``: no settings at all (the claim's one-statement path);
- ``limited``: a global running limit far above the batch, tasks without keys (the
  claim's walk with limits, no keys);
- ``keyed``: every task carries one of ``--keys`` distinct keys (in round-robin order),
  and the queue limits each key to 1 running and 100 starts per second;
- ``saturated``: as ``keyed``, but the first ``--full`` keys each run one task already,
  and their pending tasks come first in claim order: the claim skips them all;
- ``hot``: as ``keyed``, behind ``--full`` tasks of one key that already runs one (one
  customer's long backlog ahead of everyone else's).

Each round claims ``--batch`` tasks from each queue in turn (one claim, as a worker calls
it, rolled back so the backlog stays the same) and times it; the medians and their ratios
to ``plain`` are printed, with the load average. The claim of ``keyed`` looks up each
candidate's key (running tasks and its window) by index, so it costs a few lookups per
task taken; ``saturated`` adds one lookup per skipped task.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

import asyncpg

from steeple.postgres.queue import install, limit_queue

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._run_names import drop_schemas, run_name

SCHEMA = run_name("bench_keys")
QUEUES = ("plain", "limited", "keyed", "saturated", "hot")


async def _fill(conn: asyncpg.Connection, args: argparse.Namespace) -> None:
    s = f'"{SCHEMA}"'
    total = args.keys * args.per_key
    for queue in QUEUES:
        keyed = queue in ("keyed", "saturated", "hot")
        if queue == "hot":  # one key's backlog first in claim order, one of it running
            await conn.execute(
                f"INSERT INTO {s}.tasks (task_name, args, priority, run_at, max_attempts,"
                " lease_duration, backoff_initial_us, backoff_maximum_us, backoff_factor,"
                " backoff_jitter, queue, limit_key, created_at, updated_at, state, attempts,"
                " lease_token, lease_expires_at, worker_id, started_at)"
                " SELECT 'job', '{}'::jsonb, 0, clock_timestamp() - interval '2 hours', 5,"
                " interval '1 minute', 1000000, 300000000, 2, 0.1, 'hot', 'hot-customer',"
                " clock_timestamp() - interval '2 hours', clock_timestamp(),"
                " CASE WHEN i = 0 THEN 'running' ELSE 'pending' END, (i = 0)::integer,"
                " CASE WHEN i = 0 THEN gen_random_uuid() END,"
                " CASE WHEN i = 0 THEN now() + interval '1 hour' END,"
                " CASE WHEN i = 0 THEN 'other' END, CASE WHEN i = 0 THEN now() END"
                " FROM generate_series(0, $1) AS i",
                args.full,
            )
        # Round-robin keys: task i has key i % keys, so every key appears once per round.
        await conn.execute(
            f"INSERT INTO {s}.tasks (task_name, args, priority, run_at, max_attempts,"
            " lease_duration, backoff_initial_us, backoff_maximum_us, backoff_factor,"
            " backoff_jitter, queue, limit_key, created_at, updated_at)"
            " SELECT 'job', '{}'::jsonb, 0, clock_timestamp() - interval '1 hour', 5,"
            " interval '1 minute', 1000000, 300000000, 2, 0.1, $1,"
            " CASE WHEN $2 THEN 'customer-' || (i % $3) END,"
            " clock_timestamp() - interval '1 hour', clock_timestamp()"
            " FROM generate_series(0, $4 - 1) AS i",
            queue,
            keyed,
            args.keys,
            total,
        )
    # saturated: the first --full keys each run one task (one of theirs, not pending).
    await conn.execute(
        f"UPDATE {s}.tasks SET state = 'running', attempts = 1,"
        " lease_token = gen_random_uuid(), lease_expires_at = now() + interval '1 hour',"
        " worker_id = 'other', started_at = now()"
        " WHERE queue = 'saturated' AND id IN (SELECT id FROM"
        f" {s}.tasks WHERE queue = 'saturated' AND limit_key IS NOT NULL"
        " AND (substr(limit_key, 10))::integer < $1 ORDER BY id DESC LIMIT $1)",
        args.full,
    )
    await limit_queue(conn, "limited", max_running=1_000_000, schema=SCHEMA)
    for queue in ("keyed", "saturated", "hot"):
        await limit_queue(
            conn,
            queue,
            max_running_per_key=1,
            rate_limit_per_key=100,
            per_key=1.0,
            schema=SCHEMA,
        )
    await conn.execute(f"ANALYZE {s}.tasks")


async def _claim_once(conn: asyncpg.Connection, queue: str, batch: int) -> tuple[float, int]:
    tr = conn.transaction()
    await tr.start()
    try:
        started = time.perf_counter()
        rows = await conn.fetch(
            f'SELECT id FROM "{SCHEMA}".claim($1::text[], $2::integer[], $3::text[], $4, 4e9)',
            [queue],
            [batch],
            ["job"],
            "bench",
        )
        elapsed = time.perf_counter() - started
    finally:
        await tr.rollback()
    return elapsed, sum(r["id"] is not None for r in rows)


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", default=os.environ.get("STEEPLE_TEST_DSN"))
    parser.add_argument("--keys", type=int, default=10_000)
    parser.add_argument("--per-key", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--batch", type=int, default=10)
    parser.add_argument("--full", type=int, default=1000)
    args = parser.parse_args()
    if not args.dsn:
        parser.error("give --dsn or set STEEPLE_TEST_DSN")
    conn = await asyncpg.connect(args.dsn)
    try:
        await conn.execute(f'DROP SCHEMA IF EXISTS "{SCHEMA}" CASCADE')  # a killed run's leftover
        await install(conn, schema=SCHEMA)
        await _fill(conn, args)
        times: dict[str, list[float]] = {q: [] for q in QUEUES}
        taken: dict[str, int] = {}
        for _ in range(args.rounds):
            for queue in QUEUES:  # interleaved: the machine's load falls on all alike
                elapsed, got = await _claim_once(conn, queue, args.batch)
                times[queue].append(elapsed)
                taken[queue] = got
        load = os.getloadavg()
        print(
            f"claim of {args.batch}, backlog {args.keys * args.per_key} per queue,"
            f" {args.keys} keys, {args.rounds} rounds; load average"
            f" {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
        )
        base = statistics.median(times["plain"])
        for queue in QUEUES:
            median = statistics.median(times[queue])
            print(
                f"  {queue:<10} median {median * 1000:8.3f} ms  x{median / base:6.2f} of plain"
                f"  (took {taken[queue]})"
            )
    finally:
        await conn.close()
        await drop_schemas(args.dsn, SCHEMA)
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
