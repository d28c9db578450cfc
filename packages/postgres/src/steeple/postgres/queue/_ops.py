"""Operations on tasks: inspect, cancel, prune."""

from __future__ import annotations

import json
import uuid
from datetime import datetime, timedelta
from typing import Any, Final

import attrs

from steeple.core.tasks import TaskEvent, TaskState, attempts_outlook, transition
from steeple.postgres.queue import _driver, _metrics
from steeple.postgres.queue._local import local_queue
from steeple.postgres.queue._schema import DEFAULT_SCHEMA, entry_point
from steeple.postgres.queue._sql import queue_sql
from steeple.postgres.queue._validate import (
    DEFAULT_QUEUE,
    check_int,
    check_task_id,
    check_timedelta,
)
from steeple.postgres.queue.errors import TaskNotFoundError

__all__ = [
    "MAX_HISTORY",
    "MAX_RETENTION",
    "Progress",
    "TaskAttempt",
    "TaskRun",
    "cancel",
    "prune_terminal",
    "run_state",
]

MAX_RETENTION: Final = timedelta(days=36_500)
"""The largest ``older_than`` of :func:`prune_terminal` (about 100 years)."""
MAX_HISTORY: Final = 1000
"""The most attempts :func:`run_state` returns (the latest; ``history=`` chooses fewer)."""


def _iso(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat()


@attrs.frozen
class Progress:
    """The latest progress a handler reported with ``ctx.report_progress``.

    Attributes:
        fraction: how much is done, within [0, 1].
        message: what it is doing (at most 200 characters), or ``None``.
    """

    fraction: float
    message: str | None = None

    def to_json(self) -> dict[str, Any]:
        """Return a JSON-ready dict (``message`` only when there is one)."""
        shown: dict[str, Any] = {"fraction": self.fraction}
        if self.message is not None:
            shown["message"] = self.message
        return shown

    @classmethod
    def from_json(cls, text: str | None) -> Progress | None:
        """Build from the stored JSON text (``None`` when nothing was reported)."""
        if text is None:
            return None
        value = json.loads(text)
        message = value.get("message")
        return cls(float(value["fraction"]), message if isinstance(message, str) else None)


@attrs.frozen
class TaskAttempt:
    """One attempt of a task's history, as recorded when it ended.

    Attributes:
        attempt: its number (1-based).
        outcome: ``succeeded``, ``retried``, ``failed``, ``lease_expired`` or ``released``.
        worker_id: the worker that ran it.
        started_at: when it was claimed.
        finished_at: when its outcome was recorded.
        error: ``"Type: message"`` of a failure (``"lease expired"`` for an expiry).
        error_type: the exception's class, module-qualified unless a builtin.
        traceback: the formatted traceback, at most 16 KiB (start and end kept).
    """

    attempt: int
    outcome: str
    worker_id: str | None
    started_at: datetime | None
    finished_at: datetime
    error: str | None = None
    error_type: str | None = None
    traceback: str | None = None

    def to_json(self) -> dict[str, Any]:
        """Return a JSON-ready dict (instants in ISO 8601)."""
        return {
            "attempt": self.attempt,
            "outcome": self.outcome,
            "worker_id": self.worker_id,
            "started_at": _iso(self.started_at),
            "finished_at": _iso(self.finished_at),
            "error": self.error,
            "error_type": self.error_type,
            "traceback": self.traceback,
        }

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> TaskAttempt:
        """Build from one element of the history's JSON."""
        started = value.get("started_at")
        return cls(
            attempt=int(value["attempt"]),
            outcome=str(value["outcome"]),
            worker_id=value.get("worker_id"),
            started_at=None if started is None else datetime.fromisoformat(started),
            finished_at=datetime.fromisoformat(value["finished_at"]),
            error=value.get("error"),
            error_type=value.get("error_type"),
            traceback=value.get("traceback"),
        )


@attrs.frozen
class TaskRun:
    """A task as stored, without its args or lease credentials.

    Attributes:
        id: the task id.
        task_name: the task's name.
        state: pending, running, succeeded, failed or cancelled.
        priority: higher runs first.
        run_at: when it is (or was) due.
        attempts: attempts started so far.
        max_attempts: the snapshotted attempt limit.
        run_id: the stable idempotency key of its side effects.
        worker_id: the worker that last claimed it.
        lease_expires_at: while running, when the lease lapses.
        dedup_key: its dedup key, if any.
        job_id: the recurring job it was materialized from, if any.
        scheduled_for: the recurring due instant, if any.
        created_at: creation time.
        started_at: when the latest attempt started.
        finished_at: when it reached a terminal state.
        last_error: the latest failure's text.
        queue: the named queue it belongs to.
        progress: the latest progress its handler reported, or ``None``.
        result: the JSON value its handler returned (``None``: it returned ``None``, has
            not succeeded, or this came from a listing, which leaves results out).
        history: its attempts, oldest first (the latest ``history`` of them; empty in
            listings, which leave it out).
        limit_key: the key its per-key limits count it under, if any (``None`` in
            listings, which leave it out).
        workflow_id: the workflow it belongs to (its first task's id), if any (``None`` in
            listings, which leave it out).
    """

    id: int
    task_name: str
    state: TaskState
    priority: int
    run_at: datetime
    attempts: int
    max_attempts: int
    run_id: uuid.UUID
    worker_id: str | None
    lease_expires_at: datetime | None
    dedup_key: str | None
    job_id: int | None
    scheduled_for: datetime | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    last_error: str | None
    queue: str = DEFAULT_QUEUE
    progress: Progress | None = None
    result: Any = None
    history: tuple[TaskAttempt, ...] = ()
    limit_key: str | None = None
    workflow_id: int | None = None

    @property
    def attempts_shown(self) -> str:
        """Its attempts as an operator reads them: ``"1/5"`` only while retries can happen.

        ``"1, not retried"`` for a task whose failure was terminal, ``"5/5, attempts
        exhausted"`` for one retried until its attempts ran out (see
        :func:`steeple.core.tasks.attempts_outlook`).
        """
        return attempts_outlook(self.state, self.attempts, self.max_attempts)

    def to_json(self) -> dict[str, Any]:
        """Return a JSON-ready dict of every field (instants in ISO 8601, never args)."""
        return {
            "id": self.id,
            "task_name": self.task_name,
            "state": self.state.value,
            "priority": self.priority,
            "run_at": _iso(self.run_at),
            "attempts": self.attempts,
            "max_attempts": self.max_attempts,
            "run_id": str(self.run_id),
            "worker_id": self.worker_id,
            "lease_expires_at": _iso(self.lease_expires_at),
            "dedup_key": self.dedup_key,
            "job_id": self.job_id,
            "scheduled_for": _iso(self.scheduled_for),
            "created_at": _iso(self.created_at),
            "started_at": _iso(self.started_at),
            "finished_at": _iso(self.finished_at),
            "last_error": self.last_error,
            "queue": self.queue,
            "progress": None if self.progress is None else self.progress.to_json(),
            "result": self.result,
            "history": [a.to_json() for a in self.history],
        }

    @classmethod
    def from_row(cls, row: tuple[Any, ...]) -> TaskRun:
        """Build from a listing row (``RUN_STATE_COLUMNS``) or a ``run_state`` row.

        A ``run_state`` row has those columns, then the result's JSON text, the history's, the
        limit key and the workflow id.
        """
        values = list(row)
        values[2] = TaskState(values[2])
        values[18] = Progress.from_json(values[18])
        if len(values) > 19:
            values[19] = None if values[19] is None else json.loads(values[19])
            values[20] = tuple(TaskAttempt.from_json(a) for a in json.loads(values[20]))
        return cls(*values)


@entry_point
async def run_state(
    conn: Any, task_id: int, *, schema: str = DEFAULT_SCHEMA, history: int = 50
) -> TaskRun:
    """Return the current state of task ``task_id``: its result, progress and attempts too.

    Args:
        conn: an asyncpg connection or pool, or a psycopg ``AsyncConnection``.
        task_id: the task id.
        schema: the queue's PostgreSQL schema.
        history: how many of its latest attempts to return in ``TaskRun.history``
            (0..1000; each failed one carries its error type and traceback).

    Raises:
        TaskNotFoundError: no such task (or it was pruned).
        QueueConfigurationError: ``task_id`` outside 1..2**63-1, ``history`` outside 0..1000,
            or an invalid schema name.
        QueueTypeError: ``task_id`` or ``history`` is not an int.
    """
    sql = queue_sql(schema)
    check_task_id(task_id)
    check_int(history, "history", 0, MAX_HISTORY)
    local = local_queue(conn, schema)
    if local is not None:
        return local.run_state(task_id, history=history)
    rows = await _driver.fetch(conn, sql.run_state, task_id, history)
    if not rows:
        raise TaskNotFoundError(task_id)
    return TaskRun.from_row(rows[0])


@entry_point
async def cancel(conn: Any, task_id: int, *, schema: str = DEFAULT_SCHEMA) -> TaskState:
    """Cancel a pending or running task, atomically.

    A running task's lease token is cleared, so its worker can no longer complete, fail or
    renew it; the worker sets the handler's ``ctx.cancelled`` and ``ctx.lease_lost`` at its
    next renewal. A terminal task is left as it is.

    Returns:
        The task's state afterwards (``CANCELLED``, or the terminal state it already had).

    Raises:
        TaskNotFoundError: no such task.
        QueueConfigurationError: ``task_id`` outside 1..2**63-1, or an invalid schema name.
        QueueTypeError: ``task_id`` is not an int.
    """
    sql = queue_sql(schema)
    local = local_queue(conn, schema)
    if local is not None:
        return local.cancel(check_task_id(task_id))
    rows = await _driver.fetch(conn, sql.cancel, check_task_id(task_id))
    if not rows:
        raise TaskNotFoundError(task_id)
    before, changed = TaskState(rows[0][0]), int(rows[0][1])
    if changed:
        _metrics.instruments().cancelled.add(1)
        return transition(before, TaskEvent.CANCEL)
    return before


@entry_point
async def prune_terminal(
    conn: Any,
    older_than: timedelta,
    limit: int = 1000,
    *,
    schema: str = DEFAULT_SCHEMA,
) -> int:
    """Delete up to ``limit`` terminal tasks finished more than ``older_than`` ago.

    Their attempt history goes with them (ON DELETE CASCADE). A task that a live task of a
    workflow waits on is kept until that dependent finishes (it reads its parents'
    results). Call repeatedly until it returns less than ``limit`` to prune everything
    eligible in bounded batches.

    Returns:
        How many tasks were deleted.

    Raises:
        QueueConfigurationError: ``older_than`` negative or over ~100 years, ``limit``
            outside 1..10000, or an invalid schema name.
        QueueTypeError: ``older_than`` is not a timedelta or ``limit`` not an int.
    """
    check_timedelta(older_than, "older_than", timedelta(0), MAX_RETENTION)
    check_int(limit, "limit", 1, 10_000)
    rows = await _driver.fetch(conn, queue_sql(schema).prune, older_than, limit)
    return int(rows[0][0])
