"""The recurring-store operations of seed 000, run on every store (``recurring_stores.py``).

The same tests for the in-memory reference store and the PostgreSQL store (and, once
added to ``STORE_KINDS``, the SQLite store): the engine holds every operation once, and
these tests show that each adapter gives it the same storage.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Any

import attrs
import pytest

from recurring_stores import OpenableStore, OpenStore
from steeple.core.config import RecurringConfig, RecurringDefinition
from steeple.core.errors import (
    BrokerTimeoutError,
    ConfigurationError,
    RecurringCapacityError,
    RecurringClockError,
    RecurringConfigurationError,
    RecurringConflictError,
    RecurringInvalidStateError,
    RecurringNotFoundError,
    RecurringStorageError,
    RelayAcknowledgementError,
    RelayBrokerError,
    RelayBrokerTimeoutError,
    RelayLeaseLostError,
)
from steeple.core.idempotency import PUBLISH_PURPOSE, idempotency_key
from steeple.core.messages import BrokerReceipt, ScheduledMessage
from steeple.core.occurrences import OccurrenceState
from steeple.core.policies import MissedRunPolicy
from steeple.core.ports import RecurringStore
from steeple.core.records import Lease, OccurrenceInfo
from steeple.testing import DeterministicRandom, FakeClock, MemoryBroker

START = datetime(2031, 5, 17, 3, 14, 15, 926000, tzinfo=UTC)
MINUTE = timedelta(minutes=1)
S = OccurrenceState


def config(**overrides: object) -> RecurringConfig:
    values: dict[str, object] = {
        "namespace": "tests",
        "max_definitions": 5,
        "max_occurrences": 100,
    }
    values.update(overrides)
    return RecurringConfig(**values)  # type: ignore[arg-type]


def definition(
    name: str = "every-minute",
    cron: str = "* * * * *",
    *,
    back: timedelta = timedelta(minutes=10),
    policy: MissedRunPolicy = MissedRunPolicy.CATCH_UP,
    payload: bytes = b"payload",
    first_after: datetime | None = None,
) -> RecurringDefinition:
    return RecurringDefinition(
        name,
        cron,
        first_after if first_after is not None else START - back,
        policy,
        ScheduledMessage("reminders", "reminder.requested", payload, {"x-tenant": "t1"}),
    )


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(START)


@pytest.fixture
async def store(open_store: OpenStore, clock: FakeClock) -> Any:
    return await open_store(config(), clock, random=DeterministicRandom(11))


async def listed(store: Any) -> list[OccurrenceInfo]:
    page = await store.occurrences(limit=100)
    return list(page.items)


async def one_leased(store: Any) -> Lease:
    await store.create(definition(back=timedelta(minutes=1)))
    assert (await store.tick(1)).materialized == 1
    leases: list[Lease] = await store.claim(1)
    (lease,) = leases
    return lease


# --- create -----------------------------------------------------------------------------------


async def test_store_satisfies_the_port(store: Any) -> None:
    port: RecurringStore = store
    assert port is store
    assert "tests" in repr(store)


async def test_create_returns_metadata_and_replays_identically(
    store: Any, clock: FakeClock
) -> None:
    info = await store.create(definition())
    assert info.name == "every-minute"
    assert info.state == "active"
    assert info.created_at == START
    assert info.next_due_at == datetime(2031, 5, 17, 3, 5, tzinfo=UTC)
    assert info.topic == "reminders"
    clock.advance(timedelta(hours=1))
    replay = await store.create(definition())
    assert replay.created_at == START
    # A differently spelled but identical calendar is the same definition.
    same = attrs.evolve(definition(), cron="*/1 * * * *")
    assert (await store.create(same)).created_at == START


@pytest.mark.parametrize(
    "changed",
    [
        definition(payload=b"other"),
        definition(cron="*/5 * * * *"),
        definition(policy=MissedRunPolicy.COALESCE),
        definition(back=timedelta(minutes=11)),
    ],
)
async def test_conflicting_reuse_of_a_name_is_refused(
    store: Any, changed: RecurringDefinition
) -> None:
    await store.create(definition())
    with pytest.raises(RecurringConflictError):
        await store.create(changed)
    assert (await store.schedules()).items[0].next_due_at == datetime(2031, 5, 17, 3, 5, tzinfo=UTC)


async def test_definition_quota_counts_cancelled_names(
    clock: FakeClock, open_store: OpenStore
) -> None:
    store = await open_store(config(max_definitions=2), clock)
    await store.create(definition("a"))
    await store.create(definition("b"))
    await store.cancel("a")
    with pytest.raises(RecurringCapacityError):
        await store.create(definition("c"))
    # The cancelled name stays reserved: an identical replay returns it, cancelled.
    replay = await store.create(definition("a"))
    assert replay.state == "cancelled"
    with pytest.raises(RecurringConflictError):
        await store.create(definition("a", payload=b"new"))
    assert [s.name for s in (await store.schedules()).items] == ["a", "b"]


async def test_create_rejects_non_definitions(store: Any) -> None:
    with pytest.raises(RecurringConfigurationError):
        await store.create("not a definition")


# --- tick ---------------------------------------------------------------------------------------


async def test_catch_up_tick_emits_oldest_first_across_definitions(
    store: Any,
) -> None:
    await store.create(definition("b-minutes", back=timedelta(minutes=3)))
    await store.create(definition("a-fives", "*/5 * * * *", back=timedelta(minutes=20)))
    result = await store.tick(4)
    assert result.materialized == 4
    got = [(o.due_at.strftime("%H:%M"), o.definition_name) for o in await listed(store)]
    assert got == [
        ("02:55", "a-fives"),
        ("03:00", "a-fives"),
        ("03:05", "a-fives"),
        ("03:10", "a-fives"),
    ]
    await store.create(definition("a-early", back=timedelta(minutes=3)))
    result = await store.tick(4)
    got = [(o.due_at.strftime("%H:%M"), o.definition_name) for o in await listed(store)][4:]
    # Same due time: ordered by name.
    assert got == [
        ("03:12", "a-early"),
        ("03:12", "b-minutes"),
        ("03:13", "a-early"),
        ("03:13", "b-minutes"),
    ]
    result = await store.tick(100)
    assert result.materialized == 2
    assert len(result.occurrence_ids) == 2
    assert (await store.tick(100)).materialized == 0
    for occ in await listed(store):
        assert occ.state is S.PENDING
        assert occ.created_at == START
        assert occ.window_ends_at == START + timedelta(days=1)
        assert len(occ.occurrence_id) == 32
        int(occ.occurrence_id, 16)


async def test_coalesce_emits_the_oldest_once_then_skips_past_now(
    store: Any, clock: FakeClock
) -> None:
    await store.create(definition(policy=MissedRunPolicy.COALESCE))
    assert (await store.tick(100)).materialized == 1
    (occ,) = await listed(store)
    assert occ.due_at == datetime(2031, 5, 17, 3, 5, tzinfo=UTC)
    assert (await store.tick(100)).materialized == 0
    info = (await store.schedules()).items[0]
    assert info.next_due_at == datetime(2031, 5, 17, 3, 15, tzinfo=UTC)
    clock.advance(timedelta(minutes=3))
    assert (await store.tick(100)).materialized == 1
    assert (await listed(store))[-1].due_at == datetime(2031, 5, 17, 3, 15, tzinfo=UTC)


async def test_capacity_failure_rolls_back_the_whole_tick(
    clock: FakeClock, open_store: OpenStore
) -> None:
    store = await open_store(config(max_occurrences=5), clock)
    await store.create(definition("a", back=timedelta(minutes=4)))
    await store.create(definition("b", back=timedelta(minutes=4)))
    with pytest.raises(RecurringCapacityError, match="purge"):
        await store.tick(6)
    assert await listed(store) == []
    assert [s.next_due_at for s in (await store.schedules()).items] == [
        datetime(2031, 5, 17, 3, 11, tzinfo=UTC)
    ] * 2
    assert (await store.tick(5)).materialized == 5  # a smaller batch fits
    with pytest.raises(RecurringCapacityError):
        await store.tick(1)


@pytest.mark.parametrize("budget", [0, 101, -1, True, 2.0])
async def test_budgets_and_limits_outside_1_to_100_are_refused(store: Any, budget: object) -> None:
    for call in (store.tick, store.claim):
        with pytest.raises(RecurringConfigurationError):
            await call(budget)
    with pytest.raises(RecurringConfigurationError):
        await store.schedules(limit=budget)
    with pytest.raises(RecurringConfigurationError):
        await store.occurrences(limit=budget)
    with pytest.raises(RecurringConfigurationError):
        await store.purge_terminal(START, budget)


async def test_exhausted_calendar_stops(clock: FakeClock, open_store: OpenStore) -> None:
    clock.set(datetime(2100, 12, 31, 23, 59, 30, tzinfo=UTC))
    store = await open_store(config(), clock)
    await store.create(
        definition("last", "59 23 31 12 *", first_after=datetime(2100, 1, 1, tzinfo=UTC))
    )
    result = await store.tick(10)
    assert result.materialized == 1
    assert result.exhausted == ("last",)
    info = (await store.schedules()).items[0]
    assert info.state == "exhausted"
    assert info.next_due_at is None
    clock.advance(timedelta(days=1))
    assert (await store.tick(10)).materialized == 0


# --- claim and relay ----------------------------------------------------------------------------


async def test_claim_fences_with_fresh_capability_and_revision(
    store: Any, clock: FakeClock
) -> None:
    first = await one_leased(store)
    assert first.expires_at == START + timedelta(seconds=60)
    assert first.revision == 1
    assert len(first.capability) == 16
    assert "capability" not in repr(first)
    assert await store.claim(10) == []  # a live lease is not claimable
    clock.advance(timedelta(seconds=60))  # the expiry instant itself is too late
    (second,) = await store.claim(10)
    assert second.occurrence_id == first.occurrence_id
    assert second.revision == 2
    assert second.capability != first.capability
    broker = MemoryBroker()
    with pytest.raises(RelayLeaseLostError):
        await store.relay(first, broker)
    assert broker.attempts == 0
    receipt = await store.relay(second, broker)
    assert receipt.idempotency_key == broker.keys()[0]
    (occ,) = await listed(store)
    assert occ.state is S.PUBLISHED
    assert occ.attempts == 1


async def test_forged_capability_or_revision_is_refused(store: Any) -> None:
    lease = await one_leased(store)
    broker = MemoryBroker()
    forged = [
        attrs.evolve(lease, capability=bytes(16)),
        attrs.evolve(lease, capability=lease.capability[:-1]),
        attrs.evolve(lease, revision=lease.revision + 1),
        attrs.evolve(lease, revision=lease.revision - 1),
        attrs.evolve(lease, occurrence_id="f" * 32),
    ]
    for bad in forged:
        with pytest.raises(RelayLeaseLostError):
            await store.relay(bad, broker)
    assert broker.attempts == 0
    await store.relay(lease, broker)
    with pytest.raises(RelayLeaseLostError):
        await store.relay(lease, broker)  # published: the lease is spent
    assert broker.attempts == 1


async def test_lease_is_shortened_to_the_window_and_expired_work_is_classified(
    clock: FakeClock,
    open_store: OpenStore,
) -> None:
    cfg = config(delivery_window=timedelta(seconds=120), lease_duration=timedelta(seconds=60))
    store = await open_store(cfg, clock)
    await store.create(definition(back=timedelta(minutes=1)))
    await store.tick(1)
    clock.advance(timedelta(seconds=90))
    (lease,) = await store.claim(1)
    assert lease.expires_at == START + timedelta(seconds=120)
    clock.advance(timedelta(seconds=30))
    assert await store.claim(1) == []
    (occ,) = await listed(store)
    assert occ.state is S.EXPIRED
    with pytest.raises(RelayLeaseLostError):
        await store.relay(lease, MemoryBroker())


async def test_relay_publishes_the_frozen_message_under_the_documented_key(
    store: Any,
) -> None:
    lease = await one_leased(store)
    broker = MemoryBroker()
    receipt = await store.relay(lease, broker)
    ((message, key),) = broker.published
    assert message == definition().message
    assert key.startswith("stp1-")
    assert receipt == BrokerReceipt("memory", key, location="0")
    (occ,) = await listed(store)
    # The id is the generation's hex, and the key is derived from it.
    expected = idempotency_key(
        purpose=PUBLISH_PURPOSE,
        namespace="tests",
        definition_name="every-minute",
        due_at=occ.due_at,
        generation=bytes.fromhex(occ.occurrence_id),
    )
    assert key == expected


async def test_lost_acknowledgement_is_a_retry_that_the_key_deduplicates(
    store: Any, clock: FakeClock
) -> None:
    lease = await one_leased(store)
    broker = MemoryBroker()
    broker.lose_ack_next()
    with pytest.raises(RelayAcknowledgementError) as info:
        await store.relay(lease, broker)
    assert info.value.receipt.idempotency_key == broker.keys()[0]
    (occ,) = await listed(store)
    assert occ.state is S.RETRY_WAIT
    assert occ.next_attempt_at == START + timedelta(seconds=1)
    with pytest.raises(RelayLeaseLostError):
        await store.relay(lease, broker)  # the failed lease cannot try again
    assert await store.claim(1) == []  # not before the backoff
    clock.advance(timedelta(seconds=1))
    (again,) = await store.claim(1)
    receipt = await store.relay(again, broker)
    assert receipt.duplicate
    assert broker.keys_attempted == [broker.keys()[0]] * 2
    assert len(broker.published) == 1
    (occ,) = await listed(store)
    assert occ.state is S.PUBLISHED
    assert occ.attempts == 2


async def test_retryable_failures_back_off_then_die_after_ten_attempts(
    store: Any, clock: FakeClock
) -> None:
    lease = await one_leased(store)
    broker = MemoryBroker()
    expected_delays = [1, 2, 4, 8, 16, 32, 64, 128, 256]
    for attempt in range(1, 11):
        broker.fail_next()
        with pytest.raises(RelayBrokerError) as info:
            await store.relay(lease, broker)
        assert not info.value.permanent
        assert not isinstance(info.value, RelayBrokerTimeoutError)
        assert isinstance(info.value.__cause__, Exception)
        (occ,) = await listed(store)
        assert occ.attempts == attempt
        if attempt < 10:
            assert occ.state is S.RETRY_WAIT
            delay = timedelta(seconds=expected_delays[attempt - 1])
            assert occ.next_attempt_at == clock.now() + delay
            clock.advance(delay)
            (lease,) = await store.claim(1)
        else:
            assert occ.state is S.DEAD
            assert occ.next_attempt_at is None
    assert await store.claim(1) == []
    assert len(set(broker.keys_attempted)) == 1


async def test_permanent_failure_is_dead_at_once(store: Any) -> None:
    lease = await one_leased(store)
    broker = MemoryBroker()
    broker.fail_next(permanent=True)
    with pytest.raises(RelayBrokerError) as info:
        await store.relay(lease, broker)
    assert info.value.permanent
    (occ,) = await listed(store)
    assert occ.state is S.DEAD


async def test_too_large_for_the_broker_is_a_dead_letter(
    store: Any,
) -> None:
    lease = await one_leased(store)
    with pytest.raises(RelayBrokerError) as info:
        await store.relay(lease, MemoryBroker(max_payload=3))
    assert info.value.permanent
    assert (await listed(store))[0].state is S.DEAD


async def test_broker_timeout_maps_to_relay_timeout(store: Any) -> None:
    lease = await one_leased(store)
    broker = MemoryBroker()
    broker.timeout_next(accept=True)
    with pytest.raises(RelayBrokerTimeoutError) as info:
        await store.relay(lease, broker)
    assert isinstance(info.value, TimeoutError)
    assert isinstance(info.value.__cause__, BrokerTimeoutError)
    assert (await listed(store))[0].state is S.RETRY_WAIT


async def test_relay_deadline_is_bounded_by_the_lease_and_ten_seconds(
    store: Any, clock: FakeClock
) -> None:
    seen: list[float] = []

    class Recording(MemoryBroker):
        async def publish(
            self, message: ScheduledMessage, *, idempotency_key: str, timeout: float
        ) -> BrokerReceipt:
            seen.append(timeout)
            return await super().publish(message, idempotency_key=idempotency_key, timeout=timeout)

    lease = await one_leased(store)
    broker = Recording()
    broker.fail_next()
    with pytest.raises(RelayBrokerError):
        await store.relay(lease, broker)
    clock.advance(timedelta(seconds=1))
    (lease,) = await store.claim(1)
    clock.advance(timedelta(seconds=57))
    await store.relay(lease, broker)
    assert seen == [10.0, 3.0]


async def test_window_end_makes_a_retry_dead(clock: FakeClock, open_store: OpenStore) -> None:
    cfg = config(delivery_window=timedelta(seconds=10), lease_duration=timedelta(seconds=5))
    store = await open_store(cfg, clock)
    await store.create(definition(back=timedelta(minutes=1)))
    await store.tick(1)
    broker = MemoryBroker()
    # Failures at +0, +1 and +3 s back off 1, 2 and 4 s; at +7 s, 8 s would pass the window.
    for _ in range(4):
        (lease,) = await store.claim(1)
        broker.fail_next()
        with pytest.raises(RelayBrokerError):
            await store.relay(lease, broker)
        occ = (await listed(store))[0]
        if occ.state is S.RETRY_WAIT:
            assert occ.next_attempt_at is not None
            clock.set(occ.next_attempt_at)
    assert occ.state is S.DEAD
    assert occ.attempts == 4
    assert clock.now() == START + timedelta(seconds=7)


async def test_a_lease_fenced_during_publication_cannot_acknowledge(
    store: Any, clock: FakeClock
) -> None:
    lease = await one_leased(store)
    newer: list[Lease] = []

    class Slow(MemoryBroker):
        async def publish(
            self, message: ScheduledMessage, *, idempotency_key: str, timeout: float
        ) -> BrokerReceipt:
            # While this (stale) worker publishes, its lease lapses and another claims.
            clock.advance(timedelta(seconds=61))
            newer.extend(await store.claim(1))
            return await super().publish(message, idempotency_key=idempotency_key, timeout=timeout)

    broker = Slow()
    with pytest.raises(RelayLeaseLostError, match="fenced"):
        await store.relay(lease, broker)
    (occ,) = await listed(store)
    assert occ.state is S.LEASED
    receipt = await store.relay(newer[0], MemoryBroker())
    assert receipt.idempotency_key == broker.keys()[0]


async def test_a_cancellation_cannot_recall_an_in_flight_publication(
    store: Any,
) -> None:
    lease = await one_leased(store)

    class Racing(MemoryBroker):
        async def publish(
            self, message: ScheduledMessage, *, idempotency_key: str, timeout: float
        ) -> BrokerReceipt:
            await store.cancel("every-minute")
            return await super().publish(message, idempotency_key=idempotency_key, timeout=timeout)

    broker = Racing()
    receipt = await store.relay(lease, broker)
    assert not receipt.duplicate
    assert len(broker.published) == 1
    (occ,) = await listed(store)
    assert occ.state is S.CANCELLED


async def test_a_stale_lease_cannot_bury_the_new_holders_occurrence(
    store: Any, clock: FakeClock
) -> None:
    lease = await one_leased(store)

    class Failing(MemoryBroker):
        async def publish(
            self, message: ScheduledMessage, *, idempotency_key: str, timeout: float
        ) -> BrokerReceipt:
            clock.advance(timedelta(seconds=61))
            await store.claim(1)
            raise BrokerTimeoutError("slow")

    with pytest.raises(RelayBrokerTimeoutError):
        await store.relay(lease, Failing())
    (occ,) = await listed(store)
    assert occ.state is S.LEASED  # the new holder's lease, untouched


# --- cancel, retry_failed -------------------------------------------------------------------


async def test_cancel_is_permanent_and_erases_content(
    store: Any, clock: FakeClock, store_kind: OpenableStore
) -> None:
    await store.create(definition(back=timedelta(minutes=5)))
    await store.tick(100)
    leases = await store.claim(2)
    broker = MemoryBroker()
    await store.relay(leases[0], broker)
    broker.fail_next(permanent=True)
    with pytest.raises(RelayBrokerError):
        await store.relay(leases[1], broker)
    await store.claim(1)  # one more leased
    clock.advance(timedelta(seconds=5))
    info = await store.cancel("every-minute")
    assert info.state == "cancelled"
    assert info.cancelled_at == START + timedelta(seconds=5)
    assert info.next_due_at is None
    states = [o.state for o in await listed(store)]
    assert states == [S.PUBLISHED] + [S.CANCELLED] * 4
    again = await store.cancel("every-minute")
    assert again.cancelled_at == info.cancelled_at
    clock.advance(timedelta(hours=1))
    assert (await store.tick(100)).materialized == 0
    assert await store.claim(100) == []
    # Erased: no content remains on any cancelled or published occurrence.
    contents = await store_kind.kind.contents(store)
    assert [contents[o.occurrence_id] for o in await listed(store)] == [None] * 5


async def test_cancel_unknown_name(store: Any) -> None:
    with pytest.raises(RecurringNotFoundError):
        await store.cancel("nobody")


async def test_retry_failed_revives_only_dead_occurrences(store: Any, clock: FakeClock) -> None:
    lease = await one_leased(store)
    broker = MemoryBroker()
    with pytest.raises(RecurringInvalidStateError):
        await store.retry_failed(lease.occurrence_id)  # leased
    broker.fail_next(permanent=True)
    with pytest.raises(RelayBrokerError):
        await store.relay(lease, broker)
    info = await store.retry_failed(lease.occurrence_id)
    assert info.state is S.PENDING
    assert info.attempts == 0
    with pytest.raises(RecurringInvalidStateError):
        await store.retry_failed(lease.occurrence_id)  # pending now
    (lease,) = await store.claim(1)
    await store.relay(lease, broker)
    with pytest.raises(RecurringInvalidStateError, match="published"):
        await store.retry_failed(lease.occurrence_id)
    with pytest.raises(RecurringNotFoundError):
        await store.retry_failed("0" * 32)
    assert len(set(broker.keys_attempted)) == 1


async def test_retry_failed_cannot_revive_expired_cancelled_or_purged(
    store: Any, clock: FakeClock
) -> None:
    await store.create(definition("a", back=timedelta(minutes=2)))
    await store.create(definition("b", back=timedelta(minutes=1)))
    await store.tick(100)
    broker = MemoryBroker()
    for lease in await store.claim(100):
        broker.fail_next(permanent=True)
        with pytest.raises(RelayBrokerError):
            await store.relay(lease, broker)
    ids = {o.definition_name: o.occurrence_id for o in await listed(store)}
    await store.cancel("b")
    with pytest.raises(RecurringInvalidStateError, match="cancelled"):
        await store.retry_failed(ids["b"])
    clock.advance(timedelta(days=1))
    with pytest.raises(RecurringInvalidStateError, match="expired"):
        await store.retry_failed(ids["a"])
    assert await store.purge_terminal(clock.now() + timedelta(seconds=1)) == 3
    with pytest.raises(RecurringNotFoundError):
        await store.retry_failed(ids["a"])


# --- listings and purge -----------------------------------------------------------------------


async def test_pages_have_exclusive_cursors_and_no_payloads(
    store: Any,
) -> None:
    for name in ("e", "a", "d", "c", "b"):
        await store.create(definition(name, back=timedelta(minutes=2)))
    names: list[str] = []
    cursor = None
    while True:
        page = await store.schedules(after=cursor, limit=2)
        assert len(page.items) <= 2
        names.extend(s.name for s in page.items)
        if page.next_cursor is None:
            break
        cursor = page.next_cursor
    assert names == ["a", "b", "c", "d", "e"]
    assert (await store.schedules(after="b", limit=100)).items[0].name == "c"
    await store.tick(100)
    seen: list[tuple[datetime, str]] = []
    cursor = None
    while True:
        occ_page = await store.occurrences(after=cursor, limit=3)
        seen.extend((o.due_at, o.occurrence_id) for o in occ_page.items)
        if occ_page.next_cursor is None:
            break
        cursor = occ_page.next_cursor
    assert len(seen) == 10
    assert seen == sorted(seen)
    assert len(set(seen)) == 10
    for item in (await store.occurrences()).items:
        assert not hasattr(item, "payload")
        assert "payload" not in repr(item)


async def test_invalid_cursors_are_refused(store: Any) -> None:
    for bad in ("garbage", "123.abc", "000000000000000.", 5):
        with pytest.raises(RecurringConfigurationError):
            await store.occurrences(after=bad)
    with pytest.raises(RecurringConfigurationError):
        await store.schedules(after=5)


async def test_purge_removes_only_old_terminal_occurrences(store: Any, clock: FakeClock) -> None:
    await store.create(definition(back=timedelta(minutes=4)))
    await store.tick(100)
    broker = MemoryBroker()
    first, second = await store.claim(2)
    await store.relay(first, broker)  # published at START
    clock.advance(timedelta(seconds=30))
    await store.relay(second, broker)  # published at START + 30 s
    assert await store.purge_terminal(START) == 0  # strictly older than the cutoff
    assert await store.purge_terminal(START + timedelta(seconds=1)) == 1
    assert await store.purge_terminal(clock.now() + timedelta(seconds=1), limit=1) == 1
    states = sorted(o.state.value for o in await listed(store))
    assert states == ["pending", "pending"]
    assert await store.purge_terminal(clock.now() + timedelta(days=9)) == 0
    with pytest.raises(ValueError, match="aware"):
        await store.purge_terminal(datetime(2031, 1, 1))


async def test_purge_with_a_limit_removes_no_more_than_the_limit(
    store: Any, clock: FakeClock
) -> None:
    # Three occurrences are eligible; each bounded call removes exactly its limit, oldest first.
    await store.create(definition(back=timedelta(minutes=3)))
    assert (await store.tick(100)).materialized == 3
    broker = MemoryBroker()
    for lease in await store.claim(3):
        await store.relay(lease, broker)
        clock.advance(timedelta(seconds=1))
    later = clock.now() + timedelta(seconds=1)
    assert await store.purge_terminal(later, limit=1) == 1
    assert len(await listed(store)) == 2
    assert await store.purge_terminal(later, limit=2) == 2
    assert await listed(store) == []
    assert await store.purge_terminal(later, limit=2) == 0


async def test_a_bounded_purge_removes_the_earliest_finished_first_not_the_earliest_due(
    clock: FakeClock, open_store: OpenStore
) -> None:
    # Four occurrences, due at minutes 0-3, finish in another order: minute 3 first, then
    # minutes 2 and 1 together (relayed in that order), then minute 0. The documented order
    # is (finished, due, definition, id): finishing time first, due time breaking a tie.
    store = await open_store(config(), clock, random=DeterministicRandom(1))
    await store.create(definition(back=timedelta(minutes=4)))
    assert (await store.tick(100)).materialized == 4
    due_of = {o.occurrence_id: o.due_at for o in await listed(store)}
    leases = sorted(await store.claim(4), key=lambda lease: due_of[lease.occurrence_id])
    due = [due_of[lease.occurrence_id] for lease in leases]
    # The tie is broken by due time, not by id: the tied pair's ids are in the other order.
    assert leases[1].occurrence_id > leases[2].occurrence_id
    broker = MemoryBroker()
    await store.relay(leases[3], broker)
    clock.advance(timedelta(seconds=1))
    await store.relay(leases[2], broker)
    await store.relay(leases[1], broker)
    clock.advance(timedelta(seconds=1))
    await store.relay(leases[0], broker)
    later = clock.now() + timedelta(seconds=1)

    async def remaining() -> list[datetime]:
        return sorted(o.due_at for o in await listed(store))

    assert await store.purge_terminal(later, limit=1) == 1
    assert await remaining() == due[:3]  # the first finished, though due last
    assert await store.purge_terminal(later, limit=1) == 1
    assert await remaining() == [due[0], due[2]]  # a tie in finishing: the earlier due
    assert await store.purge_terminal(later, limit=1) == 1
    assert await remaining() == [due[0]]  # the last finished, though due first, stays
    assert await store.purge_terminal(later, limit=1) == 1
    assert await remaining() == []


async def test_expired_occurrences_free_capacity_only_when_purged(
    clock: FakeClock, open_store: OpenStore
) -> None:
    cfg = config(max_occurrences=2, delivery_window=timedelta(minutes=2))
    store = await open_store(cfg, clock)
    await store.create(definition(back=timedelta(minutes=2)))
    assert (await store.tick(100)).materialized == 2
    clock.advance(timedelta(minutes=3))
    with pytest.raises(RecurringCapacityError):
        await store.tick(1)
    assert [o.state for o in await listed(store)] == [S.EXPIRED, S.EXPIRED]
    # An expired occurrence's last update is its window's end, however late it was noticed.
    window_end = START + timedelta(minutes=2)
    assert await store.purge_terminal(window_end, limit=100) == 0
    assert await store.purge_terminal(window_end + timedelta(milliseconds=1), limit=100) == 2
    assert (await store.tick(2)).materialized == 2


# --- time ---------------------------------------------------------------------------------------


async def test_clock_regression_within_tolerance_adopts_recorded_time(
    store: Any, clock: FakeClock
) -> None:
    await store.create(definition(back=timedelta(minutes=1)))
    await store.tick(1)
    clock.set(START - timedelta(seconds=4.9))
    (lease,) = await store.claim(1)
    assert lease.expires_at == START + timedelta(seconds=60)  # judged by recorded time
    clock.set(START - timedelta(seconds=5))
    await store.schedules()  # exactly the tolerance is still fine


async def test_clock_regression_beyond_tolerance_fails(store: Any, clock: FakeClock) -> None:
    await store.create(definition())
    clock.set(START - timedelta(seconds=5.1))
    for call in (store.tick(1), store.claim(1), store.cancel("every-minute"), store.occurrences()):
        with pytest.raises(RecurringClockError):
            await call
    clock.set(START)
    assert (await store.schedules()).items[0].state == "active"


async def test_closed_store_refuses_calls(clock: FakeClock, open_store: OpenStore) -> None:
    async with await open_store(config(), clock) as store:
        await store.create(definition())
    with pytest.raises(RecurringStorageError):
        await store.tick(1)


async def test_an_unexpected_broker_exception_is_a_retryable_relay_error(
    store: Any,
) -> None:
    lease = await one_leased(store)

    class Buggy(MemoryBroker):
        async def publish(
            self, message: ScheduledMessage, *, idempotency_key: str, timeout: float
        ) -> BrokerReceipt:
            raise ConnectionResetError("driver error escaped the adapter")

    with pytest.raises(RelayBrokerError) as info:
        await store.relay(lease, Buggy())
    assert not info.value.permanent
    assert isinstance(info.value.__cause__, ConnectionResetError)
    (occ,) = await listed(store)
    assert occ.state is S.RETRY_WAIT
    assert occ.last_error == "ConnectionResetError"


async def test_a_hung_broker_is_cut_off_at_the_relay_deadline(store: Any, clock: FakeClock) -> None:
    await store.create(definition(back=timedelta(minutes=1)))
    await store.tick(1)
    (lease,) = await store.claim(1)
    clock.advance(timedelta(seconds=59, milliseconds=950))  # 50 ms of lease left

    class Hung(MemoryBroker):
        async def publish(
            self, message: ScheduledMessage, *, idempotency_key: str, timeout: float
        ) -> BrokerReceipt:
            await asyncio.sleep(30)  # ignores its timeout
            raise AssertionError("unreachable")

    with pytest.raises(RelayBrokerTimeoutError):
        await store.relay(lease, Hung())
    assert (await listed(store))[0].state is S.RETRY_WAIT


# --- the PostgreSQL store's operation tests, on every store ---------------------------------

PG_START = datetime(2031, 3, 4, 5, 6, 7, 123000, tzinfo=UTC)


def pg_config(ns: str = "school-events", **kw: object) -> RecurringConfig:
    args: dict[str, object] = {"max_definitions": 100, "max_occurrences": 10_000}
    args.update(kw)
    return RecurringConfig(ns, **args)  # type: ignore[arg-type]


def daily(
    name: str = "daily",
    cron: str = "0 9 * * *",
    *,
    first_after: datetime = PG_START - timedelta(days=2),
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
def pg_clock() -> FakeClock:
    return FakeClock(PG_START)


@pytest.fixture
async def pg_store(open_store: OpenStore, pg_clock: FakeClock) -> Any:
    return await open_store(pg_config(), pg_clock)


async def states_of(store: Any) -> dict[str, OccurrenceState]:
    page = await store.occurrences(limit=100)
    return {o.occurrence_id: o.state for o in page.items}


async def test_create_replay_and_conflict(pg_store: Any, pg_clock: FakeClock) -> None:
    first = await pg_store.create(daily())
    assert first.name == "daily"
    assert first.state == "active"
    assert first.next_due_at == datetime(2031, 3, 2, 9, 0, tzinfo=UTC)
    pg_clock.advance(timedelta(minutes=1))
    again = await pg_store.create(daily())
    assert again == first  # original metadata, including created_at
    with pytest.raises(RecurringConflictError):
        await pg_store.create(daily(payload=b"other"))
    with pytest.raises(RecurringConflictError):
        await pg_store.create(daily(cron="0 10 * * *"))
    page = await pg_store.schedules()
    assert [s.name for s in page.items] == ["daily"]
    assert page.next_cursor is None


async def test_catch_up_oldest_first_and_budget(pg_store: Any) -> None:
    await pg_store.create(daily())  # due 2031-03-02, 03-03, 03-04 09:00 -> 2 are past
    await pg_store.create(daily("hourly", "0 * * * *", first_after=PG_START - timedelta(hours=3)))
    result = await pg_store.tick(3)
    assert result.materialized == 3
    page = await pg_store.occurrences()
    dues = sorted((o.due_at, o.definition_name) for o in page.items)
    assert dues == [  # the three oldest across both definitions
        (datetime(2031, 3, 2, 9, tzinfo=UTC), "daily"),
        (datetime(2031, 3, 3, 9, tzinfo=UTC), "daily"),
        (datetime(2031, 3, 4, 3, tzinfo=UTC), "hourly"),
    ]
    rest = await pg_store.tick(100)
    assert rest.materialized == 2  # hourly 04:00 and 05:00
    all_dues = sorted(o.due_at for o in (await pg_store.occurrences()).items)
    assert len(all_dues) == len(set(all_dues)) == 5
    assert (await pg_store.tick(100)).materialized == 0
    for o in (await pg_store.occurrences()).items:
        assert o.state is OccurrenceState.PENDING
        assert o.window_ends_at - o.created_at == timedelta(days=1)


async def test_coalesce_emits_once(pg_store: Any, pg_clock: FakeClock) -> None:
    await pg_store.create(
        daily(
            "co",
            "*/5 * * * *",
            first_after=PG_START - timedelta(hours=5),
            policy=MissedRunPolicy.COALESCE,
        )
    )
    assert (await pg_store.tick(100)).materialized == 1
    assert (await pg_store.tick(100)).materialized == 0
    [occ] = (await pg_store.occurrences()).items
    assert occ.due_at == datetime(2031, 3, 4, 0, 10, tzinfo=UTC)  # the oldest outstanding
    [info] = (await pg_store.schedules()).items
    assert info.next_due_at is not None
    assert info.next_due_at > PG_START
    pg_clock.advance(timedelta(minutes=10))
    assert (await pg_store.tick(100)).materialized == 1


async def test_capacity_failure_rolls_back_whole_tick(
    open_store: OpenStore, pg_clock: FakeClock
) -> None:
    async with await open_store(pg_config(max_occurrences=3), pg_clock) as s:
        await s.create(daily("m", "* * * * *", first_after=PG_START - timedelta(minutes=10)))
        before = await s.schedules()
        with pytest.raises(RecurringCapacityError):
            await s.tick(5)
        assert (await s.occurrences()).items == []
        assert (await s.schedules()) == before  # cursor not advanced
        assert (await s.tick(3)).materialized == 3
        with pytest.raises(RecurringCapacityError):
            await s.tick(1)


async def test_definition_quota_counts_cancelled(
    open_store: OpenStore, pg_clock: FakeClock
) -> None:
    async with await open_store(pg_config(max_definitions=2), pg_clock) as s:
        await s.create(daily("a"))
        await s.create(daily("b"))
        await s.cancel("a")
        with pytest.raises(RecurringCapacityError):
            await s.create(daily("c"))
        # replaying an existing (even cancelled) name is not a new definition
        assert (await s.create(daily("a"))).state == "cancelled"
        with pytest.raises(RecurringConflictError):
            await s.create(daily("a", payload=b"new"))


async def test_claim_relay_publish(pg_store: Any, pg_clock: FakeClock) -> None:
    await pg_store.create(daily())
    await pg_store.tick(100)
    leases = await pg_store.claim(100)
    assert len(leases) == 2
    assert all(lease.expires_at == PG_START + timedelta(seconds=60) for lease in leases)
    assert await pg_store.claim(100) == []  # live leases are not handed out twice
    broker = MemoryBroker()
    for lease in leases:
        receipt = await pg_store.relay(lease, broker)
        assert not receipt.duplicate
    assert [m.payload for m, _ in broker.published] == [b"hello", b"hello"]
    assert len({k for _, k in broker.published}) == 2
    assert set((await states_of(pg_store)).values()) == {OccurrenceState.PUBLISHED}
    # published content is erased at once
    with pytest.raises(RelayLeaseLostError):
        await pg_store.relay(leases[0], broker)
    assert repr(leases[0]).count("capability") == 0


async def test_content_erased_on_publish_and_cancel(
    pg_store: Any, store_kind: OpenableStore
) -> None:
    await pg_store.create(daily())
    await pg_store.create(daily("other", "30 9 * * *"))
    await pg_store.tick(100)
    lease = (await pg_store.claim(1))[0]
    await pg_store.relay(lease, MemoryBroker())
    await pg_store.cancel("other")
    contents = await store_kind.kind.contents(pg_store)
    occurrences = await listed(pg_store)
    for occ in occurrences:
        erased = contents[occ.occurrence_id] is None
        assert erased == (occ.state in (S.PUBLISHED, S.CANCELLED)), occ
    assert {o.state for o in occurrences} >= {S.PUBLISHED, S.CANCELLED}


async def test_lease_expiry_and_fencing(pg_store: Any, pg_clock: FakeClock) -> None:
    await pg_store.create(daily("one", "0 3 4 3 *", first_after=PG_START - timedelta(days=1)))
    await pg_store.tick(100)
    [old] = await pg_store.claim(10)
    pg_clock.advance(timedelta(seconds=61))
    [new] = await pg_store.claim(10)
    assert new.occurrence_id == old.occurrence_id
    assert new.revision == old.revision + 1
    broker = MemoryBroker()
    with pytest.raises(RelayLeaseLostError):
        await pg_store.relay(old, broker)
    forged = Lease(new.occurrence_id, new.expires_at, new.revision, b"\x00" * 16)
    with pytest.raises(RelayLeaseLostError):
        await pg_store.relay(forged, broker)
    stale_revision = Lease(new.occurrence_id, new.expires_at, old.revision, new.capability)
    with pytest.raises(RelayLeaseLostError):
        await pg_store.relay(stale_revision, broker)
    assert broker.attempts == 0
    await pg_store.relay(new, broker)
    assert len(broker.published) == 1


async def test_stale_holder_cannot_record_after_publishing(
    pg_store: Any, pg_clock: FakeClock
) -> None:
    """A fenced worker whose publish overlapped a new claim cannot acknowledge or retry."""
    await pg_store.create(daily("one", "0 3 4 3 *", first_after=PG_START - timedelta(days=1)))
    await pg_store.tick(100)
    [old] = await pg_store.claim(10)

    class Reclaiming(MemoryBroker):
        async def publish(self, message, *, idempotency_key, timeout):  # type: ignore[no-untyped-def]
            if not hasattr(self, "new"):
                pg_clock.advance(timedelta(seconds=61))
                self.new = (await pg_store.claim(10))[0]
            return await super().publish(message, idempotency_key=idempotency_key, timeout=timeout)

    broker = Reclaiming()
    with pytest.raises(RelayLeaseLostError):
        await pg_store.relay(old, broker)
    [occ] = (await pg_store.occurrences()).items
    assert occ.state is OccurrenceState.LEASED  # the new holder still owns it
    receipt = await pg_store.relay(broker.new, broker)
    assert receipt.duplicate  # same idempotency key both times
    assert len(broker.published) == 1
    assert broker.keys_attempted[0] == broker.keys_attempted[1]


async def test_failures_back_off_and_die_after_ten(pg_store: Any, pg_clock: FakeClock) -> None:
    await pg_store.create(daily("one", "0 3 4 3 *", first_after=PG_START - timedelta(days=1)))
    await pg_store.tick(100)
    broker = MemoryBroker()
    broker.fail_next(10)
    for attempt in range(1, 11):
        [lease] = await pg_store.claim(10)
        with pytest.raises(RelayBrokerError) as info:
            await pg_store.relay(lease, broker)
        assert not info.value.permanent
        [occ] = (await pg_store.occurrences()).items
        assert occ.attempts == attempt
        if attempt < 10:
            assert occ.state is OccurrenceState.RETRY_WAIT
            assert occ.next_attempt_at == pg_clock.now() + min(
                timedelta(seconds=2 ** (attempt - 1)), timedelta(minutes=5)
            )
            assert await pg_store.claim(10) == []  # not before its backoff
            pg_clock.set(occ.next_attempt_at)
        else:
            assert occ.state is OccurrenceState.DEAD
    assert await pg_store.claim(10) == []
    assert len(set(broker.keys_attempted)) == 1
    # an operator retry gives a fresh budget within the window
    revived = await pg_store.retry_failed(occ.occurrence_id)
    assert revived.state is OccurrenceState.PENDING
    assert revived.attempts == 0
    [lease] = await pg_store.claim(10)
    await pg_store.relay(lease, broker)
    assert len(broker.published) == 1
    with pytest.raises(RecurringInvalidStateError):
        await pg_store.retry_failed(occ.occurrence_id)  # published cannot be revived
    with pytest.raises(RecurringNotFoundError):
        await pg_store.retry_failed("0" * 32)


async def test_permanent_failure_timeout_and_lost_ack(pg_store: Any, pg_clock: FakeClock) -> None:
    await pg_store.create(daily("a", "0 3 4 3 *", first_after=PG_START - timedelta(days=1)))
    await pg_store.tick(100)
    broker = MemoryBroker()
    broker.fail_next(1, permanent=True)
    [lease] = await pg_store.claim(10)
    with pytest.raises(RelayBrokerError) as info:
        await pg_store.relay(lease, broker)
    assert info.value.permanent
    [occ] = (await pg_store.occurrences()).items
    assert occ.state is OccurrenceState.DEAD
    assert occ.last_error
    await pg_store.retry_failed(occ.occurrence_id)

    broker.timeout_next(1, accept=True)
    [lease] = await pg_store.claim(10)
    with pytest.raises(RelayBrokerTimeoutError):
        await pg_store.relay(lease, broker)
    pg_clock.advance(timedelta(seconds=5))
    broker.lose_ack_next(1)
    [lease] = await pg_store.claim(10)
    with pytest.raises(RelayAcknowledgementError) as ack:
        await pg_store.relay(lease, broker)
    assert ack.value.receipt.duplicate  # accepted earlier under the same key
    pg_clock.advance(timedelta(seconds=5))
    [lease] = await pg_store.claim(10)
    receipt = await pg_store.relay(lease, broker)
    assert receipt.duplicate
    assert len(broker.published) == 1
    assert len(set(broker.keys_attempted)) == 1


async def test_cancel_is_permanent_and_inflight_publication_reported(
    pg_store: Any,
) -> None:
    await pg_store.create(daily())
    await pg_store.tick(100)
    [lease, _] = await pg_store.claim(10)

    class CancellingBroker(MemoryBroker):
        async def publish(self, message, *, idempotency_key, timeout):  # type: ignore[no-untyped-def]
            await pg_store.cancel("daily")
            return await super().publish(message, idempotency_key=idempotency_key, timeout=timeout)

    receipt = await pg_store.relay(lease, CancellingBroker())
    assert receipt.idempotency_key
    assert set((await states_of(pg_store)).values()) == {OccurrenceState.CANCELLED}
    info = await pg_store.cancel("daily")
    assert info.state == "cancelled"
    assert info.cancelled_at is not None
    assert (await pg_store.tick(100)).materialized == 0
    with pytest.raises(RecurringNotFoundError):
        await pg_store.cancel("missing")
    with pytest.raises(RecurringInvalidStateError):
        await pg_store.retry_failed(lease.occurrence_id)


async def test_window_expiry_classified_and_purge(pg_store: Any, pg_clock: FakeClock) -> None:
    await pg_store.create(daily())
    await pg_store.tick(100)
    [lease] = await pg_store.claim(1)
    await pg_store.relay(lease, MemoryBroker())
    pg_clock.advance(timedelta(days=1, seconds=1))
    assert await pg_store.claim(10) == []
    got = await states_of(pg_store)
    assert sorted(s.value for s in got.values()) == ["expired", "published"]
    assert await pg_store.purge_terminal(pg_clock.now() - timedelta(days=2)) == 0
    # an expired occurrence's last update is its window end, a second before now
    assert await pg_store.purge_terminal(pg_clock.now() - timedelta(seconds=1)) == 1  # published
    assert [o.state for o in (await pg_store.occurrences()).items] == [OccurrenceState.EXPIRED]
    assert await pg_store.purge_terminal(pg_clock.now()) == 1
    assert (await pg_store.occurrences()).items == []
    with pytest.raises(RecurringConfigurationError):
        await pg_store.purge_terminal(datetime(2031, 1, 1), limit=1)  # naive
    with pytest.raises(RecurringConfigurationError):
        await pg_store.purge_terminal(pg_clock.now(), limit=101)


async def test_lease_shortened_to_window_end(open_store: OpenStore, pg_clock: FakeClock) -> None:
    cfg = pg_config(delivery_window=timedelta(seconds=100), lease_duration=timedelta(seconds=40))
    async with await open_store(cfg, pg_clock) as s:
        await s.create(daily("a", "0 3 4 3 *", first_after=PG_START - timedelta(days=1)))
        await s.tick(1)
        [_first] = await s.claim(1)
        pg_clock.advance(timedelta(seconds=70))
        [second] = await s.claim(1)
        assert second.expires_at == PG_START + timedelta(seconds=100)


async def test_paging_and_limits(pg_store: Any) -> None:
    for i in range(5):
        await pg_store.create(daily(f"d{i}"))
    first = await pg_store.schedules(limit=2)
    assert [s.name for s in first.items] == ["d0", "d1"]
    assert first.next_cursor == "d1"
    second = await pg_store.schedules(after=first.next_cursor, limit=2)
    assert [s.name for s in second.items] == ["d2", "d3"]
    last = await pg_store.schedules(after=second.next_cursor, limit=2)
    assert [s.name for s in last.items] == ["d4"]
    assert last.next_cursor is None
    await pg_store.tick(100)
    seen: list[str] = []
    cursor: str | None = None
    while True:
        page = await pg_store.occurrences(after=cursor, limit=3)
        seen.extend(o.occurrence_id for o in page.items)
        cursor = page.next_cursor
        if cursor is None:
            break
    assert len(seen) == len(set(seen)) == 10
    bad_cursors: tuple[object, ...] = ("garbage", "12.x", 5)
    for bad_cursor in bad_cursors:
        with pytest.raises(RecurringConfigurationError):
            await pg_store.occurrences(after=bad_cursor, limit=3)
    for bad in (0, 101, True):
        with pytest.raises(RecurringConfigurationError):
            await pg_store.schedules(limit=bad)
        with pytest.raises(RecurringConfigurationError):
            await pg_store.tick(bad)
        with pytest.raises(RecurringConfigurationError):
            await pg_store.claim(bad)


class SteppingClock:
    """Each reading is ``step`` later than the previous one (slow commits, in effect)."""

    simulated = True

    def __init__(self, start: datetime, step: timedelta) -> None:
        self.at = start
        self.step = step

    def now(self) -> datetime:
        self.at += self.step
        return self.at


async def test_leases_expired_at_commit_are_not_returned(open_store: OpenStore) -> None:
    cfg = pg_config(lease_duration=timedelta(seconds=1), delivery_window=timedelta(minutes=10))
    stepping = SteppingClock(PG_START, timedelta(seconds=2))
    async with await open_store(cfg, stepping) as s:
        await s.create(daily("m", "* * * * *", first_after=PG_START - timedelta(minutes=3)))
        assert (await s.tick(10)).materialized == 3
        assert await s.claim(10) == []  # granted, but lapsed before the caller saw them
        assert {o.state for o in (await s.occurrences()).items} == {OccurrenceState.LEASED}
        stepping.step = timedelta(milliseconds=1)
        leases = await s.claim(10)
        assert len(leases) == 3
        assert all(lease.revision == 2 for lease in leases)


@pytest.mark.parametrize(("lease_s", "expected"), [(60, 10.0), (3, 3.0)])
async def test_publication_bounded_by_lease_and_ten_seconds(
    open_store: OpenStore, pg_clock: FakeClock, lease_s: int, expected: float
) -> None:
    cfg = pg_config(lease_duration=timedelta(seconds=lease_s))
    seen: list[float] = []

    class Recording(MemoryBroker):
        async def publish(self, message, *, idempotency_key, timeout):  # type: ignore[no-untyped-def]
            seen.append(timeout)
            return await super().publish(message, idempotency_key=idempotency_key, timeout=timeout)

    async with await open_store(cfg, pg_clock) as s:
        await s.create(daily("a", "0 3 4 3 *", first_after=PG_START - timedelta(days=1)))
        await s.tick(1)
        [lease] = await s.claim(1)
        await s.relay(lease, Recording())
    assert seen == [expected]


# --- hostile input: the same typed answer from every store ----------------------------------

HOSTILE = ["\ud800", "a\x00b", "x" * 100_000, "", " padded ", "\u202e", "é" * 201]


@pytest.mark.parametrize("text", HOSTILE, ids=range(len(HOSTILE)))
async def test_hostile_names_ids_and_cursors_get_typed_answers(store: Any, text: str) -> None:
    with pytest.raises(RecurringNotFoundError) as cancelled:
        await store.cancel(text)
    assert len(str(cancelled.value)) < 300  # the name is never echoed whole
    with pytest.raises(RecurringNotFoundError):
        await store.retry_failed(text)
    with pytest.raises(RecurringConfigurationError):
        await store.schedules(after=text)
    with pytest.raises(RecurringConfigurationError):
        await store.occurrences(after=text)
    # A Lease cannot even hold such an id (core checks it: 1-128 printable ASCII); ids a
    # Lease holds but no occurrence has are answered as a lost lease, by every store.
    with pytest.raises(ConfigurationError):
        Lease(text, START, 1, b"x" * 16)
    for forged_id in ("G" * 32, "x" * 128):
        with pytest.raises(RelayLeaseLostError):
            await store.relay(Lease(forged_id, START, 1, b"x" * 16), MemoryBroker())
    # nothing was stored, and the store still works
    assert (await store.schedules()).items == []
    await store.create(definition())
    assert [s.name for s in (await store.schedules()).items] == ["every-minute"]
