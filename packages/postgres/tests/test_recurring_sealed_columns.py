"""What the PostgreSQL store keeps in plaintext, and the schema-version 1 -> 2 migration.

Seed 000: "the topic, message type, headers and payload are sealed; only the name,
calendar, policy, states, times, attempt counts and key ids are plaintext." A search of
every column of every table of the store's schema (raw text, hex and base64) finds none of
them, after every kind of operation and after migrating a version-1 schema (which kept
the topic and message type in plaintext columns: the same search finds them there first).
Records sealed under a key the keyring lacks fail with an error that is both a
RecurringError and a KeyringError, naming the key id.
"""

from __future__ import annotations

import base64
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta

import asyncpg
import pytest

from steeple.core import (
    MissedRunPolicy,
    OccurrenceState,
    RecurringConfig,
    RecurringDefinition,
    RecurringError,
    RecurringSchemaVersionError,
    RecurringStorageError,
    ScheduledMessage,
)
from steeple.core.errors import KeyringError, RelayBrokerError, UnknownKeyIdError
from steeple.keyring import Keyring, StorageKey
from steeple.postgres import PostgresRecurringStore
from steeple.postgres.recurring import SCHEMA_VERSION, TABLES
from steeple.testing import FakeClock, MemoryBroker

pytestmark = pytest.mark.postgres

START = datetime(2031, 3, 4, 5, 6, 7, 250000, tzinfo=UTC)
K1 = StorageKey("k1", b"\x0d" * 32)
K2 = StorageKey("k2", b"\x0e" * 32)
CONFIG = RecurringConfig("sealed", 10, 1000)
TOPIC = "billing.invoices.topic-8c1f3e"
MESSAGE_TYPE = "invoice.requested.type-5d2a9b"
HEADER = "header-value-77aa10"
PAYLOAD = b"payload-4e4e0c: customer 1234"
SECRETS: dict[str, str | bytes] = {
    "topic": TOPIC,
    "message type": MESSAGE_TYPE,
    "header": HEADER,
    "payload": PAYLOAD,
}


def definition(name: str, minutes_back: int, cron: str = "* * * * *") -> RecurringDefinition:
    return RecurringDefinition(
        name,
        cron,
        START - timedelta(minutes=minutes_back),
        MissedRunPolicy.CATCH_UP,
        ScheduledMessage(TOPIC, MESSAGE_TYPE, PAYLOAD, {"x-tenant": HEADER}),
    )


def forms(secret: str | bytes) -> list[str]:
    """The secret as stored text might show it: raw, hex (bytea's text form), base64."""
    raw = secret.encode() if isinstance(secret, str) else secret
    shown = [raw.hex(), base64.b64encode(raw).decode()]
    if isinstance(secret, str):
        shown.append(secret)
    return shown


async def found_in_columns(dsn: str, schema: str) -> list[tuple[str, str, str]]:
    """Every (table, column, secret) where a column's text holds a form of a secret."""
    conn = await asyncpg.connect(dsn)
    try:
        columns = await conn.fetch(
            "SELECT table_name, column_name FROM information_schema.columns"
            " WHERE table_schema = $1 ORDER BY table_name, ordinal_position",
            schema,
        )
        assert {c["table_name"] for c in columns} == set(TABLES)
        hits = []
        for c in columns:
            table, column = c["table_name"], c["column_name"]
            values = await conn.fetch(f'SELECT "{column}"::text AS v FROM "{schema}"."{table}"')
            text = "\n".join(v["v"] for v in values if v["v"] is not None)
            for what, secret in SECRETS.items():
                if any(form.lower() in text.lower() for form in forms(secret)):
                    hits.append((table, column, what))
        return hits
    finally:
        await conn.close()


async def exercise(store: PostgresRecurringStore, clock: FakeClock) -> None:
    """Every kind of row: pending, published, dead (content kept), cancelled."""
    await store.create(definition("published", 2))
    await store.create(definition("dead", 1, "6 5 4 3 *"))
    await store.create(definition("cancelled", 1))
    await store.tick(100)
    broker = MemoryBroker()
    names = {o.occurrence_id: o.definition_name for o in (await store.occurrences()).items}
    for lease in await store.claim(100):
        name = names[lease.occurrence_id]
        if name == "dead":
            broker.fail_next(permanent=True)
            with pytest.raises(RelayBrokerError):
                await store.relay(lease, broker)
        elif name == "published":
            await store.relay(lease, broker)
    await store.cancel("cancelled")
    await store.create(definition("pending", 1))
    await store.tick(100)
    states = {o.state for o in (await store.occurrences()).items}
    assert {OccurrenceState.PUBLISHED, OccurrenceState.DEAD, OccurrenceState.CANCELLED} <= states
    assert OccurrenceState.PENDING in states


async def test_no_column_of_any_table_holds_topic_type_headers_or_payload(
    pg_schema: tuple[str, str],
) -> None:
    dsn, schema = pg_schema
    clock = FakeClock(START)
    async with await PostgresRecurringStore.initialize(
        dsn, CONFIG, Keyring(K1), clock, schema=schema
    ) as store:
        await exercise(store, clock)
        assert await found_in_columns(dsn, schema) == []
        # ...while the metadata still shows them, opened from the sealed definitions
        info = {s.name: s for s in (await store.schedules()).items}
        assert (info["pending"].topic, info["pending"].message_type) == (TOPIC, MESSAGE_TYPE)
        assert info["cancelled"].topic == TOPIC


async def downgrade_to_version_1(dsn: str, schema: str) -> None:
    """Turn a fresh store's schema into the version-1 layout, as v1 wrote it."""
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(
            f'ALTER TABLE "{schema}".recurring_definitions'
            " ADD COLUMN topic text, ADD COLUMN message_type text"
        )
        await conn.execute(
            f'UPDATE "{schema}".recurring_definitions SET topic = $1, message_type = $2',
            TOPIC,
            MESSAGE_TYPE,
        )
        await conn.execute(
            f'ALTER TABLE "{schema}".recurring_definitions'
            " ALTER COLUMN topic SET NOT NULL, ALTER COLUMN message_type SET NOT NULL"
        )
        await conn.execute(
            f'UPDATE "{schema}".recurring_schema_version SET version = 1'
            " WHERE component = 'recurring'"
        )
    finally:
        await conn.close()


async def test_a_version_1_schema_is_refused_by_connect_and_migrated_by_initialize(
    pg_schema: tuple[str, str],
) -> None:
    dsn, schema = pg_schema
    clock = FakeClock(START)
    async with await PostgresRecurringStore.initialize(
        dsn, CONFIG, Keyring(K1), clock, schema=schema
    ) as store:
        await exercise(store, clock)
    await downgrade_to_version_1(dsn, schema)
    # the search finds what version 1 kept in plaintext (it can fail)
    hits = await found_in_columns(dsn, schema)
    assert ("recurring_definitions", "topic", "topic") in hits
    assert ("recurring_definitions", "message_type", "message type") in hits

    with pytest.raises(RecurringSchemaVersionError, match="run initialize") as refused:
        await PostgresRecurringStore.connect(dsn, CONFIG, Keyring(K1), clock, schema=schema)
    assert isinstance(refused.value, RecurringStorageError)
    assert (refused.value.found, refused.value.expected) == (1, SCHEMA_VERSION)

    async with await PostgresRecurringStore.initialize(
        dsn, CONFIG, Keyring(K1), clock, schema=schema
    ) as migrated:
        assert await found_in_columns(dsn, schema) == []
        # the data is intact and the store works on
        info = {s.name: s for s in (await migrated.schedules()).items}
        assert set(info) == {"published", "dead", "cancelled", "pending"}
        assert info["published"].topic == TOPIC
        assert info["cancelled"].state == "cancelled"
        [lease] = await migrated.claim(10)
        broker = MemoryBroker()
        await migrated.relay(lease, broker)
        [(message, _)] = broker.published
        assert (message.topic, message.message_type, message.payload) == (
            TOPIC,
            MESSAGE_TYPE,
            PAYLOAD,
        )
    conn = await asyncpg.connect(dsn)
    try:
        version = await conn.fetchval(
            f'SELECT version FROM "{schema}".recurring_schema_version'
            " WHERE component = 'recurring'"
        )
    finally:
        await conn.close()
    assert version == SCHEMA_VERSION == 2
    # a second initialize is a no-op; connect works
    await (
        await PostgresRecurringStore.initialize(dsn, CONFIG, Keyring(K1), clock, schema=schema)
    ).close()
    await (
        await PostgresRecurringStore.connect(dsn, CONFIG, Keyring(K1), clock, schema=schema)
    ).close()


async def test_records_sealed_under_a_missing_key_fail_typed_naming_the_key(
    pg_schema: tuple[str, str],
) -> None:
    dsn, schema = pg_schema
    clock = FakeClock(START)
    async with await PostgresRecurringStore.initialize(
        dsn, CONFIG, Keyring(K1), clock, schema=schema
    ) as first:
        await first.create(definition("old", 2))
        await first.tick(1)
        [lease] = await first.claim(1)
    # rotate: k2 becomes primary (the binding is re-sealed), then k1 is dropped
    async with await PostgresRecurringStore.connect(
        dsn, CONFIG, Keyring(K2, K1), clock, schema=schema
    ) as rotated:
        await rotated.schedules()
    async with await PostgresRecurringStore.connect(
        dsn, CONFIG, Keyring(K2), clock, schema=schema
    ) as store:
        calls: dict[str, Callable[[], Awaitable[object]]] = {
            "create": lambda: store.create(definition("old", 2)),
            "schedules": lambda: store.schedules(),
            "cancel": lambda: store.cancel("old"),
            "tick": lambda: store.tick(10),
            "relay": lambda: store.relay(lease, MemoryBroker()),
        }
        for what, call in calls.items():
            with pytest.raises(UnknownKeyIdError) as info:
                await call()
            assert isinstance(info.value, RecurringError), what
            assert isinstance(info.value, KeyringError), what
            assert "'k1'" in str(info.value), what
        states = {o.occurrence_id: o.state for o in (await store.occurrences()).items}
        assert states[lease.occurrence_id] is OccurrenceState.DEAD  # unopenable: dead letter
