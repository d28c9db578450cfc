"""RabbitMQ against the machine's server (rows 26, 28, 29), through a fault proxy."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path

import aio_pika
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker_support import (
    BROKER_CHECKS,
    ProxiedHarness,
    TcpProxy,
    drain_deliveries,
    message,
    new_key,
    publish_retrying,
    running_proxy,
    start_kept,
)
from steeple.brokers import Delivery
from steeple.brokers.rabbitmq import (
    DedupingConsumer,
    MemorySeenStore,
    RabbitMQBroker,
    RabbitMQConsumer,
    SqliteSeenStore,
)
from steeple.core.errors import (
    BrokerConfigurationError,
    BrokerRejectedError,
    BrokerTimeoutError,
    BrokerUnavailableError,
    ConfigurationError,
)
from steeple.core.messages import ScheduledMessage

pytestmark = pytest.mark.broker


class RabbitHarness(ProxiedHarness):
    name = "rabbitmq"
    deduplicates = False  # RabbitMQ cannot: the consumer deduplicates (DedupingConsumer)
    recognises_lost_acknowledgement = False

    def __init__(self, url: str, proxy: TcpProxy) -> None:
        super().__init__(proxy)
        self.url = url
        self.queue = f"steeple-test-{uuid.uuid4().hex[:12]}"
        self.consumer = RabbitMQConsumer(url, queue=self.queue)
        self.deduping = DedupingConsumer(self.consumer, MemorySeenStore(timedelta(days=1)))

    async def setup(self) -> None:
        conn = await aio_pika.connect(self.url)
        async with conn:
            ch = await conn.channel()
            await ch.declare_queue(self.queue, durable=True)

    async def make_broker(self) -> RabbitMQBroker:
        b = RabbitMQBroker(
            self.proxy.url("amqp", "guest:guest@", "/"),
            routing_key=self.queue,
            max_message_bytes=4096,
        )
        return await start_kept(self.brokers, b)

    async def drain(self) -> list[tuple[str, ScheduledMessage]]:
        out = await drain_deliveries(lambda: self.deduping.fetch(100), self.deduping.acknowledge)
        # Copies dropped by the consumer-side dedup were acknowledged too.
        assert await self.consumer.fetch(1) == []
        return out

    def secrets_in_config(self) -> list[str]:
        return ["guest:guest"]

    async def close(self) -> None:
        await super().close()
        await self.consumer.close()
        conn = await aio_pika.connect(self.url)
        async with conn:
            ch = await conn.channel()
            await ch.queue_delete(self.queue)


@pytest.fixture
async def harness(amqp_url: str) -> AsyncIterator[RabbitHarness]:
    async with running_proxy("127.0.0.1", 5672) as proxy, RabbitHarness(amqp_url, proxy) as h:
        await h.setup()
        yield h


@pytest.mark.parametrize("check", sorted(BROKER_CHECKS))
async def test_rabbitmq_conformance(check: str, harness: RabbitHarness) -> None:
    await BROKER_CHECKS[check](harness)


async def test_unroutable_publish_is_a_permanent_failure(harness: RabbitHarness) -> None:
    """Row 29: no queue bound to the routing key: the broker returns it; we report it."""
    async with RabbitMQBroker(harness.url, routing_key=f"nowhere-{uuid.uuid4().hex}") as b:
        with pytest.raises(BrokerRejectedError, match="unroutable") as info:
            await b.publish(message(1), idempotency_key=new_key(), timeout=5)
        assert info.value.permanent
        # The channel is still usable for routable messages afterwards.
    async with RabbitMQBroker(harness.url) as b:  # routing by topic
        with pytest.raises(BrokerRejectedError, match="reminders"):
            await b.publish(message(1), idempotency_key=new_key(), timeout=5)
    assert await harness.drain() == []


async def test_missing_exchange_is_a_configuration_error(amqp_url: str) -> None:
    b = RabbitMQBroker(amqp_url, exchange=f"missing-{uuid.uuid4().hex}")
    with pytest.raises(BrokerConfigurationError, match="does not exist"):
        await b.publish(message(1), idempotency_key=new_key(), timeout=5)
    await b.close()


async def test_messages_are_persistent_with_the_key_as_message_id(
    harness: RabbitHarness,
) -> None:
    broker = await harness.make_broker()
    key = new_key()
    receipt = await broker.publish(message(3), idempotency_key=key, timeout=5)
    assert receipt.duplicate is False
    conn = await aio_pika.connect(harness.url)
    async with conn:
        ch = await conn.channel()
        q = await ch.get_queue(harness.queue)
        raw = await q.get(no_ack=True, timeout=5)
    assert raw.message_id == key
    assert raw.delivery_mode == aio_pika.DeliveryMode.PERSISTENT
    assert raw.type == "reminder.requested"
    assert raw.body == message(3).payload


async def test_lost_confirm_on_the_wire_gives_two_copies_and_one_processed(
    harness: RabbitHarness,
) -> None:
    """Row 26 for RabbitMQ: the queue keeps both copies; the consumer drops the second."""
    broker = await harness.make_broker()
    await broker.publish(message(0), idempotency_key=new_key(), timeout=5)
    key = new_key()
    harness.proxy.drop_replies()  # the message reaches the broker; its confirm is lost
    with pytest.raises(BrokerTimeoutError):
        await broker.publish(message(1), idempotency_key=key, timeout=1.5)
    await publish_retrying(broker, message(1), key)
    got = await harness.drain()
    assert [k for k, _ in got].count(key) == 1
    assert harness.deduping.dropped == 1  # the broker did hold two copies


async def test_sqlite_seen_store_survives_a_consumer_restart(
    harness: RabbitHarness, tmp_path: Path
) -> None:
    broker = await harness.make_broker()
    key = new_key()
    await broker.publish(message(1), idempotency_key=key, timeout=5)
    store = SqliteSeenStore(tmp_path / "seen.db", timedelta(days=1))
    first = DedupingConsumer(RabbitMQConsumer(harness.url, queue=harness.queue), store)
    [d] = await first.fetch(10)
    assert await first.acknowledge(d)
    await first._consumer.close()
    await store.close()
    # The relay republishes (say its confirm was lost); a restarted consumer drops it.
    await broker.publish(message(1), idempotency_key=key, timeout=5)
    store2 = SqliteSeenStore(tmp_path / "seen.db", timedelta(days=1))
    second = DedupingConsumer(RabbitMQConsumer(harness.url, queue=harness.queue), store2)
    try:
        assert await second.fetch(10) == []
        assert second.dropped == 1
    finally:
        await second._consumer.close()
        await store2.close()


async def test_unacknowledged_messages_return_when_the_consumer_closes(
    harness: RabbitHarness,
) -> None:
    broker = await harness.make_broker()
    key = new_key()
    await broker.publish(message(1), idempotency_key=key, timeout=5)
    c = RabbitMQConsumer(harness.url, queue=harness.queue)
    [d] = await c.fetch(10)
    assert d.delivery_count == 1
    await c.close()
    [again] = await harness.consumer.fetch(10)
    assert again.idempotency_key == key
    assert again.delivery_count == 2  # redelivered
    assert await harness.consumer.acknowledge(again.delivery_id)


async def test_memory_seen_store_ttl_and_bound() -> None:
    now = [1000.0]
    store = MemorySeenStore(timedelta(seconds=10), max_entries=3, now=lambda: now[0])
    for k in ("a", "b", "c"):
        await store.add(k)
    assert await store.contains("a")
    await store.add("d")  # over the bound: the oldest is forgotten early
    assert not await store.contains("a")
    assert await store.contains("d")
    now[0] += 10.5
    assert not await store.contains("d")
    assert len(store) == 0
    with pytest.raises(ConfigurationError):
        MemorySeenStore(timedelta(0))


async def test_unreachable_server_is_unavailable() -> None:
    from nats_support import free_port

    b = RabbitMQBroker(f"amqp://u:pw-secret@127.0.0.1:{free_port()}/", connect_timeout=1)
    assert "pw-secret" not in repr(b)
    with pytest.raises(BrokerUnavailableError):
        await b.publish(message(), idempotency_key=new_key(), timeout=2)
    await b.close()


class _ListConsumer:
    """A consumer over a fixed list of deliveries, recording acknowledgements."""

    def __init__(self, keys: list[str]) -> None:
        self.pending = [Delivery(str(i), k, message(0)) for i, k in enumerate(keys)]
        self.acked: list[str] = []

    async def fetch(self, limit: int = 10) -> list[Delivery]:
        batch, self.pending = self.pending[:limit], self.pending[limit:]
        return batch

    async def acknowledge(self, delivery_id: str) -> bool:
        self.acked.append(delivery_id)
        return True


@settings(max_examples=300, deadline=None)
@given(
    keys=st.lists(st.sampled_from([f"k{i}" for i in range(8)]), max_size=40),
    batch=st.integers(1, 7),
)
def test_deduping_consumer_hands_out_each_key_once_and_acks_everything(
    keys: list[str], batch: int
) -> None:
    async def run() -> list[str]:
        inner = _ListConsumer(keys)
        dedup = DedupingConsumer(inner, MemorySeenStore(timedelta(days=1)))
        handed: list[str] = []
        while inner.pending:
            for d in await dedup.fetch(batch):
                handed.append(d.idempotency_key)
                await dedup.acknowledge(d)
        assert sorted(inner.acked, key=int) == [str(i) for i in range(len(keys))]
        assert dedup.dropped == len(keys) - len(handed)
        return handed

    handed = asyncio.run(run())
    assert handed == list(dict.fromkeys(keys))  # first occurrence of each key, in order
