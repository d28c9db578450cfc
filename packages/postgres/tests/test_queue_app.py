"""The decorator API: App, @app.task, enqueue / enqueue_sync, app.scheduler -- real PostgreSQL."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import math
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

import queue_support
from queue_support import QueueFixture
from steeple.core.errors import InvalidCronExpression, InvalidTimeZoneError
from steeple.postgres.queue import (
    App,
    ArgsEncodingError,
    EnqueueOptions,
    Health,
    JobContext,
    QueueConfigurationError,
    QueueTypeError,
    RetryPolicy,
    TaskFunction,
    UnsupportedConnectionError,
    jobs,
    run_state,
)
from steeple.postgres.queue import admin as queue_admin
from steeple.testing import FakeClock

wait_until = functools.partial(queue_support.wait_until, timeout=15.0)


@dataclasses.dataclass
class Email:
    to: str
    subject: str = "hello"


async def test_declare_enqueue_and_run_every_task_of_an_app(queue: QueueFixture) -> None:
    dsn, schema, conn = queue
    app = App(schema=schema)
    sent: list[Email] = []
    counted: list[int] = []

    @app.task(name="send-email", args_type=Email, retry=RetryPolicy(max_attempts=3))
    async def send_email(ctx: JobContext, args: Email) -> dict[str, str]:
        sent.append(args)
        return {"sent_to": args.to}

    @app.task
    def count(ctx: JobContext, args: int) -> int:  # bare decorator, a sync handler
        counted.append(args)
        return args * 2

    assert isinstance(send_email, TaskFunction)
    assert isinstance(count, TaskFunction)
    assert (send_email.name, count.name) == ("send-email", "count")
    assert send_email.task.args_type is Email
    assert [f.name for f in app.tasks] == ["send-email", "count"]
    assert "send-email" in repr(app)
    assert repr(count) == "<steeple task 'count'>"

    first = await send_email.enqueue(conn, Email("ada@example.com"))
    later = await count.enqueue(conn, 21, priority=3, dedup_key="once")
    again = await count.enqueue(conn, 22, EnqueueOptions(dedup_key="once"))
    assert again.deduplicated
    assert again.id == later.id
    with psycopg.connect(dsn) as sync_conn:  # Django-style: the caller's sync connection
        synced = count.enqueue_sync(sync_conn, 5, delay=timedelta(0))
        many = count.enqueue_many_sync(sync_conn, [6, 7])
    batch = await count.enqueue_many(conn, [8])
    row = await conn.fetchrow(
        f'SELECT max_attempts, priority FROM "{schema}".tasks WHERE id = $1', first.id
    )
    assert row is not None
    assert tuple(row) == (3, 0)

    worker = app.scheduler(dsn, worker_id="app-w", poll_interval=0.05, threads=2)
    assert worker.schema == schema
    stop = asyncio.Event()
    run = asyncio.create_task(worker.run_until_shutdown(stop))
    try:
        await wait_until(lambda: worker.stats.succeeded == 6 or run.done())
        assert worker.health() is not Health.STOPPED
    finally:
        stop.set()
        await asyncio.wait_for(run, 30)
    assert sent == [Email("ada@example.com")]
    assert sorted(counted) == [5, 6, 7, 8, 21]
    assert (await run_state(conn, first.id, schema=schema)).result == {"sent_to": "ada@example.com"}
    assert (await run_state(conn, later.id, schema=schema)).result == 42
    for task_id in [synced.id, *many, *batch]:
        assert (await run_state(conn, task_id, schema=schema)).state.value == "succeeded"
    # Calling the TaskFunction runs the handler itself, no queue involved.
    assert await send_email(None, Email("x@example.com")) == {"sent_to": "x@example.com"}
    assert count(None, 4) == 8


def test_task_declaration_refuses_what_cannot_run_or_clashes() -> None:
    app = App()

    @app.task(name="taken")
    async def first(ctx: Any, args: Any) -> None:
        return None

    with pytest.raises(QueueConfigurationError, match="already declares a task named 'taken'"):
        app.task(name="taken")(first.handler)
    with pytest.raises(QueueTypeError, match="two positional arguments"):
        app.task(lambda ctx: None)
    with pytest.raises(QueueConfigurationError, match="no usable __name__"):
        app.task(lambda ctx, args: None)
    app.task(name="named-lambda")(lambda ctx, args: None)  # a name makes a lambda fine
    with pytest.raises(QueueTypeError, match="must be a function"):
        app.task(name="x")(42)  # type: ignore[type-var]
    with pytest.raises(QueueTypeError, match="async generator"):

        @app.task(name="gen")
        async def gen(ctx: Any, args: Any) -> Any:
            yield 1

    bad_names: list[Any] = ["", "x" * 201, "a\x00b", "\ud800", 5]
    for bad in bad_names:
        with pytest.raises(QueueConfigurationError):
            app.task(name=bad)(first.handler)
    with pytest.raises(QueueConfigurationError, match="give it once"):
        app.task(name="both", max_attempts=2, retry=RetryPolicy(max_attempts=3))(first.handler)
    with pytest.raises(QueueTypeError, match="retry must be a RetryPolicy"):
        app.task(name="r", retry={"max_attempts": 3})(first.handler)  # type: ignore[call-overload]
    for attempts in (0, -1, 10_001, 2**80, math.inf):
        with pytest.raises(QueueConfigurationError, match="max_attempts"):
            app.task(name="m", max_attempts=attempts)(first.handler)  # type: ignore[arg-type]
    with pytest.raises(QueueTypeError, match="args_type"):
        app.task(name="a", args_type=dict)(first.handler)
    # Nothing that failed was declared.
    assert [f.name for f in app.tasks] == ["taken", "named-lambda"]


@pytest.mark.parametrize("schema", ["", "Bad", "pg_catalog", "x" * 64, "a-b", None, 1, "\ud800"])
def test_app_refuses_a_bad_schema(schema: Any) -> None:
    with pytest.raises(QueueConfigurationError):
        App(schema=schema)


def test_scheduler_needs_tasks_and_keeps_the_apps_schema() -> None:
    app = App(schema="some_queue")
    with pytest.raises(QueueConfigurationError, match="declares no task"):
        app.scheduler("postgresql://localhost/db", worker_id="w")

    @app.task
    async def job(ctx: Any, args: Any) -> None:
        return None

    with pytest.raises(QueueConfigurationError, match="App\\(schema="):
        app.scheduler("postgresql://localhost/db", worker_id="w", schema="other")
    with pytest.raises(QueueConfigurationError, match="threads"):
        app.scheduler("postgresql://localhost/db", worker_id="w", threads=0)
    with pytest.raises(TypeError):
        app.scheduler("postgresql://localhost/db", worker_id="w", bogus=1)
    worker = app.scheduler("postgresql://localhost/db", worker_id="w")
    assert worker.schema == "some_queue"


async def test_enqueue_refuses_bad_options_and_args_and_stores_nothing(
    queue: QueueFixture,
) -> None:
    dsn, schema, conn = queue
    app = App(schema=schema)

    @app.task(name="strict", args_type=Email)
    async def strict(ctx: Any, args: Email) -> None:
        return None

    cases: list[tuple[dict[str, Any], type[Exception]]] = [
        ({"bogus": 1}, QueueTypeError),
        ({"options": EnqueueOptions(), "priority": 1}, QueueTypeError),
        ({"options": "now"}, QueueTypeError),
        ({"priority": 2**40}, QueueConfigurationError),
        ({"delay": timedelta(seconds=-1)}, QueueConfigurationError),
        ({"delay": math.nan}, QueueTypeError),
        ({"dedup_key": "\x00"}, QueueConfigurationError),
        ({"max_attempts": 0}, QueueConfigurationError),
    ]
    for keywords, error in cases:
        with pytest.raises(error):
            await strict.enqueue(conn, Email("a@example.com"), **keywords)
        with pytest.raises(error), psycopg.connect(dsn) as sync_conn:
            strict.enqueue_sync(sync_conn, Email("a@example.com"), **keywords)
    with pytest.raises(ArgsEncodingError, match="takes Email args"):
        await strict.enqueue(conn, {"to": "a@example.com"})
    with pytest.raises(UnsupportedConnectionError):
        await strict.enqueue(object(), Email("a@example.com"))
    assert await conn.fetchval(f'SELECT count(*) FROM "{schema}".tasks') == 0


async def test_a_task_declared_in_a_named_queue_goes_there_and_is_served(
    queue: QueueFixture,
) -> None:
    dsn, schema, conn = queue
    app = App(schema=schema)
    ran: list[Any] = []

    @app.task(name="mail", queue="emails")
    async def mail(ctx: JobContext, args: Any) -> None:
        ran.append(args)

    @app.task(name="plain")
    def plain(ctx: JobContext, args: Any) -> None:
        ran.append(args)

    assert app.queues == ["emails", "default"]
    ids = [
        (await mail.enqueue(conn, "kw")).id,
        (await mail.enqueue(conn, "opts", EnqueueOptions(priority=1))).id,
        (await mail.enqueue(conn, "other", queue="bulk")).id,  # an enqueue may name another
        (await mail.enqueue(conn, "other2", EnqueueOptions(queue="bulk"))).id,
        (await plain.enqueue(conn, "plain")).id,
    ]
    ids += await mail.enqueue_many(conn, ["many"])
    queues = [
        await conn.fetchval(f'SELECT queue FROM "{schema}".tasks WHERE id = $1', i) for i in ids
    ]
    assert queues == ["emails", "emails", "bulk", "bulk", "default", "emails"]
    worker = app.scheduler(dsn, worker_id="q-w", poll_interval=0.05)  # emails and default
    stop = asyncio.Event()
    run = asyncio.create_task(worker.run_until_shutdown(stop))
    try:
        await wait_until(lambda: worker.stats.succeeded == 4 or run.done())
    finally:
        stop.set()
        await asyncio.wait_for(run, 30)
    assert sorted(ran) == ["kw", "many", "opts", "plain"]  # "bulk" is not served
    bad_queues: list[Any] = ["", "x" * 201, "a\x00", "\ud800", 3, None]
    for bad in bad_queues:
        with pytest.raises(QueueConfigurationError):
            app.task(name="bad-queue", queue=bad)
        with pytest.raises(QueueConfigurationError):
            await mail.enqueue(conn, "x", queue=bad)
    assert await conn.fetchval(f'SELECT count(*) FROM "{schema}".tasks') == len(ids)


# --- periodic work declared where its task is ----------------------------------------------


def _declare(app: App, *, with_sweep: bool = True, cron: str = "0 7 * * *") -> None:
    """The same declarations, as each start of the application's code makes them."""

    @app.periodic(cron, timezone="Europe/Berlin", args={"size": 256}, name="morning-resize")
    @app.periodic("0 19 * * *", args={"size": 64})  # a second calendar, named after the task
    @app.task(name="resize", queue="images")
    def resize(ctx: JobContext, args: Any) -> None:
        pass

    if with_sweep:

        @app.task(name="sweep", cron="*/15 * * * *")
        async def sweep(ctx: JobContext, args: None) -> None:
            pass

    @app.task(name="plain")
    async def plain(ctx: JobContext, args: Any) -> None:
        pass


async def _start_and_stop(worker: Any) -> None:
    """Start the worker (its start-up ensures the periodic jobs), then stop it."""
    stop = asyncio.Event()
    run = asyncio.create_task(worker.run_until_shutdown(stop))
    try:
        await wait_until(lambda: worker.health() is not Health.STARTING or run.done())
    finally:
        stop.set()
        await asyncio.wait_for(run, 30)


async def _jobs(conn: Any, schema: str) -> dict[str, tuple[Any, ...]]:
    rows = await conn.fetch(
        f"SELECT name, id, task_name, cron, timezone, queue, args::text, updated_at "
        f'FROM "{schema}".jobs ORDER BY name'
    )
    return {r["name"]: tuple(r)[1:] for r in rows}


async def test_periodic_jobs_declared_on_the_app_are_ensured_when_the_worker_starts(
    queue: QueueFixture, caplog: pytest.LogCaptureFixture
) -> None:
    """Declared with the task, ensured at start (idempotently), stale ones reported only.

    Before: a job was created by hand with ``ensure_job`` at start-up, and a schedule
    removed from the code went on running unnoticed.
    """
    dsn, schema, conn = queue
    manual = App(schema=schema)
    _declare(manual)
    await jobs.create(conn, "by-hand", manual.tasks[2], "@daily", None, schema=schema)

    app = App(schema=schema)
    _declare(app)
    assert [p.name for p in app.periodic_jobs] == [
        "periodic:resize",
        "periodic:morning-resize",
        "periodic:sweep",
    ]
    with caplog.at_level(logging.INFO, logger="steeple.postgres.queue"):
        await _start_and_stop(app.scheduler(dsn, worker_id="p-1", poll_interval=0.05))
    first = await _jobs(conn, schema)
    assert {name: row[1:6] for name, row in first.items()} == {
        "by-hand": ("plain", "@daily", "UTC", "default", "null"),
        "periodic:morning-resize": (
            "resize", "0 7 * * *", "Europe/Berlin", "images", '{"size": 256}',
        ),
        "periodic:resize": ("resize", "0 19 * * *", "UTC", "images", '{"size": 64}'),
        "periodic:sweep": ("sweep", "*/15 * * * *", "UTC", "default", "null"),
    }  # fmt: skip
    assert "ensured 3 periodic job(s)" in caplog.text

    # The same code started again: the same jobs, untouched (their cursors keep their place).
    again = App(schema=schema)
    _declare(again)
    await _start_and_stop(again.scheduler(dsn, worker_id="p-2", poll_interval=0.05))
    assert await _jobs(conn, schema) == first

    # A schedule removed from the code and another changed: the changed one is brought
    # to its new calendar (the same job); the removed one is reported and keeps running.
    caplog.clear()
    changed = App(schema=schema)
    _declare(changed, with_sweep=False, cron="30 6 * * *")
    with caplog.at_level(logging.WARNING, logger="steeple.postgres.queue"):
        await _start_and_stop(changed.scheduler(dsn, worker_id="p-3", poll_interval=0.05))
    after = await _jobs(conn, schema)
    assert set(after) == set(first)
    assert after["periodic:morning-resize"][0] == first["periodic:morning-resize"][0]  # id
    assert after["periodic:morning-resize"][2] == "30 6 * * *"
    (warning,) = [r for r in caplog.records if "no longer declared" in r.getMessage()]
    assert "'periodic:sweep'" in warning.getMessage()
    assert "remove_stale_periodic=True" in warning.getMessage()
    assert await changed.stale_periodic(conn) == ["periodic:sweep"]

    # Removed only when asked; a job created by hand (no prefix) is never touched.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="steeple.postgres.queue"):
        await _start_and_stop(
            changed.scheduler(dsn, worker_id="p-4", poll_interval=0.05, remove_stale_periodic=True)
        )
    assert set(await _jobs(conn, schema)) == {
        "by-hand",
        "periodic:morning-resize",
        "periodic:resize",
    }
    assert "removed periodic job 'periodic:sweep'" in caplog.text
    assert await changed.stale_periodic(conn) == []
    report = await changed.ensure_periodic(conn, remove_stale=True)
    assert (len(report.ensured), report.stale, report.removed) == (2, (), ())


async def test_a_periodic_job_of_a_decorated_task_materializes_into_its_queue(
    queue: QueueFixture,
) -> None:
    """``ensure_job`` takes the decorated task itself; its occurrences go to its queue."""
    _, schema, conn = queue
    app = App(schema=schema)

    @app.task(name="resize", queue="images")
    def resize(ctx: JobContext, args: Any) -> None:
        pass

    clock = FakeClock(datetime(2031, 1, 1, 5, 0, tzinfo=UTC))
    job = await jobs.ensure_job(
        conn, "morning-resize", resize, "0 7 * * *", {"size": 1},
        schema=schema, clock=clock, timezone="Europe/Berlin",
    )  # fmt: skip
    assert (job.task_name, job.queue, job.timezone) == ("resize", "images", "Europe/Berlin")
    clock.set(datetime(2031, 1, 1, 6, 0, 1, tzinfo=UTC))  # 07:00:01 in Berlin
    assert await jobs.materialize_due(conn, schema=schema, clock=clock) == 1
    row = await conn.fetchrow(f'SELECT task_name, queue FROM "{schema}".tasks')
    assert row is not None
    assert tuple(row) == ("resize", "images")


def test_periodic_declarations_refuse_what_could_not_be_ensured() -> None:
    app = App()

    @app.task(name="typed", args_type=Email)
    async def typed(ctx: JobContext, args: Email) -> None:
        pass

    async def loose(ctx: JobContext, args: Any) -> None:
        pass

    with pytest.raises(InvalidCronExpression):
        app.periodic("61 * * * *")
    with pytest.raises(InvalidCronExpression):
        app.task(name="bad-cron", cron="every day")
    with pytest.raises(InvalidTimeZoneError):
        app.periodic("0 7 * * *", timezone="Mars/Olympus_Mons")
    with pytest.raises(ArgsEncodingError):
        app.periodic("0 7 * * *", args={"to": "x"})(typed)  # not an Email
    app.periodic("0 7 * * *", args=Email("ada@example.com"))(typed)
    with pytest.raises(QueueConfigurationError, match="already declares a periodic job"):
        app.periodic("0 8 * * *", args=Email("ada@example.com"))(typed)
    with pytest.raises(QueueConfigurationError, match=r"@app\.periodic"):
        app.task(name="typed-cron", args_type=Email, cron="0 7 * * *")
    with pytest.raises(QueueTypeError, match=r"above @app\.task"):
        app.periodic("0 7 * * *")(loose)  # type: ignore[arg-type]
    with pytest.raises(QueueTypeError, match=r"above @app\.task"):
        app.periodic("0 7 * * *")(App().task(name="elsewhere")(loose))  # another app's
    with pytest.raises(QueueTypeError, match=r"above @app\.task"):
        app.task(name="twice")(typed)  # @app.task above @app.periodic
    with pytest.raises(QueueConfigurationError, match="run_at, delay or dedup_key"):
        app.periodic("0 7 * * *", options=EnqueueOptions(dedup_key="k"), name="d")(typed)
    with pytest.raises(QueueConfigurationError):
        App(periodic_prefix="")
    with pytest.raises(QueueConfigurationError):
        app.periodic("0 7 * * *", name="x" * 200, args=Email("a"))(typed)  # with its prefix
    assert [p.name for p in app.periodic_jobs] == ["periodic:typed"]
    with pytest.raises(QueueTypeError):
        app.scheduler("postgresql://u@127.0.0.1/x", worker_id="w", remove_stale_periodic=1)  # type: ignore[arg-type]


async def test_the_decorated_task_is_taken_wherever_a_task_is(queue: QueueFixture) -> None:
    """Listing by task and snapshotting options take ``resize`` itself, not ``resize.task``."""
    _, schema, conn = queue
    app = App(schema=schema)

    @app.task(name="resize", retry=RetryPolicy(max_attempts=7))
    async def resize(ctx: JobContext, args: Any) -> None:
        pass

    done = await resize.enqueue(conn, None)
    page = await queue_admin.list_tasks(conn, schema=schema, task_name=resize)
    assert [t.id for t in page.items] == [done.id]
    assert await queue_admin.list_tasks(conn, schema=schema, task_name=resize.task) == page
    assert EnqueueOptions().snapshot(resize) == EnqueueOptions().snapshot(resize.task)
    assert EnqueueOptions().snapshot(resize)[1] == 7
    with pytest.raises(QueueTypeError, match=r"@app\.task function"):
        EnqueueOptions().snapshot("resize")
    with pytest.raises(QueueTypeError, match=r"@app\.task function"):
        await queue_admin.list_tasks(conn, schema=schema, task_name=object())  # type: ignore[arg-type]


async def test_a_periodic_calendar_that_never_fires_stops_the_worker_start(
    queue: QueueFixture,
) -> None:
    dsn, schema, conn = queue
    app = App(schema=schema)

    @app.task(name="leap", cron="0 0 30 2 *")  # February 30th: parses, never fires
    async def leap(ctx: JobContext, args: None) -> None:
        pass

    worker = app.scheduler(dsn, worker_id="never", poll_interval=0.05)
    with pytest.raises(QueueConfigurationError, match="never fires"):
        await asyncio.wait_for(worker.run_until_shutdown(asyncio.Event()), 30)
    assert await conn.fetchval(f'SELECT count(*) FROM "{schema}".jobs') == 0
