"""Hypothesis strategies for steeple's domain values (valid values only).

Every value these strategies produce is accepted by core's validators, so property tests
can build on them without filtering.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from hypothesis import strategies as st

from steeple.core import limits
from steeple.core.config import RecurringConfig, RecurringDefinition
from steeple.core.messages import ScheduledMessage
from steeple.core.policies import MissedRunPolicy

__all__ = [
    "aware_datetimes",
    "cron_expressions",
    "cron_fields",
    "recurring_configs",
    "recurring_definitions",
    "scheduled_messages",
]

_FIELD_RANGES = {
    "minute": (0, 59),
    "hour": (0, 23),
    "day-of-month": (1, 31),
    "month": (1, 12),
    "weekday": (1, 7),
}
_NAME_ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789-._"


def aware_datetimes(
    min_value: datetime = datetime(1970, 1, 1, tzinfo=UTC),
    max_value: datetime = datetime(2100, 12, 31, 23, 59, tzinfo=UTC),
) -> st.SearchStrategy[datetime]:
    """Return aware UTC datetimes, whole milliseconds, within the calendar's span."""
    return st.datetimes(
        min_value=min_value.replace(tzinfo=None),
        max_value=max_value.replace(tzinfo=None),
        timezones=st.just(UTC),
    ).map(lambda d: d.replace(microsecond=d.microsecond // 1000 * 1000))


@st.composite
def _field_item(draw: st.DrawFn, field: str) -> str:
    low, high = _FIELD_RANGES[field]
    kind = draw(st.sampled_from(["number", "range", "step", "range-step"]))
    if kind == "number":
        return str(draw(st.integers(low, high)))
    if kind == "range":
        a = draw(st.integers(low, high))
        return f"{a}-{draw(st.integers(a, high))}"
    step = draw(st.integers(1, high))
    if kind == "step":
        start = draw(st.sampled_from(["*", str(draw(st.integers(low, high)))]))
        return f"{start}/{step}"
    a = draw(st.integers(low, high))
    return f"{a}-{draw(st.integers(a, high))}/{step}"


@st.composite
def cron_fields(draw: st.DrawFn, field: str) -> str:
    """Return one valid field (``"*"``, or a comma list of numbers, ranges and steps).

    Args:
        draw: supplied by hypothesis.
        field: ``"minute"``, ``"hour"``, ``"day-of-month"``, ``"month"`` or ``"weekday"``.
    """
    if draw(st.integers(0, 3)) == 0:
        return "*"
    return ",".join(draw(st.lists(_field_item(field), min_size=1, max_size=3)))


@st.composite
def cron_expressions(draw: st.DrawFn) -> str:
    """Return a valid five-field expression (numbers only; it may never fire)."""
    return " ".join(draw(cron_fields(field)) for field in _FIELD_RANGES)


@st.composite
def scheduled_messages(
    draw: st.DrawFn, max_payload: int = limits.MAX_PAYLOAD_BYTES
) -> ScheduledMessage:
    """Return valid messages: short topics and types, small headers, bounded payloads."""
    word = st.text(_NAME_ALPHABET, min_size=1, max_size=20).filter(lambda s: s.strip() == s)
    headers = st.dictionaries(word, st.text("abcxyz0123 ", max_size=10), max_size=3)
    return ScheduledMessage(
        draw(word),
        draw(word),
        draw(st.binary(max_size=max_payload)),
        draw(headers),
    )


@st.composite
def recurring_definitions(
    draw: st.DrawFn,
    names: st.SearchStrategy[str] | None = None,
    crons: st.SearchStrategy[str] | None = None,
    first_after: st.SearchStrategy[datetime] | None = None,
) -> RecurringDefinition:
    """Return valid definitions (calendars that fire at least once after ``first_after``).

    Args:
        draw: supplied by hypothesis.
        names: definition names (default: short lowercase names).
        crons: cron expressions (default: a few common ones that always fire).
        first_after: exclusive starts (default: 2000-2090).
    """
    if names is None:
        names = st.text(_NAME_ALPHABET, min_size=1, max_size=30)
    if crons is None:
        crons = st.sampled_from(
            ["* * * * *", "*/5 * * * *", "0 * * * *", "30 9 * * Mon-Fri", "0 0 1 * *"]
        )
    if first_after is None:
        first_after = aware_datetimes(
            datetime(2000, 1, 1, tzinfo=UTC), datetime(2090, 1, 1, tzinfo=UTC)
        )
    name, cron, start = draw(names), draw(crons), draw(first_after)
    policy = draw(st.sampled_from([MissedRunPolicy.CATCH_UP, MissedRunPolicy.COALESCE]))
    return RecurringDefinition(name, cron, start, policy, draw(scheduled_messages(max_payload=64)))


@st.composite
def recurring_configs(draw: st.DrawFn) -> RecurringConfig:
    """Return valid namespace configurations (window >= two leases, <= 7 days)."""
    lease = timedelta(seconds=draw(st.integers(1, 300)))
    window = timedelta(seconds=draw(st.integers(2 * lease // timedelta(seconds=1), 7 * 24 * 3600)))
    return RecurringConfig(
        draw(st.from_regex(r"[a-z0-9][a-z0-9._-]{0,20}", fullmatch=True)),
        draw(st.integers(1, limits.MAX_DEFINITIONS)),
        draw(st.integers(1, limits.MAX_OCCURRENCES)),
        delivery_window=window,
        lease_duration=lease,
    )
