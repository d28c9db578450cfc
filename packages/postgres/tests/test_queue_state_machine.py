"""The queue conformance state machine (steeple.testing) against the queue's real SQL.

The adapter below runs the worker's own statements (enqueue, claim, renew, complete,
retry, fail, cancel, lease recovery, prune) on PostgreSQL; the model and the rules live in
:mod:`steeple.testing.conformance.queue`.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Hashable, Sequence
from datetime import timedelta
from typing import Any, cast

import asyncpg
import pytest
from hypothesis import HealthCheck, settings

from steeple.postgres._arrays import array_literal, text_array
from steeple.postgres.queue import EnqueueOptions, Task, enqueue, install, limit_queue
from steeple.postgres.queue._sql import queue_sql
from steeple.testing.conformance.queue import (
    ClaimedTask,
    QueueDriver,
    StoredTask,
    run_queue_conformance,
)

pytestmark = pytest.mark.postgres

TASK: Task[Any] = Task("m")


class PostgresQueueDriver:
    """Drives one schema's queue SQL over a single asyncpg connection."""

    def __init__(self, conn: asyncpg.Connection, schema: str) -> None:
        self.conn = conn
        self.schema = schema
        self.sql = queue_sql(schema)

    async def rows(self, sql: str, *args: Any) -> list[tuple[Any, ...]]:
        return [tuple(r) for r in await self.conn.fetch(sql, *args)]

    async def server_time(self) -> float:
        return float(
            await self.conn.fetchval(
                "SELECT extract(epoch FROM clock_timestamp())::double precision"
            )
        )

    async def enqueue(self, *, priority: int, delayed: bool, max_attempts: int) -> int:
        options = EnqueueOptions(priority=priority, max_attempts=max_attempts)
        if delayed:
            now = await self.conn.fetchval("SELECT clock_timestamp()")
            options = EnqueueOptions.at(
                now + timedelta(hours=1), priority=priority, max_attempts=max_attempts
            )
        done = await enqueue(self.conn, TASK, {"p": priority}, options, schema=self.schema)
        return int(done.id)

    async def enqueue_after(
        self,
        parents: Sequence[int],
        *,
        priority: int,
        max_attempts: int,
        run_on_parent_failure: bool,
        limit_key: str | None,
    ) -> int:
        options = EnqueueOptions(priority=priority, max_attempts=max_attempts, limit_key=limit_key)
        policy = "run" if run_on_parent_failure else "cancel"
        done = await enqueue(
            self.conn,
            TASK,
            {},
            options,
            schema=self.schema,
            after=parents,
            on_parent_failure=policy,
        )
        return int(done.id)

    async def limit_running_per_key(self, limit: int) -> None:
        await limit_queue(self.conn, "default", max_running_per_key=limit, schema=self.schema)

    async def enqueue_keyed(self, key: str, *, priority: int, max_attempts: int) -> int:
        options = EnqueueOptions(priority=priority, max_attempts=max_attempts, limit_key=key)
        return int((await enqueue(self.conn, TASK, {}, options, schema=self.schema)).id)

    async def _claim(self, limit: int, give_up: float) -> list[ClaimedTask]:
        rows = await self.rows(self.sql.claim, ["m"], limit, "w", give_up)
        return [ClaimedTask(task_id=r[0], attempt=r[3], token=r[6]) for r in rows]

    async def claim(self, limit: int) -> list[ClaimedTask]:
        return await self._claim(limit, await self.server_time() + 60)

    async def late_claim(self, limit: int) -> list[ClaimedTask]:
        return await self._claim(limit, await self.server_time() - 0.001)

    def forge_token(self) -> Hashable:
        return uuid.uuid4()

    async def renew(self, task_id: int, token: Hashable) -> bool:
        return bool(await self.rows(self.sql.renew, text_array([task_id]), text_array([token])))

    async def complete(self, task_id: int, token: Hashable) -> bool:
        return bool(
            await self.rows(
                self.sql.complete,
                array_literal([task_id]),
                array_literal([cast(uuid.UUID, token)]),
                "w",
                [None],
                [None],
            )
        )

    async def retry(self, task_id: int, token: Hashable) -> bool:
        return bool(
            await self.rows(
                self.sql.retry, task_id, token, timedelta(0), "flaky", "w", None, None, None
            )
        )

    async def fail(self, task_id: int, token: Hashable) -> bool:
        return bool(await self.rows(self.sql.fail, task_id, token, "boom", "w", None, None, None))

    async def release(self, task_id: int, token: Hashable) -> bool:
        return bool(await self.rows(self.sql.release, task_id, token, "w"))

    async def cancel(self, task_id: int) -> tuple[str, bool]:
        ((before, changed),) = await self.rows(self.sql.cancel, task_id)
        return str(before), bool(changed)

    async def expire_lease(self, task_id: int) -> None:
        await self.conn.execute(
            f'UPDATE "{self.schema}".tasks SET lease_expires_at = clock_timestamp() '
            "- interval '1 second' WHERE id = $1",
            task_id,
        )

    async def recover_expired(self) -> list[tuple[int, str]]:
        return [(r[0], r[1]) for r in await self.rows(self.sql.recover_expired, 100)]

    async def prune(self) -> int:
        return int(await self.conn.fetchval(self.sql.prune, timedelta(0), 10_000))

    async def tasks(self) -> dict[int, StoredTask]:
        rows = await self.rows(
            "SELECT id, state, attempts, lease_token IS NOT NULL, finished_at IS NOT NULL "
            f'FROM "{self.schema}".tasks'
        )
        return {r[0]: StoredTask(r[1], r[2], r[3], r[4]) for r in rows}

    async def orphan_history(self) -> int:
        return int(
            await self.conn.fetchval(
                f'SELECT count(*) FROM "{self.schema}".attempts a WHERE NOT EXISTS '
                f'(SELECT 1 FROM "{self.schema}".tasks t WHERE t.id = a.task_id)'
            )
        )

    async def close(self) -> None:
        await self.conn.close()


async def test_queue_sql_conforms_to_the_lifecycle_model(pg_schema: tuple[str, str]) -> None:
    dsn, schema = pg_schema
    conn = await asyncpg.connect(dsn)
    try:
        await install(conn, schema=schema)
    finally:
        await conn.close()

    async def make_driver() -> QueueDriver:
        conn = await asyncpg.connect(dsn)
        await conn.execute(
            f'TRUNCATE "{schema}".tasks, "{schema}".attempts, "{schema}".settings CASCADE'
        )
        return PostgresQueueDriver(conn, schema)

    await asyncio.to_thread(
        run_queue_conformance,
        make_driver,
        settings=settings(
            max_examples=int(os.environ.get("STEEPLE_CONFORMANCE_EXAMPLES", "60")),
            stateful_step_count=30,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
