"""Recurring publications in five minutes: define, tick, relay, consume."""

import asyncio
import os
from datetime import UTC, datetime, timedelta
from pathlib import Path

from steeple.admin.embedded import database_url
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

HERE = Path(".steeple/tour")  # the key and the journal (and the embedded PostgreSQL)


def storage_key() -> Keyring:
    """The storage key, kept in a file (as `steeple keys generate --out FILE` writes it)."""
    path = HERE / "storage.key"
    if not path.exists():  # the first run makes it; later runs must use the same key
        HERE.mkdir(parents=True, exist_ok=True)
        key = StorageKey.generate("tour-1")
        with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            f.write(f"{key.key_id}:{key.to_base64()}\n")  # a secret: readable by you only
    key_id, _, material = path.read_text().strip().rpartition(":")
    return Keyring(StorageKey.from_base64(key_id, material))


async def main(dsn: str) -> None:
    schema = os.environ.get("STEEPLE_SCHEMA", "steeple")
    keyring = storage_key()
    config = RecurringConfig("shop", max_definitions=1000, max_occurrences=100_000)

    # Deployment role, once (later runs find it): create the schema and the namespace.
    store = await PostgresRecurringStore.initialize(
        dsn, config, keyring, SystemClock(), schema=schema
    )
    async with store:
        # An immutable definition: every minute, catching up missed minutes.
        names = {s.name for s in (await store.schedules()).items}
        if "invoices" not in names:  # a second run of this tour keeps the first one's
            await store.create(
                RecurringDefinition(
                    name="invoices",
                    cron="* * * * *",
                    first_after=datetime.now(UTC) - timedelta(minutes=3),
                    policy=MissedRunPolicy.CATCH_UP,
                    message=ScheduledMessage("billing", "InvoiceRun", b'{"batch": "eu"}'),
                )
            )

        ticked = await store.tick(budget=100)  # materialize due occurrences
        print("materialized", ticked.materialized)  # first run: the three missed minutes

        async with SqliteJournalBroker(
            HERE / "journal.sqlite3", keyring, namespace="shop"
        ) as journal:
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
    # STEEPLE_DATABASE_URL if set, else a private PostgreSQL in .steeple/tour (pgserver).
    with database_url(HERE) as dsn:
        asyncio.run(main(dsn))
