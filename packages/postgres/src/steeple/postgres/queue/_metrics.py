"""OpenTelemetry instruments of the queue (API only: no-ops unless an SDK is configured).

Instruments are created on first use, never at import.
"""

from __future__ import annotations

import functools

import attrs
from opentelemetry import metrics
from opentelemetry.metrics import Counter, Histogram

__all__ = ["QueueInstruments", "instruments"]


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


@functools.cache
def instruments() -> QueueInstruments:
    """Return the queue's instruments (created once, from the global meter provider)."""
    meter = metrics.get_meter("steeple.postgres.queue")

    def counter(name: str, what: str) -> Counter:
        return meter.create_counter(f"steeple.queue.tasks.{name}", unit="{task}", description=what)

    return QueueInstruments(
        enqueued=counter("enqueued", "Tasks created"),
        claimed=counter("claimed", "Tasks claimed by a worker"),
        succeeded=counter("succeeded", "Attempts that succeeded"),
        failed=counter("failed", "Tasks that failed for good"),
        retried=counter("retried", "Attempts that failed and were requeued"),
        cancelled=counter("cancelled", "Tasks cancelled"),
        lease_lost=counter("lease_lost", "Attempts whose lease was lost or fenced"),
        recovered=counter("recovered", "Expired leases recovered"),
        run_time=meter.create_histogram(
            "steeple.queue.run_time", unit="s", description="Handler run time"
        ),
        pickup_latency=meter.create_histogram(
            "steeple.queue.pickup_latency", unit="s", description="Due time to claim"
        ),
    )
