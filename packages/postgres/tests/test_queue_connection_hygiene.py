"""Connection hygiene of the worker: keepalives, released connections, ambiguous completions."""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg
import pytest

import steeple.postgres.queue._worker as worker_module
from queue_support import QueueFixture, wait_until
from steeple.postgres.queue import (
    JobContext,
    Scheduler,
    Task,
    cancel,
    enqueue,
    run_state,
)
from steeple.postgres.queue._db import (
    KEEPALIVE_SETTINGS,
    _discard,
    _terminate,
    open_db,
)

pytestmark = pytest.mark.postgres

PLAIN: Task[Any] = Task("plain")


async def test_pools_the_worker_opens_carry_tcp_keepalives(queue: QueueFixture) -> None:
    dsn, schema, conn = queue
    worker = Scheduler(dsn, worker_id="ka", schema=schema, poll_interval=0.1)
    seen: list[tuple[Any, ...]] = []

    async def handler(ctx: JobContext, args: Any) -> None:
        db = worker._db
        assert db is not None
        seen.extend(
            await db.fetch(
                "SELECT current_setting('tcp_keepalives_idle'),"
                " current_setting('tcp_keepalives_interval'),"
                " current_setting('tcp_keepalives_count'), current_setting('tcp_user_timeout'),"
                " current_setting('application_name')",
                timeout=10,
            )
        )

    worker.register(PLAIN, handler)
    stop = asyncio.Event()
    run = asyncio.create_task(worker.run_until_shutdown(stop))
    await enqueue(conn, PLAIN, {}, schema=schema)
    await wait_until(lambda: seen)
    stop.set()
    await asyncio.wait_for(run, 30)
    assert seen == [(*KEEPALIVE_SETTINGS.values(), "steeple-queue ka")]
    assert KEEPALIVE_SETTINGS["tcp_user_timeout"] == "30000"


async def test_a_listener_whose_pool_is_terminated_reports_a_lost_connection(
    queue: QueueFixture,
) -> None:
    # Terminating the pool releases the listener's proxy under it; is_closed() on it used
    # to raise InterfaceError ("cannot call Connection.is_closed()") and mislead the log.
    dsn, _schema, _conn = queue
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=2)
    db = open_db(pool)
    assert db is not None
    stop = asyncio.Event()
    listening = asyncio.Event()
    task = asyncio.create_task(db.listen("hygiene_chan2", lambda _p: listening.set(), "x", stop))
    await asyncio.wait_for(listening.wait(), 10)
    pool.terminate()
    with pytest.raises(ConnectionError, match="listener connection was closed"):
        await asyncio.wait_for(task, 15)


async def test_discarding_a_released_connection_keeps_the_original_error(
    queue: QueueFixture,
) -> None:
    dsn, _schema, _conn = queue
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=1)
    try:
        async with pool.acquire() as proxy:
            pass
        with pytest.raises(asyncpg.InterfaceError):
            proxy.is_closed()  # the hazard: any call on a released proxy raises
        # Called from an `except CancelledError` path, it must neither raise nor close
        # a connection that now belongs to someone else.
        _discard(proxy)
        _terminate(proxy)
        async with pool.acquire() as again:
            assert await again.fetchval("SELECT 1") == 1
    finally:
        await pool.close()


class _LostReply:
    """Wraps the worker's pool: the first completion write fails with an unknown outcome.

    With ``commit=True`` the statement really runs and commits before the error (the reply
    was lost: a cut right after COMMIT); with ``commit=False`` it never reaches the server.
    """

    def __init__(self, inner: Any, complete_sql: str, *, commit: bool) -> None:
        self.inner = inner
        self.complete_sql = complete_sql
        self.commit = commit
        self.failed = asyncio.Event()
        self.release = asyncio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def fetch(self, sql: str, *args: Any, timeout: float) -> list[tuple[Any, ...]]:
        if sql == self.complete_sql and not self.failed.is_set():
            if self.commit:
                await self.inner.fetch(sql, *args, timeout=timeout)
            self.failed.set()
            await self.release.wait()
            raise ConnectionResetError("connection lost before the reply")
        return list(await self.inner.fetch(sql, *args, timeout=timeout))


async def _run_with_lost_reply(
    queue: QueueFixture, monkeypatch: pytest.MonkeyPatch, *, commit: bool, cancel_between: bool
) -> tuple[Scheduler, int, JobContext]:
    dsn, schema, conn = queue
    pool = await asyncpg.create_pool(dsn, min_size=2, max_size=6)
    wrappers: list[_LostReply] = []

    def wrapping_open_db(p: Any) -> Any:
        inner = open_db(p)
        wrapper = _LostReply(inner, worker._sql.complete, commit=commit)
        wrappers.append(wrapper)
        return wrapper

    worker = Scheduler(
        pool, worker_id="amb", schema=schema, poll_interval=0.05, maintenance_interval=0.1
    )
    monkeypatch.setattr(worker_module, "open_db", wrapping_open_db)
    contexts: list[JobContext] = []

    async def handler(ctx: JobContext, args: Any) -> None:
        contexts.append(ctx)

    worker.register(PLAIN, handler)
    stop = asyncio.Event()
    run = asyncio.create_task(worker.run_until_shutdown(stop))
    try:
        task_id = (await enqueue(conn, PLAIN, {}, schema=schema)).id
        await wait_until(lambda: wrappers and wrappers[0].failed.is_set())
        if cancel_between:
            await cancel(conn, task_id, schema=schema)
        wrappers[0].release.set()
        await wait_until(lambda: worker.stats.succeeded + worker.stats.rejected_completions)
    finally:
        stop.set()
        await asyncio.wait_for(run, 30)
        await pool.close()
    return worker, task_id, contexts[0]


async def test_a_retried_completion_that_had_committed_is_not_a_rejection(
    queue: QueueFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker, task_id, ctx = await _run_with_lost_reply(
        queue, monkeypatch, commit=True, cancel_between=False
    )
    _dsn, schema, conn = queue
    assert (await run_state(conn, task_id, schema=schema)).state.value == "succeeded"
    assert worker.stats.succeeded == 1
    assert worker.stats.confirmed_completions == 1
    assert worker.stats.rejected_completions == 0
    assert not ctx.lease_lost.is_set()
    history = await conn.fetch(
        f'SELECT outcome FROM "{schema}".attempts WHERE task_id = $1', task_id
    )
    assert [r[0] for r in history] == ["succeeded"]


async def test_a_retried_completion_fenced_meanwhile_is_still_rejected(
    queue: QueueFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker, task_id, ctx = await _run_with_lost_reply(
        queue, monkeypatch, commit=False, cancel_between=True
    )
    _dsn, schema, conn = queue
    assert (await run_state(conn, task_id, schema=schema)).state.value == "cancelled"
    assert worker.stats.succeeded == 0
    assert worker.stats.confirmed_completions == 0
    assert worker.stats.rejected_completions == 1
    assert ctx.lease_lost.is_set()
