"""Scheduler.health() tells the truth about claims (issue 10, item 4).

It used to be healthy whenever any statement had succeeded lately: a worker whose every
claim failed still said healthy as long as its lease renewals went through, and refused
claims did not count at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import asyncpg

import queue_support
from steeple.postgres.queue import (
    EnqueueOptions,
    Health,
    JobContext,
    Scheduler,
    Task,
    enqueue,
    run_state,
)

LONG: Task[Any] = Task("health.long")
SHORT: Task[Any] = Task("health.short")
CLAIM = "claim(text[], integer, text, double precision)"

wait_until = functools.partial(queue_support.wait_until, timeout=20.0)


@contextlib.asynccontextmanager
async def running(worker: Scheduler) -> AsyncIterator[Scheduler]:
    stop = asyncio.Event()
    run = asyncio.create_task(worker.run_until_shutdown(stop, drain_timeout=10))
    try:
        await wait_until(lambda: worker.health() is not Health.STARTING or run.done())
        if run.done():
            run.result()
        yield worker
    finally:
        stop.set()
        await asyncio.wait_for(run, 30)


async def _lease(conn: asyncpg.Connection, schema: str, task_id: int) -> Any:
    return (await run_state(conn, task_id, schema=schema)).lease_expires_at


async def test_failing_claims_degrade_health_even_while_renewals_succeed(
    queue: queue_support.QueueFixture,
) -> None:
    dsn, schema, conn = queue
    release = asyncio.Event()
    started = asyncio.Event()

    async def long(ctx: JobContext, args: Any) -> None:
        started.set()
        await release.wait()

    async def short(ctx: JobContext, args: Any) -> None:
        return None

    # Renewals every ~0.33 s, claims every 1 s: renewals keep succeeding in between.
    worker = Scheduler(
        dsn, worker_id="health", schema=schema, poll_interval=1.0, maintenance_interval=0.5,
        query_timeout=2,
    )  # fmt: skip
    worker.register(LONG, long)
    worker.register(SHORT, short)
    held = await enqueue(
        conn, LONG, {}, EnqueueOptions(lease_duration=timedelta(seconds=1)), schema=schema
    )
    async with running(worker):
        await asyncio.wait_for(started.wait(), 20)
        await wait_until(lambda: worker.health() is Health.HEALTHY)

        # Every claim now fails (the claim function is gone); nothing else does.
        await conn.execute(f'ALTER FUNCTION "{schema}".{CLAIM} RENAME TO claim_gone')
        await wait_until(lambda: worker.health() is Health.DEGRADED)
        for _ in range(5):
            # Right after each successful renewal of the running task's lease...
            before = await _lease(conn, schema, held.id)
            await wait_until(functools.partial(_lease_moved, conn, schema, held.id, before))
            # ...claims still fail, so the worker is still degraded.
            assert worker.health() is Health.DEGRADED
        assert worker.stats.failed_claims >= 1

        await conn.execute(f'ALTER FUNCTION "{schema}".claim_gone RENAME TO claim')
        fresh = await enqueue(conn, SHORT, {}, schema=schema)
        await wait_until(
            lambda: _state(conn, schema, fresh.id, "succeeded"),
        )
        await wait_until(lambda: worker.health() is Health.HEALTHY)
        release.set()
        await wait_until(lambda: _state(conn, schema, held.id, "succeeded"))
        assert worker.health() is Health.HEALTHY


async def _lease_moved(conn: asyncpg.Connection, schema: str, task_id: int, before: Any) -> bool:
    return bool(await _lease(conn, schema, task_id) != before)


async def _state(conn: asyncpg.Connection, schema: str, task_id: int, state: str) -> bool:
    return (await run_state(conn, task_id, schema=schema)).state.value == state
