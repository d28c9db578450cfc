"""Handler execution: what a handler sees (:class:`JobContext`), running it, its outcome.

A handler is an ``async def`` (run on the event loop) or a plain ``def`` (run in the
worker's bounded thread pool, with the same context); :func:`check_handler` refuses at
registration what cannot run. A handler's return is a success (buffered for the
completion flusher); a :class:`~steeple.postgres.queue.JobError` or any other exception
is a failure, turned here into the text and retry time the completion room records. When
the drain's deadline passes, running handlers are cancelled and their tasks handed back
(a thread cannot be interrupted: its ``ctx.lease_lost`` is set so it can stop).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import functools
import inspect
import json
import logging
import math
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from datetime import datetime, timedelta
from typing import Any, Final, Generic, TypeVar

import attrs

from steeple.core.tasks import retry_decision
from steeple.postgres.queue import _metrics, _tracing
from steeple.postgres.queue._completions import Completions
from steeple.postgres.queue._failures import describe, log_failure
from steeple.postgres.queue._inflight import Claimed
from steeple.postgres.queue._progress import ProgressWriter
from steeple.postgres.queue._shared import LOG, WorkerEnv
from steeple.postgres.queue._validate import DEFAULT_QUEUE, check_text
from steeple.postgres.queue.errors import (
    ArgsEncodingError,
    JobError,
    LeaseLostError,
    QueueConfigurationError,
    QueueTypeError,
    ResultEncodingError,
)
from steeple.postgres.queue.tasks import Task, storable_json

__all__ = [
    "MAX_RESULT_BYTES",
    "Executor",
    "Handler",
    "JobContext",
    "Registration",
    "check_handler",
    "encode_result",
]

A = TypeVar("A")
Handler = Callable[["JobContext", A], Awaitable[object] | object]
"""A handler: ``async def handle(ctx: JobContext, args)`` (run on the event loop) or
``def handle(ctx: JobContext, args)`` (run in the worker's thread pool)."""

MAX_RESULT_BYTES: Final = 64 * 1024
"""A handler's result is limited to 64 KiB of JSON."""
_MAX_PROGRESS_MESSAGE: Final = 200


@attrs.define(eq=False)
class JobContext:
    """What a handler knows about the attempt it runs.

    Attributes:
        task_id: the task's id.
        task_name: the task's name.
        run_id: stable across attempts: the idempotency key for external side effects.
        attempt: this attempt's number (1-based).
        max_attempts: the task's snapshotted attempt limit.
        worker_id: the worker running it.
        scheduled_for: the recurring due instant, for tasks materialized from a job.
        queue: the named queue the task was claimed from.
        lease_lost: set when the worker no longer holds the lease (expired, re-claimed by
            another worker, or cancelled): stop and do not start new side effects.
        cancelled: set (with ``lease_lost``) when the task was cancelled.

    A sync handler (running in a thread) reads the events with ``is_set()`` (awaiting
    them is for the event loop); :meth:`check_lease` and :meth:`report_progress` work from
    any thread.
    """

    task_id: int
    task_name: str
    run_id: uuid.UUID
    attempt: int
    max_attempts: int
    worker_id: str
    scheduled_for: datetime | None = None
    queue: str = DEFAULT_QUEUE
    lease_lost: asyncio.Event = attrs.field(factory=asyncio.Event, repr=False)
    cancelled: asyncio.Event = attrs.field(factory=asyncio.Event, repr=False)
    # The latest progress reported: (sequence number, JSON text); the worker writes it.
    _progress: tuple[int, str] | None = attrs.field(default=None, init=False, repr=False)
    _on_progress: Callable[[], None] | None = attrs.field(default=None, init=False, repr=False)

    def report_progress(self, fraction: float, message: str | None = None) -> None:
        """Record how far this attempt is: shown by ``run_state``, the admin API and CLI.

        Non-blocking, callable from the handler's thread: the worker writes the latest
        value (within a fraction of a second, batched with other tasks', fenced by the
        lease) and with the attempt's outcome. The task keeps its latest progress after
        it ends, across retries.

        Args:
            fraction: how much is done, a finite number within [0, 1] (an int or float).
            message: what it is doing, 1..200 characters without control characters, or
                ``None``.

        Raises:
            QueueConfigurationError: ``fraction`` NaN, infinite or outside [0, 1]; a
                message empty, too long, or holding a control character or lone surrogate.
            QueueTypeError: a ``fraction`` that is not a number, a message not a str.
        """
        if isinstance(fraction, bool) or not isinstance(fraction, int | float):
            raise QueueTypeError(
                f"progress fraction must be a number within [0, 1], not {type(fraction).__name__}"
            )
        try:
            value = float(fraction)
        except OverflowError:
            value = math.inf
        if not (math.isfinite(value) and 0.0 <= value <= 1.0):
            raise QueueConfigurationError(
                f"progress fraction must be a finite number within [0, 1], got {value!r}"
            )
        shown: dict[str, object] = {"fraction": value}
        if message is not None:
            shown["message"] = check_text(
                message, "progress message", max_len=_MAX_PROGRESS_MESSAGE
            )
        text = json.dumps(shown, separators=(",", ":"), ensure_ascii=False)
        previous = self._progress
        self._progress = (1 if previous is None else previous[0] + 1, text)
        notify = self._on_progress
        if notify is not None:
            notify()

    @property
    def progress_text(self) -> str | None:
        """The latest progress reported, as the JSON text stored (``None``: none yet)."""
        latest = self._progress
        return None if latest is None else latest[1]

    def check_lease(self) -> None:
        """Raise if this worker no longer holds the task: call it before each side effect.

        Raises:
            LeaseLostError: the lease expired, another worker re-claimed the task, or it was
                cancelled (whatever the handler does next will not be recorded).
        """
        if self.lease_lost.is_set():
            why = "cancelled" if self.cancelled.is_set() else "lease lost"
            raise LeaseLostError(f"task {self.task_id}, attempt {self.attempt}: {why}")


@attrs.frozen
class Registration(Generic[A]):
    """A task and the handler that runs it (``run_async``: on the loop, else in a thread)."""

    task: Task[A]
    handler: Handler[A]
    run_async: bool


def _name_of(handler: object) -> str:
    name = getattr(handler, "__qualname__", None) or type(handler).__name__
    return name if isinstance(name, str) and len(name) <= 200 else type(handler).__name__


def check_handler(handler: object) -> bool:
    """Check that ``handler`` can run as ``handler(ctx, args)``; return whether it is async.

    ``async def`` functions (and callables whose ``__call__`` is one, and partials of
    them) run on the event loop; any other function runs in the worker's thread pool.

    Raises:
        QueueTypeError: not callable (a coroutine object, a value), a class, a generator
            or async generator function, or a callable that cannot take exactly two
            positional arguments ``(ctx, args)``.
    """
    if inspect.iscoroutine(handler) or inspect.isawaitable(handler):
        raise QueueTypeError(
            "handler is a coroutine (an awaitable), not a function: pass the function "
            "itself, e.g. register(task, handle) rather than register(task, handle(...))"
        )
    if not callable(handler):
        raise QueueTypeError(
            f"handler must be a function (ctx, args), async or not, not {type(handler).__name__}"
        )
    if isinstance(handler, type):
        raise QueueTypeError(
            f"handler must be a function (ctx, args), not the class {_name_of(handler)}"
        )
    target: Any = handler
    while isinstance(target, functools.partial):
        target = target.func
    # A callable object runs its class's __call__ (looked up by name, not to test callability).
    call = (
        target
        if inspect.isroutine(target)
        else inspect.getattr_static(type(target), "__call__", target)
    )
    if inspect.isasyncgenfunction(target) or inspect.isasyncgenfunction(call):
        raise QueueTypeError(
            f"handler {_name_of(handler)} is an async generator function (it yields): a "
            "handler runs once and returns; use return instead of yield"
        )
    if inspect.isgeneratorfunction(target) or inspect.isgeneratorfunction(call):
        raise QueueTypeError(
            f"handler {_name_of(handler)} is a generator function (it yields): a handler "
            "runs once and returns; use return instead of yield"
        )
    try:
        signature = inspect.signature(handler)
    except (TypeError, ValueError):
        signature = None  # some builtins have no signature: they are judged when they run
    except Exception as exc:  # a hostile __signature__ or __wrapped__
        raise QueueTypeError(
            f"the signature of handler {_name_of(handler)} could not be read "
            f"({type(exc).__name__}); pass a plain function (ctx, args)"
        ) from None
    if signature is not None:
        try:
            signature.bind(None, None)
        except TypeError:
            raise QueueTypeError(
                f"handler {_name_of(handler)} must take two positional arguments (ctx, args); "
                f"its signature is {_shown_signature(signature)}"
            ) from None
    return inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(call)


def _shown_signature(signature: inspect.Signature) -> str:
    text = str(signature)
    return text if len(text) <= 200 else text[:197] + "..."


class Executor:
    """Runs the handler of each claimed attempt and hands its outcome to the completions."""

    def __init__(
        self,
        env: WorkerEnv,
        registry: Mapping[str, Registration[Any]],
        completions: Completions,
        threads: concurrent.futures.Executor | None = None,
        progress: ProgressWriter | None = None,
    ) -> None:
        self._env = env
        self._registry = registry
        self._completions = completions
        self._threads = threads
        self._progress = progress
        self._hard_stop = False

    def cancel_all(self) -> None:
        """Cancel every running handler; their tasks are handed back (the drain timed out).

        A handler running in a thread cannot be interrupted: its ``ctx.lease_lost`` is set
        (as for every handler) so it can see that whatever it does next is not recorded.
        """
        self._hard_stop = True
        for claimed in list(self._env.inflight.running.values()):
            claimed.ctx.lease_lost.set()
        for task in list(self._env.inflight.tasks.values()):
            task.cancel()

    async def _run(self, registration: Registration[Any], ctx: JobContext, args: Any) -> object:
        """Run the handler: awaited on the loop, or called in the thread pool."""
        if registration.run_async:
            return await registration.handler(ctx, args)  # type: ignore[misc]
        loop = asyncio.get_running_loop()
        # The thread sees the context variables of this run (its tracing span among them).
        value = await loop.run_in_executor(
            self._threads,
            functools.partial(contextvars.copy_context().run, registration.handler, ctx, args),
        )
        if inspect.isawaitable(value):
            # A plain function that returns an awaitable (a lambda around a coroutine, a
            # decorator that hid ``async``): the awaitable runs on the loop.
            value = await value
        return value

    async def execute(self, claimed: Claimed) -> None:
        """Run ``claimed``'s handler and record its outcome."""
        ctx = claimed.ctx
        registration = self._registry[ctx.task_name]
        if self._progress is not None:
            self._progress.attach(claimed)
        inst = _metrics.instruments()
        attributes = _metrics.task_attributes(ctx.task_name, ctx.queue)
        started = time.monotonic()
        try:
            try:
                try:
                    args = registration.task.decode(claimed.args_text)
                except ArgsEncodingError as exc:
                    # Stored args that no longer fit the args type: running again cannot help.
                    raise _Terminal(exc) from exc
                value = await self._run(registration, ctx, args)
                result = encode_result(ctx.task_name, value)
            except asyncio.CancelledError:
                if self._hard_stop:
                    self._completions.hand_back(claimed)
                    return
                raise
            except JobError as exc:
                inst.run_time.record(time.monotonic() - started, attributes)
                await self._failed(claimed, exc, exc.retryable, exc.delay)
            except ResultEncodingError as exc:  # running again would return the same
                inst.run_time.record(time.monotonic() - started, attributes)
                await self._failed(claimed, exc, False, None)
            except _Terminal as wrapped:
                inst.run_time.record(time.monotonic() - started, attributes)
                await self._failed(claimed, wrapped.error, False, None)
            except Exception as exc:  # a handler's failure is data: recorded on the task
                inst.run_time.record(time.monotonic() - started, attributes)
                # Plain exceptions are terminal (seed 002) unless the task opted in.
                await self._failed(claimed, exc, registration.task.retry is not None, None)
            else:
                inst.run_time.record(time.monotonic() - started, attributes)
                self._completions.succeeded(claimed, result)
        finally:
            self._env.inflight.remove(ctx.task_id)

    async def _failed(
        self, claimed: Claimed, exc: BaseException, retryable: bool, delay: timedelta | None
    ) -> None:
        ctx = claimed.ctx
        _tracing.record_failure(exc)  # on the run's span, when tracing is active
        failure = describe(exc, self._env.secrets)
        retry_after: timedelta | None = None
        if retryable:
            now = self._env.clock.now()
            decision = retry_decision(
                ctx.attempt, ctx.max_attempts, claimed.backoff, now, self._env.random.random()
            )
            if decision.retry and decision.run_at is not None:
                retry_after = delay if delay is not None else decision.run_at - now
            else:
                failure = attrs.evolve(
                    failure,
                    summary=f"attempts exhausted ({ctx.attempt}/{ctx.max_attempts}): "
                    + failure.summary,
                )
        # The task's identity and the handler's own exception, traceback included for an
        # unexpected one (a JobError is the handler's deliberate verdict: its message says
        # it, and its traceback is in the attempt history); never the task's args.
        what = (
            f"retries in {retry_after.total_seconds():.3f} s"
            if retry_after is not None
            else "failed for good"
        )
        log_failure(
            LOG,
            logging.WARNING if retry_after is not None else logging.ERROR,
            "task %s (%s) attempt %s/%s, run %s, %s: %s",
            (
                ctx.task_id,
                ctx.task_name,
                ctx.attempt,
                ctx.max_attempts,
                ctx.run_id,
                what,
                failure.summary,
            ),
            failure,
            with_traceback=not isinstance(exc, JobError),
            extra={
                "task_id": ctx.task_id,
                "task_name": ctx.task_name,
                "attempt": ctx.attempt,
                "run_id": str(ctx.run_id),
            },
        )
        await self._completions.failed(claimed, failure, retry_after)


class _Terminal(Exception):
    """Carries a failure that fails the task for good whatever its retry policy."""

    def __init__(self, error: BaseException) -> None:
        super().__init__()
        self.error = error


def encode_result(task_name: str, value: object) -> str | None:
    """Return the JSON text stored as a handler's result (``None`` for ``None``).

    Raises:
        ResultEncodingError: not JSON-encodable (NaN, infinity, a set, an object, a cycle,
            nesting too deep, a lone surrogate, a NUL), or over 64 KiB of JSON.
    """
    if value is None:
        return None
    return storable_json(
        value,
        ResultEncodingError,
        f"the result of task {task_name!r}",
        MAX_RESULT_BYTES,
        "return JSON values (dict, list, str, int, float, bool, None) or None",
    )
