"""apply_step: the one place a table row's effects become column values."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from steeple.core.occurrences import (
    OCCURRENCE_STEPS,
    PURGED,
    OccurrenceEvent,
    OccurrenceState,
    Step,
    step,
)
from steeple.engine import OccurrenceChange, OccurrenceRow, apply_step

T0 = datetime(2031, 5, 17, 3, 14, tzinfo=UTC)
AT = T0 + timedelta(minutes=7)
S = OccurrenceState


def row(state: OccurrenceState) -> OccurrenceRow:
    return OccurrenceRow(
        occurrence_id="a" * 32,
        definition_name="d",
        due_at=T0,
        state=state,
        attempts=4,
        window_ends_at=T0 + timedelta(days=1),
        created_at=T0,
        updated_at=T0 + timedelta(minutes=1),
        finished_at=T0 + timedelta(minutes=2) if state is S.DEAD else None,
        next_attempt_at=T0 + timedelta(minutes=3),
        last_error="BrokerError",
        lease_expires_at=T0 + timedelta(minutes=4),
        lease_revision=3,
        lease_digest=b"d" * 32,
        content=b"sealed",
        key_id="k1",
    )


ROWS = [(pair, r) for pair, r in OCCURRENCE_STEPS.items() if r.target is not PURGED]
IDS = [f"{s.value}-{e.value}" for (s, e), _ in ROWS]


@pytest.mark.parametrize(("pair", "table_row"), ROWS, ids=IDS)
def test_each_row_changes_exactly_what_its_effects_say(
    pair: tuple[OccurrenceState, OccurrenceEvent], table_row: Step
) -> None:
    before = row(pair[0])
    change = apply_step(before, table_row, AT)
    after = change.applied_to(before)
    e = table_row.effects
    assert after.state is table_row.target
    assert (after.content is None) == e.erase_content
    assert (after.key_id is None) == e.erase_content
    assert (after.lease_digest is None) == e.erase_lease
    assert after.lease_revision == before.lease_revision  # only a claim bumps it
    assert (after.lease_expires_at is None) == (table_row.target is not S.LEASED)
    assert (after.next_attempt_at is None) == (table_row.target is not S.RETRY_WAIT)
    assert after.attempts == (0 if e.reopens else before.attempts)
    assert (after.last_error is None) == e.clears_error
    assert after.updated_at == (AT if e.stamps else before.updated_at)
    if e.finishes:
        assert after.finished_at == AT
    elif e.reopens:
        assert after.finished_at is None
    else:
        assert after.finished_at == before.finished_at
    # identity columns never change
    for name in ("occurrence_id", "definition_name", "due_at", "window_ends_at", "created_at"):
        assert getattr(after, name) == getattr(before, name)


def test_decided_values_override_the_defaults() -> None:
    before = row(S.LEASED)
    change = apply_step(
        before,
        step(S.LEASED, OccurrenceEvent.PUBLISH_FAILED_RETRYABLE),
        AT,
        next_attempt_at=AT + timedelta(seconds=8),
        last_error="TypeError",
    )
    assert change.next_attempt_at == AT + timedelta(seconds=8)
    assert change.last_error == "TypeError"


def test_a_purge_is_not_a_change() -> None:
    with pytest.raises(ValueError, match="purge"):
        apply_step(row(S.PUBLISHED), Step(PURGED), AT)


def test_a_plain_change_keeps_the_row() -> None:
    before = row(S.LEASED)
    assert OccurrenceChange.of(before).applied_to(before) == before
    bumped = OccurrenceChange.of(before, attempts=5, updated_at=AT).applied_to(before)
    assert (bumped.attempts, bumped.updated_at, bumped.content) == (5, AT, b"sealed")
