"""The recurring store's statements need no type introspection on a fresh connection.

asyncpg introspects a parameter type it does not know built in (``bytea[]``,
``timestamptz[]``, ``integer[]``, ``bigint[]``, ``boolean[]``) on a connection's first use
of a statement: extra round trips, and a statement that times out closes its connection,
so a slow link stays slow. The statements send array parameters as ``text[]`` and cast
them in SQL. asyncpg's ``_introspect_types`` (its one path to the catalog for unknown
types) is wrapped to record every introspection, and the store's pool is expired before
each operation so that each runs on a fresh connection.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import asyncpg
import pytest

from steeple.core import (
    MissedRunPolicy,
    OccurrenceState,
    RecurringConfig,
    RecurringDefinition,
    RelayBrokerError,
    ScheduledMessage,
)
from steeple.keyring import Keyring, StorageKey
from steeple.postgres import PostgresRecurringStore
from steeple.postgres._arrays import text_array
from steeple.postgres._durability import quote_ident
from steeple.postgres.recurring._sql import Queries
from steeple.testing import FakeClock, MemoryBroker

pytestmark = pytest.mark.postgres

START = datetime(2031, 3, 4, 5, 6, 7, 123000, tzinfo=UTC)
KEY = StorageKey("k1", b"\x01" * 32)
CONFIG = RecurringConfig("introspection", max_definitions=10, max_occurrences=100)


@pytest.fixture
def introspected(monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """The type oids of every introspection any asyncpg connection runs from now on."""
    seen: list[list[int]] = []
    original = asyncpg.Connection._introspect_types  # type: ignore[attr-defined]

    async def recording(self: asyncpg.Connection, typeoids: Any, timeout: Any) -> Any:
        seen.append(list(typeoids))
        return await original(self, typeoids, timeout)

    monkeypatch.setattr(asyncpg.Connection, "_introspect_types", recording)
    return seen


def _old_style(statement: str) -> str:
    # The statement as it was, with typed array parameters: proves the counter counts.
    return statement.replace("::text[]::", "::")


async def test_every_operation_on_a_fresh_connection_needs_no_introspection(
    pg_schema: tuple[str, str], introspected: list[list[int]]
) -> None:
    dsn, schema = pg_schema
    clock = FakeClock(START)
    broker = MemoryBroker()
    store = await PostgresRecurringStore.initialize(dsn, CONFIG, Keyring(KEY), clock, schema=schema)
    found: dict[str, list[list[int]]] = {"initialize": list(introspected)}

    async def run(name: str, operation: Callable[[], Awaitable[Any]]) -> Any:
        await store._pool.expire_connections()  # the next acquire opens a new connection
        introspected.clear()
        result = await operation()
        found[name] = list(introspected)
        return result

    async with store:
        message = ScheduledMessage("reminders", "reminder.requested", b"hello")
        every_minute = RecurringDefinition(
            "minutely", "* * * * *", START - timedelta(minutes=5), MissedRunPolicy.CATCH_UP, message
        )
        await run("create", lambda: store.create(every_minute))
        ticked = await run("tick", lambda: store.tick(100))
        (lease,) = await run("claim", lambda: store.claim(1))
        await run("relay", lambda: store.relay(lease, broker))
        leases = await store.claim(2)
        outcomes = await run("relay_many", lambda: store.relay_many(leases, broker))
        broker.fail_next(permanent=True)
        (failed,) = await run("claim_and_relay", lambda: store.claim_and_relay(1, broker))
        revived = await run("retry_failed", lambda: store.retry_failed(failed.occurrence_id))
        clock.advance(timedelta(seconds=1))
        purged = await run("purge", lambda: store.purge_terminal(clock.now(), 100))
        cancelled = await run("cancel", lambda: store.cancel("minutely"))
    # Each operation did its work (so each statement really ran).
    assert ticked.materialized >= 4
    assert [o.error for o in outcomes] == [None, None]
    assert isinstance(failed.error, RelayBrokerError)
    assert revived.state is OccurrenceState.PENDING
    assert purged == 3
    assert cancelled.state == "cancelled"
    assert found == {name: [] for name in found}


async def test_typed_array_parameters_are_introspected_which_the_counter_sees(
    pg_schema: tuple[str, str], introspected: list[list[int]]
) -> None:
    dsn, schema = pg_schema
    store = await PostgresRecurringStore.initialize(
        dsn, CONFIG, Keyring(KEY), FakeClock(START), schema=schema
    )
    await store.close()
    q = Queries.for_schema(quote_ident(schema))
    conn = await asyncpg.connect(dsn)
    try:
        introspected.clear()
        # The new statement (nothing to update: no rows match): no introspection...
        await conn.execute(q.update_occurrences, CONFIG.namespace, *[text_array([])] * 11)
        assert introspected == []
        # ...the same statement with typed arrays: asyncpg asks the server about them.
        await conn.execute(_old_style(q.update_occurrences), CONFIG.namespace, *[[]] * 11)
    finally:
        await conn.close()
    assert introspected != []


ROUND_TRIPS: dict[str, list[Any]] = {
    "bytea": [b"", b"\x00\xff\\x'\"", bytes(range(256)), None],
    "timestamptz": [
        START,
        datetime(2031, 3, 4, 5, 6, 7, tzinfo=timezone(timedelta(hours=5, minutes=30))),
        datetime(2031, 3, 4, 5, 6, 7, 1, tzinfo=timezone(-timedelta(hours=11))),
        datetime.max.replace(tzinfo=UTC),
        datetime.min.replace(tzinfo=UTC),
        datetime(1, 1, 2, tzinfo=UTC),
        None,
    ],
    "integer": [0, -(2**31), 2**31 - 1, None],
    "bigint": [0, -(2**63), 2**63 - 1, None],
    "boolean": [True, False, None],
}


@pytest.mark.parametrize("sql_type", sorted(ROUND_TRIPS))
async def test_text_arrays_read_back_as_the_typed_arrays_did(
    pg_schema: tuple[str, str], sql_type: str
) -> None:
    dsn, _schema = pg_schema
    values = ROUND_TRIPS[sql_type]
    conn = await asyncpg.connect(dsn)
    try:
        # A DateStyle and bytea_output other than the defaults change neither.
        await conn.execute("SET datestyle = 'SQL, DMY'; SET bytea_output = 'escape'")
        typed = await conn.fetchval(f"SELECT $1::{sql_type}[]", values)
        as_text = await conn.fetchval(f"SELECT $1::text[]::{sql_type}[]", text_array(values))
    finally:
        await conn.close()
    assert as_text == typed
    if sql_type != "timestamptz":  # asyncpg reads the infinities back as naive datetimes
        assert typed == values
