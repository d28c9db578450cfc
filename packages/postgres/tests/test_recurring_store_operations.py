"""PostgresRecurringStore against a real PostgreSQL: the operations of seed 000."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import asyncpg
import pytest

from steeple.core import (
    MissedRunPolicy,
    OccurrenceState,
    RecurringCapacityError,
    RecurringConfig,
    RecurringConfigurationError,
    RecurringConflictError,
    RecurringDefinition,
    RecurringInvalidStateError,
    RecurringNotFoundError,
    RecurringStorageError,
    ScheduledMessage,
)
from steeple.core.errors import (
    RelayAcknowledgementError,
    RelayBrokerError,
    RelayBrokerTimeoutError,
    RelayLeaseLostError,
)
from steeple.core.records import Lease
from steeple.keyring import Keyring, StorageKey
from steeple.postgres import PostgresRecurringStore
from steeple.testing import FakeClock, MemoryBroker

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


async def test_create_replay_and_conflict(store: PostgresRecurringStore, clock: FakeClock) -> None:
    first = await store.create(definition())
    assert first.name == "daily"
    assert first.state == "active"
    assert first.next_due_at == datetime(2031, 3, 2, 9, 0, tzinfo=UTC)
    clock.advance(timedelta(minutes=1))
    again = await store.create(definition())
    assert again == first  # original metadata, including created_at
    with pytest.raises(RecurringConflictError):
        await store.create(definition(payload=b"other"))
    with pytest.raises(RecurringConflictError):
        await store.create(definition(cron="0 10 * * *"))
    page = await store.schedules()
    assert [s.name for s in page.items] == ["daily"]
    assert page.next_cursor is None


async def test_catch_up_oldest_first_and_budget(store: PostgresRecurringStore) -> None:
    await store.create(definition())  # due 2031-03-02, 03-03, 03-04 09:00 -> 2 are past
    await store.create(definition("hourly", "0 * * * *", first_after=START - timedelta(hours=3)))
    result = await store.tick(3)
    assert result.materialized == 3
    page = await store.occurrences()
    dues = sorted((o.due_at, o.definition_name) for o in page.items)
    assert dues == [  # the three oldest across both definitions
        (datetime(2031, 3, 2, 9, tzinfo=UTC), "daily"),
        (datetime(2031, 3, 3, 9, tzinfo=UTC), "daily"),
        (datetime(2031, 3, 4, 3, tzinfo=UTC), "hourly"),
    ]
    rest = await store.tick(100)
    assert rest.materialized == 2  # hourly 04:00 and 05:00
    all_dues = sorted(o.due_at for o in (await store.occurrences()).items)
    assert len(all_dues) == len(set(all_dues)) == 5
    assert (await store.tick(100)).materialized == 0
    for o in (await store.occurrences()).items:
        assert o.state is OccurrenceState.PENDING
        assert o.window_ends_at - o.created_at == timedelta(days=1)


async def test_coalesce_emits_once(store: PostgresRecurringStore, clock: FakeClock) -> None:
    await store.create(
        definition(
            "co",
            "*/5 * * * *",
            first_after=START - timedelta(hours=5),
            policy=MissedRunPolicy.COALESCE,
        )
    )
    assert (await store.tick(100)).materialized == 1
    assert (await store.tick(100)).materialized == 0
    [occ] = (await store.occurrences()).items
    assert occ.due_at == datetime(2031, 3, 4, 0, 10, tzinfo=UTC)  # the oldest outstanding
    [info] = (await store.schedules()).items
    assert info.next_due_at is not None
    assert info.next_due_at > START
    clock.advance(timedelta(minutes=10))
    assert (await store.tick(100)).materialized == 1


async def test_capacity_failure_rolls_back_whole_tick(
    pg_schema: tuple[str, str], clock: FakeClock
) -> None:
    dsn, schema = pg_schema
    async with await PostgresRecurringStore.initialize(
        dsn, config(max_occurrences=3), Keyring(KEY), clock, schema=schema
    ) as s:
        await s.create(definition("m", "* * * * *", first_after=START - timedelta(minutes=10)))
        before = await s.schedules()
        with pytest.raises(RecurringCapacityError):
            await s.tick(5)
        assert (await s.occurrences()).items == []
        assert (await s.schedules()) == before  # cursor not advanced
        assert (await s.tick(3)).materialized == 3
        with pytest.raises(RecurringCapacityError):
            await s.tick(1)


async def test_definition_quota_counts_cancelled(
    pg_schema: tuple[str, str], clock: FakeClock
) -> None:
    dsn, schema = pg_schema
    async with await PostgresRecurringStore.initialize(
        dsn, config(max_definitions=2), Keyring(KEY), clock, schema=schema
    ) as s:
        await s.create(definition("a"))
        await s.create(definition("b"))
        await s.cancel("a")
        with pytest.raises(RecurringCapacityError):
            await s.create(definition("c"))
        # replaying an existing (even cancelled) name is not a new definition
        assert (await s.create(definition("a"))).state == "cancelled"
        with pytest.raises(RecurringConflictError):
            await s.create(definition("a", payload=b"new"))


async def test_claim_relay_publish(store: PostgresRecurringStore, clock: FakeClock) -> None:
    await store.create(definition())
    await store.tick(100)
    leases = await store.claim(100)
    assert len(leases) == 2
    assert all(lease.expires_at == START + timedelta(seconds=60) for lease in leases)
    assert await store.claim(100) == []  # live leases are not handed out twice
    broker = MemoryBroker()
    for lease in leases:
        receipt = await store.relay(lease, broker)
        assert not receipt.duplicate
    assert [m.payload for m, _ in broker.published] == [b"hello", b"hello"]
    assert len({k for _, k in broker.published}) == 2
    assert set((await states(store)).values()) == {OccurrenceState.PUBLISHED}
    # published content is erased at once
    with pytest.raises(RelayLeaseLostError):
        await store.relay(leases[0], broker)
    assert repr(leases[0]).count("capability") == 0


async def test_content_erased_on_publish_and_cancel(
    store: PostgresRecurringStore, pg_schema: tuple[str, str]
) -> None:
    dsn, schema = pg_schema
    await store.create(definition())
    await store.create(definition("other", "30 9 * * *"))
    await store.tick(100)
    lease = (await store.claim(1))[0]
    await store.relay(lease, MemoryBroker())
    await store.cancel("other")
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch(
            f'SELECT state, content IS NULL AS erased FROM "{schema}".recurring_occurrences'
        )
    finally:
        await conn.close()
    for row in rows:
        assert row["erased"] == (row["state"] in ("published", "cancelled")), dict(row)
    assert {r["state"] for r in rows} >= {"published", "cancelled"}


async def test_lease_expiry_and_fencing(store: PostgresRecurringStore, clock: FakeClock) -> None:
    await store.create(definition("one", "0 3 4 3 *", first_after=START - timedelta(days=1)))
    await store.tick(100)
    [old] = await store.claim(10)
    clock.advance(timedelta(seconds=61))
    [new] = await store.claim(10)
    assert new.occurrence_id == old.occurrence_id
    assert new.revision == old.revision + 1
    broker = MemoryBroker()
    with pytest.raises(RelayLeaseLostError):
        await store.relay(old, broker)
    forged = Lease(new.occurrence_id, new.expires_at, new.revision, b"\x00" * 16)
    with pytest.raises(RelayLeaseLostError):
        await store.relay(forged, broker)
    stale_revision = Lease(new.occurrence_id, new.expires_at, old.revision, new.capability)
    with pytest.raises(RelayLeaseLostError):
        await store.relay(stale_revision, broker)
    assert broker.attempts == 0
    await store.relay(new, broker)
    assert len(broker.published) == 1


async def test_stale_holder_cannot_record_after_publishing(
    store: PostgresRecurringStore, clock: FakeClock
) -> None:
    """A fenced worker whose publish overlapped a new claim cannot acknowledge or retry."""
    await store.create(definition("one", "0 3 4 3 *", first_after=START - timedelta(days=1)))
    await store.tick(100)
    [old] = await store.claim(10)

    class Reclaiming(MemoryBroker):
        async def publish(self, message, *, idempotency_key, timeout):  # type: ignore[no-untyped-def]
            if not hasattr(self, "new"):
                clock.advance(timedelta(seconds=61))
                self.new = (await store.claim(10))[0]
            return await super().publish(message, idempotency_key=idempotency_key, timeout=timeout)

    broker = Reclaiming()
    with pytest.raises(RelayLeaseLostError):
        await store.relay(old, broker)
    [occ] = (await store.occurrences()).items
    assert occ.state is OccurrenceState.LEASED  # the new holder still owns it
    receipt = await store.relay(broker.new, broker)
    assert receipt.duplicate  # same idempotency key both times
    assert len(broker.published) == 1
    assert broker.keys_attempted[0] == broker.keys_attempted[1]


async def test_failures_back_off_and_die_after_ten(
    store: PostgresRecurringStore, clock: FakeClock
) -> None:
    await store.create(definition("one", "0 3 4 3 *", first_after=START - timedelta(days=1)))
    await store.tick(100)
    broker = MemoryBroker()
    broker.fail_next(10)
    for attempt in range(1, 11):
        [lease] = await store.claim(10)
        with pytest.raises(RelayBrokerError) as info:
            await store.relay(lease, broker)
        assert not info.value.permanent
        [occ] = (await store.occurrences()).items
        assert occ.attempts == attempt
        if attempt < 10:
            assert occ.state is OccurrenceState.RETRY_WAIT
            assert occ.next_attempt_at == clock.now() + min(
                timedelta(seconds=2 ** (attempt - 1)), timedelta(minutes=5)
            )
            assert await store.claim(10) == []  # not before its backoff
            clock.set(occ.next_attempt_at)
        else:
            assert occ.state is OccurrenceState.DEAD
    assert await store.claim(10) == []
    assert len(set(broker.keys_attempted)) == 1
    # an operator retry gives a fresh budget within the window
    revived = await store.retry_failed(occ.occurrence_id)
    assert revived.state is OccurrenceState.PENDING
    assert revived.attempts == 0
    [lease] = await store.claim(10)
    await store.relay(lease, broker)
    assert len(broker.published) == 1
    with pytest.raises(RecurringInvalidStateError):
        await store.retry_failed(occ.occurrence_id)  # published cannot be revived
    with pytest.raises(RecurringNotFoundError):
        await store.retry_failed("0" * 32)


async def test_permanent_failure_timeout_and_lost_ack(
    store: PostgresRecurringStore, clock: FakeClock
) -> None:
    await store.create(definition("a", "0 3 4 3 *", first_after=START - timedelta(days=1)))
    await store.tick(100)
    broker = MemoryBroker()
    broker.fail_next(1, permanent=True)
    [lease] = await store.claim(10)
    with pytest.raises(RelayBrokerError) as info:
        await store.relay(lease, broker)
    assert info.value.permanent
    [occ] = (await store.occurrences()).items
    assert occ.state is OccurrenceState.DEAD
    assert occ.last_error
    await store.retry_failed(occ.occurrence_id)

    broker.timeout_next(1, accept=True)
    [lease] = await store.claim(10)
    with pytest.raises(RelayBrokerTimeoutError):
        await store.relay(lease, broker)
    clock.advance(timedelta(seconds=5))
    broker.lose_ack_next(1)
    [lease] = await store.claim(10)
    with pytest.raises(RelayAcknowledgementError) as ack:
        await store.relay(lease, broker)
    assert ack.value.receipt.duplicate  # accepted earlier under the same key
    clock.advance(timedelta(seconds=5))
    [lease] = await store.claim(10)
    receipt = await store.relay(lease, broker)
    assert receipt.duplicate
    assert len(broker.published) == 1
    assert len(set(broker.keys_attempted)) == 1


async def test_cancel_is_permanent_and_inflight_publication_reported(
    store: PostgresRecurringStore,
) -> None:
    await store.create(definition())
    await store.tick(100)
    [lease, _] = await store.claim(10)

    class CancellingBroker(MemoryBroker):
        async def publish(self, message, *, idempotency_key, timeout):  # type: ignore[no-untyped-def]
            await store.cancel("daily")
            return await super().publish(message, idempotency_key=idempotency_key, timeout=timeout)

    receipt = await store.relay(lease, CancellingBroker())
    assert receipt.idempotency_key
    assert set((await states(store)).values()) == {OccurrenceState.CANCELLED}
    info = await store.cancel("daily")
    assert info.state == "cancelled"
    assert info.cancelled_at is not None
    assert (await store.tick(100)).materialized == 0
    with pytest.raises(RecurringNotFoundError):
        await store.cancel("missing")
    with pytest.raises(RecurringInvalidStateError):
        await store.retry_failed(lease.occurrence_id)


async def test_window_expiry_classified_and_purge(
    store: PostgresRecurringStore, clock: FakeClock
) -> None:
    await store.create(definition())
    await store.tick(100)
    [lease] = await store.claim(1)
    await store.relay(lease, MemoryBroker())
    clock.advance(timedelta(days=1, seconds=1))
    assert await store.claim(10) == []
    got = await states(store)
    assert sorted(s.value for s in got.values()) == ["expired", "published"]
    assert await store.purge_terminal(clock.now() - timedelta(days=2)) == 0
    # an expired occurrence's last update is its window end, a second before now
    assert await store.purge_terminal(clock.now() - timedelta(seconds=1)) == 1  # published
    assert [o.state for o in (await store.occurrences()).items] == [OccurrenceState.EXPIRED]
    assert await store.purge_terminal(clock.now()) == 1
    assert (await store.occurrences()).items == []
    with pytest.raises(RecurringConfigurationError):
        await store.purge_terminal(datetime(2031, 1, 1), limit=1)  # naive
    with pytest.raises(RecurringConfigurationError):
        await store.purge_terminal(clock.now(), limit=101)


async def test_lease_shortened_to_window_end(pg_schema: tuple[str, str], clock: FakeClock) -> None:
    dsn, schema = pg_schema
    cfg = config(delivery_window=timedelta(seconds=100), lease_duration=timedelta(seconds=40))
    async with await PostgresRecurringStore.initialize(
        dsn, cfg, Keyring(KEY), clock, schema=schema
    ) as s:
        await s.create(definition("a", "0 3 4 3 *", first_after=START - timedelta(days=1)))
        await s.tick(1)
        [_first] = await s.claim(1)
        clock.advance(timedelta(seconds=70))
        [second] = await s.claim(1)
        assert second.expires_at == START + timedelta(seconds=100)


async def test_paging_and_limits(store: PostgresRecurringStore) -> None:
    for i in range(5):
        await store.create(definition(f"d{i}"))
    first = await store.schedules(limit=2)
    assert [s.name for s in first.items] == ["d0", "d1"]
    assert first.next_cursor == "d1"
    second = await store.schedules(after=first.next_cursor, limit=2)
    assert [s.name for s in second.items] == ["d2", "d3"]
    last = await store.schedules(after=second.next_cursor, limit=2)
    assert [s.name for s in last.items] == ["d4"]
    assert last.next_cursor is None
    await store.tick(100)
    seen: list[str] = []
    cursor: str | None = None
    while True:
        page = await store.occurrences(after=cursor, limit=3)
        seen.extend(o.occurrence_id for o in page.items)
        cursor = page.next_cursor
        if cursor is None:
            break
    assert len(seen) == len(set(seen)) == 10
    bad_cursors: tuple[object, ...] = ("garbage", "12.x", 5)
    for bad_cursor in bad_cursors:
        with pytest.raises(RecurringConfigurationError):
            await store.occurrences(after=bad_cursor, limit=3)  # type: ignore[arg-type]
    for bad in (0, 101, True):
        with pytest.raises(RecurringConfigurationError):
            await store.schedules(limit=bad)
        with pytest.raises(RecurringConfigurationError):
            await store.tick(bad)
        with pytest.raises(RecurringConfigurationError):
            await store.claim(bad)


class SteppingClock:
    """Each reading is ``step`` later than the previous one (slow commits, in effect)."""

    def __init__(self, start: datetime, step: timedelta) -> None:
        self.at = start
        self.step = step

    def now(self) -> datetime:
        self.at += self.step
        return self.at


async def test_leases_expired_at_commit_are_not_returned(pg_schema: tuple[str, str]) -> None:
    dsn, schema = pg_schema
    cfg = config(lease_duration=timedelta(seconds=1), delivery_window=timedelta(minutes=10))
    stepping = SteppingClock(START, timedelta(seconds=2))
    async with await PostgresRecurringStore.initialize(
        dsn, cfg, Keyring(KEY), stepping, schema=schema
    ) as s:
        await s.create(definition("m", "* * * * *", first_after=START - timedelta(minutes=3)))
        assert (await s.tick(10)).materialized == 3
        assert await s.claim(10) == []  # granted, but lapsed before the caller saw them
        assert {o.state for o in (await s.occurrences()).items} == {OccurrenceState.LEASED}
        stepping.step = timedelta(milliseconds=1)
        leases = await s.claim(10)
        assert len(leases) == 3
        assert all(lease.revision == 2 for lease in leases)


@pytest.mark.parametrize(("lease_s", "expected"), [(60, 10.0), (3, 3.0)])
async def test_publication_bounded_by_lease_and_ten_seconds(
    pg_schema: tuple[str, str], clock: FakeClock, lease_s: int, expected: float
) -> None:
    dsn, schema = pg_schema
    cfg = config(lease_duration=timedelta(seconds=lease_s))
    seen: list[float] = []

    class Recording(MemoryBroker):
        async def publish(self, message, *, idempotency_key, timeout):  # type: ignore[no-untyped-def]
            seen.append(timeout)
            return await super().publish(message, idempotency_key=idempotency_key, timeout=timeout)

    async with await PostgresRecurringStore.initialize(
        dsn, cfg, Keyring(KEY), clock, schema=schema
    ) as s:
        await s.create(definition("a", "0 3 4 3 *", first_after=START - timedelta(days=1)))
        await s.tick(1)
        [lease] = await s.claim(1)
        await s.relay(lease, Recording())
    assert seen == [expected]


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
