"""Faults around the worker: killed connections, unfit databases, small pools."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import pytest

from queue_support import QueueFixture, wait_until
from steeple.postgres.queue import (
    EnqueueOptions,
    Health,
    JobContext,
    QueueConfigurationError,
    Scheduler,
    Task,
    UnfitDatabaseError,
    enqueue,
    enqueue_many,
    run_state,
)

PLAIN: Task[Any] = Task("plain")


async def test_terminated_worker_connections_degrade_then_recover(queue: QueueFixture) -> None:
    dsn, schema, conn = queue
    pool = await asyncpg.create_pool(dsn, min_size=4, max_size=6)
    executions: list[int] = []
    worker = Scheduler(
        pool, worker_id="victim", schema=schema, poll_interval=0.1, maintenance_interval=0.1,
        concurrency=4,
    )  # fmt: skip

    async def handler(ctx: JobContext, args: Any) -> None:
        executions.append(ctx.task_id)
        await asyncio.sleep(0.05)

    worker.register(PLAIN, handler)
    stop = asyncio.Event()
    run = asyncio.create_task(worker.run_until_shutdown(stop))
    try:
        ids = await enqueue_many(
            conn, PLAIN, list(range(200)), EnqueueOptions(lease_duration=timedelta(seconds=2)),
            schema=schema,
        )  # fmt: skip
        await wait_until(lambda: len(executions) >= 20)
        # kill every backend of the worker's pool, the listener included
        killed = await conn.fetchval(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid() "
            "AND (application_name LIKE 'steeple-listener victim%' OR query LIKE $1)",
            f'%"{schema}"%',
        )
        assert killed >= 1
        await wait_until(
            lambda: conn.fetchval(
                f"SELECT count(*) = $1 FROM \"{schema}\".tasks WHERE state = 'succeeded'",
                len(ids),
            ),
            timeout=60,
        )
        await wait_until(lambda: worker.health() is Health.HEALTHY, timeout=15)
    finally:
        stop.set()
        await asyncio.wait_for(run, 30)
        await pool.close()
    # at least once: every task succeeded; re-runs only for tasks whose attempt was cut off
    assert set(executions) == set(ids)
    rows = await conn.fetch(
        f"SELECT task_id, count(*) FILTER (WHERE outcome = 'succeeded') AS ok "
        f'FROM "{schema}".attempts GROUP BY task_id'
    )
    assert len(rows) == len(ids)
    assert all(r["ok"] == 1 for r in rows)  # finalized exactly once


async def test_unlogged_queue_tables_are_refused(queue: QueueFixture) -> None:
    dsn, schema, conn = queue
    await conn.execute(f'ALTER TABLE "{schema}".jobs SET UNLOGGED')
    worker = Scheduler(dsn, worker_id="w", schema=schema)

    async def handler(ctx: JobContext, args: Any) -> None:
        return None

    worker.register(PLAIN, handler)
    with pytest.raises(UnfitDatabaseError) as err:
        await worker.run_until_shutdown(asyncio.Event())
    assert err.value.setting == "relpersistence"
    assert worker.health() is Health.STOPPED
    # the check can be waived deliberately (e.g. a throwaway test database)
    lax = Scheduler(dsn, worker_id="w", schema=schema, require_durable=False)
    lax.register(PLAIN, handler)
    stop = asyncio.Event()
    stop.set()
    await lax.run_until_shutdown(stop)


async def test_a_pool_too_small_for_the_worker_is_refused(queue: QueueFixture) -> None:
    dsn, schema, _conn = queue
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=2)
    try:
        worker = Scheduler(pool, worker_id="w", schema=schema)

        async def handler(ctx: JobContext, args: Any) -> None:
            return None

        worker.register(PLAIN, handler)
        with pytest.raises(QueueConfigurationError, match="at least 3"):
            await worker.run_until_shutdown(asyncio.Event())
    finally:
        await pool.close()


async def test_enqueue_on_a_pool_and_a_caller_owned_pool_worker(queue: QueueFixture) -> None:
    dsn, schema, _conn = queue
    pool = await asyncpg.create_pool(dsn, min_size=3, max_size=4)
    ran: list[Any] = []
    try:
        done = await enqueue(pool, PLAIN, "via pool", schema=schema)
        worker = Scheduler(pool, worker_id="w", schema=schema, poll_interval=0.1)

        async def handler(ctx: JobContext, args: Any) -> None:
            ran.append(args)

        worker.register(PLAIN, handler)
        stop = asyncio.Event()
        run = asyncio.create_task(worker.run_until_shutdown(stop))
        await wait_until(lambda: worker.stats.succeeded == 1)
        stop.set()
        await run
        # the caller's pool is still open and usable
        assert (await run_state(pool, done.id, schema=schema)).state.value == "succeeded"
    finally:
        await pool.close()
    assert ran == ["via pool"]


async def test_a_psycopg_pool_runs_the_worker_with_wakeups_and_jobs(queue: QueueFixture) -> None:
    import psycopg_pool

    from steeple.postgres.queue import jobs
    from steeple.testing import FakeClock

    dsn, schema, conn = queue
    ran: list[Any] = []
    pool = psycopg_pool.AsyncConnectionPool(dsn, min_size=3, max_size=4, open=False)
    await pool.open()
    # A yearly job: an hourly one would gain an occurrence whenever the real clock crosses
    # the hour during the test.
    clock = FakeClock(datetime.now(UTC) - timedelta(days=800))
    try:
        async with pool.connection() as pconn:
            await jobs.create(
                pconn, "yearly", PLAIN, "0 0 1 1 *", "job", schema=schema, clock=clock
            )
        clock.advance(timedelta(days=800))
        worker = Scheduler(
            pool, worker_id="psy", schema=schema, poll_interval=5.0, maintenance_interval=0.1,
            clock=clock,
        )  # fmt: skip

        async def handler(ctx: JobContext, args: Any) -> None:
            ran.append(args)

        worker.register(PLAIN, handler)
        stop = asyncio.Event()
        run = asyncio.create_task(worker.run_until_shutdown(stop))
        try:
            await wait_until(lambda: worker.health() is Health.HEALTHY and ran == ["job"])
            # the poll interval is 5 s: a fast pickup proves the NOTIFY wake-up works
            t0 = time.monotonic()
            await enqueue(conn, PLAIN, "woken", schema=schema)
            await wait_until(lambda: "woken" in ran, timeout=3)
            assert time.monotonic() - t0 < 1.0
            # kill the listener: degraded, then back
            killed = await conn.fetchval(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE application_name = 'steeple-listener psy'"
            )
            assert killed == 1
            await wait_until(lambda: worker.health() is Health.DEGRADED, timeout=5)
            await wait_until(lambda: worker.health() is Health.HEALTHY, timeout=10)
            t0 = time.monotonic()
            await enqueue(conn, PLAIN, "again", schema=schema)
            await wait_until(lambda: "again" in ran, timeout=3)
            assert time.monotonic() - t0 < 1.0
        finally:
            stop.set()
            await asyncio.wait_for(run, 30)
    finally:
        await pool.close()
    assert ran == ["job", "woken", "again"]


async def test_an_unreachable_database_at_start_is_a_typed_error() -> None:
    import socket

    from steeple.postgres.queue import QueueUnavailableError

    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    worker = Scheduler(
        f"postgresql://postgres@127.0.0.1:{port}/none", worker_id="w", query_timeout=5
    )

    async def handler(ctx: JobContext, args: Any) -> None:
        return None

    worker.register(PLAIN, handler)
    with pytest.raises(QueueUnavailableError) as err:
        await worker.run_until_shutdown(asyncio.Event())
    assert isinstance(err.value, ConnectionError)
    assert worker.health() is Health.STOPPED


def test_job_error_constructors_validate() -> None:
    from steeple.postgres.queue import JobError

    retry = JobError.retry("later", delay=timedelta(seconds=3))
    assert (retry.retryable, retry.delay, str(retry)) == (True, timedelta(seconds=3), "later")
    permanent = JobError.permanent("never")
    assert (permanent.retryable, permanent.delay) == (False, None)
    with pytest.raises(QueueConfigurationError):
        JobError.retry("negative", delay=timedelta(seconds=-1))
    with pytest.raises(QueueConfigurationError):
        JobError.retry("not a timedelta", delay=3)  # type: ignore[arg-type]
