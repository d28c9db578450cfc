"""Plain ``def`` handlers run in the worker's thread pool; register() refuses what cannot run."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
from collections.abc import AsyncIterator, Iterator
from datetime import timedelta
from typing import Any

import pytest

import queue_support
from queue_support import QueueFixture
from steeple.postgres.queue import (
    EnqueueOptions,
    Health,
    JobContext,
    LeaseLostError,
    QueueConfigurationError,
    QueueTypeError,
    Scheduler,
    Task,
    cancel,
    enqueue,
    run_state,
)
from steeple.postgres.queue._execution import check_handler

SYNC: Task[Any] = Task("sync")
wait_until = functools.partial(queue_support.wait_until, timeout=15.0)


@contextlib.asynccontextmanager
async def running(worker: Scheduler, drain_timeout: float = 10.0) -> AsyncIterator[Scheduler]:
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run_until_shutdown(stop, drain_timeout=drain_timeout))
    try:
        await wait_until(lambda: worker.health() is not Health.STARTING or task.done())
        if task.done():
            task.result()
        yield worker
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


def worker_for(dsn: str, schema: str, **kw: Any) -> Scheduler:
    kw.setdefault("poll_interval", 0.05)
    kw.setdefault("maintenance_interval", 0.05)
    return Scheduler(dsn, worker_id="sync-w", schema=schema, **kw)


async def test_a_plain_def_handler_runs_in_a_thread_and_succeeds(queue: QueueFixture) -> None:
    """Before: the task failed with "NoneType can't be used in 'await' expression"."""
    dsn, schema, conn = queue
    seen: list[tuple[int, str, Any]] = []
    loop_thread = threading.get_ident()

    def handle(ctx: JobContext, args: Any) -> None:
        ctx.check_lease()  # usable from the thread
        seen.append((threading.get_ident(), threading.current_thread().name, args))

    done = await enqueue(conn, SYNC, {"n": 1}, schema=schema)
    worker = worker_for(dsn, schema)
    worker.register(SYNC, handle)
    async with running(worker):
        await wait_until(lambda: worker.stats.succeeded == 1)
    run = await run_state(conn, done.id, schema=schema)
    assert run.state.value == "succeeded", run.last_error
    assert run.last_error is None
    ((ident, name, args),) = seen
    assert ident != loop_thread
    assert name.startswith("steeple-handler")
    assert args == {"n": 1}


async def test_the_thread_pool_is_bounded_by_threads(queue: QueueFixture) -> None:
    dsn, schema, conn = queue
    lock = threading.Lock()
    running_now = 0
    peak = 0
    release = threading.Event()
    started = threading.Semaphore(0)

    def handle(ctx: JobContext, args: Any) -> None:
        nonlocal running_now, peak
        with lock:
            running_now += 1
            peak = max(peak, running_now)
        started.release()
        release.wait(30)
        with lock:
            running_now -= 1

    for i in range(6):
        await enqueue(conn, SYNC, i, schema=schema)
    worker = worker_for(dsn, schema, concurrency=6, threads=2)
    worker.register(SYNC, handle)
    async with running(worker):
        # Two run at once (two threads), and only those two are claimed although
        # concurrency is 6: a worker claims only what it can start, the other four stay
        # pending for any worker (before: all six were claimed, four leased to no thread).
        await wait_until(lambda: peak == 2)
        rounds = worker.stats.maintenance_rounds
        await wait_until(lambda: worker.stats.maintenance_rounds >= rounds + 3)
        assert (running_now, worker.stats.claimed) == (2, 2)
        states = await conn.fetch(f'SELECT state, count(*) FROM "{schema}".tasks GROUP BY 1')
        assert {r[0]: r[1] for r in states} == {"running": 2, "pending": 4}
        release.set()
        await wait_until(lambda: worker.stats.succeeded == 6)
    assert peak == 2
    assert worker.stats.not_started == 0


async def test_cancellation_and_lease_loss_are_visible_in_the_thread(queue: QueueFixture) -> None:
    dsn, schema, conn = queue
    started = threading.Event()
    observed: list[tuple[bool, bool, str]] = []

    def handle(ctx: JobContext, args: Any) -> None:
        started.set()
        # Polling a flag is the thread's way to wait; the event is set by the renewal.
        while not ctx.lease_lost.is_set():
            threading.Event().wait(0.01)
        try:
            ctx.check_lease()
        except LeaseLostError as exc:
            observed.append((ctx.cancelled.is_set(), ctx.lease_lost.is_set(), str(exc)))

    # A short lease: the worker learns of the cancel at its next renewal (a third of it).
    short = EnqueueOptions(lease_duration=timedelta(seconds=1))
    done = await enqueue(conn, SYNC, None, short, schema=schema)
    worker = worker_for(dsn, schema)
    worker.register(SYNC, handle)
    async with running(worker):
        await wait_until(started.is_set)
        await cancel(conn, done.id, schema=schema)
        await wait_until(lambda: observed)
    assert observed[0][:2] == (True, True)
    assert "cancelled" in observed[0][2]
    assert (await run_state(conn, done.id, schema=schema)).state.value == "cancelled"


async def test_a_sync_handler_exception_is_a_failure_like_an_async_one(
    queue: QueueFixture,
) -> None:
    dsn, schema, conn = queue

    def handle(ctx: JobContext, args: Any) -> None:
        raise RuntimeError("sync boom")

    done = await enqueue(conn, SYNC, None, schema=schema)
    worker = worker_for(dsn, schema)
    worker.register(SYNC, handle)
    async with running(worker):
        await wait_until(lambda: worker.stats.failed == 1)
    run = await run_state(conn, done.id, schema=schema)
    assert run.state.value == "failed"
    assert run.last_error is not None
    assert run.last_error.endswith(": RuntimeError: sync boom")
    assert run.last_error.startswith("not retried (plain exceptions are terminal")


async def test_a_plain_function_returning_a_coroutine_has_it_awaited(queue: QueueFixture) -> None:
    dsn, schema, conn = queue
    ran: list[str] = []

    async def inner(args: Any) -> None:
        ran.append(threading.current_thread().name)

    done = await enqueue(conn, SYNC, None, schema=schema)
    worker = worker_for(dsn, schema)
    worker.register(SYNC, lambda ctx, args: inner(args))
    async with running(worker):
        await wait_until(lambda: worker.stats.succeeded == 1)
    assert ran == [threading.current_thread().name]  # the coroutine ran on the loop
    assert (await run_state(conn, done.id, schema=schema)).state.value == "succeeded"


async def test_a_hard_stop_hands_back_a_sync_handler_and_tells_its_thread(
    queue: QueueFixture,
) -> None:
    dsn, schema, conn = queue
    started = threading.Event()
    saw_lost = threading.Event()

    def handle(ctx: JobContext, args: Any) -> None:
        started.set()
        while not ctx.lease_lost.is_set():
            threading.Event().wait(0.01)
        saw_lost.set()

    done = await enqueue(conn, SYNC, None, schema=schema)
    worker = worker_for(dsn, schema)
    worker.register(SYNC, handle)
    async with running(worker, drain_timeout=0.0):
        await wait_until(started.is_set)
    await wait_until(saw_lost.is_set)
    run = await run_state(conn, done.id, schema=schema)
    assert (run.state.value, run.attempts) == ("pending", 0)  # handed back, attempt refunded
    assert worker.stats.released == 1


# --- register() refuses what it cannot run -----------------------------------------------------


async def _ok_async(ctx: Any, args: Any) -> None:
    return None


def _ok_sync(ctx: Any, args: Any) -> None:
    return None


async def _agen(ctx: Any, args: Any) -> Any:
    yield 1


def _gen(ctx: Any, args: Any) -> Iterator[int]:
    yield 1


def _one(ctx: Any) -> None:
    return None


def _three(ctx: Any, args: Any, more: Any) -> None:
    return None


def _kw_only(*, ctx: Any, args: Any) -> None:
    return None


class _AsyncCallable:
    async def __call__(self, ctx: Any, args: Any) -> None:
        return None


class _SyncCallable:
    def __call__(self, ctx: Any, args: Any) -> None:
        return None


class _AGenCallable:
    async def __call__(self, ctx: Any, args: Any) -> Any:
        yield 1


class _HandlerClass:
    def __init__(self, ctx: Any, args: Any) -> None:
        pass


def _varargs(*args: Any) -> None:
    return None


@pytest.mark.parametrize(
    ("handler", "is_async"),
    [
        (_ok_async, True),
        (_ok_sync, False),
        (_AsyncCallable(), True),
        (_SyncCallable(), False),
        (functools.partial(_three, more=1), False),
        (functools.partial(lambda extra, ctx, args: None, 1), False),
        (lambda ctx, args: None, False),
        (_varargs, False),
        (print, False),  # a builtin: (*args, ...) takes two
    ],
)
def test_register_accepts_what_can_run(handler: Any, is_async: bool) -> None:
    assert check_handler(handler) is is_async
    Scheduler("postgresql://localhost/db", worker_id="w").register(SYNC, handler)


@pytest.mark.parametrize(
    ("handler", "words"),
    [
        (None, "must be a function"),
        (42, "must be a function"),
        ("handle", "must be a function"),
        (_agen, "async generator"),
        (_AGenCallable(), "async generator"),
        (_gen, "generator function"),
        (_one, "two positional arguments"),
        (_three, "two positional arguments"),
        (_kw_only, "two positional arguments"),
        (lambda ctx: None, "two positional arguments"),
        (lambda: None, "two positional arguments"),
        (lambda a, b, c: None, "two positional arguments"),
        (_HandlerClass, "not the class"),
        (functools.partial(_ok_sync, 1, 2), "two positional arguments"),
    ],
)
def test_register_refuses_what_cannot_run_with_a_typed_error(handler: Any, words: str) -> None:
    worker = Scheduler("postgresql://localhost/db", worker_id="w")
    with pytest.raises(QueueTypeError, match=words) as caught:
        worker.register(SYNC, handler)
    assert isinstance(caught.value, QueueConfigurationError | TypeError)
    with pytest.raises(Exception, match="register at least one handler"):
        asyncio.run(worker.run_until_shutdown(asyncio.Event()))  # nothing was registered


def test_register_refuses_a_coroutine_object() -> None:
    coro = _ok_async(None, None)
    try:
        with pytest.raises(QueueTypeError, match="pass the function itself"):
            Scheduler("postgresql://localhost/db", worker_id="w").register(SYNC, coro)  # type: ignore[arg-type]
    finally:
        coro.close()


@pytest.mark.parametrize("threads", [0, -1, 1025, 2**70, True, 1.5, "4", None])
def test_threads_is_validated(threads: Any) -> None:
    if threads is None:
        Scheduler("postgresql://localhost/db", worker_id="w", threads=threads)
        return
    with pytest.raises(QueueConfigurationError, match="threads"):
        Scheduler("postgresql://localhost/db", worker_id="w", threads=threads)


class _HostileSignature:
    @property
    def __signature__(self) -> Any:
        raise RuntimeError("no signature for you")

    def __call__(self, ctx: Any, args: Any) -> None:
        return None


def test_register_refuses_a_handler_whose_signature_cannot_be_read() -> None:
    with pytest.raises(QueueTypeError, match="could not be read"):
        Scheduler("postgresql://localhost/db", worker_id="w").register(SYNC, _HostileSignature())


class _BillingError(Exception):
    """An application's own exception type."""


class _NoSuchFile(FileNotFoundError):
    """An OSError subclass of the application's."""


def _read_invoice(kind: str) -> None:
    if kind == "timeout":
        raise TimeoutError("the invoice service did not answer")
    if kind == "value":
        raise ValueError("an invoice total of -3")
    if kind == "key":
        raise KeyError("customer")
    if kind == "oserror":
        raise _NoSuchFile(2, "no such invoice", "/invoices/7.pdf")
    if kind == "custom":
        raise _BillingError("the ledger is closed")
    if kind == "stop":
        raise StopIteration("an iterator ran dry")
    try:
        raise ConnectionResetError("the ledger hung up")
    except ConnectionResetError as exc:
        raise _BillingError("posting failed") from exc


@pytest.mark.parametrize(
    ("kind", "error_type", "last_line"),
    [
        ("timeout", "TimeoutError", "TimeoutError: the invoice service did not answer"),
        ("value", "ValueError", "ValueError: an invoice total of -3"),
        ("key", "KeyError", "KeyError: 'customer'"),
        ("oserror", f"{__name__}._NoSuchFile", "[Errno 2] no such invoice: '/invoices/7.pdf'"),
        ("custom", f"{__name__}._BillingError", "_BillingError: the ledger is closed"),
        ("stop", "StopIteration", "StopIteration: an iterator ran dry"),
        ("chained", f"{__name__}._BillingError", "_BillingError: posting failed"),
    ],
)
async def test_a_sync_handlers_traceback_keeps_its_own_frames_whatever_it_raises(
    queue: QueueFixture, kind: str, error_type: str, last_line: str
) -> None:
    """The recorded traceback holds the handler's frames, not only the executor's.

    Crossing a future, CPython replaces a ``TimeoutError`` (and asyncio refuses a
    ``StopIteration``): the exception is taken inside the thread, so what is recorded is
    what the handler raised, with every frame of its code.
    """
    dsn, schema, conn = queue
    task: Task[Any] = Task(f"invoice-{kind}")

    def post_invoice(ctx: JobContext, args: Any) -> None:
        _read_invoice(args)

    done = await enqueue(conn, task, kind, schema=schema)
    worker = worker_for(dsn, schema)
    worker.register(task, post_invoice)
    async with running(worker):
        await wait_until(lambda: worker.stats.failed == 1)
    run = await run_state(conn, done.id, schema=schema)
    assert run.state.value == "failed"
    (attempt,) = run.history
    assert attempt.error_type == error_type
    tb = attempt.traceback
    assert tb is not None
    assert "in post_invoice" in tb  # the handler's frame
    assert "in _read_invoice" in tb  # and the frame below it that raised
    assert "run_in_executor" not in tb
    assert tb.rstrip().endswith(last_line)
    if kind == "chained":
        assert "ConnectionResetError: the ledger hung up" in tb
        assert "direct cause" in tb
