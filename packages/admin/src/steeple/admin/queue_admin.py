"""Operator access to the PostgreSQL work queue (listing, cancelling, pruning tasks)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import datetime, timedelta
from typing import Any

import attrs

from steeple.admin.tasks import (
    TaskRecord,
    parse_task_cursor,
    validate_task_id,
    validate_task_state,
)
from steeple.core.errors import ConfigurationError
from steeple.core.policies import validate_budget
from steeple.core.records import Page

__all__ = ["PostgresTaskAdmin"]

_COLUMNS = (
    "id, task_name, state, attempts, max_attempts, run_at, created_at, updated_at, last_error"
)


def _record(row: Any) -> TaskRecord:
    return TaskRecord(
        task_id=int(row["id"]),
        name=str(row["task_name"]),
        state=str(row["state"]),
        attempts=int(row["attempts"]),
        max_attempts=int(row["max_attempts"]),
        run_at=row["run_at"],
        created_at=row["created_at"],
        updated_at=row["updated_at"],
        last_error=row["last_error"],
    )


@attrs.define
class PostgresTaskAdmin:
    """:class:`~steeple.admin.tasks.TaskAdmin` over an asyncpg pool and a queue schema.

    Listing reads metadata columns only (never ``args`` or the lease token); cancelling and
    pruning go through :mod:`steeple.postgres.queue`, so fencing stays the queue's job.

    Raises:
        ConfigurationError: an invalid schema name.
    """

    pool: Any
    schema: str
    _quoted: str = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        from steeple.postgres.queue._schema import validate_schema

        self._quoted = validate_schema(self.schema)

    @classmethod
    @asynccontextmanager
    async def open(cls, dsn: str, *, schema: str) -> AsyncIterator[PostgresTaskAdmin]:
        """Open a small pool on ``dsn`` for the duration of the block.

        Raises:
            OSError: the server cannot be reached (and driver errors).
        """
        import asyncpg

        pool = await asyncpg.create_pool(dsn, min_size=1, max_size=2, timeout=10)
        try:
            admin = cls(pool, schema)
            from steeple.postgres.queue import check_schema

            await check_schema(pool, schema)
            yield admin
        finally:
            await pool.close()

    async def _fetch(self, sql: str, *args: Any) -> list[Any]:
        import asyncpg

        from steeple.postgres.queue import LIBRARY_SCHEMA_VERSION, SchemaVersionMismatchError

        try:
            return list(await self.pool.fetch(sql, *args))
        except (asyncpg.UndefinedTableError, asyncpg.InvalidSchemaNameError):
            raise SchemaVersionMismatchError(self.schema, 0, LIBRARY_SCHEMA_VERSION) from None

    async def tasks(
        self, *, after: str | None = None, limit: int = 100, state: str | None = None
    ) -> Page[TaskRecord]:
        """List tasks by id after the exclusive cursor (a task id), optionally by state.

        Raises:
            ConfigurationError: a bad cursor, limit or state.
        """
        validate_budget(limit, "limit")
        position = parse_task_cursor(after)
        if state is not None:
            validate_task_state(state)
        rows = await self._fetch(
            f"SELECT {_COLUMNS} FROM {self._quoted}.tasks"
            " WHERE id > $1 AND ($2::text IS NULL OR state = $2)"
            " ORDER BY id LIMIT $3",
            position,
            state,
            limit + 1,
        )
        items = [_record(r) for r in rows[:limit]]
        cursor = str(items[-1].task_id) if len(rows) > limit else None
        return Page(items=items, next_cursor=cursor)

    async def task(self, task_id: int) -> TaskRecord | None:
        """Return one task's metadata, or ``None``.

        Raises:
            ConfigurationError: not a task id.
        """
        validate_task_id(task_id)
        rows = await self._fetch(
            f"SELECT {_COLUMNS} FROM {self._quoted}.tasks WHERE id = $1", task_id
        )
        return _record(rows[0]) if rows else None

    async def counts(self) -> dict[str, int]:
        """Return how many tasks are in each state."""
        rows = await self._fetch(
            f"SELECT state, count(*) AS n FROM {self._quoted}.tasks GROUP BY state"
        )
        return {str(r["state"]): int(r["n"]) for r in rows}

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

    async def prune(self, older_than: datetime, limit: int = 100) -> int:
        """Delete at most ``limit`` terminal tasks finished before ``older_than``.

        Raises:
            ConfigurationError: a naive ``older_than`` or a limit outside 1..100.
        """
        from steeple.postgres import queue

        validate_budget(limit, "limit")
        if not isinstance(older_than, datetime) or older_than.utcoffset() is None:
            raise ConfigurationError("older_than must be a timezone-aware datetime")
        now = await self.pool.fetchval("SELECT clock_timestamp()")
        age = max(now - older_than, timedelta(0))
        return int(await queue.prune_terminal(self.pool, age, limit, schema=self.schema))
