"""PostgresRecurringStore against a real PostgreSQL: what is particular to this store."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import pytest

from steeple.core import (
    MissedRunPolicy,
    OccurrenceState,
    RecurringConfig,
    RecurringDefinition,
    RecurringStorageError,
    ScheduledMessage,
)
from steeple.keyring import Keyring, StorageKey
from steeple.postgres import PostgresRecurringStore
from steeple.testing import FakeClock

pytestmark = pytest.mark.postgres

START = datetime(2031, 3, 4, 5, 6, 7, 123000, tzinfo=UTC)
KEY = StorageKey("k1", b"\x01" * 32)


def config(ns: str = "school-events", **kw: object) -> RecurringConfig:
    args: dict[str, object] = {"max_definitions": 100, "max_occurrences": 10_000}
    args.update(kw)
    return RecurringConfig(ns, **args)  # type: ignore[arg-type]


def definition(
    name: str = "daily",
    cron: str = "0 9 * * *",
    *,
    first_after: datetime = START - timedelta(days=2),
    policy: MissedRunPolicy = MissedRunPolicy.CATCH_UP,
    payload: bytes = b"hello",
) -> RecurringDefinition:
    return RecurringDefinition(
        name,
        cron,
        first_after,
        policy,
        ScheduledMessage("reminders", "reminder.requested", payload),
    )


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(START)


@pytest.fixture
async def store(
    pg_schema: tuple[str, str], clock: FakeClock
) -> AsyncIterator[PostgresRecurringStore]:
    dsn, schema = pg_schema
    s = await PostgresRecurringStore.initialize(dsn, config(), Keyring(KEY), clock, schema=schema)
    async with s:
        yield s


async def states(store: PostgresRecurringStore) -> dict[str, OccurrenceState]:
    page = await store.occurrences(limit=100)
    return {o.occurrence_id: o.state for o in page.items}


# The operations themselves run on every store (this one included) in
# tests/test_recurring_store_operations.py; what is particular to PostgreSQL stays here.


async def test_close_closes_only_this_store_and_reprs_hide_secrets(
    store: PostgresRecurringStore, pg_schema: tuple[str, str], clock: FakeClock
) -> None:
    dsn, schema = pg_schema
    other = await PostgresRecurringStore.connect(dsn, config(), Keyring(KEY), clock, schema=schema)
    await other.create(definition(payload=b"top secret payload"))
    await other.close()
    await other.close()  # idempotent
    with pytest.raises(RecurringStorageError):
        await other.schedules()
    assert [s.name for s in (await store.schedules()).items] == ["daily"]
    await store.tick(10)
    [lease, *_] = await store.claim(10)
    for text in (
        repr(store),
        repr(lease),
        repr(await store.occurrences()),
        repr(await store.schedules()),
    ):
        assert "top secret" not in text
        assert lease.capability.hex() not in text
        assert repr(lease.capability) not in text
        assert "k1" not in text or text is repr(store)
