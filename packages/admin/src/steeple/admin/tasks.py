"""Operator access to the work queue: the port the admin app and the CLI use.

The work queue's own API (``steeple.postgres.queue``) inspects and cancels single tasks;
operators also need listings, attempt history, throughput and the queue's recurring jobs.
:class:`TaskAdmin` is the small interface both surfaces use; the records here are plain
metadata (never a task's args unless asked for with :meth:`TaskAdmin.args`).
"""

from __future__ import annotations

import importlib
from datetime import datetime
from typing import TYPE_CHECKING, Any, Protocol

import attrs

from steeple.core.errors import ConfigurationError
from steeple.core.records import Page
from steeple.core.tasks import MAX_TASK_ID, TaskState, attempts_outlook, parse_task_cursor
from steeple.core.tasks import check_task_id as validate_task_id

if TYPE_CHECKING:
    # The queue's own records: the admin shows them and has no copies of its own.
    from steeple.postgres.queue import TaskAttempt as AttemptRecord
    from steeple.postgres.queue.admin import QueueInfo as QueueRecord
    from steeple.postgres.queue.jobs import JobInfo as JobRecord

__all__ = [
    "MAX_TASK_ID",
    "AttemptRecord",
    "JobRecord",
    "Overview",
    "QueueRecord",
    "TaskAdmin",
    "TaskFilter",
    "TaskRecord",
    "parse_task_cursor",
    "validate_task_id",
    "validate_task_state",
]


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
    priority: int = 0
    started_at: datetime | None = None
    finished_at: datetime | None = None
    worker_id: str | None = None
    run_id: str | None = None
    job_id: int | None = None
    scheduled_for: datetime | None = None
    queue: str = "default"
    progress: float | None = None
    """The latest progress its handler reported, a fraction within [0, 1]."""
    progress_message: str | None = None
    result: Any = None
    """The JSON value its handler returned (``None`` in listings, which leave it out)."""
    limit_key: str | None = None
    """The key its per-key limits count it under (``None`` in listings, which leave it out)."""
    workflow_id: int | None = None
    """The workflow it belongs to, if any (``None`` in listings, which leave it out)."""

    @property
    def attempts_shown(self) -> str:
        """Its attempts as an operator reads them: ``"1/5"`` only while retries can happen.

        ``"1, not retried"`` for a task whose failure was terminal (see
        :func:`steeple.core.tasks.attempts_outlook`).
        """
        try:
            state = TaskState(self.state)
        except ValueError:  # a state this version does not know: the bare counts
            return f"{self.attempts}/{self.max_attempts}"
        return attempts_outlook(state, self.attempts, self.max_attempts)

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
            "priority": self.priority,
            "started_at": _iso(self.started_at),
            "finished_at": _iso(self.finished_at),
            "worker_id": self.worker_id,
            "run_id": self.run_id,
            "job_id": self.job_id,
            "scheduled_for": _iso(self.scheduled_for),
            "queue": self.queue,
            "progress": self.progress,
            "progress_message": self.progress_message,
            "result": self.result,
            "limit_key": self.limit_key,
            "workflow_id": self.workflow_id,
        }


@attrs.frozen
class TaskFilter:
    """Which tasks a listing (or a bulk action) selects; ``None`` fields select all.

    Attributes:
        state: one task state.
        name: one task name.
        since: created at or after this instant (timezone-aware).
        until: created before this instant (timezone-aware).
        queue: one named queue.
        args: JSON text of an object the task's args contain (key and value), e.g.
            ``{"to": "ada@example.com"}``. Args can hold secrets: the admin app allows it
            only for a task name the host opted in to showing args (``reveal_args``).
    """

    state: str | None = None
    name: str | None = None
    since: datetime | None = None
    until: datetime | None = None
    queue: str | None = None
    args: str | None = None


@attrs.frozen
class Overview:
    """Counts per state and tasks finished per minute over the last hour.

    Attributes:
        counts: tasks per state (every state, zeros included).
        ends_at: the end of the throughput window (the database server's clock).
        bucket_seconds: the width of one throughput bucket.
        finished: per terminal state, counts per bucket, oldest first.
        queues: the named queues with live tasks or settings, by name.
        finished_by_queue: per named queue that finished tasks in the window, the count
            per terminal state over the whole window, by queue name.
        bounds: the states whose count is not exact: ``"at_least"`` (counting stopped
            there: "10,000+") or ``"about"`` (an estimate from the table's statistics).
            A large table is never counted in full on each refresh.
    """

    counts: dict[str, int]
    ends_at: datetime
    bucket_seconds: float
    finished: dict[str, tuple[int, ...]]
    queues: tuple[QueueRecord, ...] = ()
    finished_by_queue: dict[str, dict[str, int]] = attrs.field(factory=dict)
    bounds: dict[str, str] = attrs.field(factory=dict)

    def to_json(self) -> dict[str, Any]:
        """Return a JSON-ready dict."""
        return {
            "counts": self.counts,
            "count_bounds": self.bounds,
            "queues": [q.to_json() for q in self.queues],
            "throughput": {
                "ends_at": _iso(self.ends_at),
                "bucket_seconds": self.bucket_seconds,
                "finished": {k: list(v) for k, v in self.finished.items()},
                "by_queue": self.finished_by_queue,
            },
        }


# The queue's records the admin shows under its own names, imported when first asked for:
# importing the queue (and its drivers) would slow every command that never shows one.
_QUEUE_RECORDS = {
    "AttemptRecord": ("steeple.postgres.queue", "TaskAttempt"),
    "QueueRecord": ("steeple.postgres.queue.admin", "QueueInfo"),
    "JobRecord": ("steeple.postgres.queue.jobs", "JobInfo"),
}


def __getattr__(name: str) -> object:
    if name not in _QUEUE_RECORDS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attribute = _QUEUE_RECORDS[name]
    return getattr(importlib.import_module(module), attribute)


def _iso(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat()


class TaskAdmin(Protocol):
    """Listing, cancelling, retrying and pruning tasks, and the queue's recurring jobs."""

    async def tasks(
        self,
        *,
        after: str | None = None,
        limit: int = 100,
        state: str | None = None,
        where: TaskFilter | None = None,
        newest_first: bool = False,
    ) -> Page[TaskRecord]:
        """List tasks after the exclusive cursor by id, optionally filtered.

        The cursor is a task id in decimal (see :func:`parse_task_cursor`); ``state`` and
        ``where.state`` must agree when both are given.

        Raises:
            ConfigurationError: a bad cursor, limit, state, name or instant.
        """
        ...

    async def task(self, task_id: int) -> TaskRecord | None:
        """Return one task (with its result and progress), or ``None`` if there is none."""
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

    async def retry(self, task_id: int) -> TaskRecord | None:
        """Send a failed task back to pending; ``None`` when there is no such task.

        Raises:
            SteepleError: the task is not failed (or a live task holds its dedup key).
        """
        ...

    async def attempts(self, task_id: int) -> list[AttemptRecord]:
        """Return the task's latest finished attempts, newest first (tracebacks included)."""
        ...

    async def args(self, task_id: int) -> str | None:
        """Return the task's args as stored (JSON text), or ``None`` for no such task."""
        ...

    async def overview(self) -> Overview:
        """Return counts per state and per queue, and the last hour's throughput."""
        ...

    async def pause_queue(self, name: str, paused: bool) -> QueueRecord:
        """Pause (``paused=True``) or resume a named queue for every worker."""
        ...

    async def jobs(self, *, after: str | None = None, limit: int = 100) -> Page[JobRecord]:
        """List the queue's recurring jobs by name."""
        ...

    async def create_job(
        self,
        name: str,
        task_name: str,
        cron: str,
        args: Any,
        timezone: str = "UTC",
        queue: str = "default",
    ) -> JobRecord:
        """Create a recurring job whose occurrences run ``task_name`` with ``args`` in ``queue``."""
        ...

    async def change_job(
        self, verb: str, name: str, cron: str | None = None, timezone: str | None = None
    ) -> JobRecord | None:
        """``pause``, ``resume``, ``reschedule`` (to ``cron``/``timezone``) or ``delete``.

        Returns:
            The job afterwards (``None`` once deleted).
        """
        ...
