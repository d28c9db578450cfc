"""Operations on tasks: inspect, cancel, prune."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta
from typing import Any

import attrs

from steeple.core.tasks import TaskEvent, TaskState, transition
from steeple.postgres.queue import _driver, _metrics
from steeple.postgres.queue._schema import DEFAULT_SCHEMA
from steeple.postgres.queue._sql import queue_sql
from steeple.postgres.queue.errors import QueueConfigurationError, TaskNotFoundError

__all__ = ["TaskRun", "cancel", "prune_terminal", "run_state"]


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

    @classmethod
    def from_row(cls, row: tuple[Any, ...]) -> TaskRun:
        """Build from a ``run_state`` row."""
        values = list(row)
        values[2] = TaskState(values[2])
        return cls(*values)


async def run_state(conn: Any, task_id: int, *, schema: str = DEFAULT_SCHEMA) -> TaskRun:
    """Return the current state of task ``task_id``.

    Args:
        conn: an asyncpg connection or pool, or a psycopg ``AsyncConnection``.
        task_id: the task id.
        schema: the queue's PostgreSQL schema.

    Raises:
        TaskNotFoundError: no such task (or it was pruned).
    """
    rows = await _driver.fetch(conn, queue_sql(schema).run_state, task_id)
    if not rows:
        raise TaskNotFoundError(task_id)
    return TaskRun.from_row(rows[0])


async def cancel(conn: Any, task_id: int, *, schema: str = DEFAULT_SCHEMA) -> TaskState:
    """Cancel a pending or running task, atomically.

    A running task's lease token is cleared, so its worker can no longer complete, fail or
    renew it; the worker sets the handler's ``ctx.cancelled`` and ``ctx.lease_lost`` at its
    next renewal. A terminal task is left as it is.

    Returns:
        The task's state afterwards (``CANCELLED``, or the terminal state it already had).

    Raises:
        TaskNotFoundError: no such task.
    """
    rows = await _driver.fetch(conn, queue_sql(schema).cancel, task_id)
    if not rows:
        raise TaskNotFoundError(task_id)
    before, changed = TaskState(rows[0][0]), int(rows[0][1])
    if changed:
        _metrics.instruments().cancelled.add(1)
        return transition(before, TaskEvent.CANCEL)
    return before


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
        QueueConfigurationError: a negative ``older_than`` or ``limit`` outside 1..10000.
    """
    if not isinstance(older_than, timedelta) or older_than < timedelta(0):
        raise QueueConfigurationError("older_than must be a non-negative timedelta")
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= 10_000:
        raise QueueConfigurationError("limit must be an int of 1..10000")
    rows = await _driver.fetch(conn, queue_sql(schema).prune, older_than, limit)
    return int(rows[0][0])
