"""An in-memory work queue for unit tests: enqueue and run an :class:`App`'s tasks, no database.

.. code-block:: python

    queue = InMemoryQueue(app)
    await send_email.enqueue(queue, {"to": "ada@example.com"})  # where a connection goes
    assert [t.args for t in queue.enqueued(send_email)] == [{"to": "ada@example.com"}]
    await queue.run_until_idle()

It takes the place of the connection in every enqueue function, and runs the app's
handlers (async on the event loop, plain ``def`` in a thread) with the worker's own rules,
imported from where the worker keeps them: the JSON check of args and results, the option
snapshot (priority, attempts, backoff, dedup key, queue), how a failure is judged
(``JobError.retry`` / ``permanent``, a :class:`RetryPolicy`), core's retry decision and
backoff, core's task lifecycle table. Time is a virtual clock (:attr:`InMemoryQueue.clock`)
that moves only when told to. The claim (priority, then due time, then the order tasks
became due; queue pauses, concurrency limits and sliding-window rate limits on the virtual
clock) follows the PostgreSQL claim function, and the storage operations pass the same
conformance state machine as the PostgreSQL queue.

What it does not model: SQL-level races between concurrent claimers and transactions
(an enqueue is stored at once; there is no commit or rollback), leases held across
processes (handlers run inline, so a lease lapses only through :meth:`expire_lease`),
recurring jobs, the NOTIFY wake-ups and the schema's size checks.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import itertools
import json
import uuid
from collections.abc import Callable, Hashable, Iterable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, Final

import attrs

from steeple.core.backoff import Backoff
from steeple.core.claims import (
    KeyScope,
    KeyState,
    ScopeLimits,
    ScopeState,
    plan_claim,
    record_starts,
)
from steeple.core.tasks import (
    TERMINAL_TASK_STATES,
    TaskEvent,
    TaskState,
    lease_expiry_event,
    transition,
)
from steeple.postgres.queue._app import App, TaskFunction
from steeple.postgres.queue._execution import (
    JobContext,
    _call_in_thread,
    _from_outside,
    _Raised,
    check_handler,
    decode_args,
    encode_result,
    judge_failure,
    settle_failure,
)
from steeple.postgres.queue._failures import Failure
from steeple.postgres.queue._local import LocalQueue
from steeple.postgres.queue._ops import MAX_HISTORY, Progress, TaskAttempt, TaskRun
from steeple.postgres.queue._queues import (
    PER_KEY_ARGUMENTS,
    QueueInfo,
    TaskLimits,
    check_limits,
)
from steeple.postgres.queue._validate import (
    check_int,
    check_name,
    check_queue,
    check_task_id,
    check_timedelta,
)
from steeple.postgres.queue.errors import QueueError, QueueTypeError, TaskNotFoundError
from steeple.postgres.queue.tasks import EnqueuedTask, EnqueueOptions, Task

__all__ = ["InMemoryQueue", "MemoryClaim", "PendingTask", "VirtualClock"]

_PENDING: Final = TaskState.PENDING
_RUNNING: Final = TaskState.RUNNING
_LIVE: Final = frozenset({_PENDING, _RUNNING})
# The history outcomes the PostgreSQL queue records (TaskAttempt.outcome).
_OUTCOME: Final = {
    TaskEvent.SUCCEED: "succeeded",
    TaskEvent.FAIL_RETRYABLE: "retried",
    TaskEvent.FAIL_PERMANENT: "failed",
    TaskEvent.LEASE_EXPIRED: "lease_expired",
    TaskEvent.LEASE_EXPIRED_FINAL: "lease_expired",
}
_START: Final = datetime(2030, 1, 1, tzinfo=UTC)


class VirtualClock:
    """The in-memory queue's time: it moves only by :meth:`advance` or :meth:`set`.

    A :class:`~steeple.core.ports.Clock` (``now()``), so code under test can share it.
    """

    def __init__(self, start: datetime = _START) -> None:
        if not isinstance(start, datetime) or start.utcoffset() is None:
            raise QueueTypeError("the clock's start must be an aware datetime")
        self._now = start.astimezone(UTC)

    def now(self) -> datetime:
        """Return the current virtual instant (UTC)."""
        return self._now

    def advance(self, delta: timedelta) -> datetime:
        """Move forward by ``delta`` (>= 0); return the new instant.

        Raises:
            QueueConfigurationError: a negative ``delta``.
            QueueTypeError: not a timedelta.
        """
        check_timedelta(delta, "delta", timedelta(0), timedelta.max)
        self._now += delta
        return self._now

    def set(self, instant: datetime) -> datetime:
        """Move forward to ``instant`` (never back); return the new instant.

        Raises:
            QueueConfigurationError: ``instant`` is before now.
            QueueTypeError: not an aware datetime.
        """
        if not isinstance(instant, datetime) or instant.utcoffset() is None:
            raise QueueTypeError("set() needs an aware datetime")
        return self.advance(instant.astimezone(UTC) - self._now)


@attrs.frozen
class PendingTask:
    """A task waiting to run, with its args as its handler will receive them.

    Attributes:
        id: the task id.
        task_name: the task's name.
        args: the decoded args (an instance of the task's args type, or plain JSON values).
        queue: the named queue it waits in.
        priority: higher runs first.
        run_at: when it is (or becomes) due, on the queue's clock.
        attempts: attempts already made (more than 0 after a retry).
        dedup_key: its dedup key, if any.
    """

    id: int
    task_name: str
    args: Any
    queue: str
    priority: int
    run_at: datetime
    attempts: int
    dedup_key: str | None


@attrs.frozen
class MemoryClaim:
    """One task a claim took: its id, the attempt it now runs, and its lease token."""

    task_id: int
    attempt: int
    token: uuid.UUID = attrs.field(repr=False)


@attrs.define(eq=False)
class _Stored:
    id: int
    task_name: str
    args_text: str
    queue: str
    priority: int
    run_at: datetime
    created_at: datetime
    max_attempts: int
    lease_duration: timedelta
    backoff: Backoff
    dedup_key: str | None
    order: int
    limit_key: str | None = None
    run_id: uuid.UUID = attrs.field(factory=uuid.uuid4)
    state: TaskState = _PENDING
    attempts: int = 0
    lease_token: uuid.UUID | None = attrs.field(default=None, repr=False)
    lease_expires_at: datetime | None = None
    worker_id: str | None = None
    started_at: datetime | None = None
    finished_at: datetime | None = None
    last_error: str | None = None
    result_text: str | None = None
    progress_text: str | None = None
    history: list[TaskAttempt] = attrs.field(factory=list)
    ctx: JobContext | None = None


@attrs.define
class _Limits:
    paused: bool = False
    max_running: int | None = None
    rate_limit: int | None = None
    rate_period: timedelta | None = None
    # The start instants inside the last rate_period (the sliding-window log the database
    # keeps in settings.recent_starts).
    starts: list[datetime] = attrs.field(factory=list)
    per_key: tuple[int | None, int | None, timedelta | None] = (None, None, None)
    # Each key's start instants inside the last per-key period (the database's key_starts).
    key_starts: dict[str, list[datetime]] = attrs.field(factory=dict)

    def set(
        self,
        max_running: int | None,
        rate_limit: int | None,
        rate_period: timedelta | None,
        per_key: tuple[int | None, int | None, timedelta | None] = (None, None, None),
    ) -> None:
        self.max_running = max_running
        self.rate_limit = rate_limit
        self.rate_period = rate_period
        self.per_key = per_key
        if rate_limit is None:
            self.starts = []  # as the database clears its log when the rate limit goes
        if per_key[1] is None:
            self.key_starts = {}

    def scope(self, running: int) -> ScopeState:
        """Return these settings with ``running`` tasks, as the core's claim rule reads them."""
        limits = ScopeLimits(
            self.paused, self.max_running, self.rate_limit, self.rate_period, *self.per_key
        )
        return ScopeState(limits, running, tuple(self.starts))

    def record(self, now: datetime, count: int) -> None:
        if self.rate_period is not None and count > 0:
            self.starts = list(record_starts(self.starts, self.rate_period, now, count))

    def record_key(self, now: datetime, key: str, count: int) -> None:
        period = self.per_key[2]
        if period is not None:
            self.key_starts[key] = list(
                record_starts(self.key_starts.get(key, []), period, now, count)
            )


class InMemoryQueue(LocalQueue):
    """An :class:`App`'s work queue held in memory, for unit tests.

    Pass it where code passes a connection: ``await my_task.enqueue(queue, args)`` (also
    ``enqueue_sync``, ``enqueue_many`` and the module-level functions). Then inspect
    :meth:`enqueued`, run the handlers with :meth:`run_until_idle`, and read outcomes with
    :meth:`run_state`.

    Args:
        app: the tasks and handlers it runs (its ``schema`` is the one enqueues must name).
        start: the virtual clock's first instant (default 2030-01-01T00:00Z).
        worker_id: the worker name handlers see in ``ctx.worker_id``.
        random: the jitter draw in [0, 1) of each retry (default: always 0, so a retry
            waits the policy's full delay).

    Raises:
        QueueTypeError: ``app`` is not an :class:`App`; ``start`` not an aware datetime.
        QueueConfigurationError: an invalid ``worker_id``.
    """

    def __init__(
        self,
        app: App,
        *,
        start: datetime = _START,
        worker_id: str = "in-memory",
        random: Callable[[], float] | None = None,
    ) -> None:
        if not isinstance(app, App):
            raise QueueTypeError(f"InMemoryQueue needs an App, not {type(app).__name__}")
        self.app = app
        self.schema = app.schema
        self.clock = VirtualClock(start)
        self.worker_id = check_name(worker_id, "worker_id")
        self._random = random if random is not None else _no_jitter
        self._tasks: dict[int, _Stored] = {}
        self._ids = itertools.count(1)
        self._order = itertools.count(1)
        self._queues: dict[str, _Limits] = {}
        self._names: dict[str, _Limits] = {}
        # What the last claim says a rate limit held back: when a start frees up (the
        # "held" row's run_at of the database's claim), else None.
        self._rate_frees_at: datetime | None = None

    def __repr__(self) -> str:
        return f"InMemoryQueue(schema={self.schema!r}, tasks={len(self._tasks)})"

    # --- what the enqueue functions call (args already checked and encoded) -------------

    def store(self, task: Task[Any], args_text: str, options: EnqueueOptions) -> EnqueuedTask:
        """Store one task (the enqueue functions call this; use them instead)."""
        if options.dedup_key is not None:
            for stored in self._tasks.values():
                if (
                    stored.state in _LIVE
                    and stored.task_name == task.name
                    and stored.dedup_key == options.dedup_key
                ):
                    return EnqueuedTask(stored.id, deduplicated=True)
        return EnqueuedTask(self._insert(task, args_text, options))

    def store_many(
        self, task: Task[Any], args_texts: Sequence[str], options: EnqueueOptions
    ) -> list[int]:
        """Store many tasks (``enqueue_many`` calls this; use it instead)."""
        return [self._insert(task, text, options) for text in args_texts]

    def _insert(self, task: Task[Any], args_text: str, options: EnqueueOptions) -> int:
        priority, max_attempts, lease, b_init, b_max, b_factor, b_jitter = options.snapshot(task)
        now = self.clock.now()
        if options.run_at is not None:
            run_at = options.run_at
        elif options.delay is not None:
            run_at = now + options.delay
        else:
            run_at = now
        task_id = next(self._ids)
        self._tasks[task_id] = _Stored(
            id=task_id,
            task_name=task.name,
            args_text=args_text,
            queue=options.queue,
            priority=priority,
            run_at=run_at,
            created_at=now,
            max_attempts=max_attempts,
            lease_duration=lease,
            backoff=Backoff(
                initial=timedelta(microseconds=b_init),
                maximum=timedelta(microseconds=b_max),
                factor=b_factor,
                jitter=b_jitter,
            ),
            dedup_key=options.dedup_key,
            limit_key=options.limit_key,
            order=next(self._order),
        )
        return task_id

    # --- inspection ----------------------------------------------------------------------

    def enqueued(
        self, task: TaskFunction[Any] | Task[Any] | str | None = None, queue: str | None = None
    ) -> list[PendingTask]:
        """Return the pending tasks (due or not), in the order a claim takes them.

        Args:
            task: only tasks of this name (an ``@app.task`` function, a :class:`Task`, or
                the name).
            queue: only tasks waiting in this named queue.

        Raises:
            QueueTypeError: ``task`` or ``queue`` of the wrong type.
        """
        name = _task_name(task)
        if queue is not None:
            check_queue(queue)
        found = [
            s
            for s in self._tasks.values()
            if s.state is _PENDING
            and (name is None or s.task_name == name)
            and (queue is None or s.queue == queue)
        ]
        found.sort(key=_claim_order)
        return [
            PendingTask(
                id=s.id,
                task_name=s.task_name,
                args=self._decoded(s),
                queue=s.queue,
                priority=s.priority,
                run_at=s.run_at,
                attempts=s.attempts,
                dedup_key=s.dedup_key,
            )
            for s in found
        ]

    def _decoded(self, stored: _Stored) -> Any:
        declared = self._declared(stored.task_name)
        if declared is None:
            return json.loads(stored.args_text)
        return declared.task.decode(stored.args_text)

    def _declared(self, name: str) -> TaskFunction[Any] | None:
        for function in self.app.tasks:
            if function.name == name:
                return function
        return None

    def run_state(self, task_id: int, *, history: int = 50) -> TaskRun:
        """Return the task as :func:`~steeple.postgres.queue.run_state` does (result, history).

        ``await queue.run_state(memory, task_id)`` (the module function) answers the same.

        Args:
            task_id: the task id.
            history: how many of its latest attempts to return (0..1000).

        Raises:
            TaskNotFoundError: no such task (never enqueued, or pruned).
        """
        check_int(history, "history", 0, MAX_HISTORY)
        return _run(self._get(task_id), history)

    def tasks(self, state: TaskState | None = None) -> list[TaskRun]:
        """Return every stored task (or those in ``state``), by id."""
        stored = sorted(self._tasks.values(), key=lambda s: s.id)
        return [_run(s, MAX_HISTORY) for s in stored if state is None or s.state is state]

    def _get(self, task_id: int) -> _Stored:
        check_task_id(task_id)
        stored = self._tasks.get(task_id)
        if stored is None:
            raise TaskNotFoundError(task_id)
        return stored

    # --- settings ------------------------------------------------------------------------

    def pause_queue(self, queue: str) -> QueueInfo:
        """Pause ``queue``: no claim takes from it until :meth:`resume_queue`."""
        self._queues.setdefault(check_queue(queue), _Limits()).paused = True
        return self._info(queue)

    def resume_queue(self, queue: str) -> QueueInfo:
        """Resume a paused ``queue`` (idempotent)."""
        self._queues.setdefault(check_queue(queue), _Limits()).paused = False
        return self._info(queue)

    def limit_queue(
        self,
        queue: str,
        *,
        max_running: int | None = None,
        rate_limit: int | None = None,
        per: float | timedelta | None = None,
        max_running_per_key: int | None = None,
        rate_limit_per_key: int | None = None,
        per_key: float | timedelta | None = None,
    ) -> QueueInfo:
        """Set ``queue``'s limits, as :func:`~steeple.postgres.queue.limit_queue` does.

        ``None`` removes a limit. A rate limit allows ``rate_limit`` starts in any window
        of ``per`` on the virtual clock: a start counts while it is less than ``per`` old,
        so one made exactly ``per`` ago no longer does. Changing the limits keeps the
        starts already made, unless the rate limit is removed.

        Raises:
            QueueConfigurationError: a limit out of range, ``rate_limit`` without ``per``
                (or the reverse), as for ``limit_queue``.
            QueueTypeError: a value of the wrong type.
        """
        check_queue(queue)
        running, rate, period = check_limits(max_running, rate_limit, per)
        keyed = check_limits(
            max_running_per_key, rate_limit_per_key, per_key, what=PER_KEY_ARGUMENTS
        )
        self._queues.setdefault(queue, _Limits()).set(running, rate, period, keyed)
        return self._info(queue)

    def limit_task(
        self,
        task_name: str,
        *,
        max_running: int | None = None,
        rate_limit: int | None = None,
        per: float | timedelta | None = None,
        max_running_per_key: int | None = None,
        rate_limit_per_key: int | None = None,
        per_key: float | timedelta | None = None,
    ) -> TaskLimits:
        """Set the limits of the tasks named ``task_name``, in all queues together.

        As :func:`~steeple.postgres.queue.limit_task` does; the rate limit's window is
        the one :meth:`limit_queue` describes.

        Raises:
            QueueConfigurationError: a limit out of range, ``rate_limit`` without ``per``
                (or the reverse), as for ``limit_task``.
            QueueTypeError: a value of the wrong type.
        """
        check_name(task_name, "task_name")
        running, rate, period = check_limits(max_running, rate_limit, per)
        keyed = check_limits(
            max_running_per_key, rate_limit_per_key, per_key, what=PER_KEY_ARGUMENTS
        )
        self._names.setdefault(task_name, _Limits()).set(running, rate, period, keyed)
        return TaskLimits(task_name, running, rate, period, *keyed)

    def _info(self, queue: str) -> QueueInfo:
        limits = self._queues.get(queue, _Limits())
        held = [s.state for s in self._tasks.values() if s.queue == queue]
        return QueueInfo(
            queue,
            limits.paused,
            limits.max_running,
            limits.rate_limit,
            limits.rate_period,
            held.count(_PENDING),
            held.count(_RUNNING),
            max_running_per_key=limits.per_key[0],
            rate_limit_per_key=limits.per_key[1],
            rate_period_per_key=limits.per_key[2],
        )

    # --- the storage operations (what a worker does, one step at a time) -----------------

    def claim(
        self,
        limit: int,
        *,
        queues: Iterable[str] | None = None,
        names: Iterable[str] | None = None,
        deadline: datetime | None = None,
    ) -> list[MemoryClaim]:
        """Claim up to ``limit`` due pending tasks, as the database's claim does.

        Per queue (in the order given): nothing from a paused queue; at most its
        ``max_running`` minus what of it runs, and its ``rate_limit`` minus its starts in
        the window; task names with a limit first, each within its own, then the others;
        highest priority first, then earliest due, then the order they became due. Each
        claim counts an attempt, issues a new lease token, and counts a start now in the
        rate windows of its queue and name. :attr:`rate_frees_at` then says when a rate
        limit that held work back frees a start.

        Args:
            limit: the most tasks to take (1..1000).
            queues: the queues to take from (default: every queue, by name).
            names: the task names this worker runs (default: any).
            deadline: the claimer's give-up time: at or after it, nothing is taken.
        """
        check_int(limit, "limit", 1, 1000)
        now = self.clock.now()
        self._rate_frees_at = None
        if deadline is not None and now >= deadline:
            return []
        allowed = None if names is None else frozenset(_names(names, "names"))
        order = (
            sorted({s.queue for s in self._tasks.values()})
            if queues is None
            else _names(queues, "queues")
        )
        running_by_queue = _count(s.queue for s in self._running())
        running_by_name = _count(s.task_name for s in self._running())
        due = sorted(
            (
                s
                for s in self._tasks.values()
                if s.queue in order
                and s.state is _PENDING
                and s.run_at <= now
                and (allowed is None or s.task_name in allowed)
            ),
            key=_claim_order,
        )
        plan = plan_claim(
            [(queue, limit) for queue in order],
            due,
            queues={q: lim.scope(running_by_queue.get(q, 0)) for q, lim in self._queues.items()},
            names={
                n: lim.scope(running_by_name.get(n, 0))
                for n, lim in self._names.items()
                if allowed is None or n in allowed
            },
            now=now,
            total=limit,
            keys=self._key_states(),
        )
        taken = list(plan.started)
        self._record_keys(now, taken)
        for queue, count in _count(s.queue for s in taken).items():
            if queue in self._queues:
                self._queues[queue].record(now, count)
        for name, count in _count(s.task_name for s in taken).items():
            if name in self._names:
                self._names[name].record(now, count)
        if plan.held:
            self._rate_frees_at = plan.frees_at
        claims = []
        for stored in taken:
            stored.state = transition(stored.state, TaskEvent.CLAIM)
            stored.attempts += 1
            stored.lease_token = uuid.uuid4()
            stored.lease_expires_at = now + stored.lease_duration
            stored.worker_id = self.worker_id
            stored.started_at = now
            claims.append(MemoryClaim(stored.id, stored.attempts, stored.lease_token))
        return claims

    @property
    def rate_frees_at(self) -> datetime | None:
        """When a rate limit that held back part of the last claim frees a start, else None.

        The instant the oldest start in a full window leaves it (the database's claim
        returns the same as its "held" row's ``run_at``; a worker claims again then).
        """
        return self._rate_frees_at

    def _key_states(self) -> dict[KeyScope, KeyState]:
        """Return what runs and started per key of every scope, as the claim rule reads them."""
        running: dict[KeyScope, int] = {}
        for s in self._running():
            if s.limit_key is not None:
                for k in (("queue", s.queue, s.limit_key), ("task", s.task_name, s.limit_key)):
                    running[k] = running.get(k, 0) + 1
        states = {k: KeyState(running=n) for k, n in running.items()}
        for kind, scopes in (("queue", self._queues), ("task", self._names)):
            for name, lim in scopes.items():
                for key, starts in lim.key_starts.items():
                    k = (kind, name, key)
                    states[k] = KeyState(running.get(k, 0), tuple(starts))
        return states

    def _record_keys(self, now: datetime, taken: list[_Stored]) -> None:
        for s in taken:
            if s.limit_key is None:
                continue
            for lim in (self._queues.get(s.queue), self._names.get(s.task_name)):
                if lim is not None:
                    lim.record_key(now, s.limit_key, 1)

    def _running(self) -> list[_Stored]:
        return [s for s in self._tasks.values() if s.state is _RUNNING]

    def _held(self, task_id: int, token: Hashable) -> _Stored | None:
        stored = self._tasks.get(task_id)
        if stored is None or stored.lease_token is None or stored.lease_token != token:
            return None
        return stored

    def renew(self, task_id: int, token: Hashable) -> bool:
        """Extend a running task's lease; ``True`` if ``token`` is its current one."""
        stored = self._held(task_id, token)
        if stored is None:
            return False
        stored.lease_expires_at = self.clock.now() + stored.lease_duration
        return True

    def complete(self, task_id: int, token: Hashable, result_text: str | None = None) -> bool:
        """Record success (``result_text``: the result's stored JSON); ``True`` if fenced in."""
        stored = self._held(task_id, token)
        if stored is None:
            return False
        self._end(stored, TaskEvent.SUCCEED, None)
        stored.result_text = result_text
        return True

    def retry(
        self, task_id: int, token: Hashable, delay: timedelta, failure: Failure | None = None
    ) -> bool:
        """Record a retryable failure due again after ``delay``; ``True`` if fenced in."""
        stored = self._held(task_id, token)
        if stored is None:
            return False
        self._end(stored, TaskEvent.FAIL_RETRYABLE, failure)
        stored.run_at = self.clock.now() + delay
        stored.worker_id = None
        stored.order = next(self._order)  # due again behind everything already waiting
        return True

    def fail(self, task_id: int, token: Hashable, failure: Failure | None = None) -> bool:
        """Record a permanent failure; ``True`` if fenced in."""
        stored = self._held(task_id, token)
        if stored is None:
            return False
        self._end(stored, TaskEvent.FAIL_PERMANENT, failure)
        return True

    def _end(self, stored: _Stored, event: TaskEvent, failure: Failure | None) -> None:
        """Move a running task on by ``event``, dropping its lease and recording the attempt."""
        now = self.clock.now()
        stored.state = transition(stored.state, event)
        stored.history.append(
            TaskAttempt(
                attempt=stored.attempts,
                outcome=_OUTCOME[event],
                worker_id=stored.worker_id,
                started_at=stored.started_at,
                finished_at=now,
                error=None if failure is None else failure.summary,
                error_type=None if failure is None else failure.error_type,
                traceback=None if failure is None else failure.traceback,
            )
        )
        if failure is not None:
            stored.last_error = failure.summary
        stored.lease_token = None
        stored.lease_expires_at = None
        if stored.state in TERMINAL_TASK_STATES:
            stored.finished_at = now

    def cancel(self, task_id: int) -> TaskState:
        """Cancel a pending or running task, as :func:`~steeple.postgres.queue.cancel` does.

        A running handler's ``ctx.cancelled`` and ``ctx.lease_lost`` are set, and its lease
        is dropped, so whatever it returns is not recorded. ``await queue.cancel(memory,
        task_id)`` (the module function) does the same.

        Returns:
            The state afterwards (``CANCELLED``, or the terminal state it already had).

        Raises:
            TaskNotFoundError: no such task.
        """
        stored = self._get(task_id)
        if stored.state not in _LIVE:
            return stored.state
        stored.state = transition(stored.state, TaskEvent.CANCEL)
        stored.lease_token = None
        stored.lease_expires_at = None
        stored.finished_at = self.clock.now()
        if stored.ctx is not None:
            stored.ctx.cancelled.set()
            stored.ctx.lease_lost.set()
        return stored.state

    def expire_lease(self, task_id: int) -> None:
        """Make a running task's lease lapse now, as if its worker had died.

        Raises:
            TaskNotFoundError: no such task.
            QueueError: the task is not running.
        """
        stored = self._get(task_id)
        if stored.state is not _RUNNING:
            raise QueueError(f"task {task_id} is {stored.state.value}, not running")
        stored.lease_expires_at = self.clock.now() - timedelta(microseconds=1)

    def recover_expired(self) -> list[tuple[int, TaskState]]:
        """Recover every running task whose lease lapsed; return ``(task id, new state)`` pairs.

        Each goes back to pending, or fails for good on its last attempt; oldest lease first.
        """
        now = self.clock.now()
        expired = sorted(
            (
                s
                for s in self._running()
                if s.lease_expires_at is not None and s.lease_expires_at < now
            ),
            key=lambda s: (s.lease_expires_at, s.id),
        )
        recovered = []
        for stored in expired:
            event = lease_expiry_event(stored.attempts, stored.max_attempts)
            if stored.ctx is not None:
                stored.ctx.lease_lost.set()
            self._end(stored, event, None)
            stored.history[-1] = attrs.evolve(stored.history[-1], error="lease expired")
            stored.last_error = "lease expired"
            if stored.state is _PENDING:
                stored.worker_id = None
            recovered.append((stored.id, stored.state))
        return recovered

    def prune(self, older_than: timedelta = timedelta(0)) -> int:
        """Delete the terminal tasks finished at least ``older_than`` ago; return how many."""
        check_timedelta(older_than, "older_than", timedelta(0), timedelta.max)
        cutoff = self.clock.now() - older_than
        gone = [
            s.id
            for s in self._tasks.values()
            if s.state in TERMINAL_TASK_STATES
            and s.finished_at is not None
            and s.finished_at <= cutoff
        ]
        for task_id in gone:
            del self._tasks[task_id]
        return len(gone)

    # --- running the handlers ------------------------------------------------------------

    async def run_until_idle(
        self,
        *,
        queues: Sequence[str] | None = None,
        concurrency: int = 10,
        advance_time: bool = False,
        max_attempts_run: int = 10_000,
    ) -> int:
        """Run the app's handlers until nothing due is left; return how many attempts ran.

        Each round claims up to ``concurrency`` due tasks (honouring pauses and limits) and
        runs them together, recording each outcome as a worker does: a return is a success
        (its result must be storable JSON), ``JobError.retry`` and (with a
        :class:`RetryPolicy`) other exceptions retry after the backoff until attempts run
        out, anything else fails for good. Tasks that handlers enqueue run in later rounds.

        Args:
            queues: the queues to serve (default: the app's, like ``app.scheduler()``).
            concurrency: the most handlers running at once (1..1000).
            advance_time: when nothing can be claimed, move the clock to the next pending
                task's due time (a retry's backoff, a delayed task) or, when a rate limit
                holds due work back, to when its window frees a start
                (:attr:`rate_frees_at`), whichever comes first, and go on; by default the
                clock stays, and such tasks wait for :meth:`VirtualClock.advance`.
            max_attempts_run: give up after this many attempts (a handler that enqueues
                itself forever).

        Raises:
            QueueError: still not idle after ``max_attempts_run`` attempts.
        """
        check_int(concurrency, "concurrency", 1, 1000)
        check_int(max_attempts_run, "max_attempts_run", 1, 10**9)
        served = self.app.queues if queues is None else _names(queues, "queues")
        names = {f.name for f in self.app.tasks}
        ran = 0
        while True:
            self.recover_expired()
            claims = self.claim(concurrency, queues=served, names=names)
            if not claims:
                if advance_time:
                    upcoming = [
                        s.run_at
                        for s in self._tasks.values()
                        if s.state is _PENDING
                        and s.queue in served
                        and s.task_name in names
                        and s.run_at > self.clock.now()
                    ]
                    frees_at = self._rate_frees_at
                    if frees_at is not None and self._due_waiting(served, names):
                        upcoming.append(frees_at)
                    if upcoming:
                        self.clock.set(min(upcoming))
                        continue
                return ran
            if ran + len(claims) > max_attempts_run:
                raise QueueError(
                    f"the queue was not idle after {ran} attempts (max_attempts_run); "
                    "does a handler enqueue work forever?"
                )
            ran += len(claims)
            async with asyncio.TaskGroup() as group:
                for claimed in claims:
                    group.create_task(self._execute(claimed))

    def _due_waiting(self, served: Sequence[str], names: set[str]) -> bool:
        """Whether a due task of these queues and names waits (a limit holds it back)."""
        now = self.clock.now()
        return any(
            s.state is _PENDING and s.queue in served and s.task_name in names and s.run_at <= now
            for s in self._tasks.values()
        )

    async def _execute(self, claimed: MemoryClaim) -> None:
        stored = self._tasks[claimed.task_id]
        declared = self._declared(stored.task_name)
        assert declared is not None  # claims take only the app's task names
        ctx = JobContext(
            task_id=stored.id,
            task_name=stored.task_name,
            run_id=stored.run_id,
            attempt=claimed.attempt,
            max_attempts=stored.max_attempts,
            worker_id=self.worker_id,
            queue=stored.queue,
        )
        stored.ctx = ctx
        me = asyncio.current_task()
        error: BaseException | None = None
        result: str | None = None
        try:
            try:
                args = decode_args(declared.task, stored.args_text)
                value = await _call(declared.handler, ctx, args)
                if isinstance(value, _Raised):
                    error = value.error
                else:
                    result = encode_result(ctx.task_name, value)
            except asyncio.CancelledError as exc:
                if me is not None and me.cancelling():
                    raise
                error = exc
            except BaseException as exc:
                if _from_outside(exc, me):
                    raise
                error = exc
        finally:
            stored.ctx = None
        if stored.lease_token == claimed.token:
            stored.progress_text = ctx.progress_text or stored.progress_text
        if error is None:
            self.complete(claimed.task_id, claimed.token, result)
            return
        recorded, kind, delay, retries_unexpected = judge_failure(error, declared.task)
        failure, retry_after, _ = settle_failure(
            recorded,
            kind,
            delay,
            ctx,
            stored.backoff,
            self.clock.now,
            self._random,
            retries_unexpected=retries_unexpected,
        )
        if retry_after is not None:
            self.retry(claimed.task_id, claimed.token, retry_after, failure)
        else:
            self.fail(claimed.task_id, claimed.token, failure)


async def _call(handler: Callable[..., Any], ctx: JobContext, args: Any) -> object:
    """Run a handler as the worker does: awaited on the loop, or in a thread."""
    if check_handler(handler):
        return await handler(ctx, args)
    loop = asyncio.get_running_loop()
    value = await loop.run_in_executor(
        None, functools.partial(_call_in_thread, contextvars.copy_context(), handler, ctx, args)
    )
    if inspect.isawaitable(value):
        return await value
    return value


def _names(values: Iterable[str], what: str) -> list[str]:
    """Check a collection of queue or task names (a lone str is refused, not iterated)."""
    if isinstance(values, str | bytes) or not isinstance(values, Iterable):
        raise QueueTypeError(f"{what} must be a list of names, not {type(values).__name__}")
    if what == "queues":
        return [check_queue(value) for value in values]
    return [check_name(value, "task name") for value in values]


def _no_jitter() -> float:
    return 0.0


def _claim_order(stored: _Stored) -> tuple[int, datetime, int]:
    return (-stored.priority, stored.run_at, stored.order)


def _count(values: Iterable[str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for value in values:
        counts[value] = counts.get(value, 0) + 1
    return counts


def _task_name(task: object) -> str | None:
    if task is None:
        return None
    if isinstance(task, TaskFunction):
        return task.name
    if isinstance(task, Task):
        return task.name
    if isinstance(task, str):
        return task
    raise QueueTypeError(
        f"task must be an @app.task function, a Task, a name or None, not {type(task).__name__}"
    )


def _run(stored: _Stored, history: int) -> TaskRun:
    return TaskRun(
        id=stored.id,
        task_name=stored.task_name,
        state=stored.state,
        priority=stored.priority,
        run_at=stored.run_at,
        attempts=stored.attempts,
        max_attempts=stored.max_attempts,
        run_id=stored.run_id,
        worker_id=stored.worker_id,
        lease_expires_at=stored.lease_expires_at,
        dedup_key=stored.dedup_key,
        job_id=None,
        scheduled_for=None,
        created_at=stored.created_at,
        started_at=stored.started_at,
        finished_at=stored.finished_at,
        last_error=stored.last_error,
        queue=stored.queue,
        progress=Progress.from_json(stored.progress_text),
        result=None if stored.result_text is None else json.loads(stored.result_text),
        history=tuple(stored.history[len(stored.history) - history :]),
        limit_key=stored.limit_key,
    )
