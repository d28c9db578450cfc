"""RabbitMQ (extra ``steeple-brokers[rabbitmq]``): confirms, mandatory routing, and the gap.

The adapter publishes persistent messages (``delivery_mode=2``) with ``mandatory=True`` on a
channel with publisher confirms, and waits for the broker's confirm: an unroutable message
comes back (``basic.return``) and is a :class:`~steeple.core.errors.BrokerRejectedError`,
never a silent drop. ``message_id`` is the idempotency key.

**The gap, honestly.** RabbitMQ queues do not deduplicate. A relay whose confirm was lost
republishes under the same key and the queue then holds two copies; nothing on the broker
side can prevent it. Deduplication is therefore the consumer's job: :class:`DedupingConsumer`
drops a message whose ``message_id`` it has already processed, remembering keys in a
bounded :class:`SeenStore` for a TTL that must cover the delivery window.
:class:`SqliteSeenStore` survives consumer restarts; :class:`MemorySeenStore` does not, and
evicts the oldest keys beyond ``max_entries``. A consumer that crashes after its handler's
effect but before recording the key will see the message again: make the effect and the
record one transaction where that matters (the seed: consumers deduplicate external
effects at the destination).
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import struct
import time
from collections import OrderedDict
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

import aio_pika
import aio_pika.exceptions as apx
import aiormq.exceptions
from pamqp.header import ContentHeader

from steeple.brokers._common import (
    HEADER_HEADERS,
    HEADER_KEY,
    HEADER_TOPIC,
    HEADER_TYPE,
    AckUncertainError,
    AsyncLifecycle,
    Delivery,
    check_key,
    check_message,
    check_size,
    check_timeout,
    check_utf8_length,
    decode_headers,
    encoded_size,
    header_map,
    positive_duration,
    publish_guarded,
    redact_url,
)
from steeple.core import limits
from steeple.core.errors import (
    BrokerConfigurationError,
    BrokerRejectedError,
    BrokerTimeoutError,
    BrokerUnavailableError,
    ConfigurationError,
    MessageTooLargeError,
)
from steeple.core.messages import BrokerReceipt, ScheduledMessage

__all__ = [
    "DedupingConsumer",
    "MemorySeenStore",
    "RabbitMQBroker",
    "RabbitMQConsumer",
    "SeenStore",
    "SqliteSeenStore",
]

_MAX_MESSAGE_BYTES = 1024 * 1024
_CLOSE_GRACE = 1.0
_STALE_GRACE = 0.2

SHORTSTR_BYTES = 255
"""AMQP 0-9-1 ``shortstr`` (exchange names, routing keys, the ``type`` property...): a
one-octet length, so at most 255 bytes of UTF-8 (``100 * "€"`` is 300 bytes)."""
DEFAULT_FRAME_MAX = 131072
"""RabbitMQ's default ``frame_max``, used until the connection has negotiated its own."""
_FRAME_OVERHEAD = 8
"""Frame type (1), channel (2), size (4) and frame-end (1) octets around a frame payload."""


def _shortstr(value: object, what: str) -> bytes:
    return check_utf8_length(value, SHORTSTR_BYTES, what, "rabbitmq", "AMQP 0-9-1 (shortstr)")


async def _connect(url: str, timeout: float, name: str) -> Any:
    try:
        async with asyncio.timeout(timeout):
            return await aio_pika.connect(
                url, timeout=timeout, client_properties={"connection_name": name}
            )
    except TimeoutError:
        raise BrokerTimeoutError(
            f"rabbitmq: connecting to {redact_url(url)} took longer than {timeout:g} s"
        ) from None
    except (apx.AMQPError, OSError, ConnectionError) as exc:
        raise BrokerUnavailableError(
            f"rabbitmq: cannot connect to {redact_url(url)} ({type(exc).__name__})"
        ) from None
    except (ValueError, TypeError, KeyError) as exc:
        # The client refused the URL or its options before connecting: nothing to retry.
        raise BrokerConfigurationError(
            f"rabbitmq: the client refused the URL {redact_url(url)} ({type(exc).__name__})"
        ) from None


async def _close_quietly(connection: Any, grace: float = _CLOSE_GRACE) -> None:
    if connection is None:
        return
    # A stalled or broken connection must not hold up the caller.
    with contextlib.suppress(Exception):
        async with asyncio.timeout(grace):
            await connection.close()


class RabbitMQBroker(AsyncLifecycle):
    """Publishes persistent, mandatory messages with publisher confirms.

    Args:
        url: ``amqp://`` or ``amqps://`` URL (credentials in it are never shown).
        exchange: the exchange (``""`` = the default exchange, routing by queue name).
        routing_key: fixed routing key; ``None`` routes by the message's topic.
        max_message_bytes: refuse larger messages for good.
        connect_timeout: seconds allowed to connect.

    Raises:
        ConfigurationError: invalid arguments.
    """

    def __init__(
        self,
        url: str,
        *,
        exchange: str = "",
        routing_key: str | None = None,
        max_message_bytes: int = _MAX_MESSAGE_BYTES,
        connect_timeout: float = 5.0,
    ) -> None:
        if not isinstance(url, str) or not url:
            raise ConfigurationError("url must be a non-empty str")
        for what, value in (("exchange", exchange), ("routing_key", routing_key)):
            if value is None and what == "routing_key":
                continue
            if not isinstance(value, str):
                raise ConfigurationError(f"{what} must be a str")
            try:
                _shortstr(value, what)
            except BrokerRejectedError as exc:
                raise ConfigurationError(str(exc)) from None
        if (
            isinstance(max_message_bytes, bool)
            or not isinstance(max_message_bytes, int)
            or (max_message_bytes < 1)
        ):
            raise ConfigurationError("max_message_bytes must be a positive int")
        self._url = url
        self._exchange_name = exchange
        self._routing_key = routing_key
        self._max_bytes = max_message_bytes
        self._connect_timeout = check_timeout(connect_timeout)
        self._connection: Any = None
        self._channel: Any = None
        self._exchange: Any = None
        self._closed = False
        self._lock = asyncio.Lock()
        self._stale: list[Any] = []

    def __repr__(self) -> str:
        return (
            f"RabbitMQBroker(url={redact_url(self._url)!r}, exchange={self._exchange_name!r}, "
            f"routing_key={self._routing_key!r})"
        )

    @classmethod
    async def connect(cls, url: str, **kwargs: Any) -> RabbitMQBroker:
        """Build and start a broker (see the class for the arguments).

        Raises:
            BrokerUnavailableError: the server cannot be reached.
            BrokerConfigurationError: the exchange does not exist.
        """
        broker = cls(url, **kwargs)
        await broker.start()
        return broker

    async def start(self) -> None:
        """Connect, open a confirming channel and find the exchange. Idempotent.

        Raises:
            BrokerUnavailableError: the server cannot be reached or refuses the login.
            BrokerTimeoutError: the server did not answer in time.
            BrokerConfigurationError: the named exchange does not exist.
        """
        if self._closed:
            raise BrokerUnavailableError("rabbitmq: this broker was closed")
        async with self._lock:
            if self._exchange is not None and not self._channel.is_closed:
                return
            await self._drop()
            connection = await _connect(self._url, self._connect_timeout, "steeple-publisher")
            try:
                channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
                if self._exchange_name:
                    exchange = await channel.get_exchange(self._exchange_name, ensure=True)
                else:
                    exchange = channel.default_exchange
            except apx.ChannelNotFoundEntity:
                await _close_quietly(connection)
                raise BrokerConfigurationError(
                    f"rabbitmq: exchange {self._exchange_name!r} does not exist; declare it"
                ) from None
            except (apx.AMQPError, OSError, ConnectionError) as exc:
                await _close_quietly(connection)
                raise BrokerUnavailableError(
                    f"rabbitmq: cannot open a channel ({type(exc).__name__})"
                ) from None
            self._connection, self._channel, self._exchange = connection, channel, exchange

    async def _drop(self) -> None:
        self._abandon()
        await self._close_stale()

    def _abandon(self) -> None:
        if self._connection is not None:
            self._stale.append(self._connection)
        self._connection = self._channel = self._exchange = None

    async def _close_stale(self) -> None:
        stale, self._stale = self._stale, []
        for connection in stale:
            await _close_quietly(connection, grace=_STALE_GRACE)

    async def close(self) -> None:
        """Close the connection. Idempotent."""
        self._closed = True
        await self._drop()

    async def publish(
        self, message: ScheduledMessage, *, idempotency_key: str, timeout: float
    ) -> BrokerReceipt:
        """Publish persistently and wait for the broker's confirm.

        RabbitMQ cannot deduplicate: the receipt's ``duplicate`` is always False, and a
        republication after a lost confirm can put a second copy in the queue (consumers
        deduplicate on ``message_id``; see :class:`DedupingConsumer`).

        Before anything is sent, the routing key (the topic, unless a fixed one is
        configured) and the message type must fit AMQP's 255-byte ``shortstr``, and the
        content header frame (the properties, headers included) the connection's
        ``frame_max``: RabbitMQ closes the whole connection on a larger frame.

        Raises:
            ConfigurationError: a bad key or timeout, or not a ScheduledMessage.
            MessageTooLargeError: over ``max_message_bytes``, the frame limit or the
                server's limit (permanent).
            BrokerRejectedError: a routing key or message type over 255 bytes, or a value
                AMQP cannot encode, refused before sending; or unroutable (returned by the
                broker) or refused (permanent).
            BrokerConfigurationError: the exchange does not exist.
            BrokerUnavailableError: the server is unreachable, or it nacked the message.
            BrokerTimeoutError: no confirm in time; the queue may hold the message.
        """
        key = check_key(idempotency_key)
        seconds = check_timeout(timeout)
        check_message(message, "rabbitmq")
        check_size(encoded_size(message, key), self._max_bytes, "the rabbitmq adapter")
        routing_key = self._routing_key if self._routing_key is not None else message.topic
        _shortstr(routing_key, "the routing key (the message's topic)")
        _shortstr(message.message_type, "the message type (the AMQP type property)")
        try:
            amqp_message = aio_pika.Message(
                body=message.payload,
                message_id=key,
                type=message.message_type,
                delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                content_type="application/octet-stream",
                headers=dict(header_map(message, key)),
            )
        except (TypeError, ValueError) as exc:
            raise BrokerRejectedError(f"rabbitmq: the client refused the message ({exc})") from None
        header_size = self._content_header_size(amqp_message)

        async def prepare() -> None:
            await self.start()
            limit = self._frame_max()
            if limit and header_size + _FRAME_OVERHEAD > limit:
                raise MessageTooLargeError(
                    f"rabbitmq: the message's properties and headers take {header_size} "
                    f"bytes, over the connection's frame_max ({limit} bytes with framing); "
                    "RabbitMQ would close the connection: shorten the headers",
                    size=header_size,
                    limit=limit - _FRAME_OVERHEAD,
                )

        async def no_probe() -> BrokerReceipt | None:
            # A queue cannot be searched by message_id: a lost confirm stays uncertain.
            return None

        try:
            return await publish_guarded(
                prepare=prepare,
                broker="rabbitmq",
                key=key,
                timeout=seconds,
                transmit=lambda: self._transmit(amqp_message, routing_key, key),
                probe=no_probe,
            )
        except BrokerTimeoutError:
            # The channel's state is unknown (a confirm may still arrive): start afresh.
            # Closing a stalled connection can take long, so it is closed by the next
            # start() or close(), not within this call's deadline.
            self._abandon()
            raise

    @staticmethod
    def _content_header_size(amqp_message: Any) -> int:
        """Bytes of the content header frame's payload, encoded as aiormq will send it.

        Raises:
            BrokerRejectedError: a property or header AMQP cannot encode (permanent).
        """
        try:
            header = ContentHeader(
                body_size=len(amqp_message.body), properties=amqp_message.properties
            )
            return len(header.marshal())
        except (TypeError, ValueError, struct.error, OverflowError) as exc:
            raise BrokerRejectedError(
                f"rabbitmq: AMQP cannot encode the message's properties ({exc})"
            ) from None

    def _frame_max(self) -> int:
        """Return the frame_max the connection negotiated (0: no limit)."""
        tune = getattr(
            getattr(getattr(self._connection, "transport", None), "connection", None),
            "connection_tune",
            None,
        )
        frame_max = getattr(tune, "frame_max", None)
        return frame_max if isinstance(frame_max, int) else DEFAULT_FRAME_MAX

    async def _transmit(self, amqp_message: Any, routing_key: str, key: str) -> BrokerReceipt:
        exchange = self._exchange
        if exchange is None:
            raise BrokerUnavailableError("rabbitmq: not connected")
        try:
            await exchange.publish(amqp_message, routing_key, mandatory=True, timeout=None)
        except apx.PublishError:
            raise BrokerRejectedError(
                f"rabbitmq: unroutable: no queue is bound to routing key {routing_key!r} on "
                f"exchange {self._exchange_name!r} (the broker returned the message)"
            ) from None
        except apx.DeliveryError:
            raise BrokerUnavailableError(
                "rabbitmq: the broker nacked the message (it could not take responsibility)"
            ) from None
        except apx.ChannelPreconditionFailed as exc:
            await self._drop()
            if "size" in str(exc).lower():
                raise MessageTooLargeError(
                    "rabbitmq: the message exceeds the server's max_message_size"
                ) from None
            raise BrokerRejectedError(f"rabbitmq: precondition failed: {exc}") from None
        except apx.ChannelNotFoundEntity:
            await self._drop()
            raise BrokerConfigurationError(
                f"rabbitmq: exchange {self._exchange_name!r} does not exist"
            ) from None
        except aiormq.exceptions.ChannelAccessRefused:
            await self._drop()
            raise BrokerRejectedError("rabbitmq: access refused to the exchange") from None
        except (apx.AMQPError, apx.ChannelInvalidStateError, ConnectionError, OSError) as exc:
            # The frame may have reached the broker before the connection broke.
            await self._drop()
            raise AckUncertainError(type(exc).__name__) from None
        return BrokerReceipt(
            "rabbitmq", key, duplicate=False, location=f"{self._exchange_name}/{routing_key}"
        )


class RabbitMQConsumer(AsyncLifecycle):
    """Reads a queue with explicit acknowledgements (``basic.get``).

    Unacknowledged messages go back to the queue when this consumer's channel closes
    (RabbitMQ's redelivery); there is no per-message visibility timeout.

    Args:
        url: the server URL.
        queue: the queue name (must exist).

    Raises:
        ConfigurationError: invalid arguments.
    """

    def __init__(self, url: str, *, queue: str) -> None:
        if not isinstance(queue, str) or not queue:
            raise ConfigurationError("queue must be a non-empty str")
        self._url = url
        self._queue_name = queue
        self._connection: Any = None
        self._queue: Any = None
        self._held: dict[str, Any] = {}

    def __repr__(self) -> str:
        return f"RabbitMQConsumer(url={redact_url(self._url)!r}, queue={self._queue_name!r})"

    async def start(self) -> None:
        """Connect and find the queue. Idempotent.

        Raises:
            BrokerUnavailableError: the server cannot be reached.
            BrokerConfigurationError: the queue does not exist.
        """
        if self._queue is not None:
            return
        connection = await _connect(self._url, 5.0, "steeple-consumer")
        try:
            channel = await connection.channel()
            self._queue = await channel.get_queue(self._queue_name, ensure=True)
        except apx.ChannelNotFoundEntity:
            await _close_quietly(connection)
            raise BrokerConfigurationError(
                f"rabbitmq: queue {self._queue_name!r} does not exist"
            ) from None
        self._connection = connection

    async def close(self) -> None:
        """Close the connection; unacknowledged messages return to the queue."""
        connection, self._connection, self._queue = self._connection, None, None
        self._held.clear()
        await _close_quietly(connection)

    async def fetch(self, limit: int = 10) -> list[Delivery]:
        """Up to ``limit`` messages that are in the queue now.

        Raises:
            BrokerUnavailableError: the connection failed.
        """
        await self.start()
        out: list[Delivery] = []
        try:
            for _ in range(limit):
                incoming = await self._queue.get(no_ack=False, fail=False, timeout=5)
                if incoming is None:
                    break
                out.append(self._delivery(incoming))
        except (apx.AMQPError, ConnectionError, OSError) as exc:
            await self.close()
            raise BrokerUnavailableError(f"rabbitmq: {type(exc).__name__}") from None
        return out

    def _delivery(self, incoming: Any) -> Delivery:
        headers = {
            k: (v.decode() if isinstance(v, bytes) else str(v))
            for k, v in (incoming.headers or {}).items()
        }
        key = incoming.message_id or headers.get(HEADER_KEY, "")
        delivery_id = str(incoming.delivery_tag)
        self._held[delivery_id] = incoming
        message = ScheduledMessage(
            headers.get(HEADER_TOPIC, incoming.routing_key or "unknown"),
            headers.get(HEADER_TYPE, incoming.type or "unknown"),
            incoming.body,
            decode_headers(headers.get(HEADER_HEADERS)),
        )
        return Delivery(delivery_id, key, message, 2 if incoming.redelivered else 1)

    async def acknowledge(self, delivery_id: str) -> bool:
        """Acknowledge a delivery; False for an unknown id.

        Raises:
            BrokerUnavailableError: the connection failed (the message will come back).
        """
        incoming = self._held.pop(delivery_id, None)
        if incoming is None:
            return False
        try:
            await incoming.ack()
        except (apx.AMQPError, ConnectionError, OSError) as exc:
            raise BrokerUnavailableError(f"rabbitmq: {type(exc).__name__}") from None
        return True


class SeenStore(Protocol):
    """Remembers processed idempotency keys for a TTL (consumer-side dedup)."""

    async def contains(self, key: str) -> bool:
        """Tell whether ``key`` was recorded and has not expired."""
        ...

    async def add(self, key: str) -> None:
        """Record ``key`` as processed."""
        ...


class MemorySeenStore:
    """An in-process, bounded seen-set with a TTL (lost when the process stops).

    Args:
        ttl: how long a key is remembered; make it at least the delivery window.
        max_entries: beyond this, the oldest keys are forgotten early (size it to the
            messages of one window).
        now: monotonic time source in seconds (tests pass a fake).

    Raises:
        ConfigurationError: invalid arguments.
    """

    def __init__(
        self,
        ttl: timedelta = limits.MAX_DELIVERY_WINDOW,
        *,
        max_entries: int = 1_000_000,
        now: Callable[[], float] = time.monotonic,
    ) -> None:
        self._ttl = positive_duration(ttl, "ttl").total_seconds()
        if isinstance(max_entries, bool) or not isinstance(max_entries, int) or max_entries < 1:
            raise ConfigurationError("max_entries must be a positive int")
        self._max = max_entries
        self._now = now
        self._expiry: OrderedDict[str, float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._expiry)

    def _prune(self, now: float) -> None:
        while self._expiry:
            key, expires = next(iter(self._expiry.items()))
            if expires > now and len(self._expiry) <= self._max:
                break
            del self._expiry[key]

    async def contains(self, key: str) -> bool:
        """Tell whether ``key`` was recorded less than ``ttl`` ago (and not evicted)."""
        now = self._now()
        self._prune(now)
        expires = self._expiry.get(key)
        return expires is not None and expires > now

    async def add(self, key: str) -> None:
        """Record ``key`` (refreshing its TTL)."""
        now = self._now()
        self._expiry.pop(key, None)
        self._expiry[key] = now + self._ttl
        self._prune(now)


class SqliteSeenStore:
    """A durable seen-set in a SQLite file (survives consumer restarts).

    Args:
        path: the file (created if missing).
        ttl: how long a key is remembered; make it at least the delivery window.
        now: wall-clock time source in seconds.

    Raises:
        ConfigurationError: invalid arguments.
    """

    def __init__(
        self,
        path: str | Path,
        ttl: timedelta = limits.MAX_DELIVERY_WINDOW,
        *,
        now: Callable[[], float] = time.time,
    ) -> None:
        self._path = Path(path)
        self._ttl = positive_duration(ttl, "ttl").total_seconds()
        self._now = now
        self._conn: sqlite3.Connection | None = None
        self._lock = asyncio.Lock()

    def __repr__(self) -> str:
        return f"SqliteSeenStore(path={str(self._path)!r}, ttl={self._ttl}s)"

    def _open(self) -> sqlite3.Connection:
        if self._conn is None:
            conn = sqlite3.connect(self._path, isolation_level=None, check_same_thread=False)
            conn.execute("PRAGMA journal_mode = WAL")
            conn.execute("PRAGMA synchronous = FULL")
            conn.execute(
                "CREATE TABLE IF NOT EXISTS steeple_seen"
                " (key TEXT PRIMARY KEY, expires_at REAL NOT NULL)"
            )
            self._conn = conn
        return self._conn

    async def contains(self, key: str) -> bool:
        """Tell whether ``key`` was recorded less than ``ttl`` ago."""
        now = self._now()

        def run() -> bool:
            row = (
                self._open()
                .execute("SELECT 1 FROM steeple_seen WHERE key = ? AND expires_at > ?", (key, now))
                .fetchone()
            )
            return row is not None

        async with self._lock:
            return await asyncio.to_thread(run)

    async def add(self, key: str) -> None:
        """Record ``key`` durably and forget expired keys."""
        now = self._now()

        def run() -> None:
            conn = self._open()
            conn.execute("BEGIN IMMEDIATE")
            conn.execute(
                "INSERT INTO steeple_seen (key, expires_at) VALUES (?, ?)"
                " ON CONFLICT (key) DO UPDATE SET expires_at = excluded.expires_at",
                (key, now + self._ttl),
            )
            conn.execute("DELETE FROM steeple_seen WHERE expires_at <= ?", (now,))
            conn.execute("COMMIT")

        async with self._lock:
            await asyncio.to_thread(run)

    async def close(self) -> None:
        """Close the file."""
        async with self._lock:
            conn, self._conn = self._conn, None
            if conn is not None:
                conn.close()


class DedupingConsumer:
    """Wraps a consumer: drops deliveries whose idempotency key was already processed.

    Call :meth:`fetch`, handle each delivery, then :meth:`acknowledge` it: the key is
    recorded in the seen store first, then the message is acknowledged. Duplicates (seen
    before, or repeated within one batch) are acknowledged and not returned.

    Args:
        consumer: anything with ``fetch(limit)`` and ``acknowledge(delivery_id)``
            (e.g. :class:`RabbitMQConsumer`).
        seen: where processed keys are remembered.
    """

    def __init__(self, consumer: Any, seen: SeenStore) -> None:
        self._consumer = consumer
        self._seen = seen
        self.dropped = 0
        """How many duplicate deliveries were dropped so far."""

    def __repr__(self) -> str:
        return f"DedupingConsumer(consumer={self._consumer!r}, dropped={self.dropped})"

    async def fetch(self, limit: int = 10) -> list[Delivery]:
        """Return new (never processed) deliveries, at most one per idempotency key.

        Raises:
            BrokerError: whatever the wrapped consumer raises.
        """
        out: list[Delivery] = []
        batch_keys: set[str] = set()
        for delivery in await self._consumer.fetch(limit):
            key = delivery.idempotency_key
            if key in batch_keys or await self._seen.contains(key):
                self.dropped += 1
                await self._consumer.acknowledge(delivery.delivery_id)
                continue
            batch_keys.add(key)
            out.append(delivery)
        return out

    async def acknowledge(self, delivery: Delivery) -> bool:
        """Record the delivery's key as processed, then acknowledge it.

        Raises:
            BrokerError: whatever the wrapped consumer raises.
        """
        await self._seen.add(delivery.idempotency_key)
        return bool(await self._consumer.acknowledge(delivery.delivery_id))
