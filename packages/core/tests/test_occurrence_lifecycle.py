"""The occurrence lifecycle table, checked pair by pair against an independent expectation."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from steeple.core import InvalidTransitionError, SteepleError
from steeple.core.occurrences import (
    CLAIMABLE_STATES,
    OCCURRENCE_TRANSITIONS,
    PURGED,
    TERMINAL_STATES,
    OccurrenceEvent,
    OccurrenceState,
    PurgedType,
    transition,
)

# The lead's decision, transcribed by hand from CORE_API.md as plain strings, so this
# expectation shares nothing with the implementation's table.
_EXPECTED_TEXT = """
pending    claim                     leased
pending    window_expired            expired
pending    cancel                    cancelled
leased     published                 published
leased     publish_failed_retryable  retry_wait
leased     publish_failed_final      dead
leased     lease_expired             pending
leased     claim                     leased
leased     window_expired            expired
leased     cancel                    cancelled
retry_wait claim                     leased
retry_wait window_expired            expired
retry_wait cancel                    cancelled
dead       operator_retry            pending
dead       window_expired            expired
dead       cancel                    cancelled
dead       purge                     <purged>
published  purge                     <purged>
expired    purge                     <purged>
cancelled  published                 cancelled
cancelled  purge                     <purged>
"""
EXPECTED: dict[tuple[str, str], str] = {
    (state, event): target
    for state, event, target in (line.split() for line in _EXPECTED_TEXT.strip().splitlines())
}

ALL_STATE_NAMES = ["pending", "leased", "retry_wait", "published", "dead", "expired", "cancelled"]
ALL_EVENT_NAMES = [
    "claim",
    "published",
    "publish_failed_retryable",
    "publish_failed_final",
    "lease_expired",
    "window_expired",
    "cancel",
    "operator_retry",
    "purge",
]


def _name(result: object) -> str:
    if result is PURGED:
        return "<purged>"
    assert isinstance(result, OccurrenceState)
    return result.value


def _check_pair(state: OccurrenceState, event: OccurrenceEvent) -> None:
    expected = EXPECTED.get((state.value, event.value))
    if expected is None:
        with pytest.raises(InvalidTransitionError) as info:
            transition(state, event)
        assert info.value.state is state
        assert info.value.event is event
        assert info.value.lifecycle == "occurrence"
        assert state.value in str(info.value)
        assert event.value in str(info.value)
    else:
        assert _name(transition(state, event)) == expected


def test_enums_are_exactly_the_contract() -> None:
    assert [s.value for s in OccurrenceState] == ALL_STATE_NAMES
    assert [e.value for e in OccurrenceEvent] == ALL_EVENT_NAMES
    assert {e.name for e in OccurrenceEvent} == {
        "CLAIM",
        "PUBLISHED",
        "PUBLISH_FAILED_RETRYABLE",
        "PUBLISH_FAILED_FINAL",
        "LEASE_EXPIRED",
        "WINDOW_EXPIRED",
        "CANCEL",
        "OPERATOR_RETRY",
        "PURGE",
    }


@pytest.mark.parametrize(
    ("state", "event"), list(itertools.product(OccurrenceState, OccurrenceEvent))
)
def test_every_pair_exhaustively(state: OccurrenceState, event: OccurrenceEvent) -> None:
    _check_pair(state, event)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(OccurrenceState), st.sampled_from(OccurrenceEvent))
def test_every_pair_property(state: OccurrenceState, event: OccurrenceEvent) -> None:
    _check_pair(state, event)


def test_table_has_exactly_the_expected_rows() -> None:
    actual = {(s.value, e.value): _name(t) for (s, e), t in OCCURRENCE_TRANSITIONS.items()}
    assert actual == EXPECTED
    assert len(OCCURRENCE_TRANSITIONS) == 21


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(OccurrenceState),
    st.lists(st.sampled_from(OccurrenceEvent), max_size=30),
)
def test_event_sequences_follow_the_expectation(
    start: OccurrenceState, events: list[OccurrenceEvent]
) -> None:
    """Walk random event sequences; an illegal event leaves the held state untouched."""
    state: OccurrenceState | PurgedType = start
    model = start.value
    for event in events:
        if state is PURGED:
            # Nothing happens to a row that no longer exists: the store never calls
            # transition() with it, and the function rejects it as not a state.
            with pytest.raises(InvalidTransitionError):
                transition(state, event)  # type: ignore[arg-type]
            continue
        assert isinstance(state, OccurrenceState)
        expected = EXPECTED.get((model, event.value))
        if expected is None:
            with pytest.raises(InvalidTransitionError):
                transition(state, event)
            assert state.value == model  # unchanged
        else:
            state = transition(state, event)
            model = expected
            assert _name(state) == model


def test_table_is_read_only() -> None:
    with pytest.raises(TypeError):
        OCCURRENCE_TRANSITIONS[(OccurrenceState.PUBLISHED, OccurrenceEvent.CLAIM)] = (  # type: ignore[index]
            OccurrenceState.LEASED
        )
    with pytest.raises(InvalidTransitionError):
        transition(OccurrenceState.PUBLISHED, OccurrenceEvent.CLAIM)


@pytest.mark.parametrize(
    ("state", "event"),
    [
        ("pending", OccurrenceEvent.CLAIM),
        (OccurrenceState.PENDING, "claim"),
        (None, None),
        ([], OccurrenceEvent.CLAIM),  # unhashable
    ],
)
def test_non_members_are_invalid_transitions(state: object, event: object) -> None:
    with pytest.raises(InvalidTransitionError):
        transition(state, event)  # type: ignore[arg-type]


def test_invalid_transition_is_a_steeple_error_not_a_value_error() -> None:
    with pytest.raises(SteepleError):
        transition(OccurrenceState.PUBLISHED, OccurrenceEvent.PUBLISHED)


def test_terminal_and_claimable_sets() -> None:
    assert {s.value for s in TERMINAL_STATES} == {"published", "dead", "expired", "cancelled"}
    assert {s.value for s in CLAIMABLE_STATES} == {"pending", "retry_wait", "leased"}
    # Terminal states are exactly those a PURGE row leaves from.
    assert {s for s in OccurrenceState if (s.value, "purge") in EXPECTED} == TERMINAL_STATES
    # Claimable states are exactly those with a CLAIM row.
    assert {s for s in OccurrenceState if (s.value, "claim") in EXPECTED} == CLAIMABLE_STATES
    # No automatic event (anything but an operator retry or purge) leaves a terminal state
    # except to expire or cancel a dead letter; an in-flight publication of a cancelled
    # occurrence keeps it cancelled.
    assert transition(OccurrenceState.CANCELLED, OccurrenceEvent.PUBLISHED) is (
        OccurrenceState.CANCELLED
    )
    for state in TERMINAL_STATES - {OccurrenceState.DEAD}:
        for event in OccurrenceEvent:
            if event is OccurrenceEvent.PURGE:
                continue
            if (state, event) == (OccurrenceState.CANCELLED, OccurrenceEvent.PUBLISHED):
                continue
            with pytest.raises(InvalidTransitionError):
                transition(state, event)


def test_purged_sentinel() -> None:
    assert PURGED is PurgedType.PURGED
    assert repr(PURGED) == "PURGED"
    assert not isinstance(PURGED, OccurrenceState)
    assert transition(OccurrenceState.PUBLISHED, OccurrenceEvent.PURGE) is PURGED


def test_no_transition_into_purged_except_by_purge() -> None:
    for (_, event), target in OCCURRENCE_TRANSITIONS.items():
        assert (target is PURGED) == (event is OccurrenceEvent.PURGE)
