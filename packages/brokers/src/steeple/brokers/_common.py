"""Pieces every adapter shares: the delivery value, wire encoding, validation (private).

Nothing here imports a client library, so ``steeple.brokers`` stays importable without
any extra installed.
"""

from __future__ import annotations

import asyncio
import json
import struct
from collections.abc import Awaitable, Callable, Mapping
from datetime import timedelta
from types import TracebackType
from typing import Any, Protocol, TypeVar
from urllib.parse import urlsplit, urlunsplit

import attrs

from steeple.core.errors import (
    BrokerConfigurationError,
    BrokerError,
    BrokerRejectedError,
    BrokerTimeoutError,
    BrokerUnavailableError,
    ConfigurationError,
    ConfigurationTypeError,
    MessageTooLargeError,
    RecurringConfigurationError,
    RelayAcknowledgementError,
    SteepleError,
)
from steeple.core.messages import BrokerReceipt, ScheduledMessage
from steeple.core.messages import check_idempotency_key as check_key
from steeple.core.messages import check_publish_timeout as check_timeout

__all__ = [
    "HEADER_HEADERS",
    "HEADER_KEY",
    "HEADER_TOPIC",
    "HEADER_TYPE",
    "AsyncLifecycle",
    "Delivery",
    "check_dedup_window",
    "check_key",
    "check_message",
    "check_size",
    "check_timeout",
    "check_utf8_length",
    "decode_headers",
    "encode_headers",
    "encoded_size",
    "header_map",
    "positive_duration",
    "publish_guarded",
    "redact_url",
    "wire_text",
]

HEADER_TOPIC = "Steeple-Topic"
HEADER_TYPE = "Steeple-Message-Type"
HEADER_KEY = "Steeple-Idempotency-Key"
HEADER_HEADERS = "Steeple-Headers"
"""The message's own headers, as one JSON object (broker header names are too restricted)."""


@attrs.frozen(repr=False)
class Delivery:
    """One message handed to a consumer, to be acknowledged by ``delivery_id``.

    Attributes:
        delivery_id: opaque id the consumer acknowledges with.
        idempotency_key: the key the relay published under (deduplicate on it).
        message: the published message.
        delivery_count: how many times this message was handed out (1 = first time).
    """

    delivery_id: str
    idempotency_key: str
    message: ScheduledMessage
    delivery_count: int = 1

    def __repr__(self) -> str:
        # The message repr already hides payload and headers.
        return (
            f"Delivery(delivery_id={self.delivery_id!r}, idempotency_key={self.idempotency_key!r},"
            f" message={self.message!r}, delivery_count={self.delivery_count})"
        )


def wire_text(value: object, what: str, broker: str) -> bytes:
    """Return the UTF-8 bytes a text field travels as.

    Every adapter's wire format is UTF-8; a value without an encoding is refused here,
    before anything is sent, instead of failing inside a client library.

    Raises:
        BrokerRejectedError: ``value`` is not a str, or holds a lone surrogate (permanent).
    """
    if not isinstance(value, str):
        raise BrokerRejectedError(f"{broker}: {what} is a {type(value).__name__}, not text")
    try:
        return value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise BrokerRejectedError(
            f"{broker}: {what} contains a lone surrogate (U+{ord(value[exc.start]):04X} at "
            f"position {exc.start}), which has no UTF-8 encoding; the message can never be "
            "sent"
        ) from None


def check_utf8_length(value: object, limit: int, what: str, broker: str, rule: str) -> bytes:
    """Return ``value`` in UTF-8, refusing more than ``limit`` bytes (not characters).

    ``100 * "€"`` is 100 characters but 300 bytes: protocols count bytes.

    Raises:
        BrokerRejectedError: unencodable, or longer than ``limit`` bytes (permanent).
    """
    raw = wire_text(value, what, broker)
    if len(raw) > limit:
        raise BrokerRejectedError(
            f"{broker}: {what} is {len(raw)} bytes in UTF-8; {rule} allows at most {limit} bytes",
            size=len(raw),
            limit=limit,
        )
    return raw


def check_message(message: object, broker: str) -> ScheduledMessage:
    """Require a ScheduledMessage whose every text field has a UTF-8 encoding.

    ``ScheduledMessage`` already refuses lone surrogates; this is the adapters' own
    guarantee for a message built some other way (a store that bypassed validation).

    Raises:
        ConfigurationTypeError: ``message`` is not a ScheduledMessage.
        BrokerRejectedError: a topic, message type or header that cannot be encoded.
    """
    if not isinstance(message, ScheduledMessage):
        raise ConfigurationTypeError(
            f"message must be a ScheduledMessage, not {type(message).__name__}"
        )
    wire_text(message.topic, "the topic", broker)
    wire_text(message.message_type, "the message type", broker)
    if not isinstance(message.payload, bytes):
        raise BrokerRejectedError(f"{broker}: the payload is not bytes")
    for name, value in message.headers.items():
        wire_text(name, "a header name", broker)
        wire_text(value, f"header {name!r}", broker)
    return message


def encode_headers(message: ScheduledMessage) -> str:
    """Encode the message's headers as compact, sorted JSON."""
    return json.dumps(dict(message.headers), separators=(",", ":"), sort_keys=True)


def decode_headers(raw: str | bytes | None) -> dict[str, str]:
    """Inverse of :func:`encode_headers` (missing -> no headers).

    Raises:
        RecurringConfigurationError: not a JSON object of strings.
    """
    if raw is None or raw in ("", b""):
        return {}
    value: Any = json.loads(raw)
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise RecurringConfigurationError("the Steeple-Headers header is not a JSON object")
    return value


_FRAMING_ALLOWANCE = 96
"""Bytes allowed for field names and framing around the fields :func:`encoded_size` counts."""


def encoded_size(message: ScheduledMessage, key: str) -> int:
    """Bytes the message occupies on the wire: payload plus metadata, in UTF-8.

    Counts the payload, the topic and message type in UTF-8, the idempotency key, the
    headers as the JSON they travel as, and a fixed allowance for field names.

    Raises:
        BrokerRejectedError: a text field cannot be encoded (see :func:`wire_text`).
    """
    return (
        len(message.payload)
        + len(wire_text(message.topic, "the topic", "the adapter"))
        + len(wire_text(message.message_type, "the message type", "the adapter"))
        + len(key)
        + len(encode_headers(message))
        + _FRAMING_ALLOWANCE
    )


def check_size(size: int, limit: int, broker: str) -> None:
    """Refuse a message over ``limit`` bytes for good.

    Raises:
        MessageTooLargeError: ``size > limit``.
    """
    if size > limit:
        raise MessageTooLargeError(
            f"the message is {size} bytes on the wire; {broker} accepts at most {limit}: "
            "send a reference to the data instead",
            size=size,
            limit=limit,
        )


def check_dedup_window(
    window: timedelta, required_window: timedelta, *, broker: str, what: str, fix: str
) -> None:
    """Refuse a dedup window shorter than the delivery window it must protect.

    Raises:
        BrokerConfigurationError: ``window < required_window``.
    """
    if window < required_window:
        raise BrokerConfigurationError(
            f"{broker}: {what} is {window}, shorter than the delivery window {required_window} "
            f"that it must protect; a retry after {window} could deliver a second copy. {fix}",
            window=window.total_seconds(),
            required=required_window.total_seconds(),
        )


def positive_duration(value: object, what: str) -> timedelta:
    """Require a positive timedelta.

    Raises:
        ConfigurationError: not a timedelta, or not positive.
    """
    if not isinstance(value, timedelta):
        raise ConfigurationError(f"{what} must be a datetime.timedelta, not {type(value).__name__}")
    if value <= timedelta(0):
        raise ConfigurationError(f"{what} must be positive, not {value}")
    return value


def redact_url(url: str) -> str:
    """Strip user name, password, query and fragment from a URL, for reprs and logs."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        if ":" in host:
            host = f"[{host}]"
        port = f":{parts.port}" if parts.port else ""
        return urlunsplit((parts.scheme, host + port, parts.path, "", ""))
    except ValueError:
        return "<url>"


def header_map(message: ScheduledMessage, key: str) -> Mapping[str, str]:
    """Build the metadata headers NATS and RabbitMQ messages carry."""
    out = {HEADER_TOPIC: message.topic, HEADER_TYPE: message.message_type, HEADER_KEY: key}
    if message.headers:
        out[HEADER_HEADERS] = encode_headers(message)
    return out


class _Closable(Protocol):
    async def close(self) -> None: ...


class _Startable(_Closable, Protocol):
    async def start(self) -> None: ...


_StartableT = TypeVar("_StartableT", bound=_Startable)


class AsyncLifecycle:
    """Mixin: ``async with obj`` awaits ``obj.start()`` on entry and ``obj.close()`` on exit.

    The class provides ``start`` and ``close`` itself; one that has nothing to start
    overrides ``__aenter__``.
    """

    async def __aenter__(self: _StartableT) -> _StartableT:
        await self.start()
        return self

    async def __aexit__(
        self: _Closable,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()


class AckUncertainError(Exception):
    """Raised inside an adapter when the request went out but its reply never came back."""


PROBE_RESERVE_SECONDS = 1.0
"""At most this much of a publish deadline is kept to ask the broker what happened."""


# Raised while building frames or encoding values: the same message fails the same way on
# every attempt, so retrying cannot help.
_DETERMINISTIC = (TypeError, ValueError, LookupError, OverflowError, struct.error)


def _unexpected(broker: str, exc: Exception, *, sent: bool) -> BrokerError:
    """Classify an exception no adapter mapped (a client library's own, or a bug)."""
    what = f"{type(exc).__name__}: {str(exc)[:200]}".encode("utf-8", "backslashreplace")
    detail = what.decode("utf-8")
    if isinstance(exc, _DETERMINISTIC):
        where = "publishing" if sent else "connecting"
        error: BrokerError = BrokerRejectedError(
            f"{broker}: the client library failed {where} with {detail}; retrying the same "
            "message cannot help"
        )
        if not sent:
            # The settings were refused before anything was sent: a configuration error.
            error = BrokerConfigurationError(
                f"{broker}: the client library refused the connection settings ({detail})"
            )
        return error
    return BrokerError(f"{broker}: unexpected failure ({detail}); it may be retried")


async def _prepare_within(
    broker: str, key: str, timeout: float, prepare: Callable[[], Awaitable[None]]
) -> None:
    """Run ``prepare`` (connecting) within the publication's deadline; nothing is sent yet."""
    try:
        async with asyncio.timeout(timeout):
            await prepare()
    except TimeoutError:
        raise BrokerTimeoutError(
            f"{broker}: connecting took longer than the {timeout:g} s deadline; nothing was sent",
            timeout=timeout,
            idempotency_key=key,
        ) from None
    except SteepleError:
        raise
    except Exception as exc:
        raise _unexpected(broker, exc, sent=False) from exc


async def publish_guarded(
    *,
    broker: str,
    key: str,
    timeout: float,
    transmit: Callable[[], Awaitable[BrokerReceipt]],
    probe: Callable[[], Awaitable[BrokerReceipt | None]],
    prepare: Callable[[], Awaitable[None]] | None = None,
) -> BrokerReceipt:
    """Run ``transmit`` within the deadline; when its reply is lost, ask ``probe``.

    The whole call finishes within ``timeout`` seconds: a quarter of it (at most one second)
    is reserved for the probe, which looks the idempotency key up on a fresh connection.
    ``prepare`` (connecting) runs first, inside the same deadline.

    Raises:
        RelayAcknowledgementError: the reply was lost (or the client library failed in an
            unexpected way) but the probe found the message: the broker accepted it (the
            error carries the receipt).
        BrokerTimeoutError: the reply was lost and the probe could not tell; the broker may
            have accepted the message. Republish with the same key.
        BrokerUnavailableError: the reply was lost and the broker is unreachable.
        BrokerRejectedError: the client library raised an error it raises while encoding
            (``TypeError``, ``ValueError``, ``struct.error``...) and the probe did not find
            the message: permanent.
        BrokerConfigurationError: ``prepare`` failed that way (the connection settings).
        BrokerError: whatever ``transmit`` raised otherwise; any other unexpected
            exception, as a retryable failure.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    if prepare is not None:
        await _prepare_within(broker, key, timeout, prepare)
    remaining = max(deadline - loop.time(), 0.001)
    reserve = min(remaining * 0.25, PROBE_RESERVE_SECONDS)
    unexpected: Exception | None = None
    try:
        async with asyncio.timeout(remaining - reserve):
            return await transmit()
    except (TimeoutError, AckUncertainError) as exc:
        original: BaseException = exc
    except SteepleError:
        raise
    except Exception as exc:
        # Something the adapter did not map escaped the client library. Whether the
        # broker got the message is unknown: ask before classifying the failure.
        original = unexpected = exc
    try:
        async with asyncio.timeout(reserve):
            found = await probe()
    except BrokerUnavailableError as exc:
        raise BrokerUnavailableError(
            f"{broker} became unreachable during the publication ({exc}); it may have "
            "accepted it: republish with the same idempotency key",
            idempotency_key=key,
        ) from original
    except (TimeoutError, BrokerError, OSError):
        # The probe is best effort: not knowing is reported as a timeout below.
        found = None
    if found is not None:
        raise RelayAcknowledgementError(
            found, f"its acknowledgement was lost ({broker} holds the key)"
        ) from original
    if unexpected is not None:
        raise _unexpected(broker, unexpected, sent=True) from unexpected
    if isinstance(original, AckUncertainError):
        # Not a slow broker: the connection failed with the request out (seconds before
        # the deadline, which the message must not claim ran out).
        what = f"lost the connection ({original}) before acknowledging the publication"
    else:
        what = f"did not acknowledge the publication within {timeout:g} s"
    raise BrokerTimeoutError(
        f"{broker} {what}; it may have accepted it: republish with the same idempotency key",
        timeout=timeout,
        idempotency_key=key,
    ) from original
