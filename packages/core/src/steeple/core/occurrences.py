"""The occurrence lifecycle (states; the transition table is added below)."""

from __future__ import annotations

import enum

__all__ = ["OccurrenceState"]


class OccurrenceState(enum.Enum):
    """Where a materialized occurrence is in its life."""

    PENDING = "pending"
    LEASED = "leased"
    RETRY_WAIT = "retry_wait"
    PUBLISHED = "published"
    DEAD = "dead"
    EXPIRED = "expired"
    CANCELLED = "cancelled"
