"""ScheduledMessage and BrokerReceipt: every limit, and reprs that never show content."""

from __future__ import annotations

import pytest

from steeple.core import (
    BrokerReceipt,
    ConfigurationError,
    RecurringConfigurationError,
    ScheduledMessage,
    limits,
)

KIB16 = 16 * 1024


def _msg(**overrides: object) -> ScheduledMessage:
    args: dict[str, object] = {
        "topic": "billing.daily",
        "message_type": "invoice.due",
        "payload": b"{}",
    }
    args.update(overrides)
    return ScheduledMessage(**args)  # type: ignore[arg-type]


def test_limits_are_the_contract() -> None:
    assert limits.MAX_PAYLOAD_BYTES == KIB16


def test_payload_exactly_16_kib_accepted_one_more_byte_rejected() -> None:
    assert len(_msg(payload=b"x" * KIB16).payload) == KIB16
    with pytest.raises(RecurringConfigurationError, match="16385 bytes"):
        _msg(payload=b"x" * (KIB16 + 1))


def test_payload_types() -> None:
    assert _msg(payload=bytearray(b"ab")).payload == b"ab"
    assert _msg(payload=memoryview(b"ab")).payload == b"ab"
    assert _msg(payload=b"").payload == b""
    with pytest.raises(RecurringConfigurationError, match="bytes"):
        _msg(payload="text")
    with pytest.raises(RecurringConfigurationError):
        _msg(payload=None)


@pytest.mark.parametrize("field", ["topic", "message_type"])
@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        ("", "empty"),
        ("   ", "empty"),
        ("x" * 256, "256 characters"),
        ("a\x00b", "control"),
        ("a\nb", "control"),
        ("a\tb", "control"),
        ("a\x7fb", "control"),
        ("a\u200bb", "invisible"),  # zero-width space (Cf)
        (" lead", "whitespace"),
        ("trail ", "whitespace"),
        (17, "must be a str"),
        (None, "must be a str"),
    ],
)
def test_bad_topics_and_types(field: str, value: object, fragment: str) -> None:
    with pytest.raises(RecurringConfigurationError, match=fragment):
        _msg(**{field: value})


@pytest.mark.parametrize("field", ["topic", "message_type"])
def test_topic_at_limit_and_unicode(field: str) -> None:
    assert getattr(_msg(**{field: "x" * 255}), field) == "x" * 255
    assert getattr(_msg(**{field: "émission.quotidienne"}), field) == "émission.quotidienne"


def test_headers_count_limit() -> None:
    at_limit = {f"h{i}": "v" for i in range(limits.MAX_HEADERS)}
    assert len(_msg(headers=at_limit).headers) == 32
    over = {f"h{i}": "v" for i in range(limits.MAX_HEADERS + 1)}
    with pytest.raises(RecurringConfigurationError, match="33 headers"):
        _msg(headers=over)


def test_header_name_and_value_lengths() -> None:
    assert _msg(headers={"n" * 128: "v" * 1024}).headers == {"n" * 128: "v" * 1024}
    with pytest.raises(RecurringConfigurationError, match="header name"):
        _msg(headers={"n" * 129: "v"})
    with pytest.raises(RecurringConfigurationError, match="1025 characters"):
        _msg(headers={"n": "v" * 1025})


@pytest.mark.parametrize(
    "headers",
    [
        {"": "v"},
        {"a\x00": "v"},
        {"a\nb": "v"},
        {"n": "a\r\nX-Injected: 1"},
        {"n": "nul\x00"},
        {"n": "c1\x85"},
        {"n": 5},
        {5: "v"},
        [("n", "v")],
        "n=v",
    ],
)
def test_bad_headers(headers: object) -> None:
    with pytest.raises(RecurringConfigurationError):
        _msg(headers=headers)


def test_headers_frozen_sorted_and_empty_value_allowed() -> None:
    msg = _msg(headers={"b": "2", "a": "", "c": "tab-free value"})
    assert list(msg.headers) == ["a", "b", "c"]
    with pytest.raises(TypeError):
        msg.headers["d"] = "x"  # type: ignore[index]
    assert _msg(headers=None).headers == {}
    assert _msg().headers == {}


def test_equality_and_hash() -> None:
    a = _msg(headers={"x": "1", "y": "2"})
    b = _msg(headers={"y": "2", "x": "1"})
    assert a == b
    assert hash(a) == hash(b)
    assert a != _msg(headers={"x": "1"})
    assert a != _msg(payload=b"other", headers={"x": "1", "y": "2"})


def test_repr_never_shows_payload_or_header_values() -> None:
    msg = _msg(payload=b"SECRET-PAYLOAD-BYTES", headers={"authorization": "Bearer SECRET-TOKEN"})
    for text in (repr(msg), str(msg)):
        assert "SECRET" not in text
        assert "Bearer" not in text
        assert "<20 bytes>" in text
        assert "<1 headers>" in text
        assert "billing.daily" in text


def test_configuration_errors_are_value_errors() -> None:
    with pytest.raises(ValueError, match="empty"):
        _msg(topic="")
    assert issubclass(RecurringConfigurationError, ConfigurationError)


def test_broker_receipt() -> None:
    receipt = BrokerReceipt(broker="memory", idempotency_key="stp1-" + "0" * 48)
    assert receipt.duplicate is False
    assert receipt.location is None
    assert BrokerReceipt("nats", "k", duplicate=True, location="7").duplicate is True
