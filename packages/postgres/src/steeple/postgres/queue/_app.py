"""The decorator API: an :class:`App` declares each task and its handler together.

A thin layer over :class:`~steeple.postgres.queue.Task`, the ``enqueue`` functions and
:meth:`Scheduler.register`: nothing here decides anything they do not.

.. code-block:: python

    app = queue.App()

    @app.task(name="send-email", retry=queue.RetryPolicy(max_attempts=5))
    async def send_email(ctx: queue.JobContext, args: dict) -> None: ...

    await send_email.enqueue(conn, {"to": "ada@example.com"})
    worker = app.scheduler(dsn, worker_id="web-1")

Periodic work is declared where its task is, and ensured when the worker starts:

.. code-block:: python

    @app.periodic("0 7 * * *", timezone="Europe/Berlin", args={"size": 256})
    @app.task(queue="images")
    def resize(ctx: queue.JobContext, args: dict) -> None: ...

    @app.task(cron="*/15 * * * *")  # args None
    async def sweep(ctx: queue.JobContext, args: None) -> None: ...
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Final, Generic, TypeVar, overload

import attrs

from steeple.core.ports import Clock
from steeple.core.zoned import DEFAULT_ZONE, ZonedCalendar
from steeple.postgres.queue import jobs
from steeple.postgres.queue._enqueue import enqueue, enqueue_many, enqueue_many_sync, enqueue_sync
from steeple.postgres.queue._execution import Handler, check_handler
from steeple.postgres.queue._schema import DEFAULT_SCHEMA, validate_schema
from steeple.postgres.queue._shared import LOG
from steeple.postgres.queue._validate import DEFAULT_QUEUE, check_bool, check_name, check_queue
from steeple.postgres.queue._worker import Scheduler
from steeple.postgres.queue.errors import QueueConfigurationError, QueueTypeError
from steeple.postgres.queue.tasks import EnqueuedTask, EnqueueOptions, RetryPolicy, Task

if TYPE_CHECKING:
    from zoneinfo import ZoneInfo

__all__ = ["PERIODIC_PREFIX", "App", "PeriodicJob", "PeriodicReport", "TaskFunction"]

PERIODIC_PREFIX: Final = "periodic:"
"""What the names of the jobs an :class:`App` declares start with (by default): how the
jobs an earlier version of its code declared, and it no longer does, are told apart."""

A = TypeVar("A")
F = TypeVar("F", bound=Callable[..., Any])
_OPTION_KEYWORDS: Final = frozenset(
    {
        "run_at", "delay", "priority", "lease_duration", "max_attempts", "backoff",
        "dedup_key", "queue",
    }
)  # fmt: skip


class TaskFunction(Generic[A]):
    """A handler declared with :meth:`App.task`: call it, enqueue it, run it.

    Calling it runs the handler itself (``await send_email(ctx, args)`` in a test);
    :meth:`enqueue` / :meth:`enqueue_sync` create tasks for workers to run.

    Attributes:
        task: the :class:`Task` (name, args type, retry policy, attempt limit).
        handler: the decorated function.
        app: the :class:`App` that declared it (its schema is where tasks go).
        queue: the named queue its tasks wait in unless an enqueue names another.
    """

    def __init__(
        self, app: App, task: Task[A], handler: Handler[A], queue: str = DEFAULT_QUEUE
    ) -> None:
        self.app = app
        self.task = task
        self.handler = handler
        self.queue = queue
        self.__name__ = getattr(handler, "__name__", task.name)
        self.__qualname__ = getattr(handler, "__qualname__", task.name)
        self.__doc__ = getattr(handler, "__doc__", None)
        self.__wrapped__ = handler

    def __repr__(self) -> str:
        return f"<steeple task {self.task.name!r}>"

    def __call__(self, ctx: Any, args: A) -> Any:
        """Run the handler directly (no queue involved)."""
        return self.handler(ctx, args)

    @property
    def name(self) -> str:
        """The task's stable name."""
        return self.task.name

    def options(self, options: EnqueueOptions | None = None, **keywords: Any) -> EnqueueOptions:
        """Return the options of one enqueue: ``options``, or ``EnqueueOptions(**keywords)``.

        Either goes to the task's declared queue unless it names another: an
        :class:`EnqueueOptions` whose ``queue`` is left at ``"default"`` takes the task's.

        Raises:
            QueueTypeError: both given; an unknown keyword; a wrong type.
            QueueConfigurationError: a value out of range.
        """
        if keywords:
            if options is not None:
                raise QueueTypeError(
                    "give options=EnqueueOptions(...) or option keywords, not both"
                )
            unknown = sorted(set(keywords) - _OPTION_KEYWORDS)
            if unknown:
                raise QueueTypeError(
                    f"unknown enqueue options {unknown}; expected some of "
                    f"{sorted(_OPTION_KEYWORDS)}"
                )
            keywords.setdefault("queue", self.queue)
            return EnqueueOptions(**keywords)
        if options is not None and not isinstance(options, EnqueueOptions):
            raise QueueTypeError(
                f"options must be EnqueueOptions or None, not {type(options).__name__}"
            )
        if options is None:
            return EnqueueOptions(queue=self.queue)
        if options.queue == DEFAULT_QUEUE and self.queue != DEFAULT_QUEUE:
            return attrs.evolve(options, queue=self.queue)
        return options

    async def enqueue(
        self,
        conn: Any,
        args: A,
        options: EnqueueOptions | None = None,
        *,
        after: Sequence[Any] | None = None,
        on_parent_failure: Any = "cancel",
        **keywords: Any,
    ) -> EnqueuedTask:
        """Create one task on ``conn`` (asyncpg or psycopg async), in the caller's transaction.

        Options as an :class:`EnqueueOptions` or as keywords (``delay=timedelta(...)``,
        ``priority=5``, ``dedup_key="..."``...); ``after=[...]`` makes it wait for those
        tasks (a workflow); see :func:`~steeple.postgres.queue.enqueue`.

        Raises:
            ArgsEncodingError: ``args`` cannot be encoded.
            UnsupportedConnectionError: ``conn`` is not an async asyncpg/psycopg connection.
            QueueConfigurationError: an option out of range.
            QueueTypeError: both ``options`` and keywords, an unknown keyword, a wrong type.
            UnfitDatabaseError: the server refused the write; nothing was stored.
            TaskNotFoundError: a task in ``after`` does not exist; nothing was stored.
        """
        chosen = self.options(options, **keywords)
        return await enqueue(
            conn,
            self.task,
            args,
            chosen,
            schema=self.app.schema,
            after=after,
            on_parent_failure=on_parent_failure,
        )

    def enqueue_sync(
        self,
        conn: Any,
        args: A,
        options: EnqueueOptions | None = None,
        *,
        after: Sequence[Any] | None = None,
        on_parent_failure: Any = "cancel",
        **keywords: Any,
    ) -> EnqueuedTask:
        """Like :meth:`enqueue`, on a psycopg (sync) ``Connection`` -- Django's, say.

        Raises:
            ArgsEncodingError: ``args`` cannot be encoded.
            UnsupportedConnectionError: ``conn`` is not a psycopg sync connection.
            QueueConfigurationError: an option out of range.
            QueueTypeError: both ``options`` and keywords, an unknown keyword, a wrong type.
            UnfitDatabaseError: the server refused the write; nothing was stored.
            TaskNotFoundError: a task in ``after`` does not exist; nothing was stored.
        """
        chosen = self.options(options, **keywords)
        return enqueue_sync(
            conn,
            self.task,
            args,
            chosen,
            schema=self.app.schema,
            after=after,
            on_parent_failure=on_parent_failure,
        )

    async def enqueue_many(
        self, conn: Any, args_list: Sequence[A], options: EnqueueOptions | None = None
    ) -> list[int]:
        """Create many tasks with one statement (see :func:`~steeple.postgres.queue.enqueue_many`).

        Raises:
            ArgsEncodingError: any args cannot be encoded (nothing is inserted).
            QueueConfigurationError: a dedup key, or more than 10,000 tasks.
            QueueTypeError: not EnqueueOptions or a sequence of args.
            UnsupportedConnectionError: ``conn`` is not an async asyncpg/psycopg connection.
            UnfitDatabaseError: the server refused the write; nothing was stored.
        """
        chosen = self.options(options)
        return await enqueue_many(conn, self.task, args_list, chosen, schema=self.app.schema)

    def enqueue_many_sync(
        self, conn: Any, args_list: Sequence[A], options: EnqueueOptions | None = None
    ) -> list[int]:
        """Like :meth:`enqueue_many`, on a psycopg (sync) ``Connection``.

        Raises:
            ArgsEncodingError: any args cannot be encoded (nothing is inserted).
            QueueConfigurationError: a dedup key, or more than 10,000 tasks.
            QueueTypeError: not EnqueueOptions or a sequence of args.
            UnsupportedConnectionError: ``conn`` is not a psycopg sync connection.
            UnfitDatabaseError: the server refused the write; nothing was stored.
        """
        chosen = self.options(options)
        return enqueue_many_sync(conn, self.task, args_list, chosen, schema=self.app.schema)


@attrs.frozen
class PeriodicJob:
    """A recurring job declared in code (``@app.periodic`` or ``@app.task(cron=...)``).

    Attributes:
        name: the job's name as stored (the app's prefix, then the declared name).
        task: the task each occurrence runs (its declared queue is the job's).
        cron: the cron expression, read in ``timezone``.
        timezone: the IANA zone name (``"UTC"`` by default).
        args: the args of every occurrence.
        options: priority, lease, attempts and backoff of every occurrence.
    """

    name: str
    task: TaskFunction[Any] = attrs.field(repr=lambda t: repr(t.name))
    cron: str
    timezone: str
    args: Any = attrs.field(repr=False)
    options: EnqueueOptions | None = None


@attrs.frozen
class PeriodicReport:
    """What :meth:`App.ensure_periodic` did.

    Attributes:
        ensured: every declared job, as stored now.
        stale: jobs named with the app's prefix that it no longer declares (left running
            unless removal was asked for).
        removed: those of them that were deleted.
    """

    ensured: tuple[jobs.JobInfo, ...]
    stale: tuple[str, ...]
    removed: tuple[str, ...]


def _check_prefix(prefix: object) -> str:
    return check_name(prefix, "periodic_prefix", max_len=100)


class App:
    """A set of tasks declared with their handlers, in one queue schema.

    Args:
        schema: the queue's PostgreSQL schema (its tasks are enqueued there; its workers
            serve it).
        periodic_prefix: what the names of the recurring jobs it declares start with
            (1-100 characters, default ``"periodic:"``). A job with this prefix that the
            app no longer declares is reported as stale at start; give each App sharing
            a schema its own prefix, or one would take the other's jobs for stale ones.

    Raises:
        QueueConfigurationError: an invalid schema name or prefix.
        QueueTypeError: a schema or prefix that is not a str.
    """

    def __init__(
        self, *, schema: str = DEFAULT_SCHEMA, periodic_prefix: str = PERIODIC_PREFIX
    ) -> None:
        validate_schema(schema)
        self.schema = schema
        self.periodic_prefix = _check_prefix(periodic_prefix)
        self._tasks: dict[str, TaskFunction[Any]] = {}
        self._periodic: dict[str, PeriodicJob] = {}

    def __repr__(self) -> str:
        return f"App(schema={self.schema!r}, tasks={sorted(self._tasks)!r})"

    @property
    def tasks(self) -> tuple[TaskFunction[Any], ...]:
        """The declared tasks, in declaration order."""
        return tuple(self._tasks.values())

    @overload
    def task(self, handler: F, /) -> TaskFunction[Any]: ...

    @overload
    def task(
        self,
        handler: None = None,
        /,
        *,
        name: str | None = None,
        args_type: type[Any] | None = None,
        max_attempts: int | None = None,
        retry: RetryPolicy | None = None,
        queue: str = DEFAULT_QUEUE,
        cron: str | None = None,
        timezone: str | ZoneInfo | None = DEFAULT_ZONE,
    ) -> Callable[[F], TaskFunction[Any]]: ...

    def task(
        self,
        handler: Callable[..., Any] | None = None,
        /,
        *,
        name: str | None = None,
        args_type: type[Any] | None = None,
        max_attempts: int | None = None,
        retry: RetryPolicy | None = None,
        queue: str = DEFAULT_QUEUE,
        cron: str | None = None,
        timezone: str | ZoneInfo | None = DEFAULT_ZONE,
    ) -> TaskFunction[Any] | Callable[[F], TaskFunction[Any]]:
        """Declare a task and its handler: ``@app.task`` or ``@app.task(name=..., ...)``.

        The handler is an ``async def`` or a plain ``def`` taking ``(ctx, args)`` (see
        :meth:`Scheduler.register`); it is checked now, not when a task first runs.

        Args:
            handler: the function, when used bare (``@app.task``).
            name: the stable task name shared by producers and workers (default: the
                function's ``__name__``; renaming the function then renames the task, so
                name tasks that outlive a refactoring explicitly).
            args_type: an attrs class or dataclass for the args (default: plain JSON).
            max_attempts: the attempt limit its enqueues snapshot (1..10000; default 5,
                or the retry policy's).
            retry: retry plain exceptions with this :class:`RetryPolicy` (default: only
                ``JobError.retry`` retries).
            queue: the named queue its tasks wait in (default ``"default"``); an enqueue
                may name another. :meth:`scheduler` serves the queues of every task.
            cron: run it on this calendar too: a recurring job named after the task, with
                args ``None``, ensured when the worker starts (see :meth:`periodic`, which
                also takes args, a job name and options).
            timezone: the IANA zone whose wall clock ``cron`` follows (default UTC).

        Returns:
            A :class:`TaskFunction` (bare use), or a decorator returning one.

        Raises:
            QueueTypeError: a handler that cannot run as ``handler(ctx, args)``; options
                of the wrong type.
            QueueConfigurationError: an invalid name or option; a name the app already
                declared; ``max_attempts`` that contradicts ``retry``; ``cron`` on a task
                with an ``args_type`` (give its args with :meth:`periodic`).
            InvalidCronExpression: a malformed ``cron``.
            InvalidTimeZoneError: an unknown ``timezone``.
        """
        check_queue(queue)
        if cron is not None:
            if args_type is not None:
                raise QueueConfigurationError(
                    "a task with an args_type needs the args of its periodic runs: declare "
                    "them with @app.periodic(cron, args=...) above @app.task"
                )
            ZonedCalendar.parse(cron, timezone)  # refused now, before anything is declared

        def declare(fn: Callable[..., Any]) -> TaskFunction[Any]:
            if isinstance(fn, TaskFunction):
                raise QueueTypeError(
                    f"{fn!r} is already declared: put @app.periodic above @app.task"
                )
            check_handler(fn)
            chosen = name if name is not None else getattr(fn, "__name__", None)
            if chosen is None or chosen == "<lambda>":
                raise QueueConfigurationError(
                    "this handler has no usable __name__: give @app.task(name=...)"
                )
            declared: Task[Any] = Task(chosen, args_type, retry=retry, max_attempts=max_attempts)
            if declared.name in self._tasks:
                raise QueueConfigurationError(
                    f"this app already declares a task named {declared.name!r}"
                )
            function: TaskFunction[Any] = TaskFunction(self, declared, fn, queue)
            if cron is not None:
                self._declare_periodic(function, cron, None, None, timezone, None)
            self._tasks[declared.name] = function
            return function

        if handler is not None:
            return declare(handler)
        return declare

    def periodic(
        self,
        cron: str,
        *,
        args: Any = None,
        name: str | None = None,
        timezone: str | ZoneInfo | None = DEFAULT_ZONE,
        options: EnqueueOptions | None = None,
    ) -> Callable[[TaskFunction[A]], TaskFunction[A]]:
        """Run a declared task on a calendar: ``@app.periodic(cron, ...)`` above ``@app.task``.

        Declares a recurring job (see :mod:`steeple.postgres.queue.jobs`) that
        :meth:`scheduler` (and ``steeple worker --app``) ensure when the worker starts:
        created the first time, brought to this declaration after a change, left alone
        when nothing changed (its cursor keeps its place). Stack it to run one task on
        several calendars (give each its own ``name``).

        Args:
            cron: a five-field cron expression or ``@hourly``, ``@daily``, ...
            args: the args of every occurrence (checked against the task's args type now).
            name: the job's name (default: the task's); stored after the app's
                ``periodic_prefix`` (``"periodic:resize"``).
            timezone: the IANA zone whose wall clock ``cron`` follows (default UTC).
            options: priority, lease, attempts, backoff or queue of every occurrence (no
                run_at, delay or dedup key); the task's declared queue by default.

        Returns:
            A decorator taking the :class:`TaskFunction` and returning it.

        Raises:
            InvalidCronExpression: a malformed ``cron``.
            InvalidTimeZoneError: an unknown ``timezone``.
            ArgsEncodingError: ``args`` the task cannot take.
            QueueConfigurationError: a bad or already declared job name; options with
                run_at, delay or dedup_key.
            QueueTypeError: options of the wrong type; (the decorator) something other
                than a task this app declared.
        """
        calendar = ZonedCalendar.parse(cron, timezone)

        def declare(function: TaskFunction[A]) -> TaskFunction[A]:
            if not isinstance(function, TaskFunction) or function.app is not self:
                raise QueueTypeError(
                    "@app.periodic takes a task this app declared: put it above @app.task"
                )
            self._declare_periodic(function, calendar.expression, args, name, timezone, options)
            return function

        return declare

    def _declare_periodic(
        self,
        function: TaskFunction[Any],
        cron: str,
        args: Any,
        name: str | None,
        timezone: str | ZoneInfo | None,
        options: EnqueueOptions | None,
    ) -> None:
        declared = function.name if name is None else check_name(name, "periodic job name")
        full = check_name(self.periodic_prefix + declared, "periodic job name")
        if full in self._periodic:
            raise QueueConfigurationError(
                f"this app already declares a periodic job named {declared!r}: give "
                "@app.periodic(..., name=...) to run a task on several calendars"
            )
        # What ensure_job would refuse, refused now: the zone, the options, the args.
        zone = ZonedCalendar.parse(cron, timezone).zone
        jobs._template(options, None)
        function.task.encode(args)
        self._periodic[full] = PeriodicJob(full, function, cron, zone, args, options)

    @property
    def periodic_jobs(self) -> tuple[PeriodicJob, ...]:
        """The recurring jobs declared in code, in declaration order."""
        return tuple(self._periodic.values())

    async def ensure_periodic(
        self, conn: Any, *, remove_stale: bool = False, clock: Clock | None = None
    ) -> PeriodicReport:
        """Bring the database's recurring jobs to the app's declarations (idempotent).

        Every declared job is ensured (:func:`steeple.postgres.queue.jobs.ensure_job`).
        A job named with the app's prefix that it no longer declares (its declaration
        was removed from the code) is stale: reported, and left running unless
        ``remove_stale`` (then deleted; tasks it already created are not touched).
        Ask for removal only once every worker runs the code without it: a worker still
        on the older code would declare it again at its next start, and one on newer
        code sees jobs only newer code declares as stale.

        Args:
            conn: an asyncpg connection or pool, or a psycopg ``AsyncConnection``.
            remove_stale: delete the stale jobs.
            clock: a clock to read "now" from instead of the database server's (tests).

        Raises:
            QueueConfigurationError: a declared calendar that never fires again.
            QueueTypeError: a ``remove_stale`` that is not a bool, a clock of the wrong type.
            UnsupportedConnectionError: ``conn`` is not an async asyncpg/psycopg connection.
            SchemaVersionMismatchError: the queue schema is missing or another version.
        """
        check_bool(remove_stale, "remove_stale")
        ensured = [
            await jobs.ensure_job(
                conn,
                p.name,
                p.task,
                p.cron,
                p.args,
                p.options,
                schema=self.schema,
                clock=clock,
                timezone=p.timezone,
            )
            for p in self._periodic.values()
        ]
        declared = list(self._periodic)
        stale = await jobs._undeclared(conn, self.periodic_prefix, declared, schema=self.schema)
        removed: list[str] = []
        if remove_stale and stale:
            removed = await jobs._undeclared(
                conn, self.periodic_prefix, declared, schema=self.schema, remove=True
            )
        return PeriodicReport(tuple(ensured), tuple(stale), tuple(removed))

    async def stale_periodic(self, conn: Any) -> list[str]:
        """Return the jobs named with the app's prefix that it no longer declares.

        Raises:
            UnsupportedConnectionError: ``conn`` is not an async asyncpg/psycopg connection.
            SchemaVersionMismatchError: the queue schema is missing or another version.
        """
        return await jobs._undeclared(
            conn, self.periodic_prefix, list(self._periodic), schema=self.schema
        )

    async def _ensure_at_start(self, conn: Any, remove_stale: bool) -> None:
        """Ensure the declared jobs as a worker starts, and say what is stale."""
        report = await self.ensure_periodic(conn, remove_stale=remove_stale)
        if report.ensured:
            LOG.info(
                "ensured %d periodic job(s): %s",
                len(report.ensured),
                ", ".join(j.name for j in report.ensured),
            )
        for name in report.stale:
            if name in report.removed:
                LOG.warning("removed periodic job %r: this app no longer declares it", name)
            else:
                LOG.warning(
                    "periodic job %r is no longer declared by this app but still runs; "
                    "remove it with app.scheduler(..., remove_stale_periodic=True), "
                    "steeple worker --remove-stale-periodic, or jobs.delete",
                    name,
                )

    @property
    def queues(self) -> list[str]:
        """The named queues its tasks are declared in, in declaration order."""
        return list(dict.fromkeys(f.queue for f in self._tasks.values()))

    def handlers(self) -> list[tuple[Task[Any], Handler[Any]]]:
        """Return ``(task, handler)`` for every declared task (what a worker registers)."""
        return [(f.task, f.handler) for f in self._tasks.values()]

    def scheduler(
        self,
        pool_or_dsn: Any,
        *,
        worker_id: str,
        remove_stale_periodic: bool = False,
        **options: Any,
    ) -> Scheduler:
        """Build a worker for every task this app declares, on the app's schema.

        When it starts (before its first claim) it ensures the app's periodic jobs
        (:meth:`ensure_periodic`), and logs a warning for each stale one; a declared
        calendar that never fires again stops the start with a
        ``QueueConfigurationError`` (from ``run_until_shutdown``).

        Args:
            pool_or_dsn: as for :class:`Scheduler`.
            worker_id: this worker's name.
            remove_stale_periodic: delete stale periodic jobs at start instead of only
                reporting them (see :meth:`ensure_periodic` for when that is safe).
            **options: any other :class:`Scheduler` option (``concurrency``, ``threads``,
                ``poll_interval``...), except ``schema`` (the app's). ``queues`` defaults
                to the queues the app's tasks are declared in.

        Raises:
            QueueConfigurationError: no task declared, a ``schema`` option, or any error
                :class:`Scheduler` raises for its options.
            QueueTypeError: an option of the wrong type.
        """
        if "schema" in options:
            raise QueueConfigurationError(
                f"the worker serves the app's schema ({self.schema!r}); set it on App(schema=)"
            )
        if not self._tasks:
            raise QueueConfigurationError("the app declares no task: decorate one with @app.task")
        check_bool(remove_stale_periodic, "remove_stale_periodic")
        options.setdefault("queues", self.queues)
        worker = Scheduler(pool_or_dsn, worker_id=worker_id, schema=self.schema, **options)
        for task, handler in self.handlers():
            worker.register(task, handler)

        async def ensure(conn: Any) -> None:
            await self._ensure_at_start(conn, remove_stale_periodic)

        worker._at_start.append(ensure)
        return worker
