"""Operator access to the PostgreSQL work queue: :class:`TaskAdmin` over ``steeple.postgres``.

An adapter: the SQL lives in :mod:`steeple.postgres.queue.admin` (listings, counts,
retries, attempts, throughput), :mod:`steeple.postgres.queue` (cancel, prune) and
:mod:`steeple.postgres.queue.jobs` (recurring jobs), which also keep the fencing.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import attrs

from steeple.admin.tasks import (
    Overview,
    TaskFilter,
    TaskRecord,
    validate_task_id,
)
from steeple.core.errors import ConfigurationError
from steeple.core.policies import validate_budget
from steeple.core.records import Page

if TYPE_CHECKING:
    from steeple.admin.tasks import AttemptRecord, JobRecord, QueueRecord
    from steeple.postgres.pooler import Pooler
    from steeple.postgres.queue import TaskRun

__all__ = ["PostgresTaskAdmin", "task_record"]

_JOB_VERBS = ("pause", "resume", "reschedule", "delete")
_HISTORY = 100  # attempts shown on a task's page


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
        priority=run.priority,
        started_at=run.started_at,
        finished_at=run.finished_at,
        worker_id=run.worker_id,
        run_id=str(run.run_id),
        job_id=run.job_id,
        scheduled_for=run.scheduled_for,
        queue=run.queue,
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
    async def open(
        cls, dsn: str, *, schema: str, pooler: Pooler | None = None
    ) -> AsyncIterator[PostgresTaskAdmin]:
        """Open a small pool on ``dsn`` for the duration of the block.

        ``pooler="transaction"``: ``dsn`` leads through a transaction pooler (see
        :mod:`steeple.postgres.pooler`).

        Raises:
            SchemaVersionMismatchError: the queue schema is not installed or not this
                library's version.
            QueueConfigurationError: an invalid schema name.
            OSError: the server cannot be reached (and driver errors).
        """
        import asyncpg

        from steeple.postgres.pooler import asyncpg_options
        from steeple.postgres.queue import check_schema

        pool = await asyncpg.create_pool(
            dsn, min_size=1, max_size=2, timeout=10, **asyncpg_options(pooler)
        )
        try:
            await check_schema(pool, schema)
            yield cls(pool, schema)
        finally:
            await pool.close()

    async def tasks(
        self,
        *,
        after: str | None = None,
        limit: int = 100,
        state: str | None = None,
        where: TaskFilter | None = None,
        newest_first: bool = False,
    ) -> Page[TaskRecord]:
        """List tasks by id after the exclusive cursor (a task id), optionally filtered.

        Raises:
            ConfigurationError: a bad cursor, limit, state, name or instant, or two states
                that disagree.
        """
        from steeple.postgres.queue import admin

        validate_budget(limit, "limit")
        where = where or TaskFilter()
        if state is not None and where.state is not None and state != where.state:
            raise ConfigurationError("give one task state, not two different ones")
        page = await admin.list_tasks(
            self.pool,
            schema=self.schema,
            state=state or where.state,
            task_name=where.name,
            after=after,
            limit=limit,
            created_after=where.since,
            created_before=where.until,
            newest_first=newest_first,
            queue=where.queue,
            args_contain=None if where.args is None else json.loads(where.args),
        )
        return Page(items=[task_record(t) for t in page.items], next_cursor=page.next_cursor)

    async def task(self, task_id: int) -> TaskRecord | None:
        """Return one task with its result and progress (never its args), or ``None``.

        Raises:
            ConfigurationError: not a task id.
        """
        from steeple.postgres import queue

        validate_task_id(task_id)
        try:
            run = await queue.admin.task_detail(self.pool, task_id, schema=self.schema, history=0)
        except queue.TaskNotFoundError:
            return None
        return attrs.evolve(
            task_record(run),
            result=run.result,
            limit_key=run.limit_key,
            workflow_id=run.workflow_id,
        )

    async def workflow(self, task_id: int) -> dict[str, Any] | None:
        """Return the workflow of ``task_id`` as a graph (never args or results), or ``None``.

        ``{"workflow_id": ..., "tasks": [{"id", "name", "state", "after", "waiting_on",
        "on_parent_failure", "last_error"}, ...]}``, tasks in id order.

        Raises:
            ConfigurationError: not a task id.
        """
        from steeple.postgres import queue

        validate_task_id(task_id)
        try:
            state = await queue.workflow_state(self.pool, task_id, schema=self.schema)
        except queue.TaskNotFoundError:
            return None
        return {
            "workflow_id": state.workflow_id,
            "tasks": [
                {
                    "id": t.run.id,
                    "name": t.run.task_name,
                    "state": t.run.state.value,
                    "after": list(t.after),
                    "waiting_on": t.waiting_on,
                    "on_parent_failure": None
                    if t.on_parent_failure is None
                    else t.on_parent_failure.value,
                    "last_error": t.run.last_error,
                }
                for t in state.tasks
            ],
        }

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

    async def attempts(self, task_id: int) -> list[AttemptRecord]:
        """Return the task's latest 100 finished attempts, newest first, tracebacks included.

        Raises:
            ConfigurationError: not a task id.
        """
        from steeple.postgres import queue

        validate_task_id(task_id)
        try:
            run = await queue.admin.task_detail(
                self.pool, task_id, schema=self.schema, history=_HISTORY
            )
        except queue.TaskNotFoundError:
            return []
        return list(reversed(run.history))

    async def args(self, task_id: int) -> str | None:
        """Return the task's args as stored (JSON text), or ``None`` for no such task.

        Raises:
            ConfigurationError: not a task id.
        """
        from steeple.postgres import queue

        validate_task_id(task_id)
        try:
            return await queue.admin.task_args(self.pool, task_id, schema=self.schema)
        except queue.TaskNotFoundError:
            return None

    async def overview(self) -> Overview:
        """Return counts per state and tasks finished per minute over the last hour.

        The counts are bounded (see ``steeple.postgres.queue.admin.count_by_state_bounded``):
        the overview is refreshed every few seconds by every open page, and must not count
        a table of millions each time.
        """
        from steeple.postgres.queue import admin

        # First: a typed error when the queue is not installed.
        bounded = await admin.count_by_state_bounded(self.pool, schema=self.schema)
        seen = await admin.throughput(self.pool, schema=self.schema)
        queues = await admin.list_queues(self.pool, schema=self.schema)
        return Overview(
            counts={state.value: c.n for state, c in bounded.items()},
            bounds={state.value: c.bound for state, c in bounded.items() if c.bound != "exact"},
            ends_at=seen.ends_at,
            bucket_seconds=seen.bucket.total_seconds(),
            finished={state.value: per for state, per in seen.finished.items()},
            queues=tuple(queues),
            finished_by_queue={
                name: {state.value: n for state, n in per.items()}
                for name, per in seen.by_queue.items()
            },
        )

    async def pause_queue(self, name: str, paused: bool) -> QueueRecord:
        """Pause (``paused=True``) or resume a named queue for every worker.

        Raises:
            ConfigurationError: an invalid queue name.
        """
        from steeple.postgres.queue import admin

        change = admin.pause_queue if paused else admin.resume_queue
        return await change(self.pool, name, schema=self.schema)

    async def jobs(self, *, after: str | None = None, limit: int = 100) -> Page[JobRecord]:
        """List the queue's recurring jobs by name (never their args).

        Raises:
            ConfigurationError: a bad cursor or limit.
        """
        from steeple.postgres.queue import admin

        validate_budget(limit, "limit")
        page = await admin.list_jobs(self.pool, schema=self.schema, after=after, limit=limit)
        return Page(items=list(page.items), next_cursor=page.next_cursor)

    async def create_job(
        self,
        name: str,
        task_name: str,
        cron: str,
        args: Any,
        timezone: str = "UTC",
        queue: str = "default",
    ) -> JobRecord:
        """Create a recurring job whose occurrences run ``task_name`` with the JSON ``args``.

        Its runs wait in ``queue``: one the workers that run ``task_name`` serve.

        Raises:
            ConfigurationError: a bad name, task name, cron expression, zone, queue or args.
            JobExistsError: a job of that name exists.
        """
        from steeple.postgres.queue import Task, jobs

        task: Task[Any] = Task(task_name)
        return await jobs.create(
            self.pool,
            name,
            task,
            cron,
            args,
            schema=self.schema,
            timezone=timezone,
            queue=queue,
        )

    async def change_job(
        self, verb: str, name: str, cron: str | None = None, timezone: str | None = None
    ) -> JobRecord | None:
        """Pause, resume, reschedule or delete a job (see :mod:`steeple.postgres.queue.jobs`).

        Returns:
            The job afterwards; ``None`` once deleted.

        Raises:
            ConfigurationError: an unknown verb, a bad name, cron expression or zone.
            JobNotFoundError: no such job.
        """
        from steeple.postgres.queue import jobs

        if verb not in _JOB_VERBS:
            raise ConfigurationError(f"a job change is one of {', '.join(_JOB_VERBS)}")
        if verb == "pause":
            return await jobs.pause(self.pool, name, schema=self.schema)
        if verb == "resume":
            return await jobs.resume(self.pool, name, schema=self.schema)
        if verb == "delete":
            await jobs.delete(self.pool, name, schema=self.schema)
            return None
        if cron is None:
            raise ConfigurationError("reschedule needs a cron expression")
        if timezone is None:
            changed = await jobs.reschedule(self.pool, name, cron, schema=self.schema)
        else:
            changed = await jobs.reschedule(
                self.pool, name, cron, schema=self.schema, timezone=timezone
            )
        return changed
