"""The worker's statements need no type introspection on a fresh asyncpg connection.

asyncpg introspects a parameter type it does not know built in (``bigint[]``, ``uuid[]``,
``integer[]``, ``timestamptz[]``...) on its first use on each connection: extra round
trips (8 instead of 2 measured through a delaying proxy), and a statement that times out
closes its connection, so with enough latency no renewal or completion ever lands. The
statements send array parameters as ``text[]`` (which asyncpg knows) and cast them in
SQL. A connection class records every introspection asyncpg runs (its own
``_introspect_types``, the one path to the server's catalog for unknown types).
"""

from __future__ import annotations

import asyncio
import functools
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import pytest

import queue_support
from steeple.postgres._arrays import array_literal, text_array
from steeple.postgres.queue import EnqueueOptions, JobContext, Scheduler, Task, enqueue
from steeple.postgres.queue._sql import QueueSql, queue_sql

pytestmark = pytest.mark.postgres

WORK: Task[Any] = Task("introspection.work")
wait_until = functools.partial(queue_support.wait_until, timeout=20.0)


class _Counting(asyncpg.Connection):
    """Records the type oids of every introspection query this connection runs."""

    introspected: list[object]  # shared by every connection of one test, set on the class

    async def _introspect_types(self, typeoids: Any, timeout: Any) -> Any:
        type(self).introspected.append(list(typeoids))
        return await super()._introspect_types(typeoids, timeout)  # type: ignore[misc]


def _counting() -> type[_Counting]:
    return type("Counting", (_Counting,), {"introspected": []})


def _old_style_renew(sql: QueueSql) -> str:
    # The renewal as it was, with typed array parameters: proves the counter counts.
    return sql.renew.replace("$1::text[]::bigint[]", "$1::bigint[]").replace(
        "$2::text[]::uuid[]", "$2::uuid[]"
    )


STATEMENTS: dict[str, Callable[[QueueSql], tuple[str, tuple[Any, ...]]]] = {
    "claim_timed": lambda sql: (
        sql.claim_timed,
        (
            ["default"],
            text_array([1]),
            ["nothing"],
            "w",
            0.0,
            text_array([0]),
            text_array([datetime.now(UTC)]),
            text_array([1]),
        ),
    ),
    "renew": lambda sql: (sql.renew, (text_array([1]), text_array([uuid.uuid4()]))),
    "complete": lambda sql: (
        sql.complete,
        (array_literal([1]), array_literal([uuid.uuid4()]), "w", [None], [None]),
    ),
    "completed_by": lambda sql: (
        sql.completed_by,
        (text_array([1]), text_array([1]), text_array([datetime.now(UTC)]), "w"),
    ),
    "progress": lambda sql: (sql.progress, (text_array([1]), text_array([uuid.uuid4()]), ["1"])),
    "lost_states": lambda sql: (sql.lost_states, (text_array([1]),)),
    "trace_contexts": lambda sql: (sql.trace_contexts, (text_array([1]),)),
}


@pytest.mark.parametrize("name", sorted(STATEMENTS))
async def test_first_use_on_a_fresh_connection_needs_no_introspection(
    queue: queue_support.QueueFixture, name: str
) -> None:
    dsn, schema, _conn = queue
    statement, args = STATEMENTS[name](queue_sql(schema))
    counting = _counting()
    conn = await asyncpg.connect(dsn, connection_class=counting)
    try:
        await conn.fetch(statement, *args)
        # The same statement on the same connection again: no introspection either.
        await conn.fetch(statement, *args)
    finally:
        await conn.close()
    assert counting.introspected == []


async def test_typed_array_parameters_are_introspected_which_the_counter_sees(
    queue: queue_support.QueueFixture,
) -> None:
    dsn, schema, _conn = queue
    counting = _counting()
    conn = await asyncpg.connect(dsn, connection_class=counting)
    try:
        await conn.fetch(_old_style_renew(queue_sql(schema)), [1], [uuid.uuid4()])
    finally:
        await conn.close()
    assert counting.introspected != []


async def test_a_worker_claims_renews_reports_and_completes_without_introspection(
    queue: queue_support.QueueFixture,
) -> None:
    dsn, schema, conn = queue
    counting = _counting()
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=4, connection_class=counting)
    renewed = asyncio.Event()
    watcher = await asyncpg.connect(dsn)  # the handler's own: the test polls on conn

    async def work(ctx: JobContext, args: Any) -> str:
        first = await _lease(watcher, schema, ctx.task_id)
        ctx.report_progress(0.5, "half way")
        # Until the lease was renewed at least once (every lease / 3).
        await wait_until(functools.partial(_lease_moved, watcher, schema, ctx.task_id, first))
        renewed.set()
        return "done"

    worker = Scheduler(pool, worker_id="fresh", schema=schema, poll_interval=0.2)
    worker.register(WORK, work)
    options = EnqueueOptions(lease_duration=timedelta(seconds=1.5))
    task_id = (await enqueue(conn, WORK, {}, options, schema=schema)).id
    stop = asyncio.Event()
    run = asyncio.create_task(worker.run_until_shutdown(stop, drain_timeout=10))
    try:
        await wait_until(lambda: _state(conn, schema, task_id, "succeeded"))
    finally:
        stop.set()
        await asyncio.wait_for(run, 30)
        await pool.close()
        await watcher.close()
    assert renewed.is_set()
    assert worker.stats.succeeded == 1
    assert counting.introspected == []


async def _lease(conn: asyncpg.Connection, schema: str, task_id: int) -> Any:
    return await conn.fetchval(
        f'SELECT lease_expires_at FROM "{schema}".tasks WHERE id = $1', task_id
    )


async def _lease_moved(conn: asyncpg.Connection, schema: str, task_id: int, before: Any) -> bool:
    return bool(await _lease(conn, schema, task_id) != before)


async def _state(conn: asyncpg.Connection, schema: str, task_id: int, state: str) -> bool:
    found = await conn.fetchval(f'SELECT state FROM "{schema}".tasks WHERE id = $1', task_id)
    return bool(found == state)
