"""The batched calls (``relay_many``, ``claim_and_relay``, ``create_many``) on every store.

Run on each store of ``recurring_stores.py`` (in memory, PostgreSQL, and whatever is added):
per-lease outcomes in order, each with the error a single ``relay`` of that lease gives;
fenced, expired and repeated leases publish and record nothing; publications run
concurrently, each bounded by its own lease; a failed recording keeps every receipt;
``create_many`` judges replay and conflict per entry and the quota for the whole batch.
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
    AuthenticationFailedError,
    RecurringCapacityError,
    RecurringConfigurationError,
    RecurringConflictError,
    RecurringKeyringError,
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
from steeple.core.records import Lease, OccurrenceInfo, RelayOutcome, ScheduleInfo
from steeple.testing import BrokerFault, DeterministicRandom, FakeClock, MemoryBroker

START = datetime(2031, 5, 17, 3, 14, 15, 926000, tzinfo=UTC)
S = OccurrenceState


def config(**overrides: object) -> RecurringConfig:
    values: dict[str, object] = {
        "namespace": "batches",
        "max_definitions": 20,
        "max_occurrences": 200,
    }
    values.update(overrides)
    return RecurringConfig(**values)  # type: ignore[arg-type]


def definition(
    name: str, *, back: timedelta = timedelta(minutes=1), payload: bytes | None = None
) -> RecurringDefinition:
    return RecurringDefinition(
        name,
        "* * * * *",
        START - back,
        MissedRunPolicy.CATCH_UP,
        ScheduledMessage(
            "reminders", "reminder.requested", name.encode() if payload is None else payload
        ),
    )


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(START)


@pytest.fixture
async def store(open_store: OpenStore, clock: FakeClock) -> Any:
    return await open_store(config(), clock, random=DeterministicRandom(7))


async def listed(store: Any) -> dict[str, OccurrenceInfo]:
    page = await store.occurrences(limit=100)
    return {o.definition_name: o for o in page.items}


async def leases_of(store: Any, *names: str) -> dict[str, Lease]:
    """One occurrence per name (each a definition one minute behind), all claimed."""
    for name in names:
        await store.create(definition(name))
    assert (await store.tick(100)).materialized == len(names)
    leases: list[Lease] = await store.claim(100)
    by_id = {o.occurrence_id: name for name, o in (await listed(store)).items()}
    return {by_id[lease.occurrence_id]: lease for lease in leases}


class ScriptedBroker(MemoryBroker):
    """A MemoryBroker that fails the publications of chosen payloads, as told.

    ``script[payload]`` is a :class:`BrokerFault` applied to that publication, or an
    exception to raise, or a coroutine function awaited before accepting.
    """

    def __init__(self, script: dict[bytes, Any]) -> None:
        super().__init__()
        self.script = script

    async def publish(
        self, message: ScheduledMessage, *, idempotency_key: str, timeout: float
    ) -> BrokerReceipt:
        action = self.script.get(message.payload)
        if isinstance(action, BrokerFault):
            self._faults.appendleft(action)  # this very call (no await in between)
        elif isinstance(action, BaseException):
            self.attempts += 1
            self.keys_attempted.append(idempotency_key)
            raise action
        elif action is not None:
            await action()
        return await super().publish(message, idempotency_key=idempotency_key, timeout=timeout)


# --- relay_many ----------------------------------------------------------------------------


async def test_a_mixed_batch_gets_one_outcome_per_lease_in_order(store: Any) -> None:
    names = ["ok", "retry", "dead", "lost-ack", "slow", "bug", "cancelled"]
    leases = await leases_of(store, *names)

    async def cancel_in_flight() -> None:
        await store.cancel("cancelled")

    broker = ScriptedBroker(
        {
            b"retry": BrokerFault.UNAVAILABLE,
            b"dead": BrokerFault.REJECTED,
            b"lost-ack": BrokerFault.LOSE_ACK,
            b"slow": BrokerFault.TIMEOUT_AFTER_ACCEPT,
            b"bug": TypeError("an adapter's bug"),
            b"cancelled": cancel_in_flight,
        }
    )
    forged = attrs.evolve(leases["ok"], capability=bytes(16))
    stale = attrs.evolve(leases["retry"], revision=leases["retry"].revision - 1)
    batch = [
        leases["cancelled"],
        forged,
        leases["bug"],
        leases["ok"],
        leases["dead"],
        stale,
        leases["lost-ack"],
        leases["ok"],  # the same lease again: relayed once
        leases["slow"],
        leases["retry"],
    ]
    outcomes: list[RelayOutcome] = await store.relay_many(batch, broker)
    assert [o.occurrence_id for o in outcomes] == [lease.occurrence_id for lease in batch]
    cancelled, forged_o, bug, ok, dead, stale_o, lost, again, slow, retry = outcomes

    assert cancelled.ok
    assert cancelled.receipt is not None
    assert not cancelled.receipt.duplicate
    assert ok.ok
    assert ok.result() == ok.receipt
    for refused in (forged_o, stale_o, again):
        assert isinstance(refused.error, RelayLeaseLostError)
        with pytest.raises(RelayLeaseLostError):
            refused.result()
    assert isinstance(bug.error, RelayBrokerError)
    assert isinstance(bug.error.__cause__, TypeError)
    assert not bug.error.permanent
    assert isinstance(dead.error, RelayBrokerError)
    assert dead.error.permanent
    assert isinstance(lost.error, RelayAcknowledgementError)
    accepted = broker.keys()
    assert lost.error.receipt.idempotency_key in accepted
    assert isinstance(slow.error, RelayBrokerTimeoutError)
    assert isinstance(retry.error, RelayBrokerError)
    assert not isinstance(retry.error, RelayBrokerTimeoutError)
    assert not retry.error.permanent

    # One publication per live lease; the refused entries reached no broker.
    assert broker.attempts == 7
    assert len(set(broker.keys_attempted)) == 7
    states = {name: (o.state, o.attempts) for name, o in (await listed(store)).items()}
    assert states == {
        "ok": (S.PUBLISHED, 1),
        "retry": (S.RETRY_WAIT, 1),
        "dead": (S.DEAD, 1),
        "lost-ack": (S.RETRY_WAIT, 1),
        "slow": (S.RETRY_WAIT, 1),
        "bug": (S.RETRY_WAIT, 1),
        "cancelled": (S.CANCELLED, 1),
    }


async def test_content_that_cannot_be_opened_is_a_dead_letter_of_its_own(
    store: Any, store_kind: OpenableStore
) -> None:
    leases = await leases_of(store, "a", "b", "c")
    contents = await store_kind.kind.contents(store)
    # "b" gets "a"'s ciphertext: sealed for another occurrence, it fails authentication.
    await store_kind.kind.set_content(
        store, leases["b"].occurrence_id, contents[leases["a"].occurrence_id]
    )
    broker = MemoryBroker()
    a, b, c = await store.relay_many([leases["a"], leases["b"], leases["c"]], broker)
    assert a.ok
    assert c.ok
    assert isinstance(b.error, RecurringKeyringError)
    assert isinstance(b.error, AuthenticationFailedError)
    assert broker.attempts == 2
    occurrences = await listed(store)
    assert occurrences["b"].state is S.DEAD
    assert occurrences["b"].last_error == "content cannot be opened (AuthenticationFailedError)"
    assert {occurrences[n].state for n in ("a", "c")} == {S.PUBLISHED}


async def test_fenced_entries_record_nothing(store: Any) -> None:
    leases = await leases_of(store, "a", "b")
    broker = MemoryBroker()
    forged = [
        attrs.evolve(leases["a"], capability=bytes(16)),
        attrs.evolve(leases["b"], revision=leases["b"].revision + 1),
        attrs.evolve(leases["a"], occurrence_id="f" * 32),
        attrs.evolve(leases["b"], occurrence_id="not-an-id"),
    ]
    outcomes = await store.relay_many(forged, broker)
    assert all(isinstance(o.error, RelayLeaseLostError) for o in outcomes)
    assert broker.attempts == 0
    assert {n: (o.state, o.attempts) for n, o in (await listed(store)).items()} == {
        "a": (S.LEASED, 0),
        "b": (S.LEASED, 0),
    }
    # The real leases still hold.
    assert all(o.ok for o in await store.relay_many([leases["a"], leases["b"]], broker))


async def test_expired_leases_publish_nothing(store: Any, clock: FakeClock) -> None:
    leases = await leases_of(store, "a", "b", "c")
    clock.advance(timedelta(seconds=60))  # the expiry instant itself is too late
    broker = MemoryBroker()
    outcomes = await store.relay_many(list(leases.values()), broker)
    assert all(isinstance(o.error, RelayLeaseLostError) for o in outcomes)
    assert broker.attempts == 0
    assert {o.state for o in (await listed(store)).values()} == {S.LEASED}
    assert {o.attempts for o in (await listed(store)).values()} == {0}


async def test_leases_fenced_during_publication_record_nothing(
    store: Any, clock: FakeClock
) -> None:
    leases = await leases_of(store, "a", "b")
    newer: list[Lease] = []

    async def lapse_and_reclaim() -> None:
        # While the batch publishes, its leases lapse and another worker claims.
        clock.advance(timedelta(seconds=61))
        newer.extend(await store.claim(100))

    broker = ScriptedBroker({b"a": lapse_and_reclaim})
    first, second = await store.relay_many([leases["a"], leases["b"]], broker)
    # "a" was accepted but can no longer be recorded by this holder; "b" found its lease
    # lapsed when its turn came and was never sent.
    assert isinstance(first.error, RelayLeaseLostError)
    assert "fenced" in str(first.error)
    assert isinstance(second.error, RelayLeaseLostError)
    assert broker.attempts == 1
    occurrences = await listed(store)
    assert {o.state for o in occurrences.values()} == {S.LEASED}
    # "b" was never sent, but its lease was already taken over: the stale holder cannot
    # give its attempt back (the new holder's check counts its own).
    assert occurrences["b"].attempts == 1
    assert len(newer) == 2
    # The new holder publishes under the same keys (the broker deduplicates "a").
    broker.script.clear()
    again = await store.relay_many(newer, broker)
    assert [o.ok for o in again] == [True, True]
    receipts = {o.occurrence_id: o.receipt for o in again}
    assert receipts[leases["a"].occurrence_id].duplicate
    assert len(broker.published) == 2


async def test_a_lease_that_lapses_before_its_turn_spends_no_attempt(
    store: Any, clock: FakeClock
) -> None:
    """Found by the relay stress test: a batch of 100 leases published a few at a time
    by a slow broker outlasted its leases, and every lapsed lease, never sent, still
    spent one of the occurrence's ten attempts (9 of 10 spent in a 60 s run, a dead
    letter at the next broker failure)."""
    leases = await leases_of(store, "a", "b")

    async def slow() -> None:
        clock.advance(timedelta(seconds=61))  # "b" waits for its turn past its lease

    broker = ScriptedBroker({b"a": slow})
    _, second = await store.relay_many([leases["a"], leases["b"]], broker, concurrency=1)
    assert isinstance(second.error, RelayLeaseLostError)
    assert "nothing was published" in str(second.error)
    assert broker.keys_attempted == [broker.published[0][1]]  # "a" only
    occurrences = await listed(store)
    assert (occurrences["b"].state, occurrences["b"].attempts) == (S.LEASED, 0)
    assert occurrences["a"].attempts == 1
    # The next holder's attempt is the first.
    [again] = await store.claim(100)
    assert again.occurrence_id == leases["b"].occurrence_id
    assert (await store.relay_many([again], MemoryBroker()))[0].ok
    occurrences = await listed(store)
    assert (occurrences["b"].state, occurrences["b"].attempts) == (S.PUBLISHED, 1)


async def test_a_failed_recording_keeps_every_receipt(store: Any) -> None:
    leases = await leases_of(store, "plain", "lost-ack", "down")

    async def close_store() -> None:
        await store.close()  # recording the outcomes will fail

    broker = ScriptedBroker(
        {
            b"plain": close_store,
            b"lost-ack": BrokerFault.LOSE_ACK,
            b"down": BrokerFault.UNAVAILABLE,
        }
    )
    plain, lost, down = await store.relay_many(
        [leases["plain"], leases["lost-ack"], leases["down"]], broker
    )
    # Accepted, then the outcome could not be recorded: an uncertain acknowledgement that
    # carries the receipt, the storage error as its cause.
    assert isinstance(plain.error, RelayAcknowledgementError)
    assert isinstance(plain.error.__cause__, RecurringStorageError)
    # The broker's own lost acknowledgement keeps its receipt too.
    assert isinstance(lost.error, RelayAcknowledgementError)
    assert isinstance(lost.error.__cause__, RecurringStorageError)
    assert {plain.error.receipt.idempotency_key, lost.error.receipt.idempotency_key} == set(
        broker.keys()
    )
    # A failure that could not be recorded is the storage error.
    assert isinstance(down.error, RecurringStorageError)
    assert len(broker.published) == 2


async def test_idempotency_keys_are_stable_across_batches(store: Any, clock: FakeClock) -> None:
    leases = await leases_of(store, "a", "b")
    broker = MemoryBroker()
    broker.fail_next(2)
    first = await store.relay_many([leases["a"], leases["b"]], broker)
    assert [type(o.error) for o in first] == [RelayBrokerError, RelayBrokerError]
    keys = list(broker.keys_attempted)
    clock.advance(timedelta(seconds=1))
    again: list[RelayOutcome] = await store.claim_and_relay(10, broker)
    assert [o.ok for o in again] == [True, True]
    assert broker.keys_attempted[2:] == keys
    for name, occ in (await listed(store)).items():
        assert occ.state is S.PUBLISHED
        assert occ.attempts == 2
        expected = idempotency_key(
            purpose=PUBLISH_PURPOSE,
            namespace="batches",
            definition_name=name,
            due_at=occ.due_at,
            generation=bytes.fromhex(occ.occurrence_id),
        )
        assert expected in keys


async def test_each_publication_is_bounded_by_its_own_lease(
    open_store: OpenStore, clock: FakeClock
) -> None:
    store = await open_store(config(lease_duration=timedelta(seconds=8)), clock)
    await store.create(definition("early"))
    await store.tick(100)
    (early,) = await store.claim(1)
    clock.advance(timedelta(seconds=5))
    await store.create(definition("late", back=timedelta(minutes=2)))
    await store.tick(100)
    late = await store.claim(100)
    seen: dict[bytes, float] = {}

    class Recording(MemoryBroker):
        async def publish(
            self, message: ScheduledMessage, *, idempotency_key: str, timeout: float
        ) -> BrokerReceipt:
            seen[message.payload] = timeout
            return await super().publish(message, idempotency_key=idempotency_key, timeout=timeout)

    outcomes = await store.relay_many([early, *late], Recording())
    assert all(o.ok for o in outcomes)
    # 3 s left of the first lease, 8 s of the later ones (each under the 10 s cap).
    assert seen == {b"early": 3.0, b"late": 8.0}


async def test_publications_run_concurrently_within_the_bound(store: Any) -> None:
    leases = await leases_of(store, "a", "b", "c", "d", "e")
    in_flight = 0
    peak = 0

    class Counting(MemoryBroker):
        async def publish(
            self, message: ScheduledMessage, *, idempotency_key: str, timeout: float
        ) -> BrokerReceipt:
            nonlocal in_flight, peak
            in_flight += 1
            peak = max(peak, in_flight)
            for _ in range(5):
                await asyncio.sleep(0)  # let every waiting publication start if it may
            in_flight -= 1
            return await super().publish(message, idempotency_key=idempotency_key, timeout=timeout)

    outcomes = await store.relay_many(list(leases.values()), Counting(), concurrency=2)
    assert all(o.ok for o in outcomes)
    assert peak == 2
    await store.create(definition("f", back=timedelta(minutes=3)))
    await store.tick(100)
    outcomes = await store.claim_and_relay(100, Counting())
    assert len(outcomes) == 3
    assert peak == 3  # the default bound (32) lets the whole batch fly at once


async def test_cancellation_propagates_and_leaves_the_leases_to_lapse(store: Any) -> None:
    leases = await leases_of(store, "a", "b")
    started = asyncio.Event()

    class Hanging(MemoryBroker):
        async def publish(
            self, message: ScheduledMessage, *, idempotency_key: str, timeout: float
        ) -> BrokerReceipt:
            started.set()
            await asyncio.Event().wait()
            raise AssertionError("unreachable")

    task = asyncio.create_task(store.relay_many(list(leases.values()), Hanging()))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    occurrences = await listed(store)
    assert {(o.state, o.attempts) for o in occurrences.values()} == {(S.LEASED, 1)}


@pytest.mark.parametrize(
    "bad",
    [
        "not leases",
        [object()],
        None,
    ],
    ids=["a-str", "not-a-lease", "none"],
)
async def test_relay_many_refuses_what_is_not_a_batch_of_leases(store: Any, bad: Any) -> None:
    with pytest.raises(RecurringConfigurationError):
        await store.relay_many(bad, MemoryBroker())


async def test_relay_many_limits(store: Any) -> None:
    leases = await leases_of(store, "a")
    broker = MemoryBroker()
    with pytest.raises(RecurringConfigurationError, match="at most 100"):
        await store.relay_many([leases["a"]] * 101, broker)
    for concurrency in (0, 101, True, 2.0):
        with pytest.raises(RecurringConfigurationError):
            await store.relay_many([leases["a"]], broker, concurrency=concurrency)
        with pytest.raises(RecurringConfigurationError):
            await store.claim_and_relay(1, broker, concurrency=concurrency)
    with pytest.raises(RecurringConfigurationError):
        await store.relay_many([leases["a"]], object())
    assert await store.relay_many([], broker) == []
    assert broker.attempts == 0
    assert (await listed(store))["a"].attempts == 0


# --- claim_and_relay -----------------------------------------------------------------------


async def test_claim_and_relay_claims_the_oldest_and_relays_them(
    store: Any, clock: FakeClock
) -> None:
    await store.create(definition("a", back=timedelta(minutes=3)))
    await store.create(definition("b", back=timedelta(minutes=2)))
    await store.tick(100)
    broker = ScriptedBroker({b"b": BrokerFault.UNAVAILABLE})
    outcomes = await store.claim_and_relay(4, broker)

    async def oldest_first() -> list[OccurrenceInfo]:
        items = (await store.occurrences(limit=100)).items
        return sorted(items, key=lambda o: (o.due_at, o.definition_name))

    ordered = await oldest_first()
    assert [o.occurrence_id for o in outcomes] == [o.occurrence_id for o in ordered[:4]]
    assert [o.definition_name for o in ordered] == ["a", "a", "b", "a", "b"]
    assert [o.ok for o in outcomes] == [True, True, False, True]
    assert isinstance(outcomes[2].error, RelayBrokerError)
    assert [(o.state, o.attempts) for o in await oldest_first()] == [
        (S.PUBLISHED, 1),
        (S.PUBLISHED, 1),
        (S.RETRY_WAIT, 1),
        (S.PUBLISHED, 1),
        (S.PENDING, 0),
    ]
    assert await store.claim(10) != []  # the fifth is still claimable
    clock.advance(timedelta(days=2))
    assert await store.claim_and_relay(10, broker) == []  # expired: nothing to claim


async def test_claim_and_relay_leases_fenced_during_publication_record_nothing(
    store: Any, clock: FakeClock
) -> None:
    """The leases ``claim_and_relay`` grants itself are fenced when their outcomes are
    recorded like any presented lease: a newer claim during publication wins."""
    for name in ("a", "b"):
        await store.create(definition(name))
    assert (await store.tick(100)).materialized == 2
    newer: list[Lease] = []

    async def lapse_and_reclaim() -> None:
        # While the batch publishes, its leases lapse and another worker claims.
        clock.advance(timedelta(seconds=61))
        newer.extend(await store.claim(100))

    broker = ScriptedBroker({b"a": lapse_and_reclaim})
    outcomes = await store.claim_and_relay(10, broker, concurrency=1)
    by_id = {o.occurrence_id: name for name, o in (await listed(store)).items()}
    first, second = sorted(outcomes, key=lambda o: by_id[o.occurrence_id])
    # "a" was accepted but can no longer be recorded by this holder; "b" found its lease
    # lapsed when its turn came and was never sent.
    assert isinstance(first.error, RelayLeaseLostError)
    assert "fenced" in str(first.error)
    assert isinstance(second.error, RelayLeaseLostError)
    assert broker.attempts == 1
    occurrences = await listed(store)
    assert {o.state for o in occurrences.values()} == {S.LEASED}
    assert len(newer) == 2
    # The new holder records its own outcomes.
    broker.script.clear()
    again = await store.relay_many(newer, broker)
    assert [o.ok for o in again] == [True, True]
    assert {o.state for o in (await listed(store)).values()} == {S.PUBLISHED}


# --- create_many ---------------------------------------------------------------------------


async def test_create_many_replays_and_conflicts_per_entry(store: Any, clock: FakeClock) -> None:
    original = await store.create(definition("b"))
    clock.advance(timedelta(seconds=30))
    results: list[ScheduleInfo | RecurringConflictError] = await store.create_many(
        [
            definition("a"),
            definition("b"),  # replay of the stored one
            definition("b", payload=b"other"),  # conflicts with it
            definition("a"),  # replay of the batch's own entry
            definition("a", back=timedelta(minutes=2)),  # conflicts with that entry
            definition("c"),
        ]
    )
    a, b, b_conflict, a_again, a_conflict, c = results
    assert isinstance(a, ScheduleInfo)
    assert a.created_at == START + timedelta(seconds=30)
    assert b == original
    assert isinstance(b_conflict, RecurringConflictError)
    assert a_again == a
    assert isinstance(a_conflict, RecurringConflictError)
    assert isinstance(c, ScheduleInfo)
    assert [s.name for s in (await store.schedules()).items] == ["a", "b", "c"]
    # Each stored definition is the first entry of its name.
    assert (await store.tick(100)).materialized == 3


async def test_create_many_quota_is_for_the_whole_batch(
    open_store: OpenStore, clock: FakeClock
) -> None:
    store = await open_store(config(max_definitions=5), clock)
    await store.create_many([definition("a"), definition("b")])
    with pytest.raises(RecurringCapacityError, match="nothing was created"):
        await store.create_many([definition(n) for n in ("c", "d", "e", "f")])
    assert [s.name for s in (await store.schedules()).items] == ["a", "b"]
    # Replays do not count: three new ones fit exactly beside two replays.
    results = await store.create_many([definition(n) for n in ("a", "c", "b", "d", "e")])
    assert all(isinstance(r, ScheduleInfo) for r in results)
    assert len((await store.schedules()).items) == 5
    assert all(isinstance(r, ScheduleInfo) for r in await store.create_many([definition("a")]))
    with pytest.raises(RecurringCapacityError):
        await store.create_many([definition("a"), definition("z")])
    with pytest.raises(RecurringCapacityError):
        await store.create(definition("z"))


async def test_create_many_counts_cancelled_names_and_replays_them(
    open_store: OpenStore, clock: FakeClock
) -> None:
    store = await open_store(config(max_definitions=2), clock)
    await store.create_many([definition("a"), definition("b")])
    await store.cancel("a")
    (replay,) = await store.create_many([definition("a")])
    assert isinstance(replay, ScheduleInfo)
    assert replay.state == "cancelled"
    with pytest.raises(RecurringCapacityError):
        await store.create_many([definition("c")])


@pytest.mark.parametrize(
    "bad",
    ["not definitions", [object()], None, [definition("a")] * 101],
    ids=["a-str", "not-a-definition", "none", "over-100"],
)
async def test_create_many_refuses_what_is_not_a_batch(store: Any, bad: Any) -> None:
    with pytest.raises(RecurringConfigurationError):
        await store.create_many(bad)
    assert (await store.schedules()).items == []


async def test_create_many_of_nothing_is_nothing(store: Any) -> None:
    assert await store.create_many([]) == []
