"""The work-queue half of ``steeple demo``: tasks enqueued, then run by a real worker."""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

import attrs

from steeple.core.backoff import Backoff

if TYPE_CHECKING:
    from steeple.admin.demo import DemoSummary

__all__ = ["DemoQueue", "prepare"]

_EMAILS = 6
_DELAYED = (0.15, 0.35, 0.55)
"""Delays of the delayed tasks, as fractions of the run's duration."""


@attrs.define
class DemoQueue:
    """A prepared queue: the pool, the worker, and the summary it updates."""

    pool: Any
    scheduler: Any
    summary: DemoSummary

    @property
    def materialized(self) -> int:
        """Tasks the recurring job materialized so far."""
        return int(self.scheduler.stats.materialized)

    async def run(self, stop: asyncio.Event) -> None:
        """Run the worker until ``stop``; then close the pool."""
        try:
            await self.scheduler.run_until_shutdown(stop, drain_timeout=5.0)
        finally:
            self.summary.tasks_materialized = self.materialized
            await self.pool.close()


async def prepare(dsn: str, schema: str, summary: DemoSummary, duration: float) -> DemoQueue:
    """Install the queue schema, enqueue the demo's tasks and build the worker.

    Raises:
        steeple.postgres.queue.QueueError: the queue refuses (and driver errors).
    """
    import asyncpg

    from steeple.postgres import queue
    from steeple.postgres.queue import EnqueueOptions, Task

    welcome: Task[Any] = Task("send-welcome-email")
    resize: Task[Any] = Task("resize-image")
    flaky: Task[Any] = Task("import-feed")
    rates: Task[Any] = Task("refresh-rates")
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=6, timeout=10)
    try:
        async with pool.acquire() as conn:
            await queue.install(conn, schema=schema)
            now = await queue.admin.server_time(conn)
            async with conn.transaction():
                for user in range(1, _EMAILS + 1):
                    await queue.enqueue(
                        conn, welcome, {"user": user}, EnqueueOptions.immediate(), schema=schema
                    )
                for n, delay in enumerate(_DELAYED, start=1):
                    await queue.enqueue(
                        conn,
                        resize,
                        {"image": f"photo-{n}.jpg"},
                        EnqueueOptions.at(now + timedelta(seconds=delay * duration)),
                        schema=schema,
                    )
                await queue.enqueue(
                    conn,
                    flaky,
                    {"feed": "prices"},
                    EnqueueOptions.immediate(
                        max_attempts=3,
                        backoff=Backoff(timedelta(milliseconds=500), timedelta(seconds=2)),
                    ),
                    schema=schema,
                )
            # The recurring job's first due minute is placed in the past (a clock one minute
            # behind), so its first occurrence materializes as soon as the worker starts.
            await queue.jobs.ensure_job(
                conn,
                "refresh-exchange-rates",
                rates,
                "* * * * *",
                {"base": "EUR"},
                schema=schema,
                clock=_Fixed(now - timedelta(minutes=1)),
            )
        summary.tasks_enqueued += _EMAILS + len(_DELAYED) + 1
    except BaseException:
        await pool.close()
        raise

    scheduler = queue.Scheduler(
        pool,
        worker_id="steeple-demo",
        schema=schema,
        poll_interval=0.25,
        maintenance_interval=0.5,
        concurrency=8,
    )
    _register(scheduler, summary, welcome, resize, flaky, rates)
    return DemoQueue(pool, scheduler, summary)


def _register(
    scheduler: Any, summary: DemoSummary, welcome: Any, resize: Any, flaky: Any, rates: Any
) -> None:
    """Register the demo's handlers: each counts what it did in ``summary``."""
    from steeple.postgres.queue.errors import JobError

    async def send_welcome(ctx: Any, args: Any) -> None:
        await asyncio.sleep(0.05)
        summary.tasks_done += 1

    async def resize_image(ctx: Any, args: Any) -> None:
        await asyncio.sleep(0.1)
        summary.tasks_done += 1

    async def import_feed(ctx: Any, args: Any) -> None:
        if ctx.attempt == 1:
            summary.tasks_retried += 1
            raise JobError.retry("the feed server said 503 (the demo fails the first attempt)")
        summary.tasks_done += 1

    async def refresh_rates(ctx: Any, args: Any) -> None:
        summary.tasks_done += 1

    scheduler.register(welcome, send_welcome)
    scheduler.register(resize, resize_image)
    scheduler.register(flaky, import_feed)
    scheduler.register(rates, refresh_rates)


class _Fixed:
    """A clock stopped at one instant (only for placing the recurring job's cursor).

    Set from the server's clock, which decides when the job is due: this host's clock
    may disagree with it.
    """

    def __init__(self, instant: datetime) -> None:
        self._instant = instant

    def now(self) -> datetime:
        return self._instant
