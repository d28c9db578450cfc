"""Every queue entry point, run against a schema older than the library (versions 5 and 6),
raises SchemaVersionMismatchError naming both versions and changes nothing."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

import asyncpg
import psycopg
import pytest

from steeple.postgres.queue import (
    LIBRARY_SCHEMA_VERSION,
    SchemaVersionMismatchError,
    Task,
    _schema,
    admin,
    cancel,
    enqueue,
    enqueue_many,
    enqueue_many_sync,
    enqueue_sync,
    jobs,
    limit_queue,
    limit_task,
    list_queues,
    pause_queue,
    prune_terminal,
    resume_queue,
    run_state,
)

JOB: Task[Any] = Task("old-schema-job")
Call = Callable[[Any, str, str], Awaitable[Any]]


def _sync(call: Callable[[Any, str], Any]) -> Call:
    """Run a sync entry point on a psycopg (sync) connection of its own, in a thread."""

    async def run(_conn: Any, schema: str, dsn: str) -> Any:
        def inner() -> Any:
            with psycopg.connect(dsn) as sync_conn:
                return call(sync_conn, schema)

        return await asyncio.to_thread(inner)

    return run


ENTRY_POINTS: dict[str, Call] = {
    "enqueue": lambda c, s, _: enqueue(c, JOB, {}, schema=s),
    "enqueue_many": lambda c, s, _: enqueue_many(c, JOB, [{}, {}], schema=s),
    "enqueue_sync": _sync(lambda c, s: enqueue_sync(c, JOB, {}, schema=s)),
    "enqueue_many_sync": _sync(lambda c, s: enqueue_many_sync(c, JOB, [{}], schema=s)),
    "run_state": lambda c, s, _: run_state(c, 1, schema=s),
    "cancel": lambda c, s, _: cancel(c, 1, schema=s),
    "prune_terminal": lambda c, s, _: prune_terminal(c, timedelta(days=1), 10, schema=s),
    "pause_queue": lambda c, s, _: pause_queue(c, "q", schema=s),
    "resume_queue": lambda c, s, _: resume_queue(c, "q", schema=s),
    "limit_queue": lambda c, s, _: limit_queue(c, "q", max_running=2, schema=s),
    "limit_task": lambda c, s, _: limit_task(c, "old-schema-job", max_running=2, schema=s),
    "list_queues": lambda c, s, _: list_queues(c, schema=s),
    "list_task_limits": lambda c, s, _: admin.list_task_limits(c, schema=s),
    "admin.list_tasks": lambda c, s, _: admin.list_tasks(c, schema=s),
    "admin.task_detail": lambda c, s, _: admin.task_detail(c, 1, schema=s),
    "admin.count_by_state": lambda c, s, _: admin.count_by_state(c, schema=s),
    "admin.retry_failed_task": lambda c, s, _: admin.retry_failed_task(c, 1, schema=s),
    "admin.count_prunable": lambda c, s, _: admin.count_prunable(c, timedelta(days=1), schema=s),
    "admin.list_jobs": lambda c, s, _: admin.list_jobs(c, schema=s),
    "admin.task_args": lambda c, s, _: admin.task_args(c, 1, schema=s),
    "admin.throughput": lambda c, s, _: admin.throughput(c, schema=s),
    "jobs.create": lambda c, s, _: jobs.create(c, "j", JOB, "* * * * *", {}, schema=s),
    "jobs.ensure_job": lambda c, s, _: jobs.ensure_job(c, "j", JOB, "* * * * *", {}, schema=s),
    "jobs.get": lambda c, s, _: jobs.get(c, "old", schema=s),
    "jobs.pause": lambda c, s, _: jobs.pause(c, "old", schema=s),
    "jobs.resume": lambda c, s, _: jobs.resume(c, "old", schema=s),
    "jobs.reschedule": lambda c, s, _: jobs.reschedule(c, "old", "5 * * * *", schema=s),
    "jobs.delete": lambda c, s, _: jobs.delete(c, "old", schema=s),
    "jobs.materialize_due": lambda c, s, _: jobs.materialize_due(c, schema=s),
}
# Each version's last migration: a schema installed up to it is at that version.
OLD_VERSIONS = {5: 3, 6: 4}


async def _snapshot(conn: asyncpg.Connection, schema: str) -> list[Any]:
    tasks = await conn.fetch(f'SELECT * FROM "{schema}".tasks ORDER BY id')
    job_rows = await conn.fetch(f'SELECT * FROM "{schema}".jobs ORDER BY id')
    return [list(map(tuple, tasks)), list(map(tuple, job_rows))]


@pytest.mark.parametrize("version", sorted(OLD_VERSIONS))
@pytest.mark.parametrize("entry_point", sorted(ENTRY_POINTS))
async def test_an_entry_point_refuses_an_older_schema_naming_both_versions(
    pg_schema: tuple[str, str], monkeypatch: pytest.MonkeyPatch, entry_point: str, version: int
) -> None:
    dsn, schema = pg_schema
    conn = await asyncpg.connect(dsn)
    try:
        with monkeypatch.context() as patched:
            patched.setattr(_schema, "_MIGRATIONS", _schema._MIGRATIONS[: OLD_VERSIONS[version]])
            patched.setattr(_schema, "LIBRARY_SCHEMA_VERSION", version)
            assert await _schema.install(conn, schema=schema) == version
        # What a library of that version wrote: a pending task and a due recurring job.
        await conn.execute(
            f"""INSERT INTO "{schema}".tasks (task_name, args, max_attempts, lease_duration,
                backoff_initial_us, backoff_maximum_us, backoff_factor, backoff_jitter)
            VALUES ('old-schema-job', '{{}}', 3, interval '60 s', 1000000, 60000000, 2, 0.1)"""
        )
        await conn.execute(
            f"""INSERT INTO "{schema}".jobs (name, task_name, cron, args, priority,
                max_attempts, lease_duration, backoff_initial_us, backoff_maximum_us,
                backoff_factor, backoff_jitter, cursor_at, next_run_at)
            VALUES ('old', 'old-schema-job', '* * * * *', '{{}}', 0, 3, interval '60 s',
                    1000000, 60000000, 2, 0.1, clock_timestamp() - interval '1 hour',
                    clock_timestamp() - interval '1 minute')"""
        )
        before = await _snapshot(conn, schema)
        with pytest.raises(SchemaVersionMismatchError) as refused:
            await ENTRY_POINTS[entry_point](conn, schema, dsn)
        assert refused.value.database_version == version
        assert refused.value.library_version == LIBRARY_SCHEMA_VERSION
        assert f"version {version}" in str(refused.value)
        assert f"version {LIBRARY_SCHEMA_VERSION}" in str(refused.value)
        assert "install()" in str(refused.value)
        assert await _snapshot(conn, schema) == before
    finally:
        await conn.close()


async def test_the_version_is_read_before_a_statement_could_abort_the_callers_transaction(
    pg_schema: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    dsn, schema = pg_schema
    conn = await asyncpg.connect(dsn)
    try:
        with monkeypatch.context() as patched:
            patched.setattr(_schema, "_MIGRATIONS", _schema._MIGRATIONS[:4])
            patched.setattr(_schema, "LIBRARY_SCHEMA_VERSION", 6)
            await _schema.install(conn, schema=schema)
        async with conn.transaction():
            with pytest.raises(SchemaVersionMismatchError):
                await enqueue(conn, JOB, {}, schema=schema)
            # The caller's transaction is still usable: nothing failed inside it.
            assert await conn.fetchval("SELECT 1") == 1
        # Upgraded, the same session is served (the refusal was not remembered).
        await _schema.install(conn, schema=schema)
        assert (await enqueue(conn, JOB, {}, schema=schema)).id > 0
    finally:
        await conn.close()


async def test_a_pool_is_checked_too(
    pg_schema: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    dsn, schema = pg_schema
    async with asyncpg.create_pool(dsn, min_size=1, max_size=2) as pool:
        with monkeypatch.context() as patched:
            patched.setattr(_schema, "_MIGRATIONS", _schema._MIGRATIONS[:3])
            patched.setattr(_schema, "LIBRARY_SCHEMA_VERSION", 5)
            async with pool.acquire() as conn:
                await _schema.install(conn, schema=schema)
        with pytest.raises(SchemaVersionMismatchError) as refused:
            await jobs.delete(pool, "absent", schema=schema)
        assert refused.value.database_version == 5
