"""OpenTelemetry tracing of the queue, optional: on only while a tracer provider is configured.

``opentelemetry-api`` is the ``steeple-postgres[otel]`` extra, so nothing here imports it at
module import: it is looked for on first use. Tracing is *active* when the API is installed
and a real tracer provider has been set (an SDK's ``TracerProvider``); with no API, or the
API's default proxy / no-op provider, every function here returns at once, no span is
made, no trace context is written and the worker makes no extra query.

What is traced, following OpenTelemetry's messaging semantic conventions:

- **Enqueue**: a ``PRODUCER`` span ``send <task name>`` around the insert (one span for an
  ``enqueue_many`` batch, with ``messaging.batch.message_count``). Its W3C trace context
  (``traceparent``, ``tracestate``; never baggage) is written into the task's
  ``trace_context`` column in the same statement: the message's creation context.
- **Each run** (one attempt): a ``CONSUMER`` span ``process <task name>`` around the
  handler. Its **parent is the creation context** (a run processes one task, for which the
  conventions allow the creation context as parent), so the run continues the enqueuer's
  trace, and it also **links** to it (the conventions' default correlation, for tools that
  follow links). Tasks without a context (enqueued while tracing was off, materialized from
  a recurring job, or a context that does not parse) get a root span. A span current where
  the worker runs (an ambient context) is never the parent; it is added as a second link.
  A failing attempt records the exception and sets the status to error.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Final

import attrs

from steeple.postgres._arrays import text_array
from steeple.postgres.queue._db import DB_ERRORS
from steeple.postgres.queue._json import storable_json
from steeple.postgres.queue._shared import LOG
from steeple.postgres.queue._validate import DEFAULT_QUEUE
from steeple.postgres.queue.errors import QueueConfigurationError

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import Span, Tracer

    from steeple.postgres.queue._db import WorkerDb
    from steeple.postgres.queue._execution import JobContext
    from steeple.postgres.queue._sql import QueueSql

__all__ = [
    "INSTRUMENTATION_NAME",
    "SYSTEM",
    "Sending",
    "record_failure",
    "sending",
    "trace_contexts",
    "traced_run",
    "tracer",
]

INSTRUMENTATION_NAME: Final = "steeple.postgres.queue"
"""The tracer's (instrumentation scope's) name."""
SYSTEM: Final = "steeple"
"""The ``messaging.system`` attribute of every span."""
# W3C trace context bounds: traceparent is 55 characters, tracestate at most 32 entries
# of ~256 characters (512 recommended). The column's CHECK allows 4 KiB.
_MAX_CARRIER: Final = 4096


@attrs.frozen
class _Api:
    """The parts of opentelemetry-api the queue uses (imported once, on first use)."""

    trace: Any
    context_type: Any
    propagator: Any
    no_tracing: tuple[type, ...]


_api_cache: list[_Api | None] = []
# The tracer of the provider last seen, reused while that provider stays the global one.
_tracer_cache: list[tuple[object, Tracer]] = []


def _api() -> _Api | None:
    if _api_cache:
        return _api_cache[0]
    try:
        from opentelemetry import trace
        from opentelemetry.context import Context
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
    except ImportError:  # the optional [otel] extra is not installed: tracing is off
        api = None
    else:
        api = _Api(
            trace=trace,
            context_type=Context,
            # W3C trace context only: the stored format does not depend on the global
            # propagator, and baggage (which may hold anything) is never stored.
            propagator=TraceContextTextMapPropagator(),
            no_tracing=(trace.ProxyTracerProvider, trace.NoOpTracerProvider),
        )
    _api_cache.append(api)
    return api


def tracer() -> Tracer | None:
    """Return the queue's tracer while tracing is active, else None (cheap: no allocation)."""
    api = _api()
    if api is None:
        return None
    provider = api.trace.get_tracer_provider()
    if isinstance(provider, api.no_tracing):
        return None
    if _tracer_cache and _tracer_cache[0][0] is provider:
        return _tracer_cache[0][1]
    made: Tracer = provider.get_tracer(INSTRUMENTATION_NAME)
    _tracer_cache[:] = [(provider, made)]
    return made


# --- producing ----------------------------------------------------------------------------


class Sending:
    """The enqueue being traced: the context to store with the task(s), and its span."""

    carrier: str | None = None
    """The trace context to write into ``tasks.trace_context`` (JSON), or None."""

    def enqueued(self, task_id: int, *, deduplicated: bool) -> None:
        """Record the task the enqueue created or found (a no-op when tracing is off)."""


_OFF: Final = Sending()


class _TracedSending(Sending):
    def __init__(self, span: Span, carrier: str | None) -> None:
        self._span = span
        self.carrier = carrier

    def enqueued(self, task_id: int, *, deduplicated: bool) -> None:
        self._span.set_attribute("messaging.message.id", str(task_id))
        self._span.set_attribute("steeple.task.id", task_id)
        self._span.set_attribute("steeple.task.deduplicated", deduplicated)


def sending(
    task_name: str, count: int, queue: str = DEFAULT_QUEUE
) -> contextlib.AbstractContextManager[Sending]:
    """Trace an enqueue of ``count`` tasks named ``task_name`` (the insert runs inside).

    When tracing is off this returns a shared no-op whose ``carrier`` is None.
    """
    traced = tracer()
    if traced is None:
        return contextlib.nullcontext(_OFF)
    return _send_span(traced, task_name, count, queue)


@contextlib.contextmanager
def _send_span(traced: Tracer, task_name: str, count: int, queue: str) -> Iterator[Sending]:
    api = _api()
    assert api is not None  # a tracer exists only with the API
    attributes: dict[str, Any] = {
        "messaging.system": SYSTEM,
        "messaging.operation.type": "send",
        "messaging.operation.name": "send",
        "messaging.destination.name": queue,
        "steeple.task.name": task_name,
        "steeple.task.queue": queue,
    }
    if count != 1:
        attributes["messaging.batch.message_count"] = count
    with traced.start_as_current_span(
        f"send {task_name}", kind=api.trace.SpanKind.PRODUCER, attributes=attributes
    ) as span:
        carrier: dict[str, str] = {}
        api.propagator.inject(carrier, context=api.trace.set_span_in_context(span))
        yield _TracedSending(span, _stored_carrier(carrier))


def _stored_carrier(carrier: dict[str, str]) -> str | None:
    """Return the carrier's JSON text as stored, or None (empty, or not storable).

    One the column cannot hold (over 4 KiB, a NUL...) costs the runs their parent, never
    the enqueue.
    """
    if not carrier:
        return None
    try:
        return storable_json(
            carrier, QueueConfigurationError, "the trace context", _MAX_CARRIER, "str values"
        )
    except QueueConfigurationError:
        return None


# --- running ------------------------------------------------------------------------------


async def trace_contexts(
    db: WorkerDb, sql: QueueSql, ids: list[int], timeout: float
) -> dict[int, str]:
    """Read the stored trace contexts of claimed tasks (only called while tracing is active).

    A failure is logged and costs the runs their parent, never the runs themselves.
    """
    try:
        rows = await db.fetch(sql.trace_contexts, text_array(ids), timeout=timeout)
    except DB_ERRORS as exc:
        LOG.warning("could not read the trace context of claimed tasks: %s", exc)
        return {}
    return {int(task_id): text for task_id, text in rows}


def _extract(api: _Api, stored: str | None) -> Context | None:
    """Return the context stored with a task, or None (absent or not a valid context)."""
    if stored is None:
        return None
    try:
        carrier = json.loads(stored)
    except (ValueError, RecursionError):  # the column holds any JSON object (deep ones too)
        return None
    if not isinstance(carrier, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in carrier.items()
    ):
        return None
    try:
        extracted: Context = api.propagator.extract(carrier, context=api.context_type())
    except Exception:  # a context that does not parse costs the run its parent, nothing more
        return None
    if not api.trace.get_current_span(extracted).get_span_context().is_valid:
        return None
    return extracted


async def traced_run(
    traced: Tracer, ctx: JobContext, stored: str | None, run: Awaitable[None]
) -> None:
    """Await ``run`` (one attempt of a handler) inside its ``process`` span."""
    api = _api()
    assert api is not None  # a tracer exists only with the API
    links = []
    created = _extract(api, stored)
    if created is not None:
        links.append(api.trace.Link(api.trace.get_current_span(created).get_span_context()))
    ambient = api.trace.get_current_span().get_span_context()
    if ambient.is_valid:
        links.append(api.trace.Link(ambient))
    attributes: dict[str, Any] = {
        "messaging.system": SYSTEM,
        "messaging.operation.type": "process",
        "messaging.operation.name": "process",
        "messaging.destination.name": ctx.queue,
        "messaging.message.id": str(ctx.task_id),
        "messaging.client.id": ctx.worker_id,
        "steeple.task.id": ctx.task_id,
        "steeple.task.name": ctx.task_name,
        "steeple.task.attempt": ctx.attempt,
        "steeple.task.max_attempts": ctx.max_attempts,
        "steeple.task.run_id": str(ctx.run_id),
    }
    attributes["steeple.task.queue"] = ctx.queue
    if ctx.scheduled_for is not None:
        attributes["steeple.task.scheduled_for"] = ctx.scheduled_for.isoformat()
    with traced.start_as_current_span(
        f"process {ctx.task_name}",
        # The creation context is the parent; without one, a root span (never the ambient
        # context of the worker's own caller).
        context=created if created is not None else api.context_type(),
        kind=api.trace.SpanKind.CONSUMER,
        attributes=attributes,
        links=links,
    ) as span:
        # The handler's failure is recorded by record_failure (the executor catches it);
        # a cancellation (the drain's deadline passed) is not the task's error.
        try:
            await run
        except asyncio.CancelledError:
            span.set_attribute("steeple.task.interrupted", True)
            raise


def record_failure(exc: BaseException) -> None:
    """Mark the current run's span failed with ``exc`` (a no-op unless a span records)."""
    api = _api_cache[0] if _api_cache else None
    if api is None:
        return
    span = api.trace.get_current_span()
    if not span.is_recording():
        return
    kind = type(exc)
    span.record_exception(exc)
    span.set_attribute("error.type", f"{kind.__module__}.{kind.__qualname__}")
    span.set_status(api.trace.Status(api.trace.StatusCode.ERROR, kind.__name__))
