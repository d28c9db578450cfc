"""Workers inside an ASGI application: started with its lifespan, drained when it stops.

For FastAPI, Starlette or any framework that takes a lifespan (an async context manager
entered at start-up and left at shutdown). Nothing here imports a web framework.

.. code-block:: python

    worker = Scheduler(dsn, worker_id="web-1")
    worker.register(send_email, handle_send_email)
    app = FastAPI(lifespan=worker_lifespan(worker))

or, when the lifespan also owns other resources (a pool for the request handlers):

.. code-block:: python

    @asynccontextmanager
    async def lifespan(app):
        async with asyncpg.create_pool(dsn) as pool, running_workers(worker):
            yield {"pool": pool}

The server's graceful shutdown (SIGTERM or SIGINT under uvicorn, hypercorn...) leaves
the lifespan, which stops the workers claiming and waits for running handlers to finish
(up to ``drain_timeout``; the rest are handed back to the queue, pending, their attempt
refunded). Give the server's own shutdown timeout at least that long.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from datetime import timedelta
from typing import Final

from steeple.postgres.queue._shared import LOG, Health
from steeple.postgres.queue._validate import check_seconds
from steeple.postgres.queue._worker import Scheduler
from steeple.postgres.queue.errors import QueueTypeError, QueueUnavailableError

__all__ = ["running_workers", "worker_lifespan"]

_MAX_WAIT: Final = 86_400.0
# How often start-up looks whether the workers have passed their checks (their first claim
# round and LISTEN): health() is a flag read, not a query.
_START_POLL: Final = 0.01


@contextlib.asynccontextmanager
async def running_workers(
    *schedulers: Scheduler,
    drain_timeout: float | timedelta = 30.0,
    start_timeout: float | timedelta = 60.0,
) -> AsyncIterator[None]:
    """Run ``schedulers`` in this event loop while the block runs; drain them at its end.

    Entering starts each worker (:meth:`Scheduler.run_until_shutdown` in a task) and
    returns once every one has passed its start-up checks and made its first claim
    round, so an application whose queue schema is missing or whose database is unfit
    fails at start-up instead of serving requests without a worker. Leaving (normally
    or by an exception) stops every worker and waits for its drain.

    Args:
        *schedulers: the workers (each runs once: build new ones for a new lifespan).
        drain_timeout: how long running handlers get to finish at shutdown, in seconds
            or a timedelta (0 .. 1 day).
        start_timeout: how long start-up may take before it is abandoned.

    Raises:
        QueueTypeError: something other than a :class:`Scheduler`; a wrong-typed timeout.
        QueueConfigurationError: a timeout that is NaN, infinite, negative or over a day.
        QueueUnavailableError: a worker did not start within ``start_timeout``.
        QueueError: any error a worker's :meth:`Scheduler.run_until_shutdown` raised at
            start-up (schema missing or of another version, unfit database...), or, when
            leaving, the error that stopped a worker while the block ran (logged then too).
    """
    for scheduler in schedulers:
        if not isinstance(scheduler, Scheduler):
            raise QueueTypeError(f"expected Scheduler objects, not {type(scheduler).__name__}")
    drain = check_seconds(drain_timeout, "drain_timeout", 0.0, _MAX_WAIT)
    start = check_seconds(start_timeout, "start_timeout", 0.0, _MAX_WAIT)
    stop = asyncio.Event()
    runs = [
        asyncio.create_task(s.run_until_shutdown(stop, drain_timeout=drain), name=repr(s))
        for s in schedulers
    ]
    try:
        await _started(schedulers, runs, start)
        for scheduler, run in zip(schedulers, runs, strict=True):
            run.add_done_callback(_report_unexpected_stop(scheduler, stop))
        yield
    except BaseException:
        # The block (or start-up) failed: drain every worker, then let that error through.
        await _stopped(stop, runs)
        raise
    failures = await _stopped(stop, runs)
    if failures:
        raise failures[0]


async def _stopped(stop: asyncio.Event, runs: list[asyncio.Task[None]]) -> list[BaseException]:
    """Stop the workers, wait for every drain; return what stopped any of them."""
    stop.set()
    results = await asyncio.gather(*runs, return_exceptions=True)
    return [result for result in results if isinstance(result, BaseException)]


async def _started(
    schedulers: tuple[Scheduler, ...], runs: list[asyncio.Task[None]], timeout: float
) -> None:
    """Wait until every worker is past STARTING; raise what a worker raised while starting."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        for scheduler, run in zip(schedulers, runs, strict=True):
            # A worker reports STOPPED as it leaves run_until_shutdown, before its task ends.
            if run.done() or scheduler.health() is Health.STOPPED:
                await run  # raises its start-up error
                raise QueueUnavailableError(f"queue worker {scheduler.worker_id!r} stopped")
        if all(s.health() is not Health.STARTING for s in schedulers):
            return
        if loop.time() >= deadline:
            raise QueueUnavailableError(f"the queue workers did not start within {timeout} s")
        await asyncio.wait(runs, timeout=_START_POLL, return_when=asyncio.FIRST_COMPLETED)


def _report_unexpected_stop(
    scheduler: Scheduler, stop: asyncio.Event
) -> Callable[[asyncio.Task[None]], None]:
    def done(run: asyncio.Task[None]) -> None:
        if stop.is_set() or run.cancelled():
            return
        error = run.exception()
        # The application keeps serving; its readiness probe sees health() == STOPPED.
        LOG.error(
            "queue worker %s stopped while the application runs: %s",
            scheduler.worker_id,
            "no error" if error is None else f"{type(error).__name__}: {error}",
        )

    return done


def worker_lifespan(
    *schedulers: Scheduler,
    drain_timeout: float | timedelta = 30.0,
    start_timeout: float | timedelta = 60.0,
) -> Callable[[object], contextlib.AbstractAsyncContextManager[None]]:
    """Return an ASGI lifespan that runs ``schedulers`` (see :func:`running_workers`).

    Use it as ``FastAPI(lifespan=worker_lifespan(worker))`` or
    ``Starlette(lifespan=...)``. A lifespan runs once: each worker runs once.

    Raises:
        QueueTypeError: something other than a :class:`Scheduler`.
    """
    for scheduler in schedulers:
        if not isinstance(scheduler, Scheduler):
            raise QueueTypeError(f"expected Scheduler objects, not {type(scheduler).__name__}")

    def lifespan(app: object) -> contextlib.AbstractAsyncContextManager[None]:
        del app
        return running_workers(
            *schedulers, drain_timeout=drain_timeout, start_timeout=start_timeout
        )

    return lifespan
