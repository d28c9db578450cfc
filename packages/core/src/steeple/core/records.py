"""What the recurring store hands out: leases, metadata records and pages."""

from __future__ import annotations

import re
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, Final, Generic, TypeVar

import attrs

from steeple.core._frozen import new, writable
from steeple.core._validate import INT64_MAX, aware_utc, bounded_int, byte_string
from steeple.core.calendar import FIRST_INSTANT, LAST_INSTANT
from steeple.core.errors import (
    ConfigurationError,
    ConfigurationTypeError,
    RecurringConfigurationError,
    SteepleError,
)
from steeple.core.messages import BrokerReceipt
from steeple.core.occurrences import OccurrenceState
from steeple.core.policies import MissedRunPolicy

T = TypeVar("T")

__all__ = [
    "Lease",
    "OccurrenceInfo",
    "Page",
    "RelayOutcome",
    "ScheduleInfo",
    "ScheduleState",
    "TickResult",
    "occurrence_cursor",
    "parse_occurrence_cursor",
    "trusted_lease",
    "trusted_outcome",
    "validate_occurrence_id",
]


_MAX_OCCURRENCE_ID_LENGTH = 128
_MAX_CAPABILITY_BYTES = 1024


def _is_token(value: str) -> bool:
    """Whether ``value`` is printable ASCII without spaces ("!" to "~")."""
    # str methods run in C: this is checked on every lease a relay handles.
    return value.isascii() and value.isprintable() and " " not in value


def _check_occurrence_id(_: object, __: object, value: Any) -> None:
    if not isinstance(value, str):
        raise ConfigurationTypeError(f"occurrence_id must be a str, not {type(value).__name__}")
    # Stores hand out 32 hex characters; anything outside printable ASCII is no id of theirs
    # and would only fail later, inside a driver.
    if not 1 <= len(value) <= _MAX_OCCURRENCE_ID_LENGTH or not _is_token(value):
        raise ConfigurationError(
            f"occurrence_id must be 1-{_MAX_OCCURRENCE_ID_LENGTH} printable ASCII characters"
        )


def _check_expires_at(_: object, __: object, value: Any) -> None:
    aware_utc(value, "expires_at")


def _check_revision(_: object, __: object, value: Any) -> None:
    bounded_int(value, "revision", 0, INT64_MAX, ConfigurationError)


def _capability(value: object) -> bytes:
    return byte_string(value, "capability", max_len=_MAX_CAPABILITY_BYTES)


@attrs.frozen(repr=False, weakref_slot=False)
class Lease:
    """A claim on one occurrence, fenced by a random capability and a revision.

    Only ``occurrence_id`` and ``expires_at`` are public; the capability is a secret the
    store checks on every later step and never appears in a repr.

    Raises:
        ConfigurationTypeError: a field of the wrong type (a ``TypeError`` too).
        ConfigurationError: an occurrence id that is not 1-128 printable ASCII characters,
            a naive ``expires_at``, a revision outside 0..2**63-1, or a capability over
            1024 bytes.
    """

    occurrence_id: str = attrs.field(validator=_check_occurrence_id)
    expires_at: datetime = attrs.field(validator=_check_expires_at)
    revision: int = attrs.field(validator=_check_revision)
    capability: bytes = attrs.field(converter=_capability)

    def __repr__(self) -> str:
        return (
            f"Lease(occurrence_id={self.occurrence_id!r}, "
            f"expires_at={self.expires_at.isoformat()!r}, revision={self.revision})"
        )


def trusted_lease(
    occurrence_id: str, expires_at: datetime, revision: int, capability: bytes
) -> Lease:
    """Build a :class:`Lease` from values a store produced itself, without checking them.

    For the engine only: the id is one it issued, the expiry an aware instant it
    computed, the revision a stored counter plus one, the capability fresh random bytes.
    Everything a caller hands in goes through ``Lease(...)``, which checks every field;
    a test requires both to build equal leases from the same values.
    """
    # Filled in as a plain object, then made a Lease (steeple.core._frozen).
    lease: Any = new(_WRITABLE_LEASE)
    lease.occurrence_id = occurrence_id
    lease.expires_at = expires_at
    lease.revision = revision
    lease.capability = capability
    lease.__class__ = Lease
    return lease  # type: ignore[no-any-return]  # a Lease, every field set


_WRITABLE_LEASE: Final = writable(Lease)


class ScheduleState:
    """Values of :attr:`ScheduleInfo.state`."""

    ACTIVE = "active"
    CANCELLED = "cancelled"
    EXHAUSTED = "exhausted"


@attrs.frozen
class ScheduleInfo:
    """Metadata of a recurring definition (no payload, no headers)."""

    name: str
    cron: str
    policy: MissedRunPolicy
    first_after: datetime
    topic: str
    message_type: str
    state: str
    next_due_at: datetime | None
    created_at: datetime
    cancelled_at: datetime | None = None


@attrs.frozen(weakref_slot=False)
class OccurrenceInfo:
    """Metadata of one occurrence (never the payload, never lease credentials)."""

    occurrence_id: str
    definition_name: str
    due_at: datetime
    state: OccurrenceState
    attempts: int
    window_ends_at: datetime
    created_at: datetime
    next_attempt_at: datetime | None = None
    last_error: str | None = None


@attrs.frozen
class Page(Generic[T]):
    """One page of a listing; ``next_cursor`` is exclusive and ``None`` on the last page."""

    items: Sequence[T]
    next_cursor: str | None


@attrs.frozen
class TickResult:
    """What one tick materialized."""

    materialized: int
    occurrence_ids: Sequence[str] = ()
    exhausted: Sequence[str] = ()


@attrs.frozen(repr=False, weakref_slot=False)
class RelayOutcome:
    """What relaying one lease came to (one per lease of a batched relay, in order).

    Exactly one of ``receipt`` and ``error`` is set.

    Raises:
        ConfigurationError: neither or both are set, they have the wrong types, or the
            occurrence id is not 1-128 printable ASCII characters.

    Attributes:
        occurrence_id: the lease's occurrence (as the lease named it).
        receipt: the broker's receipt when the publication was accepted and recorded (or
            accepted while its definition was cancelled: the occurrence stays cancelled).
        error: otherwise, the typed error a single ``relay`` of this lease raises: a
            :class:`~steeple.core.errors.RecurringRelayError` (lease lost, broker failure
            or timeout, uncertain acknowledgement carrying the receipt), a
            :class:`~steeple.core.errors.RecurringKeyringError` (content that cannot be
            opened), or the storage error that kept a failure from being recorded.
    """

    occurrence_id: str = attrs.field(validator=_check_occurrence_id)
    receipt: BrokerReceipt | None = None
    error: SteepleError | None = None

    def __attrs_post_init__(self) -> None:
        if (self.receipt is None) == (self.error is None):
            raise ConfigurationError("a RelayOutcome holds either a receipt or an error")
        if self.receipt is not None and not isinstance(self.receipt, BrokerReceipt):
            raise ConfigurationTypeError("receipt must be a BrokerReceipt")
        if self.error is not None and not isinstance(self.error, SteepleError):
            raise ConfigurationTypeError("error must be a SteepleError")

    @property
    def ok(self) -> bool:
        """Whether the broker accepted the message and the store recorded it."""
        return self.error is None

    def result(self) -> BrokerReceipt:
        """Return the receipt, or raise the error (what a single ``relay`` does).

        Raises:
            SteepleError: ``error``, as it is (with its ``__cause__``).
        """
        if self.error is not None:
            raise self.error
        return self.receipt  # type: ignore[return-value]  # set when error is not

    def __repr__(self) -> str:
        what = "ok" if self.error is None else type(self.error).__name__
        return f"RelayOutcome(occurrence_id={self.occurrence_id!r}, {what})"


# --- identities and cursors a boundary can check before anything reaches storage -------------


def trusted_outcome(
    occurrence_id: str,
    receipt: BrokerReceipt | None = None,
    error: SteepleError | None = None,
) -> RelayOutcome:
    """Build a :class:`RelayOutcome` from values the engine holds, without checking them.

    For the engine only: the id comes from a checked :class:`Lease`, the receipt passed
    the engine's own type check, exactly one of ``receipt`` and ``error`` is set. A
    caller's values go through ``RelayOutcome(...)``; a test requires both to build equal
    outcomes.
    """
    # Filled in as a plain object, then made a RelayOutcome (steeple.core._frozen).
    outcome: Any = new(_WRITABLE_OUTCOME)
    outcome.occurrence_id = occurrence_id
    outcome.receipt = receipt
    outcome.error = error
    outcome.__class__ = RelayOutcome
    return outcome  # type: ignore[no-any-return]  # a RelayOutcome, every field set


_WRITABLE_OUTCOME: Final = writable(RelayOutcome)


_OCCURRENCE_ID: Final = re.compile(r"[0-9a-f]{32}\Z")
_OCCURRENCE_CURSOR: Final = re.compile(r"([0-9]{15})\.([0-9a-f]{32})\Z")
_MS: Final = timedelta(milliseconds=1)
_LAST_MS: Final = (LAST_INSTANT - FIRST_INSTANT) // _MS


def validate_occurrence_id(value: object) -> str:
    """Return ``value`` if it has the shape of an occurrence id: 32 lowercase hex characters.

    (Ids come from :func:`steeple.core.leases.occurrence_id_for`.) A well-formed id may still
    name no occurrence; a malformed one is refused before it reaches storage.

    Raises:
        RecurringConfigurationError: not a str of 32 lowercase hex characters.
    """
    if not isinstance(value, str):
        raise RecurringConfigurationError(f"an occurrence id is a str, not {type(value).__name__}")
    if not _OCCURRENCE_ID.match(value):
        raise RecurringConfigurationError("an occurrence id is 32 lowercase hex characters")
    return value


def occurrence_cursor(due_at: datetime, occurrence_id: str) -> str:
    """Return the exclusive occurrences-listing cursor after the occurrence ``(due_at, id)``.

    Raises:
        RecurringConfigurationError: ``due_at`` is naive or outside the calendar's years
            (1970-2100), or ``occurrence_id`` is malformed.
    """
    if not isinstance(due_at, datetime) or due_at.utcoffset() is None:
        raise RecurringConfigurationError("a cursor's due time is a timezone-aware datetime")
    ms = (due_at.astimezone(UTC) - FIRST_INSTANT) // _MS
    if not 0 <= ms <= _LAST_MS:
        raise RecurringConfigurationError("a cursor's due time lies in 1970-2100")
    return f"{ms:015d}.{validate_occurrence_id(occurrence_id)}"


def parse_occurrence_cursor(cursor: object) -> tuple[datetime, str]:
    """Return the ``(due_at, occurrence_id)`` position of an occurrences-listing cursor.

    Only what :func:`occurrence_cursor` returns is accepted: 15 ASCII digits of epoch
    milliseconds within 1970-2100, a dot, and an occurrence id.

    Raises:
        RecurringConfigurationError: anything else (wrong type, shape, digits or range).
    """
    match = _OCCURRENCE_CURSOR.match(cursor) if isinstance(cursor, str) else None
    if match is None or int(match.group(1)) > _LAST_MS:
        raise RecurringConfigurationError(
            "invalid occurrences cursor: pass back a next_cursor this store returned"
        )
    return FIRST_INSTANT + int(match.group(1)) * _MS, match.group(2)
