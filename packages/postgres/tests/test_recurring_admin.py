"""steeple.postgres.recurring.admin: key usage, purge dry runs, the stored binding."""

from __future__ import annotations

import contextlib
from datetime import UTC, datetime, timedelta

import asyncpg
import pytest

from steeple.core import (
    MissedRunPolicy,
    RecurringConfig,
    RecurringConfigurationError,
    RecurringDefinition,
    RecurringStorageError,
    ScheduledMessage,
)
from steeple.core.errors import (
    AuthenticationFailedError,
    RecurringError,
    RelayBrokerError,
    UnknownKeyIdError,
)
from steeple.keyring import Keyring, StorageKey
from steeple.postgres import PostgresRecurringStore
from steeple.postgres.recurring import admin
from steeple.testing import FakeClock, MemoryBroker

pytestmark = pytest.mark.postgres

START = datetime(2031, 3, 4, 5, 6, 7, 123000, tzinfo=UTC)
OLD = StorageKey("old", b"\x01" * 32)
NEW = StorageKey("new", b"\x02" * 32)
CONFIG = RecurringConfig(
    "shop", 50, 5000, delivery_window=timedelta(hours=2), lease_duration=timedelta(seconds=90)
)


def _definition(name: str) -> RecurringDefinition:
    return RecurringDefinition(
        name,
        "*/10 * * * *",
        START - timedelta(hours=1),
        MissedRunPolicy.CATCH_UP,
        ScheduledMessage("t", "m", b"secret payload"),
    )


async def _seed(dsn: str, schema: str, clock: FakeClock) -> None:
    """Definitions and occurrences sealed under OLD, then more under NEW after rotation."""
    store = await PostgresRecurringStore.initialize(dsn, CONFIG, Keyring(OLD), clock, schema=schema)
    async with store:
        await store.create(_definition("a"))
        await store.tick(100)  # six occurrences under OLD
    rotated = Keyring(NEW, OLD)
    store = await PostgresRecurringStore.connect(dsn, CONFIG, rotated, clock, schema=schema)
    async with store:
        await store.create(_definition("b"))  # the binding is re-sealed under NEW too
        await store.tick(100)  # six more, under NEW


async def test_key_usage_counts_records_per_key_id(pg_schema: tuple[str, str]) -> None:
    dsn, schema = pg_schema
    await _seed(dsn, schema, FakeClock(START))
    conn = await asyncpg.connect(dsn)
    try:
        usage = await admin.sealed_key_usage(conn, schema=schema, namespace="shop")
        assert await admin.sealed_key_usage(conn, schema=schema, namespace="other") == {}
    finally:
        await conn.close()
    # OLD: definition a + its 6 occurrences; NEW: the binding, definition b + its 6.
    assert usage == {"new": 8, "old": 7}
    assert list(usage) == sorted(usage)


async def test_count_purgeable_matches_purge_terminal(pg_schema: tuple[str, str]) -> None:
    dsn, schema = pg_schema
    clock = FakeClock(START)
    store = await PostgresRecurringStore.initialize(dsn, CONFIG, Keyring(OLD), clock, schema=schema)
    broker = MemoryBroker()
    async with store:
        await store.create(_definition("a"))
        await store.tick(100)
        leases = await store.claim(100)
        broker.fail_next(1, permanent=True)
        for lease in leases:
            with contextlib.suppress(RelayBrokerError):  # one dead letter: terminal too
                await store.relay(lease, broker)
        clock.advance(timedelta(minutes=30))
        conn = await asyncpg.connect(dsn)
        try:
            counted = await admin.count_purgeable(
                conn, clock.now(), schema=schema, namespace="shop"
            )
            none_yet = await admin.count_purgeable(
                conn, START - timedelta(days=1), schema=schema, namespace="shop"
            )
            rows = await conn.fetchval(f'SELECT count(*) FROM "{schema}".recurring_occurrences')
        finally:
            await conn.close()
        assert (counted, none_yet, rows) == (6, 0, 6)  # counting removed nothing
        assert await store.purge_terminal(clock.now(), 100) == counted


async def test_namespace_binding_opens_to_the_initialized_configuration(
    pg_schema: tuple[str, str],
) -> None:
    dsn, schema = pg_schema
    await _seed(dsn, schema, FakeClock(START))
    conn = await asyncpg.connect(dsn)
    try:
        binding = await admin.namespace_binding(conn, schema=schema, namespace="shop")
        assert await admin.namespace_binding(conn, schema=schema, namespace="nope") is None
    finally:
        await conn.close()
    assert binding is not None
    assert binding.key_id == "new"
    assert "sealed" not in repr(binding)
    fields = Keyring(NEW, OLD).binding_fields(binding.sealed, namespace="shop")
    assert RecurringConfig.from_fingerprint(fields) == CONFIG
    with pytest.raises(UnknownKeyIdError):
        Keyring(OLD).binding_fields(binding.sealed, namespace="shop")
    with pytest.raises(AuthenticationFailedError):
        Keyring(StorageKey("new", b"\x03" * 32)).binding_fields(binding.sealed, namespace="shop")
    with pytest.raises(AuthenticationFailedError):
        Keyring(NEW).binding_fields(binding.sealed, namespace="other")


async def test_a_schema_without_a_store_and_hostile_names(pg_schema: tuple[str, str]) -> None:
    dsn, schema = pg_schema
    conn = await asyncpg.connect(dsn)
    try:
        for call in (
            admin.sealed_key_usage(conn, schema=schema, namespace="shop"),
            admin.namespace_binding(conn, schema=schema, namespace="shop"),
            admin.count_purgeable(conn, START, schema=schema, namespace="shop"),
        ):
            with pytest.raises(RecurringStorageError, match="holds no recurring store"):
                await call
        for bad_schema in ("", "a\x00b", "x" * 64, "a\udc80"):
            with pytest.raises(RecurringConfigurationError):
                await admin.sealed_key_usage(conn, schema=bad_schema, namespace="shop")
        for bad_namespace in ("", "Shop", "a\x00", "x" * 10_000, 5):
            with pytest.raises(RecurringConfigurationError):
                await admin.sealed_key_usage(
                    conn,
                    schema=schema,
                    namespace=bad_namespace,  # type: ignore[arg-type]
                )
        with pytest.raises(RecurringConfigurationError):
            await admin.count_purgeable(
                conn,
                datetime(2031, 1, 1),  # naive on purpose
                schema=schema,
                namespace="shop",
            )
    finally:
        await conn.close()
    assert issubclass(RecurringConfigurationError, RecurringError)
