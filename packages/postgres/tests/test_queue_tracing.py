"""OpenTelemetry tracing of the queue, with the SDK's in-memory exporter and a real PostgreSQL.

The ``spans`` fixture installs an SDK ``TracerProvider`` as the global one for one test and
puts the API's "not set" state back afterwards (what opentelemetry's own test utilities
do), so the other tests of the run keep seeing no tracer provider.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Iterator
from datetime import timedelta
from typing import Any

import asyncpg
import attrs
import psycopg
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from opentelemetry.util._once import Once

from queue_support import QueueFixture, wait_until
from steeple.postgres.queue import (
    EnqueueOptions,
    JobContext,
    JobError,
    Scheduler,
    Task,
    _tracing,
    enqueue,
    enqueue_many,
    enqueue_many_sync,
    enqueue_sync,
    install,
    run_state,
)

MAIL: Task[Any] = Task("send-mail")


@pytest.fixture
def spans(monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemorySpanExporter]:
    """An SDK tracer provider, global for this test only, exporting to memory."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(trace, "_TRACER_PROVIDER_SET_ONCE", Once())
    monkeypatch.setattr(trace, "_TRACER_PROVIDER", None)
    trace.set_tracer_provider(provider)
    try:
        yield exporter
    finally:
        provider.shutdown()


Handler = Callable[[JobContext, Any], Awaitable[object]]


async def _run_until(
    dsn: str, schema: str, handler: Handler, done: Callable[[], Awaitable[bool]]
) -> Scheduler:
    worker = Scheduler(dsn, worker_id="tracer", schema=schema, poll_interval=0.05)
    worker.register(MAIL, handler)
    stop = asyncio.Event()
    running = asyncio.create_task(worker.run_until_shutdown(stop))
    try:
        await wait_until(done)
    finally:
        stop.set()
        await running
    return worker


async def _state(conn: asyncpg.Connection, schema: str, task_id: int) -> str:
    return (await run_state(conn, task_id, schema=schema)).state.value


def _named(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.name == name]


async def _stored(conn: asyncpg.Connection, schema: str, task_id: int) -> Any:
    text = await conn.fetchval(
        f'SELECT trace_context::text FROM "{schema}".tasks WHERE id = $1', task_id
    )
    return None if text is None else json.loads(text)


async def test_a_run_continues_the_enqueuers_trace(
    queue: QueueFixture, spans: InMemorySpanExporter
) -> None:
    dsn, schema, conn = queue
    tracer = trace.get_tracer("the-app")
    with tracer.start_as_current_span("POST /signup") as request:
        queued = await enqueue(conn, MAIL, {"to": "ada"}, schema=schema)
    trace_id = request.get_span_context().trace_id

    stored = await _stored(conn, schema, queued.id)
    assert set(stored) == {"traceparent"}  # W3C trace context only, no baggage
    version, stored_trace, stored_span, flags = stored["traceparent"].split("-")
    assert (version, int(stored_trace, 16)) == ("00", trace_id)
    assert int(flags, 16) & 1  # sampled

    seen: list[trace.SpanContext] = []

    async def handle(ctx: JobContext, args: Any) -> None:
        # The handler runs inside the run's span: its own spans are children of it.
        with tracer.start_as_current_span("smtp") as inner:
            seen.append(inner.get_span_context())

    await _run_until(dsn, schema, handle, lambda: _succeeded(conn, schema, queued.id))

    (send,) = _named(spans, "send send-mail")
    assert send.kind is SpanKind.PRODUCER
    assert send.context is not None
    assert send.context.trace_id == trace_id
    assert send.parent is not None
    assert send.parent.span_id == request.get_span_context().span_id
    assert int(stored_span, 16) == send.context.span_id  # the stored context is the send span's
    assert send.attributes is not None
    assert send.attributes["messaging.system"] == "steeple"
    assert send.attributes["messaging.operation.type"] == "send"
    assert send.attributes["messaging.destination.name"] == "default"  # the named queue
    assert send.attributes["steeple.task.queue"] == "default"
    assert send.attributes["steeple.task.id"] == queued.id
    assert send.attributes["steeple.task.deduplicated"] is False

    (process,) = _named(spans, "process send-mail")
    state = await run_state(conn, queued.id, schema=schema)
    assert process.kind is SpanKind.CONSUMER
    assert process.context is not None
    assert process.context.trace_id == trace_id  # the enqueuer's trace continues
    assert process.parent is not None
    assert process.parent.span_id == send.context.span_id  # parent: the creation context
    assert [link.context.span_id for link in process.links] == [send.context.span_id]
    assert process.attributes is not None
    assert process.attributes["messaging.operation.type"] == "process"
    assert process.attributes["messaging.message.id"] == str(queued.id)
    assert process.attributes["steeple.task.id"] == queued.id
    assert process.attributes["steeple.task.name"] == "send-mail"
    assert process.attributes["steeple.task.attempt"] == 1
    assert process.attributes["steeple.task.run_id"] == str(state.run_id)
    assert process.attributes["messaging.client.id"] == "tracer"
    assert process.status.status_code is StatusCode.UNSET
    assert [c.trace_id for c in seen] == [trace_id]
    (smtp,) = _named(spans, "smtp")
    assert smtp.parent is not None
    assert smtp.parent.span_id == process.context.span_id


async def _succeeded(conn: asyncpg.Connection, schema: str, *ids: int) -> bool:
    return all([await _state(conn, schema, i) == "succeeded" for i in ids])


async def test_failed_attempts_record_the_exception_and_retries_stay_in_the_trace(
    queue: QueueFixture, spans: InMemorySpanExporter
) -> None:
    dsn, schema, conn = queue
    with trace.get_tracer("the-app").start_as_current_span("request") as request:
        queued = await enqueue(
            conn, MAIL, {}, EnqueueOptions.immediate(max_attempts=2), schema=schema
        )

    async def handle(ctx: JobContext, args: Any) -> None:
        if ctx.attempt == 1:
            raise JobError.retry("busy", delay=timedelta(milliseconds=10))
        raise ValueError("the mailbox does not exist")

    async def failed() -> bool:
        return await _state(conn, schema, queued.id) == "failed"

    await _run_until(dsn, schema, handle, failed)
    runs = sorted(
        _named(spans, "process send-mail"),
        key=lambda s: int(str((s.attributes or {}).get("steeple.task.attempt"))),
    )
    assert [s.attributes["steeple.task.attempt"] for s in runs if s.attributes] == [1, 2]
    for run, kind in zip(runs, ("JobError", "ValueError"), strict=True):
        assert run.context is not None
        assert run.context.trace_id == request.get_span_context().trace_id
        assert run.status.status_code is StatusCode.ERROR
        assert run.status.description == kind
        assert run.attributes is not None
        assert str(run.attributes["error.type"]).endswith(kind)
        (event,) = [e for e in run.events if e.name == "exception"]
        assert event.attributes is not None
        assert str(event.attributes["exception.type"]).endswith(kind)
        assert "exception.stacktrace" in event.attributes
    assert runs[1].events[0].attributes is not None
    assert runs[1].events[0].attributes["exception.message"] == "the mailbox does not exist"


async def test_batches_sync_and_deduplicated_enqueues(
    queue: QueueFixture, spans: InMemorySpanExporter
) -> None:
    dsn, schema, conn = queue
    tracer = trace.get_tracer("the-app")
    with tracer.start_as_current_span("batch"):
        ids = await enqueue_many(conn, MAIL, [1, 2, 3], schema=schema)
    (send,) = _named(spans, "send send-mail")
    assert send.attributes is not None
    assert send.attributes["messaging.batch.message_count"] == 3
    contexts = [await _stored(conn, schema, i) for i in ids]
    assert contexts[0] == contexts[1] == contexts[2]
    assert send.context is not None
    assert f"{send.context.span_id:016x}" in contexts[0]["traceparent"]

    with psycopg.connect(dsn) as sync:
        with tracer.start_as_current_span("sync"):
            one = enqueue_sync(sync, MAIL, 4, schema=schema)
            many = enqueue_many_sync(sync, MAIL, [5, 6], schema=schema)
        sync.commit()
    for task_id in (one.id, *many):
        assert (await _stored(conn, schema, task_id))["traceparent"].startswith("00-")

    options = EnqueueOptions(dedup_key="once")
    first = await enqueue(conn, MAIL, 7, options, schema=schema)
    spans.clear()
    again = await enqueue(conn, MAIL, 7, options, schema=schema)
    assert again.deduplicated
    (dedup,) = _named(spans, "send send-mail")
    assert dedup.attributes is not None
    assert dedup.attributes["steeple.task.deduplicated"] is True
    assert dedup.attributes["steeple.task.id"] == first.id


async def test_a_failed_enqueue_marks_its_span(
    pg_schema: tuple[str, str], spans: InMemorySpanExporter
) -> None:
    dsn, schema = pg_schema
    conn = await asyncpg.connect(dsn)
    try:
        await install(conn, schema=schema)
        # A constraint the insert breaks: the enqueue fails at the database.
        await conn.execute(
            f'ALTER TABLE "{schema}".tasks '
            "ADD CONSTRAINT no_mail CHECK (task_name <> 'send-mail')"
        )
        with pytest.raises(asyncpg.CheckViolationError):
            await enqueue(conn, MAIL, 1, schema=schema)
    finally:
        await conn.close()
    (send,) = _named(spans, "send send-mail")
    assert send.status.status_code is StatusCode.ERROR
    assert [e.name for e in send.events] == ["exception"]


VALID = "00-" + "f" * 32 + "-" + "e" * 16 + "-01"


@pytest.mark.parametrize(
    ("stored", "parented"),
    [
        ('{"traceparent": "00-00000000000000000000000000000000-0000000000000000-01"}', False),
        ('{"traceparent": "not a trace context"}', False),
        ('{"traceparent": 5}', False),
        ('{"traceparent": "' + VALID + '", "x": {"y": 1}}', False),
        ('{"a": ' + "[" * 1500 + "]" * 1500 + "}", False),  # deeper than json.loads goes
        ("{}", False),
        # A valid parent with a hostile tracestate: the state is dropped, the parent kept.
        ('{"traceparent": "' + VALID + '", "tracestate": "ünï=☃,,=x,' + "k=v," * 200 + '"}', True),
    ],
)
async def test_a_stored_context_that_does_not_parse_gives_a_root_span(
    queue: QueueFixture, spans: InMemorySpanExporter, stored: str, parented: bool
) -> None:
    dsn, schema, conn = queue
    queued = await enqueue(conn, MAIL, 1, schema=schema)
    await conn.execute(
        f'UPDATE "{schema}".tasks SET trace_context = $2::jsonb WHERE id = $1', queued.id, stored
    )

    async def handle(ctx: JobContext, args: Any) -> None:
        return None

    await _run_until(dsn, schema, handle, lambda: _succeeded(conn, schema, queued.id))
    (process,) = _named(spans, "process send-mail")
    assert process.context is not None
    if parented:
        assert process.parent is not None
        assert (process.parent.trace_id, process.parent.span_id) == (
            2**128 - 1,
            0xE * 0x1111111111111111,
        )
        assert process.context.trace_id == 2**128 - 1
        assert len(process.links) == 1
    else:
        assert process.parent is None
        assert list(process.links) == []
        assert process.context.trace_id != 2**128 - 1


async def test_without_a_tracer_provider_nothing_is_written_and_nothing_more_is_read(
    queue: QueueFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No SDK configured (the API's proxy provider): no span, NULL context, no extra query."""
    dsn, schema, conn = queue
    assert _tracing.tracer() is None

    async def never(*args: object) -> dict[int, str]:
        raise AssertionError("the worker read trace contexts with tracing off")

    monkeypatch.setattr(_tracing, "trace_contexts", never)
    with trace.get_tracer("the-app").start_as_current_span("request"):
        one = await enqueue(conn, MAIL, 1, schema=schema)
        many = await enqueue_many(conn, MAIL, [2, 3], schema=schema)

    async def handle(ctx: JobContext, args: Any) -> None:
        return None

    await _run_until(dsn, schema, handle, lambda: _succeeded(conn, schema, one.id, *many))
    count = await conn.fetchval(
        f'SELECT count(*) FROM "{schema}".tasks WHERE trace_context IS NOT NULL'
    )
    assert count == 0


async def test_a_failed_read_of_trace_contexts_costs_the_parent_not_the_run(
    queue: QueueFixture, spans: InMemorySpanExporter, caplog: pytest.LogCaptureFixture
) -> None:
    dsn, schema, conn = queue
    with trace.get_tracer("the-app").start_as_current_span("request"):
        queued = await enqueue(conn, MAIL, 1, schema=schema)

    async def handle(ctx: JobContext, args: Any) -> None:
        return None

    worker = Scheduler(dsn, worker_id="tracer", schema=schema, poll_interval=0.05)
    worker.register(MAIL, handle)
    # The read fails on the server (as a lost connection or a timeout would).
    env = worker._env
    env.sql = attrs.evolve(env.sql, trace_contexts="SELECT 1 / 0 AS id, '' AS ctx")
    stop = asyncio.Event()
    running = asyncio.create_task(worker.run_until_shutdown(stop))
    with caplog.at_level(logging.WARNING, logger="steeple.postgres.queue"):
        try:
            await wait_until(lambda: _succeeded(conn, schema, queued.id))
        finally:
            stop.set()
            await running
    assert "could not read the trace context of claimed tasks" in caplog.text
    (process,) = _named(spans, "process send-mail")
    assert process.parent is None  # a root span: the run itself went ahead
