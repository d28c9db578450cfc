"""Latency of the PostgreSQL recurring store against the PostgreSQL limit, in one run.

    python benchmarks/bench_recurring.py [--ticks 30] [--relays 200]

Uses ``STEEPLE_DATABASE_URL`` or ``STEEPLE_TEST_DSN``; without either it starts a private
pgserver cluster. Prints milliseconds per operation for

- ``tick(100)``: one transaction materializing 100 sealed occurrences, beside a raw-SQL
  transaction inserting 100 rows of the same size (the PostgreSQL limit for that work);
- ``relay`` through a MemoryBroker: two transactions around the publish, beside two raw
  one-row UPDATE transactions (the least two durable commits cost);
- ``claim(100)``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import asyncpg

from steeple.core import MissedRunPolicy, RecurringConfig, RecurringDefinition, ScheduledMessage
from steeple.keyring import Keyring, StorageKey
from steeple.postgres import PostgresRecurringStore
from steeple.testing import FakeClock, MemoryBroker

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._run_names import drop_schemas, run_name

NOW = datetime(2031, 3, 4, 5, 6, 7, tzinfo=UTC)


def _dsn() -> tuple[str, object | None]:
    dsn = os.environ.get("STEEPLE_DATABASE_URL") or os.environ.get("STEEPLE_TEST_DSN")
    if dsn:
        return dsn, None
    from pgserver.postgres_server import get_server

    server = get_server(Path(tempfile.mkdtemp(prefix="steeple-bench-")), cleanup_mode="delete")
    return server.get_uri(), server


def _ms(samples: list[float]) -> str:
    return (
        f"{statistics.median(samples) * 1000:8.2f} ms (p90 "
        f"{sorted(samples)[int(len(samples) * 0.9) - 1] * 1000:.2f})"
    )


async def _raw_baselines(
    dsn: str, schema: str, rounds: int, payload: bytes
) -> tuple[list[float], list[float]]:
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(
            f'CREATE TABLE "{schema}".raw_rows (id text PRIMARY KEY, name text, '
            "due_at timestamptz, state text, content bytea, created_at timestamptz)"
        )
        inserts: list[float] = []
        for r in range(rounds):
            ids = [f"{r:06d}{i:026d}" for i in range(100)]
            # as many distinct bytes as the sealed contents (payload + envelope + JSON)
            contents = [os.urandom(len(payload) + 120) for _ in ids]
            started = time.perf_counter()
            async with conn.transaction():
                await conn.execute("SET LOCAL synchronous_commit = on")
                await conn.execute(
                    f"INSERT INTO \"{schema}\".raw_rows SELECT u.id, $1, $2, 'pending', "
                    "u.content, $2 FROM unnest($3::text[], $4::bytea[]) AS u(id, content)",
                    "definition",
                    NOW,
                    ids,
                    contents,
                )
            inserts.append(time.perf_counter() - started)
        updates: list[float] = []
        for r in range(rounds):
            started = time.perf_counter()
            for state in ("leased", "published"):
                async with conn.transaction():
                    await conn.execute(
                        f'UPDATE "{schema}".raw_rows SET state = $1 WHERE id = $2',
                        state,
                        f"{r:06d}{0:026d}",
                    )
            updates.append(time.perf_counter() - started)
        return inserts, updates
    finally:
        await conn.close()


async def main(ticks: int, relays: int) -> None:
    dsn, server = _dsn()
    schema = run_name("bench_recurring")
    clock = FakeClock(NOW)
    keyring = Keyring(StorageKey.generate("bench"))
    payload = os.urandom(512)
    store = await PostgresRecurringStore.initialize(
        dsn, RecurringConfig("bench", 200, 100_000), keyring, clock, schema=schema
    )
    try:
        for i in range(100):
            await store.create(
                RecurringDefinition(
                    f"def-{i:03d}",
                    "* * * * *",
                    NOW - timedelta(days=2),
                    MissedRunPolicy.CATCH_UP,
                    ScheduledMessage("bench", "tick", payload),
                )
            )
        for _ in range(3):  # warm the pool and the plans
            await store.tick(100)
        tick_samples: list[float] = []
        for _ in range(ticks):
            started = time.perf_counter()
            result = await store.tick(100)
            tick_samples.append(time.perf_counter() - started)
            assert result.materialized == 100
        broker = MemoryBroker()
        claim_samples: list[float] = []
        relay_samples: list[float] = []
        while len(relay_samples) < relays:
            started = time.perf_counter()
            leases = await store.claim(100)
            claim_samples.append(time.perf_counter() - started)
            for lease in leases:
                if len(relay_samples) >= relays:
                    break
                started = time.perf_counter()
                await store.relay(lease, broker)
                relay_samples.append(time.perf_counter() - started)
        raw_insert, raw_update = await _raw_baselines(dsn, schema, max(ticks, 20), payload)
    finally:
        await store.close()
        await drop_schemas(dsn, schema)
        if server is not None:
            server.cleanup()  # type: ignore[attr-defined]
    tick_ms = statistics.median(tick_samples)
    relay_ms = statistics.median(relay_samples)
    print(f"steeple recurring store on {dsn.split('@')[-1]}")
    print(f"  tick(100)                 {_ms(tick_samples)}")
    print(f"  raw INSERT of 100 rows    {_ms(raw_insert)}   (the PostgreSQL limit)")
    print(f"  ratio tick / raw insert   {tick_ms / statistics.median(raw_insert):8.2f} x")
    print(f"  claim(100)                {_ms(claim_samples)}")
    print(f"  relay (MemoryBroker)      {_ms(relay_samples)}")
    print(f"  raw 2 x 1-row UPDATE txn  {_ms(raw_update)}   (the PostgreSQL limit)")
    print(f"  ratio relay / raw         {relay_ms / statistics.median(raw_update):8.2f} x")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ticks", type=int, default=30)
    parser.add_argument("--relays", type=int, default=200)
    args = parser.parse_args()
    asyncio.run(main(args.ticks, args.relays))
