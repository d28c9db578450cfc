"""Redis Streams (extra ``steeple-brokers[redis]``).

Redis has no idempotent ``XADD`` (before 8.6), so one Lua script does both steps
atomically: if the dedup marker ``<prefix><key>`` exists it returns the entry id it holds
(a duplicate); otherwise it ``XADD``s the entry and sets the marker to the new entry id with
a TTL of ``dedup_ttl`` (``SET ... PX``). Scripts run atomically, so two relays racing on
one key store one entry. The marker is independent of the stream: trimming the stream
does not forget keys, and the marker's TTL is checked against ``required_window``.

The promise holds only as long as the markers do. :meth:`RedisStreamBroker.check_persistence`
reads ``appendonly``, ``appendfsync`` and ``maxmemory-policy`` and reports every setting
that can lose or evict markers (logged as warnings; refused with ``strict=True``).

Redis Cluster: the stream and the markers must share a hash slot; give the stream a hash
tag (``{orders}``) and the default prefix ``<stream>:dedup:`` follows it.
"""

from __future__ import annotations

import asyncio
import logging
from datetime import timedelta
from typing import Any

import attrs
import redis.asyncio as aioredis
import redis.exceptions as rexc

from steeple.brokers._common import (
    AckUncertainError,
    AsyncLifecycle,
    Delivery,
    check_dedup_window,
    check_key,
    check_message,
    check_size,
    check_timeout,
    decode_headers,
    encode_headers,
    positive_duration,
    publish_guarded,
    redact_url,
    wire_text,
)
from steeple.core import limits
from steeple.core.errors import (
    BrokerConfigurationError,
    BrokerError,
    BrokerRejectedError,
    BrokerTimeoutError,
    BrokerUnavailableError,
    ConfigurationError,
)
from steeple.core.messages import BrokerReceipt, ScheduledMessage

__all__ = ["PersistenceReport", "RedisStreamBroker", "RedisStreamConsumer"]

_log = logging.getLogger("steeple.brokers.redis")

# KEYS[1] stream, KEYS[2] dedup marker; ARGV[1] marker TTL (ms), ARGV[2..] entry fields.
_PUBLISH_SCRIPT = """
local existing = redis.call('GET', KEYS[2])
if existing then
  return {1, existing}
end
local id = redis.call('XADD', KEYS[1], '*', unpack(ARGV, 2))
redis.call('SET', KEYS[2], id, 'PX', ARGV[1])
return {0, id}
"""

_MAX_MESSAGE_BYTES = 1024 * 1024


@attrs.frozen
class PersistenceReport:
    """What the server's settings mean for the dedup promise.

    Attributes:
        appendonly: the ``appendonly`` setting (``None`` if it could not be read).
        appendfsync: the ``appendfsync`` setting.
        maxmemory_policy: the ``maxmemory-policy`` setting.
        warnings: one sentence per setting that can lose or evict dedup markers.
    """

    appendonly: str | None
    appendfsync: str | None
    maxmemory_policy: str | None
    warnings: tuple[str, ...]

    @property
    def durable(self) -> bool:
        """True when no setting undermines the dedup markers."""
        return not self.warnings


# Error prefixes of replies that describe the server's state, not the message: the same
# publication can succeed later (a script running, a failing RDB save, a cluster failing
# over). Anything else the server refuses is refused for good.
_TRANSIENT_PREFIXES = (
    "BUSY",
    "MISCONF",
    "TRYAGAIN",
    "CLUSTERDOWN",
    "MASTERDOWN",
    "NOREPLICAS",
    "LOADING",
    "READONLY",
    "OOM",
)


def _map_response_error(exc: rexc.ResponseError) -> BrokerError:
    text = str(exc)
    if isinstance(exc, rexc.OutOfMemoryError | rexc.ReadOnlyError | rexc.BusyLoadingError):
        return BrokerUnavailableError(f"redis: {type(exc).__name__}: the server cannot write now")
    if text.split(" ", 1)[0].upper() in _TRANSIENT_PREFIXES:
        return BrokerUnavailableError(f"redis: the server cannot take it now: {text[:200]}")
    if isinstance(exc, rexc.NoPermissionError):
        return BrokerRejectedError("redis: the user may not run the publish script (NOPERM)")
    if text.startswith("WRONGTYPE") or "WRONGTYPE" in text:
        return BrokerConfigurationError(
            "redis: the stream key or a dedup marker key holds another data type (WRONGTYPE)"
        )
    return BrokerRejectedError(f"redis: the server refused the publication: {text[:200]}")


class RedisStreamBroker(AsyncLifecycle):
    """Publishes into a Redis stream with an atomic dedup marker per idempotency key.

    Args:
        url: ``redis://`` or ``rediss://`` URL (credentials in it are never shown).
        stream: the stream key.
        dedup_ttl: how long a key's marker lives (default 7 days).
        required_window: the delivery window the markers must cover; a shorter
            ``dedup_ttl`` is refused.
        dedup_prefix: marker key prefix (default ``"<stream>:dedup:"``).
        strict: refuse to start when :meth:`check_persistence` reports a warning.
        max_message_bytes: refuse larger messages for good.
        connect_timeout: seconds allowed to connect.

    Raises:
        ConfigurationError: invalid arguments.
        BrokerConfigurationError: ``dedup_ttl`` shorter than ``required_window``.
    """

    def __init__(
        self,
        url: str,
        *,
        stream: str,
        dedup_ttl: timedelta = limits.MAX_DELIVERY_WINDOW,
        required_window: timedelta = limits.DEFAULT_DELIVERY_WINDOW,
        dedup_prefix: str | None = None,
        strict: bool = False,
        max_message_bytes: int = _MAX_MESSAGE_BYTES,
        connect_timeout: float = 5.0,
    ) -> None:
        if not isinstance(url, str) or not url:
            raise ConfigurationError("url must be a non-empty str")
        if not isinstance(stream, str) or not stream or not stream.isprintable():
            raise ConfigurationError("stream must be a non-empty printable str")
        if dedup_prefix is not None and (
            not isinstance(dedup_prefix, str) or not dedup_prefix.isprintable()
        ):
            # isprintable() is False for lone surrogates and control characters, which
            # could never be sent as part of a key.
            raise ConfigurationError("dedup_prefix must be a printable str")
        self._url = url
        self._stream = stream
        self._ttl = positive_duration(dedup_ttl, "dedup_ttl")
        required = positive_duration(required_window, "required_window")
        check_dedup_window(
            self._ttl,
            required,
            broker="redis",
            what="dedup_ttl",
            fix="Pass a dedup_ttl at least as long as the delivery window.",
        )
        self._prefix = dedup_prefix if dedup_prefix is not None else f"{stream}:dedup:"
        self._strict = bool(strict)
        if (
            isinstance(max_message_bytes, bool)
            or not isinstance(max_message_bytes, int)
            or (max_message_bytes < 1)
        ):
            raise ConfigurationError("max_message_bytes must be a positive int")
        self._max_bytes = max_message_bytes
        self._connect_timeout = check_timeout(connect_timeout)
        self._client: aioredis.Redis | None = None
        self._script: Any = None
        self._report: PersistenceReport | None = None
        self._closed = False
        # The first publications of a relay batch all call start at once: one connects,
        # the others wait for it (each would otherwise open, and leak, a client of its own).
        self._start_lock = asyncio.Lock()

    def __repr__(self) -> str:
        return (
            f"RedisStreamBroker(url={redact_url(self._url)!r}, stream={self._stream!r}, "
            f"dedup_ttl={self._ttl})"
        )

    @property
    def persistence(self) -> PersistenceReport | None:
        """The report read at start (``None`` before start)."""
        return self._report

    def marker_key(self, idempotency_key: str) -> str:
        """Return the dedup marker's key for ``idempotency_key``."""
        return self._prefix + idempotency_key

    @classmethod
    async def connect(cls, url: str, **kwargs: Any) -> RedisStreamBroker:
        """Build and start a broker (see the class for the arguments).

        Raises:
            BrokerUnavailableError: the server cannot be reached.
            BrokerConfigurationError: ``strict`` and the persistence settings fall short.
        """
        broker = cls(url, **kwargs)
        await broker.start()
        return broker

    async def start(self) -> None:
        """Connect, load the script and check persistence. Idempotent.

        Raises:
            BrokerUnavailableError: the server cannot be reached or refuses the login.
            BrokerTimeoutError: the server did not answer in time.
            BrokerConfigurationError: ``strict`` and :meth:`check_persistence` warned.
        """
        if self._closed:
            raise BrokerUnavailableError("redis: this broker was closed")
        if self._client is not None:
            return  # the lock is for the first start only; every publish asks
        async with self._start_lock:
            if self._client is None and not self._closed:
                await self._connect()
            if self._was_closed():
                await self.close()  # closed while connecting: nothing may stay open
                raise BrokerUnavailableError("redis: this broker was closed")

    def _was_closed(self) -> bool:
        """Whether :meth:`close` ran (read afresh after an await)."""
        return self._closed

    async def _connect(self) -> None:
        client = aioredis.Redis.from_url(
            self._url,
            socket_connect_timeout=self._connect_timeout,
            health_check_interval=0,
        )
        try:
            try:
                await client.ping()
            except rexc.TimeoutError:
                raise BrokerTimeoutError("redis: the server did not answer PING") from None
            except (rexc.ConnectionError, OSError) as exc:
                raise BrokerUnavailableError(
                    f"redis: cannot connect to {redact_url(self._url)} ({type(exc).__name__})"
                ) from None
            report = await self._check_persistence(client)
            if self._strict and report.warnings:
                raise BrokerConfigurationError(
                    "redis: the server cannot keep dedup markers durably: "
                    + " ".join(report.warnings)
                )
        except BaseException:
            await client.aclose()
            raise
        # Published only once checked: a publication never sees a half-started broker.
        self._script = client.register_script(_PUBLISH_SCRIPT)
        self._client = client

    async def check_persistence(self) -> PersistenceReport:
        """Read the settings the dedup promise relies on and report what falls short.

        Each warning is also logged at WARNING level.

        Raises:
            BrokerUnavailableError: the server cannot be reached.
        """
        client = self._client
        if client is None:
            raise BrokerUnavailableError("redis: not started")
        return await self._check_persistence(client)

    async def _check_persistence(self, client: aioredis.Redis) -> PersistenceReport:
        values: dict[str, str | None] = {}
        warnings: list[str] = []
        for name in ("appendonly", "appendfsync", "maxmemory-policy"):
            got: Any
            try:
                got = await client.config_get(name)
            except rexc.ResponseError:
                got = {}
            except (rexc.ConnectionError, rexc.TimeoutError, OSError) as exc:
                raise BrokerUnavailableError(f"redis: {type(exc).__name__}") from None
            raw = got.get(name.encode(), got.get(name)) if isinstance(got, dict) else None
            values[name] = raw.decode() if isinstance(raw, bytes) else raw
        if all(v is None for v in values.values()):
            warnings.append(
                "CONFIG GET is not allowed, so persistence cannot be checked: make sure "
                "appendonly is yes and maxmemory-policy is noeviction."
            )
        else:
            if values["appendonly"] != "yes":
                warnings.append(
                    f"appendonly is {values['appendonly']!r}: a restart loses every dedup "
                    "marker and stream entry written since the last snapshot; set "
                    "appendonly yes."
                )
            elif values["appendfsync"] != "always":
                warnings.append(
                    f"appendfsync is {values['appendfsync']!r}: a crash can lose up to about "
                    "a second of markers and entries; set appendfsync always for no loss."
                )
            if values["maxmemory-policy"] != "noeviction":
                warnings.append(
                    f"maxmemory-policy is {values['maxmemory-policy']!r}: under memory "
                    "pressure Redis may evict dedup markers before their TTL; set "
                    "maxmemory-policy noeviction."
                )
        for warning in warnings:
            _log.warning("redis dedup promise is not durable: %s", warning)
        report = PersistenceReport(
            values["appendonly"],
            values["appendfsync"],
            values["maxmemory-policy"],
            tuple(warnings),
        )
        self._report = report
        return report

    async def close(self) -> None:
        """Close every connection. Idempotent."""
        self._closed = True
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()

    async def publish(
        self, message: ScheduledMessage, *, idempotency_key: str, timeout: float
    ) -> BrokerReceipt:
        """Add ``message`` to the stream unless ``idempotency_key`` is already marked.

        Every field is encoded to bytes, and the entry's exact size checked against
        ``max_message_bytes``, before anything is sent.

        Raises:
            ConfigurationError: a bad key or timeout, or not a ScheduledMessage.
            MessageTooLargeError: over ``max_message_bytes`` (permanent).
            BrokerRejectedError: a text field without a UTF-8 encoding (permanent).
            BrokerConfigurationError: the stream or marker key holds another type.
            BrokerRejectedError: the server refused the script (permanent).
            BrokerUnavailableError: the server is unreachable, read-only or out of memory.
            BrokerTimeoutError: no reply in time; the entry may have been added.
            RelayAcknowledgementError: the reply was lost but the marker exists.
        """
        key = check_key(idempotency_key)
        seconds = check_timeout(timeout)
        fields = self._fields(check_message(message, "redis"), key)
        # The entry's exact size: every field name and value, in bytes.
        check_size(sum(len(f) for f in fields[1:]), self._max_bytes, "the redis adapter")
        return await publish_guarded(
            prepare=self.start,
            broker="redis",
            key=key,
            timeout=seconds,
            transmit=lambda: self._transmit(fields, key),
            probe=lambda: self._probe(key),
        )

    def _fields(self, message: ScheduledMessage, key: str) -> list[bytes]:
        """Build the script's ARGV: the marker TTL, then the entry's fields, as bytes.

        Encoded here, so that nothing is left for redis-py to fail on mid-command.

        Raises:
            BrokerRejectedError: a text field without a UTF-8 encoding (permanent).
        """
        ttl_ms = int(self._ttl.total_seconds() * 1000)
        return [
            str(ttl_ms).encode(),
            b"key",
            key.encode("ascii"),
            b"topic",
            wire_text(message.topic, "the topic", "redis"),
            b"type",
            wire_text(message.message_type, "the message type", "redis"),
            b"headers",
            encode_headers(message).encode("ascii"),
            b"payload",
            message.payload,
        ]

    async def _transmit(self, fields: list[bytes], key: str) -> BrokerReceipt:
        if self._script is None or self._client is None:
            raise BrokerUnavailableError("redis: this broker was closed")
        try:
            duplicate, entry_id = await self._script(
                keys=[self._stream, self.marker_key(key)], args=fields, client=self._client
            )
        except rexc.ResponseError as exc:
            raise _map_response_error(exc) from None
        except rexc.DataError as exc:
            # redis-py refused to encode an argument: nothing was sent.
            raise BrokerRejectedError(f"redis: the client refused the message: {exc}") from None
        except (rexc.TimeoutError, rexc.ConnectionError, rexc.RedisError, OSError) as exc:
            # The script may have run: the reply is what is missing (or unreadable).
            raise AckUncertainError(type(exc).__name__) from None
        # A cancelled command leaves its connection's reply stream unknown: redis-py
        # disconnects that connection itself (and only it). Resetting the whole pool here
        # cut every other publication in flight (found by the relay stress test).
        entry = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
        return BrokerReceipt("redis", key, duplicate=bool(duplicate), location=entry)

    async def _probe(self, key: str) -> BrokerReceipt | None:
        """Look the marker up on a connection of its own, opened for this lookup.

        Not from the pool, and without touching it: the pool's other connections carry
        other publications.
        """
        if self._client is None:
            return None
        client = aioredis.Redis.from_url(
            self._url,
            socket_connect_timeout=self._connect_timeout,
            health_check_interval=0,
            single_connection_client=True,
        )
        try:
            entry = await client.get(self.marker_key(key))
        except (rexc.RedisError, OSError) as exc:
            raise BrokerUnavailableError(f"redis: {type(exc).__name__}") from None
        finally:
            await client.aclose()
        if entry is None:
            return None
        text = entry.decode() if isinstance(entry, bytes) else str(entry)
        return BrokerReceipt("redis", key, duplicate=True, location=text)


class RedisStreamConsumer(AsyncLifecycle):
    """A consumer-group reader (``XREADGROUP``/``XACK``, ``XAUTOCLAIM`` for redelivery).

    Args:
        url: the server URL.
        stream: the stream key.
        group: the consumer group (created at the stream's start if missing).
        consumer: this consumer's name within the group.
        visibility_timeout: entries pending longer than this are claimed again.

    Raises:
        ConfigurationError: invalid arguments.
    """

    def __init__(
        self,
        url: str,
        *,
        stream: str,
        group: str,
        consumer: str = "steeple",
        visibility_timeout: timedelta = timedelta(seconds=30),
    ) -> None:
        for what, value in (("stream", stream), ("group", group), ("consumer", consumer)):
            if not isinstance(value, str) or not value:
                raise ConfigurationError(f"{what} must be a non-empty str")
        self._url = url
        self._stream = stream
        self._group = group
        self._consumer = consumer
        self._visibility = positive_duration(visibility_timeout, "visibility_timeout")
        self._client: aioredis.Redis | None = None

    def __repr__(self) -> str:
        return (
            f"RedisStreamConsumer(url={redact_url(self._url)!r}, stream={self._stream!r}, "
            f"group={self._group!r}, consumer={self._consumer!r})"
        )

    async def start(self) -> None:
        """Connect and create the group if missing. Idempotent.

        Raises:
            BrokerUnavailableError: the server cannot be reached.
        """
        if self._client is not None:
            return
        client = aioredis.Redis.from_url(self._url, socket_connect_timeout=5)
        try:
            await client.xgroup_create(self._stream, self._group, id="0", mkstream=True)
        except rexc.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                await client.aclose()
                raise BrokerUnavailableError(f"redis: cannot create the group: {exc}") from None
        except (rexc.ConnectionError, rexc.TimeoutError, OSError) as exc:
            await client.aclose()
            raise BrokerUnavailableError(f"redis: {type(exc).__name__}") from None
        self._client = client

    async def close(self) -> None:
        """Close the connection."""
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()

    async def fetch(self, limit: int = 10, *, wait: float = 0.0) -> list[Delivery]:
        """Entries pending past the visibility timeout first, then new ones.

        Args:
            limit: at most this many entries.
            wait: seconds to block for new entries when there are none (0 = don't block).

        Raises:
            BrokerUnavailableError: the server cannot be reached.
        """
        await self.start()
        client = self._client
        assert client is not None
        try:
            autoclaimed: Any = await client.xautoclaim(
                self._stream,
                self._group,
                self._consumer,
                min_idle_time=int(self._visibility.total_seconds() * 1000),
                start_id="0-0",
                count=limit,
            )
            claimed = autoclaimed[1]
            entries: list[tuple[Any, Any, int]] = []
            for entry_id, fields in claimed:
                if fields is None:
                    continue
                info = await client.xpending_range(
                    self._stream, self._group, min=entry_id, max=entry_id, count=1
                )
                count = int(info[0]["times_delivered"]) if info else 2
                entries.append((entry_id, fields, count))
            if len(entries) < limit:
                read: Any = await client.xreadgroup(
                    self._group,
                    self._consumer,
                    {self._stream: ">"},
                    count=limit - len(entries),
                    block=int(wait * 1000) if wait > 0 else None,
                )
                for _stream, items in read or []:
                    entries.extend((entry_id, fields, 1) for entry_id, fields in items)
        except (rexc.ConnectionError, rexc.TimeoutError, OSError) as exc:
            raise BrokerUnavailableError(f"redis: {type(exc).__name__}") from None
        out = []
        for entry_id, fields, count in entries:
            f = {k.decode(): v for k, v in fields.items()}
            message = ScheduledMessage(
                f["topic"].decode(),
                f["type"].decode(),
                f["payload"],
                decode_headers(f.get("headers")),
            )
            out.append(Delivery(entry_id.decode(), f["key"].decode(), message, count))
        return out

    async def acknowledge(self, delivery_id: str) -> bool:
        """``XACK`` the entry; False if it was not pending in the group.

        Raises:
            BrokerUnavailableError: the server cannot be reached.
        """
        await self.start()
        assert self._client is not None
        try:
            return bool(await self._client.xack(self._stream, self._group, delivery_id))
        except (rexc.ConnectionError, rexc.TimeoutError, OSError) as exc:
            raise BrokerUnavailableError(f"redis: {type(exc).__name__}") from None
