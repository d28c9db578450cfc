"""The decorator API: an :class:`App` declares each task and its handler together.

A thin layer over :class:`~steeple.postgres.queue.Task`, the ``enqueue`` functions and
:meth:`Scheduler.register`: nothing here decides anything they do not.

.. code-block:: python

    app = queue.App()

    @app.task(name="send-email", retry=queue.RetryPolicy(max_attempts=5))
    async def send_email(ctx: queue.JobContext, args: dict) -> None: ...

    await send_email.enqueue(conn, {"to": "ada@example.com"})
    worker = app.scheduler(dsn, worker_id="web-1")
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Final, Generic, TypeVar, overload

import attrs

from steeple.postgres.queue._enqueue import enqueue, enqueue_many, enqueue_many_sync, enqueue_sync
from steeple.postgres.queue._execution import Handler, check_handler
from steeple.postgres.queue._schema import DEFAULT_SCHEMA, validate_schema
from steeple.postgres.queue._validate import DEFAULT_QUEUE, check_queue
from steeple.postgres.queue._worker import Scheduler
from steeple.postgres.queue.errors import QueueConfigurationError, QueueTypeError
from steeple.postgres.queue.tasks import EnqueuedTask, EnqueueOptions, RetryPolicy, Task

__all__ = ["App", "TaskFunction"]

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
        self, conn: Any, args: A, options: EnqueueOptions | None = None, **keywords: Any
    ) -> EnqueuedTask:
        """Create one task on ``conn`` (asyncpg or psycopg async), in the caller's transaction.

        Options as an :class:`EnqueueOptions` or as keywords (``delay=timedelta(...)``,
        ``priority=5``, ``dedup_key="..."``...); see :func:`~steeple.postgres.queue.enqueue`.

        Raises:
            ArgsEncodingError: ``args`` cannot be encoded.
            UnsupportedConnectionError: ``conn`` is not an async asyncpg/psycopg connection.
            QueueConfigurationError: an option out of range.
            QueueTypeError: both ``options`` and keywords, an unknown keyword, a wrong type.
            UnfitDatabaseError: the server refused the write; nothing was stored.
        """
        chosen = self.options(options, **keywords)
        return await enqueue(conn, self.task, args, chosen, schema=self.app.schema)

    def enqueue_sync(
        self, conn: Any, args: A, options: EnqueueOptions | None = None, **keywords: Any
    ) -> EnqueuedTask:
        """Like :meth:`enqueue`, on a psycopg (sync) ``Connection`` -- Django's, say.

        Raises:
            ArgsEncodingError: ``args`` cannot be encoded.
            UnsupportedConnectionError: ``conn`` is not a psycopg sync connection.
            QueueConfigurationError: an option out of range.
            QueueTypeError: both ``options`` and keywords, an unknown keyword, a wrong type.
            UnfitDatabaseError: the server refused the write; nothing was stored.
        """
        chosen = self.options(options, **keywords)
        return enqueue_sync(conn, self.task, args, chosen, schema=self.app.schema)

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


class App:
    """A set of tasks declared with their handlers, in one queue schema.

    Args:
        schema: the queue's PostgreSQL schema (its tasks are enqueued there; its workers
            serve it).

    Raises:
        QueueConfigurationError: an invalid schema name.
        QueueTypeError: a schema that is not a str.
    """

    def __init__(self, *, schema: str = DEFAULT_SCHEMA) -> None:
        validate_schema(schema)
        self.schema = schema
        self._tasks: dict[str, TaskFunction[Any]] = {}

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
                ``JobError.retry`` retries, as in seed 002).
            queue: the named queue its tasks wait in (default ``"default"``); an enqueue
                may name another. :meth:`scheduler` serves the queues of every task.

        Returns:
            A :class:`TaskFunction` (bare use), or a decorator returning one.

        Raises:
            QueueTypeError: a handler that cannot run as ``handler(ctx, args)``; options
                of the wrong type.
            QueueConfigurationError: an invalid name or option; a name the app already
                declared; ``max_attempts`` that contradicts ``retry``.
        """
        check_queue(queue)

        def declare(fn: Callable[..., Any]) -> TaskFunction[Any]:
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
            self._tasks[declared.name] = function
            return function

        if handler is not None:
            return declare(handler)
        return declare

    @property
    def queues(self) -> list[str]:
        """The named queues its tasks are declared in, in declaration order."""
        return list(dict.fromkeys(f.queue for f in self._tasks.values()))

    def handlers(self) -> list[tuple[Task[Any], Handler[Any]]]:
        """Return ``(task, handler)`` for every declared task (what a worker registers)."""
        return [(f.task, f.handler) for f in self._tasks.values()]

    def scheduler(self, pool_or_dsn: Any, *, worker_id: str, **options: Any) -> Scheduler:
        """Build a worker for every task this app declares, on the app's schema.

        Args:
            pool_or_dsn: as for :class:`Scheduler`.
            worker_id: this worker's name.
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
        options.setdefault("queues", self.queues)
        worker = Scheduler(pool_or_dsn, worker_id=worker_id, schema=self.schema, **options)
        for task, handler in self.handlers():
            worker.register(task, handler)
        return worker
