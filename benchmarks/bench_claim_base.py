"""The claim statement at a base commit beside the work tree's, interleaved claim by claim.

``python benchmarks/bench_claim_base.py --dsn URL [--base 6611b55] [--rounds 7] [--n 20000]``

The base commit's queue migrations (``git archive``) are applied by hand to one schema and
the work tree's ``install`` to another, in the same database. Each round inserts N pending
no-op tasks into both (one INSERT each, then ``VACUUM ANALYZE``) and drains both with the
one-off claim statement (200 a claim, nothing completed), one claim of each in turn, the
side going first alternating by round: both sides meet the same load at the same moment.
It prints each round's claims per second and head/base, and the medians. Only the claim's
SQL differs between the sides; the client (this process, one connection) is the same.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import os
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import asyncpg

from steeple.postgres.queue import install
from steeple.postgres.queue._sql import queue_sql

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._run_names import drop_schemas, run_name

MIGRATIONS = "packages/postgres/src/steeple/postgres/queue/migrations"
BATCH = 200
SIDES = (run_name("bench_claim_base"), run_name("bench_claim_head"))
INSERT = """
INSERT INTO {s}.tasks (task_name, args, max_attempts, lease_duration, backoff_initial_us,
                       backoff_maximum_us, backoff_factor, backoff_jitter, run_at, created_at,
                       updated_at)
SELECT 'b', '{{}}'::jsonb, 3, interval '30 s', 1000000, 10000000, 2, 0, now(), now(), now()
FROM generate_series(1, $1)"""


def base_migrations(commit: str) -> list[str]:
    """Return the base commit's queue migrations (``up.sql`` texts), in order."""
    archive = subprocess.run(
        ["git", "archive", commit, MIGRATIONS], capture_output=True, check=True
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        members = sorted(
            (m for m in tar.getmembers() if m.name.endswith("/up.sql")), key=lambda m: m.name
        )
        return [tar.extractfile(m).read().decode() for m in members]  # type: ignore[union-attr]


async def fill(conn: asyncpg.Connection, n: int) -> None:
    for s in SIDES:
        await conn.execute(f'TRUNCATE "{s}".tasks, "{s}".attempts CASCADE')
        await conn.execute(INSERT.format(s=f'"{s}"'), n)
        await conn.execute(f'VACUUM ANALYZE "{s}".tasks')


async def drain(conn: asyncpg.Connection, n: int, first: int) -> dict[str, float]:
    """Claim every task of both sides, alternately; return each side's claims per second."""
    claim = {s: queue_sql(s).claim for s in SIDES}
    give_up = await conn.fetchval("SELECT extract(epoch FROM clock_timestamp()) + 3600")
    spent = dict.fromkeys(SIDES, 0.0)
    taken = dict.fromkeys(SIDES, 0)
    order = SIDES if first == 0 else SIDES[::-1]
    while any(taken[s] < n for s in SIDES):
        for s in order:
            if taken[s] >= n:
                continue
            t0 = time.perf_counter()
            rows = await conn.fetch(claim[s], ["b"], BATCH, "w", give_up)
            spent[s] += time.perf_counter() - t0
            if not rows:
                raise RuntimeError(f"{s}: the claim took nothing with {n - taken[s]} left")
            taken[s] += len(rows)
    return {s: n / spent[s] for s in SIDES}


async def run(dsn: str, base: str, rounds: int, n: int) -> None:
    migrations = base_migrations(base)
    conn = await asyncpg.connect(dsn)
    try:
        for s in SIDES:
            await conn.execute(f'DROP SCHEMA IF EXISTS "{s}" CASCADE')  # a killed run's leftover
            await conn.execute(f'CREATE SCHEMA "{s}"')
        for sql in migrations:
            await conn.execute(sql.replace("__SCHEMA__", f'"{SIDES[0]}"'))
        await install(conn, schema=SIDES[1])
        rates: dict[str, list[float]] = {s: [] for s in SIDES}
        for r in range(rounds):
            await fill(conn, n)
            for s, rate in (await drain(conn, n, r % 2)).items():
                rates[s].append(rate)
            b, h = rates[SIDES[0]][-1], rates[SIDES[1]][-1]
            print(f"round {r + 1}/{rounds}: base {b:,.0f}  head {h:,.0f} tasks/s  {h / b:.3f}x")
        ratios = [h / b for b, h in zip(rates[SIDES[0]], rates[SIDES[1]], strict=True)]
        b, h = statistics.median(rates[SIDES[0]]), statistics.median(rates[SIDES[1]])
        print(
            f"claim, {n:,} tasks a round, {BATCH} a claim: base {base} {b:,.0f}, head {h:,.0f} "
            f"tasks/s (medians); head/base per round: median {statistics.median(ratios):.3f}, "
            f"{min(ratios):.3f}..{max(ratios):.3f}"
        )
    finally:
        await conn.close()
        await drop_schemas(dsn, *SIDES)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", default=os.environ.get("STEEPLE_TEST_DSN"))
    parser.add_argument("--base", default="6611b55", help="the base commit")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--n", type=int, default=20_000, help="tasks per side and round")
    args = parser.parse_args()
    if not args.dsn:
        parser.error("give --dsn or set STEEPLE_TEST_DSN")
    asyncio.run(run(args.dsn, args.base, args.rounds, args.n))


if __name__ == "__main__":
    main()
