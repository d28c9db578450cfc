"""Relay workers as real processes: SIGKILL one mid-work, a fresh process finishes the job.

The checker (as in RELIABILITY.md): every occurrence is published at least once, always
under the same idempotency key, and the store ends with everything published.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import asyncpg
import pytest

from steeple.core import (
    MissedRunPolicy,
    OccurrenceState,
    RecurringConfig,
    RecurringDefinition,
    ScheduledMessage,
    SystemClock,
)
from steeple.keyring import Keyring, StorageKey
from steeple.postgres import PostgresRecurringStore

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

KEY = StorageKey("k1", b"\x0a" * 32)
CONFIG = RecurringConfig(
    "workers", 10, 1000, lease_duration=timedelta(seconds=1), delivery_window=timedelta(hours=1)
)

_WORKER = """
import asyncio, json, os, sys
from datetime import timedelta
from steeple.core import RecurringConfig, SystemClock
from steeple.core.messages import BrokerReceipt
from steeple.keyring import Keyring, StorageKey
from steeple.postgres import PostgresRecurringStore, RecurringRelay

class FileBroker:
    '''Appends every accepted (key, payload) to a file, durably; dedup is the checker's.'''
    def __init__(self, path):
        self.path = path
    async def publish(self, message, *, idempotency_key, timeout):
        await asyncio.sleep(0.03)
        with open(self.path, "a") as f:
            f.write(json.dumps([idempotency_key, message.payload.decode()]) + "\\n")
            f.flush()
            os.fsync(f.fileno())
        return BrokerReceipt("file", idempotency_key)

async def main(dsn, schema, path, seconds):
    config = RecurringConfig("workers", 10, 1000, lease_duration=timedelta(seconds=1),
                             delivery_window=timedelta(hours=1))
    store = await PostgresRecurringStore.connect(
        dsn, config, Keyring(StorageKey("k1", b"\\x0a" * 32)), SystemClock(), schema=schema)
    stop = asyncio.Event()
    asyncio.get_running_loop().call_later(float(seconds), stop.set)
    async with store:
        print("ready", flush=True)
        await RecurringRelay(store, FileBroker(path), claim_limit=5, idle_interval=0.05).run(stop)

asyncio.run(main(*sys.argv[1:]))
"""


async def spawn(dsn: str, schema: str, journal: Path, seconds: float) -> asyncio.subprocess.Process:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _WORKER,
        dsn,
        schema,
        str(journal),
        str(seconds),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), 30)
    assert line.strip() == b"ready", (await proc.communicate())[1].decode()
    return proc


@pytest.mark.timeout(120)
async def test_sigkilled_worker_is_replaced_and_nothing_is_lost(
    pg_schema: tuple[str, str], tmp_path: Path
) -> None:
    dsn, schema = pg_schema
    journal = tmp_path / "broker.jsonl"
    journal.touch()
    now = SystemClock().now()
    store = await PostgresRecurringStore.initialize(
        dsn, CONFIG, Keyring(KEY), SystemClock(), schema=schema
    )
    try:
        for name in ("a", "b"):
            await store.create(
                RecurringDefinition(
                    name,
                    "* * * * *",
                    now - timedelta(minutes=20),
                    MissedRunPolicy.CATCH_UP,
                    ScheduledMessage("t", "m", name.encode()),
                )
            )
        victim = await spawn(dsn, schema, journal, 60)
        # let it work part-way (leases taken, some published), then kill it outright
        for _ in range(200):
            if len(journal.read_text().splitlines()) >= 5:
                break
            await asyncio.sleep(0.02)
        victim.send_signal(signal.SIGKILL)
        await victim.wait()
        assert victim.returncode == -signal.SIGKILL
        done_before = len(journal.read_text().splitlines())
        assert 0 < done_before < 40

        successor = await spawn(dsn, schema, journal, 8)
        _, err = await successor.communicate()
        assert successor.returncode == 0, err.decode()

        page = await store.occurrences(limit=100)
        # 40 were due at the start; a minute boundary during the test adds one per definition
        assert len(page.items) in (40, 42)
        assert {o.state for o in page.items} == {OccurrenceState.PUBLISHED}
        lines = [json.loads(x) for x in journal.read_text().splitlines()]
        by_key: dict[str, set[str]] = {}
        for key, payload in lines:
            by_key.setdefault(key, set()).add(payload)
        assert len(by_key) == len(page.items)  # one key per occurrence, each delivered
        assert all(len(p) == 1 for p in by_key.values())
        conn = await asyncpg.connect(dsn)
        try:
            for _ in range(20):  # wait out the brief between-statement state
                idle = await conn.fetchval(
                    "SELECT count(*) FROM pg_stat_activity WHERE application_name = "
                    "'steeple-recurring' AND state LIKE 'idle in transaction%' "
                    "AND position($1 in query) > 0",
                    f'"{schema}"',
                )
                if idle == 0:
                    break
                await asyncio.sleep(0.05)
        finally:
            await conn.close()
        assert idle == 0
    finally:
        await store.close()


async def test_connection_limit_below_the_pool_is_typed_back_pressure(
    pg_schema: tuple[str, str], pg_name: Callable[[str], str]
) -> None:
    from steeple.core import RecurringStorageError
    from steeple.postgres import grant_runtime_role
    from steeple.testing import FakeClock

    dsn, schema = pg_schema
    clock = FakeClock(datetime(2031, 3, 4, 5, 6, 7, tzinfo=UTC))
    await (
        await PostgresRecurringStore.initialize(dsn, CONFIG, Keyring(KEY), clock, schema=schema)
    ).close()
    role = pg_name("steeple_lim")
    conn = await asyncpg.connect(dsn)
    await conn.execute(f'CREATE ROLE "{role}" LOGIN CONNECTION LIMIT 1')
    await grant_runtime_role(conn, role, schema)
    try:
        host = dsn.split("@", 1)[1]
        store = await PostgresRecurringStore.connect(
            f"postgresql://{role}@{host}", CONFIG, Keyring(KEY), clock, schema=schema
        )
        try:
            results = await asyncio.gather(
                *(store.schedules() for _ in range(8)), return_exceptions=True
            )
            errors = [r for r in results if isinstance(r, BaseException)]
            assert all(isinstance(e, RecurringStorageError) for e in errors), errors
            assert len(errors) < 8
            await store.schedules()  # still usable afterwards
        finally:
            await store.close()
    finally:
        await conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = $1", role
        )
        await conn.execute(f'DROP OWNED BY "{role}"; DROP ROLE "{role}"')
        await conn.close()
