"""Operations on tasks: inspect, cancel, prune."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta
from typing import Any, Final

import attrs

from steeple.core.tasks import TaskEvent, TaskState, transition
from steeple.postgres.queue import _driver, _metrics
from steeple.postgres.queue._driver import errors_typed
from steeple.postgres.queue._schema import DEFAULT_SCHEMA
from steeple.postgres.queue._sql import queue_sql
from steeple.postgres.queue._validate import check_int, check_task_id, check_timedelta
from steeple.postgres.queue.errors import TaskNotFoundError

__all__ = ["MAX_RETENTION", "TaskRun", "cancel", "prune_terminal", "run_state"]

MAX_RETENTION: Final = timedelta(days=36_500)
"""The largest ``older_than`` of :func:`prune_terminal` (about 100 years)."""


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
    queue: str = "default"

    @classmethod
    def from_row(cls, row: tuple[Any, ...]) -> TaskRun:
        """Build from a ``run_state`` row."""
        values = list(row)
        values[2] = TaskState(values[2])
        return cls(*values)


@errors_typed
async def run_state(conn: Any, task_id: int, *, schema: str = DEFAULT_SCHEMA) -> TaskRun:
    """Return the current state of task ``task_id``.

    Args:
        conn: an asyncpg connection or pool, or a psycopg ``AsyncConnection``.
        task_id: the task id.
        schema: the queue's PostgreSQL schema.

    Raises:
        TaskNotFoundError: no such task (or it was pruned).
        QueueConfigurationError: ``task_id`` beyond 64 bits, or an invalid schema name.
        QueueTypeError: ``task_id`` is not an int.
    """
    sql = queue_sql(schema)
    rows = await _driver.fetch(conn, sql.run_state, check_task_id(task_id))
    if not rows:
        raise TaskNotFoundError(task_id)
    return TaskRun.from_row(rows[0])


@errors_typed
async def cancel(conn: Any, task_id: int, *, schema: str = DEFAULT_SCHEMA) -> TaskState:
    """Cancel a pending or running task, atomically.

    A running task's lease token is cleared, so its worker can no longer complete, fail or
    renew it; the worker sets the handler's ``ctx.cancelled`` and ``ctx.lease_lost`` at its
    next renewal. A terminal task is left as it is.

    Returns:
        The task's state afterwards (``CANCELLED``, or the terminal state it already had).

    Raises:
        TaskNotFoundError: no such task.
        QueueConfigurationError: ``task_id`` beyond 64 bits, or an invalid schema name.
        QueueTypeError: ``task_id`` is not an int.
    """
    sql = queue_sql(schema)
    rows = await _driver.fetch(conn, sql.cancel, check_task_id(task_id))
    if not rows:
        raise TaskNotFoundError(task_id)
    before, changed = TaskState(rows[0][0]), int(rows[0][1])
    if changed:
        _metrics.instruments().cancelled.add(1)
        return transition(before, TaskEvent.CANCEL)
    return before


@errors_typed
async def prune_terminal(
    conn: Any,
    older_than: timedelta,
    limit: int = 1000,
    *,
    schema: str = DEFAULT_SCHEMA,
) -> int:
    """Delete up to ``limit`` terminal tasks finished more than ``older_than`` ago.

    Their attempt history goes with them (ON DELETE CASCADE). Call repeatedly until it
    returns less than ``limit`` to prune everything eligible in bounded batches.

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
