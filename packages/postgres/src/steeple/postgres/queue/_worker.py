"""The worker: a :class:`Scheduler` composing the rooms that each run one of its loops.

Module map of the worker (``steeple.postgres.queue``), one room per concern:

- ``_worker.py``      Scheduler: options, registration, health(), run_until_shutdown
                      (start-up checks, composing the rooms, drain, shutdown).
- ``_claiming.py``    Claimer: the claim loop, batch claims with give-up times on the
                      estimated server clock, free slots shared by demand among queues,
                      claimed rows into running attempts (sync ones onto free threads,
                      handed back when none frees up in time).
- ``_execution.py``   JobContext, Handler, Registration; Executor: runs a handler, turns
                      its return or exception into an outcome; cancels at a hard stop.
- ``_threads.py``     HandlerThreads: the daemon thread pool of plain ``def`` handlers.
- ``_completions.py`` Completions: the batched success flusher, confirming lost replies,
                      writing failures/retries, fencing, releasing at shutdown.
- ``_renewal.py``     Renewer: token-guarded lease renewal, lease-lost/cancelled signals.
- ``_progress.py``    ProgressWriter: handlers' reported progress, batched, token-fenced.
- ``_failures.py``    what a failed attempt records: exception type, message, traceback.
- ``_wakeups.py``     Wakeups: the claim loop's wake event, LISTEN/NOTIFY, due-time timers.
- ``_maintenance.py`` Maintainer: expired-lease recovery, recurring-job materialization.
- ``_inflight.py``    Claimed (one running attempt) and InFlight (all of them, slots, idle).
- ``_outage.py``      each loop's retry backoff; the one rate-limited report of an
                      unreachable database (logs, health()).
- ``_shared.py``      WorkerEnv (settings, pool, clocks shared by the rooms), WorkerStatus
                      (the flags behind health()), Health, WorkerStats.
- ``_aio.py``         small asyncio waits shared by the loops.
- ``_sql.py``         every statement, task states computed from core's transition table.

Every outcome written is fenced by the attempt's lease token: a worker that lost its
lease cannot finish, fail, renew or release anything.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Final, TypeVar

import asyncpg

from steeple.core.clock import SystemClock
from steeple.core.dsn import conninfo_url
from steeple.core.entropy import SystemRandom
from steeple.core.errors import ConfigurationError
from steeple.core.ports import Clock, RandomSource
from steeple.postgres._durability import DurabilityProblem, check_transport
from steeple.postgres.pooler import (
    Pooler,
    PoolerAdvice,
    PoolerProblem,
    asyncpg_options,
    check_pooler,
    pooler_refusal,
)
from steeple.postgres.queue import _driver, _metrics
from steeple.postgres.queue._aio import wait_either
from steeple.postgres.queue._claiming import Claimer
from steeple.postgres.queue._completions import Completions
from steeple.postgres.queue._db import (
    DB_ERRORS,
    SERVER_SETTINGS,
    WorkerDb,
    check_durable,
    keep_session,
    listening_on,
    open_db,
)
from steeple.postgres.queue._execution import (
    Executor,
    Handler,
    JobContext,
    Registration,
    check_handler,
)
from steeple.postgres.queue._failures import connection_secrets, scrub_secrets
from steeple.postgres.queue._maintenance import Maintainer
from steeple.postgres.queue._progress import ProgressWriter
from steeple.postgres.queue._renewal import Renewer
from steeple.postgres.queue._schema import DEFAULT_SCHEMA, check_schema, validate_schema
from steeple.postgres.queue._shared import LOG, Health, WorkerEnv, WorkerStats, WorkerStatus
from steeple.postgres.queue._sql import queue_sql
from steeple.postgres.queue._threads import HandlerThreads
from steeple.postgres.queue._validate import (
    DEFAULT_QUEUE,
    check_bool,
    check_int,
    check_name,
    check_queue,
    check_seconds,
)
from steeple.postgres.queue._wakeups import Wakeups
from steeple.postgres.queue.errors import (
    QueueConfigurationError,
    QueueError,
    QueueTypeError,
    QueueUnavailableError,
    UnknownTaskError,
)
from steeple.postgres.queue.tasks import Task, declared_task
from steeple.runtime.looplag import DEFAULT_LOOP_LAG_THRESHOLD, LoopStall, watching_event_loop

if TYPE_CHECKING:
    from steeple.postgres.queue._app import TaskFunction

__all__ = ["Handler", "Health", "JobContext", "Scheduler", "WorkerStats"]

A = TypeVar("A")

_MAX_INTERVAL: Final = 3600.0  # the longest poll / maintenance interval and query timeout
_MAX_DRAIN: Final = 86_400.0
_MAX_CONCURRENCY: Final = 100_000
_MAX_THREADS: Final = 1024
_DEFAULT_THREADS: Final = 32
_MAX_QUEUES: Final = 100
# Seconds handlers get to end once a hard stop cancelled them, before they are closed.
_CANCEL_GRACE: Final = 2.0


def _served(queues: object, concurrency: int) -> list[tuple[str, int]]:
    """Check the queues a worker serves; return (name, its limit in this worker) pairs."""
    if isinstance(queues, Mapping):
        pairs = list(queues.items())
    elif isinstance(queues, Sequence) and not isinstance(queues, str | bytes | bytearray):
        pairs = [(name, concurrency) for name in queues]
    else:
        raise QueueTypeError(
            "queues must be a list of queue names or a mapping of name to concurrency, "
            f"not {type(queues).__name__}"
        )
    if not 1 <= len(pairs) <= _MAX_QUEUES:
        raise QueueConfigurationError(f"a worker serves 1..{_MAX_QUEUES} queues, got {len(pairs)}")
    seen: set[str] = set()
    for name, limit in pairs:
        check_queue(name)
        check_int(limit, f"the concurrency of queue {name!r}", 1, _MAX_CONCURRENCY)
        if name in seen:
            raise QueueConfigurationError(f"queue {name!r} is listed twice")
        seen.add(name)
    return [(name, min(limit, concurrency)) for name, limit in pairs]


def _check_dsn(dsn: object, what: str) -> str:
    """Refuse a DSN that is not a usable str (never quoting it); return it as a URL.

    A malformed DSN would come back from the driver with pieces of it quoted; a remote
    host without verified TLS is refused as the recurring store refuses it (durability
    fails closed): one check, steeple.postgres._durability's. asyncpg reads only URLs, so
    a libpq key=value string is rewritten.
    """
    if not isinstance(dsn, str):
        raise QueueTypeError(f"{what} must be a str, not {type(dsn).__name__}")
    if not dsn or "\x00" in dsn or not _encodable(dsn):
        raise QueueConfigurationError(
            f"{what} must be a non-empty str without NUL or lone surrogates"
        )
    try:
        url = conninfo_url(dsn)
        check_transport(url)
    except ConfigurationError as exc:
        raise QueueConfigurationError(str(exc) if what == "the DSN" else f"{what}: {exc}") from None
    except DurabilityProblem as exc:
        raise QueueConfigurationError(str(exc) if what == "the DSN" else f"{what}: {exc}") from None
    return url


_POOLER_ADVICE: Final = PoolerAdvice(
    "create it as Scheduler(..., pooler='transaction') or App.scheduler(..., pooler='transaction')",
    listen="listen_dsn",
)
"""What a worker whose DSN leads to an undeclared transaction pooler says to change."""


def _check_pool_for_pooler(pool: object) -> None:
    """Refuse a caller's asyncpg pool whose connections keep named prepared statements.

    Behind a transaction pooler a statement prepared in one transaction is gone (or is
    another's) in the next. psycopg statements are always sent unprepared.
    """
    kwargs = getattr(pool, "_connect_kwargs", None)
    cached = isinstance(kwargs, Mapping) and kwargs.get("statement_cache_size", 100) != 0
    if isinstance(pool, asyncpg.Pool) and cached:
        raise QueueConfigurationError(
            "with pooler='transaction' an asyncpg pool must be created with "
            "statement_cache_size=0 (its cached statements are named prepared "
            "statements, which a transaction pooler does not keep)"
        )


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class Scheduler:
    """A worker running registered handlers for due tasks of named queues in one schema.

    Args:
        pool_or_dsn: an asyncpg pool or a psycopg_pool ``AsyncConnectionPool`` (the
            caller owns it), or a DSN (the worker opens and closes its own asyncpg pool).
        worker_id: this worker's name, recorded on claimed tasks (1-200 chars).
        schema: the queue's PostgreSQL schema.
        poll_interval: seconds (or timedelta) between polls when no NOTIFY arrives.
        concurrency: the most handlers running at once in this worker.
        threads: the size of the thread pool that runs plain ``def`` handlers (1..1024;
            default ``min(concurrency, 32)``). Created only when such a handler is
            registered. The worker claims no more sync tasks than it has free threads
            (while every thread is taken it claims only tasks of async handlers); a claimed
            sync task that gets no thread within a quarter of its lease is handed back
            (pending, attempt refunded) for other workers.
        queues: the named queues served: a list of names (each may use all of
            ``concurrency``), or a mapping of name to the most of its tasks running at
            once in this worker (capped by ``concurrency``). Default: ``["default"]``.
            Free slots follow demand: shared among the queues each round, and those of a
            queue that answers empty (or paused, or held by a limit) go to the others
            without waiting for a poll.
            Limits across all workers, pauses and rate limits are stored in the database
            (see :mod:`steeple.postgres.queue.admin`) and applied by every claim.
        batch_size: the most tasks claimed per query (default: ``concurrency``).
        maintenance_interval: seconds between expired-lease recovery and job materialization.
        listen: use LISTEN/NOTIFY wake-ups (polling alone when False).
        pooler: ``"transaction"`` when ``pool_or_dsn`` leads through a connection pooler in
            transaction mode (PgBouncer ``pool_mode = transaction``); ``None`` (default)
            for a direct connection or a pooler in session mode. Through a transaction
            pooler the worker keeps no session state (see :mod:`steeple.postgres.pooler`):
            the pool it opens from a DSN has no statement cache and sends no session
            settings, a caller's asyncpg pool must have been created with
            ``statement_cache_size=0``, and LISTEN needs ``listen_dsn``; without it the
            worker polls every ``poll_interval`` and logs so once at start.
        listen_dsn: a DSN straight to PostgreSQL (not through a transaction pooler) on
            which the wake-up listener LISTENs, one connection per worker; the pool serves
            everything else. ``None``: the listener takes a connection of the pool (not
            through a transaction pooler: polling then).
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
        loop_lag_threshold: seconds of event-loop lag reported as a stall: a warning names
            the handler (task and code) that blocked the loop, and ``stats.loop_stalls``
            and the ``steeple.queue.loop_stall`` histogram count it. ``None`` turns the
            detection off (see :mod:`steeple.runtime.looplag`). A handler that blocks the
            loop past its lease loses it: another worker runs the task and this one's
            late outcome is rejected.

    Intervals and timeouts are seconds (int or float) or timedeltas: poll and maintenance
    intervals 0.001 s .. 1 h, query_timeout 0.1 s .. 1 h, loop_lag_threshold 0.01 s .. 1 h.

    Raises:
        QueueConfigurationError: an invalid worker id, schema, queue name, count or
            interval (NaN, infinite, negative, zero or too large), no queue or a queue
            listed twice, an invalid DSN (see :func:`steeple.core.dsn.check_dsn`; the
            message never quotes the DSN), or a DSN naming a remote host without verified
            TLS (``sslmode=verify-full`` or ``verify-ca``; loopback and Unix sockets may
            use any mode); the same for ``listen_dsn``; a ``pooler`` other than ``None`` or
            ``"transaction"``; with ``pooler="transaction"``, a caller's asyncpg pool with a
            statement cache.
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
        threads: int | None = None,
        queues: Sequence[str] | Mapping[str, int] = (DEFAULT_QUEUE,),
        batch_size: int | None = None,
        maintenance_interval: float | timedelta = 1.0,
        listen: bool = True,
        pooler: Pooler | None = None,
        listen_dsn: str | None = None,
        query_timeout: float | timedelta = 30.0,
        require_durable: bool = True,
        clock: Clock | None = None,
        random: RandomSource | None = None,
        loop_lag_threshold: float | timedelta | None = DEFAULT_LOOP_LAG_THRESHOLD,
    ) -> None:
        check_name(worker_id, "worker_id")
        validate_schema(schema)
        check_int(concurrency, "concurrency", 1, _MAX_CONCURRENCY)
        pool_size = min(concurrency, _DEFAULT_THREADS) if threads is None else threads
        check_int(pool_size, "threads", 1, _MAX_THREADS)
        self._queues = _served(queues, concurrency)
        batch = concurrency if batch_size is None else batch_size
        check_int(batch, "batch_size", 1, 1000)
        poll = check_seconds(poll_interval, "poll_interval", 0.001, _MAX_INTERVAL)
        maintenance = check_seconds(
            maintenance_interval, "maintenance_interval", 0.001, _MAX_INTERVAL
        )
        query = check_seconds(query_timeout, "query_timeout", 0.1, _MAX_INTERVAL)
        self._loop_lag = (
            None
            if loop_lag_threshold is None
            else check_seconds(loop_lag_threshold, "loop_lag_threshold", 0.01, _MAX_INTERVAL)
        )
        check_bool(listen, "listen")
        try:
            self._pooler = check_pooler(pooler)
        except PoolerProblem as exc:
            raise QueueConfigurationError(str(exc)) from None
        if listen_dsn is not None:
            listen_dsn = _check_dsn(listen_dsn, "listen_dsn")
        if self._pooler is not None and not isinstance(pool_or_dsn, str):
            _check_pool_for_pooler(pool_or_dsn)
        self._listen_dsn = listen_dsn
        # Through a transaction pooler LISTEN works only on a direct connection.
        listen = listen and (self._pooler is None or listen_dsn is not None)
        check_bool(require_durable, "require_durable")
        if clock is not None and not callable(getattr(clock, "now", None)):
            raise QueueTypeError(f"clock must have a now() method, not {type(clock).__name__}")
        if random is not None and not callable(getattr(random, "random", None)):
            raise QueueTypeError(f"random must have a random() method, not {type(random).__name__}")
        if isinstance(pool_or_dsn, str):
            pool_or_dsn = _check_dsn(pool_or_dsn, "the DSN")
        elif open_db(pool_or_dsn) is None:
            raise QueueConfigurationError(
                "pool_or_dsn must be an asyncpg Pool, a psycopg_pool AsyncConnectionPool "
                "or a DSN string"
            )
        self._source = pool_or_dsn
        self.worker_id = worker_id
        self.schema = schema
        self._sql = queue_sql(schema)
        self._maintenance = maintenance
        self._concurrency = concurrency
        self._threads = pool_size
        self._batch = batch
        self._listen = listen
        self._require_durable = require_durable
        self._registry: dict[str, Registration[Any]] = {}
        # Run on one connection once the schema is checked, before the first claim (an
        # App ensures its periodic jobs there).
        self._at_start: list[Callable[[Any], Awaitable[None]]] = []
        self._started = False
        self.stats = WorkerStats()
        self._env = WorkerEnv(
            worker_id=worker_id,
            schema=schema,
            sql=self._sql,
            poll=poll,
            timeout=query,
            clock=clock or SystemClock(),
            random=random or SystemRandom(),
            status=WorkerStatus(listen=listen),
            stats=self.stats,
            secrets=tuple(
                sorted(
                    {*connection_secrets(pool_or_dsn), *connection_secrets(listen_dsn)},
                    key=len,
                    reverse=True,
                )
            ),
        )

    def __repr__(self) -> str:
        return f"Scheduler(worker_id={self.worker_id!r}, schema={self.schema!r})"

    @property
    def queues(self) -> dict[str, int]:
        """The queues this worker serves, each with its concurrency limit in this worker."""
        return dict(self._queues)

    @property
    def _db(self) -> WorkerDb | None:
        return self._env.db_or_none

    def register(self, task: Task[A] | TaskFunction[A], handler: Handler[A]) -> None:
        """Run ``handler`` for tasks named ``task.name``.

        ``handler(ctx, args)`` is an ``async def`` (run on the event loop) or a plain
        ``def`` (run in the worker's thread pool of ``threads``, with the same
        :class:`JobContext`: read ``ctx.lease_lost.is_set()`` / ``ctx.cancelled.is_set()``
        or call ``ctx.check_lease()`` from the thread). A plain function that returns an
        awaitable has it awaited on the event loop.

        Raises:
            UnknownTaskError: that task name already has a handler.
            QueueTypeError: ``task`` is not a Task (or an ``@app.task`` function);
                ``handler`` is not a function that can be called as ``handler(ctx, args)``
                (not callable, a coroutine object, a class, a generator or async generator
                function, another arity).
            QueueError: the worker has already started.
        """
        task, _ = declared_task(task)
        run_async = check_handler(handler)
        if self._started:
            raise QueueError("register handlers before run_until_shutdown")
        if task.name in self._registry:
            raise UnknownTaskError(f"task {task.name!r} already has a handler")
        self._registry[task.name] = Registration(task, handler, run_async)

    def health(self) -> Health:
        """Report starting / healthy / degraded / stopped.

        Starting until the first claim round has finished and the wake-up listener is
        LISTENing (or its first attempt failed and the worker polls). Then healthy, or
        degraded while the database is unreachable (connections refused, lost or
        unanswered, until a statement is answered again), while the latest claim round
        failed or was refused (until a claim
        succeeds again), while completions, lease renewals or maintenance keep failing
        (each until that same activity succeeds again: claims that work say nothing about
        completions that time out), while the wake-up listener is down, or while a table
        of the queue holds 100,000 dead rows or more (looked at every 30 s: the reason
        names who holds the vacuum horizon, see :mod:`steeple.postgres.horizon`).
        :meth:`health_reasons` says which.
        """
        return self._env.status.health()

    def health_reasons(self) -> tuple[str, ...]:
        """Say why :meth:`health` is degraded: one line per cause, empty when it is not.

        Each line names the activity and the cause, e.g. ``"completions failing: PostgreSQL
        refused the write because the session is read-only (SQLSTATE 25006 ...)"`` or
        ``"wake-up listener down: polling until it reconnects"``.
        """
        return self._env.status.reasons()

    # --- lifecycle -----------------------------------------------------------------------

    async def run_until_shutdown(
        self,
        stop: asyncio.Event,
        *,
        drain_timeout: float | timedelta = 30.0,
        hard_stop: asyncio.Event | None = None,
    ) -> None:
        """Work until ``stop`` is set, then drain gracefully within ``drain_timeout``.

        After ``stop``: no new claims; claimed tasks not yet started (sync handlers waiting
        for a thread) are handed back at once; running handlers get ``drain_timeout`` to finish;
        the rest are cancelled and their tasks handed back (pending, attempt refunded);
        buffered completions are written; the pool (if the worker opened it) is closed.
        Setting ``hard_stop`` (say on a second SIGTERM) ends the drain at once: it stops
        claiming as ``stop`` does, and the handlers still running are cancelled and their
        tasks handed back now. A handler that ignores its cancellation (a coroutine that
        catches ``CancelledError``) is closed two seconds later (one that ignores even
        that keeps this call waiting for it, its task already handed back: the ``steeple
        worker`` command then ends its process); a plain ``def`` handler's
        thread cannot be stopped, so it is left running (its ``ctx.lease_lost`` set,
        nothing it does recorded), in a daemon thread that never keeps the process alive.
        A task whose release cannot be written is left to its lease, which lapses; it is
        recovered and run again, never completed twice (every outcome is fenced by the
        lease token). What a handler raises, ``BaseException`` included (``SystemExit``,
        ``KeyboardInterrupt``, ``GeneratorExit``, a ``CancelledError`` nobody asked for),
        fails its task alone; a ``KeyboardInterrupt`` or ``SystemExit`` raised by a signal
        handler of the process (Ctrl-C, while SIGINT has Python's default handler) is not
        a handler's failure and propagates.

        Raises:
            SchemaVersionMismatchError: the queue schema is missing or another version.
            UnfitDatabaseError: the server or schema could lose acknowledged work.
            QueueUnavailableError: the database failed or was unreachable at start-up.
            QueueConfigurationError: a pool too small for the worker; a ``drain_timeout``
                that is NaN, infinite, negative or over a day; a DSN that cannot be parsed;
                a DSN leading through a transaction pooler (PgBouncer refused a session
                setting) without ``pooler="transaction"``.
            QueueTypeError: ``stop`` or ``hard_stop`` is not an ``asyncio.Event``, or a
                wrong-typed ``drain_timeout``.
            UnknownTaskError: no handler is registered.
            QueueError: called twice.
        """
        hard, drain = _check_run_arguments(stop, hard_stop, drain_timeout)
        if self._started:
            raise QueueError("a Scheduler runs once; create a new one")
        if not self._registry:
            raise UnknownTaskError("register at least one handler before running")
        self._started = True
        env = self._env
        owned = isinstance(self._source, str)
        threads = (
            HandlerThreads(max_workers=self._threads, thread_name_prefix="steeple-handler")
            if any(not r.run_async for r in self._registry.values())
            else None
        )
        try:
            await self._open_checked()
            await self._serve(stop, hard, drain, threads)
        finally:
            env.status.stopped()
            if threads is not None:
                # Threads the drain gave up on keep running (a thread cannot be stopped);
                # their ctx.lease_lost is set and nothing they do is recorded. They are
                # daemon threads: they never keep the process from exiting.
                threads.shutdown(wait=False, cancel_futures=True)
            if env.db_or_none is not None:
                await env.db_or_none.close_reserve()
                if owned:
                    await env.db_or_none.close()

    async def _open_checked(self) -> None:
        """Open the database and check it fits; a start-up failure raises the typed error."""
        env = self._env
        try:
            env.db_or_none = await self._open()
            await self._check_fit(env.db)
        except DB_ERRORS as exc:
            refused = pooler_refusal(exc)
            if refused is not None:
                raise QueueConfigurationError(refused.explain(_POOLER_ADVICE)) from exc
            raise QueueUnavailableError(
                "the worker could not start: "
                + scrub_secrets(f"{type(exc).__name__}: {exc}", env.secrets)
            ) from exc
        env.status.started()
        if self._pooler is not None and self._listen_dsn is None:
            LOG.warning(
                "%s: wake-ups are by polling every %g s: the pool leads through a "
                "transaction pooler, where LISTEN does not work; give listen_dsn (CLI: "
                "--listen-dsn) a direct connection to PostgreSQL for NOTIFY wake-ups",
                self.worker_id,
                env.poll,
            )

    async def _serve(
        self,
        stop: asyncio.Event,
        hard: asyncio.Event,
        drain: float,
        threads: HandlerThreads | None,
    ) -> None:
        """Run the services and the claim loop until a stop, then drain and release."""
        env = self._env
        wakeups = Wakeups(env)
        completions = Completions(env, wakeups)
        progress = ProgressWriter(env)
        executor = Executor(env, self._registry, completions, threads, progress)
        claimer = Claimer(
            env,
            list(self._registry),
            queues=self._queues,
            concurrency=self._concurrency,
            batch=self._batch,
            wakeups=wakeups,
            executor=executor,
            completions=completions,
            sync_names=[name for name, r in self._registry.items() if not r.run_async],
            threads=self._threads,
        )
        async with (
            watching_event_loop(self._loop_lag, on_stall=self._stalled),
            asyncio.TaskGroup() as services,
        ):
            if self._listen:
                services.create_task(wakeups.listen_forever())
            services.create_task(Renewer(env).renew_forever())
            services.create_task(Maintainer(env, wakeups, self._maintenance).maintain_forever())
            services.create_task(completions.flush_forever())
            services.create_task(progress.write_forever())
            # A hard stop stops claiming too (the claim loop watches one event).
            claiming = asyncio.Event()
            if stop.is_set() or hard.is_set():
                claiming.set()
            services.create_task(_either(stop, hard, claiming, env.closing))
            try:
                async with asyncio.TaskGroup() as handlers:
                    await claimer.claim_until(claiming, handlers)
                    await self._drain(executor, completions, drain, hard)
                await completions.release_unfinished()
            finally:
                env.closing.set()
                completions.stop()
                progress.stop()
                wakeups.cancel_timers()

    def _stalled(self, stall: LoopStall) -> None:
        # The monitor logged it, naming the culprit; counted here for this worker.
        self.stats.loop_stalls += 1
        _metrics.instruments().loop_stall.record(stall.lag)

    async def _open(self) -> WorkerDb:
        if isinstance(self._source, str):
            source = await self._open_pool(self._source)
        else:
            source = self._source
        db = open_db(source)
        if db is None:  # __init__ checked it; a pool type cannot change since
            raise QueueConfigurationError("pool_or_dsn is no longer a supported pool")
        return listening_on(db, self._listen_dsn if self._listen else None)

    async def _open_pool(self, dsn: str) -> asyncpg.Pool:
        try:
            async with asyncio.timeout(self._env.timeout):
                pool: asyncpg.Pool = await asyncpg.create_pool(
                    dsn,
                    # No floor: asyncpg would restore it in the background while the
                    # database is down, logging a traceback for each attempt; the loops
                    # open what they need, with their own backoff and one report.
                    min_size=0,
                    max_size=8,
                    max_inactive_connection_lifetime=60,
                    # No reset query on release: one round trip less per statement.
                    reset=keep_session,
                    # Named per worker: operators (and tests) find its sessions in
                    # pg_stat_activity, as they find its listener.
                    **asyncpg_options(
                        self._pooler,
                        {
                            **SERVER_SETTINGS,
                            "application_name": f"steeple-queue {self.worker_id}"[:63],
                        },
                    ),
                )
        except (ValueError, TypeError) as exc:
            # asyncpg parses the DSN here (a bad port, an unknown option...).
            # Its message may quote the DSN, password included: not repeated.
            raise QueueConfigurationError(
                f"the worker's DSN could not be parsed ({type(exc).__name__}); "
                "check its host, port and query parameters"
            ) from None
        return pool

    async def _check_fit(self, db: WorkerDb) -> None:
        # Claims + completions, + the listener when it takes a pooled connection.
        pooled_listener = self._listen and self._listen_dsn is None
        needed = 3 if pooled_listener else 2
        if db.max_size() < needed:
            raise QueueConfigurationError(
                f"the pool must allow at least {needed} connections (claims, completions"
                + (", the listener)" if pooled_listener else ")")
            )

        async def check(conn: Any) -> None:
            await check_schema(conn, self.schema)
            if self._require_durable:
                await check_durable(
                    conn,
                    self.schema,
                    ("schema_migrations", "tasks", "attempts", "jobs", "settings"),
                )
            # Claims carry a give-up time on the server's clock: anchor the estimate of it.
            ((server,),) = await _driver.fetch(
                conn, "SELECT extract(epoch FROM clock_timestamp())::double precision"
            )
            self._env.server_clock.observe(float(server), time.monotonic())
            for step in self._at_start:
                await step(conn)

        await db.with_connection(check, timeout=self._env.timeout)

    async def _drain(
        self, executor: Executor, completions: Completions, timeout: float, hard: asyncio.Event
    ) -> None:
        inflight = self._env.inflight
        if not inflight.running:
            return
        idle = asyncio.ensure_future(inflight.idle.wait())
        try:
            await wait_either(hard, idle, timeout)
        finally:
            idle.cancel()
        if inflight.running:
            LOG.warning(
                "%s: handing back %d running task(s) (%s)",
                self.worker_id,
                len(inflight.running),
                "hard stop" if hard.is_set() else f"the {timeout:g} s drain deadline passed",
            )
            executor.cancel_all()
            # A handler that ignores its cancellation (a coroutine catching CancelledError)
            # must not keep the worker from stopping: after a short grace it is closed.
            if inflight.running:
                idle = asyncio.ensure_future(inflight.idle.wait())
                try:
                    await asyncio.wait({idle}, timeout=_CANCEL_GRACE)
                finally:
                    idle.cancel()
            if inflight.running:
                closed = executor.close_stubborn()
                LOG.warning(
                    "%s: %d handler(s) ignored the hard stop for %g s: closed, their tasks "
                    "handed back",
                    self.worker_id,
                    closed,
                    _CANCEL_GRACE,
                )
            # Written now, not once every handler has ended: a handler that ignores even
            # being closed cannot hold them back.
            await completions.release_unfinished()


async def _either(
    first: asyncio.Event, second: asyncio.Event, then: asyncio.Event, closing: asyncio.Event
) -> None:
    """Set ``then`` once ``first`` or ``second`` is set (unless ``closing`` comes first)."""
    waiters = [asyncio.ensure_future(e.wait()) for e in (first, second, closing)]
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()
    if not closing.is_set():
        then.set()


def _check_run_arguments(
    stop: asyncio.Event, hard_stop: asyncio.Event | None, drain_timeout: float | timedelta
) -> tuple[asyncio.Event, float]:
    """Refuse wrong-typed stop events and drain timeouts; return the hard stop and drain."""
    if not isinstance(stop, asyncio.Event):
        raise QueueTypeError(f"stop must be an asyncio.Event, not {type(stop).__name__}")
    if hard_stop is not None and not isinstance(hard_stop, asyncio.Event):
        raise QueueTypeError(f"hard_stop must be an asyncio.Event, not {type(hard_stop).__name__}")
    hard = hard_stop if hard_stop is not None else asyncio.Event()
    return hard, check_seconds(drain_timeout, "drain_timeout", 0.0, _MAX_DRAIN)
