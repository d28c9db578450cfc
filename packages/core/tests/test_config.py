"""RecurringConfig and RecurringDefinition: every limit and rule, with clear errors."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest

from steeple.core import (
    CronCalendar,
    InvalidCronExpression,
    MissedRunPolicy,
    RecurringConfig,
    RecurringConfigurationError,
    RecurringDefinition,
    ScheduledMessage,
)

S = timedelta(seconds=1)
MSG = ScheduledMessage("billing.daily", "invoice.due", b"SECRET-PAYLOAD", {"k": "SECRET-HEADER"})
AFTER = datetime(2030, 1, 1, tzinfo=UTC)


# --- RecurringConfig -----------------------------------------------------------------------


def test_defaults() -> None:
    config = RecurringConfig("tenant-a", 10, 100)
    assert config.delivery_window == timedelta(days=1)
    assert config.lease_duration == timedelta(seconds=60)


@pytest.mark.parametrize("namespace", ["a", "tenant-a", "t.e_s-t", "0abc", "a" * 63, "x9"])
def test_good_namespaces(namespace: str) -> None:
    assert RecurringConfig(namespace, 1, 1).namespace == namespace


@pytest.mark.parametrize(
    "namespace",
    ["", "A", "Tenant", "-a", ".a", "_a", "a" * 64, "a b", "a\n", "a\x00", "é", "a/b", 5, None],
)
def test_bad_namespaces(namespace: object) -> None:
    with pytest.raises(RecurringConfigurationError, match="namespace"):
        RecurringConfig(namespace, 1, 1)


@pytest.mark.parametrize(("defs", "occs"), [(1, 1), (10_000, 100_000), (5000, 1)])
def test_quotas_in_range(defs: int, occs: int) -> None:
    config = RecurringConfig("ns", defs, occs)
    assert (config.max_definitions, config.max_occurrences) == (defs, occs)


@pytest.mark.parametrize(
    ("defs", "occs", "fragment"),
    [
        (0, 1, "max_definitions"),
        (10_001, 1, "max_definitions"),
        (-1, 1, "max_definitions"),
        (True, 1, "max_definitions"),
        (1.0, 1, "max_definitions"),
        (1, 0, "max_occurrences"),
        (1, 100_001, "max_occurrences"),
        (1, "5", "max_occurrences"),
    ],
)
def test_quotas_out_of_range(defs: object, occs: object, fragment: str) -> None:
    with pytest.raises(RecurringConfigurationError, match=fragment):
        RecurringConfig("ns", defs, occs)  # type: ignore[arg-type]


@pytest.mark.parametrize("lease", [S, 300 * S, 60 * S, timedelta(milliseconds=1500)])
def test_leases_in_range(lease: timedelta) -> None:
    assert RecurringConfig("ns", 1, 1, lease_duration=lease).lease_duration == lease


@pytest.mark.parametrize(
    ("lease", "fragment"),
    [
        (timedelta(milliseconds=999), "between 1 and 300"),
        (timedelta(seconds=300, microseconds=1000), "between 1 and 300"),
        (timedelta(0), "between 1 and 300"),
        (-S, "between 1 and 300"),
        (timedelta(seconds=2, microseconds=1), "whole number of milliseconds"),
        (60, "timedelta"),
    ],
)
def test_leases_out_of_range(lease: object, fragment: str) -> None:
    with pytest.raises(RecurringConfigurationError, match=fragment):
        RecurringConfig("ns", 1, 1, lease_duration=lease)  # type: ignore[arg-type]


def test_window_limits() -> None:
    assert RecurringConfig("ns", 1, 1, delivery_window=timedelta(days=7)).delivery_window == (
        timedelta(days=7)
    )
    with pytest.raises(RecurringConfigurationError, match="at most 7 days"):
        RecurringConfig("ns", 1, 1, delivery_window=timedelta(days=7, milliseconds=1))
    with pytest.raises(RecurringConfigurationError, match="whole number of milliseconds"):
        RecurringConfig("ns", 1, 1, delivery_window=timedelta(hours=1, microseconds=1))
    with pytest.raises(RecurringConfigurationError, match="timedelta"):
        RecurringConfig("ns", 1, 1, delivery_window="1d")  # type: ignore[arg-type]


def test_window_must_hold_two_leases() -> None:
    lease = timedelta(seconds=300)
    ok = RecurringConfig("ns", 1, 1, delivery_window=2 * lease, lease_duration=lease)
    assert ok.delivery_window == timedelta(minutes=10)
    with pytest.raises(RecurringConfigurationError, match="two leases"):
        RecurringConfig(
            "ns", 1, 1, delivery_window=2 * lease - timedelta(milliseconds=1), lease_duration=lease
        )
    with pytest.raises(RecurringConfigurationError, match="two leases"):
        RecurringConfig("ns", 1, 1, delivery_window=timedelta(0))


def test_fingerprint_is_canonical() -> None:
    config = RecurringConfig("ns", 3, 4, delivery_window=timedelta(hours=2), lease_duration=30 * S)
    assert config.fingerprint() == {
        "namespace": "ns",
        "max_definitions": 3,
        "max_occurrences": 4,
        "delivery_window_ms": 7_200_000,
        "lease_duration_ms": 30_000,
    }


def test_config_is_frozen() -> None:
    config = RecurringConfig("ns", 1, 1)
    with pytest.raises(AttributeError):
        config.namespace = "other"  # type: ignore[misc]


# --- RecurringDefinition ---------------------------------------------------------------------


def _definition(**overrides: object) -> RecurringDefinition:
    args: dict[str, object] = {
        "name": "daily-invoices",
        "cron": "30 6 * * *",
        "first_after": AFTER,
        "policy": MissedRunPolicy.CATCH_UP,
        "message": MSG,
    }
    args.update(overrides)
    return RecurringDefinition(**args)  # type: ignore[arg-type]


def test_definition_basics() -> None:
    d = _definition()
    assert isinstance(d.cron, CronCalendar)
    assert d.cron.expression == "30 6 * * *"
    assert d.first_due == datetime(2030, 1, 1, 6, 30, tzinfo=UTC)
    assert _definition(cron=CronCalendar.parse("30 6 * * *")) == d
    assert _definition(policy=MissedRunPolicy.COALESCE).policy is MissedRunPolicy.COALESCE


def test_first_after_is_exclusive_and_normalized() -> None:
    on_the_dot = _definition(first_after=datetime(2030, 1, 1, 6, 30, tzinfo=UTC))
    assert on_the_dot.first_due == datetime(2030, 1, 2, 6, 30, tzinfo=UTC)
    zoned = _definition(first_after=AFTER.astimezone(timezone(timedelta(hours=-8))))
    assert zoned.first_after == AFTER
    assert zoned.first_after.utcoffset() == timedelta(0)
    # Kept to milliseconds, like the stores.
    fine = _definition(first_after=AFTER + timedelta(microseconds=1999))
    assert fine.first_after == AFTER + timedelta(milliseconds=1)


def test_naive_first_after_rejected_with_a_clear_message() -> None:
    with pytest.raises(RecurringConfigurationError, match=r"timezone-aware.*tzinfo=UTC"):
        _definition(first_after=datetime(2030, 1, 1))
    with pytest.raises(RecurringConfigurationError, match="datetime"):
        _definition(first_after="2030-01-01T00:00:00Z")


def test_never_firing_calendar_rejected() -> None:
    with pytest.raises(RecurringConfigurationError, match="could never publish"):
        _definition(cron="0 0 30 2 *")


def test_calendar_exhausted_after_first_after_rejected() -> None:
    with pytest.raises(RecurringConfigurationError, match="could never publish"):
        _definition(cron="0 0 1 1 *", first_after=datetime(2100, 1, 1, tzinfo=UTC))
    last = _definition(cron="0 0 1 1 *", first_after=datetime(2099, 12, 31, tzinfo=UTC))
    assert last.first_due == datetime(2100, 1, 1, tzinfo=UTC)


@pytest.mark.parametrize("cron", ["", "* * * *", "*/0 * * * *", "0 0 * * 0", "@daily", 5])
def test_bad_cron_rejected(cron: object) -> None:
    with pytest.raises(InvalidCronExpression):
        _definition(cron=cron)


@pytest.mark.parametrize(
    ("name", "fragment"),
    [
        ("", "empty"),
        (" ", "empty"),
        ("x" * 201, "201 characters"),
        ("a\x00b", "control"),
        ("a\nb", "control"),
        ("a\u202eb", "invisible"),  # right-to-left override
        (None, "must be a str"),
    ],
)
def test_bad_names(name: object, fragment: str) -> None:
    with pytest.raises(RecurringConfigurationError, match=fragment):
        _definition(name=name)


def test_name_at_limit() -> None:
    assert _definition(name="n" * 200).name == "n" * 200


@pytest.mark.parametrize("policy", [MissedRunPolicy.RUN_ONCE, "catch_up", None])
def test_bad_policy(policy: object) -> None:
    with pytest.raises(RecurringConfigurationError, match="policy"):
        _definition(policy=policy)


def test_bad_message() -> None:
    with pytest.raises(RecurringConfigurationError, match="ScheduledMessage"):
        _definition(message={"topic": "t"})


def test_definition_repr_hides_payload_and_headers() -> None:
    text = repr(_definition())
    assert "SECRET" not in text
    assert "daily-invoices" in text


def test_definitions_are_frozen_and_hashable() -> None:
    d = _definition()
    assert hash(d) == hash(_definition())
    with pytest.raises(AttributeError):
        d.name = "x"  # type: ignore[misc]


def test_from_fingerprint_rebuilds_the_configuration() -> None:
    config = RecurringConfig("ns", 3, 4, delivery_window=timedelta(hours=2), lease_duration=30 * S)
    assert RecurringConfig.from_fingerprint(config.fingerprint()) == config
    good = config.fingerprint()
    for bad in (
        {},
        {**good, "extra": 1},
        {k: v for k, v in good.items() if k != "namespace"},
        {**good, "lease_duration_ms": "30000"},
        {**good, "lease_duration_ms": True},
        {**good, "delivery_window_ms": 2**64},
        {**good, "lease_duration_ms": 0},
        {**good, "max_definitions": 10**9},
        {**good, "namespace": "Not Valid"},
    ):
        with pytest.raises(RecurringConfigurationError):
            RecurringConfig.from_fingerprint(bad)
    with pytest.raises(RecurringConfigurationError):
        RecurringConfig.from_fingerprint([1, 2])  # type: ignore[arg-type]
