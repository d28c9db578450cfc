"""What a user reads when a cron expression or an instant is refused, and search edges.

Each refusal names the field and the text to fix, in words a user can act on; the
answers do not depend on the machine's time zone.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta, timezone, tzinfo

import pytest

from steeple.core.calendar import CronCalendar
from steeple.core.errors import (
    ConfigurationError,
    ConfigurationTypeError,
    InvalidCronExpression,
)


def utc(year: int, month: int, day: int, hour: int = 0, minute: int = 0) -> datetime:
    return datetime(year, month, day, hour, minute, tzinfo=UTC)


def rejected(expression: object) -> InvalidCronExpression:
    with pytest.raises(InvalidCronExpression) as raised:
        CronCalendar.parse(expression)  # type: ignore[arg-type]
    return raised.value


@pytest.mark.parametrize(
    ("expression", "field", "reason"),
    [
        ("@daily", None, "shorthands such as @daily are not supported; write the five fields"),
        (
            "0\u00a00 * * *",
            "minute",
            "contains U+00A0, a space that is not a field separator "
            "(only ASCII space, tab, CR and LF separate fields)",
        ),
        ("0 0 * * \x00", "weekday", "contains the character U+0000, which is not allowed"),
        (
            "0 \u00e9 * * *",
            "hour",
            "contains the character '\u00e9' (U+00E9), which is not allowed",
        ),
        (
            "0 0 * * 1#2",
            "weekday",
            "contains the character '#' (U+0023), which is not allowed ('#' is not supported)",
        ),
        ("60 * * * *", "minute", "'60': 60 is out of range 0-59"),
        ("0 0 * * 8", "weekday", "'8': 8 is out of range 1-7 (1=Sunday ... 7=Saturday)"),
        ("JAN * * * *", "minute", "'JAN': names such as 'JAN' are not allowed in the minute field"),
        ("0 0 1,,2 * *", "day-of-month", "'1,,2': empty list item"),
        ("0 0 L * *", "day-of-month", "'L': 'L', 'W', '#' and 'H' are not supported"),
        ("? * * * *", "minute", "'?': '?' is allowed only in the day-of-month and weekday fields"),
        ("0 0 * * 1-2-3", "weekday", "'1-2-3': '1-2-3' has more than one '-'"),
    ],
)
def test_a_refusal_names_the_field_and_says_what_is_wrong(
    expression: str, field: str | None, reason: str
) -> None:
    error = rejected(expression)
    assert (error.field, error.reason) == (field, reason)


def test_a_character_run_into_a_name_belongs_to_that_names_field() -> None:
    # "X#" is one token: the fifth field, not a sixth.
    assert rejected("0 0 * * X#").field == "weekday"


def test_a_value_that_is_not_text_is_shown_by_its_type() -> None:
    error = rejected(12)
    assert (error.expression, error.reason) == ("<int>", "expected a str, got int")


def test_a_huge_expression_is_shown_by_its_own_text() -> None:
    error = rejected("1" * 1001)
    assert error.expression.startswith("1" * 20)
    assert error.reason == "longer than 1000 characters (1001)"


def test_a_calendar_built_directly_refuses_an_expression_that_is_not_text() -> None:
    days = frozenset({1})
    with pytest.raises(ConfigurationTypeError, match=r"^expression must be a str, not int$"):
        CronCalendar(12, days, frozenset({0}), days, days, days)  # type: ignore[arg-type]


class _BrokenZone(tzinfo):
    def utcoffset(self, dt: datetime | None) -> timedelta | None:
        raise RuntimeError("no offset today")

    def dst(self, dt: datetime | None) -> timedelta | None:
        return None

    def tzname(self, dt: datetime | None) -> str | None:
        return None


def test_bad_instants_are_refused_with_what_to_fix() -> None:
    calendar = CronCalendar.parse("0 9 * * *")
    with pytest.raises(ConfigurationTypeError) as not_a_datetime:
        calendar.next_after("2024-01-01")  # type: ignore[arg-type]
    assert str(not_a_datetime.value) == "expected a timezone-aware datetime, got str"
    with pytest.raises(ConfigurationError) as broken:
        calendar.matches(datetime(2024, 1, 1, tzinfo=_BrokenZone()))
    assert str(broken.value) == "the datetime's tzinfo fails to give an offset (RuntimeError)"
    with pytest.raises(ConfigurationError) as naive:
        calendar.next_after(datetime(2024, 1, 1))
    assert str(naive.value) == (
        "naive datetime 2024-01-01T00:00:00 rejected: instants must be timezone-aware "
        "(UTC), e.g. datetime(..., tzinfo=datetime.UTC)"
    )


def test_day_30_skips_february_of_a_leap_year() -> None:
    calendar = CronCalendar.parse("0 0 30 * *")
    assert calendar.next_after(utc(2024, 2, 1)) == utc(2024, 3, 30)


def test_the_next_allowed_hour_starts_at_its_first_minute() -> None:
    # From 09:45 the next hour allowed is 10: its first minute, the same day.
    calendar = CronCalendar.parse("0,30 10 * * *")
    assert calendar.next_after(utc(2024, 1, 1, 9, 45)) == utc(2024, 1, 1, 10, 0)


@pytest.fixture
def machine_far_from_utc() -> Iterator[None]:
    if not hasattr(time, "tzset"):
        pytest.skip("time.tzset is Unix-only")
    before = os.environ.get("TZ")
    os.environ["TZ"] = "Asia/Kolkata"
    time.tzset()
    try:
        yield
    finally:
        if before is None:
            del os.environ["TZ"]
        else:
            os.environ["TZ"] = before
        time.tzset()


@pytest.mark.usefixtures("machine_far_from_utc")
def test_answers_do_not_depend_on_the_machines_time_zone() -> None:
    calendar = CronCalendar.parse("0 9 * * *")
    assert calendar.matches(utc(2024, 1, 1, 9))
    assert not calendar.matches(utc(2024, 1, 1, 14, 30))
    assert calendar.next_after(utc(2024, 1, 1, 8)) == utc(2024, 1, 1, 9)


@pytest.mark.usefixtures("machine_far_from_utc")
def test_an_instant_in_another_offset_is_converted_to_utc_not_to_the_machines_zone() -> None:
    # 03:00 at UTC-5 is 08:00 UTC (13:30 on this machine's clock): 09:00 UTC the same day.
    calendar = CronCalendar.parse("0 9 * * *")
    east_coast = datetime(2024, 1, 1, 3, tzinfo=timezone(timedelta(hours=-5)))
    assert calendar.next_after(east_coast) == utc(2024, 1, 1, 9)


FIELD_BOUNDS = (("minutes", 0, 59), ("hours", 0, 23), ("days_of_month", 1, 31),
                ("months", 1, 12), ("weekdays", 1, 7))  # fmt: skip


def _build(position: int, values: object) -> CronCalendar:
    sets: list[object] = [frozenset({bounds[1]}) for bounds in FIELD_BOUNDS]
    sets[position] = values
    return CronCalendar("direct", *sets)  # type: ignore[arg-type]


@pytest.mark.parametrize("position", range(5))
def test_a_calendar_built_directly_takes_each_fields_bounds_and_nothing_past_them(
    position: int,
) -> None:
    name, minimum, maximum = FIELD_BOUNDS[position]
    built = _build(position, frozenset({minimum, maximum}))
    assert getattr(built, name) == {
        minimum,
        maximum,
    }
    out_of_range = f"^{name} values must be integers in {minimum}-{maximum}$"
    for bad in ({minimum - 1}, {maximum + 1}, {True}, {str(minimum)}):
        with pytest.raises(ConfigurationError, match=out_of_range):
            _build(position, frozenset(bad))
    empty = f"^{name} must be a non-empty frozenset$"
    with pytest.raises(ConfigurationError, match=empty) as refused:
        _build(position, frozenset())
    assert not isinstance(refused.value, TypeError)
    with pytest.raises(ConfigurationTypeError, match=empty):
        _build(position, {minimum})
