"""The occurrence lifecycle: states, events, and ONE transition table with a pure ``transition()``.

Every legal move of a materialized occurrence is a row of :data:`OCCURRENCE_STEPS`,
keyed by ``(state, event)`` (h2's ``stream.py`` style: ``(state, event) -> (next state,
effects)``). Anything not in the table raises
:class:`~steeple.core.errors.InvalidTransitionError` and changes nothing: the engine looks
the next state and what it erases up here instead of spreading the rules through ``if``
statements. :data:`OCCURRENCE_TRANSITIONS` is the same table without the effects.

A cancellation after the relay's final lease check cannot recall an in-flight
publication: ``PUBLISHED`` arriving for a cancelled occurrence is the row
``(cancelled, published) -> cancelled``, whose only effect is to spend the lease (the
relay reports the broker's receipt). Cancellation and window expiry keep the lease
credentials precisely so that the in-flight holder can still prove it held the lease and
learn what happened.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Mapping
from types import MappingProxyType
from typing import Final, Literal

import attrs

from steeple.core._validate import TypedEnumType
from steeple.core.errors import InvalidTransitionError

__all__ = [
    "CLAIMABLE_STATES",
    "OCCURRENCE_STEPS",
    "OCCURRENCE_TRANSITIONS",
    "PURGED",
    "TERMINAL_STATES",
    "Effects",
    "OccurrenceEvent",
    "OccurrenceState",
    "PurgedType",
    "Step",
    "states_for",
    "step",
    "transition",
]


class OccurrenceState(enum.Enum, metaclass=TypedEnumType):
    """Where a materialized occurrence is in its life."""

    PENDING = "pending"
    LEASED = "leased"
    RETRY_WAIT = "retry_wait"
    PUBLISHED = "published"
    DEAD = "dead"
    EXPIRED = "expired"
    CANCELLED = "cancelled"


class OccurrenceEvent(enum.Enum, metaclass=TypedEnumType):
    """What can happen to an occurrence (inputs of the state table)."""

    CLAIM = "claim"
    """A relay worker leased it (fencing any earlier holder of an expired lease)."""
    PUBLISHED = "published"
    """The broker accepted the publication and the store recorded it."""
    PUBLISH_FAILED_RETRYABLE = "publish_failed_retryable"
    """Publication failed; another automatic attempt is allowed later."""
    PUBLISH_FAILED_FINAL = "publish_failed_final"
    """Publication failed for good (permanent error, attempts used up, or window ending)."""
    LEASE_EXPIRED = "lease_expired"
    """The lease lapsed without an outcome; the occurrence is publishable again."""
    WINDOW_EXPIRED = "window_expired"
    """The delivery window closed before publication."""
    CANCEL = "cancel"
    """The definition was cancelled."""
    OPERATOR_RETRY = "operator_retry"
    """An operator gave a dead occurrence a fresh attempt budget (``retry_failed``)."""
    PURGE = "purge"
    """``purge_terminal`` removed the row."""


class PurgedType(enum.Enum, metaclass=TypedEnumType):
    """The type of :data:`PURGED` (an enum so that ``Literal[PURGED]`` type-checks)."""

    PURGED = "purged"

    def __repr__(self) -> str:
        return "PURGED"


PURGED: Final = PurgedType.PURGED
"""The "state" after :attr:`OccurrenceEvent.PURGE`: the row is gone."""


@attrs.frozen
class Effects:
    """What a transition does to an occurrence besides changing its state.

    Attributes:
        erase_content: the sealed content and its key id are deleted (publication,
            cancellation, expiry). A dead letter keeps its content for an operator retry.
        erase_lease: the lease credentials (capability digest) are deleted: the lease is
            spent. Cancellation and expiry keep them so that an in-flight relay can still
            prove it held the lease and learn the outcome.
        finishes: the occurrence became terminal: ``finished_at`` is stamped.
        reopens: an operator revived it: ``finished_at`` is cleared, the attempt count
            reset to zero and the last error cleared.
        clears_error: the last error is cleared.
        stamps: ``updated_at`` (and ``finished_at`` when it finishes) are set to the
            instant of the transition. Only the in-flight publication of a cancelled
            occurrence does not stamp: it stays cancelled as of its cancellation.
    """

    erase_content: bool = False
    erase_lease: bool = False
    finishes: bool = False
    reopens: bool = False
    clears_error: bool = False
    stamps: bool = True


@attrs.frozen
class Step:
    """One row of the table: the next state and what the move erases or resets.

    Attributes:
        target: the next state (or :data:`PURGED`: the row is removed).
        effects: what else changes.
    """

    target: OccurrenceState | Literal[PurgedType.PURGED]
    effects: Effects = Effects()
    # Derived from the target when the row is built (every change reads them: plain
    # attributes, not properties).
    ends_lease: bool = attrs.field(init=False, eq=False, repr=False)
    """The lease expiry is cleared: no live lease outside ``leased``."""
    clears_next_attempt: bool = attrs.field(init=False, eq=False, repr=False)
    """The next automatic attempt is cleared: only ``retry_wait`` waits for one."""

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "ends_lease", self.target is not OccurrenceState.LEASED)
        object.__setattr__(
            self, "clears_next_attempt", self.target is not OccurrenceState.RETRY_WAIT
        )


_S = OccurrenceState
_E = OccurrenceEvent

_CLOSE = Effects(erase_content=True, finishes=True)
"""Expiry and cancellation: content erased, terminal; the lease credentials stay."""
_SPEND = Effects(erase_lease=True)
_PURGE = Step(PURGED)

OCCURRENCE_STEPS: Final[Mapping[tuple[OccurrenceState, OccurrenceEvent], Step]] = MappingProxyType(
    {
        (_S.PENDING, _E.CLAIM): Step(_S.LEASED),
        (_S.PENDING, _E.WINDOW_EXPIRED): Step(_S.EXPIRED, _CLOSE),
        (_S.PENDING, _E.CANCEL): Step(_S.CANCELLED, _CLOSE),
        (_S.LEASED, _E.PUBLISHED): Step(
            _S.PUBLISHED,
            Effects(erase_content=True, erase_lease=True, finishes=True, clears_error=True),
        ),
        (_S.LEASED, _E.PUBLISH_FAILED_RETRYABLE): Step(_S.RETRY_WAIT, _SPEND),
        (_S.LEASED, _E.PUBLISH_FAILED_FINAL): Step(
            _S.DEAD, Effects(erase_lease=True, finishes=True)
        ),
        (_S.LEASED, _E.LEASE_EXPIRED): Step(_S.PENDING, _SPEND),
        # Re-claim of an expired lease: the new capability and revision fence the old holder.
        (_S.LEASED, _E.CLAIM): Step(_S.LEASED),
        (_S.LEASED, _E.WINDOW_EXPIRED): Step(_S.EXPIRED, _CLOSE),
        (_S.LEASED, _E.CANCEL): Step(_S.CANCELLED, _CLOSE),
        (_S.RETRY_WAIT, _E.CLAIM): Step(_S.LEASED),
        (_S.RETRY_WAIT, _E.WINDOW_EXPIRED): Step(_S.EXPIRED, _CLOSE),
        (_S.RETRY_WAIT, _E.CANCEL): Step(_S.CANCELLED, _CLOSE),
        (_S.DEAD, _E.OPERATOR_RETRY): Step(
            _S.PENDING, Effects(erase_lease=True, reopens=True, clears_error=True)
        ),
        (_S.DEAD, _E.WINDOW_EXPIRED): Step(_S.EXPIRED, _CLOSE),
        (_S.DEAD, _E.CANCEL): Step(_S.CANCELLED, _CLOSE),
        (_S.DEAD, _E.PURGE): _PURGE,
        (_S.PUBLISHED, _E.PURGE): _PURGE,
        (_S.EXPIRED, _E.PURGE): _PURGE,
        # Cancelled after the relay's final check: the publication cannot be recalled. It
        # stays cancelled (as of its cancellation) and the lease is spent.
        (_S.CANCELLED, _E.PUBLISHED): Step(_S.CANCELLED, Effects(erase_lease=True, stamps=False)),
        (_S.CANCELLED, _E.PURGE): _PURGE,
    }
)
"""The whole occurrence lifecycle: ``(state, event) -> Step(next state, effects)``."""

_STEPS_BY_VALUE: Final[dict[tuple[str, str], Step]] = {
    (state._value_, event._value_): row for (state, event), row in OCCURRENCE_STEPS.items()
}
# The same table keyed by the members' values: a str hashes in C, an enum member in
# Python, and every write of every occurrence looks its step up.

OCCURRENCE_TRANSITIONS: Final[
    Mapping[tuple[OccurrenceState, OccurrenceEvent], OccurrenceState | Literal[PurgedType.PURGED]]
] = MappingProxyType({pair: row.target for pair, row in OCCURRENCE_STEPS.items()})
"""The lifecycle without effects: ``(state, event) -> next state`` (or :data:`PURGED`)."""

TERMINAL_STATES: Final[frozenset[OccurrenceState]] = frozenset(
    {_S.PUBLISHED, _S.DEAD, _S.EXPIRED, _S.CANCELLED}
)
"""States no automatic step leaves; ``purge_terminal`` may remove them (dead may also be
revived by an operator retry within its window)."""

CLAIMABLE_STATES: Final[frozenset[OccurrenceState]] = frozenset(
    {_S.PENDING, _S.RETRY_WAIT, _S.LEASED}
)
"""States a claim may lease from: pending, retry_wait (once its next attempt is due) and
leased (only when the current lease has expired)."""


def transition(
    state: OccurrenceState, event: OccurrenceEvent
) -> OccurrenceState | Literal[PurgedType.PURGED]:
    """Return the state that ``event`` moves an occurrence in ``state`` to.

    Pure: it only reads the table.

    Raises:
        InvalidTransitionError: ``(state, event)`` is not in the table (including values
            that are not an :class:`OccurrenceState` / :class:`OccurrenceEvent`).
    """
    return step(state, event).target


def step(state: OccurrenceState, event: OccurrenceEvent) -> Step:
    """Return the table row for ``event`` in ``state``: the next state and its effects.

    Pure: it only reads the table.

    Raises:
        InvalidTransitionError: ``(state, event)`` is not in the table (including values
            that are not an :class:`OccurrenceState` / :class:`OccurrenceEvent`).
    """
    # Only members are looked up: hashing a foreign object could fail in any way.
    if isinstance(state, OccurrenceState) and isinstance(event, OccurrenceEvent):
        found = _STEPS_BY_VALUE.get((state._value_, event._value_))
        if found is not None:
            return found
    raise InvalidTransitionError("occurrence", state, event)


def states_for(event: OccurrenceEvent) -> dict[Step, frozenset[OccurrenceState]]:
    """Return the states ``event`` is legal in, grouped by the step it takes from them.

    Set-based writes (expire every window-ended occurrence, cancel a definition's work)
    apply one step to many rows; this says which states each step applies to.
    """
    if type(event) is OccurrenceEvent:
        # The table is fixed: grouped once per event (every claim and listing asks), and
        # each caller gets its own dict.
        return dict(_grouped(event))
    return _group(event)


def _group(event: object) -> dict[Step, frozenset[OccurrenceState]]:
    groups: dict[Step, set[OccurrenceState]] = {}
    for (state, ev), row in OCCURRENCE_STEPS.items():
        if ev is event:
            groups.setdefault(row, set()).add(state)
    return {row: frozenset(states) for row, states in groups.items()}


_grouped = functools.cache(_group)
