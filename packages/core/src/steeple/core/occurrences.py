"""The occurrence lifecycle: states, events, and ONE transition table with a pure ``transition()``.

Every legal move of a materialized occurrence is a row of :data:`OCCURRENCE_TRANSITIONS`,
keyed by ``(state, event)`` (h11's ``_state.py`` style). Anything not in the table raises
:class:`~steeple.core.errors.InvalidTransitionError` and changes nothing: stores look the
next state up here instead of spreading the rules through ``if`` statements.

A cancellation after the relay's final lease check cannot recall an in-flight
publication: when ``PUBLISHED`` arrives for a cancelled occurrence the store keeps it
cancelled and reports the receipt. That is the store's rule, not a table row, because the
table answers "what is the next state", and cancelled has no ``PUBLISHED`` successor.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from types import MappingProxyType
from typing import Final, Literal

from steeple.core._validate import TypedEnumType
from steeple.core.errors import InvalidTransitionError

__all__ = [
    "CLAIMABLE_STATES",
    "OCCURRENCE_TRANSITIONS",
    "PURGED",
    "TERMINAL_STATES",
    "OccurrenceEvent",
    "OccurrenceState",
    "PurgedType",
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

_S = OccurrenceState
_E = OccurrenceEvent

OCCURRENCE_TRANSITIONS: Final[
    Mapping[tuple[OccurrenceState, OccurrenceEvent], OccurrenceState | Literal[PurgedType.PURGED]]
] = MappingProxyType(
    {
        (_S.PENDING, _E.CLAIM): _S.LEASED,
        (_S.PENDING, _E.WINDOW_EXPIRED): _S.EXPIRED,
        (_S.PENDING, _E.CANCEL): _S.CANCELLED,
        (_S.LEASED, _E.PUBLISHED): _S.PUBLISHED,
        (_S.LEASED, _E.PUBLISH_FAILED_RETRYABLE): _S.RETRY_WAIT,
        (_S.LEASED, _E.PUBLISH_FAILED_FINAL): _S.DEAD,
        (_S.LEASED, _E.LEASE_EXPIRED): _S.PENDING,
        # Re-claim of an expired lease: the new capability and revision fence the old holder.
        (_S.LEASED, _E.CLAIM): _S.LEASED,
        (_S.LEASED, _E.WINDOW_EXPIRED): _S.EXPIRED,
        (_S.LEASED, _E.CANCEL): _S.CANCELLED,
        (_S.RETRY_WAIT, _E.CLAIM): _S.LEASED,
        (_S.RETRY_WAIT, _E.WINDOW_EXPIRED): _S.EXPIRED,
        (_S.RETRY_WAIT, _E.CANCEL): _S.CANCELLED,
        (_S.DEAD, _E.OPERATOR_RETRY): _S.PENDING,
        (_S.DEAD, _E.WINDOW_EXPIRED): _S.EXPIRED,
        (_S.DEAD, _E.CANCEL): _S.CANCELLED,
        (_S.DEAD, _E.PURGE): PURGED,
        (_S.PUBLISHED, _E.PURGE): PURGED,
        (_S.EXPIRED, _E.PURGE): PURGED,
        (_S.CANCELLED, _E.PURGE): PURGED,
    }
)
"""The whole occurrence lifecycle: ``(state, event) -> next state`` (or :data:`PURGED`)."""

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
    # Only members are looked up: hashing a foreign object could fail in any way.
    if isinstance(state, OccurrenceState) and isinstance(event, OccurrenceEvent):
        found = OCCURRENCE_TRANSITIONS.get((state, event))
        if found is not None:
            return found
    raise InvalidTransitionError("occurrence", state, event)
