"""``steeple worker --app module:object``: run an application's relay and task handlers.

The object is a :class:`WorkerApp` or a work-queue :class:`steeple.postgres.queue.App`
(every task it declares is served, on its schema), or a callable (sync or async, no
arguments) returning one. A ``broker`` runs :class:`steeple.postgres.RecurringRelay`
(tick, claim, relay) for the namespace; ``tasks`` run the work-queue worker. SIGINT /
SIGTERM stop both gracefully: nothing new is claimed, in-flight work finishes (within
``drain_timeout``), then the process exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import inspect
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from steeple.admin.settings import CliError, ExitCode
from steeple.core.ports import MessageBroker

if TYPE_CHECKING:
    from steeple.admin._backend import Target

__all__ = ["WorkerApp", "load_worker_app", "run_worker"]


@attrs.frozen
class WorkerApp:
    """What ``steeple worker`` runs for an application.

    Attributes:
        broker: where recurring occurrences are published; ``None`` runs no relay.
        tasks: ``(Task, handler)`` pairs for the work-queue worker; empty runs no worker.
        worker_id: the task worker's name (shown on claimed tasks).
        concurrency: the most task handlers running at once.
        relay_batch: leases claimed per relay round (1-100).
        drain_timeout: seconds in-flight handlers get after a stop signal.
        queue_schema: the work queue's schema (default: the command's ``--queue-schema``);
            set from a ``steeple.postgres.queue.App``'s schema.
        queues: the named queues the task worker serves (default: ``"default"`` only);
            set from the queues an App's tasks are declared in.
    """

    broker: MessageBroker | None = None
    tasks: Sequence[tuple[Any, Callable[..., Any]]] = ()
    worker_id: str = "steeple-worker"
    concurrency: int = 16
    relay_batch: int = 20
    drain_timeout: float = 30.0
    queue_schema: str | None = None
    queues: Sequence[str] | None = None


def load_worker_app(reference: str) -> Any:
    """Import ``module:attribute`` (the current directory is importable).

    Raises:
        CliError: (usage) not ``module:object``; (config) the module or object is missing.
    """
    module_name, sep, attribute = reference.partition(":")
    if not sep or not module_name or not attribute:
        raise CliError(
            f"--app {reference!r} is not module:object",
            code=ExitCode.USAGE,
            hint="write it like --app myproject.worker:app",
        )
    cwd = str(Path.cwd())
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise CliError(
            f"cannot import {module_name!r}: {exc}",
            code=ExitCode.CONFIG,
            hint="run from your project's directory, or fix PYTHONPATH",
        ) from None
    value: Any = module
    for part in attribute.split("."):
        try:
            value = getattr(value, part)
        except AttributeError:
            raise CliError(
                f"{module_name!r} has no attribute {attribute!r}",
                code=ExitCode.CONFIG,
                hint="point --app at a steeple.admin.WorkerApp (or a function returning one)",
            ) from None
    return value


async def _resolve(value: Any) -> WorkerApp:
    from steeple.postgres.queue import App

    if not isinstance(value, WorkerApp | App) and callable(value):
        value = value()
        if inspect.isawaitable(value):
            value = await value
    if isinstance(value, App):
        if not value.tasks:
            raise CliError(
                "the queue App declares no task: nothing to run",
                code=ExitCode.CONFIG,
                hint="decorate a handler with @app.task in the module --app imports",
            )
        value = WorkerApp(tasks=value.handlers(), queue_schema=value.schema, queues=value.queues)
    if not isinstance(value, WorkerApp):
        raise CliError(
            f"--app gave a {type(value).__name__}, not a steeple.admin.WorkerApp or a "
            "steeple.postgres.queue.App",
            code=ExitCode.CONFIG,
            hint="return WorkerApp(broker=..., tasks=[(task, handler), ...]) or a queue App",
        )
    if value.broker is None and not value.tasks:
        raise CliError(
            "the WorkerApp has neither a broker nor tasks: nothing to run",
            code=ExitCode.CONFIG,
        )
    return value


async def run_worker(
    spec: Any,
    target: Target,
    *,
    log: Callable[[str], None] = print,
    stop: asyncio.Event | None = None,
) -> None:
    """Run until ``stop`` is set or SIGINT / SIGTERM arrives.

    Raises:
        CliError: the application object, the store or the queue is unusable.
    """
    from steeple.admin._backend import connect_store

    worker_app = await _resolve(spec)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    installed: list[signal.Signals] = []
    for signum in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(signum, _stopper(stop, log, signum))
            installed.append(signum)
    relay: Any = None
    store = None
    scheduler = None
    try:
        if worker_app.broker is not None:
            store = await connect_store(target)
        queue_schema = _queue_schema(worker_app, target)
        if worker_app.tasks:
            from steeple.postgres.queue import Scheduler

            scheduler = Scheduler(
                target.dsn,
                worker_id=worker_app.worker_id,
                schema=queue_schema,
                concurrency=worker_app.concurrency,
                queues=["default"] if worker_app.queues is None else list(worker_app.queues),
            )
            for task, handler in worker_app.tasks:
                scheduler.register(task, handler)
        parts = []
        if store is not None:
            parts.append(f"relay for namespace {target.namespace!r}")
        if scheduler is not None:
            parts.append(f"task worker on {queue_schema!r}")
        log(f"steeple worker: running {' and '.join(parts)}; Ctrl-C or SIGTERM to stop")
        async with asyncio.TaskGroup() as group:
            if store is not None and worker_app.broker is not None:
                from steeple.postgres import RecurringRelay

                relay = RecurringRelay(store, worker_app.broker, claim_limit=worker_app.relay_batch)
                group.create_task(relay.run(stop))
            if scheduler is not None:
                group.create_task(
                    scheduler.run_until_shutdown(stop, drain_timeout=worker_app.drain_timeout)
                )
    finally:
        for signum in installed:
            loop.remove_signal_handler(signum)
        if store is not None:
            await store.close()
    if relay is not None:
        log(
            f"steeple worker: relayed {relay.published} occurrences ({relay.failed} relay failures)"
        )


def _queue_schema(worker_app: WorkerApp, target: Target) -> str:
    """Return the queue schema to serve: the app's, unless the command named another."""
    chosen = worker_app.queue_schema
    if chosen is None:
        return target.queue_schema
    override = target.queue_schema_override
    if override is not None and override != chosen:
        raise CliError(
            f"--queue-schema {override!r} differs from the app's schema {chosen!r}",
            code=ExitCode.CONFIG,
            hint="drop --queue-schema, or build the App with App(schema=...) to match",
        )
    return chosen


def _stopper(stop: asyncio.Event, log: Callable[[str], None], signum: int) -> Callable[[], None]:
    def handler() -> None:
        if not stop.is_set():
            log(f"steeple worker: {signal.Signals(signum).name} received, stopping gracefully")
        stop.set()

    return handler
