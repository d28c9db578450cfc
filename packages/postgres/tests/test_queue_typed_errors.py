"""Every queue function on a caller's connection raises the queue's typed errors.

A read-only session (what a standby or ``default_transaction_read_only`` gives), a lock
held past ``lock_timeout``, a statement past ``statement_timeout`` and a backend ended by
``pg_terminate_backend`` are each provoked for real, for every entry point: jobs, cancel,
prune, retry, queue settings, the admin listings and enqueue. Each raises
``UnfitDatabaseError`` / ``QueueDeadlineError`` / ``QueueUnavailableError`` (the driver's
error as its cause), never a raw asyncpg error, and nothing in the schema changed. The same
through psycopg connections for a sample of writers.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

import asyncpg
import pytest

import queue_support
from steeple.postgres import queue as pq
from steeple.postgres.queue import (
    QueueDeadlineError,
    QueueUnavailableError,
    Task,
    UnfitDatabaseError,
    admin,
    jobs,
)
from steeple.postgres.queue._sql import queue_sql

pytestmark = pytest.mark.postgres

TASK: Task[Any] = Task("typed.errors")
Call = Callable[[asyncpg.Connection, str, dict[str, int]], Awaitable[object]]


async def _failed_task(conn: asyncpg.Connection, schema: str) -> int:
    task_id = (await pq.enqueue(conn, Task("typed.failed"), {}, schema=schema)).id
    sql = queue_sql(schema)
    give_up = await conn.fetchval("SELECT extract(epoch FROM clock_timestamp()) + 60")
    (row,) = await conn.fetch(sql.claim, ["typed.failed"], 1, "w", give_up)
    assert await conn.fetch(sql.fail, task_id, row["lease_token"], "boom", "w", None, None, None)
    return task_id


WRITERS: dict[str, Call] = {
    "jobs.create": lambda c, s, ids: jobs.create(c, "fresh", TASK, "* * * * *", {}, schema=s),
    "jobs.ensure_job": lambda c, s, ids: jobs.ensure_job(c, "j", TASK, "*/5 * * * *", {}, schema=s),
    "jobs.pause": lambda c, s, ids: jobs.pause(c, "j", schema=s),
    "jobs.resume": lambda c, s, ids: jobs.resume(c, "paused", schema=s),
    "jobs.reschedule": lambda c, s, ids: jobs.reschedule(c, "j", "*/2 * * * *", schema=s),
    "jobs.delete": lambda c, s, ids: jobs.delete(c, "j", schema=s),
    "jobs.materialize_due": lambda c, s, ids: jobs.materialize_due(c, schema=s),
    "cancel": lambda c, s, ids: pq.cancel(c, ids["pending"], schema=s),
    "prune_terminal": lambda c, s, ids: pq.prune_terminal(c, timedelta(0), schema=s),
    "retry_failed_task": lambda c, s, ids: admin.retry_failed_task(c, ids["failed"], schema=s),
    "pause_queue": lambda c, s, ids: pq.pause_queue(c, "q", schema=s),
    "resume_queue": lambda c, s, ids: pq.resume_queue(c, "paused-q", schema=s),
    "limit_queue": lambda c, s, ids: pq.limit_queue(c, "q", max_running=3, schema=s),
    "limit_task": lambda c, s, ids: pq.limit_task(c, "typed.errors", max_running=3, schema=s),
    "enqueue": lambda c, s, ids: pq.enqueue(c, TASK, {}, schema=s),
}
READERS: dict[str, Call] = {
    "jobs.get": lambda c, s, ids: jobs.get(c, "j", schema=s),
    "run_state": lambda c, s, ids: pq.run_state(c, ids["pending"], schema=s),
    "admin.list_tasks": lambda c, s, ids: admin.list_tasks(c, schema=s),
    "admin.count_by_state": lambda c, s, ids: admin.count_by_state(c, schema=s),
    "admin.count_prunable": lambda c, s, ids: admin.count_prunable(c, timedelta(0), schema=s),
    "admin.list_jobs": lambda c, s, ids: admin.list_jobs(c, schema=s),
    "admin.task_detail": lambda c, s, ids: admin.task_detail(c, ids["failed"], schema=s),
    "admin.task_args": lambda c, s, ids: admin.task_args(c, ids["pending"], schema=s),
    "admin.throughput": lambda c, s, ids: admin.throughput(c, schema=s),
    "list_queues": lambda c, s, ids: pq.list_queues(c, schema=s),
    "list_task_limits": lambda c, s, ids: admin.list_task_limits(c, schema=s),
}
EVERY = {**WRITERS, **READERS}


@pytest.fixture
async def prepared(
    queue: queue_support.QueueFixture,
) -> tuple[str, str, asyncpg.Connection, dict[str, int]]:
    """The queue with a job, a paused job and queue, a pending and a failed task."""
    dsn, schema, conn = queue
    await jobs.create(conn, "j", TASK, "0 0 1 1 *", {}, schema=schema)
    await jobs.create(conn, "paused", TASK, "0 0 1 1 *", {}, schema=schema)
    await jobs.pause(conn, "paused", schema=schema)
    await pq.pause_queue(conn, "paused-q", schema=schema)
    ids = {
        "pending": (await pq.enqueue(conn, TASK, {}, schema=schema)).id,
        "failed": await _failed_task(conn, schema),
    }
    return dsn, schema, conn, ids


async def _snapshot(conn: asyncpg.Connection, schema: str) -> dict[str, str]:
    """Every row of every table of the schema, as text (to show nothing changed)."""
    tables = await conn.fetch(
        "SELECT tablename FROM pg_tables WHERE schemaname = $1 ORDER BY tablename", schema
    )
    snapshot = {}
    for (table,) in tables:
        snapshot[table] = await conn.fetchval(
            f"SELECT coalesce(string_agg(t::text, E'\\n' ORDER BY t::text), '') "
            f'FROM "{schema}"."{table}" t'
        )
    return snapshot


async def _lock_everything(conn: asyncpg.Connection, schema: str) -> None:
    tables = await conn.fetchval(
        "SELECT string_agg(format('%I.%I', schemaname, tablename), ', ') FROM pg_tables "
        "WHERE schemaname = $1",
        schema,
    )
    await conn.execute(f"LOCK TABLE {tables} IN ACCESS EXCLUSIVE MODE")


@pytest.mark.parametrize("entry", sorted(WRITERS))
async def test_a_read_only_session_is_an_unfit_database(
    prepared: tuple[str, str, asyncpg.Connection, dict[str, int]], entry: str
) -> None:
    dsn, schema, conn, ids = prepared
    before = await _snapshot(conn, schema)
    # What a hot standby (or a role/database set read-only) gives every session.
    victim = await asyncpg.connect(dsn, server_settings={"default_transaction_read_only": "on"})
    try:
        with pytest.raises(UnfitDatabaseError) as err:
            await WRITERS[entry](victim, schema, ids)
    finally:
        await victim.close()
    assert err.value.setting == "read_only"
    assert "read-only" in str(err.value)
    assert isinstance(err.value.__cause__, asyncpg.ReadOnlySQLTransactionError)
    assert await _snapshot(conn, schema) == before


@pytest.mark.parametrize("entry", sorted(EVERY))
async def test_a_lock_held_past_lock_timeout_is_a_deadline_error(
    prepared: tuple[str, str, asyncpg.Connection, dict[str, int]], entry: str
) -> None:
    dsn, schema, conn, ids = prepared
    before = await _snapshot(conn, schema)
    victim = await asyncpg.connect(dsn, server_settings={"lock_timeout": "200"})
    try:
        async with conn.transaction():
            await _lock_everything(conn, schema)
            with pytest.raises(QueueDeadlineError) as err:
                await EVERY[entry](victim, schema, ids)
    finally:
        await victim.close()
    assert "lock_timeout" in str(err.value)
    assert isinstance(err.value, TimeoutError)
    assert isinstance(err.value.__cause__, asyncpg.LockNotAvailableError)
    assert await _snapshot(conn, schema) == before


@pytest.mark.parametrize("entry", sorted(EVERY))
async def test_a_statement_past_statement_timeout_is_a_deadline_error(
    prepared: tuple[str, str, asyncpg.Connection, dict[str, int]], entry: str
) -> None:
    dsn, schema, conn, ids = prepared
    before = await _snapshot(conn, schema)
    victim = await asyncpg.connect(dsn, server_settings={"statement_timeout": "200"})
    try:
        async with conn.transaction():
            await _lock_everything(conn, schema)
            with pytest.raises(QueueDeadlineError) as err:
                await EVERY[entry](victim, schema, ids)
    finally:
        await victim.close()
    assert "statement_timeout" in str(err.value)
    assert isinstance(err.value.__cause__, asyncpg.QueryCanceledError)
    assert await _snapshot(conn, schema) == before


@pytest.mark.parametrize("entry", sorted(EVERY))
async def test_a_terminated_backend_is_unavailable(
    prepared: tuple[str, str, asyncpg.Connection, dict[str, int]], entry: str
) -> None:
    dsn, schema, conn, ids = prepared
    before = await _snapshot(conn, schema)
    victim = await asyncpg.connect(dsn)
    try:
        pid = victim.get_server_pid()
        assert await conn.fetchval("SELECT pg_terminate_backend($1)", pid)
        await queue_support.wait_until(
            lambda: _gone(conn, pid),
            timeout=20.0,
        )
        with pytest.raises(QueueUnavailableError) as err:
            await EVERY[entry](victim, schema, ids)
    finally:
        await victim.close()
    assert "connection was lost" in str(err.value)
    assert not isinstance(err.value, QueueDeadlineError)
    assert isinstance(
        err.value.__cause__,
        asyncpg.PostgresError | asyncpg.InterfaceError | asyncpg.exceptions.InternalClientError,
    )
    assert await _snapshot(conn, schema) == before


async def _gone(conn: asyncpg.Connection, pid: int) -> bool:
    return not await conn.fetchval("SELECT count(*) FROM pg_stat_activity WHERE pid = $1", pid)


async def test_server_time_on_a_terminated_backend_is_unavailable(
    queue: queue_support.QueueFixture,
) -> None:
    dsn, _schema, conn = queue
    victim = await asyncpg.connect(dsn)
    try:
        pid = victim.get_server_pid()
        assert await conn.fetchval("SELECT pg_terminate_backend($1)", pid)
        await queue_support.wait_until(lambda: _gone(conn, pid), timeout=20.0)
        with pytest.raises(QueueUnavailableError):
            await admin.server_time(victim)
    finally:
        await victim.close()


# The same translation through psycopg (its errors carry the same SQLSTATEs; a lost
# connection is an OperationalError).
PSYCOPG_CASES = {
    "read-only": ("-c default_transaction_read_only=on", UnfitDatabaseError, "read-only"),
    "lock_timeout": ("-c lock_timeout=200", QueueDeadlineError, "lock_timeout"),
    "statement_timeout": ("-c statement_timeout=200", QueueDeadlineError, "statement_timeout"),
    "terminated": ("", QueueUnavailableError, "connection was lost"),
}


@pytest.mark.parametrize("entry", ["jobs.pause", "cancel", "retry_failed_task", "enqueue"])
@pytest.mark.parametrize("case", sorted(PSYCOPG_CASES))
async def test_psycopg_connections_get_the_same_typed_errors(
    prepared: tuple[str, str, asyncpg.Connection, dict[str, int]], entry: str, case: str
) -> None:
    import psycopg

    dsn, schema, conn, ids = prepared
    options, expected, fragment = PSYCOPG_CASES[case]
    before = await _snapshot(conn, schema)
    victim = await psycopg.AsyncConnection.connect(dsn, autocommit=True, options=options)
    try:
        if case == "terminated":
            pid = victim.info.backend_pid
            assert await conn.fetchval("SELECT pg_terminate_backend($1)", pid)
            await queue_support.wait_until(lambda: _gone(conn, pid), timeout=20.0)
        async with conn.transaction():
            if case.endswith("timeout"):
                await _lock_everything(conn, schema)
            with pytest.raises(expected) as err:
                await WRITERS[entry](victim, schema, ids)  # type: ignore[arg-type]
    finally:
        await victim.close()
    assert fragment in str(err.value)
    assert isinstance(err.value.__cause__, psycopg.Error)
    assert await _snapshot(conn, schema) == before
