"""The decorator API: App, @app.task, enqueue / enqueue_sync, app.scheduler -- real PostgreSQL."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import math
from datetime import timedelta
from typing import Any

import psycopg
import pytest

import queue_support
from queue_support import QueueFixture
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
    run_state,
)

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
