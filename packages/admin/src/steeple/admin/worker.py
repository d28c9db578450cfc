"""``steeple worker --app module:object``: run an application's relay and task handlers.

The object is a :class:`WorkerApp` or a work-queue :class:`steeple.postgres.queue.App`
(every task it declares is served, on its schema), or a callable (sync or async, no
arguments) returning one. A ``broker`` runs :class:`steeple.postgres.RecurringRelay`
(tick, claim, relay) for the namespace; ``tasks`` run the work-queue worker. SIGINT /
SIGTERM stop both gracefully: nothing new is claimed, in-flight work finishes (within
``drain_timeout``), then the process exits 0.

When the drain deadline passes, or a second SIGINT / SIGTERM arrives, the stop is hard:
running handlers are cancelled and their tasks handed back (pending, attempt refunded;
a release that cannot be written leaves the lease to lapse), and a relay round still
publishing is cancelled (its leases lapse; the occurrences are relayed again under the
same idempotency keys). Every outcome is fenced, so nothing finished is recorded twice.
A handler that ignores being stopped cannot keep the process alive: a plain ``def``
handler's thread is a daemon, a coroutine that ignores its cancellation is closed, and
the ``steeple worker`` command ends the process if it is still running ten seconds after
the hard stop (its tasks were handed back first).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import inspect
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from steeple.admin._text import plural
from steeple.admin.settings import CliError, ExitCode
from steeple.core.ports import MessageBroker

if TYPE_CHECKING:
    from steeple.admin._backend import Target

__all__ = ["EXIT_AFTER_HARD_STOP", "WorkerApp", "load_worker_app", "run_worker"]

EXIT_AFTER_HARD_STOP = 10.0
"""Seconds after a hard stop at which the ``steeple worker`` process ends itself if its
work has not stopped (a handler ignores even being closed): its tasks were handed back."""


@attrs.frozen
class WorkerApp:
    """What ``steeple worker`` runs for an application.

    Attributes:
        broker: where recurring occurrences are published; ``None`` runs no relay.
        tasks: ``(Task, handler)`` pairs for the work-queue worker; empty runs no worker.
        worker_id: the task worker's name (shown on claimed tasks).
        concurrency: the most task handlers running at once.
        relay_batch: leases claimed per relay round (1-100).
        drain_timeout: seconds in-flight handlers and the relay's current round get
            after a stop signal, before the hard stop.
        loop_lag_threshold: seconds of event-loop lag reported as a stall, with a
            warning naming the handler or broker call that blocked the loop; ``None``
            turns the detection off (see :mod:`steeple.runtime.looplag`).
        queue_schema: the work queue's schema (default: the command's ``--queue-schema``);
            set from a ``steeple.postgres.queue.App``'s schema.
        queues: the named queues the task worker serves (default: ``"default"`` only);
            set from the queues an App's tasks are declared in.
        queue_app: the ``steeple.postgres.queue.App`` it was made from, if any: its
            worker is the App's (:meth:`App.scheduler`), which ensures the App's
            periodic jobs when it starts.
    """

    broker: MessageBroker | None = None
    tasks: Sequence[tuple[Any, Callable[..., Any]]] = ()
    worker_id: str = "steeple-worker"
    concurrency: int = 16
    relay_batch: int = 20
    drain_timeout: float = 30.0
    loop_lag_threshold: float | None = 0.5
    queue_schema: str | None = None
    queues: Sequence[str] | None = None
    queue_app: Any = None


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
        value = WorkerApp(
            tasks=value.handlers(),
            queue_schema=value.schema,
            queues=value.queues,
            queue_app=value,
        )
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
    exit_after_hard_stop: float | None = None,
    remove_stale_periodic: bool = False,
) -> None:
    """Run until ``stop`` is set or SIGINT / SIGTERM arrives.

    A queue App's periodic jobs are ensured when its worker starts; a job it declared
    earlier and no longer does is reported, and deleted only with
    ``remove_stale_periodic``.

    ``exit_after_hard_stop`` (the ``steeple worker`` command passes
    :data:`EXIT_AFTER_HARD_STOP`): seconds after a hard stop at which the process is
    ended (``os._exit(1)``, output flushed) if the work has not stopped by then; ``None``
    never ends it.

    Raises:
        CliError: the application object, the store or the queue is unusable.
    """
    from steeple.admin._backend import connect_store

    worker_app = await _resolve(spec)
    stop = stop or asyncio.Event()
    hard_stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    installed: list[signal.Signals] = []
    for signum in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(signum, _stopper(stop, hard_stop, log, signum))
            installed.append(signum)
    relay: Any = None
    store = None
    scheduler = None
    watchdog = _Watchdog(exit_after_hard_stop, log)
    try:
        if worker_app.broker is not None:
            store = await connect_store(target)
        queue_schema = _queue_schema(worker_app, target)
        if worker_app.tasks:
            scheduler = _scheduler(worker_app, target, queue_schema, remove_stale_periodic)
        parts = []
        if store is not None:
            parts.append(f"relay for namespace {target.namespace!r}")
        if scheduler is not None:
            parts.append(f"task worker on {queue_schema!r}")
        log(f"steeple worker: running {' and '.join(parts)}; Ctrl-C or SIGTERM to stop")
        async with asyncio.TaskGroup() as group:
            relay_task: asyncio.Task[None] | None = None
            work: list[asyncio.Task[None]] = []
            if store is not None and worker_app.broker is not None:
                from steeple.postgres import RecurringRelay

                relay = RecurringRelay(
                    store,
                    worker_app.broker,
                    claim_limit=worker_app.relay_batch,
                    loop_lag_threshold=worker_app.loop_lag_threshold,
                )
                relay_task = group.create_task(relay.run(stop), name="steeple relay")
                work.append(relay_task)
            if scheduler is not None:
                work.append(
                    group.create_task(
                        scheduler.run_until_shutdown(
                            stop, drain_timeout=worker_app.drain_timeout, hard_stop=hard_stop
                        ),
                        name="steeple task worker",
                    )
                )
            group.create_task(
                _supervise(
                    work,
                    relay_task,
                    stop,
                    hard_stop,
                    worker_app.drain_timeout,
                    log,
                    watchdog,
                ),
                name="steeple worker stop",
            )
    finally:
        if watchdog.timer is not None:
            watchdog.timer.cancel()
        for signum in installed:
            loop.remove_signal_handler(signum)
        if store is not None:
            await store.close()
    _report(relay, scheduler, log)


def _scheduler(
    worker_app: WorkerApp, target: Target, queue_schema: str, remove_stale_periodic: bool
) -> Any:
    """Build the task worker: the queue App's own, or one for the app's registered tasks."""
    from steeple.postgres.queue import Scheduler

    queues = ["default"] if worker_app.queues is None else list(worker_app.queues)
    if worker_app.queue_app is not None:
        return worker_app.queue_app.scheduler(
            target.dsn,
            worker_id=worker_app.worker_id,
            remove_stale_periodic=remove_stale_periodic,
            concurrency=worker_app.concurrency,
            loop_lag_threshold=worker_app.loop_lag_threshold,
            queues=queues,
            pooler=target.pooler,
            listen_dsn=target.listen_dsn,
        )
    scheduler = Scheduler(
        target.dsn,
        worker_id=worker_app.worker_id,
        schema=queue_schema,
        concurrency=worker_app.concurrency,
        loop_lag_threshold=worker_app.loop_lag_threshold,
        queues=queues,
        pooler=target.pooler,
        listen_dsn=target.listen_dsn,
    )
    for task, handler in worker_app.tasks:
        scheduler.register(task, handler)
    return scheduler


def _report(relay: Any, scheduler: Any, log: Callable[[str], None]) -> None:
    """Log what the relay and the task worker did, once they stopped."""
    if relay is not None:
        log(
            f"steeple worker: relayed {plural(relay.published, 'occurrence')} "
            f"({plural(relay.failed, 'relay failure')})"
        )
    if scheduler is not None:
        stats = scheduler.stats
        log(
            f"steeple worker: tasks: {stats.succeeded} succeeded, {stats.retried} retried, "
            f"{stats.failed} failed, {stats.released} handed back, "
            f"{stats.rejected_completions} outcomes rejected (lease lost)"
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


async def _supervise(
    work: list[asyncio.Task[None]],
    relay_task: asyncio.Task[None] | None,
    stop: asyncio.Event,
    hard_stop: asyncio.Event,
    drain_timeout: float,
    log: Callable[[str], None],
    watchdog: _Watchdog,
) -> None:
    """After ``stop``, give the work ``drain_timeout`` seconds, then stop it hard.

    The task worker watches ``hard_stop`` itself (it hands its running tasks back); a
    relay round still running at the hard stop is cancelled: its leases lapse and the
    occurrences are relayed again under the same idempotency keys.
    """
    if not work:
        return
    done = asyncio.ensure_future(asyncio.wait(work))
    try:
        stopping = asyncio.ensure_future(stop.wait())
        await asyncio.wait({done, stopping}, return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        if done.done():
            return
        hard = asyncio.ensure_future(hard_stop.wait())
        await asyncio.wait({done, hard}, timeout=drain_timeout, return_when=asyncio.FIRST_COMPLETED)
        hard.cancel()
        if done.done():
            return
        if not hard_stop.is_set():
            log(f"steeple worker: the {drain_timeout:g} s drain deadline passed; stopping hard")
            hard_stop.set()
        watchdog.arm()
        if relay_task is not None and not relay_task.done():
            log(
                "steeple worker: relay round cancelled; its leases lapse and the occurrences "
                "are relayed again under the same idempotency keys"
            )
            relay_task.cancel()
        await done
    finally:
        done.cancel()


class _Watchdog:
    """Ends the process if its work has not stopped some seconds after the hard stop.

    A thread, so that it acts whatever runs on the event loop.
    """

    def __init__(self, seconds: float | None, log: Callable[[str], None]) -> None:
        self._seconds = seconds
        self._log = log
        self.timer: threading.Timer | None = None

    def arm(self) -> None:
        if self._seconds is None or self.timer is not None:
            return
        self.timer = threading.Timer(self._seconds, self._exit)
        self.timer.daemon = True
        self.timer.start()

    def _exit(self) -> None:
        self._log(
            f"steeple worker: still running {self._seconds:g} s after the hard stop (a "
            "handler ignores being stopped); ending the process"
        )
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(ExitCode.FAILED)


def _stopper(
    stop: asyncio.Event, hard_stop: asyncio.Event, log: Callable[[str], None], signum: int
) -> Callable[[], None]:
    name = signal.Signals(signum).name

    def handler() -> None:
        if not stop.is_set():
            log(f"steeple worker: {name} received, stopping gracefully")
            stop.set()
        elif not hard_stop.is_set():
            log(f"steeple worker: {name} received again, stopping hard")
            hard_stop.set()

    return handler
