"""What each move of the occurrence lifecycle erases or resets (the table's effects)."""

from __future__ import annotations

import itertools

import pytest

from steeple.core import InvalidTransitionError
from steeple.core.leases import capability_digest, holds_lease
from steeple.core.occurrences import (
    OCCURRENCE_STEPS,
    OCCURRENCE_TRANSITIONS,
    PURGED,
    OccurrenceEvent,
    OccurrenceState,
    states_for,
    step,
)

S = OccurrenceState
E = OccurrenceEvent

# Transcribed by hand from the seed (publication and cancellation erase content at once;
# retryable dead letters keep it until expiry or purge; a cancellation or expiry keeps the
# lease credentials so an in-flight relay can prove it held the lease; an outcome spends
# the lease), sharing nothing with the table.
ERASES_CONTENT = {
    ("pending", "window_expired"),
    ("pending", "cancel"),
    ("leased", "published"),
    ("leased", "window_expired"),
    ("leased", "cancel"),
    ("retry_wait", "window_expired"),
    ("retry_wait", "cancel"),
    ("dead", "window_expired"),
    ("dead", "cancel"),
}
SPENDS_LEASE = {
    ("leased", "published"),
    ("leased", "publish_failed_retryable"),
    ("leased", "publish_failed_final"),
    ("leased", "lease_expired"),
    ("dead", "operator_retry"),
    ("cancelled", "published"),
}
FINISHES = ERASES_CONTENT | {("leased", "publish_failed_final")}
REOPENS = {("dead", "operator_retry")}
CLEARS_ERROR = {("leased", "published"), ("dead", "operator_retry")}
DOES_NOT_STAMP = {("cancelled", "published")}

PAIRS = list(itertools.product(OccurrenceState, OccurrenceEvent))


@pytest.mark.parametrize(("state", "event"), PAIRS)
def test_effects_of_every_pair(state: OccurrenceState, event: OccurrenceEvent) -> None:
    pair = (state.value, event.value)
    if (state, event) not in OCCURRENCE_TRANSITIONS:
        with pytest.raises(InvalidTransitionError):
            step(state, event)
        return
    row = step(state, event)
    assert row.target is OCCURRENCE_TRANSITIONS[(state, event)]
    if row.target is PURGED:
        return
    effects = row.effects
    assert effects.erase_content == (pair in ERASES_CONTENT), pair
    assert effects.erase_lease == (pair in SPENDS_LEASE), pair
    assert effects.finishes == (pair in FINISHES), pair
    assert effects.reopens == (pair in REOPENS), pair
    assert effects.clears_error == (pair in CLEARS_ERROR), pair
    assert effects.stamps == (pair not in DOES_NOT_STAMP), pair
    assert row.ends_lease == (row.target is not S.LEASED)
    assert row.clears_next_attempt == (row.target is not S.RETRY_WAIT)


def test_cancelled_after_publication_stays_cancelled_as_a_table_row() -> None:
    row = step(S.CANCELLED, E.PUBLISHED)
    assert row.target is S.CANCELLED
    assert row.effects.erase_lease
    assert not row.effects.stamps
    # ...but an expired occurrence cannot record a late publication.
    with pytest.raises(InvalidTransitionError):
        step(S.EXPIRED, E.PUBLISHED)


def test_only_terminal_targets_erase_content_and_a_dead_letter_keeps_it() -> None:
    for (_, _), row in OCCURRENCE_STEPS.items():
        if row.target is not PURGED and row.effects.erase_content:
            assert row.target in (S.PUBLISHED, S.EXPIRED, S.CANCELLED)
    assert not step(S.LEASED, E.PUBLISH_FAILED_FINAL).effects.erase_content


@pytest.mark.parametrize("event", list(OccurrenceEvent))
def test_states_for_groups_the_table_by_step(event: OccurrenceEvent) -> None:
    groups = states_for(event)
    flattened = {(s, event) for states in groups.values() for s in states}
    assert flattened == {pair for pair in OCCURRENCE_STEPS if pair[1] is event}
    for row, states in groups.items():
        assert all(step(s, event) == row for s in states)


@pytest.mark.parametrize(
    "value", ["cancel", None, ["cancel"], {"event": "cancel"}, bytearray(b"cancel")]
)
def test_a_value_that_is_not_an_event_applies_to_no_state(value: object) -> None:
    # A set-based write asked about something that is not an event (a raw string read
    # back from storage, an unhashable value) moves no row, and says so without raising.
    assert states_for(value) == {}  # type: ignore[arg-type]


def test_each_caller_gets_its_own_grouping() -> None:
    first = states_for(E.CANCEL)
    first.clear()
    assert states_for(E.CANCEL) != {}


def test_window_expiry_and_cancellation_take_one_step_from_every_live_state() -> None:
    live = {S.PENDING, S.LEASED, S.RETRY_WAIT, S.DEAD}
    for event in (E.WINDOW_EXPIRED, E.CANCEL):
        [(_row, states)] = states_for(event).items()
        assert states == live


def test_holding_a_lease_needs_the_digest_and_the_revision() -> None:
    capability = bytes(range(16))
    digest = capability_digest(capability)
    assert len(digest) == 32
    assert digest != capability
    assert holds_lease(digest, 3, capability, 3)
    assert holds_lease(digest, 3, bytearray(capability), 3)
    assert not holds_lease(digest, 3, capability, 2)
    assert not holds_lease(digest, 3, capability[:-1], 3)
    assert not holds_lease(digest, 3, bytes(16), 3)
    assert not holds_lease(None, 3, capability, 3)  # a spent lease
    assert not holds_lease(digest, 3, "not bytes", 3)
    assert not holds_lease(digest, 1, capability, True)  # bools are not revisions
    assert not holds_lease(digest, 3, capability, "3")
