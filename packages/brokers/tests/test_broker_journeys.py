"""Journeys: PostgreSQL recurring store -> relay -> real broker -> real consumer.

For every broker: a catch-up definition materializes three occurrences; the first relay's
acknowledgement is lost after the broker accepted (RelayAcknowledgementError); the worker
then "restarts" (store, relay and broker objects closed and built afresh, as a new
process would) and a RecurringRelay finishes the work. The consumer must end with
exactly one delivery per occurrence -- by the broker's dedup, or (RabbitMQ) by the
documented consumer-side dedup, which must have dropped the extra copy.
"""

from __future__ import annotations

import asyncio
import json
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import aio_pika
import asyncpg
import nats
import pytest
import redis.asyncio as aioredis

from broker_support import drain_deliveries, lose_next_ack, start_kept, take_pending_tasks
from steeple.brokers.nats import JetStreamBroker, JetStreamConsumer
from steeple.brokers.queue import WorkQueueBroker
from steeple.brokers.rabbitmq import (
    DedupingConsumer,
    MemorySeenStore,
    RabbitMQBroker,
    RabbitMQConsumer,
)
from steeple.brokers.redis import RedisStreamBroker, RedisStreamConsumer
from steeple.brokers.sqlite import SqliteJournalBroker
from steeple.core.clock import SystemClock
from steeple.core.config import RecurringConfig, RecurringDefinition
from steeple.core.errors import (
    RelayAcknowledgementError,
    RelayBrokerError,
    RelayBrokerTimeoutError,
)
from steeple.core.messages import ScheduledMessage
from steeple.core.occurrences import OccurrenceState
from steeple.core.policies import MissedRunPolicy
from steeple.core.records import OccurrenceInfo
from steeple.keyring import Keyring, StorageKey
from steeple.postgres import PostgresRecurringStore, RecurringRelay
from steeple.postgres.queue import install

pytestmark = [pytest.mark.postgres, pytest.mark.broker, pytest.mark.slow]

KEYRING = Keyring(StorageKey("journey-2026", bytes(range(100, 132))))


class Destination:
    """One broker under test: how to build it, how to read what reached consumers."""

    name: str
    broker_dedups: bool = True
    brokers: list[Any]
    """Every broker ``make_broker`` built; :meth:`close` closes them."""

    async def make_broker(self) -> Any:
        raise NotImplementedError

    def spec(self) -> dict[str, Any]:
        raise NotImplementedError

    async def consume(self) -> list[tuple[str, ScheduledMessage]]:
        raise NotImplementedError

    async def close(self) -> None:
        for b in self.brokers:
            await b.close()


class SqliteDestination(Destination):
    name = "sqlite"

    def __init__(self, tmp: Path) -> None:
        self.path = tmp / "journal.db"
        self.brokers: list[SqliteJournalBroker] = []

    def spec(self) -> dict[str, Any]:
        return {"path": str(self.path)}

    async def make_broker(self) -> SqliteJournalBroker:
        b = SqliteJournalBroker(self.path, KEYRING)
        return await start_kept(self.brokers, b)

    async def consume(self) -> list[tuple[str, ScheduledMessage]]:
        async with SqliteJournalBroker(self.path, KEYRING) as consumer:
            return await drain_deliveries(
                lambda: consumer.fetch(100), lambda d: consumer.acknowledge(d.delivery_id)
            )


class NatsDestination(Destination):
    name = "nats"

    def __init__(self, url: str) -> None:
        tag = uuid.uuid4().hex[:10]
        self.url, self.stream, self.subject = url, f"JOURNEY_{tag}", f"journey.{tag}"
        self.brokers: list[JetStreamBroker] = []

    def spec(self) -> dict[str, Any]:
        return {"url": self.url, "stream": self.stream, "subject": self.subject}

    async def make_broker(self) -> JetStreamBroker:
        b = JetStreamBroker(self.url, stream=self.stream, subject=self.subject, manage_stream=True)
        return await start_kept(self.brokers, b)

    async def consume(self) -> list[tuple[str, ScheduledMessage]]:
        async with JetStreamConsumer(self.url, stream=self.stream, durable="journey") as c:
            return await drain_deliveries(
                lambda: c.fetch(100, wait=0.5), lambda d: c.acknowledge(d.delivery_id)
            )

    async def close(self) -> None:
        await super().close()
        nc = await nats.connect(self.url)
        try:
            await nc.jetstream().delete_stream(self.stream)
        finally:
            await nc.close()


class RedisDestination(Destination):
    name = "redis"

    def __init__(self, url: str) -> None:
        self.url, self.stream = url, f"steeple-journey:{uuid.uuid4().hex[:10]}"
        self.brokers: list[RedisStreamBroker] = []

    def spec(self) -> dict[str, Any]:
        return {"url": self.url, "stream": self.stream}

    async def make_broker(self) -> RedisStreamBroker:
        b = RedisStreamBroker(self.url, stream=self.stream)
        return await start_kept(self.brokers, b)

    async def consume(self) -> list[tuple[str, ScheduledMessage]]:
        async with RedisStreamConsumer(self.url, stream=self.stream, group="journey") as c:
            return await drain_deliveries(
                lambda: c.fetch(100), lambda d: c.acknowledge(d.delivery_id)
            )

    async def close(self) -> None:
        await super().close()
        client = aioredis.Redis.from_url(self.url)
        try:
            keys = [k async for k in client.scan_iter(match=f"{self.stream}*")]
            if keys:
                await client.delete(*keys)
        finally:
            await client.aclose()


class RabbitDestination(Destination):
    name = "rabbitmq"
    broker_dedups = False

    def __init__(self, url: str) -> None:
        self.url, self.queue = url, f"steeple-journey-{uuid.uuid4().hex[:10]}"
        self.brokers: list[RabbitMQBroker] = []
        self.dropped = 0

    async def make_broker(self) -> RabbitMQBroker:
        conn = await aio_pika.connect(self.url)
        async with conn:
            await (await conn.channel()).declare_queue(self.queue, durable=True)
        b = RabbitMQBroker(self.url, routing_key=self.queue)
        return await start_kept(self.brokers, b)

    async def consume(self) -> list[tuple[str, ScheduledMessage]]:
        raw = RabbitMQConsumer(self.url, queue=self.queue)
        consumer = DedupingConsumer(raw, MemorySeenStore(timedelta(days=1)))
        try:
            out = await drain_deliveries(lambda: consumer.fetch(100), consumer.acknowledge)
            self.dropped = consumer.dropped
            return out
        finally:
            await raw.close()

    async def close(self) -> None:
        await super().close()
        conn = await aio_pika.connect(self.url)
        async with conn:
            await (await conn.channel()).queue_delete(self.queue)


class QueueDestination(Destination):
    name = "queue"

    def __init__(self, dsn: str, schema: str) -> None:
        self.dsn, self.schema = dsn, schema
        self.brokers: list[WorkQueueBroker] = []

    async def make_broker(self) -> WorkQueueBroker:
        if not self.brokers:
            conn = await asyncpg.connect(self.dsn)
            try:
                await install(conn, schema=self.schema)
            finally:
                await conn.close()
            await WorkQueueBroker(self.dsn, schema=self.schema).install()
        b = WorkQueueBroker(self.dsn, schema=self.schema)
        self.brokers.append(b)
        return b

    async def consume(self) -> list[tuple[str, ScheduledMessage]]:
        return await take_pending_tasks(self.dsn, self.schema)


@pytest.fixture
async def destination(
    request: pytest.FixtureRequest, tmp_path: Path, pg_schema: tuple[str, str]
) -> AsyncIterator[Destination]:
    kind = request.param
    dest: Destination
    if kind == "sqlite":
        dest = SqliteDestination(tmp_path)
    elif kind == "nats":
        dest = NatsDestination(request.getfixturevalue("nats_url"))
    elif kind == "redis":
        dest = RedisDestination(request.getfixturevalue("redis_url"))
    elif kind == "rabbitmq":
        dest = RabbitDestination(request.getfixturevalue("amqp_url"))
    else:
        dsn, schema = pg_schema
        dest = QueueDestination(dsn, f"{schema}_q")
    try:
        yield dest
    finally:
        await dest.close()
        if kind == "queue":
            conn = await asyncpg.connect(pg_schema[0])
            try:
                await conn.execute(f'DROP SCHEMA IF EXISTS "{pg_schema[1]}_q" CASCADE')
            finally:
                await conn.close()


async def _until(predicate: Callable[[], Awaitable[bool]], within: float) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while not await predicate():
        assert loop.time() < deadline, "the journey did not finish in time"
        await asyncio.sleep(0.2)


async def _relay_until_published(
    destination: Destination, dsn: str, schema: str, config: RecurringConfig, clock: SystemClock
) -> Sequence[OccurrenceInfo]:
    """A new worker: fresh store and broker connections, a relay loop run until done."""
    store = await PostgresRecurringStore.connect(dsn, config, KEYRING, clock, schema=schema)
    broker = await destination.make_broker()
    relay = RecurringRelay(store, broker, idle_interval=0.2)
    try:

        async def all_published() -> bool:
            await relay.run_once()
            page = await store.occurrences(limit=100)
            return all(o.state == OccurrenceState.PUBLISHED for o in page.items)

        await _until(all_published, within=60)
        return (await store.occurrences(limit=100)).items
    finally:
        await store.close()


@pytest.mark.parametrize(
    "destination", ["sqlite", "nats", "redis", "rabbitmq", "queue"], indirect=True
)
async def test_journey_with_a_lost_ack_and_a_worker_restart(
    destination: Destination, pg_schema: tuple[str, str]
) -> None:
    dsn, schema = pg_schema
    namespace = f"journey-{destination.name}"
    config = RecurringConfig(namespace, 100, 1000, lease_duration=timedelta(seconds=2))
    clock = SystemClock()
    now = clock.now()
    message = ScheduledMessage(
        "reminders", "reminder.requested", b'{"event": 7}', {"tenant": "school-1"}
    )
    # Catch-up over the last three minutes: three occurrences due now.
    first_after = now.replace(second=0, microsecond=0) - timedelta(minutes=3)
    definition = RecurringDefinition(
        "daily-reminder-v1", "* * * * *", first_after, MissedRunPolicy.CATCH_UP, message
    )

    store = await PostgresRecurringStore.initialize(dsn, config, KEYRING, clock, schema=schema)
    try:
        await store.create(definition)
        tick = await store.tick(100)
        assert tick.materialized >= 3
        broker = await destination.make_broker()
        # This worker leases everything, loses one acknowledgement, then "crashes": the
        # other leases are abandoned and must expire before the next worker reclaims them.
        [lease, *abandoned] = await store.claim(100)
        assert len(abandoned) >= 2
        lose_next_ack(broker)
        if destination.broker_dedups:
            # The adapter finds the key on the broker: an uncertain acknowledgement.
            with pytest.raises(RelayAcknowledgementError) as lost:
                await store.relay(lease, broker)
            assert lost.value.receipt.idempotency_key
        else:
            # RabbitMQ cannot look a key up: the lost confirm is a timeout, retried.
            with pytest.raises(RelayBrokerTimeoutError):
                await store.relay(lease, broker)
    finally:
        await store.close()
    # The worker "restarts": new store connection, new broker connection, new relay loop.
    # Abandoned leases run out after 2 s; the lost one waits out its retry backoff.
    occurrences = await _relay_until_published(destination, dsn, schema, config, clock)

    delivered = await destination.consume()
    keys = [k for k, _ in delivered]
    assert len(keys) == len(occurrences) >= 3
    assert len(set(keys)) == len(keys), "an occurrence reached consumers twice"
    assert all(m == message for _, m in delivered)
    if isinstance(destination, RabbitDestination):
        # The queue held the lost-ack copy twice; the consumer-side dedup dropped one.
        assert destination.dropped == 1


async def test_a_message_over_the_server_limit_is_a_dead_letter_not_endless_retries(
    pg_schema: tuple[str, str], tmp_path: Path
) -> None:
    """Row 28: the private nats-server accepts at most 1 KiB; the occurrence dies at once."""
    from nats_support import PrivateNats

    dsn, schema = pg_schema
    server = PrivateNats(tmp_path, max_payload=1024)
    server.start()
    config = RecurringConfig("journey-too-large", 100, 1000)
    clock = SystemClock()
    big = ScheduledMessage("reminders", "reminder.requested", b"x" * 2000)
    definition = RecurringDefinition(
        "big-v1",
        "* * * * *",
        clock.now().replace(second=0, microsecond=0) - timedelta(minutes=1),
        MissedRunPolicy.CATCH_UP,
        big,
    )
    store = await PostgresRecurringStore.initialize(dsn, config, KEYRING, clock, schema=schema)
    broker = JetStreamBroker(server.url, stream="BIG", subject="big.one", manage_stream=True)
    try:
        await store.create(definition)
        assert (await store.tick(100)).materialized >= 1
        leases = await store.claim(100)
        for lease in leases:
            with pytest.raises(RelayBrokerError) as info:
                await store.relay(lease, broker)
            assert info.value.permanent
        states = {o.state for o in (await store.occurrences(limit=100)).items}
        assert states == {OccurrenceState.DEAD}
        assert await store.claim(100) == []  # not retried automatically
    finally:
        await broker.close()
        await store.close()
        server.kill()


@pytest.mark.parametrize("destination", ["sqlite", "nats", "redis"], indirect=True)
async def test_worker_killed_after_the_broker_accepted_then_a_new_worker_finishes(
    destination: Destination, pg_schema: tuple[str, str]
) -> None:
    """Row 12 with real brokers: SIGKILL after the broker accepted, before the store knew."""
    dsn, schema = pg_schema
    namespace = f"kill-{destination.name}"
    config = RecurringConfig(namespace, 100, 1000, lease_duration=timedelta(seconds=2))
    clock = SystemClock()
    message = ScheduledMessage("reminders", "reminder.requested", b"kill -9")
    definition = RecurringDefinition(
        "killed-v1",
        "* * * * *",
        clock.now().replace(second=0, microsecond=0) - timedelta(minutes=3),
        MissedRunPolicy.CATCH_UP,
        message,
    )
    store = await PostgresRecurringStore.initialize(dsn, config, KEYRING, clock, schema=schema)
    try:
        await store.create(definition)
        assert (await store.tick(100)).materialized >= 3
    finally:
        await store.close()

    worker = await asyncio.create_subprocess_exec(
        sys.executable,
        str(Path(__file__).parent / "journey_worker.py"),
        dsn,
        schema,
        namespace,
        destination.name,
        json.dumps(destination.spec()),
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert worker.stdout is not None
        async with asyncio.timeout(60):
            while not (line := (await worker.stdout.readline()).decode()).startswith("accepted"):
                assert line, "the worker exited before the broker accepted"
    finally:
        worker.kill()  # SIGKILL: the store never learns about the publication
        await worker.wait()

    occurrences = await _relay_until_published(destination, dsn, schema, config, clock)
    # The killed worker's occurrence was attempted twice, under the same key.
    assert max(o.attempts for o in occurrences) >= 2
    delivered = await destination.consume()
    keys = [k for k, _ in delivered]
    assert len(keys) == len(set(keys)) == len(occurrences)
