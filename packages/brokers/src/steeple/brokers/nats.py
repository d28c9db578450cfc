"""NATS JetStream (extra ``steeple-brokers[nats]``).

Deduplication is the server's: every message carries ``Nats-Msg-Id`` = the idempotency
key, and JetStream drops a second message with the same id inside the stream's
``duplicate_window`` (its PubAck then says ``duplicate``). The window defaults to two
minutes, far shorter than steeple's delivery window, so :meth:`JetStreamBroker.start` reads
the stream's window and refuses one shorter than ``required_window`` -- or, with
``manage_stream=True``, creates or updates the stream with that window.

The message's payload is the NATS payload; topic, message type and the idempotency key
travel in ``Steeple-*`` headers, the message's own headers as one JSON header.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, StorageType, StreamConfig

from steeple.brokers._common import (
    HEADER_HEADERS,
    HEADER_TOPIC,
    HEADER_TYPE,
    AckUncertainError,
    AsyncLifecycle,
    Delivery,
    check_dedup_window,
    check_key,
    check_message,
    check_size,
    check_timeout,
    decode_headers,
    header_map,
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
    MessageTooLargeError,
)
from steeple.core.messages import BrokerReceipt, ScheduledMessage

__all__ = ["MSG_ID_HEADER", "JetStreamBroker", "JetStreamConsumer"]

MSG_ID_HEADER = "Nats-Msg-Id"

_log = logging.getLogger("steeple.brokers.nats")
_FORBIDDEN_NAME_CHARS = set(" \t\r\n.*>/\\")

MAX_SUBJECT_BYTES = 1024
"""Longest subject accepted, in UTF-8: the server refuses a control line (``HPUB <subject>
<reply> <sizes>``) over its ``max_control_line`` (4096 bytes by default) and closes the
connection, so subjects stay well under it."""
MAX_HEADER_BYTES = 65535
"""JetStream refuses a message whose header block is larger ("header size exceeds maximum
allowed of 64k", error 10097): the server stores its length in 16 bits."""
_EXPECTED_STREAM_HEADER = "Nats-Expected-Stream"
# nats-py's header line encoding (nats/aio/client.py): "NATS/1.0\r\n", then "Key: Value\r\n"
# per header, then "\r\n". Keys are RFC 7230 tokens; values are sent stripped of surrounding
# whitespace and with CR/LF turned into spaces, i.e. silently altered, so they are refused.
_HEADER_KEY = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_HEADER_LINE = b"NATS/1.0\r\n"


def _check_name(value: object, what: str) -> str:
    if not isinstance(value, str) or not value or len(value) > 200:
        raise ConfigurationError(f"{what} must be a non-empty str of at most 200 characters")
    if set(value) & _FORBIDDEN_NAME_CHARS or not value.isprintable():
        raise ConfigurationError(f"{what} {value!r} must not contain spaces, '.', '*', '>' or '/'")
    return value


def _check_subject(value: object) -> str:
    """Require a concrete NATS subject: non-empty dot-separated tokens, no spaces or wildcards.

    Raises:
        ConfigurationError: anything the server would refuse or treat as a pattern.
    """
    if not isinstance(value, str) or not value:
        raise ConfigurationError("subject must be a non-empty str")
    if not value.isprintable() or any(ch.isspace() for ch in value):
        raise ConfigurationError(
            "subject must not contain spaces, tabs, line breaks or other non-printable characters"
        )
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError:
        raise ConfigurationError("subject contains a lone surrogate (no UTF-8 form)") from None
    if size > MAX_SUBJECT_BYTES:
        raise ConfigurationError(
            f"subject is {size} bytes; at most {MAX_SUBJECT_BYTES} are accepted (the "
            "server's control line limit)"
        )
    tokens = value.split(".")
    if any(not token for token in tokens):
        raise ConfigurationError(
            f"subject {value!r} has an empty token ('..', or a leading or trailing '.')"
        )
    if any(token in ("*", ">") or "*" in token or ">" in token for token in tokens):
        raise ConfigurationError("subject must be a concrete subject, not a wildcard")
    return value


def header_block(headers: Mapping[str, str], broker: str = "nats") -> bytes:
    """Encode headers exactly as nats-py sends them, refusing what it would alter.

    Raises:
        BrokerRejectedError: a key that is not an RFC 7230 token, or a value that cannot be
            encoded, holds CR or LF, or starts or ends with whitespace (nats-py would send
            it changed).
    """
    out = bytearray(_HEADER_LINE)
    for key, value in headers.items():
        if not _HEADER_KEY.fullmatch(key):
            raise BrokerRejectedError(f"{broker}: header name {key!r} is not a token")
        raw = wire_text(value, f"header {key!r}", broker)
        if "\r" in value or "\n" in value or value != value.strip():
            raise BrokerRejectedError(
                f"{broker}: header {key!r} holds a line break or surrounding whitespace, "
                "which the NATS client would rewrite"
            )
        out += key.encode("ascii") + b": " + raw + b"\r\n"
    out += b"\r\n"
    return bytes(out)


async def _connect(url: str, timeout: float, name: str) -> NatsClient:
    async def quiet_error(exc: Exception) -> None:
        # The client reports reconnect attempts here; the URL may hold credentials.
        _log.debug("nats connection event: %s", type(exc).__name__)

    try:
        async with asyncio.timeout(timeout):
            return await nats.connect(
                servers=[url],
                name=name,
                connect_timeout=max(timeout / 2, 0.5),
                allow_reconnect=True,
                max_reconnect_attempts=-1,
                reconnect_time_wait=0.25,
                error_cb=quiet_error,
            )
    except TimeoutError:
        raise BrokerTimeoutError(
            f"nats: connecting to {redact_url(url)} took longer than {timeout:g} s"
        ) from None
    except (OSError, nats.errors.Error) as exc:
        raise BrokerUnavailableError(
            f"nats: cannot connect to {redact_url(url)} ({type(exc).__name__})"
        ) from None
    except (ValueError, TypeError) as exc:
        # The client refused the URL or options before connecting: nothing to retry.
        raise BrokerConfigurationError(
            f"nats: the client refused the server URL {redact_url(url)} ({type(exc).__name__})"
        ) from None


class JetStreamBroker(AsyncLifecycle):
    """Publishes into a JetStream stream with ``Nats-Msg-Id`` deduplication.

    Args:
        url: the server URL (credentials in it are never shown).
        stream: the stream name.
        subject: the subject to publish on (must be bound to ``stream``): a concrete
            subject of non-empty dot-separated tokens, without whitespace or wildcards,
            at most 1024 bytes.
        required_window: the delivery window the stream's ``duplicate_window`` must cover.
        manage_stream: create the stream if missing and raise a short window to
            ``required_window`` (file storage); otherwise only check.
        max_message_bytes: refuse larger messages, in addition to the server's max_payload.
        connect_timeout: seconds allowed to connect and inspect the stream.

    Raises:
        ConfigurationError: invalid arguments.
    """

    def __init__(
        self,
        url: str,
        *,
        stream: str,
        subject: str,
        required_window: timedelta = limits.DEFAULT_DELIVERY_WINDOW,
        manage_stream: bool = False,
        max_message_bytes: int | None = None,
        connect_timeout: float = 5.0,
    ) -> None:
        if not isinstance(url, str) or not url:
            raise ConfigurationError("url must be a non-empty str")
        self._url = url
        self._stream = _check_name(stream, "stream")
        self._subject = _check_subject(subject)
        self._required = positive_duration(required_window, "required_window")
        self._manage = bool(manage_stream)
        if max_message_bytes is not None and (
            isinstance(max_message_bytes, bool)
            or not isinstance(max_message_bytes, int)
            or max_message_bytes < 1
        ):
            raise ConfigurationError("max_message_bytes must be a positive int or None")
        self._max_bytes = max_message_bytes
        self._connect_timeout = check_timeout(connect_timeout)
        self._nc: NatsClient | None = None
        self._js: JetStreamContext | None = None
        self._stream_max: int = -1
        self._window: timedelta | None = None
        self._closed = False
        self._start_lock = asyncio.Lock()

    def __repr__(self) -> str:
        return (
            f"JetStreamBroker(url={redact_url(self._url)!r}, stream={self._stream!r}, "
            f"subject={self._subject!r}, duplicate_window={self._window})"
        )

    @property
    def duplicate_window(self) -> timedelta | None:
        """The stream's duplicate window as read at start (``None`` before start)."""
        return self._window

    @classmethod
    async def connect(cls, url: str, **kwargs: Any) -> JetStreamBroker:
        """Build and start a broker (see the class for the arguments).

        Raises:
            BrokerConfigurationError: the stream is missing or its window too short.
            BrokerUnavailableError: the server cannot be reached.
            BrokerTimeoutError: the server did not answer in time.
        """
        broker = cls(url, **kwargs)
        await broker.start()
        return broker

    async def start(self) -> None:
        """Connect, then check (or configure) the stream's duplicate window. Idempotent.

        Raises:
            BrokerConfigurationError: the stream is missing (and ``manage_stream`` is off),
                or its ``duplicate_window`` is shorter than ``required_window``.
            BrokerUnavailableError: the server cannot be reached, or JetStream is off.
            BrokerTimeoutError: the server did not answer in time.
        """
        if self._closed:
            raise BrokerUnavailableError("nats: this broker was closed")
        if self._started():
            return  # the lock is for the first start only; every publish asks
        async with self._start_lock:
            if self._started():
                return
            nc = await _connect(self._url, self._connect_timeout, "steeple-publisher")
            try:
                js = nc.jetstream(timeout=self._connect_timeout)
                await self._check_stream(js)
            except BaseException:
                await nc.close()
                raise
            self._nc, self._js = nc, js

    def _started(self) -> bool:
        return self._js is not None

    async def _check_stream(self, js: JetStreamContext) -> None:
        required = self._required.total_seconds()
        try:
            info = await js.stream_info(self._stream)
        except nats.js.errors.NotFoundError:
            if not self._manage:
                raise BrokerConfigurationError(
                    f"nats: stream {self._stream!r} does not exist; create it with subject "
                    f"{self._subject!r} and duplicate_window >= {self._required}, or pass "
                    "manage_stream=True"
                ) from None
            info = await self._call(
                js.add_stream(
                    StreamConfig(
                        name=self._stream,
                        subjects=[self._subject],
                        duplicate_window=required,
                        storage=StorageType.FILE,
                    )
                ),
                "creating the stream",
            )
        except (nats.errors.TimeoutError, TimeoutError):
            raise BrokerTimeoutError("nats: the stream info request timed out") from None
        except nats.errors.NoRespondersError:
            raise BrokerUnavailableError("nats: JetStream is not enabled on the server") from None
        except nats.errors.Error as exc:
            raise BrokerUnavailableError(f"nats: reading the stream failed: {exc}") from None
        config = info.config
        window = timedelta(seconds=config.duplicate_window or 0)
        if window < self._required:
            if not self._manage:
                check_dedup_window(
                    window,
                    self._required,
                    broker=f"nats stream {self._stream!r}",
                    what="duplicate_window",
                    fix="Raise the stream's duplicate_window (nats stream edit "
                    "--dupe-window), or pass manage_stream=True.",
                )
            info = await self._call(
                js.update_stream(config.evolve(duplicate_window=required)),
                "raising the stream's duplicate_window",
            )
            window = timedelta(seconds=info.config.duplicate_window or 0)
            check_dedup_window(
                window,
                self._required,
                broker=f"nats stream {self._stream!r}",
                what="duplicate_window after the update",
                fix="The server did not keep the new window.",
            )
        self._window = window
        self._stream_max = info.config.max_msg_size or -1
        _log.info("nats stream %s: duplicate_window %s", self._stream, window)

    @staticmethod
    async def _call(awaitable: Any, what: str) -> Any:
        try:
            return await awaitable
        except nats.js.errors.APIError as exc:
            raise BrokerConfigurationError(f"nats: {what} was refused: {exc.description}") from None
        except (nats.errors.TimeoutError, TimeoutError):
            raise BrokerTimeoutError(f"nats: {what} timed out") from None

    async def close(self) -> None:
        """Close the connection. Idempotent."""
        self._closed = True
        nc, self._nc, self._js = self._nc, None, None
        if nc is not None and not nc.is_closed:
            await nc.close()

    def _limit(self) -> int:
        limit = self._nc.max_payload if self._nc is not None else 1024 * 1024
        if self._stream_max > 0:
            limit = min(limit, self._stream_max)
        if self._max_bytes is not None:
            limit = min(limit, self._max_bytes)
        return limit

    async def publish(
        self, message: ScheduledMessage, *, idempotency_key: str, timeout: float
    ) -> BrokerReceipt:
        """Publish with ``Nats-Msg-Id`` = ``idempotency_key`` and wait for the PubAck.

        The exact wire size (the header block nats-py sends plus the payload) is checked
        before anything is sent against the server's ``max_payload``, the stream's
        ``max_msg_size`` and ``max_message_bytes``; the header block against JetStream's
        64 KiB limit.

        Raises:
            ConfigurationError: a bad key or timeout, or not a ScheduledMessage.
            BrokerConfigurationError: the stream is missing or its window too short.
            MessageTooLargeError: over the server's max_payload or the stream's
                max_msg_size, or headers over 64 KiB (permanent), checked before sending.
            BrokerRejectedError: a header value NATS cannot carry unchanged, refused before
                sending; or the stream refused the message (permanent).
            BrokerUnavailableError: the server is unreachable or no stream listens.
            BrokerTimeoutError: no PubAck in time; the stream may hold the message.
            RelayAcknowledgementError: the PubAck was lost but the stream holds the key.
        """
        key = check_key(idempotency_key)
        seconds = check_timeout(timeout)
        headers = self._headers(check_message(message, "nats"), key)
        # What the server counts against max_payload (and the stream against max_msg_size):
        # the header block plus the payload, byte for byte.
        block = header_block(headers)
        if len(block) > MAX_HEADER_BYTES:
            raise MessageTooLargeError(
                f"nats: the message's headers are {len(block)} bytes on the wire; JetStream "
                f"accepts at most {MAX_HEADER_BYTES} (64 KiB): shorten the headers",
                size=len(block),
                limit=MAX_HEADER_BYTES,
            )
        size = len(block) + len(message.payload)
        if self._max_bytes is not None:
            check_size(size, self._max_bytes, "the nats adapter")

        async def prepare() -> None:
            await self.start()
            # A message over max_payload makes the server close the whole connection.
            check_size(size, self._limit(), "the nats server")

        if self._js is not None:
            # Started: check the size now; no connection step (nor its deadline) to run.
            check_size(size, self._limit(), "the nats server")
        return await publish_guarded(
            prepare=prepare if self._js is None else None,
            broker="nats",
            key=key,
            timeout=seconds,
            transmit=lambda: self._transmit(message, key, headers),
            probe=lambda: self._probe(key),
        )

    def _headers(self, message: ScheduledMessage, key: str) -> dict[str, str]:
        """Every header the message travels with (js.publish adds the expected stream)."""
        return {
            **header_map(message, key),
            MSG_ID_HEADER: key,
            _EXPECTED_STREAM_HEADER: self._stream,
        }

    async def _transmit(
        self, message: ScheduledMessage, key: str, headers: dict[str, str]
    ) -> BrokerReceipt:
        js = self._js
        if js is None:
            raise BrokerUnavailableError("nats: this broker was closed")
        try:
            # The caller's deadline (asyncio.timeout) bounds this; the client's own
            # request timeout is only a backstop.
            ack = await js.publish(
                self._subject,
                message.payload,
                timeout=60,
                stream=self._stream,
                headers=dict(headers),
            )
        except (nats.errors.BadSubjectError, nats.errors.BadHeaderError) as exc:
            # Refused by the client before anything was written (checked above already).
            raise BrokerRejectedError(f"nats: the client refused the message: {exc}") from None
        except nats.errors.MaxPayloadError:
            raise MessageTooLargeError(
                f"nats: the message exceeds the server's max_payload ({self._limit()} bytes)"
            ) from None
        except nats.js.errors.APIError as exc:
            raise self._api_error(exc) from None
        except nats.js.errors.NoStreamResponseError:
            raise BrokerUnavailableError(
                f"nats: no stream answered on subject {self._subject!r} (stream missing, "
                "not bound to the subject, or unavailable)"
            ) from None
        except nats.errors.TimeoutError:
            raise AckUncertainError("no PubAck") from None
        except (
            nats.errors.ConnectionClosedError,
            nats.errors.ConnectionReconnectingError,
            nats.errors.ConnectionDrainingError,
            nats.errors.StaleConnectionError,
            nats.errors.OutboundBufferLimitError,
        ) as exc:
            if self._nc is not None and self._nc.is_closed:
                # The client gave up on this connection: the next publish connects afresh.
                self._nc = self._js = None
            raise BrokerUnavailableError(
                f"nats: connection unusable ({type(exc).__name__})"
            ) from None
        except OSError as exc:
            raise BrokerUnavailableError(f"nats: {type(exc).__name__}") from None
        except nats.errors.Error as exc:
            # Any other client error after the request went out: the server may hold it.
            raise AckUncertainError(type(exc).__name__) from None
        return BrokerReceipt(
            "nats", key, duplicate=bool(ack.duplicate), location=f"{ack.stream}:{ack.seq}"
        )

    def _api_error(self, exc: nats.js.errors.APIError) -> BrokerError:
        desc = (exc.description or "").lower()
        if "maximum" in desc and ("size" in desc or "payload" in desc):
            return MessageTooLargeError(f"nats: {exc.description}")
        if exc.code is not None and exc.code >= 500:
            return BrokerUnavailableError(f"nats: server error: {exc.description}")
        return BrokerRejectedError(f"nats: the stream refused the message: {exc.description}")

    async def _probe(self, key: str) -> BrokerReceipt | None:
        """Return the stream's last message on our subject if it carries ``key``."""
        js = self._js
        if js is None:
            return None
        try:
            raw = await js.get_msg(self._stream, subject=self._subject)
        except (nats.errors.Error, OSError):
            return None
        headers = raw.headers or {}
        if headers.get(MSG_ID_HEADER) != key:
            return None
        return BrokerReceipt("nats", key, duplicate=True, location=f"{self._stream}:{raw.seq}")


class JetStreamConsumer(AsyncLifecycle):
    """A durable pull consumer on a stream, for verification and simple workers.

    Args:
        url: the server URL.
        stream: the stream name.
        durable: the durable consumer's name (created if missing).
        subject: filter subject (defaults to every subject of the stream).
        ack_wait: unacknowledged messages are redelivered after this long.

    Raises:
        ConfigurationError: invalid arguments.
    """

    def __init__(
        self,
        url: str,
        *,
        stream: str,
        durable: str,
        subject: str | None = None,
        ack_wait: timedelta = timedelta(seconds=30),
    ) -> None:
        self._url = url
        self._stream = _check_name(stream, "stream")
        self._durable = _check_name(durable, "durable")
        self._subject = _check_subject(subject) if subject is not None else None
        self._ack_wait = positive_duration(ack_wait, "ack_wait")
        self._nc: NatsClient | None = None
        self._sub: Any = None
        self._held: dict[str, Msg] = {}

    def __repr__(self) -> str:
        return (
            f"JetStreamConsumer(url={redact_url(self._url)!r}, stream={self._stream!r}, "
            f"durable={self._durable!r})"
        )

    async def start(self) -> None:
        """Connect and bind (or create) the durable consumer. Idempotent.

        Raises:
            BrokerUnavailableError: the server or stream cannot be reached.
            BrokerTimeoutError: the server did not answer in time.
        """
        if self._sub is not None:
            return
        nc = await _connect(self._url, 5.0, "steeple-consumer")
        try:
            js = nc.jetstream(timeout=5.0)
            self._sub = await js.pull_subscribe(
                self._subject or "",
                durable=self._durable,
                stream=self._stream,
                config=ConsumerConfig(ack_wait=self._ack_wait.total_seconds()),
            )
        except (nats.errors.Error, OSError) as exc:
            await nc.close()
            raise BrokerUnavailableError(
                f"nats: cannot bind consumer {self._durable!r}: {type(exc).__name__}"
            ) from None
        self._nc = nc

    async def close(self) -> None:
        """Close the connection (the durable consumer stays on the server)."""
        nc, self._nc, self._sub = self._nc, None, None
        self._held.clear()
        if nc is not None and not nc.is_closed:
            await nc.close()

    async def fetch(self, limit: int = 10, *, wait: float = 0.5) -> list[Delivery]:
        """Up to ``limit`` messages, waiting at most ``wait`` seconds for the first.

        Raises:
            BrokerUnavailableError: the connection failed.
        """
        await self.start()
        try:
            msgs = await self._sub.fetch(limit, timeout=wait)
        except (nats.errors.TimeoutError, TimeoutError):
            return []
        except (nats.errors.Error, OSError) as exc:
            raise BrokerUnavailableError(f"nats: fetch failed: {type(exc).__name__}") from None
        out = []
        for msg in msgs:
            headers = msg.headers or {}
            meta = msg.metadata
            delivery_id = f"{meta.sequence.stream}.{meta.num_delivered}"
            self._held[delivery_id] = msg
            message = ScheduledMessage(
                headers.get(HEADER_TOPIC, msg.subject),
                headers.get(HEADER_TYPE, "unknown"),
                msg.data,
                decode_headers(headers.get(HEADER_HEADERS)),
            )
            out.append(
                Delivery(delivery_id, headers.get(MSG_ID_HEADER, ""), message, meta.num_delivered)
            )
        return out

    async def acknowledge(self, delivery_id: str) -> bool:
        """Acknowledge a delivery and wait for the server to confirm.

        Returns False for an unknown id.

        Raises:
            BrokerTimeoutError: the server did not confirm.
        """
        msg = self._held.pop(delivery_id, None)
        if msg is None:
            return False
        try:
            await msg.ack_sync(timeout=5)
        except nats.errors.TimeoutError:
            raise BrokerTimeoutError("nats: the acknowledgement was not confirmed") from None
        except nats.errors.Error:
            return False
        return True
