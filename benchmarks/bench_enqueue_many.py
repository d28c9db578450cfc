"""Bulk enqueue: steeple's ``enqueue_many`` vs its previous statement, COPY, and PgQueuer.

Run:  .venv/bin/python benchmarks/bench_enqueue_many.py [--dsn DSN] [--n 30000] [--rounds 5]

Without ``--dsn`` (and no ``STEEPLE_TEST_DSN``) a private PostgreSQL (pgserver) is started,
as ``bench_queue.py`` does. Each round enqueues ``--n`` no-op tasks with every variant in
turn (the order rotates each round, tables emptied before each), in calls of ``--chunk``
tasks on an autocommit connection, so a busy machine slows them alike; the table gives the
median of the rounds. The variants:

- ``enqueue_many``: the public call, as shipped (run ids sent by the client);
- ``server run ids``: the same statement with the run ids left to the column's default,
  ``gen_random_uuid()`` per row (the statement before the run ids were sent);
- ``COPY into tasks``: ``copy_records_to_table`` straight into the tasks table, every
  column computed by the client (ids drawn from the sequence, the server's clock read
  first), then the NOTIFY: the fewest server steps COPY allows, in one transaction;
- ``COPY + INSERT``: COPY of the args into a temporary staging table, then the shipped
  statement reading it, in one transaction (what keeps every server-side rule);
- ``PgQueuer``: ``Queries.enqueue`` with lists (its bulk path), as ``bench_queue.py``.

Beside the rate: the server backend's CPU time (from /proc, when the server runs on this
machine) and the client's, per ``--n`` tasks: the part of each that a busy machine cannot
inflate much.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import asyncpg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks._run_names import run_name

SCHEMA = run_name("bench_enqueue_many")
PGQUEUER_SCHEMA = run_name("bench_enqueue_many_pgq")
_RUN_ID_COLUMN = ", trace_context, run_id)"
_RUN_ID_VALUE = ",\n           encode(substr($16::bytea, u.n::integer * 16 - 15, 16), 'hex')::uuid"
_COPY_COLUMNS = [
    "id", "task_name", "args", "priority", "run_at", "max_attempts", "lease_duration",
    "backoff_initial_us", "backoff_maximum_us", "backoff_factor", "backoff_jitter", "queue",
    "created_at", "updated_at", "run_id",
]  # fmt: skip

Variant = Callable[[list[Any]], Awaitable[None]]


def server_run_ids_statement(shipped: str) -> str:
    """The shipped statement with the run ids left to ``gen_random_uuid()`` (as before)."""
    if _RUN_ID_COLUMN not in shipped or _RUN_ID_VALUE not in shipped:
        raise SystemExit("the enqueue_many statement changed: update this benchmark")
    return shipped.replace(_RUN_ID_COLUMN, ", trace_context)").replace(_RUN_ID_VALUE, "")


class Cpu:
    """CPU seconds of this process and of the connection's server backend (when local)."""

    def __init__(self, conn: asyncpg.Connection) -> None:
        self.stat = Path(f"/proc/{conn.get_server_pid()}/stat")
        self.tick = os.sysconf("SC_CLK_TCK")

    def server(self) -> float | None:
        try:
            fields = self.stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            return None
        return (int(fields[11]) + int(fields[12])) / self.tick


async def variants(conn: asyncpg.Connection, chunk: int) -> dict[str, Variant]:
    from pgqueuer import AsyncpgDriver, Queries

    from steeple.postgres.queue import Task, enqueue_many
    from steeple.postgres.queue._enqueue import _many_params, random_run_ids
    from steeple.postgres.queue._sql import queue_sql

    noop: Task[dict[str, int]] = Task("noop")
    sql = queue_sql(SCHEMA)
    before = server_run_ids_statement(sql.enqueue_many)
    staged = sql.enqueue_many.replace(
        "jsonb_array_elements($2::text::jsonb) WITH ORDINALITY AS u(a, n)",
        "pg_temp.bench_staged AS u",
    ).replace("FROM ins", "FROM ins, (SELECT $2::text) AS unused")
    queries = Queries(AsyncpgDriver(conn))

    async def shipped(payloads: list[Any]) -> None:
        for start in range(0, len(payloads), chunk):
            await enqueue_many(conn, noop, payloads[start : start + chunk], schema=SCHEMA)

    async def server_ids(payloads: list[Any]) -> None:
        for start in range(0, len(payloads), chunk):
            part = payloads[start : start + chunk]
            params, _, _ = _many_params(noop, part, None, sql, None, local=False)
            await conn.fetch(before, *params, None)

    async def copy_direct(payloads: list[Any]) -> None:
        lease = datetime.timedelta(seconds=60)
        for start in range(0, len(payloads), chunk):
            texts = [noop.encode(a) for a in payloads[start : start + chunk]]
            raw = random_run_ids(len(texts))
            async with conn.transaction():
                row = await conn.fetchrow(
                    "SELECT clock_timestamp(), array(SELECT nextval(pg_get_serial_sequence("
                    f"'{SCHEMA}.tasks', 'id')) FROM generate_series(1, $1)) FROM "
                    "(SELECT set_config('synchronous_commit', 'on', true)) AS durable",
                    len(texts),
                )
                assert row is not None
                now, ids = row
                records = [
                    (i, "noop", t, 0, now, 5, lease, 1_000_000, 300_000_000, 2, 0.0, "default",
                     now, now, uuid.UUID(bytes=raw[16 * k : 16 * k + 16]))
                    for k, (i, t) in enumerate(zip(ids, texts, strict=True))
                ]  # fmt: skip
                await conn.copy_records_to_table(
                    "tasks", schema_name=SCHEMA, columns=_COPY_COLUMNS, records=records
                )
                await conn.execute(f"SELECT pg_notify('{sql.channel}', '')")

    async def copy_staged(payloads: list[Any]) -> None:
        for start in range(0, len(payloads), chunk):
            part = payloads[start : start + chunk]
            params, _, _ = _many_params(noop, part, None, sql, None, local=False)
            params[1] = None
            async with conn.transaction():
                await conn.execute(
                    "CREATE TEMP TABLE IF NOT EXISTS bench_staged (a jsonb, n bigint) "
                    "ON COMMIT DELETE ROWS"
                )
                await conn.copy_records_to_table(
                    "bench_staged",
                    records=[(noop.encode(a), n) for n, a in enumerate(part, start=1)],
                )
                await conn.fetch(staged, *params, None, random_run_ids(len(part)))

    async def pgqueuer(payloads: list[Any]) -> None:
        for start in range(0, len(payloads), chunk):
            m = min(chunk, len(payloads) - start)
            await queries.enqueue(["noop"] * m, [None] * m, [0] * m)

    return {
        "enqueue_many": shipped,
        "server run ids": server_ids,
        "COPY into tasks": copy_direct,
        "COPY + INSERT": copy_staged,
        "PgQueuer": pgqueuer,
    }


async def run(dsn: str, n: int, chunk: int, rounds: int) -> None:
    os.environ["PGQUEUER_SCHEMA"] = PGQUEUER_SCHEMA
    from pgqueuer import AsyncpgDriver, Queries

    from steeple.postgres.queue import install

    conn = await asyncpg.connect(dsn)
    try:
        for schema in (SCHEMA, PGQUEUER_SCHEMA):
            await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        await install(conn, schema=SCHEMA)
        await Queries(AsyncpgDriver(conn)).install()
        table = await variants(conn, chunk)
        cpu = Cpu(conn)
        payloads = [{"i": i} for i in range(n)]
        rates: dict[str, list[float]] = {k: [] for k in table}
        server: dict[str, list[float]] = {k: [] for k in table}
        client: dict[str, list[float]] = {k: [] for k in table}
        names = list(table)
        for r in range(rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                await conn.execute(
                    f'TRUNCATE "{SCHEMA}".tasks CASCADE; '
                    f'TRUNCATE "{PGQUEUER_SCHEMA}".pgqueuer, "{PGQUEUER_SCHEMA}".pgqueuer_log'
                )
                s0, c0, t0 = cpu.server(), time.process_time(), time.perf_counter()
                await table[name](payloads)
                rates[name].append(n / (time.perf_counter() - t0))
                client[name].append(time.process_time() - c0)
                s1 = cpu.server()
                if s0 is not None and s1 is not None:
                    server[name].append(s1 - s0)
            print(f"round {r + 1}/{rounds} done", file=sys.stderr, flush=True)
        report(n, chunk, rounds, rates, server, client)
    finally:
        for schema in (SCHEMA, PGQUEUER_SCHEMA):
            await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        await conn.close()


def report(
    n: int,
    chunk: int,
    rounds: int,
    rates: dict[str, list[float]],
    server: dict[str, list[float]],
    client: dict[str, list[float]],
) -> None:
    ours = statistics.median(rates["enqueue_many"])
    print(f"\nbulk enqueue, N={n:,} no-op tasks in calls of {chunk:,}, median of {rounds} rounds")
    head = f"{'variant':<16} {'tasks/s':>9} {'enqueue_many/it':>16} {'server CPU ms':>14}"
    print(head + f" {'client CPU ms':>14}  rounds (tasks/s)")
    print("-" * (len(head) + 34))
    for name, values in rates.items():
        rate = statistics.median(values)
        cpu = f"{statistics.median(server[name]) * 1000:.0f}" if server[name] else "-"
        line = f"{name:<16} {rate:>9,.0f} {ours / rate:>15.2f}x {cpu:>14}"
        line += f" {statistics.median(client[name]) * 1000:>14.0f}  "
        print(line + ", ".join(f"{v:,.0f}" for v in values))


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", default=os.environ.get("STEEPLE_TEST_DSN"), required=False)
    parser.add_argument("--n", type=int, default=30_000, help="tasks per variant and round")
    parser.add_argument("--chunk", type=int, default=5000, help="tasks per call")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    server = None
    if not args.dsn:
        from pgserver.postgres_server import get_server

        print("no --dsn: starting a private PostgreSQL (pgserver)", file=sys.stderr)
        server = get_server(tempfile.mkdtemp(prefix="steeple-bench-"), cleanup_mode="delete")
        args.dsn = server.get_uri()
    try:
        await run(args.dsn, args.n, args.chunk, args.rounds)
    finally:
        if server is not None:
            server.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
