"""Deployment of the recurring store: initialize/connect, durability, TLS, roles, grants."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest

from steeple.core import (
    RecurringConfig,
    RecurringConfigurationError,
    RecurringNotFoundError,
    RecurringStorageError,
)
from steeple.keyring import Keyring, StorageKey
from steeple.postgres import PostgresRecurringStore, grant_runtime_role
from steeple.postgres._durability import DurabilityProblem, check_transport
from steeple.testing import FakeClock

pytestmark = pytest.mark.postgres

START = datetime(2031, 3, 4, 5, 6, 7, tzinfo=UTC)
KEYRING = Keyring(StorageKey("k1", b"\x02" * 32))
CONFIG = RecurringConfig("tenant-a", 10, 100)


def with_user(dsn: str, user: str) -> str:
    parts = urlsplit(dsn)
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{user}@{host}"))


def with_query(dsn: str, query: str) -> str:
    parts = urlsplit(dsn)
    joined = f"{parts.query}&{query}" if parts.query else query
    return urlunsplit(parts._replace(query=joined))


async def sql(dsn: str, statement: str) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(statement)
    finally:
        await conn.close()


@pytest.fixture
async def deployed(pg_schema: tuple[str, str]) -> tuple[str, str]:
    dsn, schema = pg_schema
    store = await PostgresRecurringStore.initialize(
        dsn, CONFIG, KEYRING, FakeClock(START), schema=schema
    )
    await store.close()
    return dsn, schema


@pytest.fixture
async def runtime_role(
    deployed: tuple[str, str], pg_name: Callable[[str], str]
) -> AsyncIterator[str]:
    """A login role with exactly the shipped grants."""
    dsn, schema = deployed
    role = pg_name("steeple_rt")
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(f'CREATE ROLE "{role}" LOGIN')
        await grant_runtime_role(conn, role, schema)
    finally:
        await conn.close()
    try:
        yield role
    finally:
        conn = await asyncpg.connect(dsn)
        try:
            # end any session still open as the role, then drop it
            await conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = $1", role
            )
            await conn.execute(f'DROP OWNED BY "{role}"; DROP ROLE "{role}"')
        finally:
            await conn.close()


async def test_concurrent_initializers_converge(pg_schema: tuple[str, str]) -> None:
    dsn, schema = pg_schema
    await sql(dsn, f'DROP SCHEMA "{schema}"')  # initialize creates the schema itself
    stores = await asyncio.gather(
        *(
            PostgresRecurringStore.initialize(dsn, CONFIG, KEYRING, FakeClock(START), schema=schema)
            for _ in range(20)
        )
    )
    try:
        conn = await asyncpg.connect(dsn)
        try:
            count = await conn.fetchval(f'SELECT count(*) FROM "{schema}".recurring_namespaces')
            versions = await conn.fetchval(
                f'SELECT count(*) FROM "{schema}".recurring_schema_version'
            )
        finally:
            await conn.close()
        assert count == 1
        assert versions == 1
        # every store works on the one namespace
        await stores[0].create(_definition("one"))
        assert [s.name for s in (await stores[19].schedules()).items] == ["one"]
    finally:
        await asyncio.gather(*(s.close() for s in stores))


_INIT_SCRIPT = """
import asyncio, sys
from datetime import UTC, datetime
from steeple.core import RecurringConfig
from steeple.keyring import Keyring, StorageKey
from steeple.postgres import PostgresRecurringStore
from steeple.testing import FakeClock

async def main(dsn, schema):
    store = await PostgresRecurringStore.initialize(
        dsn, RecurringConfig("tenant-a", 10, 100), Keyring(StorageKey("k1", b"\\x02" * 32)),
        FakeClock(datetime(2031, 3, 4, 5, 6, 7, tzinfo=UTC)), schema=schema)
    await store.close()
    print("initialized")

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


async def test_initializers_in_separate_processes_converge(pg_schema: tuple[str, str]) -> None:
    dsn, schema = pg_schema
    await sql(dsn, f'DROP SCHEMA "{schema}"')
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            _INIT_SCRIPT,
            dsn,
            schema,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        for _ in range(3)
    ]
    outputs = await asyncio.gather(*(p.communicate() for p in procs))
    for proc, (out, err) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, err.decode()
        assert out.strip() == b"initialized"
    conn = await asyncpg.connect(dsn)
    try:
        assert await conn.fetchval(f'SELECT count(*) FROM "{schema}".recurring_namespaces') == 1
    finally:
        await conn.close()


def _definition(name: str):  # type: ignore[no-untyped-def]
    from steeple.core import MissedRunPolicy, RecurringDefinition, ScheduledMessage

    return RecurringDefinition(
        name, "0 9 * * *", START, MissedRunPolicy.CATCH_UP, ScheduledMessage("t", "m", b"p")
    )


async def test_reinitialize_with_other_config_or_keyring_fails(
    deployed: tuple[str, str],
) -> None:
    dsn, schema = deployed
    clock = FakeClock(START)
    same = await PostgresRecurringStore.initialize(dsn, CONFIG, KEYRING, clock, schema=schema)
    await same.close()
    other = RecurringConfig("tenant-a", 11, 100)
    with pytest.raises(RecurringConfigurationError):
        await PostgresRecurringStore.initialize(dsn, other, KEYRING, clock, schema=schema)
    with pytest.raises(RecurringConfigurationError):
        await PostgresRecurringStore.connect(dsn, other, KEYRING, clock, schema=schema)
    wrong_keys = Keyring(StorageKey("k1", b"\x03" * 32))
    with pytest.raises(RecurringConfigurationError):
        await PostgresRecurringStore.connect(dsn, CONFIG, wrong_keys, clock, schema=schema)


async def test_connect_never_creates(pg_schema: tuple[str, str]) -> None:
    dsn, schema = pg_schema
    clock = FakeClock(START)
    with pytest.raises(RecurringStorageError, match="initialize"):
        await PostgresRecurringStore.connect(dsn, CONFIG, KEYRING, clock, schema=schema)
    conn = await asyncpg.connect(dsn)
    try:
        tables = await conn.fetchval("SELECT count(*) FROM pg_tables WHERE schemaname = $1", schema)
    finally:
        await conn.close()
    assert tables == 0
    store = await PostgresRecurringStore.initialize(dsn, CONFIG, KEYRING, clock, schema=schema)
    await store.close()
    with pytest.raises(RecurringNotFoundError):
        await PostgresRecurringStore.connect(
            dsn, RecurringConfig("tenant-b", 10, 100), KEYRING, clock, schema=schema
        )


async def test_schema_version_mismatch_refused(deployed: tuple[str, str]) -> None:
    dsn, schema = deployed
    await sql(dsn, f'UPDATE "{schema}".recurring_schema_version SET version = 99')
    with pytest.raises(RecurringStorageError, match="version 99"):
        await PostgresRecurringStore.connect(dsn, CONFIG, KEYRING, FakeClock(START), schema=schema)


async def test_unlogged_table_refused(deployed: tuple[str, str]) -> None:
    dsn, schema = deployed
    await sql(dsn, f'ALTER TABLE "{schema}".recurring_occurrences SET UNLOGGED')
    with pytest.raises(RecurringStorageError, match="unlogged"):
        await PostgresRecurringStore.connect(dsn, CONFIG, KEYRING, FakeClock(START), schema=schema)
    await sql(dsn, f'ALTER TABLE "{schema}".recurring_occurrences SET LOGGED')
    store = await PostgresRecurringStore.connect(
        dsn, CONFIG, KEYRING, FakeClock(START), schema=schema
    )
    await store.close()


async def test_read_only_session_refused(deployed: tuple[str, str]) -> None:
    # synchronous_commit at every level and scope: test_durability_real.py
    dsn, schema = deployed
    with pytest.raises(RecurringStorageError, match="read-only"):
        await PostgresRecurringStore.connect(
            with_query(dsn, "default_transaction_read_only=on"),
            CONFIG,
            KEYRING,
            FakeClock(START),
            schema=schema,
        )


async def test_role_synchronous_commit_off_refused(
    deployed: tuple[str, str], runtime_role: str
) -> None:
    dsn, schema = deployed
    role_dsn = with_user(dsn, runtime_role)
    clock = FakeClock(START)
    store = await PostgresRecurringStore.connect(role_dsn, CONFIG, KEYRING, clock, schema=schema)
    await sql(dsn, f'ALTER ROLE "{runtime_role}" SET synchronous_commit = off')
    try:
        with pytest.raises(RecurringStorageError, match="synchronous_commit"):
            await PostgresRecurringStore.connect(role_dsn, CONFIG, KEYRING, clock, schema=schema)
        # A store already connected checks every new pooled connection too.
        await sql(
            dsn,
            f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            f"WHERE usename = '{runtime_role}'",
        )
        await asyncio.sleep(0.2)
        with pytest.raises(RecurringStorageError):
            await store.schedules()
    finally:
        await store.close()
        await sql(dsn, f'ALTER ROLE "{runtime_role}" RESET synchronous_commit')


async def test_restricted_runtime_role_works(deployed: tuple[str, str], runtime_role: str) -> None:
    from steeple.testing import MemoryBroker

    dsn, schema = deployed
    clock = FakeClock(START)
    async with await PostgresRecurringStore.connect(
        with_user(dsn, runtime_role), CONFIG, KEYRING, clock, schema=schema
    ) as store:
        assert store.warnings == []
        await store.create(_definition("daily"))
        from datetime import timedelta

        clock.advance(timedelta(days=2))
        assert (await store.tick(10)).materialized == 2
        broker = MemoryBroker()
        for lease in await store.claim(10):
            await store.relay(lease, broker)
        clock.advance(timedelta(seconds=1))
        assert await store.purge_terminal(clock.now()) == 2
        # and it cannot change the tables (no DDL)
    conn = await asyncpg.connect(with_user(dsn, runtime_role))
    try:
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await conn.execute(f'ALTER TABLE "{schema}".recurring_occurrences SET UNLOGGED')
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await conn.execute(f'CREATE TABLE "{schema}".intruder (x int)')
    finally:
        await conn.close()


@pytest.mark.parametrize(
    ("table", "privilege"),
    [
        ("recurring_occurrences", "DELETE"),
        ("recurring_namespaces", "UPDATE"),
        ("recurring_definitions", "INSERT"),
        ("recurring_schema_version", "SELECT"),
    ],
)
async def test_missing_grant_named(
    deployed: tuple[str, str], runtime_role: str, table: str, privilege: str
) -> None:
    dsn, schema = deployed
    await sql(dsn, f'REVOKE {privilege} ON "{schema}".{table} FROM "{runtime_role}"')
    with pytest.raises(RecurringStorageError) as info:
        await PostgresRecurringStore.connect(
            with_user(dsn, runtime_role), CONFIG, KEYRING, FakeClock(START), schema=schema
        )
    assert privilege in str(info.value)
    assert table in str(info.value)


async def test_missing_schema_usage_named(deployed: tuple[str, str], runtime_role: str) -> None:
    dsn, schema = deployed
    await sql(dsn, f'REVOKE USAGE ON SCHEMA "{schema}" FROM "{runtime_role}"')
    with pytest.raises(RecurringStorageError, match="USAGE"):
        await PostgresRecurringStore.connect(
            with_user(dsn, runtime_role), CONFIG, KEYRING, FakeClock(START), schema=schema
        )


async def test_excess_power_reported(
    deployed: tuple[str, str], runtime_role: str, caplog: pytest.LogCaptureFixture
) -> None:
    dsn, schema = deployed
    clock = FakeClock(START)
    with caplog.at_level(logging.WARNING, logger="steeple.postgres.recurring"):
        store = await PostgresRecurringStore.connect(dsn, CONFIG, KEYRING, clock, schema=schema)
    await store.close()
    assert any("superuser" in w for w in store.warnings)
    assert any("superuser" in r.getMessage() for r in caplog.records)

    await sql(dsn, f'GRANT CREATE ON SCHEMA "{schema}" TO "{runtime_role}"')
    await sql(dsn, f'ALTER TABLE "{schema}".recurring_schema_version OWNER TO "{runtime_role}"')
    store = await PostgresRecurringStore.connect(
        with_user(dsn, runtime_role), CONFIG, KEYRING, clock, schema=schema
    )
    await store.close()
    joined = " ".join(store.warnings)
    assert "CREATE" in joined
    assert "owns" in joined
    assert "recurring_schema_version" in joined
    await sql(dsn, f'ALTER TABLE "{schema}".recurring_schema_version OWNER TO CURRENT_USER')


@pytest.mark.parametrize(
    "dsn",
    [
        "postgresql://app@db.example.com/prod",
        "postgresql://app@db.example.com/prod?sslmode=require",
        "postgresql://app@10.1.2.3:5432/prod?sslmode=prefer",
        "postgresql://app@localhost,db.example.com/prod",
        "postgresql:///prod?host=127.0.0.1,db.example.com&port=5432,5433",
        "host=127.0.0.1,db.example.com port=5432,5433 dbname=prod sslmode=require",
    ],
)
async def test_remote_without_verified_tls_refused(dsn: str) -> None:
    with pytest.raises(RecurringConfigurationError, match="verify-full"):
        await PostgresRecurringStore.connect(dsn, CONFIG, KEYRING, FakeClock(START))
    with pytest.raises(RecurringConfigurationError, match="verify-full"):
        await PostgresRecurringStore.initialize(dsn, CONFIG, KEYRING, FakeClock(START))


@pytest.mark.parametrize(
    "dsn",
    [
        "postgresql://app@127.0.0.1/db",
        "postgresql://app@localhost:5433/db",
        "postgresql://app@[::1]/db",
        "postgresql:///db?host=/var/run/postgresql",
        "postgresql:///db?host=127.0.0.1,localhost&port=5432,5433",
        "postgresql://?host=127.0.0.1,127.0.0.1&port=5432,5433&target_session_attrs=read-write",
        "postgresql://app@db.example.com/prod?sslmode=verify-full",
        "postgresql://app@db.example.com/prod?sslmode=verify-ca",
    ],
)
def test_loopback_socket_or_verified_tls_accepted(dsn: str) -> None:
    check_transport(dsn)


def test_non_uri_dsn_refused() -> None:
    with pytest.raises(DurabilityProblem):
        check_transport("host=db.example.com dbname=x")


async def test_every_transaction_commits_synchronously(deployed: tuple[str, str]) -> None:
    """The control-row lock that opens every transaction also sets synchronous_commit on
    locally, whatever the session says."""
    from steeple.postgres._durability import quote_ident
    from steeple.postgres.recurring._sql import Queries

    dsn, schema = deployed
    q = Queries.for_schema(quote_ident(schema))
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute("SET synchronous_commit = off")
        async with conn.transaction():
            row = await conn.fetchrow(q.lock_namespace, CONFIG.namespace)
            assert row is not None
            assert await conn.fetchval("SHOW synchronous_commit") == "on"
        assert await conn.fetchval("SHOW synchronous_commit") == "off"  # local only
    finally:
        await conn.close()


class _NaiveClock:
    """A clock that forgets its time zone (a common mistake: ``datetime.now()``)."""

    simulated = True

    def __init__(self, aware: bool = False) -> None:
        self.aware = aware

    def now(self) -> datetime:
        reading = datetime(2031, 3, 4, 5, 6, 7)
        return reading.replace(tzinfo=UTC) if self.aware else reading


async def test_initialize_with_an_exhausted_seal_budget_raises_a_recurring_error(
    pg_schema: tuple[str, str],
) -> None:
    from steeple.core import RecurringError, SealBudgetExhaustedError

    dsn, schema = pg_schema
    spent = Keyring(StorageKey("k1", b"\x02" * 32), seal_budget=1, seal_counts={"k1": 1})
    with pytest.raises(RecurringError) as caught:
        await PostgresRecurringStore.initialize(dsn, CONFIG, spent, FakeClock(START), schema=schema)
    # Still the keyring's own class, as create's refusal is, and it says what to do.
    assert isinstance(caught.value, SealBudgetExhaustedError)
    assert "rotate" in str(caught.value)


async def test_initialize_connect_and_operations_with_a_naive_clock_raise_recurring_errors(
    pg_schema: tuple[str, str],
) -> None:
    dsn, schema = pg_schema
    with pytest.raises(RecurringConfigurationError, match="timezone-aware"):
        await PostgresRecurringStore.initialize(dsn, CONFIG, KEYRING, _NaiveClock(), schema=schema)
    clock = _NaiveClock(aware=True)
    store = await PostgresRecurringStore.initialize(dsn, CONFIG, KEYRING, clock, schema=schema)
    try:
        clock.aware = False
        with pytest.raises(RecurringConfigurationError, match="timezone-aware"):
            await store.tick(10)
        with pytest.raises(RecurringConfigurationError, match="timezone-aware"):
            await store.schedules()
    finally:
        await store.close()
    with pytest.raises(RecurringConfigurationError, match="timezone-aware"):
        await PostgresRecurringStore.connect(dsn, CONFIG, KEYRING, _NaiveClock(), schema=schema)
