"""A relay worker process for the kill -9 journey (run as a script, not collected).

It claims every publishable occurrence, relays the first one, and right after the broker
accepted it -- before the store records the outcome -- prints ``accepted`` and hangs, so
the test can SIGKILL it at exactly that point.

Usage: python journey_worker.py DSN SCHEMA NAMESPACE KIND SPEC_JSON
"""

from __future__ import annotations

import asyncio
import json
import sys
from datetime import timedelta
from typing import Any

from steeple.core.clock import SystemClock
from steeple.core.config import RecurringConfig
from steeple.core.messages import BrokerReceipt
from steeple.keyring import Keyring, StorageKey
from steeple.postgres import PostgresRecurringStore

KEYRING = Keyring(StorageKey("journey-2026", bytes(range(100, 132))))


def build(kind: str, spec: dict[str, Any]) -> Any:
    if kind == "sqlite":
        from steeple.brokers.sqlite import SqliteJournalBroker

        return SqliteJournalBroker(spec["path"], KEYRING)
    if kind == "nats":
        from steeple.brokers.nats import JetStreamBroker

        return JetStreamBroker(
            spec["url"], stream=spec["stream"], subject=spec["subject"], manage_stream=True
        )
    if kind == "redis":
        from steeple.brokers.redis import RedisStreamBroker

        return RedisStreamBroker(spec["url"], stream=spec["stream"])
    raise SystemExit(f"unknown kind {kind}")


async def main(dsn: str, schema: str, namespace: str, kind: str, spec: dict[str, Any]) -> None:
    config = RecurringConfig(namespace, 100, 1000, lease_duration=timedelta(seconds=2))
    store = await PostgresRecurringStore.connect(dsn, config, KEYRING, SystemClock(), schema=schema)
    broker = build(kind, spec)
    original = broker._transmit

    async def transmit_then_hang(*args: Any, **kwargs: Any) -> BrokerReceipt:
        receipt: BrokerReceipt = await original(*args, **kwargs)
        print("accepted", receipt.location, flush=True)
        await asyncio.sleep(3600)
        return receipt

    broker._transmit = transmit_then_hang
    leases = await store.claim(100)
    print("claimed", len(leases), flush=True)
    await store.relay(leases[0], broker)


if __name__ == "__main__":
    dsn, schema, namespace, kind, spec = sys.argv[1:6]
    asyncio.run(main(dsn, schema, namespace, kind, json.loads(spec)))
