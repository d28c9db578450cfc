"""The engine's own guarantees, over the in-memory adapter wrapped to misbehave.

Wrappers of :class:`~steeple.testing.recurring.InMemoryRecurringStorage` make time pass
while a transaction waits for its lock or commits, or make one transaction fail, so that
each guarantee of the relay is shown deterministically with a fake clock: the lease is
judged after lock waits and after the commit, and a broker's acceptance followed by a
failed recording comes back as :class:`RelayAcknowledgementError` with the receipt.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

import attrs
import pytest

from steeple.core.config import RecurringConfig, RecurringDefinition
from steeple.core.errors import (
    AuthenticationFailedError,
    ConfigurationError,
    KeyringError,
    RecurringConfigurationError,
    RecurringDeadlineError,
    RecurringError,
    RecurringKeyringError,
    RecurringStorageError,
    RelayAcknowledgementError,
    RelayLeaseLostError,
    UnknownKeyIdError,
)
from steeple.core.messages import ScheduledMessage
from steeple.core.occurrences import OccurrenceState
from steeple.core.policies import MissedRunPolicy
from steeple.core.records import Lease
from steeple.engine import RecurringEngine, RecurringRepository, RepositoryWork
from steeple.keyring import Keyring, StorageKey
from steeple.testing import DeterministicRandom, FakeClock, MemoryBroker
from steeple.testing.recurring import InMemoryRecurringStorage

T = TypeVar("T")
START = datetime(2031, 5, 17, 3, 14, 15, 926000, tzinfo=UTC)
K1 = StorageKey("k1", b"\x11" * 32)
K2 = StorageKey("k2", b"\x22" * 32)
CONFIG = RecurringConfig("engine", 10, 100, lease_duration=timedelta(seconds=30))
S = OccurrenceState


class Scripted(InMemoryRecurringStorage):
    """The in-memory adapter with hooks around the N-th transaction (1-based)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.before: dict[int, Callable[[], object]] = {}
        self.after: dict[int, Callable[[], object]] = {}

    async def transaction(self, operation: str, work: RepositoryWork[T]) -> T:
        self.count += 1
        n = self.count

        async def hooked(repo: RecurringRepository) -> T:
            if n in self.before:
                self.before[n]()  # e.g. time passes while the lock is awaited
            result = await work(repo)
            if n in self.after:
                self.after[n]()  # e.g. time passes while the commit is acknowledged
            return result

        return await super().transaction(operation, hooked)


def definition(name: str = "d", payload: bytes = b"p") -> RecurringDefinition:
    return RecurringDefinition(
        name,
        "* * * * *",
        START - timedelta(minutes=1),
        MissedRunPolicy.CATCH_UP,
        ScheduledMessage("topic", "type", payload),
    )


def engine(storage: Any, clock: FakeClock, keyring: Keyring | None = None) -> RecurringEngine:
    return RecurringEngine(storage, CONFIG, keyring or Keyring(K1), clock, DeterministicRandom(5))


async def leased(storage: Scripted, clock: FakeClock) -> tuple[RecurringEngine, Lease]:
    e = engine(storage, clock)
    await e.create(definition())
    await e.tick(10)
    [lease] = await e.claim(10)
    return e, lease


async def test_the_lease_is_judged_after_the_lock_wait() -> None:
    clock = FakeClock(START)
    storage = Scripted()
    e, lease = await leased(storage, clock)
    # the relay's check waits 31 s for the lock: the 30 s lease lapsed meanwhile
    storage.before[storage.count + 1] = lambda: clock.advance(timedelta(seconds=31))
    broker = MemoryBroker()
    with pytest.raises(RelayLeaseLostError):
        await e.relay(lease, broker)
    assert broker.attempts == 0


async def test_the_lease_is_judged_again_after_the_commit() -> None:
    clock = FakeClock(START)
    storage = Scripted()
    e, lease = await leased(storage, clock)
    # the check passes, but its commit takes 31 s: nothing may be published on a
    # lapsed lease (another worker may hold it by now)
    storage.after[storage.count + 1] = lambda: clock.advance(timedelta(seconds=31))
    broker = MemoryBroker()
    with pytest.raises(RelayLeaseLostError, match="while its check committed"):
        await e.relay(lease, broker)
    assert broker.attempts == 0
    [occ] = (await e.occurrences()).items
    # nothing was sent: the attempt the check counted is given back; reclaimable
    assert (occ.state, occ.attempts) == (S.LEASED, 0)
    [again] = await e.claim(10)
    assert again.revision == lease.revision + 1
    await e.relay(again, broker)
    assert len(broker.published) == 1


async def test_a_slow_commit_shortens_the_publication_deadline() -> None:
    clock = FakeClock(START)
    storage = Scripted()
    e, lease = await leased(storage, clock)
    storage.after[storage.count + 1] = lambda: clock.advance(timedelta(seconds=25))
    seen: list[float] = []

    class Recording(MemoryBroker):
        async def publish(self, message: Any, *, idempotency_key: str, timeout: float) -> Any:
            seen.append(timeout)
            return await super().publish(message, idempotency_key=idempotency_key, timeout=timeout)

    await e.relay(lease, Recording())
    assert seen == [5.0]  # 30 s lease - 25 s spent committing


class SteppingClock:
    """Each reading is ``step`` later than the previous one."""

    def __init__(self, start: datetime, step: timedelta) -> None:
        self.at = start
        self.step = step
        self.readings: list[datetime] = []

    def now(self) -> datetime:
        self.at += self.step
        self.readings.append(self.at)
        return self.at


async def test_the_recorded_time_is_read_again_as_the_transaction_commits() -> None:
    clock = SteppingClock(START, timedelta(seconds=3))
    storage = Scripted()
    e = RecurringEngine(storage, CONFIG, Keyring(K1), clock)
    await e.create(definition())
    # read once after the lock was granted, once more just before the commit
    assert clock.readings == [START + timedelta(seconds=3), START + timedelta(seconds=6)]
    assert storage.recorded == clock.readings[-1]
    assert (await e.schedules()).items[0].created_at == clock.readings[0]


@pytest.mark.parametrize(
    "failure",
    [RecurringDeadlineError("lock_timeout"), RecurringStorageError("connection lost")],
    ids=["deadline", "connection-lost"],
)
async def test_acceptance_then_a_failed_recording_is_an_acknowledgement_error(
    failure: RecurringError,
) -> None:
    clock = FakeClock(START)
    storage = Scripted()
    e, lease = await leased(storage, clock)

    def fail() -> None:
        raise failure

    storage.before[storage.count + 2] = fail  # the outcome's transaction
    broker = MemoryBroker()
    with pytest.raises(RelayAcknowledgementError) as info:
        await e.relay(lease, broker)
    assert info.value.receipt.idempotency_key == broker.keys()[0]
    assert info.value.__cause__ is failure
    [occ] = (await e.occurrences()).items
    assert occ.state is S.LEASED  # not recorded: republished under the same key later
    clock.advance(timedelta(seconds=30))
    [again] = await e.claim(10)
    assert (await e.relay(again, broker)).duplicate
    assert len(broker.published) == 1


async def test_a_lost_acknowledgement_whose_recording_fails_keeps_the_receipt() -> None:
    clock = FakeClock(START)
    storage = Scripted()
    e, lease = await leased(storage, clock)
    failure = RecurringDeadlineError("lock_timeout")

    def fail() -> None:
        raise failure

    storage.before[storage.count + 2] = fail
    broker = MemoryBroker()
    broker.lose_ack_next()
    with pytest.raises(RelayAcknowledgementError) as info:
        await e.relay(lease, broker)
    assert info.value.receipt.idempotency_key == broker.keys()[0]
    assert info.value.__cause__ is failure


async def test_a_failed_recording_of_a_broker_failure_is_a_storage_error() -> None:
    clock = FakeClock(START)
    storage = Scripted()
    e, lease = await leased(storage, clock)
    failure = RecurringDeadlineError("lock_timeout")

    def fail() -> None:
        raise failure

    storage.before[storage.count + 2] = fail
    broker = MemoryBroker()
    broker.fail_next()
    with pytest.raises(RecurringDeadlineError) as info:
        await e.relay(lease, broker)
    assert info.value is failure


async def test_records_sealed_under_a_missing_key_fail_typed_naming_the_key() -> None:
    clock = FakeClock(START)
    storage = Scripted()
    first = engine(storage, clock, Keyring(K1))
    await first.create(definition("old"))
    await first.tick(10)
    [lease] = await first.claim(10)
    # another instance, whose keyring lost k1
    second = engine(storage, clock, Keyring(K2))
    calls: dict[str, Callable[[], Awaitable[object]]] = {
        "create": lambda: second.create(definition("old")),
        "schedules": lambda: second.schedules(),
        "cancel": lambda: second.cancel("old"),
    }
    for what, call in calls.items():
        with pytest.raises(UnknownKeyIdError) as info:
            await call()
        error: Exception = info.value
        assert isinstance(error, RecurringKeyringError), what
        assert isinstance(error, RecurringError), what
        assert "'k1'" in str(error), what
        assert "definition 'old'" in str(error), what
    # the occurrence sealed under k1 cannot be opened: typed, and a dead letter at once
    with pytest.raises(UnknownKeyIdError) as relayed:
        await second.relay(lease, MemoryBroker())
    assert isinstance(relayed.value, RecurringError)
    assert isinstance(relayed.value, KeyringError)
    assert "'k1'" in str(relayed.value)
    dead = [o for o in (await second.occurrences()).items if o.state is S.DEAD]
    assert [o.occurrence_id for o in dead] == [lease.occurrence_id]
    assert dead[0].last_error == "content cannot be opened (UnknownKeyIdError)"
    clock.advance(timedelta(minutes=1))
    with pytest.raises(UnknownKeyIdError) as ticked:
        await second.tick(10)
    assert isinstance(ticked.value, RecurringError)


async def test_tampered_content_is_an_authentication_error_and_a_dead_letter() -> None:
    clock = FakeClock(START - timedelta(minutes=2))
    storage = Scripted()
    e = engine(storage, clock)
    await e.create(
        RecurringDefinition(
            "two",
            "* * * * *",
            START - timedelta(minutes=5),
            MissedRunPolicy.CATCH_UP,
            ScheduledMessage("topic", "type", b"x"),
        )
    )
    clock.set(START)
    await e.tick(2)
    first, second = await e.claim(2)
    storage.occurrences[second.occurrence_id] = attrs.evolve(
        storage.occurrences[second.occurrence_id],
        content=storage.occurrences[first.occurrence_id].content,
    )
    with pytest.raises(AuthenticationFailedError) as info:
        await e.relay(second, MemoryBroker())
    assert isinstance(info.value, RecurringError)
    states = {o.occurrence_id: o.state for o in (await e.occurrences()).items}
    assert states[second.occurrence_id] is S.DEAD


async def test_arguments_of_the_wrong_kind_are_configuration_errors() -> None:
    clock = FakeClock(START)
    e = engine(InMemoryRecurringStorage(), clock)
    with pytest.raises(RecurringConfigurationError):
        await e.relay("a lease", MemoryBroker())  # type: ignore[arg-type]
    lease = Lease("0" * 32, START, 1, b"x" * 16)
    with pytest.raises(RecurringConfigurationError):
        await e.relay(lease, object())  # type: ignore[arg-type]
    # ids a Lease holds but no occurrence can have never reach the storage: not held
    for odd in ("G" * 32, "0" * 31, "x" * 128):
        with pytest.raises(RelayLeaseLostError):
            await e.relay(Lease(odd, START, 1, b"x" * 16), MemoryBroker())
    # (empty, unencodable or oversized ids are refused by Lease itself since core checks it)
    for refused in ("", "\ud800" * 32, "x" * 10_000):
        with pytest.raises(ConfigurationError):
            Lease(refused, START, 1, b"x" * 16)
    with pytest.raises(RecurringConfigurationError):
        RecurringEngine(InMemoryRecurringStorage(), "ns", Keyring(K1), clock)  # type: ignore[arg-type]
    with pytest.raises(RecurringConfigurationError):
        RecurringEngine(object(), CONFIG, Keyring(K1), clock)  # type: ignore[arg-type]
    for bad_cursor in ("\ud800" * 20, "000000000000000.\x00", "1" * 15 + "." + "a" * 100):
        with pytest.raises(RecurringConfigurationError):
            await e.occurrences(after=bad_cursor)
