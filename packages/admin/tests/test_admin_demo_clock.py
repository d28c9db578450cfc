"""The demo's accelerated clock against a real store: it starts in the past, resumes at the
time its namespace recorded, and never runs past real time (issue 10 item 8)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from steeple.admin._backend import Target
from steeple.admin.demo import DEMO_BACKDATE, _open_on_demo_time
from steeple.admin.settings import CliError, NamespaceSettings
from steeple.core import SystemClock
from steeple.keyring import Keyring, StorageKey
from steeple.postgres import PostgresRecurringStore
from steeple.testing import FakeClock

pytestmark = pytest.mark.postgres

SETTINGS = NamespaceSettings("demo", max_definitions=100, lease_duration=timedelta(seconds=300))


async def record_time_at(target: Target, keyring: Keyring, instant: datetime) -> None:
    """What any other command does: open the namespace with its clock and record its time."""
    store = await PostgresRecurringStore.connect(
        target.dsn, SETTINGS.config(), keyring, FakeClock(instant), schema=target.schema
    )
    async with store:
        await store.schedules(limit=1)


async def test_new_namespace_starts_in_the_past_then_resumes_where_it_was_left(
    pg_schema: tuple[str, str],
) -> None:
    dsn, schema = pg_schema
    target = Target(dsn, schema, SETTINGS)
    keyring = Keyring(StorageKey.generate("demo-key"))
    real = datetime.now(UTC).replace(microsecond=0)

    store, clock = await _open_on_demo_time(target, keyring, 60, FakeClock(real))
    async with store:
        first = clock.now()
        # a new namespace: six hours before real time (plus what the opening took at 60x)
        assert real - DEMO_BACKDATE <= first <= real - DEMO_BACKDATE + timedelta(minutes=5)
        await store.schedules(limit=1)

    # another command records real time in the namespace (as `steeple schedules` does)
    await record_time_at(target, keyring, real)
    later = real + timedelta(seconds=30)
    store, clock = await _open_on_demo_time(target, keyring, 60, FakeClock(later))
    async with store:
        resumed = clock.now()
        assert real <= resumed <= later  # at the recorded time, capped by real time
        await store.schedules(limit=1)


async def test_a_namespace_ahead_of_real_time_is_reported_not_run(
    pg_schema: tuple[str, str],
) -> None:
    dsn, schema = pg_schema
    target = Target(dsn, schema, SETTINGS)
    keyring = Keyring(StorageKey.generate("demo-key"))
    real = datetime.now(UTC)
    store, _ = await _open_on_demo_time(target, keyring, 60, SystemClock())
    await store.close()
    # what an earlier demo version left behind: a recorded time two hours ahead
    await record_time_at(target, keyring, real + timedelta(hours=2))
    with pytest.raises(CliError, match="ahead of this machine's clock") as info:
        await _open_on_demo_time(target, keyring, 60, FakeClock(real))
    assert "--fresh" in (info.value.hint or "")
    # within the store's 5 s tolerance it is adopted, never refused
    await record_time_at(target, keyring, real + timedelta(hours=2, seconds=3))
    store, clock = await _open_on_demo_time(
        target, keyring, 60, FakeClock(real + timedelta(hours=2))
    )
    async with store:
        await store.schedules(limit=1)
        assert clock.now() <= real + timedelta(hours=2)
