"""What the recurring store hands out: leases, metadata records and pages."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Generic, TypeVar

import attrs

from steeple.core.occurrences import OccurrenceState
from steeple.core.policies import MissedRunPolicy

T = TypeVar("T")

__all__ = ["Lease", "OccurrenceInfo", "Page", "ScheduleInfo", "ScheduleState", "TickResult"]


@attrs.frozen(repr=False)
class Lease:
    """A claim on one occurrence, fenced by a random capability and a revision.

    Only ``occurrence_id`` and ``expires_at`` are public; the capability is a secret the
    store checks on every later step and never appears in a repr.
    """

    occurrence_id: str
    expires_at: datetime
    revision: int
    capability: bytes

    def __repr__(self) -> str:
        return (
            f"Lease(occurrence_id={self.occurrence_id!r}, "
            f"expires_at={self.expires_at.isoformat()!r}, revision={self.revision})"
        )


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


@attrs.frozen
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
