"""Operator access to the PostgreSQL work queue: :class:`TaskAdmin` over ``steeple.postgres``.

An adapter: the SQL lives in :mod:`steeple.postgres.queue.admin` (listings, counts,
retries) and :mod:`steeple.postgres.queue` (cancel, prune), which also keep the fencing.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import attrs

from steeple.admin.tasks import TaskRecord, validate_task_id
from steeple.core.errors import ConfigurationError
from steeple.core.policies import validate_budget
from steeple.core.records import Page

if TYPE_CHECKING:
    from steeple.postgres.queue import TaskRun

__all__ = ["PostgresTaskAdmin", "task_record"]


def task_record(run: TaskRun) -> TaskRecord:
    """Return the admin's view of a queue task (metadata only)."""
    return TaskRecord(
        task_id=run.id,
        name=run.task_name,
        state=run.state.value,
        attempts=run.attempts,
        max_attempts=run.max_attempts,
        run_at=run.run_at,
        created_at=run.created_at,
        # The latest instant a run records: finished, else started, else created.
        updated_at=run.finished_at or run.started_at or run.created_at,
        last_error=run.last_error,
        progress=None if run.progress is None else run.progress.fraction,
        progress_message=None if run.progress is None else run.progress.message,
    )


@attrs.define
class PostgresTaskAdmin:
    """:class:`~steeple.admin.tasks.TaskAdmin` over an asyncpg pool and a queue schema.

    Listing reads metadata only (never ``args`` or the lease token); cancelling and pruning
    go through :mod:`steeple.postgres.queue`, so fencing stays the queue's job.
    """

    pool: Any
    schema: str

    @classmethod
    @asynccontextmanager
    async def open(cls, dsn: str, *, schema: str) -> AsyncIterator[PostgresTaskAdmin]:
        """Open a small pool on ``dsn`` for the duration of the block.

        Raises:
            SchemaVersionMismatchError: the queue schema is not installed or not this
                library's version.
            QueueConfigurationError: an invalid schema name.
            OSError: the server cannot be reached (and driver errors).
        """
        import asyncpg

        from steeple.postgres.queue import check_schema

        pool = await asyncpg.create_pool(dsn, min_size=1, max_size=2, timeout=10)
        try:
            await check_schema(pool, schema)
            yield cls(pool, schema)
        finally:
            await pool.close()

    async def tasks(
        self, *, after: str | None = None, limit: int = 100, state: str | None = None
    ) -> Page[TaskRecord]:
        """List tasks by id after the exclusive cursor (a task id), optionally by state.

        Raises:
            ConfigurationError: a bad cursor, limit or state.
        """
        from steeple.postgres.queue import admin

        validate_budget(limit, "limit")
        page = await admin.list_tasks(
            self.pool, schema=self.schema, state=state, after=after, limit=limit
        )
        return Page(items=[task_record(t) for t in page.items], next_cursor=page.next_cursor)

    async def task(self, task_id: int) -> TaskRecord | None:
        """Return one task's metadata, or ``None``.

        Raises:
            ConfigurationError: not a task id.
        """
        from steeple.postgres import queue

        validate_task_id(task_id)
        try:
            return task_record(await queue.run_state(self.pool, task_id, schema=self.schema))
        except queue.TaskNotFoundError:
            return None

    async def counts(self) -> dict[str, int]:
        """Return how many tasks are in each state."""
        from steeple.postgres.queue import admin

        counts = await admin.count_by_state(self.pool, schema=self.schema)
        return {state.value: n for state, n in counts.items()}

    async def cancel(self, task_id: int) -> str | None:
        """Cancel a pending or running task, fencing its worker (idempotent).

        Returns:
            The state afterwards, or ``None`` when there is no such task.

        Raises:
            ConfigurationError: not a task id.
        """
        from steeple.postgres import queue

        validate_task_id(task_id)
        try:
            state = await queue.cancel(self.pool, task_id, schema=self.schema)
        except queue.TaskNotFoundError:
            return None
        return str(state.value)

    async def retry(self, task_id: int) -> TaskRecord | None:
        """Send a failed task back to pending (see ``steeple.postgres.queue.admin``).

        Returns:
            The task afterwards, or ``None`` when there is no such task.

        Raises:
            ConfigurationError: not a task id.
            TaskStateError: the task is not failed, or a live task holds its dedup key.
        """
        from steeple.postgres import queue

        validate_task_id(task_id)
        try:
            run = await queue.admin.retry_failed_task(self.pool, task_id, schema=self.schema)
        except queue.TaskNotFoundError:
            return None
        return task_record(run)

    async def prune(self, older_than: datetime, limit: int = 100) -> int:
        """Delete at most ``limit`` terminal tasks finished before ``older_than``.

        The cutoff is turned into an age on this host's clock (the one that computed it);
        the queue then judges the age on the database server's clock.

        Raises:
            ConfigurationError: a naive ``older_than`` or a limit outside 1..100.
        """
        from steeple.postgres import queue

        validate_budget(limit, "limit")
        if not isinstance(older_than, datetime) or older_than.utcoffset() is None:
            raise ConfigurationError("older_than must be a timezone-aware datetime")
        age = max(datetime.now(UTC) - older_than, timedelta(0))
        return int(await queue.prune_terminal(self.pool, age, limit, schema=self.schema))
