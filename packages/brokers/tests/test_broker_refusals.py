"""Messages a broker can never accept: refused before sending, dead-lettered at once.

For every adapter, each message its protocol refuses (too large on the wire, a routing key
or header the protocol cannot carry, text without a UTF-8 encoding) raises a permanent
``BrokerRejectedError`` before anything reaches the broker: the stream, queue, journal or
task table stays empty, and the client library's own counters show nothing was written.
Through the in-memory reference store, such a message is dead-lettered at its first
attempt (state ``dead``, ``attempts == 1``). Unexpected exceptions from a client library
are mapped to typed broker errors at the adapter boundary.

The machine's NATS, Redis, RabbitMQ and PostgreSQL are used for real; each test creates
its own stream, exchange and queue, or schema, and deletes it afterwards.
"""

from __future__ import annotations

import struct
import uuid
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import MappingProxyType
from typing import Any

import aio_pika
import asyncpg
import asyncpg.exceptions
import nats
import nats.js.errors
import pytest
import redis.asyncio as aioredis
from nats.js.api import StreamConfig

from broker_support import message, new_key
from nats_support import PrivateNats
from steeple.brokers._common import publish_guarded
from steeple.brokers.nats import MAX_HEADER_BYTES, JetStreamBroker, JetStreamConsumer, header_block
from steeple.brokers.queue import WorkQueueBroker
from steeple.brokers.rabbitmq import RabbitMQBroker
from steeple.brokers.redis import RedisStreamBroker, _map_response_error
from steeple.brokers.sqlite import SqliteJournalBroker
from steeple.core import (
    MissedRunPolicy,
    OccurrenceState,
    RecurringConfig,
    RecurringDefinition,
    RelayBrokerError,
)
from steeple.core.errors import (
    BrokerConfigurationError,
    BrokerError,
    BrokerRejectedError,
    BrokerUnavailableError,
    ConfigurationError,
    MessageTooLargeError,
    RelayAcknowledgementError,
)
from steeple.core.messages import BrokerReceipt, ScheduledMessage
from steeple.keyring import Keyring, StorageKey
from steeple.postgres.queue import install
from steeple.testing import FakeClock, InMemoryRecurringStore

EURO_TOPIC = "€" * 100  # 100 characters, 300 bytes of UTF-8
HUGE_HEADERS = {f"h{i:02}": "€" * 1024 for i in range(32)}  # ~197 KB as escaped JSON
START = datetime(2031, 5, 17, 9, 41, 27, tzinfo=UTC)


def forged(msg: ScheduledMessage, **fields: Any) -> ScheduledMessage:
    """A message carrying values ScheduledMessage refuses (as if a store skipped the checks)."""
    out = ScheduledMessage(msg.topic, msg.message_type, msg.payload, msg.headers)
    for name, value in fields.items():
        object.__setattr__(out, name, value)
    return out


SURROGATE_HEADER = MappingProxyType({"tenant": "t\ud800"})


async def dead_at_first_attempt(broker: Any, msg: ScheduledMessage) -> None:
    """Relay ``msg`` once through the in-memory reference store: it must end dead, 1 attempt."""
    clock = FakeClock(START)
    store = InMemoryRecurringStore(RecurringConfig("refusals", 10, 100), clock)
    definition = RecurringDefinition(
        "refused", "* * * * *", START - timedelta(seconds=90), MissedRunPolicy.CATCH_UP, msg
    )
    await store.create(definition)
    assert (await store.tick(1)).materialized == 1
    (lease,) = await store.claim(1)
    with pytest.raises(RelayBrokerError) as caught:
        await store.relay(lease, broker)
    assert caught.value.permanent is True
    assert isinstance(caught.value.__cause__, BrokerRejectedError)
    (info,) = (await store.occurrences()).items
    assert info.state is OccurrenceState.DEAD
    assert info.attempts == 1
    await store.close()


# --- NATS JetStream ----------------------------------------------------------------------


def _nats_names() -> tuple[str, str]:
    tag = uuid.uuid4().hex[:10]
    return f"STP_REF_{tag}", f"steeple.refusals.{tag}"


async def _stream_messages(url: str, stream: str) -> int:
    nc = await nats.connect(url, connect_timeout=3, max_reconnect_attempts=1)
    try:
        info = await nc.jetstream().stream_info(stream)
        return int(info.state.messages)
    finally:
        await nc.close()


async def _delete_stream(url: str, stream: str) -> None:
    nc = await nats.connect(url, connect_timeout=3, max_reconnect_attempts=1)
    try:
        await nc.jetstream().delete_stream(stream)
    except nats.js.errors.NotFoundError:
        pass
    finally:
        await nc.close()


@pytest.fixture
async def nats_broker(nats_url: str) -> AsyncIterator[JetStreamBroker]:
    stream, subject = _nats_names()
    broker = JetStreamBroker(nats_url, stream=stream, subject=subject, manage_stream=True)
    try:
        await broker.start()
        yield broker
    finally:
        await broker.close()
        await _delete_stream(nats_url, stream)


def _nats_sent(broker: JetStreamBroker) -> int:
    nc = broker._nc
    assert nc is not None
    return int(nc.stats["out_msgs"])


@pytest.mark.broker
async def test_nats_headers_over_64_kib_refused_before_sending(
    nats_url: str, nats_broker: JetStreamBroker
) -> None:
    msg = ScheduledMessage("reminders", "reminder.requested", b"x", HUGE_HEADERS)
    sent = _nats_sent(nats_broker)
    with pytest.raises(MessageTooLargeError, match="64 KiB") as caught:
        await nats_broker.publish(msg, idempotency_key=new_key(), timeout=5)
    assert caught.value.permanent is True
    assert _nats_sent(nats_broker) == sent  # nothing was written to the connection
    assert await _stream_messages(nats_url, nats_broker._stream) == 0
    await dead_at_first_attempt(nats_broker, msg)
    assert await _stream_messages(nats_url, nats_broker._stream) == 0


def _headers_of_block_size(broker: JetStreamBroker, key: str, target: int) -> dict[str, str]:
    """Message headers whose NATS header block is exactly ``target`` bytes.

    In the headers' JSON, "😀" travels as a 12-byte surrogate-pair escape, "€" as a
    6-byte escape and "a" as 1 byte.
    """
    headers: dict[str, str] = {}

    def size(extra: dict[str, str]) -> int:
        msg = ScheduledMessage("t", "m", b"", {**headers, **extra})
        return len(header_block(broker._headers(msg, key)))

    while size({f"h{len(headers):02}": "😀" * 1024}) < target:
        headers[f"h{len(headers):02}"] = "😀" * 1024
    last = f"h{len(headers):02}"
    twelves, rest = divmod(target - size({last: ""}), 12)
    sixes, ones = divmod(rest, 6)
    headers[last] = "😀" * twelves + "€" * sixes + "a" * ones
    assert size({}) == target
    return headers


@pytest.mark.broker
async def test_nats_header_block_is_measured_exactly(nats_url: str) -> None:
    """A block of exactly 65535 bytes is accepted by the server; one more byte is refused."""
    stream, subject = _nats_names()
    async with JetStreamBroker(
        nats_url, stream=stream, subject=subject, manage_stream=True
    ) as broker:
        try:
            key = new_key()
            fits = ScheduledMessage(
                "t", "m", b"", _headers_of_block_size(broker, key, MAX_HEADER_BYTES)
            )
            receipt = await broker.publish(fits, idempotency_key=key, timeout=5)
            assert receipt.duplicate is False
            other = new_key()
            over = ScheduledMessage(
                "t", "m", b"", _headers_of_block_size(broker, other, MAX_HEADER_BYTES + 1)
            )
            with pytest.raises(MessageTooLargeError):
                await broker.publish(over, idempotency_key=other, timeout=5)
            assert await _stream_messages(nats_url, stream) == 1
        finally:
            await _delete_stream(nats_url, stream)


@pytest.fixture
def private_nats(tmp_path: Path) -> Iterator[PrivateNats]:
    server = PrivateNats(tmp_path, max_payload=4096)
    server.start()
    try:
        yield server
    finally:
        server.kill()


@pytest.mark.broker
async def test_nats_headers_plus_payload_over_max_payload_refused_before_sending(
    private_nats: PrivateNats,
) -> None:
    """The payload alone fits max_payload; with its headers it does not.

    The server would close the whole connection ("Maximum Payload Violation"), which the
    relay saw as a timeout, retrying ten times. Now: a permanent refusal, nothing sent, and
    the connection stays up.
    """
    stream, subject = _nats_names()
    async with JetStreamBroker(
        private_nats.url, stream=stream, subject=subject, manage_stream=True
    ) as broker:
        msg = message(1, size=3900)
        assert len(msg.payload) < 4096
        sent = _nats_sent(broker)
        with pytest.raises(MessageTooLargeError, match="4096") as caught:
            await broker.publish(msg, idempotency_key=new_key(), timeout=5)
        assert caught.value.permanent is True
        assert _nats_sent(broker) == sent
        nc = broker._nc
        assert nc is not None
        # Still the same, healthy connection: a message that fits goes through on it.
        assert await broker.publish(message(2), idempotency_key=new_key(), timeout=5)
        assert nc.is_connected
        assert nc.stats["reconnects"] == 0
        assert broker._nc is nc
        assert await _stream_messages(private_nats.url, stream) == 1


@pytest.mark.broker
async def test_nats_stream_max_msg_size_counts_the_headers(nats_url: str) -> None:
    stream, subject = _nats_names()
    nc = await nats.connect(nats_url)
    try:
        await nc.jetstream().add_stream(
            StreamConfig(name=stream, subjects=[subject], max_msg_size=2048, duplicate_window=86400)
        )
    finally:
        await nc.close()
    try:
        async with JetStreamBroker(nats_url, stream=stream, subject=subject) as broker:
            # 1848 + the ~330 bytes of headers > 2048, though the payload alone fits.
            msg = message(3, size=1848)
            sent = _nats_sent(broker)
            with pytest.raises(MessageTooLargeError, match="2048"):
                await broker.publish(msg, idempotency_key=new_key(), timeout=5)
            assert _nats_sent(broker) == sent
            assert await _stream_messages(nats_url, stream) == 0
    finally:
        await _delete_stream(nats_url, stream)


@pytest.mark.broker
async def test_nats_lone_surrogate_header_refused_before_sending(
    nats_url: str, nats_broker: JetStreamBroker
) -> None:
    sent = _nats_sent(nats_broker)
    with pytest.raises(BrokerRejectedError, match="lone surrogate"):
        await nats_broker.publish(
            forged(message(), headers=SURROGATE_HEADER), idempotency_key=new_key(), timeout=5
        )
    with pytest.raises(BrokerRejectedError, match="lone surrogate"):
        await nats_broker.publish(
            forged(message(), topic="t\udc80"), idempotency_key=new_key(), timeout=5
        )
    assert _nats_sent(nats_broker) == sent
    assert await _stream_messages(nats_url, nats_broker._stream) == 0


@pytest.mark.broker
async def test_nats_carries_non_ascii_topics_unchanged(
    nats_url: str, nats_broker: JetStreamBroker
) -> None:
    """The server does not refuse UTF-8 header values, and consumers read them back exactly."""
    msg = ScheduledMessage("commandes.été", "facture.émise €", b"{}", {"région": "Île-de-France"})
    key = new_key()
    await nats_broker.publish(msg, idempotency_key=key, timeout=5)
    consumer = JetStreamConsumer(nats_url, stream=nats_broker._stream, durable="verify")
    try:
        (delivery,) = await consumer.fetch(10, wait=2)
        assert delivery.message == msg
        assert delivery.idempotency_key == key
    finally:
        await consumer.close()


@pytest.mark.parametrize(
    "subject",
    [
        "has space",
        "tab\there",
        "line\nbreak",
        "orders.*",
        "orders.>",
        "orders.a*b",
        "orders..daily",
        ".orders",
        "orders.",
        "a." * 600 + "b",  # over 1024 bytes
        "orders.\ud800",
        "nul\x00",
    ],
)
def test_nats_subjects_the_server_refuses_are_configuration_errors(subject: str) -> None:
    with pytest.raises(ConfigurationError):
        JetStreamBroker("nats://127.0.0.1:4222", stream="S", subject=subject)


# --- RabbitMQ ----------------------------------------------------------------------------


class RabbitTopology:
    """A topic exchange bound with '#' to a durable queue: every routing key lands there."""

    def __init__(self, url: str) -> None:
        tag = uuid.uuid4().hex[:12]
        self.url = url
        self.exchange = f"steeple-refusals-{tag}"
        self.queue = f"steeple-refusals-{tag}"

    async def create(self) -> None:
        conn = await aio_pika.connect(self.url)
        async with conn:
            ch = await conn.channel()
            exchange = await ch.declare_exchange(self.exchange, aio_pika.ExchangeType.TOPIC)
            queue = await ch.declare_queue(self.queue, durable=True)
            await queue.bind(exchange, "#")

    async def depth(self) -> int:
        conn = await aio_pika.connect(self.url)
        async with conn:
            ch = await conn.channel()
            queue = await ch.declare_queue(self.queue, passive=True)
            return int(queue.declaration_result.message_count or 0)

    async def delete(self) -> None:
        conn = await aio_pika.connect(self.url)
        async with conn:
            ch = await conn.channel()
            await ch.queue_delete(self.queue)
            await ch.exchange_delete(self.exchange)


@pytest.fixture
async def rabbit(amqp_url: str) -> AsyncIterator[tuple[RabbitMQBroker, RabbitTopology]]:
    topology = RabbitTopology(amqp_url)
    await topology.create()
    broker = RabbitMQBroker(amqp_url, exchange=topology.exchange)
    try:
        await broker.start()
        yield broker, topology
    finally:
        await broker.close()
        await topology.delete()


@pytest.mark.broker
async def test_rabbitmq_routing_key_over_255_bytes_refused_before_sending(
    rabbit: tuple[RabbitMQBroker, RabbitTopology],
) -> None:
    broker, topology = rabbit
    msg = ScheduledMessage(EURO_TOPIC, "invoice.due", b"{}")
    assert len(msg.topic) == 100
    with pytest.raises(BrokerRejectedError, match="300 bytes") as caught:
        await broker.publish(msg, idempotency_key=new_key(), timeout=5)
    assert caught.value.permanent is True
    # A key that fits routes to the queue: the refusal was about the key only.
    await broker.publish(
        ScheduledMessage("€" * 85, "invoice.due", b"{}"), idempotency_key=new_key(), timeout=5
    )
    assert await topology.depth() == 1
    await dead_at_first_attempt(broker, msg)
    assert await topology.depth() == 1


@pytest.mark.broker
async def test_rabbitmq_message_type_over_255_bytes_refused_before_sending(
    rabbit: tuple[RabbitMQBroker, RabbitTopology],
) -> None:
    broker, topology = rabbit
    msg = ScheduledMessage("orders", "é" * 200, b"{}")
    with pytest.raises(BrokerRejectedError, match="message type"):
        await broker.publish(msg, idempotency_key=new_key(), timeout=5)
    assert await topology.depth() == 0
    await dead_at_first_attempt(broker, msg)
    assert await topology.depth() == 0


@pytest.mark.broker
async def test_rabbitmq_headers_over_frame_max_refused_and_connection_kept(
    rabbit: tuple[RabbitMQBroker, RabbitTopology],
) -> None:
    """RabbitMQ closes the whole connection on a content header over frame_max."""
    broker, topology = rabbit
    msg = ScheduledMessage("orders", "invoice.due", b"{}", HUGE_HEADERS)
    connection = broker._connection
    with pytest.raises(MessageTooLargeError, match="frame_max") as caught:
        await broker.publish(msg, idempotency_key=new_key(), timeout=5)
    assert caught.value.permanent is True
    assert broker._connection is connection
    assert not connection.is_closed
    await broker.publish(message(), idempotency_key=new_key(), timeout=5)
    assert broker._connection is connection
    assert await topology.depth() == 1


@pytest.mark.broker
async def test_rabbitmq_lone_surrogate_refused_before_sending(
    rabbit: tuple[RabbitMQBroker, RabbitTopology],
) -> None:
    broker, topology = rabbit
    for bad in (forged(message(), headers=SURROGATE_HEADER), forged(message(), topic="\ud800")):
        with pytest.raises(BrokerRejectedError, match="lone surrogate"):
            await broker.publish(bad, idempotency_key=new_key(), timeout=5)
    assert await topology.depth() == 0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"exchange": "€" * 86},  # 258 bytes
        {"routing_key": "€" * 86},
        {"routing_key": "\ud800"},
        {"exchange": 7},
    ],
)
def test_rabbitmq_names_over_255_bytes_are_configuration_errors(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigurationError):
        RabbitMQBroker("amqp://guest:guest@127.0.0.1:5672/", **kwargs)


# --- Redis Streams -----------------------------------------------------------------------


@pytest.fixture
async def redis_stream(redis_url: str) -> AsyncIterator[str]:
    stream = f"steeple-refusals:{uuid.uuid4().hex[:12]}"
    try:
        yield stream
    finally:
        client = aioredis.Redis.from_url(redis_url)
        try:
            keys = [k async for k in client.scan_iter(match=f"{stream}*", count=500)]
            if keys:
                await client.delete(*keys)
        finally:
            await client.aclose()


async def _redis_state(url: str, stream: str) -> tuple[int, int]:
    """(entries in the stream, dedup markers)."""
    client = aioredis.Redis.from_url(url)
    try:
        entries = int(await client.xlen(stream))
        markers = len([k async for k in client.scan_iter(match=f"{stream}:dedup:*")])
        return entries, markers
    finally:
        await client.aclose()


@pytest.mark.broker
async def test_redis_size_is_counted_in_bytes_before_sending(
    redis_url: str, redis_stream: str
) -> None:
    # 340 characters of headers, but 2,040 bytes as the JSON the entry carries.
    msg = ScheduledMessage("orders", "invoice.due", b"", {"h": "€" * 340})
    async with RedisStreamBroker(redis_url, stream=redis_stream, max_message_bytes=2000) as broker:
        with pytest.raises(MessageTooLargeError, match="2000") as caught:
            await broker.publish(msg, idempotency_key=new_key(), timeout=5)
        assert caught.value.permanent is True
        assert await _redis_state(redis_url, redis_stream) == (0, 0)
        await dead_at_first_attempt(broker, msg)
        assert await _redis_state(redis_url, redis_stream) == (0, 0)


@pytest.mark.broker
async def test_redis_lone_surrogate_refused_before_sending(
    redis_url: str, redis_stream: str
) -> None:
    async with RedisStreamBroker(redis_url, stream=redis_stream) as broker:
        for bad in (forged(message(), headers=SURROGATE_HEADER), forged(message(), topic="\ud800")):
            with pytest.raises(BrokerRejectedError, match="lone surrogate"):
                await broker.publish(bad, idempotency_key=new_key(), timeout=5)
        assert await _redis_state(redis_url, redis_stream) == (0, 0)


def test_redis_state_errors_are_transient_message_errors_permanent() -> None:
    import redis.exceptions as rexc

    busy = _map_response_error(rexc.ResponseError("BUSY Redis is busy running a script"))
    assert isinstance(busy, BrokerUnavailableError)
    assert not busy.permanent
    misconf = _map_response_error(rexc.ResponseError("MISCONF Errors writing the RDB"))
    assert isinstance(misconf, BrokerUnavailableError)
    refused = _map_response_error(rexc.ResponseError("ERR Protocol error: invalid bulk length"))
    assert isinstance(refused, BrokerRejectedError)
    assert refused.permanent


def test_redis_dedup_prefix_must_be_sendable() -> None:
    with pytest.raises(ConfigurationError):
        RedisStreamBroker("redis://127.0.0.1:6379/0", stream="s", dedup_prefix="p\ud800:")


# --- the work queue ----------------------------------------------------------------------


@pytest.fixture
async def queue_schema(pg_schema: tuple[str, str]) -> tuple[str, str]:
    dsn, schema = pg_schema
    conn = await asyncpg.connect(dsn)
    try:
        await install(conn, schema=schema)
    finally:
        await conn.close()
    await WorkQueueBroker(dsn, schema=schema).install()
    return dsn, schema


async def _queue_rows(dsn: str, schema: str) -> tuple[int, int]:
    """(tasks, ledger keys)."""
    conn = await asyncpg.connect(dsn)
    try:
        tasks = await conn.fetchval(f'SELECT count(*) FROM "{schema}".tasks')
        keys = await conn.fetchval(f'SELECT count(*) FROM "{schema}".broker_dedup')
        return int(tasks), int(keys)
    finally:
        await conn.close()


UNREACHABLE_DSN = "postgresql://nobody@127.0.0.1:9/nowhere"  # port 9 (discard): no server


@pytest.mark.postgres
@pytest.mark.parametrize(
    "msg",
    [
        forged(message(), headers=SURROGATE_HEADER),
        forged(message(), topic="caf\udce9"),
        ScheduledMessage("orders", "t" * 201, b"{}"),  # a valid type, but no valid task name
    ],
    ids=["surrogate-header", "surrogate-topic", "task-name-too-long"],
)
async def test_work_queue_refuses_before_connecting(
    queue_schema: tuple[str, str], msg: ScheduledMessage
) -> None:
    dsn, schema = queue_schema
    # Refused without even trying the (unreachable) database.
    nowhere = WorkQueueBroker(UNREACHABLE_DSN, schema=schema, connect_timeout=1.0)
    with pytest.raises(BrokerRejectedError) as caught:
        await nowhere.publish(msg, idempotency_key=new_key(), timeout=3)
    assert caught.value.permanent is True
    broker = WorkQueueBroker(dsn, schema=schema)
    with pytest.raises(BrokerRejectedError):
        await broker.publish(msg, idempotency_key=new_key(), timeout=5)
    assert await _queue_rows(dsn, schema) == (0, 0)


@pytest.mark.postgres
async def test_work_queue_task_name_callback_failure_is_permanent(
    queue_schema: tuple[str, str],
) -> None:
    dsn, schema = queue_schema

    def task_name(msg: ScheduledMessage) -> str:
        raise KeyError(msg.message_type)

    broker = WorkQueueBroker(dsn, schema=schema, task_name=task_name)
    with pytest.raises(BrokerRejectedError, match="task_name"):
        await broker.publish(message(), idempotency_key=new_key(), timeout=5)
    assert await _queue_rows(dsn, schema) == (0, 0)


@pytest.mark.postgres
async def test_work_queue_unsendable_message_is_dead_at_first_attempt(
    queue_schema: tuple[str, str],
) -> None:
    dsn, schema = queue_schema
    broker = WorkQueueBroker(dsn, schema=schema)
    await dead_at_first_attempt(broker, ScheduledMessage("orders", "t" * 250, b"{}"))
    assert await _queue_rows(dsn, schema) == (0, 0)


def test_work_queue_database_errors_are_classified_by_sqlstate() -> None:
    from steeple.brokers.queue import _map_postgres_error

    untranslatable = asyncpg.exceptions.UntranslatableCharacterError("no LATIN1 form")
    assert isinstance(_map_postgres_error(untranslatable), BrokerRejectedError)
    too_big = asyncpg.exceptions.ProgramLimitExceededError("index row size exceeds")
    assert _map_postgres_error(too_big).permanent is True
    denied = asyncpg.exceptions.InsufficientPrivilegeError("permission denied")
    assert isinstance(_map_postgres_error(denied), BrokerConfigurationError)
    deadlock = asyncpg.exceptions.DeadlockDetectedError("deadlock detected")
    assert isinstance(_map_postgres_error(deadlock), BrokerUnavailableError)
    assert _map_postgres_error(deadlock).permanent is False


# --- the SQLite journal ------------------------------------------------------------------

KEY = StorageKey("refusals", bytes(range(32)))


async def test_sqlite_journal_refuses_what_no_consumer_could_read(tmp_path: Path) -> None:
    """Its JSON would escape a lone surrogate and store it; every fetch would then fail."""
    async with SqliteJournalBroker(tmp_path / "j.db", Keyring(KEY)) as journal:
        for bad in (forged(message(), headers=SURROGATE_HEADER), forged(message(), topic="\ud800")):
            with pytest.raises(BrokerRejectedError, match="lone surrogate"):
                await journal.publish(bad, idempotency_key=new_key(), timeout=5)
        assert await journal.pending() == 0


async def test_sqlite_journal_size_is_counted_in_bytes(tmp_path: Path) -> None:
    msg = ScheduledMessage("orders", "invoice.due", b"", {"h": "€" * 340})
    async with SqliteJournalBroker(
        tmp_path / "j.db", Keyring(KEY), max_message_bytes=2000
    ) as journal:
        with pytest.raises(MessageTooLargeError):
            await journal.publish(msg, idempotency_key=new_key(), timeout=5)
        assert await journal.pending() == 0
        await dead_at_first_attempt(journal, msg)
        assert await journal.pending() == 0


# --- unexpected exceptions from client libraries -----------------------------------------

UNEXPECTED = [
    TypeError("unexpected type"),
    UnicodeEncodeError("utf-8", "\ud800", 0, 1, "surrogates not allowed"),
    struct.error("argument out of range"),
    ValueError("bad value"),
    OverflowError("too big"),
]


async def _raising(exc: BaseException) -> Any:
    raise exc


def _patch_client_call(
    monkeypatch: pytest.MonkeyPatch, target: Any, name: str, exc: Exception
) -> None:
    async def fail(*_args: Any, **_kwargs: Any) -> Any:
        raise exc

    monkeypatch.setattr(target, name, fail)


@pytest.mark.parametrize("exc", UNEXPECTED, ids=lambda e: type(e).__name__)
async def test_unexpected_encoding_errors_become_permanent_refusals(exc: Exception) -> None:
    async def nothing_found() -> BrokerReceipt | None:
        return None

    with pytest.raises(BrokerRejectedError) as caught:
        await publish_guarded(
            broker="x", key="k", timeout=2, transmit=lambda: _raising(exc), probe=nothing_found
        )
    assert caught.value.permanent is True
    assert caught.value.__cause__ is exc


async def test_unexpected_errors_are_typed_and_probed() -> None:
    receipt = BrokerReceipt("x", "k", duplicate=True)

    async def found() -> BrokerReceipt | None:
        return receipt

    async def nothing_found() -> BrokerReceipt | None:
        return None

    # The broker holds the key after all: the acknowledgement was what failed.
    with pytest.raises(RelayAcknowledgementError) as acknowledged:
        await publish_guarded(
            broker="x", key="k", timeout=2, transmit=lambda: _raising(TypeError()), probe=found
        )
    assert acknowledged.value.receipt is receipt
    # Not an encoding error: typed, and retryable.
    with pytest.raises(BrokerError) as other:
        await publish_guarded(
            broker="x",
            key="k",
            timeout=2,
            transmit=lambda: _raising(RuntimeError("boom")),
            probe=nothing_found,
        )
    assert other.value.permanent is False
    # Connecting refused the settings: a configuration error, nothing was sent.
    with pytest.raises(BrokerConfigurationError):
        await publish_guarded(
            broker="x",
            key="k",
            timeout=2,
            prepare=lambda: _raising(ValueError("bad port")),
            transmit=lambda: _raising(AssertionError("not reached")),
            probe=nothing_found,
        )


@pytest.mark.broker
@pytest.mark.parametrize("exc", UNEXPECTED, ids=lambda e: type(e).__name__)
async def test_each_adapter_maps_unexpected_client_errors(
    exc: Exception,
    monkeypatch: pytest.MonkeyPatch,
    nats_broker: JetStreamBroker,
    rabbit: tuple[RabbitMQBroker, RabbitTopology],
    redis_url: str,
    redis_stream: str,
    tmp_path: Path,
) -> None:
    """The client call itself raises: each adapter turns it into a permanent refusal."""
    # NATS: the JetStream publish call (the probe finds nothing under a fresh key).
    assert nats_broker._js is not None
    _patch_client_call(monkeypatch, nats_broker._js, "publish", exc)
    with pytest.raises(BrokerRejectedError):
        await nats_broker.publish(message(), idempotency_key=new_key(), timeout=3)
    # RabbitMQ: the exchange's publish.
    broker, _topology = rabbit
    _patch_client_call(monkeypatch, broker._exchange, "publish", exc)
    with pytest.raises(BrokerRejectedError):
        await broker.publish(message(), idempotency_key=new_key(), timeout=3)
    # Redis: the script call.
    async with RedisStreamBroker(redis_url, stream=redis_stream) as redis_broker:
        _patch_client_call(monkeypatch, redis_broker, "_script", exc)
        with pytest.raises(BrokerRejectedError):
            await redis_broker.publish(message(), idempotency_key=new_key(), timeout=3)
    # SQLite: the write on the journal's thread.
    async with SqliteJournalBroker(tmp_path / "j.db", Keyring(KEY)) as journal:

        def fail_sync(*_args: Any) -> BrokerReceipt:
            raise exc

        monkeypatch.setattr(journal, "_append_sync", fail_sync)
        with pytest.raises(BrokerRejectedError):
            await journal.publish(message(), idempotency_key=new_key(), timeout=3)


@pytest.mark.postgres
@pytest.mark.parametrize("exc", UNEXPECTED[:3], ids=lambda e: type(e).__name__)
async def test_work_queue_maps_unexpected_client_errors(
    exc: Exception, monkeypatch: pytest.MonkeyPatch, queue_schema: tuple[str, str]
) -> None:
    import steeple.brokers.queue as queue_module

    dsn, schema = queue_schema
    _patch_client_call(monkeypatch, queue_module, "enqueue", exc)
    broker = WorkQueueBroker(dsn, schema=schema)
    with pytest.raises(BrokerRejectedError):
        await broker.publish(message(), idempotency_key=new_key(), timeout=5)
    assert await _queue_rows(dsn, schema) == (0, 0)
