"""Operator access to work-queue tasks: the port the admin app and the CLI use.

The work queue's own API (``steeple.postgres.queue``) inspects and cancels single tasks;
operators also need a listing. :class:`TaskAdmin` is the small interface both surfaces use.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Protocol

import attrs

from steeple.core.records import Page

__all__ = ["TaskAdmin", "TaskRecord"]


@attrs.frozen
class TaskRecord:
    """Metadata of one task (never its arguments, never its lease token)."""

    task_id: int
    name: str
    state: str
    attempts: int
    max_attempts: int
    run_at: datetime | None
    created_at: datetime | None
    updated_at: datetime | None = None
    last_error: str | None = None

    def to_json(self) -> dict[str, Any]:
        """Return a JSON-ready dict."""
        return {
            "task_id": self.task_id,
            "name": self.name,
            "state": self.state,
            "attempts": self.attempts,
            "max_attempts": self.max_attempts,
            "run_at": _iso(self.run_at),
            "created_at": _iso(self.created_at),
            "updated_at": _iso(self.updated_at),
            "last_error": self.last_error,
        }


def _iso(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat()


class TaskAdmin(Protocol):
    """Listing, cancelling and pruning tasks for operators."""

    async def tasks(
        self, *, after: str | None = None, limit: int = 100, state: str | None = None
    ) -> Page[TaskRecord]:
        """List tasks after the exclusive cursor, newest id last, optionally by state."""
        ...

    async def task(self, task_id: int) -> TaskRecord | None:
        """Return one task's metadata, or ``None`` if there is no such task."""
        ...

    async def cancel(self, task_id: int) -> str | None:
        """Cancel a pending or running task (idempotent).

        Returns:
            The task's state afterwards (``"cancelled"``, or the terminal state it already
            had), or ``None`` when there is no such task.
        """
        ...

    async def prune(self, older_than: datetime, limit: int = 100) -> int:
        """Delete at most ``limit`` terminal tasks finished before ``older_than``."""
        ...
