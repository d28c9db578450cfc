"""Workers in an ASGI application's lifespan (steeple.postgres.queue.contrib.asgi), for real.

A real Starlette app is driven through the ASGI lifespan protocol itself (the messages a
server such as uvicorn sends), in this event loop; the FastAPI recipe runs under uvicorn
in test_queue_recipes.py.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import asyncpg
import pytest
from starlette.applications import Starlette

from queue_support import QueueFixture, wait_until
from steeple.postgres.queue import (
    Health,
    JobContext,
    QueueConfigurationError,
    QueueTypeError,
    Scheduler,
    SchemaVersionMismatchError,
    Task,
    enqueue,
    run_state,
)
from steeple.postgres.queue.contrib.asgi import running_workers, worker_lifespan

JOB: Task[Any] = Task("job")
Handler = Callable[[JobContext, Any], Awaitable[object]]


def _worker(dsn: str, schema: str, handler: Handler, name: str = "asgi") -> Scheduler:
    worker = Scheduler(dsn, worker_id=name, schema=schema, poll_interval=0.05)
    worker.register(JOB, handler)
    return worker


async def _state(conn: asyncpg.Connection, schema: str, task_id: int) -> str:
    return (await run_state(conn, task_id, schema=schema)).state.value


class _AsgiServer:
    """The lifespan half of an ASGI server (what uvicorn does at start-up and shutdown)."""

    def __init__(self, app: Starlette) -> None:
        self.inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.sent: list[str] = []
        scope = {"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}
        self.running = asyncio.create_task(app(scope, self._receive, self._send))

    async def _receive(self) -> dict[str, Any]:
        return await self.inbox.get()

    async def _send(self, message: MutableMapping[str, Any]) -> None:
        self.sent.append(message["type"])

    async def startup(self) -> None:
        await self.inbox.put({"type": "lifespan.startup"})
        await wait_until(lambda: self.sent or self.running.done())

    async def begin_shutdown(self) -> None:
        await self.inbox.put({"type": "lifespan.shutdown"})
        await wait_until(self.inbox.empty)  # the app took the message: shutdown has begun


async def test_a_starlette_lifespan_runs_the_worker_and_drains_it(queue: QueueFixture) -> None:
    dsn, schema, conn = queue
    started, release = asyncio.Event(), asyncio.Event()

    async def handle(ctx: JobContext, args: Any) -> None:
        started.set()
        await release.wait()

    worker = _worker(dsn, schema, handle)
    server = _AsgiServer(Starlette(lifespan=worker_lifespan(worker, drain_timeout=60)))
    assert worker.health() is Health.STARTING
    await server.startup()
    assert server.sent == ["lifespan.startup.complete"]
    # Start-up completed only once the worker was past its checks and first claim round.
    assert worker.health() is Health.HEALTHY
    queued = await enqueue(conn, JOB, 1, schema=schema)
    await started.wait()

    await server.begin_shutdown()
    for _ in range(10):
        await asyncio.sleep(0)
    # The handler is still blocked, so the shutdown cannot have completed: it waits.
    assert not server.running.done()
    assert await _state(conn, schema, queued.id) == "running"
    release.set()
    await server.running
    assert server.sent == ["lifespan.startup.complete", "lifespan.shutdown.complete"]
    # Drained, not handed back: the handler finished and its success was recorded.
    assert await _state(conn, schema, queued.id) == "succeeded"
    assert worker.health() is Health.STOPPED


async def test_leaving_waits_for_running_handlers(queue: QueueFixture) -> None:
    dsn, schema, conn = queue
    started, release = asyncio.Event(), asyncio.Event()
    finished: list[int] = []

    async def handle(ctx: JobContext, args: Any) -> None:
        started.set()
        await release.wait()
        finished.append(ctx.task_id)

    worker = _worker(dsn, schema, handle)
    async with running_workers(worker, drain_timeout=60):
        queued = await enqueue(conn, JOB, 1, schema=schema)
        await started.wait()
        # Runs once leaving has begun (the block's end stops the worker before it yields).
        asyncio.get_running_loop().call_soon(release.set)
    # The block's end waited for the handler (which was blocked until after it began).
    assert finished == [queued.id]
    assert await _state(conn, schema, queued.id) == "succeeded"


async def test_past_the_drain_timeout_work_is_handed_back(queue: QueueFixture) -> None:
    dsn, schema, conn = queue
    started = asyncio.Event()

    async def handle(ctx: JobContext, args: Any) -> None:
        started.set()
        await asyncio.Event().wait()  # never finishes by itself

    worker = _worker(dsn, schema, handle)
    async with running_workers(worker, drain_timeout=0):
        queued = await enqueue(conn, JOB, 1, schema=schema)
        await started.wait()
    state = await run_state(conn, queued.id, schema=schema)
    assert (state.state.value, state.attempts) == ("pending", 0)  # released, attempt refunded


async def test_a_worker_that_cannot_start_fails_the_start_up(pg_schema: tuple[str, str]) -> None:
    dsn, schema = pg_schema  # no queue installed in this schema

    async def handle(ctx: JobContext, args: Any) -> None:
        return None

    healthy = _worker(dsn, schema, handle, "other")
    broken = _worker(dsn, schema, handle)
    entered = False
    with pytest.raises(SchemaVersionMismatchError):
        async with running_workers(healthy, broken):
            entered = True
    assert not entered
    assert healthy.health() is Health.STOPPED
    assert broken.health() is Health.STOPPED

    server = _AsgiServer(Starlette(lifespan=worker_lifespan(_worker(dsn, schema, handle))))
    await server.startup()
    with pytest.raises(SchemaVersionMismatchError):
        await server.running
    assert server.sent == ["lifespan.startup.failed"]


async def test_an_error_in_the_block_still_drains_and_comes_out(queue: QueueFixture) -> None:
    dsn, schema, _conn = queue

    async def handle(ctx: JobContext, args: Any) -> None:
        return None

    worker = _worker(dsn, schema, handle)
    with pytest.raises(LookupError, match="the app broke"):
        async with running_workers(worker):
            raise LookupError("the app broke")
    assert worker.health() is Health.STOPPED


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (lambda w: running_workers(w, "not a worker"), QueueTypeError),  # type: ignore[arg-type]
        (lambda w: running_workers(w, drain_timeout=float("nan")), QueueConfigurationError),
        (lambda w: running_workers(w, drain_timeout=-1), QueueConfigurationError),
        (lambda w: running_workers(w, start_timeout="10"), QueueTypeError),  # type: ignore[arg-type]
        (lambda w: running_workers(w, drain_timeout=10**400), QueueConfigurationError),
    ],
)
async def test_bad_arguments_are_refused_before_anything_runs(
    queue: QueueFixture,
    call: Callable[[Scheduler], contextlib.AbstractAsyncContextManager[None]],
    error: type[Exception],
) -> None:
    dsn, schema, _conn = queue

    async def handle(ctx: JobContext, args: Any) -> None:
        return None

    worker = _worker(dsn, schema, handle)
    with pytest.raises(error):
        async with call(worker):
            pass
    assert worker.health() is Health.STARTING  # never started: it can still run later
    with pytest.raises(QueueTypeError):
        worker_lifespan(worker, None)  # type: ignore[arg-type]
