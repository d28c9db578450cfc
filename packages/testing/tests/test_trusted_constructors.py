"""Values the engine builds from values it checked skip the checks, and equal checked ones.

The engine builds every lease it grants and every relay outcome it reports through
trusted factories (no field checks: the values are its own). The public constructors
keep every check. Both must build equal values, and the leases and outcomes a store
hands out must be exactly what the public constructors build from the same fields.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import attrs
import pytest

from steeple.core import MissedRunPolicy, RecurringConfig, RecurringDefinition, ScheduledMessage
from steeple.core._frozen import new, writable
from steeple.core.errors import BrokerUnavailableError, ConfigurationError, InvalidTransitionError
from steeple.core.leases import (
    capability_digest,
    grant_leases,
    holds_granted_lease,
    holds_lease,
    lease_expiry,
    new_capability,
    new_generation,
    new_occurrence_id,
    new_occurrence_ids,
    occurrence_id_for,
)
from steeple.core.messages import BrokerReceipt, trusted_receipt
from steeple.core.occurrences import (
    CLAIMABLE_STATES,
    OCCURRENCE_STEPS,
    OccurrenceEvent,
    OccurrenceState,
    step,
)
from steeple.core.records import Lease, RelayOutcome, trusted_lease, trusted_outcome
from steeple.engine.ports import (
    _CHANGE_FIELDS,
    DefinitionRow,
    DefinitionUpdate,
    OccurrenceChange,
    OccurrenceRow,
    apply_step,
    pending_row,
)
from steeple.testing import FakeClock, MemoryBroker
from steeple.testing.entropy import DeterministicRandom
from steeple.testing.simulation import memory_store

AT = datetime(2026, 1, 1, 12, tzinfo=UTC)


def test_a_trusted_lease_equals_the_checked_one() -> None:
    fields = ("ab" * 16, AT, 7, b"\x01" * 32)
    trusted, checked = trusted_lease(*fields), Lease(*fields)
    assert trusted == checked
    assert hash(trusted) == hash(checked)
    assert repr(trusted) == repr(checked)
    assert attrs.asdict(trusted) == attrs.asdict(checked)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        trusted.revision = 8  # type: ignore[misc]


def test_a_trusted_outcome_equals_the_checked_one() -> None:
    receipt = BrokerReceipt(broker="memory", idempotency_key="k" * 16)
    error = BrokerUnavailableError("down")
    assert trusted_outcome("ab" * 16, receipt=receipt) == RelayOutcome("ab" * 16, receipt=receipt)
    assert trusted_outcome("ab" * 16, error=error) == RelayOutcome("ab" * 16, error=error)
    assert trusted_outcome("ab" * 16, receipt=receipt).result() == receipt
    trusted = trusted_outcome("ab" * 16, error=error)
    assert type(trusted) is RelayOutcome
    assert hash(trusted) == hash(RelayOutcome("ab" * 16, error=error))
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        trusted.error = None  # type: ignore[misc]


def _assert_built_as_checked(built: Any, checked: Any) -> None:
    """``built`` (filled in as a plain object, then given its class) is ``checked``."""
    assert type(built) is type(checked)
    assert built == checked
    assert hash(built) == hash(checked)
    assert repr(built) == repr(checked)
    assert attrs.asdict(built, recurse=False) == attrs.asdict(checked, recurse=False)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        built.state = OccurrenceState.DEAD


def test_only_a_slotted_class_without_a_weak_reference_slot_is_filled_in() -> None:
    """``writable`` refuses a class whose layout a plain one cannot share."""

    @attrs.frozen
    class Weak:
        x: int

    @attrs.frozen(slots=False)
    class Unslotted:
        x: int

    @attrs.frozen(weakref_slot=False)
    class Plain:
        x: int

    for refused in (Weak, Unslotted):
        with pytest.raises(TypeError):
            writable(refused)
    built: Any = new(writable(Plain))
    built.x = 1
    built.__class__ = Plain
    _assert_built_as_checked(built, Plain(1))


def test_a_steps_change_and_the_row_it_writes_equal_the_constructed_ones() -> None:
    """``apply_step`` and ``applied_to`` fill a plain object in and give it its class: the
    values equal, field for field, what the public constructors build."""
    row = OccurrenceRow(
        "ef" * 16, "job", AT, OccurrenceState.PENDING, 2, AT + timedelta(hours=1), AT, AT,
        content=b"sealed", key_id="k1",
    )  # fmt: skip
    claimed = step(OccurrenceState.PENDING, OccurrenceEvent.CLAIM)
    now = AT + timedelta(seconds=5)
    expires = now + timedelta(seconds=30)
    change = apply_step(
        row, claimed, now, attempted=True,
        lease_expires_at=expires, lease_revision=1, lease_digest=b"\x02" * 32,
    )  # fmt: skip
    expected = OccurrenceChange(
        row.occurrence_id, OccurrenceState.LEASED, 3, None, None, expires,
        1, b"\x02" * 32, now, None,
    )  # fmt: skip
    _assert_built_as_checked(change, expected)
    written = change.applied_to(row)
    _assert_built_as_checked(
        written,
        OccurrenceRow(
            row.occurrence_id, "job", AT, OccurrenceState.LEASED, 3, row.window_ends_at, AT,
            now, None, None, None, expires, 1, b"\x02" * 32, b"sealed", "k1",
        ),
    )  # fmt: skip
    published = step(OccurrenceState.LEASED, OccurrenceEvent.PUBLISHED)
    done = apply_step(written, published, now)
    assert done.erase_content
    _assert_built_as_checked(
        done.applied_to(written),
        OccurrenceRow(
            row.occurrence_id, "job", AT, OccurrenceState.PUBLISHED, 3, row.window_ends_at, AT,
            now, now, None, None, None, 1, None, None, None,
        ),
    )  # fmt: skip


def test_a_ticks_new_row_equals_the_constructed_one() -> None:
    """``pending_row`` fills a plain object in: the row a tick inserts equals, field for
    field, the pending row the public constructor builds."""
    window = AT + timedelta(hours=1)
    due = AT - timedelta(minutes=1)
    _assert_built_as_checked(
        pending_row("cd" * 16, "job", due, window, AT, b"sealed", "k1"),
        OccurrenceRow(
            "cd" * 16, "job", due, OccurrenceState.PENDING, 0, window, AT, AT,
            content=b"sealed", key_id="k1",
        ),
    )  # fmt: skip


@pytest.mark.parametrize("duplicate", [False, True])
def test_a_trusted_receipt_equals_the_checked_one(duplicate: bool) -> None:
    trusted = trusted_receipt("simulated", "stp1-" + "a" * 48, duplicate=duplicate)
    checked = BrokerReceipt("simulated", "stp1-" + "a" * 48, duplicate=duplicate)
    assert trusted == checked
    assert hash(trusted) == hash(checked)
    assert repr(trusted) == repr(checked)
    assert attrs.asdict(trusted) == attrs.asdict(checked)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        trusted.duplicate = not duplicate  # type: ignore[misc]


def test_the_public_constructors_still_check_every_field() -> None:
    with pytest.raises(ConfigurationError):
        Lease("has space", AT, 1, b"x")
    with pytest.raises(ConfigurationError):
        Lease("ab" * 16, datetime(2026, 1, 1), 1, b"x")
    with pytest.raises(ConfigurationError):
        Lease("ab" * 16, AT, -1, b"x")
    with pytest.raises(ConfigurationError):
        RelayOutcome("ab" * 16)
    with pytest.raises(ConfigurationError):
        BrokerReceipt(broker="", idempotency_key="k")
    with pytest.raises(ConfigurationError):
        RelayOutcome(
            "ab" * 16,
            receipt=BrokerReceipt(broker="m", idempotency_key="k"),
            error=BrokerUnavailableError("x"),
        )


async def test_a_stores_leases_and_outcomes_are_what_the_checked_constructors_build() -> None:
    clock = FakeClock(AT)
    store = await memory_store(RecurringConfig("trusted", 10, 100), clock, DeterministicRandom(3))
    message = ScheduledMessage("jobs", "job.run", b"{}")
    for i in range(3):
        await store.create(
            RecurringDefinition(f"job-{i}", "* * * * *", AT, MissedRunPolicy.CATCH_UP, message)
        )
    clock.advance(timedelta(minutes=2))
    await store.tick(100)
    leases = await store.claim(2)
    assert len(leases) == 2
    for lease in leases:
        assert lease == Lease(
            lease.occurrence_id, lease.expires_at, lease.revision, lease.capability
        )
    outcomes = [*await store.relay_many(leases, MemoryBroker())]
    outcomes += await store.claim_and_relay(100, MemoryBroker())
    assert len(outcomes) == 6
    for outcome in outcomes:
        assert outcome == RelayOutcome(outcome.occurrence_id, outcome.receipt, outcome.error)
    await store.close()


@pytest.mark.parametrize("stored", ["none", "same", "other"])
@pytest.mark.parametrize("stored_revision", [0, 1, 2])
def test_a_granted_leases_fence_is_the_checked_one(stored: str, stored_revision: int) -> None:
    """Judged by the digest taken when it was granted, a lease is held exactly when
    :func:`holds_lease` (which hashes the presented capability) says it is."""
    capability, other = b"\x01" * 32, b"\x02" * 32
    digest = capability_digest(capability)
    stored_digest = {"none": None, "same": digest, "other": capability_digest(other)}[stored]
    for revision in (0, 1, 2):
        checked = holds_lease(stored_digest, stored_revision, capability, revision)
        assert holds_granted_lease(stored_digest, stored_revision, digest, revision) is checked
    assert holds_granted_lease(digest, 1, digest, 1)
    assert not holds_granted_lease(None, 1, digest, 1)


@pytest.mark.parametrize(
    ("granted", "revision"),
    [
        ("digest-as-str", 1),
        (bytearray(32), 1),
        (None, 1),
        (b"", True),
        (b"", 1.0),
        (b"", "1"),
        (b"", None),
        (b"", 2**64),
    ],
)
def test_a_granted_lease_of_the_wrong_type_is_never_held(granted: object, revision: object) -> None:
    """As with a presented capability: nothing but a bytes digest and an int revision."""
    digest = capability_digest(b"cap")
    held = digest if granted == b"" else granted
    assert holds_granted_lease(digest, 1, held, revision) is False  # type: ignore[arg-type]


@pytest.mark.parametrize("state", [s for s in OccurrenceState if s in CLAIMABLE_STATES])
def test_a_claim_that_counts_the_attempt_writes_what_two_changes_wrote(
    state: OccurrenceState,
) -> None:
    """The grant of ``claim_and_relay`` counts the attempt in its own change: equal to the
    claim's change with the attempt counted on top (the relay's check, by hand)."""
    row = OccurrenceRow(
        occurrence_id="ab" * 16,
        definition_name="job",
        due_at=AT,
        state=state,
        attempts=3,
        window_ends_at=AT + timedelta(hours=1),
        created_at=AT,
        updated_at=AT,
        content=b"sealed",
        lease_revision=4,
        lease_digest=b"\x00" * 32,
        lease_expires_at=AT,
        next_attempt_at=AT,
    )
    now = AT + timedelta(minutes=1)
    lease: dict[str, Any] = {
        "lease_expires_at": now + timedelta(seconds=60),
        "lease_revision": 5,
        "lease_digest": b"\x07" * 32,
    }
    claimed = step(state, OccurrenceEvent.CLAIM)
    claim = apply_step(row, claimed, now, **lease)
    by_hand = attrs.evolve(claim, attempts=claim.attempts + 1, updated_at=now)
    assert apply_step(row, claimed, now, attempted=True, **lease) == by_hand
    assert apply_step(row, claimed, now, **lease) == claim  # not counted unless asked


def test_the_steps_looked_up_by_value_are_the_table() -> None:
    """:func:`step` looks its answer up by the members' values: the table's own rows."""
    for state in OccurrenceState:
        for event in OccurrenceEvent:
            if (state, event) in OCCURRENCE_STEPS:
                assert step(state, event) is OCCURRENCE_STEPS[(state, event)]
            else:
                with pytest.raises(InvalidTransitionError):
                    step(state, event)


def test_a_steps_change_names_each_column_it_sets() -> None:
    """``apply_step`` builds its change positionally: each value lands in its own field,
    for every step of the table, with and without values decided besides."""
    assert tuple(f.name for f in attrs.fields(OccurrenceChange)) == _CHANGE_FIELDS
    row = OccurrenceRow(
        occurrence_id="cd" * 16,
        definition_name="job",
        due_at=AT,
        state=OccurrenceState.LEASED,
        attempts=3,
        window_ends_at=AT + timedelta(hours=1),
        created_at=AT - timedelta(minutes=2),
        updated_at=AT - timedelta(minutes=1),
        finished_at=AT - timedelta(seconds=30),
        next_attempt_at=AT + timedelta(minutes=5),
        last_error="BrokerUnavailableError",
        lease_expires_at=AT + timedelta(seconds=60),
        lease_revision=4,
        lease_digest=b"\x00" * 32,
        content=b"sealed",
    )
    now = AT + timedelta(minutes=3)
    for (state, event), found in OCCURRENCE_STEPS.items():
        if not isinstance(found.target, OccurrenceState):
            continue
        moved = attrs.evolve(row, state=state)
        change = apply_step(moved, found, now)
        effects = found.effects
        stamp = now if effects.stamps else moved.updated_at
        expected = {
            "occurrence_id": moved.occurrence_id,
            "state": found.target,
            "attempts": 0 if effects.reopens else moved.attempts,
            "next_attempt_at": None if found.clears_next_attempt else moved.next_attempt_at,
            "last_error": None if effects.clears_error else moved.last_error,
            "lease_expires_at": None if found.ends_lease else moved.lease_expires_at,
            "lease_revision": moved.lease_revision,
            "lease_digest": None if effects.erase_lease else moved.lease_digest,
            "updated_at": stamp,
            "finished_at": stamp
            if effects.finishes
            else (None if effects.reopens else moved.finished_at),
            "erase_content": effects.erase_content,
        }
        assert attrs.asdict(change, recurse=False) == expected, (state, event)
        decided = apply_step(moved, found, now, last_error="X", lease_revision=9)
        assert attrs.asdict(decided, recurse=False) == expected | {
            "last_error": "X",
            "lease_revision": 9,
        }


def test_a_fresh_occurrence_id_is_the_id_of_a_fresh_generation() -> None:
    """The tick draws each id in one step: the same id as the checked two."""
    one, two = DeterministicRandom(11), DeterministicRandom(11)
    for _ in range(50):
        assert new_occurrence_id(one) == occurrence_id_for(new_generation(two))


def test_a_ticks_ids_are_fresh_ids_drawn_one_by_one() -> None:
    """A tick looks its random source up once and draws an id per occurrence, as asked."""
    one, two = DeterministicRandom(11), DeterministicRandom(11)
    ids = new_occurrence_ids(one)
    for _ in range(50):
        assert next(ids) == new_occurrence_id(two)
    assert one.token_bytes(16) == two.token_bytes(16)  # no draw ahead of what was asked
    with pytest.raises(ConfigurationError, match=r"bad generation \(need 16 bytes\)$"):
        next(new_occurrence_ids(_Short()))
    lazy = new_occurrence_ids(object())  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match=r"^random must be a RandomSource"):
        next(lazy)  # refused at the first id, as new_occurrence_id refuses it


class _Short:
    def token_bytes(self, n: int) -> bytes:
        return bytes(n - 1)

    def random(self) -> float:
        return 0.0


def test_definition_values_filled_in_as_plain_objects_equal_the_constructed_ones() -> None:
    """A tick builds its definition updates, and the in-memory store its rows, as plain
    objects given their class: equal to what the constructors build, and the classes have
    nothing else their constructors would run (a default factory, a validator, a
    converter, a post-init)."""
    for cls in (DefinitionRow, DefinitionUpdate):
        assert not hasattr(cls, "__attrs_post_init__")
        for field in attrs.fields(cls):
            assert field.validator is None
            assert field.converter is None
            assert not isinstance(field.default, attrs.Factory)  # type: ignore[arg-type]
    later = AT + timedelta(minutes=5)
    fields = ("job", "active", AT, later, None)
    built, constructed = DefinitionUpdate.built(*fields), DefinitionUpdate(*fields)
    assert built == constructed
    assert hash(built) == hash(constructed)
    assert repr(built) == repr(constructed)
    assert attrs.asdict(built) == attrs.asdict(constructed)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        built.state = "cancelled"  # type: ignore[misc]
    row = DefinitionRow(
        "job", b"sealed", "k1", "*/5 * * * *", MissedRunPolicy.COALESCE, AT - timedelta(days=1),
        "active", AT - timedelta(minutes=5), AT, AT - timedelta(days=2),
    )  # fmt: skip
    for update in (
        built,
        DefinitionUpdate("job", "exhausted", later, None, None),
        DefinitionUpdate("job", "cancelled", AT, None, later),
    ):
        applied = update.applied_to(row)
        assert applied == attrs.evolve(
            row,
            state=update.state,
            cursor=update.cursor,
            next_due_at=update.next_due_at,
            cancelled_at=update.cancelled_at,
        )
        assert attrs.asdict(applied) == attrs.asdict(
            DefinitionRow(*(getattr(applied, f.name) for f in attrs.fields(DefinitionRow)))
        )


def test_a_step_refuses_a_value_for_no_column() -> None:
    """Values decided besides the step land in their own column; no other name is taken."""
    row = OccurrenceRow(
        occurrence_id="ef" * 16,
        definition_name="job",
        due_at=AT,
        state=OccurrenceState.PENDING,
        attempts=0,
        window_ends_at=AT + timedelta(hours=1),
        created_at=AT,
        updated_at=AT,
    )
    claimed = step(OccurrenceState.PENDING, OccurrenceEvent.CLAIM)
    with pytest.raises(TypeError, match="no column 'content'"):
        apply_step(row, claimed, AT, content=b"x")


@pytest.mark.parametrize("lease_seconds", [1, 60, 300])
def test_a_claims_grants_are_the_checked_functions_drawn_in_order(lease_seconds: int) -> None:
    """``grant_leases`` checks the batch once; each grant equals ``lease_expiry``, then
    ``new_capability`` and ``capability_digest`` drawn from the same source in order, and
    a window that has ended (or ends now) draws nothing."""
    lease = timedelta(seconds=lease_seconds)
    windows = [
        AT + timedelta(days=1),
        AT + timedelta(seconds=30),  # shortens the lease to the window's end
        AT,  # ended: no lease, no draw
        AT - timedelta(minutes=1),  # ended
        AT + timedelta(microseconds=1),
        AT + lease,
        AT + timedelta(hours=2),
    ]
    batch = DeterministicRandom(7)
    one_by_one = DeterministicRandom(7)
    grants = grant_leases(AT, lease, windows, batch)
    assert len(grants) == len(windows)
    for window, grant in zip(windows, grants, strict=True):
        expires = lease_expiry(AT, lease, window)
        if expires is None:
            assert grant is None
            continue
        assert grant is not None
        capability = new_capability(one_by_one)
        assert (grant.expires_at, grant.capability) == (expires, capability)
        assert grant.digest == capability_digest(capability)
    # Nothing more was drawn than the checked functions drew.
    assert batch.token_bytes(16) == one_by_one.token_bytes(16)


def test_a_claims_grants_refuse_what_lease_expiry_refuses() -> None:
    random = DeterministicRandom(1)
    with pytest.raises(ConfigurationError):
        grant_leases(AT, timedelta(seconds=60), [datetime(2026, 1, 2)], random)
    with pytest.raises(ConfigurationError):
        grant_leases(AT.replace(tzinfo=None), timedelta(seconds=60), [], random)
    with pytest.raises(ConfigurationError):
        grant_leases(AT, timedelta(0), [], random)
    with pytest.raises(TypeError):
        grant_leases(AT, timedelta(seconds=60), ["2026-01-02"], random)  # type: ignore[list-item]
    with pytest.raises(TypeError):
        grant_leases(AT, timedelta(seconds=60), [AT + timedelta(days=1)], object())  # type: ignore[arg-type]

    class Short:
        def token_bytes(self, n: int) -> bytes:
            return b"\x00" * (n - 1)

    with pytest.raises(ConfigurationError):
        grant_leases(AT, timedelta(seconds=60), [AT + timedelta(days=1)], Short())  # type: ignore[arg-type]
