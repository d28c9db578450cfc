"""A relay process for the relay stress test (run as a script, not collected).

It runs a ``RecurringRelay`` (tick, ``claim_and_relay``, repeat) over the namespace until
SIGTERM, publishing to the broker ``KIND`` described by ``SPEC_JSON`` (whose address is
the test's fault proxy). It prints ``ready`` once connected and, after a graceful stop,
``stats {...}`` (the relay's counters). The test SIGKILLs it at random.

Usage: python relay_stress_worker.py DSN SCHEMA NAMESPACE LEASE_MS KIND SPEC_JSON
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from collections import Counter
from datetime import timedelta
from typing import Any

import attrs

from steeple.core.clock import SystemClock
from steeple.core.config import RecurringConfig
from steeple.core.messages import BrokerReceipt, ScheduledMessage
from steeple.engine import RelayStatistics
from steeple.keyring import Keyring, StorageKey
from steeple.postgres import PostgresRecurringStore, RecurringRelay

KEYRING = Keyring(StorageKey("stress-2026", bytes(range(7, 39))))
MAX_DEFINITIONS = 10_000
MAX_OCCURRENCES = 100_000


class Counted:
    """Wraps the adapter: counts what each ``publish`` raised, by type (in ``stats``)."""

    def __init__(self, broker: Any) -> None:
        self.broker = broker
        self.raised: Counter[str] = Counter()

    async def publish(
        self, message: ScheduledMessage, *, idempotency_key: str, timeout: float
    ) -> BrokerReceipt:
        try:
            receipt: BrokerReceipt = await self.broker.publish(
                message, idempotency_key=idempotency_key, timeout=timeout
            )
        except Exception as exc:
            name = type(exc).__name__
            if not self.raised[name]:
                print(f"first {name}: {exc}", file=sys.stderr, flush=True)
            self.raised[name] += 1
            raise
        return receipt


def build(kind: str, spec: dict[str, Any]) -> Any:
    """The broker adapter of ``kind``, connecting to ``spec['url']`` (or ``spec['dsn']``)."""
    if kind == "nats":
        from steeple.brokers.nats import JetStreamBroker

        return JetStreamBroker(spec["url"], stream=spec["stream"], subject=spec["subject"])
    if kind == "redis":
        from steeple.brokers.redis import RedisStreamBroker

        return RedisStreamBroker(spec["url"], stream=spec["stream"])
    if kind == "rabbitmq":
        from steeple.brokers.rabbitmq import RabbitMQBroker

        return RabbitMQBroker(spec["url"], routing_key=spec["queue"])
    if kind == "queue":
        from steeple.brokers.queue import WorkQueueBroker

        return WorkQueueBroker(spec["dsn"], schema=spec["schema"])
    raise SystemExit(f"unknown broker kind {kind!r}")


async def main(
    dsn: str, schema: str, namespace: str, lease_ms: int, kind: str, spec: dict[str, Any]
) -> None:
    config = RecurringConfig(
        namespace,
        MAX_DEFINITIONS,
        MAX_OCCURRENCES,
        lease_duration=timedelta(milliseconds=lease_ms),
    )
    store = await PostgresRecurringStore.connect(dsn, config, KEYRING, SystemClock(), schema=schema)
    broker = build(kind, spec)
    counted = Counted(broker)
    stats = RelayStatistics()
    relay = RecurringRelay(store, counted, idle_interval=0.05, statistics=stats)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    print("ready", flush=True)
    try:
        await relay.run(stop)
    finally:
        await broker.close()
        await store.close()
    print("stats " + json.dumps(attrs.asdict(stats) | dict(counted.raised)), flush=True)


if __name__ == "__main__":
    dsn, schema, namespace, lease_ms, kind, spec = sys.argv[1:7]
    asyncio.run(main(dsn, schema, namespace, int(lease_ms), kind, json.loads(spec)))
