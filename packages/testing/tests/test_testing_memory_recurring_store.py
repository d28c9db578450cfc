from __future__ import annotations

import hashlib
from datetime import UTC, datetime, timedelta

import attrs
import pytest

from steeple.core.config import RecurringConfig, RecurringDefinition
from steeple.core.errors import (
    AuthenticationFailedError,
    RecurringConfigurationError,
    RecurringConflictError,
)
from steeple.core.messages import ScheduledMessage
from steeple.core.occurrences import OccurrenceState
from steeple.core.policies import MissedRunPolicy
from steeple.core.ports import RecurringStore
from steeple.core.records import Lease, OccurrenceInfo
from steeple.runtime import crashpoints
from steeple.testing import DeterministicRandom, FakeClock, InMemoryRecurringStore, MemoryBroker

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
def store(clock: FakeClock) -> InMemoryRecurringStore:
    return InMemoryRecurringStore(config(), clock, random=DeterministicRandom(11))


async def listed(store: InMemoryRecurringStore) -> list[OccurrenceInfo]:
    page = await store.occurrences(limit=100)
    return list(page.items)


async def one_leased(store: InMemoryRecurringStore) -> Lease:
    await store.create(definition(back=timedelta(minutes=1)))
    assert (await store.tick(1)).materialized == 1
    (lease,) = await store.claim(1)
    return lease


def key_of(store: InMemoryRecurringStore, broker: MemoryBroker) -> str:
    return broker.keys_attempted[-1]


# The operations themselves run on every store (this one included) in
# tests/test_recurring_store_operations.py; what is particular to this store stays here.


async def test_store_satisfies_the_port(store: InMemoryRecurringStore) -> None:
    port: RecurringStore = store
    assert port is store
    assert "tests" in repr(store)


def test_config_must_be_a_recurring_config(clock: FakeClock) -> None:
    with pytest.raises(RecurringConfigurationError):
        InMemoryRecurringStore("tests", clock)  # type: ignore[arg-type]


# --- sealing ------------------------------------------------------------------------------------


class ToySealer:
    """A context-binding toy sealer (tests only: XOR with a hash of the context)."""

    primary_key_id = "toy"

    def __init__(self) -> None:
        self.sealed: list[tuple[str, str]] = []

    def _pad(self, n: int, namespace: str, purpose: str, identity: str) -> bytes:
        seed = f"{namespace}|{purpose}|{identity}".encode()
        out = b""
        counter = 0
        while len(out) < n:
            out += hashlib.sha256(seed + counter.to_bytes(4, "big")).digest()
            counter += 1
        return out[:n]

    def seal(self, plaintext: bytes, *, namespace: str, purpose: str, identity: str) -> bytes:
        self.sealed.append((purpose, identity))
        tag = hashlib.sha256(f"{namespace}|{purpose}|{identity}".encode() + plaintext).digest()
        pad = self._pad(len(plaintext), namespace, purpose, identity)
        return tag + bytes(a ^ b for a, b in zip(plaintext, pad, strict=True))

    def open(self, sealed: bytes, *, namespace: str, purpose: str, identity: str) -> bytes:
        tag, body = sealed[:32], sealed[32:]
        pad = self._pad(len(body), namespace, purpose, identity)
        plain = bytes(a ^ b for a, b in zip(body, pad, strict=True))
        context = f"{namespace}|{purpose}|{identity}".encode()
        if hashlib.sha256(context + plain).digest() != tag:
            raise AuthenticationFailedError("moved or tampered")
        return plain


async def test_sealed_content_round_trips_and_is_bound_to_its_identity(clock: FakeClock) -> None:
    sealer = ToySealer()
    store = InMemoryRecurringStore(config(), clock, sealer=sealer)
    await store.create(definition(back=timedelta(minutes=2)))
    # A replay opens the sealed definition to compare.
    await store.create(definition(back=timedelta(minutes=2)))
    with pytest.raises(RecurringConflictError):
        await store.create(definition(payload=b"different"))
    await store.tick(2)
    first, second = await store.claim(2)
    assert sealer.sealed[0] == ("definition", "every-minute")
    assert {p for p, _ in sealer.sealed[1:]} == {"occurrence"}
    broker = MemoryBroker()
    await store.relay(first, broker)
    assert broker.published[0][0] == definition().message
    assert all(isinstance(o.content, bytes | None) for o in store._occurrences.values())
    # Content moved onto another occurrence no longer opens.
    occurrences = store._occurrences
    occurrences[second.occurrence_id] = attrs.evolve(
        occurrences[second.occurrence_id], content=occurrences[first.occurrence_id].content or b""
    )
    with pytest.raises(AuthenticationFailedError):
        await store.relay(second, broker)


class _Crash(Exception):
    pass


def _due_index_of(store: InMemoryRecurringStore) -> dict[str, tuple[datetime, str]]:
    """The index a tick selects by, as the stored rows say it must be."""
    rows = store._definitions
    return {n: (r.next_due_at, n) for n, r in rows.items() if r.next_due_at is not None}


async def test_a_tick_undone_leaves_its_definitions_due_as_they_were(clock: FakeClock) -> None:
    """A tick selects definitions by an index of their next due times, kept with the rows:
    a tick that raises after advancing them puts the index back with them, so the next
    tick materializes what the undone one would have; a cancelled definition leaves it."""
    store = InMemoryRecurringStore(config(), clock, random=DeterministicRandom(11))
    await store.create(definition("a", back=timedelta(minutes=3)))
    await store.create(definition("b", "*/2 * * * *", back=timedelta(minutes=5)))
    await store.create(definition("c", first_after=START + timedelta(hours=1)))
    before = dict(store._storage.due)
    assert before == _due_index_of(store)
    assert set(before) == {"a", "b", "c"}

    def crash(name: str) -> None:
        if name == "tick.written":
            raise _Crash(name)

    crashpoints.arm(crash)
    try:
        with pytest.raises(_Crash):
            await store.tick(10)
    finally:
        crashpoints.disarm()
    assert store._storage.due == before
    assert (await store.tick(10)).materialized == 3 + 3  # a: 03:12-03:14; b: 03:10-03:14
    assert store._storage.due == _due_index_of(store) != before
    await store.cancel("b")
    assert store._storage.due == _due_index_of(store)
    assert set(store._storage.due) == {"a", "c"}
