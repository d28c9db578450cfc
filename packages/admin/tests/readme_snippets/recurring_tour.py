"""Recurring publications in five minutes: define, tick, relay, consume."""

import asyncio
import os
import tempfile
from datetime import UTC, datetime, timedelta
from pathlib import Path

from steeple.brokers.sqlite import SqliteJournalBroker
from steeple.core import (
    MissedRunPolicy,
    RecurringConfig,
    RecurringDefinition,
    ScheduledMessage,
    SystemClock,
)
from steeple.keyring import Keyring, StorageKey
from steeple.postgres import PostgresRecurringStore


async def main() -> None:
    dsn = os.environ["STEEPLE_DATABASE_URL"]
    schema = os.environ.get("STEEPLE_SCHEMA", "steeple")
    # In production the key comes from your secret manager (see `steeple keys generate`).
    keyring = Keyring(StorageKey.generate("2026-11"))
    config = RecurringConfig("shop", max_definitions=100, max_occurrences=10_000)

    # Deployment role, once: create the schema and the namespace.
    store = await PostgresRecurringStore.initialize(
        dsn, config, keyring, SystemClock(), schema=schema
    )
    async with store:
        # An immutable definition: every minute, catching up missed minutes.
        await store.create(
            RecurringDefinition(
                name="nightly-invoices",
                cron="* * * * *",
                first_after=datetime.now(UTC) - timedelta(minutes=3),
                policy=MissedRunPolicy.CATCH_UP,
                message=ScheduledMessage("billing", "InvoiceRun", b'{"batch": "eu"}'),
            )
        )

        ticked = await store.tick(budget=100)  # materialize due occurrences
        print("materialized", ticked.materialized)  # the three missed minutes

        journal_path = Path(tempfile.mkdtemp()) / "journal.sqlite3"
        async with SqliteJournalBroker(journal_path, keyring, namespace="shop") as journal:
            for lease in await store.claim(limit=10):
                receipt = await store.relay(lease, journal)  # publish, then record it
                print("published", receipt.idempotency_key)

            # A consumer reads and acknowledges; deduplicate on the idempotency key.
            for delivery in await journal.fetch(limit=10):
                print(delivery.message.topic, delivery.message.payload)
                await journal.acknowledge(delivery.delivery_id)

        page = await store.occurrences(limit=10)
        print([o.state.value for o in page.items])  # ['published', 'published', 'published']


if __name__ == "__main__":
    asyncio.run(main())
