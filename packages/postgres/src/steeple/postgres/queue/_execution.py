"""Handler execution: what a handler sees (:class:`JobContext`), running it, its outcome.

A handler's return is a success (buffered for the completion flusher); a
:class:`~steeple.postgres.queue.JobError` or any other exception is a failure, turned here
into the text and retry time the completion room records. When the drain's deadline
passes, running handlers are cancelled and their tasks handed back.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from datetime import datetime, timedelta
from typing import Any, Final, Generic, TypeVar

import attrs

from steeple.core.tasks import retry_decision
from steeple.postgres.queue import _metrics, _tracing
from steeple.postgres.queue._completions import Completions
from steeple.postgres.queue._inflight import Claimed
from steeple.postgres.queue._shared import WorkerEnv
from steeple.postgres.queue._validate import DEFAULT_QUEUE, storable_text
from steeple.postgres.queue.errors import JobError, LeaseLostError
from steeple.postgres.queue.tasks import Task

__all__ = ["Executor", "Handler", "JobContext", "Registration"]

A = TypeVar("A")
Handler = Callable[["JobContext", A], Awaitable[object]]
"""An async handler: ``async def handle(ctx: JobContext, args) -> None``."""

_MAX_ERROR_TEXT: Final = 2000


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
    """A task and the handler that runs it."""

    task: Task[A]
    handler: Handler[A]


def error_text(exc: BaseException) -> str:
    """Return what is recorded of a handler's exception: type and message, bounded, storable."""
    try:
        message = str(exc)
    except Exception:  # a handler's exception whose __str__ fails is still a failure
        message = "<the exception's message could not be read>"
    text = f"{type(exc).__name__}: {message}"
    if len(text) > _MAX_ERROR_TEXT:
        text = text[: _MAX_ERROR_TEXT - 3] + "..."
    # Handlers' messages may hold NUL or lone surrogates, which PostgreSQL text cannot.
    return storable_text(text)


class Executor:
    """Runs the handler of each claimed attempt and hands its outcome to the completions."""

    def __init__(
        self,
        env: WorkerEnv,
        registry: Mapping[str, Registration[Any]],
        completions: Completions,
    ) -> None:
        self._env = env
        self._registry = registry
        self._completions = completions
        self._hard_stop = False

    def cancel_all(self) -> None:
        """Cancel every running handler; their tasks are handed back (the drain timed out)."""
        self._hard_stop = True
        for task in list(self._env.inflight.tasks.values()):
            task.cancel()

    async def execute(self, claimed: Claimed) -> None:
        """Run ``claimed``'s handler and record its outcome."""
        ctx = claimed.ctx
        registration = self._registry[ctx.task_name]
        inst = _metrics.instruments()
        attributes = _metrics.task_attributes(ctx.task_name, ctx.queue)
        started = time.monotonic()
        try:
            try:
                args = registration.task.decode(claimed.args_text)
                await registration.handler(ctx, args)
            except asyncio.CancelledError:
                if self._hard_stop:
                    self._completions.hand_back(claimed)
                    return
                raise
            except JobError as exc:
                inst.run_time.record(time.monotonic() - started, attributes)
                await self._failed(claimed, exc, exc.retryable, exc.delay)
            except Exception as exc:  # a handler's failure is data: recorded on the task
                inst.run_time.record(time.monotonic() - started, attributes)
                await self._failed(claimed, exc, False, None)
            else:
                inst.run_time.record(time.monotonic() - started, attributes)
                self._completions.succeeded(claimed)
        finally:
            self._env.inflight.remove(ctx.task_id)

    async def _failed(
        self, claimed: Claimed, exc: BaseException, retryable: bool, delay: timedelta | None
    ) -> None:
        ctx = claimed.ctx
        _tracing.record_failure(exc)  # on the run's span, when tracing is active
        text = error_text(exc)
        retry_after: timedelta | None = None
        if retryable:
            now = self._env.clock.now()
            decision = retry_decision(
                ctx.attempt, ctx.max_attempts, claimed.backoff, now, self._env.random.random()
            )
            if decision.retry and decision.run_at is not None:
                retry_after = delay if delay is not None else decision.run_at - now
            else:
                text = f"attempts exhausted ({ctx.attempt}/{ctx.max_attempts}): {text}"
        await self._completions.failed(claimed, text, retry_after)
