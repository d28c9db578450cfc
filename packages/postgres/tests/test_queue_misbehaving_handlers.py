"""Handlers that misbehave: whatever a handler raises (``BaseException`` included) fails its
task alone, and a hard stop ends the worker whatever its handlers do.

Each kind of ``BaseException`` (``SystemExit``, ``KeyboardInterrupt``, ``GeneratorExit``, a
custom subclass, a ``CancelledError`` the worker did not ask for) is raised by a sync and by
an async handler beside tasks that succeed: the task fails with its type and traceback
recorded, the others succeed, and the worker stays healthy and keeps claiming. Ctrl-C is
wired as an application does (``loop.add_signal_handler``): a signal handler's exception is
told apart from a handler's own.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import signal
import sys
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

import queue_support
from queue_support import QueueFixture
from steeple.postgres.queue import (
    Health,
    JobContext,
    Scheduler,
    Task,
    enqueue,
    run_state,
)
from steeple.postgres.queue._execution import _raised_by_signal

wait_until = functools.partial(queue_support.wait_until, timeout=20.0)
POISON: Task[Any] = Task("poison")
FINE: Task[Any] = Task("fine")


class HandlerAbortError(BaseException):
    """A BaseException subclass of the application's own."""


def _exit() -> None:
    sys.exit(3)


def _interrupt() -> None:
    raise KeyboardInterrupt


def _generator_exit() -> None:
    raise GeneratorExit


def _custom() -> None:
    raise HandlerAbortError("the handler gave up")


def _cancelled() -> None:
    raise asyncio.CancelledError


def _stop_iteration() -> None:
    raise StopIteration


KINDS: dict[str, tuple[Callable[[], None], str]] = {
    "SystemExit": (_exit, "SystemExit"),
    "KeyboardInterrupt": (_interrupt, "KeyboardInterrupt"),
    "GeneratorExit": (_generator_exit, "GeneratorExit"),
    "custom": (_custom, f"{__name__}.HandlerAbortError"),
    "CancelledError": (_cancelled, "asyncio.exceptions.CancelledError"),
}


@pytest.fixture
async def ctrl_c_handled() -> AsyncIterator[asyncio.Event]:
    """SIGINT wired to an event, as an application running a worker does."""
    loop = asyncio.get_running_loop()
    interrupted = asyncio.Event()
    loop.add_signal_handler(signal.SIGINT, interrupted.set)
    try:
        yield interrupted
    finally:
        loop.remove_signal_handler(signal.SIGINT)


@contextlib.asynccontextmanager
async def running(
    worker: Scheduler, stop: asyncio.Event | None = None, **kw: Any
) -> AsyncIterator[asyncio.Task[None]]:
    stop = stop or asyncio.Event()
    task = asyncio.create_task(worker.run_until_shutdown(stop, **kw))
    try:
        await wait_until(lambda: worker.health() is not Health.STARTING or task.done())
        if task.done():
            task.result()
        yield task
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


def worker_for(dsn: str, schema: str, **kw: Any) -> Scheduler:
    kw.setdefault("poll_interval", 0.05)
    kw.setdefault("maintenance_interval", 0.05)
    kw.setdefault("concurrency", 4)
    return Scheduler(dsn, worker_id="misbehaving", schema=schema, **kw)


async def _fails_alone(
    queue: QueueFixture, poison: Callable[[JobContext, Any], Any], error_type: str, frame: str
) -> None:
    """Run ``poison`` beside tasks that succeed; check it failed alone, the worker went on."""
    dsn, schema, conn = queue
    fine = [(await enqueue(conn, FINE, {"n": n}, schema=schema)).id for n in range(3)]
    bad = await enqueue(conn, POISON, None, schema=schema)

    async def handle_fine(ctx: JobContext, args: Any) -> int:
        return int(args["n"])

    worker = worker_for(dsn, schema)
    worker.register(POISON, poison)
    worker.register(FINE, handle_fine)
    async with running(worker) as task:
        await wait_until(lambda: worker.stats.failed == 1 and worker.stats.succeeded == 3)
        # Still claiming after the failure: a later task runs too.
        later = await enqueue(conn, FINE, {"n": 9}, schema=schema)
        await wait_until(lambda: worker.stats.succeeded == 4)
        assert worker.health() is Health.HEALTHY, worker.health_reasons()
        assert not task.done()
    run = await run_state(conn, bad.id, schema=schema)
    assert run.state.value == "failed"
    (attempt,) = run.history
    assert attempt.outcome == "failed"
    assert attempt.error_type == error_type
    assert attempt.traceback is not None
    assert f"in {frame}" in attempt.traceback  # the handler's own frames are recorded
    for task_id in [*fine, later.id]:
        assert (await run_state(conn, task_id, schema=schema)).state.value == "succeeded"
    assert worker.stats.released == 0


@pytest.mark.parametrize("kind", list(KINDS))
async def test_a_base_exception_from_an_async_handler_fails_its_task_alone(
    queue: QueueFixture, ctrl_c_handled: asyncio.Event, kind: str
) -> None:
    """Before: SystemExit and KeyboardInterrupt ended the event loop, GeneratorExit and a
    custom subclass broke the worker's task group, and a CancelledError left the task
    running until its lease lapsed."""
    raise_it, error_type = KINDS[kind]

    async def poison(ctx: JobContext, args: Any) -> None:
        await asyncio.sleep(0)
        raise_it()

    await _fails_alone(queue, poison, error_type, raise_it.__name__)
    assert not ctrl_c_handled.is_set()


@pytest.mark.parametrize("kind", [*KINDS, "StopIteration"])
async def test_a_base_exception_from_a_sync_handler_fails_its_task_alone(
    queue: QueueFixture, kind: str
) -> None:
    """Before: SystemExit and KeyboardInterrupt ended the event loop, GeneratorExit and a
    custom subclass broke the worker's task group; a CancelledError (and a StopIteration,
    which asyncio cannot carry in a future) left the task running."""
    raise_it, error_type = KINDS.get(kind, (_stop_iteration, "StopIteration"))

    def poison(ctx: JobContext, args: Any) -> None:
        raise_it()

    await _fails_alone(queue, poison, error_type, raise_it.__name__)


def test_an_exception_raised_by_a_signal_handler_is_told_from_a_handlers_own() -> None:
    """A real signal's exception propagates (Ctrl-C keeps working); a handler's is data."""
    caught: list[BaseException] = []

    def on_signal(signum: int, frame: object) -> None:
        sys.exit(7)

    previous = signal.signal(signal.SIGUSR1, on_signal)
    try:
        try:
            signal.raise_signal(signal.SIGUSR1)
            for _ in range(1_000_000):  # the Python handler runs at the next check
                pass
        except SystemExit as exc:
            caught.append(exc)
        try:
            sys.exit(7)
        except SystemExit as exc:
            caught.append(exc)
        from_signal, own = caught
        assert _raised_by_signal(from_signal)
        assert not _raised_by_signal(own)
        assert not _raised_by_signal(HandlerAbortError())
    finally:
        signal.signal(signal.SIGUSR1, previous)
    # With Python's own SIGINT handler, a KeyboardInterrupt may be Ctrl-C: it propagates.
    previous_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        assert _raised_by_signal(KeyboardInterrupt())
        assert not _raised_by_signal(SystemExit(0))
    finally:
        signal.signal(signal.SIGINT, previous_int)
    # In another thread nothing comes from a signal.
    seen: list[bool] = []
    thread = threading.Thread(target=lambda: seen.append(_raised_by_signal(KeyboardInterrupt())))
    thread.start()
    thread.join()
    assert seen == [False]


async def test_a_hard_stop_ends_the_worker_whatever_its_handlers_do(queue: QueueFixture) -> None:
    """A sync handler stuck in its thread and an async handler that swallows cancellation:
    the hard stop hands both tasks back and run_until_shutdown returns.

    Before: the worker waited forever for the async handler."""
    dsn, schema, conn = queue
    stuck_task: Task[Any] = Task("stuck")
    stubborn_task: Task[Any] = Task("stubborn")
    release = threading.Event()
    swallowed: list[int] = []
    closed: list[str] = []

    def stuck(ctx: JobContext, args: Any) -> None:
        release.wait()  # ignores ctx.lease_lost: a thread cannot be interrupted

    async def stubborn(ctx: JobContext, args: Any) -> None:
        try:
            while True:
                try:
                    await asyncio.Event().wait()
                except asyncio.CancelledError:
                    swallowed.append(ctx.task_id)
        except GeneratorExit:
            closed.append("closed")
            raise

    ids = [
        (await enqueue(conn, stuck_task, None, schema=schema)).id,
        (await enqueue(conn, stubborn_task, None, schema=schema)).id,
    ]
    worker = worker_for(dsn, schema)
    worker.register(stuck_task, stuck)
    worker.register(stubborn_task, stubborn)
    stop, hard = asyncio.Event(), asyncio.Event()
    try:
        run = asyncio.create_task(worker.run_until_shutdown(stop, drain_timeout=60, hard_stop=hard))
        await wait_until(lambda: worker.stats.claimed == 2 or run.done())
        assert not run.done()
        stop.set()
        hard.set()
        await asyncio.wait_for(run, 30)
        assert swallowed
        assert closed == ["closed"]
        assert worker.stats.released == 2
        for task_id in ids:
            state = await run_state(conn, task_id, schema=schema)
            assert (state.state.value, state.attempts) == ("pending", 0)
        # The stuck thread is still running, as a daemon: it cannot keep the process alive.
        stuck_threads = [t for t in threading.enumerate() if t.name.startswith("steeple-handler")]
        assert stuck_threads
        assert all(t.daemon for t in stuck_threads)
    finally:
        release.set()
