"""The worker: claims batches, runs handlers concurrently, renews, completes, recovers.

One asyncio program per :class:`Scheduler`:

- the claim loop takes up to ``batch_size`` due tasks in one ``UPDATE ... FROM (SELECT ...
  FOR NO KEY UPDATE SKIP LOCKED)`` with a fresh random lease token per task, and starts a
  handler for each in a TaskGroup, never more than ``concurrency`` at once;
- completions are buffered and written in batches, each fenced by ``lease_token`` (a worker
  that lost its lease cannot finish anything);
- a renewer extends the leases of running handlers (token-guarded) and sets
  ``ctx.lease_lost`` when a renewal finds the lease gone;
- maintenance recovers expired leases of dead workers and materializes due recurring jobs;
- a listener on a dedicated connection turns NOTIFYs into immediate wake-ups; if it dies
  the worker polls every ``poll_interval`` and reconnects.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta
from typing import Any, Final, Generic, TypeVar

import asyncpg
import attrs

from steeple.core.backoff import Backoff
from steeple.core.clock import SystemClock
from steeple.core.dsn import check_dsn
from steeple.core.entropy import SystemRandom
from steeple.core.errors import ConfigurationError
from steeple.core.ports import Clock, RandomSource
from steeple.core.remote_clock import RemoteClockEstimate
from steeple.core.tasks import TaskEvent, TaskState, retry_decision, transition
from steeple.postgres.queue import _driver, _metrics
from steeple.postgres.queue._db import (
    DB_ERRORS,
    SERVER_SETTINGS,
    WorkerDb,
    check_durable,
    open_db,
)
from steeple.postgres.queue._schema import DEFAULT_SCHEMA, check_schema, validate_schema
from steeple.postgres.queue._sql import queue_sql
from steeple.postgres.queue._validate import (
    check_bool,
    check_int,
    check_name,
    check_seconds,
    storable_text,
)
from steeple.postgres.queue.errors import (
    JobError,
    LeaseLostError,
    QueueConfigurationError,
    QueueError,
    QueueTypeError,
    QueueUnavailableError,
    UnknownTaskError,
)
from steeple.postgres.queue.tasks import Task

__all__ = ["Handler", "Health", "JobContext", "Scheduler", "WorkerStats"]

_log = logging.getLogger("steeple.postgres.queue")
A = TypeVar("A")
Handler = Callable[["JobContext", A], Awaitable[object]]
"""An async handler: ``async def handle(ctx: JobContext, args) -> None``."""

_LISTEN_ERRORS: Final[tuple[type[BaseException], ...]] = (*DB_ERRORS, ConnectionError)
_MAX_ERROR_TEXT: Final = 2000
_MAX_TIMERS: Final = 1000
_FLUSH_BATCH: Final = 1000

# The SQL encodes these transitions; deriving the names from core's table keeps them honest.
_AFTER_SUCCESS: Final = transition(TaskState.RUNNING, TaskEvent.SUCCEED)
_AFTER_RETRY: Final = transition(TaskState.RUNNING, TaskEvent.FAIL_RETRYABLE)
_AFTER_FAILURE: Final = transition(TaskState.RUNNING, TaskEvent.FAIL_PERMANENT)


class Health(enum.Enum):
    """What :meth:`Scheduler.health` reports."""

    STARTING = "starting"
    """Not yet claiming (schema check, first connection)."""
    HEALTHY = "healthy"
    """Claiming, with the database and the wake-up listener working."""
    DEGRADED = "degraded"
    """Running, but claims are failing or being refused, the database failed recently, or
    the listener is down (polling)."""
    STOPPED = "stopped"
    """``run_until_shutdown`` returned (or never ran and was closed)."""


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


@attrs.define(eq=False)
class _Claimed:
    ctx: JobContext
    token: uuid.UUID = attrs.field(repr=False)
    args_text: str = attrs.field(repr=False)
    lease: float
    backoff: Backoff
    # Local monotonic times, counted from when the claim was SENT (the server started the
    # lease later than that, never earlier): no wall clock is involved.
    renew_at: float
    expires_at: float
    # When this claim started (server time): with the attempt number it identifies the
    # claim after completion cleared the token (see _confirm_completed).
    started_at: datetime
    lost: bool = False
    # A completion write for it failed with an unknown outcome (it may have committed).
    unsure: bool = False


@attrs.define
class WorkerStats:
    """Counts since the worker started (also exported as OpenTelemetry metrics)."""

    claimed: int = 0
    succeeded: int = 0
    retried: int = 0
    failed: int = 0
    released: int = 0
    recovered: int = 0
    rejected_completions: int = 0
    confirmed_completions: int = 0
    lease_lost: int = 0
    materialized: int = 0
    failed_claims: int = 0
    """Claim rounds that failed (database error or timeout)."""
    refused_claims: int = 0
    """Claim rounds the server refused as arriving after the worker had given up on them
    (its clock moved, or the network held the request): each re-anchors the worker's
    estimate of the server's clock from the answer."""


@attrs.frozen
class _Registration(Generic[A]):
    task: Task[A]
    handler: Handler[A]


_MAX_INTERVAL: Final = 3600.0  # the longest poll / maintenance interval and query timeout
_MAX_DRAIN: Final = 86_400.0
_MAX_CONCURRENCY: Final = 100_000


@functools.lru_cache(maxsize=256)
def _backoff(initial_us: int, maximum_us: int, factor: int, jitter: float) -> Backoff:
    # Most tasks share a handful of policies: build (and validate) each once.
    return Backoff(
        initial=timedelta(microseconds=initial_us),
        maximum=timedelta(microseconds=maximum_us),
        factor=factor,
        jitter=jitter,
    )


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _error_text(exc: BaseException) -> str:
    try:
        message = str(exc)
    except Exception:  # a handler's exception whose __str__ fails is still a failure
        message = "<the exception's message could not be read>"
    text = f"{type(exc).__name__}: {message}"
    if len(text) > _MAX_ERROR_TEXT:
        text = text[: _MAX_ERROR_TEXT - 3] + "..."
    # Handlers' messages may hold NUL or lone surrogates, which PostgreSQL text cannot.
    return storable_text(text)


async def _wait(event: asyncio.Event, timeout: float) -> bool:
    """Wait for ``event`` at most ``timeout`` seconds; return whether it is set."""
    if event.is_set():
        return True
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout):
            await event.wait()
    return event.is_set()


class Scheduler:
    """A worker running registered handlers for due tasks of one queue schema.

    Args:
        pool_or_dsn: an asyncpg pool or a psycopg_pool ``AsyncConnectionPool`` (the
            caller owns it), or a DSN (the worker opens and closes its own asyncpg pool).
        worker_id: this worker's name, recorded on claimed tasks (1-200 chars).
        schema: the queue's PostgreSQL schema.
        poll_interval: seconds (or timedelta) between polls when no NOTIFY arrives.
        concurrency: the most handlers running at once.
        batch_size: the most tasks claimed per query (default: ``concurrency``).
        maintenance_interval: seconds between expired-lease recovery and job materialization.
        listen: use LISTEN/NOTIFY wake-ups (polling alone when False).
        query_timeout: seconds any one worker query may take before it is abandoned (the
            worker then reports degraded and retries; a lease it could not renew lapses).
            A claim the server receives after that long takes nothing.
        require_durable: refuse to start on a server or schema that could lose
            acknowledged commits (fsync, full_page_writes or synchronous_commit off,
            unlogged tables, a read-only standby).
        clock: the clock whose differences time retry backoff (default: system clock).
            What is due, leases and give-up times are judged by the database server's
            clock and this host's monotonic clock, so stepping either wall clock (NTP,
            an operator, a failover to a server whose clock differs) never stops claims.
        random: randomness for backoff jitter (default: the OS).

    Intervals and timeouts are seconds (int or float) or timedeltas: poll and maintenance
    intervals 0.001 s .. 1 h, query_timeout 0.1 s .. 1 h.

    Raises:
        QueueConfigurationError: an invalid worker id, schema, count or interval (NaN,
            infinite, negative, zero or too large), or an invalid DSN (see
            :func:`steeple.core.dsn.check_dsn`; the message never quotes the DSN).
        QueueTypeError: an option of the wrong type.
    """

    def __init__(
        self,
        pool_or_dsn: Any,
        *,
        worker_id: str,
        schema: str = DEFAULT_SCHEMA,
        poll_interval: float | timedelta = 1.0,
        concurrency: int = 16,
        batch_size: int | None = None,
        maintenance_interval: float | timedelta = 1.0,
        listen: bool = True,
        query_timeout: float | timedelta = 30.0,
        require_durable: bool = True,
        clock: Clock | None = None,
        random: RandomSource | None = None,
    ) -> None:
        check_name(worker_id, "worker_id")
        validate_schema(schema)
        check_int(concurrency, "concurrency", 1, _MAX_CONCURRENCY)
        batch = concurrency if batch_size is None else batch_size
        check_int(batch, "batch_size", 1, 1000)
        poll = check_seconds(poll_interval, "poll_interval", 0.001, _MAX_INTERVAL)
        maintenance = check_seconds(
            maintenance_interval, "maintenance_interval", 0.001, _MAX_INTERVAL
        )
        query = check_seconds(query_timeout, "query_timeout", 0.1, _MAX_INTERVAL)
        check_bool(listen, "listen")
        check_bool(require_durable, "require_durable")
        if clock is not None and not callable(getattr(clock, "now", None)):
            raise QueueTypeError(f"clock must have a now() method, not {type(clock).__name__}")
        if random is not None and not callable(getattr(random, "random", None)):
            raise QueueTypeError(f"random must have a random() method, not {type(random).__name__}")
        if isinstance(pool_or_dsn, str):
            if not pool_or_dsn or "\x00" in pool_or_dsn or not _encodable(pool_or_dsn):
                raise QueueConfigurationError(
                    "the DSN must be a non-empty str without NUL or lone surrogates"
                )
            # A malformed DSN would come back from the driver with pieces of it quoted.
            try:
                check_dsn(pool_or_dsn)
            except ConfigurationError as exc:
                raise QueueConfigurationError(str(exc)) from None
        elif open_db(pool_or_dsn) is None:
            raise QueueConfigurationError(
                "pool_or_dsn must be an asyncpg Pool, a psycopg_pool AsyncConnectionPool "
                "or a DSN string"
            )
        self._source = pool_or_dsn
        self.worker_id = worker_id
        self.schema = schema
        self._sql = queue_sql(schema)
        self._poll = poll
        self._maintenance = maintenance
        self._concurrency = concurrency
        self._batch = batch
        self._min_claim = max(1, min(batch, concurrency) // 4)
        self._listen = listen
        self._timeout = query
        self._require_durable = require_durable
        self._clock: Clock = clock or SystemClock()
        self._random: RandomSource = random or SystemRandom()
        self._registry: dict[str, _Registration[Any]] = {}
        self._health = Health.STARTING
        self._started = False
        self._db_ok = True
        self._listener_ok = not listen
        self._db: WorkerDb | None = None
        self._running: dict[int, _Claimed] = {}
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._completions: list[_Claimed] = []
        self._to_release: list[_Claimed] = []
        self._wake = asyncio.Event()
        self._slot_freed = asyncio.Event()
        self._flush_wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._closing = asyncio.Event()
        self._hard_stop = False
        self._timers: dict[int, asyncio.TimerHandle] = {}
        # The server's clock, re-anchored on every answer that carries it (the start-up
        # check, each claim): give-up times and wake-ups are computed on it from this
        # host's monotonic clock, so neither wall clock's steps can void them for long.
        self._server_clock = RemoteClockEstimate()
        self._claims_ok = True
        self.stats = WorkerStats()

    def __repr__(self) -> str:
        return f"Scheduler(worker_id={self.worker_id!r}, schema={self.schema!r})"

    def register(self, task: Task[A], handler: Handler[A]) -> None:
        """Run ``handler`` for tasks named ``task.name``.

        Raises:
            UnknownTaskError: that task name already has a handler.
            QueueTypeError: ``task`` is not a Task, or ``handler`` is not callable.
            QueueError: the worker has already started.
        """
        if not isinstance(task, Task):
            raise QueueTypeError(f"task must be a steeple Task, not {type(task).__name__}")
        if not callable(handler):
            raise QueueTypeError(
                f"handler must be an async callable (ctx, args), not {type(handler).__name__}"
            )
        if self._started:
            raise QueueError("register handlers before run_until_shutdown")
        if task.name in self._registry:
            raise UnknownTaskError(f"task {task.name!r} already has a handler")
        self._registry[task.name] = _Registration(task, handler)

    def health(self) -> Health:
        """Report starting / healthy / degraded / stopped.

        Degraded while the latest claim round failed or was refused (until a claim
        succeeds again), after another database failure (until a write succeeds), or while
        the wake-up listener is down.
        """
        if self._health is Health.HEALTHY and not (
            self._claims_ok and self._db_ok and self._listener_ok
        ):
            return Health.DEGRADED
        return self._health

    # --- lifecycle -----------------------------------------------------------------------

    async def run_until_shutdown(
        self, stop: asyncio.Event, *, drain_timeout: float | timedelta = 30.0
    ) -> None:
        """Work until ``stop`` is set, then drain gracefully within ``drain_timeout``.

        After ``stop``: no new claims; running handlers get ``drain_timeout`` to finish;
        the rest are cancelled and their tasks handed back (pending, attempt refunded);
        buffered completions are written; the pool (if the worker opened it) is closed.

        Raises:
            SchemaVersionMismatchError: the queue schema is missing or another version.
            UnfitDatabaseError: the server or schema could lose acknowledged work.
            QueueUnavailableError: the database failed or was unreachable at start-up.
            QueueConfigurationError: a pool too small for the worker; a ``drain_timeout``
                that is NaN, infinite, negative or over a day; a DSN that cannot be parsed.
            QueueTypeError: ``stop`` is not an ``asyncio.Event``, or a wrong-typed
                ``drain_timeout``.
            UnknownTaskError: no handler is registered.
            QueueError: called twice.
        """
        if not isinstance(stop, asyncio.Event):
            raise QueueTypeError(f"stop must be an asyncio.Event, not {type(stop).__name__}")
        drain = check_seconds(drain_timeout, "drain_timeout", 0.0, _MAX_DRAIN)
        if self._started:
            raise QueueError("a Scheduler runs once; create a new one")
        if not self._registry:
            raise UnknownTaskError("register at least one handler before running")
        self._started = True
        owned = isinstance(self._source, str)
        try:
            try:
                if isinstance(self._source, str):
                    try:
                        async with asyncio.timeout(self._timeout):
                            pool = await asyncpg.create_pool(
                                self._source,
                                min_size=2,
                                max_size=8,
                                max_inactive_connection_lifetime=60,
                                server_settings=dict(SERVER_SETTINGS),
                            )
                    except (ValueError, TypeError) as exc:
                        # asyncpg parses the DSN here (a bad port, an unknown option...).
                        # Its message may quote the DSN, password included: not repeated.
                        raise QueueConfigurationError(
                            f"the worker's DSN could not be parsed ({type(exc).__name__}); "
                            "check its host, port and query parameters"
                        ) from None
                    self._db = open_db(pool)
                else:
                    self._db = open_db(self._source)
                await self._check_fit(self._require_db())
            except DB_ERRORS as exc:
                raise QueueUnavailableError(
                    f"the worker could not start: {type(exc).__name__}: {exc}"
                ) from exc
            self._health = Health.HEALTHY
            async with asyncio.TaskGroup() as services:
                if self._listen:
                    services.create_task(self._listen_forever())
                services.create_task(self._renew_forever())
                services.create_task(self._maintain_forever())
                services.create_task(self._flush_forever())
                try:
                    async with asyncio.TaskGroup() as handlers:
                        await self._claim_until(stop, handlers)
                        await self._drain(drain)
                    await self._release_unfinished()
                finally:
                    self._closing.set()
                    self._flush_wake.set()
                    for timer in self._timers.values():
                        timer.cancel()
                    self._timers.clear()
        finally:
            self._health = Health.STOPPED
            if owned and self._db is not None:
                await self._db.close()

    async def _check_fit(self, db: WorkerDb) -> None:
        needed = 3 if self._listen else 2  # listener + claims + completions
        if db.max_size() < needed:
            raise QueueConfigurationError(
                f"the pool must allow at least {needed} connections (claims, completions"
                + (", the listener)" if self._listen else ")")
            )

        async def check(conn: Any) -> None:
            await check_schema(conn, self.schema)
            if self._require_durable:
                await check_durable(
                    conn, self.schema, ("schema_migrations", "tasks", "attempts", "jobs")
                )
            # Claims carry a give-up time on the server's clock: anchor the estimate of it.
            ((server,),) = await _driver.fetch(
                conn, "SELECT extract(epoch FROM clock_timestamp())::double precision"
            )
            self._server_clock.observe(float(server), time.monotonic())

        await db.with_connection(check, timeout=self._timeout)

    async def _drain(self, timeout: float) -> None:
        if self._running and not await _wait(self._idle, timeout):
            self._hard_stop = True
            for task in list(self._tasks.values()):
                task.cancel()

    async def _release_unfinished(self) -> None:
        pool = self._require_db()
        for claimed in self._to_release:
            try:
                await pool.fetch(
                    self._sql.release,
                    claimed.ctx.task_id,
                    claimed.token,
                    self.worker_id,
                    timeout=self._timeout,
                )
                self.stats.released += 1
            except DB_ERRORS as exc:
                # The lease will expire and maintenance elsewhere recovers the task.
                _log.warning("could not release task %s: %s", claimed.ctx.task_id, exc)
        self._to_release.clear()

    def _require_db(self) -> WorkerDb:
        if self._db is None:
            raise QueueError("the worker is not running")
        return self._db

    # --- claiming ------------------------------------------------------------------------

    async def _claim_until(self, stop: asyncio.Event, handlers: asyncio.TaskGroup) -> None:
        pool = self._require_db()
        names = list(self._registry)
        inst = _metrics.instruments()
        stop_waiter = asyncio.ensure_future(stop.wait())
        try:
            while not stop.is_set():
                free = self._concurrency - len(self._running)
                # Claim in worthwhile batches: while a quarter of a batch is not yet free
                # and handlers are running, wait for more slots instead of claiming crumbs.
                if free <= 0 or (self._running and free < self._min_claim):
                    self._slot_freed.clear()
                    await self._wait_either(self._slot_freed, stop_waiter, None)
                    continue
                self._wake.clear()
                wanted = min(free, self._batch)
                sent = time.monotonic()
                # The give-up time, on the server's clock: what it surely reads when this
                # worker stops waiting (see steeple.core.remote_clock). A claim the server
                # runs later than that takes nothing, instead of leasing tasks to nobody.
                give_up = self._server_clock.at_least(sent + self._timeout)
                try:
                    answer = await pool.fetch(
                        self._sql.claim_timed,
                        names,
                        wanted,
                        self.worker_id,
                        give_up,
                        timeout=self._timeout,
                    )
                except DB_ERRORS as exc:
                    self._claims_ok = False
                    self._db_ok = False
                    self.stats.failed_claims += 1
                    _log.warning("claim failed (%s); retrying after the poll interval", exc)
                    await self._wait_either(self._wake, stop_waiter, self._poll)
                    continue
                server_now = float(answer[0][0])
                self._server_clock.observe(server_now, time.monotonic())
                rows = [row[1:] for row in answer if row[1] is not None]
                if not rows and server_now >= give_up:
                    # Refused as too late: the server's clock moved under the estimate, or
                    # the request sat in the network. The answer re-anchored the estimate:
                    # try again at once, then at the poll interval while it keeps happening.
                    self.stats.refused_claims += 1
                    refused_before = not self._claims_ok
                    self._claims_ok = False
                    _log.warning(
                        "the server refused a claim as arriving after its give-up time "
                        "(its clock moved, or the network delayed the request)"
                    )
                    if refused_before:
                        await self._wait_either(self._wake, stop_waiter, self._poll)
                    continue
                self._claims_ok = True
                self._db_ok = True
                for row in rows:
                    self._start(row, sent, handlers, inst)
                if len(rows) < wanted:
                    await self._wait_either(self._wake, stop_waiter, self._poll)
                else:
                    # Let handlers and the flusher run before the next claim.
                    await asyncio.sleep(0)
        finally:
            stop_waiter.cancel()

    @staticmethod
    async def _wait_either(
        event: asyncio.Event, stop_waiter: asyncio.Future[Any], timeout: float | None
    ) -> None:
        if event.is_set() or stop_waiter.done():
            return
        waiter = asyncio.ensure_future(event.wait())
        try:
            await asyncio.wait(
                {waiter, stop_waiter}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            waiter.cancel()

    def _start(
        self,
        row: Any,
        now: float,
        handlers: asyncio.TaskGroup,
        inst: _metrics.QueueInstruments,
    ) -> None:
        (task_id, name, args_text, attempt, max_attempts, run_id, token, lease,
         b_init, b_max, b_factor, b_jitter, run_at, started_at, scheduled_for) = row  # fmt: skip
        lease_s = lease.total_seconds()
        claimed = _Claimed(
            ctx=JobContext(
                task_id=task_id,
                task_name=name,
                run_id=run_id,
                attempt=attempt,
                max_attempts=max_attempts,
                worker_id=self.worker_id,
                scheduled_for=scheduled_for,
            ),
            token=token,
            args_text=args_text,
            lease=lease_s,
            backoff=_backoff(b_init, b_max, b_factor, b_jitter),
            renew_at=now + lease_s / 3,
            expires_at=now + lease_s,
            started_at=started_at,
        )
        attributes = {"task": name}
        inst.claimed.add(1, attributes)
        inst.pickup_latency.record(max((started_at - run_at).total_seconds(), 0.0), attributes)
        self.stats.claimed += 1
        self._running[task_id] = claimed
        self._idle.clear()
        self._tasks[task_id] = handlers.create_task(self._execute(claimed))

    # --- running -------------------------------------------------------------------------

    async def _execute(self, claimed: _Claimed) -> None:
        ctx = claimed.ctx
        registration = self._registry[ctx.task_name]
        inst = _metrics.instruments()
        attributes = {"task": ctx.task_name}
        started = time.monotonic()
        try:
            try:
                args = registration.task.decode(claimed.args_text)
                await registration.handler(ctx, args)
            except asyncio.CancelledError:
                if self._hard_stop:
                    self._to_release.append(claimed)
                    return
                raise
            except JobError as exc:
                inst.run_time.record(time.monotonic() - started, attributes)
                await self._finish_failed(claimed, exc, exc.retryable, exc.delay)
            except Exception as exc:  # a handler's failure is data: recorded on the task
                inst.run_time.record(time.monotonic() - started, attributes)
                await self._finish_failed(claimed, exc, False, None)
            else:
                inst.run_time.record(time.monotonic() - started, attributes)
                self._completions.append(claimed)
                self._flush_wake.set()
        finally:
            self._running.pop(ctx.task_id, None)
            self._tasks.pop(ctx.task_id, None)
            self._slot_freed.set()
            if not self._running:
                self._idle.set()

    async def _finish_failed(
        self, claimed: _Claimed, exc: BaseException, retryable: bool, delay: timedelta | None
    ) -> None:
        pool = self._require_db()
        ctx = claimed.ctx
        inst = _metrics.instruments()
        attributes = {"task": ctx.task_name}
        text = _error_text(exc)
        retry_after: timedelta | None = None
        if retryable:
            now = self._clock.now()
            decision = retry_decision(
                ctx.attempt, ctx.max_attempts, claimed.backoff, now, self._random.random()
            )
            if decision.retry and decision.run_at is not None:
                retry_after = delay if delay is not None else decision.run_at - now
            else:
                text = f"attempts exhausted ({ctx.attempt}/{ctx.max_attempts}): {text}"
        try:
            if retry_after is not None:
                rows = await pool.fetch(
                    self._sql.retry,
                    ctx.task_id,
                    claimed.token,
                    retry_after,
                    text,
                    self.worker_id,
                    timeout=self._timeout,
                )
                outcome = _AFTER_RETRY
            else:
                rows = await pool.fetch(
                    self._sql.fail,
                    ctx.task_id,
                    claimed.token,
                    text,
                    self.worker_id,
                    timeout=self._timeout,
                )
                outcome = _AFTER_FAILURE
        except DB_ERRORS as exc2:
            # Nothing recorded: the lease expires and the task is recovered and rerun.
            self._db_ok = False
            _log.warning("could not record the failure of task %s: %s", ctx.task_id, exc2)
            return
        if not rows:
            self._fenced(claimed)
        elif outcome is TaskState.PENDING:
            if retry_after is not None:
                self._wake_at(retry_after.total_seconds())
            self.stats.retried += 1
            inst.retried.add(1, attributes)
        else:
            self.stats.failed += 1
            inst.failed.add(1, attributes)

    def _fenced(self, claimed: _Claimed) -> None:
        self.stats.rejected_completions += 1
        _metrics.instruments().lease_lost.add(1, {"task": claimed.ctx.task_name})
        claimed.ctx.lease_lost.set()
        _log.info(
            "task %s: the outcome of attempt %s was rejected (lease lost or cancelled)",
            claimed.ctx.task_id,
            claimed.ctx.attempt,
        )

    # --- background loops ----------------------------------------------------------------

    async def _flush_forever(self) -> None:
        pool = self._require_db()
        inst = _metrics.instruments()
        while True:
            await self._flush_wake.wait()
            self._flush_wake.clear()
            while self._completions:
                batch = self._completions[:_FLUSH_BATCH]
                del self._completions[:_FLUSH_BATCH]
                try:
                    rows = await pool.fetch(
                        self._sql.complete,
                        [c.ctx.task_id for c in batch],
                        [c.token for c in batch],
                        self.worker_id,
                        timeout=self._timeout,
                    )
                    self._db_ok = True
                except DB_ERRORS as exc:
                    self._db_ok = False
                    _log.warning("could not record %d completions: %s", len(batch), exc)
                    for claimed in batch:
                        claimed.unsure = True
                    self._completions[:0] = batch
                    if self._closing.is_set():
                        # Shutting down: the leases expire and the tasks are rerun elsewhere.
                        self._completions.clear()
                        return
                    await asyncio.sleep(min(self._poll, 1.0))
                    continue
                done = {r[0] for r in rows}
                missed = [c for c in batch if c.ctx.task_id not in done]
                confirmed = await self._confirm_completed([c for c in missed if c.unsure])
                for claimed in batch:
                    if claimed.ctx.task_id in done:
                        self.stats.succeeded += 1
                    elif claimed.ctx.task_id in confirmed:
                        self.stats.succeeded += 1
                        self.stats.confirmed_completions += 1
                    else:
                        self._fenced(claimed)
                done |= confirmed
                if done:
                    inst.succeeded.add(len(done), {"task": batch[0].ctx.task_name})
            if self._closing.is_set() and not self._completions:
                return

    async def _confirm_completed(self, unsure: list[_Claimed]) -> set[int]:
        """Return the ids among ``unsure`` whose earlier completion write did commit.

        A completion retried after an ambiguous failure (the connection cut after COMMIT was
        sent) finds its token already cleared -- by itself. It is told apart from a fenced
        one by the claim's identity: still succeeded, with this attempt number and this
        claim's start time (any later claim changes both), so it is not a rejection.
        """
        if not unsure:
            return set()
        try:
            rows = await self._require_db().fetch(
                self._sql.completed_by,
                [c.ctx.task_id for c in unsure],
                [c.ctx.attempt for c in unsure],
                [c.started_at for c in unsure],
                self.worker_id,
                timeout=self._timeout,
            )
        except DB_ERRORS as exc:
            # Still unknown: report them as rejected (the handler may not assume success).
            _log.warning("could not confirm %d completions: %s", len(unsure), exc)
            return set()
        confirmed = {r[0] for r in rows}
        for task_id in sorted(confirmed):
            _log.info("task %s: an earlier completion write had committed", task_id)
        return confirmed

    async def _renew_forever(self) -> None:
        pool = self._require_db()
        while not self._closing.is_set():
            leases = [c.lease for c in self._running.values()]
            tick = min(0.5, max(0.02, min(leases) / 6)) if leases else min(0.5, self._poll)
            if await _wait(self._closing, tick):
                return
            now = time.monotonic()
            due = [c for c in self._running.values() if not c.lost and now >= c.renew_at]
            if not due:
                continue
            # A renewal slower than half a lease is as good as lost: give up and retry.
            deadline = max(0.1, min(self._timeout, min(c.lease for c in due) / 2))
            try:
                rows = await pool.fetch(
                    self._sql.renew,
                    [c.ctx.task_id for c in due],
                    [c.token for c in due],
                    timeout=deadline,
                )
                self._db_ok = True
            except DB_ERRORS as exc:
                self._db_ok = False
                _log.warning("lease renewal failed: %s", exc)
                for claimed in due:
                    if time.monotonic() >= claimed.expires_at:
                        self._lose(claimed, cancelled=False)
                continue
            renewed = {r[0] for r in rows}
            lost = [c for c in due if c.ctx.task_id not in renewed]
            for claimed in due:
                if claimed.ctx.task_id in renewed:
                    claimed.renew_at = now + claimed.lease / 3
                    claimed.expires_at = now + claimed.lease
            if lost:
                cancelled: set[int] = set()
                with contextlib.suppress(*DB_ERRORS):
                    states = await pool.fetch(
                        self._sql.lost_states, [c.ctx.task_id for c in lost], timeout=self._timeout
                    )
                    cancelled = {r[0] for r in states if r[1] == TaskState.CANCELLED.value}
                for claimed in lost:
                    self._lose(claimed, cancelled=claimed.ctx.task_id in cancelled)

    def _lose(self, claimed: _Claimed, *, cancelled: bool) -> None:
        claimed.lost = True
        self.stats.lease_lost += 1
        if cancelled:
            claimed.ctx.cancelled.set()
        claimed.ctx.lease_lost.set()

    async def _maintain_forever(self) -> None:
        from steeple.postgres.queue.jobs import materialize_due

        pool = self._require_db()
        inst = _metrics.instruments()
        while True:
            try:
                rows = await pool.fetch(self._sql.recover_expired, 100, timeout=self._timeout)
                if rows:
                    self.stats.recovered += len(rows)
                    inst.recovered.add(len(rows))
                    self._wake.set()
                # Due-ness is judged by the server's clock (the one claims use), never by
                # this host's: a host whose clock differs must not skip or delay occurrences.
                made = await pool.with_connection(
                    lambda conn: materialize_due(conn, schema=self.schema, limit=100),
                    timeout=self._timeout,
                )
                if made:
                    self.stats.materialized += made
                    self._wake.set()
            except DB_ERRORS as exc:
                self._db_ok = False
                _log.warning("maintenance failed: %s", exc)
            if await _wait(self._closing, self._maintenance):
                return

    def _wake_at(self, delay: float) -> None:
        """Wake the claim loop after ``delay`` seconds (a delayed task or a retry comes due)."""
        if delay <= 0:
            self._wake.set()
            return
        loop = asyncio.get_running_loop()
        # One timer per 10 ms slot, a bounded number: beyond that, polling covers it.
        slot = round((loop.time() + delay) * 100)
        if slot in self._timers or len(self._timers) >= _MAX_TIMERS:
            return

        def fire() -> None:
            self._timers.pop(slot, None)
            self._wake.set()

        # A few ms late rather than early: the database's clock decides what is due.
        self._timers[slot] = loop.call_at(slot / 100 + 0.005, fire)

    def _on_notify(self, payload: str) -> None:
        if not payload:
            self._wake.set()
            return
        try:
            due = float(payload)
            # The payload is the due time on the server's clock: count down to it on this
            # host's monotonic clock, never by comparing it with this host's wall clock.
            delay = self._server_clock.until(due, time.monotonic())
        except ValueError:
            self._wake.set()
            return
        self._wake_at(delay)

    async def _listen_forever(self) -> None:
        db = self._require_db()
        on_notify = self._on_notify

        while not self._closing.is_set():
            try:
                self._listener_ok = True
                await db.listen(
                    self._sql.channel,
                    on_notify,
                    f"steeple-listener {self.worker_id}",
                    self._closing,
                )
            except _LISTEN_ERRORS as exc:
                _log.warning("wake-up listener lost (%s); polling until it reconnects", exc)
            finally:
                self._listener_ok = False
            if self._closing.is_set():
                return
            await _wait(self._closing, min(self._poll, 1.0))
