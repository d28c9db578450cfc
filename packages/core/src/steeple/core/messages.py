"""Messages the recurring store publishes, and what a broker gives back."""

from __future__ import annotations

import math
import unicodedata
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Final

import attrs

from steeple.core import limits
from steeple.core._frozen import new, writable
from steeple.core._validate import encodable, shown, text
from steeple.core.errors import (
    ConfigurationError,
    ConfigurationTypeError,
    RecurringConfigurationError,
)

__all__ = [
    "BrokerReceipt",
    "ScheduledMessage",
    "check_idempotency_key",
    "check_publish_timeout",
    "trusted_receipt",
]


def _freeze_headers(value: Mapping[str, str] | None) -> Mapping[str, str]:
    if value is None:
        return MappingProxyType({})
    if not isinstance(value, Mapping):
        raise RecurringConfigurationError(
            f"headers must be a mapping of str to str, not {type(value).__name__}"
        )
    if len(value) > limits.MAX_HEADERS:
        raise RecurringConfigurationError(
            f"a message has {len(value)} headers; the limit is {limits.MAX_HEADERS}"
        )
    out: dict[str, str] = {}
    for k, v in value.items():
        text(
            k,
            "header name",
            max_len=limits.MAX_HEADER_NAME_LENGTH,
            error=RecurringConfigurationError,
        )
        if not isinstance(v, str):
            raise RecurringConfigurationError(
                f"header {k!r} must have a str value, not {type(v).__name__}"
            )
        if len(v) > limits.MAX_HEADER_VALUE_LENGTH:
            raise RecurringConfigurationError(
                f"header {k!r} is {len(v)} characters; the limit is "
                f"{limits.MAX_HEADER_VALUE_LENGTH}"
            )
        # C0, DEL and C1 controls (CR/LF included) could split or forge a header downstream.
        if any(unicodedata.category(c) == "Cc" for c in v):
            raise RecurringConfigurationError(f"header {k!r} contains a control character")
        # A lone surrogate has no UTF-8 form: every broker and store would fail on it later.
        encodable(v, f"header {k!r}", RecurringConfigurationError)
        out[k] = v
    return MappingProxyType(dict(sorted(out.items())))


def _payload(value: Any) -> bytes:
    if isinstance(value, bytearray | memoryview):
        try:
            value = bytes(value)
        except (ValueError, TypeError, BufferError):  # a released memoryview, for one
            raise RecurringConfigurationError("payload is an unreadable buffer") from None
    if not isinstance(value, bytes):
        raise RecurringConfigurationError(
            f"payload must be bytes, not {type(value).__name__}; encode it first"
        )
    if len(value) > limits.MAX_PAYLOAD_BYTES:
        raise RecurringConfigurationError(
            f"payload is {len(value)} bytes; the limit is {limits.MAX_PAYLOAD_BYTES} (16 KiB): "
            "send a reference to the data instead"
        )
    return value


@attrs.frozen(repr=False, eq=True)
class ScheduledMessage:
    """What a recurring definition publishes: topic, message type, raw payload, headers.

    Raises:
        RecurringConfigurationError: empty/too long/control characters in topic or type,
            a payload over 16 KiB, bad headers.
    """

    topic: str = attrs.field()
    message_type: str = attrs.field()
    payload: bytes = attrs.field(converter=_payload)
    headers: Mapping[str, str] = attrs.field(factory=dict, converter=_freeze_headers)

    @topic.validator
    def _check_topic(self, _: object, value: str) -> None:
        text(value, "topic", max_len=limits.MAX_TOPIC_LENGTH, error=RecurringConfigurationError)

    @message_type.validator
    def _check_type(self, _: object, value: str) -> None:
        text(
            value,
            "message_type",
            max_len=limits.MAX_TOPIC_LENGTH,
            error=RecurringConfigurationError,
        )

    def __repr__(self) -> str:
        # Payloads and headers may hold personal data: never shown.
        return (
            f"ScheduledMessage(topic={self.topic!r}, message_type={self.message_type!r}, "
            f"payload=<{len(self.payload)} bytes>, headers=<{len(self.headers)} headers>)"
        )

    def __hash__(self) -> int:
        return hash((self.topic, self.message_type, self.payload, tuple(self.headers.items())))


def _receipt_text(value: object, what: str, max_len: int) -> str:
    if not isinstance(value, str):
        raise ConfigurationTypeError(f"{what} must be a str, not {type(value).__name__}")
    if len(value) > max_len:
        raise ConfigurationError(f"{what} is {len(value)} characters; the limit is {max_len}")
    return encodable(value, what)


def _receipt_broker(_: object, __: object, value: Any) -> None:
    if not _receipt_text(value, "broker", limits.MAX_NAME_LENGTH):
        raise ConfigurationError("broker must not be empty")


def _receipt_key(_: object, __: object, value: Any) -> None:
    _receipt_text(value, "idempotency_key", limits.MAX_NAME_LENGTH)


def _receipt_duplicate(_: object, __: object, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigurationTypeError(f"duplicate must be a bool, not {shown(value)}")


def _receipt_location(_: object, __: object, value: Any) -> None:
    if value is not None:
        _receipt_text(value, "location", limits.MAX_LOCATION_LENGTH)


@attrs.frozen(weakref_slot=False)
class BrokerReceipt:
    """A broker's word that it accepted a message.

    Attributes:
        broker: which adapter (``"nats"``, ``"redis"``, ``"sqlite"``...).
        idempotency_key: the key the message was published under.
        duplicate: the broker recognised the key and did not store a second copy.
        location: where it landed (stream sequence, entry id, journal row), if known.

    Raises:
        ConfigurationTypeError: a field of the wrong type (``duplicate`` must be a bool).
        ConfigurationError: an empty broker name, a field too long (broker and key: 200
            characters, location: 1024), or a lone surrogate (stores must persist it).
    """

    broker: str = attrs.field(validator=_receipt_broker)
    idempotency_key: str = attrs.field(validator=_receipt_key)
    duplicate: bool = attrs.field(default=False, validator=_receipt_duplicate)
    location: str | None = attrs.field(default=None, validator=_receipt_location)


def trusted_receipt(broker: str, idempotency_key: str, *, duplicate: bool = False) -> BrokerReceipt:
    """Build a :class:`BrokerReceipt` from values a broker model produced, without checks.

    For a simulated broker only: its name is a constant and the key one the relay derived
    (printable ASCII, 53 characters). Every real broker goes through ``BrokerReceipt(...)``,
    which checks every field; a test requires both to build equal receipts.
    """
    # Filled in as a plain object, then made a BrokerReceipt (steeple.core._frozen).
    receipt: Any = new(_WRITABLE_RECEIPT)
    receipt.broker = broker
    receipt.idempotency_key = idempotency_key
    receipt.duplicate = duplicate
    receipt.location = None
    receipt.__class__ = BrokerReceipt
    return receipt  # type: ignore[no-any-return]  # a BrokerReceipt, every field set


_WRITABLE_RECEIPT: Final = writable(BrokerReceipt)


def check_publish_timeout(timeout: object) -> float:
    """Validate a publish timeout in seconds (finite, > 0): every broker refuses others.

    Raises:
        ConfigurationError: not a positive finite number.
    """
    if isinstance(timeout, bool) or not isinstance(timeout, int | float):
        raise ConfigurationError(f"timeout must be a number of seconds, not {timeout!r}")
    value = float(timeout)
    if not math.isfinite(value) or value <= 0:
        raise ConfigurationError(f"timeout must be a positive number of seconds, not {timeout!r}")
    return value


def check_idempotency_key(key: object) -> str:
    """Validate an idempotency key: printable ASCII without spaces, 1..200 characters.

    Every broker refuses other keys before sending anything.

    Raises:
        ConfigurationError: empty, too long or not a plain token.
    """
    if not isinstance(key, str) or not key:
        raise ConfigurationError("idempotency_key must be a non-empty str")
    if len(key) > limits.MAX_NAME_LENGTH:
        raise ConfigurationError(
            f"idempotency_key is {len(key)} characters; the limit is {limits.MAX_NAME_LENGTH}"
        )
    # Printable ASCII without spaces (33..126), checked in C: once per publication.
    if not (key.isascii() and key.isprintable() and " " not in key):
        raise ConfigurationError("idempotency_key must be printable ASCII without spaces")
    return key
