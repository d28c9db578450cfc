"""Property: any valid message either comes back from the real broker exactly, or is refused.

Hypothesis draws messages with arbitrary Unicode topics, message types and headers (4-byte
characters, combining marks, right-to-left text, JSON-special characters, up to the core's
length limits). Each is published to the machine's real NATS, RabbitMQ or Redis (and the
SQLite journal): either the adapter refuses it before sending with a permanent
``BrokerRejectedError`` and the broker holds nothing new, or a consumer reads back the very
same message under the same key. No other outcome (an untyped error, a dropped
connection, a message altered on the way) is allowed.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aio_pika
import nats
import pytest
import redis.asyncio as aioredis
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from broker_support import new_key
from steeple.brokers import Delivery
from steeple.brokers.nats import JetStreamBroker, JetStreamConsumer
from steeple.brokers.rabbitmq import RabbitMQBroker, RabbitMQConsumer
from steeple.brokers.redis import RedisStreamBroker, RedisStreamConsumer
from steeple.brokers.sqlite import SqliteJournalBroker
from steeple.core import limits
from steeple.core.errors import BrokerRejectedError, ConfigurationError
from steeple.core.messages import ScheduledMessage
from steeple.keyring import Keyring, StorageKey

# Text the core accepts, with the characters most likely to trip an encoder.
TRICKY = st.sampled_from(["€", "😀", "é", "\u0301", "ß", "ﬁ", "\u05d0", '"', "\\", ":", "{", " "])
TEXT = st.text(st.one_of(st.characters(codec="utf-8"), TRICKY), min_size=1, max_size=40)


@st.composite
def messages(draw: st.DrawFn) -> ScheduledMessage:
    long_text = st.one_of(TEXT, st.builds(lambda c, n: c * n, TRICKY, st.integers(60, 255)))
    try:
        return ScheduledMessage(
            draw(long_text),
            draw(long_text),
            draw(st.binary(max_size=200)),
            draw(st.dictionaries(TEXT, st.text(max_size=60), max_size=4)),
        )
    except ConfigurationError:
        assume(False)
        raise


Publish = Callable[[ScheduledMessage, str], Awaitable[Any]]
Fetch = Callable[[], Awaitable[list[Delivery]]]
Count = Callable[[], Awaitable[int]]


def run_property(
    runner: asyncio.Runner,
    publish: Publish,
    fetch: Fetch,
    acknowledge: Callable[[Delivery], Awaitable[Any]],
    count: Count,
) -> dict[str, int]:
    """Drive the property on one broker; every drawn message is accepted exactly or refused.

    Returns how many examples ended each way (``accepted``, ``refused``).
    """
    outcomes = {"accepted": 0, "refused": 0}

    async def check(msg: ScheduledMessage) -> None:
        key = new_key()
        before = await count()
        refused: BrokerRejectedError | None = None
        try:
            await publish(msg, key)
        except BrokerRejectedError as exc:
            refused = exc
        if refused is not None:
            assert refused.permanent is True
            assert await count() == before
            outcomes["refused"] += 1
            return
        deliveries = await fetch()
        assert [(d.idempotency_key, d.message) for d in deliveries] == [(key, msg)]
        for delivery in deliveries:
            await acknowledge(delivery)
        outcomes["accepted"] += 1

    @settings(
        max_examples=40,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    @given(msg=messages())
    def prop(msg: ScheduledMessage) -> None:
        runner.run(check(msg))

    prop()
    return outcomes


@pytest.mark.broker
def test_nats_round_trips_or_refuses(nats_url: str) -> None:
    tag = uuid.uuid4().hex[:10]
    stream, subject = f"STP_RT_{tag}", f"steeple.roundtrip.{tag}"
    with asyncio.Runner() as runner:
        broker = JetStreamBroker(nats_url, stream=stream, subject=subject, manage_stream=True)
        runner.run(broker.start())
        consumer = JetStreamConsumer(nats_url, stream=stream, durable="verify")

        async def count() -> int:
            assert broker._js is not None
            return int((await broker._js.stream_info(stream)).state.messages)

        async def cleanup() -> None:
            await consumer.close()
            await broker.close()
            nc = await nats.connect(nats_url)
            try:
                await nc.jetstream().delete_stream(stream)
            finally:
                await nc.close()

        try:
            outcomes = run_property(
                runner,
                lambda m, k: broker.publish(m, idempotency_key=k, timeout=5),
                lambda: consumer.fetch(10, wait=2),
                lambda d: consumer.acknowledge(d.delivery_id),
                count,
            )
            assert outcomes["accepted"] > 0
        finally:
            runner.run(cleanup())


@pytest.mark.broker
def test_rabbitmq_round_trips_or_refuses(amqp_url: str) -> None:
    name = f"steeple-roundtrip-{uuid.uuid4().hex[:12]}"
    with asyncio.Runner() as runner:

        async def setup() -> None:
            conn = await aio_pika.connect(amqp_url)
            async with conn:
                ch = await conn.channel()
                exchange = await ch.declare_exchange(name, aio_pika.ExchangeType.TOPIC)
                queue = await ch.declare_queue(name, durable=True)
                await queue.bind(exchange, "#")

        async def cleanup() -> None:
            await consumer.close()
            await broker.close()
            conn = await aio_pika.connect(amqp_url)
            async with conn:
                ch = await conn.channel()
                await ch.queue_delete(name)
                await ch.exchange_delete(name)

        runner.run(setup())
        broker = RabbitMQBroker(amqp_url, exchange=name)
        consumer = RabbitMQConsumer(amqp_url, queue=name)
        published = 0

        async def publish(msg: ScheduledMessage, key: str) -> None:
            nonlocal published
            await broker.publish(msg, idempotency_key=key, timeout=5)
            published += 1

        async def count() -> int:
            # A queue cannot be counted without racing the consumer: count what was sent.
            return published

        try:
            outcomes = run_property(
                runner,
                publish,
                lambda: consumer.fetch(10),
                lambda d: consumer.acknowledge(d.delivery_id),
                count,
            )
            # Long topics of "€"/"😀" exceed the 255-byte routing key: both ways are seen.
            assert outcomes["accepted"] > 0
            assert outcomes["refused"] > 0
        finally:
            runner.run(cleanup())


@pytest.mark.broker
def test_redis_round_trips_or_refuses(redis_url: str) -> None:
    stream = f"steeple-roundtrip:{uuid.uuid4().hex[:12]}"
    with asyncio.Runner() as runner:
        broker = RedisStreamBroker(redis_url, stream=stream)
        consumer = RedisStreamConsumer(redis_url, stream=stream, group="verify")
        client = aioredis.Redis.from_url(redis_url)

        async def count() -> int:
            return int(await client.xlen(stream))

        async def cleanup() -> None:
            await consumer.close()
            await broker.close()
            keys = [k async for k in client.scan_iter(match=f"{stream}*", count=500)]
            if keys:
                await client.delete(*keys)
            await client.aclose()

        try:
            outcomes = run_property(
                runner,
                lambda m, k: broker.publish(m, idempotency_key=k, timeout=5),
                lambda: consumer.fetch(10),
                lambda d: consumer.acknowledge(d.delivery_id),
                count,
            )
            assert outcomes["accepted"] > 0
        finally:
            runner.run(cleanup())


def test_sqlite_journal_round_trips_or_refuses(tmp_path: Path) -> None:
    with asyncio.Runner() as runner:
        journal = SqliteJournalBroker(
            tmp_path / "j.db",
            Keyring(StorageKey("roundtrip", bytes(range(32)))),
            max_message_bytes=limits.MAX_PAYLOAD_BYTES + 64 * 1024,
        )
        try:
            outcomes = run_property(
                runner,
                lambda m, k: journal.publish(m, idempotency_key=k, timeout=5),
                lambda: journal.fetch(10),
                lambda d: journal.acknowledge(d.delivery_id),
                journal.pending,
            )
            assert outcomes["accepted"] > 0
        finally:
            runner.run(journal.close())
