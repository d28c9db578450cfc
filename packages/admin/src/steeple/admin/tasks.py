"""Operator access to work-queue tasks: the port the admin app and the CLI use.

The work queue's own API (``steeple.postgres.queue``) inspects and cancels single tasks;
operators also need a listing. :class:`TaskAdmin` is the small interface both surfaces use.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Any, Final, Protocol

import attrs

from steeple.core.errors import ConfigurationError
from steeple.core.records import Page
from steeple.core.tasks import TaskState

__all__ = [
    "MAX_TASK_ID",
    "TaskAdmin",
    "TaskRecord",
    "parse_task_cursor",
    "validate_task_id",
    "validate_task_state",
]

MAX_TASK_ID: Final = 2**63 - 1
"""Task ids are PostgreSQL bigints: 1 .. 2**63 - 1."""
_DIGITS: Final = re.compile(r"[0-9]{1,19}\Z")


def validate_task_id(value: object) -> int:
    """Return ``value`` if it is a task id: an int (not a bool) in 1 .. :data:`MAX_TASK_ID`.

    Raises:
        ConfigurationError: anything else.
    """
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_TASK_ID:
        raise ConfigurationError(f"a task id is a whole number from 1 to {MAX_TASK_ID}")
    return value


def parse_task_cursor(after: object) -> int:
    """Return the task id a listing cursor names (``0``, before every task, for ``None``).

    A task listing's cursor is the decimal id of the last task on the previous page.

    Raises:
        ConfigurationError: not ``None`` or 1-19 ASCII digits up to :data:`MAX_TASK_ID`.
    """
    if after is None:
        return 0
    if not isinstance(after, str) or not _DIGITS.match(after) or int(after) > MAX_TASK_ID:
        raise ConfigurationError("the cursor of a task listing is a task id")
    return int(after)


def validate_task_state(value: object) -> str:
    """Return ``value`` if it names a task state (``pending``, ``running``, ...).

    Raises:
        ConfigurationError: anything else.
    """
    states = sorted(s.value for s in TaskState)
    if not isinstance(value, str) or value not in states:
        raise ConfigurationError(f"a task state is one of {', '.join(states)}")
    return value


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
    progress: float | None = None
    """The latest progress its handler reported, a fraction within [0, 1]."""
    progress_message: str | None = None

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
            "progress": self.progress,
            "progress_message": self.progress_message,
        }


def _iso(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat()


class TaskAdmin(Protocol):
    """Listing, cancelling and pruning tasks for operators."""

    async def tasks(
        self, *, after: str | None = None, limit: int = 100, state: str | None = None
    ) -> Page[TaskRecord]:
        """List tasks after the exclusive cursor, newest id last, optionally by state.

        The cursor is a task id in decimal (see :func:`parse_task_cursor`).

        Raises:
            ConfigurationError: a bad cursor, limit or state.
        """
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
