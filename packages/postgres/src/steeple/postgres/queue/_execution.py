"""Handler execution: what a handler sees (:class:`JobContext`), running it, its outcome.

A handler is an ``async def`` (run on the event loop) or a plain ``def`` (run in the
worker's bounded thread pool, with the same context); :func:`check_handler` refuses at
registration what cannot run. A handler's return is a success (buffered for the
completion flusher); a :class:`~steeple.postgres.queue.JobError` or any other exception
is a failure, turned here into the text and retry time the completion room records. So is
a ``BaseException`` the handler raises (``SystemExit``, ``KeyboardInterrupt``,
``GeneratorExit``, a ``CancelledError`` nobody asked for): it fails that task alone, and
the worker goes on. When the drain's deadline passes, running handlers are cancelled and
their tasks handed back (a thread cannot be interrupted: its ``ctx.lease_lost`` is set so
it can stop, and its task is handed back at once); a coroutine that ignores the
cancellation is closed after a short grace, so it cannot keep the worker from stopping.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import functools
import inspect
import logging
import math
import signal
import threading
import time
import traceback
import uuid
from collections.abc import Awaitable, Callable, Iterable, Mapping
from datetime import datetime, timedelta
from types import CodeType
from typing import Any, Final, Generic, TypeVar

import attrs

from steeple.core.backoff import Backoff
from steeple.core.tasks import FailureVerdict, failure_outcome
from steeple.core.tasks import TaskFailureKind as FailureKind
from steeple.postgres.queue import _metrics, _tracing
from steeple.postgres.queue._completions import Completions
from steeple.postgres.queue._failures import Failure, describe, log_failure, noted, verdict_note
from steeple.postgres.queue._inflight import Claimed
from steeple.postgres.queue._json import storable_json
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
from steeple.postgres.queue.tasks import Task

__all__ = [
    "MAX_RESULT_BYTES",
    "Executor",
    "Handler",
    "JobContext",
    "Registration",
    "check_handler",
    "decode_args",
    "encode_result",
    "judge_failure",
    "settle_failure",
]

A = TypeVar("A")
Handler = Callable[["JobContext", A], Awaitable[object] | object]
"""A handler: ``async def handle(ctx: JobContext, args)`` (run on the event loop) or
``def handle(ctx: JobContext, args)`` (run in the worker's thread pool)."""

MAX_RESULT_BYTES: Final = 64 * 1024
"""A handler's result is limited to 64 KiB of JSON (as the database stores it)."""
_MAX_PROGRESS_MESSAGE: Final = 200
# Makes a context's events on first use (rare, and never twice for one context).
_EVENTS_MADE: Final = threading.Lock()
# The stored progress column allows 8 KiB; a fraction and 200 characters take under 1.2 KiB.
_MAX_PROGRESS_BYTES: Final = 8192


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
    # Made on first use (most attempts never look at them): see the properties below.
    _lease_lost: asyncio.Event | None = attrs.field(default=None, alias="lease_lost", repr=False)
    _cancelled: asyncio.Event | None = attrs.field(default=None, alias="cancelled", repr=False)
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
        # -0.0 is 0.0 here: the database has no negative zero, and the fraction means none.
        shown: dict[str, object] = {"fraction": value + 0.0}
        if message is not None:
            shown["message"] = check_text(
                message, "progress message", max_len=_MAX_PROGRESS_MESSAGE
            )
        text = storable_json(
            shown, QueueConfigurationError, "progress", _MAX_PROGRESS_BYTES, "a fraction and text"
        )
        previous = self._progress
        self._progress = (1 if previous is None else previous[0] + 1, text)
        notify = self._on_progress
        if notify is not None:
            notify()

    @property
    def lease_lost(self) -> asyncio.Event:
        """Set when the worker no longer holds the lease (see the class docstring)."""
        event = self._lease_lost
        return event if event is not None else self._made("_lease_lost")

    @property
    def cancelled(self) -> asyncio.Event:
        """Set (with ``lease_lost``) when the task was cancelled."""
        event = self._cancelled
        return event if event is not None else self._made("_cancelled")

    def _made(self, slot: str) -> asyncio.Event:
        # First use, from the loop or a handler's thread: one event, whoever asks first.
        with _EVENTS_MADE:
            event: asyncio.Event | None = getattr(self, slot)
            if event is None:
                event = asyncio.Event()
                setattr(self, slot, event)
            return event

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
        # The awaitable each running async handler returned (closed if it ignores a hard
        # stop), and the attempts given up on that way: nothing of theirs is recorded.
        self._awaiting: dict[Claimed, Awaitable[object]] = {}
        self._abandoned: set[Claimed] = set()

    def cancel_all(self) -> None:
        """Cancel every running handler; their tasks are handed back (the drain timed out).

        A handler running in a thread cannot be interrupted: its ``ctx.lease_lost`` is set
        (as for every handler) so it can see that whatever it does next is not recorded;
        its task is handed back at once, and the thread is left to end on its own.
        """
        self._hard_stop = True
        for claimed in list(self._env.inflight.running.values()):
            claimed.ctx.lease_lost.set()
        for task in list(self._env.inflight.tasks.values()):
            task.cancel()

    def close_stubborn(self) -> int:
        """Give up on the handlers still running after :meth:`cancel_all`; return how many.

        Their tasks are handed back, and each coroutine is closed (``GeneratorExit`` is
        raised where it waits) so that it cannot keep the worker, or the event loop, from
        stopping. One that ignores even that is left running, and nothing it does later is
        recorded (the lease it held is released, so any outcome it wrote would be fenced).
        """
        inflight = self._env.inflight
        stubborn = list(inflight.running.items())
        for task_id, claimed in stubborn:
            self._abandoned.add(claimed)
            self._completions.hand_back(claimed)
            awaiting = self._awaiting.pop(claimed, None)
            close = getattr(awaiting, "close", None)
            if callable(close):
                try:
                    close()
                except Exception as exc:  # it ignored GeneratorExit, or its cleanup failed
                    LOG.error(
                        "task %s (%s): its handler ignored the hard stop and could not be "
                        "closed (%s); it is left running, and nothing it does is recorded",
                        task_id,
                        claimed.ctx.task_name,
                        type(exc).__name__,
                    )
            running = inflight.tasks.get(task_id)
            if running is not None:
                # Wakes the attempt, which sees its closed handler and ends unrecorded.
                running.cancel()
            inflight.remove(task_id)
        return len(stubborn)

    async def _in_thread(
        self, registration: Registration[Any], claimed: Claimed, args: Any
    ) -> object:
        """Run a plain ``def`` handler in the thread pool (an async one is awaited on the loop).

        What it raises comes back as a :class:`_Raised` (never through the future: asyncio
        refuses some exceptions there, such as ``StopIteration``).
        """
        loop = asyncio.get_running_loop()
        # The thread sees the context variables of this run (its tracing span among them).
        value = await loop.run_in_executor(
            self._threads,
            functools.partial(
                _call_in_thread,
                contextvars.copy_context(),
                registration.handler,
                claimed.ctx,
                args,
            ),
        )
        if inspect.isawaitable(value):
            # A plain function that returns an awaitable (a lambda around a coroutine, a
            # decorator that hid ``async``): the awaitable runs on the loop.
            value = await self._awaited(claimed, value)
        return value

    async def _awaited(self, claimed: Claimed, awaitable: Awaitable[object]) -> object:
        self._awaiting[claimed] = awaitable
        try:
            return await awaitable
        finally:
            self._awaiting.pop(claimed, None)

    async def execute(self, claimed: Claimed, inst: _metrics.QueueInstruments | None) -> None:
        """Run ``claimed``'s handler and record its outcome.

        ``inst``: the instruments to measure its run time with (None: metrics are off).
        """
        ctx = claimed.ctx
        registration = self._registry[ctx.task_name]
        if self._progress is not None:
            self._progress.attach(claimed)
        started = time.monotonic()
        try:
            outcome = await self._attempt(registration, claimed, asyncio.current_task())
            if outcome is None or claimed in self._abandoned:
                return  # handed back at the hard stop: its late outcome is not recorded
            if inst is not None:
                inst.run_time.record(
                    time.monotonic() - started, _metrics.task_attributes(ctx.task_name, ctx.queue)
                )
            error, result = outcome
            if error is None:
                self._completions.succeeded(claimed, result)
            else:
                await self._failed(claimed, *judge_failure(error, registration.task))
        finally:
            self._env.inflight.remove(ctx.task_id)

    async def _attempt(
        self,
        registration: Registration[Any],
        claimed: Claimed,
        me: asyncio.Task[Any] | None,
    ) -> tuple[BaseException | None, str | None] | None:
        """Run the handler once: its error, or its result as stored text.

        ``None``: the attempt is not to be recorded (abandoned, or handed back at a hard
        stop). Raises a cancellation or failure that came from outside the handler.
        """
        try:
            args = decode_args(registration.task, claimed.args_text)
            if registration.run_async:
                value = await self._awaited(claimed, registration.handler(claimed.ctx, args))  # type: ignore[arg-type]
            else:
                value = await self._in_thread(registration, claimed, args)
            if isinstance(value, _Raised):
                return value.error, None
            return None, encode_result(claimed.ctx.task_name, value)
        except asyncio.CancelledError as exc:
            if claimed in self._abandoned:
                return None
            if self._hard_stop:
                self._completions.hand_back(claimed)
                return None
            if me is not None and me.cancelling():
                raise  # the worker's owner cancelled it: not this handler's failure
            return exc, None  # the handler raised it, and nobody cancelled it
        except BaseException as exc:
            if _from_outside(exc, me):
                raise
            # A handler's failure is data, recorded on the task, whatever it raised
            # (SystemExit, KeyboardInterrupt, GeneratorExit included).
            return exc, None

    async def _failed(
        self,
        claimed: Claimed,
        exc: BaseException,
        kind: FailureKind,
        delay: timedelta | None,
        retries_unexpected: bool,
    ) -> None:
        ctx = claimed.ctx
        _tracing.record_failure(exc)  # on the run's span, when tracing is active
        failure, retry_after, verdict = settle_failure(
            exc,
            kind,
            delay,
            ctx,
            claimed.backoff,
            self._env.clock.now,
            self._env.random.random,
            retries_unexpected=retries_unexpected,
            secrets=self._env.secrets,
        )
        if retry_after is not None:
            # An expected retry is one line: its traceback is in the attempt history.
            attempt = f"attempt {ctx.attempt}/{ctx.max_attempts}"
            what = f"retries in {retry_after.total_seconds():.3f} s"
        else:
            # No "n/max" here: it would promise retries that never come. The handler's own
            # verdict (JobError.permanent) says so here; the others say why in the summary.
            attempt = f"attempt {ctx.attempt}"
            what = "failed, not retried" if verdict is FailureVerdict.VERDICT else "failed"
        # The task's identity and the handler's own exception, with its traceback when it
        # failed for good on something unexpected (a JobError is the handler's deliberate
        # verdict: its message says it, and its traceback is in the attempt history);
        # never the task's args. The traceback logged is the recorded, scrubbed one.
        log_failure(
            LOG,
            logging.WARNING if retry_after is not None else logging.ERROR,
            "task %s (%s) %s, run %s, %s: %s",
            (ctx.task_id, ctx.task_name, attempt, ctx.run_id, what, failure.summary),
            failure,
            with_traceback=retry_after is None and not isinstance(exc, JobError),
            extra={
                "task_id": ctx.task_id,
                "task_name": ctx.task_name,
                "attempt": ctx.attempt,
                "run_id": str(ctx.run_id),
            },
        )
        await self._completions.failed(claimed, failure, retry_after)


def decode_args(task: Task[A], args_text: str) -> A:
    """Decode a claimed task's stored args for its handler.

    Raises:
        _Terminal: the stored args no longer fit the args type (running again cannot help).
    """
    try:
        return task.decode(args_text)
    except ArgsEncodingError as exc:
        raise _Terminal(exc) from exc


def judge_failure(
    error: BaseException, task: Task[Any]
) -> tuple[BaseException, FailureKind, timedelta | None, bool]:
    """Return what a handler's failure amounts to, for :func:`settle_failure`.

    That is the exception to record, what kind of failure it is, the delay it asked for
    (``None``: the task's backoff decides) and whether the task retries unexpected
    exceptions. A :class:`JobError` says itself whether it wants a retry; a result that
    cannot be stored, or args that no longer decode, fail for good (running again gives the
    same); any other exception is unexpected, retried only when the task opted in with a
    :class:`RetryPolicy`.
    """
    retries_unexpected = task.retry is not None
    if isinstance(error, JobError):
        kind = FailureKind.RETRY_ASKED if error.retryable else FailureKind.VERDICT
        return error, kind, error.delay, retries_unexpected
    if isinstance(error, ResultEncodingError):
        return error, FailureKind.VERDICT, None, retries_unexpected
    if isinstance(error, _Terminal):
        return error.error, FailureKind.VERDICT, None, retries_unexpected
    return error, FailureKind.UNEXPECTED, None, retries_unexpected


def settle_failure(
    exc: BaseException,
    kind: FailureKind,
    delay: timedelta | None,
    ctx: JobContext,
    backoff: Backoff,
    now: Callable[[], datetime],
    draw: Callable[[], float],
    *,
    retries_unexpected: bool,
    secrets: Iterable[str] = (),
) -> tuple[Failure, timedelta | None, FailureVerdict]:
    """Return what is recorded of a failed attempt, how long until it runs again, and why.

    Whether it runs again is decided once, in core (:func:`~steeple.core.tasks.failure_outcome`);
    ``None`` for the delay means it fails for good, and the recorded summary then says why
    (attempts exhausted, or a plain exception, which is terminal), so the log line,
    ``run_state``, the CLI and the dashboard all tell the same decision. ``secrets`` (the
    worker's own, see :func:`describe`) are masked in what is recorded.
    """
    instant = now()
    outcome = failure_outcome(
        kind,
        retries_unexpected=retries_unexpected,
        attempt=ctx.attempt,
        max_attempts=ctx.max_attempts,
        backoff=backoff,
        now=instant,
        draw=draw(),
    )
    failure = noted(
        describe(exc, secrets), verdict_note(outcome.verdict, ctx.attempt, ctx.max_attempts)
    )
    if outcome.retry and outcome.run_at is not None:
        return failure, delay if delay is not None else outcome.run_at - instant, outcome.verdict
    return failure, None, outcome.verdict


class _Terminal(Exception):
    """Carries a failure that fails the task for good whatever its retry policy."""

    def __init__(self, error: BaseException) -> None:
        super().__init__()
        self.error = error


@attrs.frozen
class _Raised:
    """What a plain ``def`` handler raised in its thread."""

    error: BaseException


def _call_in_thread(
    context: contextvars.Context, handler: Callable[..., object], ctx: JobContext, args: Any
) -> object:
    """Call a plain ``def`` handler in its thread; return what it raised as a :class:`_Raised`.

    Signals are handled in the main thread only, so whatever a handler raises in its
    thread (``SystemExit`` from ``sys.exit()``, ``KeyboardInterrupt`` included) is its own.
    """
    try:
        return context.run(handler, ctx, args)
    except BaseException as exc:  # the handler's failure, recorded on its task
        return _Raised(exc)


def _from_outside(exc: BaseException, attempt: asyncio.Task[Any] | None) -> bool:
    """Whether ``exc`` reached a handler on the event loop from outside it.

    That is: its coroutine is being closed (``GeneratorExit`` thrown in while ``attempt``
    is not running: the loop is closing, or the task was dropped), or a signal handler of
    this process raised it where the handler was (a real Ctrl-C, an application's
    ``SIGTERM`` handler calling ``sys.exit()``). Anything else it raises is its own.
    """
    try:
        current = asyncio.current_task()
    except RuntimeError:  # no loop runs: the garbage collector closes the coroutine
        current = None
    if current is None or current is not attempt:
        return True
    return isinstance(exc, KeyboardInterrupt | SystemExit) and _raised_by_signal(exc)


def _raised_by_signal(exc: BaseException) -> bool:
    """Whether a signal handler raised ``exc`` (it runs in the main thread, where it lands)."""
    if threading.current_thread() is not threading.main_thread():
        return False
    if isinstance(exc, KeyboardInterrupt) and (
        signal.getsignal(signal.SIGINT) is signal.default_int_handler
    ):
        # Python's own SIGINT handler raises it wherever the main thread is, leaving no
        # frame of its own: a handler's KeyboardInterrupt cannot be told from Ctrl-C then,
        # and Ctrl-C must keep working (asyncio.run and the steeple worker command install
        # their own SIGINT handlers, which leave a frame or raise nothing).
        return True
    handlers: set[CodeType] = set()
    for signum in signal.valid_signals():
        code = _code_of(signal.getsignal(signum))
        if code is not None:
            handlers.add(code)
    return any(frame.f_code in handlers for frame, _ in traceback.walk_tb(exc.__traceback__))


def _code_of(handler: object) -> CodeType | None:
    """Return the code of a Python signal handler (a function, bound method or partial)."""
    while isinstance(handler, functools.partial):
        handler = handler.func
    handler = getattr(handler, "__func__", handler)
    code = getattr(handler, "__code__", None)
    return code if isinstance(code, CodeType) else None


def encode_result(task_name: str, value: object) -> str | None:
    """Return the JSON text stored as a handler's result (``None`` for ``None``).

    ``run_state`` returns a value equal to the one returned (tuples as lists), or the
    result is refused.

    Raises:
        ResultEncodingError: not JSON-encodable (NaN, infinity, a set, an object, a cycle,
            nesting too deep, a lone surrogate, a NUL), one that would not come back equal
            (``-0.0``, a non-str object key), or over 64 KiB of JSON as the database
            stores it (numbers written out in full: ``1e300`` takes 303 bytes).
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
