"""OpenTelemetry instruments of the queue, optional: off unless ``opentelemetry-api`` is installed.

``opentelemetry-api`` is the ``steeple-postgres[otel]`` extra, so nothing here imports it at
module import: :func:`instruments` looks for it on first use and, when it is missing, hands
out instruments that do nothing. With the API but no SDK configured, its own instruments are
no-ops too. Instruments are created on first use, never at import.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Protocol

import attrs

__all__ = [
    "Counter",
    "Histogram",
    "QueueInstruments",
    "instruments",
    "recording",
    "task_attributes",
]

Attributes = Mapping[str, str] | None


@functools.lru_cache(maxsize=1024)
def task_attributes(task_name: str, queue: str) -> Mapping[str, str]:
    """Return the attributes every per-task measurement carries: the task name and queue.

    Built once per name and queue (a worker measures each task several times): read-only.
    """
    return MappingProxyType({"task": task_name, "queue": queue})


class Counter(Protocol):
    """What the queue uses of an OpenTelemetry counter."""

    def add(self, amount: int, attributes: Attributes = None) -> None:
        """Add ``amount`` under ``attributes``."""
        ...


class Histogram(Protocol):
    """What the queue uses of an OpenTelemetry histogram."""

    def record(self, amount: float, attributes: Attributes = None) -> None:
        """Record one value under ``attributes``."""
        ...


class _Off:
    """Counter and histogram in one, both doing nothing (no ``opentelemetry-api``)."""

    def add(self, amount: int, attributes: Attributes = None) -> None:
        del amount, attributes

    def record(self, amount: float, attributes: Attributes = None) -> None:
        del amount, attributes


@attrs.frozen
class QueueInstruments:
    """Counters and histograms named ``steeple.queue.*``."""

    enqueued: Counter
    claimed: Counter
    succeeded: Counter
    failed: Counter
    retried: Counter
    cancelled: Counter
    lease_lost: Counter
    recovered: Counter
    run_time: Histogram
    pickup_latency: Histogram
    loop_stall: Histogram


def _off() -> QueueInstruments:
    off = _Off()
    return QueueInstruments(off, off, off, off, off, off, off, off, off, off, off)


@functools.cache
def instruments() -> QueueInstruments:
    """Return the queue's instruments (created once, from the global meter provider).

    Without ``opentelemetry-api`` installed they do nothing.
    """
    try:
        from opentelemetry import metrics
    except ImportError:  # the optional [otel] extra is not installed: metrics are off
        return _off()
    meter: Any = metrics.get_meter("steeple.postgres.queue")

    def counter(name: str, what: str) -> Counter:
        made: Counter = meter.create_counter(
            f"steeple.queue.tasks.{name}", unit="{task}", description=what
        )
        return made

    def histogram(name: str, unit: str, what: str) -> Histogram:
        made: Histogram = meter.create_histogram(name, unit=unit, description=what)
        return made

    return QueueInstruments(
        enqueued=counter("enqueued", "Tasks created"),
        claimed=counter("claimed", "Tasks claimed by a worker"),
        succeeded=counter("succeeded", "Attempts that succeeded"),
        failed=counter("failed", "Tasks that failed for good"),
        retried=counter("retried", "Attempts that failed and were requeued"),
        cancelled=counter("cancelled", "Tasks cancelled"),
        lease_lost=counter("lease_lost", "Attempts whose lease was lost or fenced"),
        recovered=counter("recovered", "Expired leases recovered"),
        run_time=histogram("steeple.queue.run_time", "s", "Handler run time"),
        pickup_latency=histogram("steeple.queue.pickup_latency", "s", "Due time to claim"),
        loop_stall=histogram(
            "steeple.queue.loop_stall", "s", "Event-loop stalls past the loop-lag threshold"
        ),
    )


@functools.cache
def _unconfigured() -> tuple[Any, tuple[type, ...]] | None:
    """``get_meter_provider`` and the provider types that record nothing; None: no API."""
    try:
        from opentelemetry import metrics
    except ImportError:
        return None
    kinds: list[type] = [metrics.NoOpMeterProvider]
    try:  # the stand-in until a provider is set (private: absent, it counts as recording)
        from opentelemetry.metrics._internal import _ProxyMeterProvider
    except ImportError:  # pragma: no cover - another opentelemetry-api layout
        pass
    else:
        kinds.append(_ProxyMeterProvider)
    return metrics.get_meter_provider, tuple(kinds)


def recording() -> QueueInstruments | None:
    """Return the instruments while a meter provider is configured, else None.

    The hot path asks once per claimed batch and skips its per-task measurements when
    nothing would record them (no ``opentelemetry-api``, or no provider set: the API's own
    instruments are no-ops then). Instruments made before a provider is set forward to it
    once it is, so the measurements resume with the next batch.
    """
    api = _unconfigured()
    if api is None:
        return None
    get_provider, silent = api
    if isinstance(get_provider(), silent):
        return None
    return instruments()
