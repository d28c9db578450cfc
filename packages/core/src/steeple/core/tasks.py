"""The work-queue task lifecycle (states; the transition table is added below)."""

from __future__ import annotations

import enum

__all__ = ["TaskState"]


class TaskState(enum.Enum):
    """Where a queued task is in its life."""

    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
