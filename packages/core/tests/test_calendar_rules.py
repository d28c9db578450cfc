"""Rule-by-rule tests of CronCalendar against DESIGN.md, section "The calendar (exactly)"."""

from __future__ import annotations

import ast
import pickle
import subprocess
import sys
from datetime import UTC, date, datetime, timedelta, timezone, tzinfo
from itertools import islice
from pathlib import Path

import attrs
import pytest

import steeple.core.calendar as calendar_module
from steeple.core.calendar import FIRST_INSTANT, LAST_INSTANT, CronCalendar
from steeple.core.errors import InvalidCronExpression

FIELDS = ("minute", "hour", "day-of-month", "month", "weekday")


def utc(
    year: int, month: int, day: int, hour: int = 0, minute: int = 0, second: int = 0, us: int = 0
) -> datetime:
    return datetime(year, month, day, hour, minute, second, us, tzinfo=UTC)


def rejected(expression: object) -> InvalidCronExpression:
    with pytest.raises(InvalidCronExpression) as raised:
        CronCalendar.parse(expression)  # type: ignore[arg-type]
    return raised.value


def field_sets(expression: str) -> tuple[set[int], ...]:
    calendar = CronCalendar.parse(expression)
    fields = (
        calendar.minutes,
        calendar.hours,
        calendar.days_of_month,
        calendar.months,
        calendar.weekdays,
    )
    assert all(type(values) is frozenset for values in fields)
    return tuple(set(values) for values in fields)


ALL_MINUTES = set(range(60))
ALL_HOURS = set(range(24))
ALL_DAYS = set(range(1, 32))
ALL_MONTHS = set(range(1, 13))
ALL_WEEKDAYS = set(range(1, 8))


# --- tokens and separators --------------------------------------------------------------


def test_star_expression_selects_every_value() -> None:
    assert field_sets("* * * * *") == (
        ALL_MINUTES,
        ALL_HOURS,
        ALL_DAYS,
        ALL_MONTHS,
        ALL_WEEKDAYS,
    )


@pytest.mark.parametrize(
    "expression",
    ["0\t9\t*\t*\tMon", "0\r\n9\n*\r*  Mon", "\n\t 0 9 * * Mon \r\n", "0 \t\r\n 9 * * Mon"],
)
def test_ascii_space_tab_cr_lf_runs_separate_fields(expression: str) -> None:
    assert CronCalendar.parse(expression) == CronCalendar.parse("0 9 * * Mon")
    assert CronCalendar.parse(expression).expression == expression


@pytest.mark.parametrize(
    ("space", "name"),
    [
        ("\u00a0", "U+00A0"),  # no-break space
        ("\u2003", "U+2003"),  # em space
        ("\u3000", "U+3000"),  # ideographic space
        ("\u202f", "U+202F"),  # narrow no-break space
        ("\x0b", "U+000B"),  # vertical tab: ASCII whitespace, but not a separator
        ("\x0c", "U+000C"),  # form feed
        ("\x85", "U+0085"),  # next line
    ],
)
def test_other_spaces_are_not_separators(space: str, name: str) -> None:
    error = rejected(f"0{space}9 * * * *")
    assert error.field == "minute"
    assert name in error.reason
    assert "separator" in error.reason
    # Between two otherwise valid fields: still rejected, never read as a separator.
    error = rejected(f"0 9{space}* * * *")
    assert error.field == "hour"


@pytest.mark.parametrize(
    ("expression", "field"),
    [
        ("0 0\x00 * * *", "hour"),
        ("\u0663 * * * *", "minute"),  # ARABIC-INDIC DIGIT THREE
        ("0 \uff11 * * *", "hour"),  # FULLWIDTH DIGIT ONE
        ("0 0 \u00b2 * *", "day-of-month"),  # SUPERSCRIPT TWO
        ("0 0 1 \u216b *", "month"),  # ROMAN NUMERAL TWELVE
        ("0 0 * * Mon\u200b", "weekday"),  # ZERO WIDTH SPACE
        ("0 0 * * M\u00f6n", "weekday"),
        ("+5 * * * *", "minute"),
        ("1_0 * * * *", "minute"),
        ("0 0 * * 1;", "weekday"),
    ],
)
def test_characters_outside_the_grammar_are_rejected(expression: str, field: str) -> None:
    error = rejected(expression)
    assert error.field == field
    assert "U+" in error.reason


def test_characters_past_the_fifth_field_are_rejected_for_the_whole() -> None:
    error = rejected("0 0 * * * \u00a0")
    assert error.field is None


@pytest.mark.parametrize("value", [None, b"* * * * *", 5, ["*"] * 5, 0.5])
def test_non_str_is_rejected(value: object) -> None:
    error = rejected(value)
    assert "expected a str" in error.reason
    assert type(value).__name__ in error.reason


def test_huge_expressions_are_rejected_before_parsing() -> None:
    at_limit = "0" * 992 + " * * * *"  # leading zeros: a valid expression of 1000 chars
    assert len(at_limit) == 1000
    assert CronCalendar.parse(at_limit).minutes == {0}
    error = rejected(at_limit + " ")
    assert error.field is None
    assert "longer than 1000" in error.reason
    assert len(str(error)) < 300  # the message does not echo the whole input
    assert rejected("* " * 100_000).field is None


@pytest.mark.parametrize(
    ("expression", "count"),
    [
        ("", 0),
        ("   \t\n", 0),
        ("*", 1),
        ("*/5 * * *", 4),
        ("0 12 * * * 2031", 6),
        ("0 0 0 * * * *", 7),
        ("0 12 ***", 3),
        ("0 0 * * Mon, Fri", 6),
        ("0 0 * * Mon ,Fri", 6),
    ],
)
def test_exactly_five_fields(expression: str, count: int) -> None:
    error = rejected(expression)
    assert error.field is None
    assert f"expected 5 fields (minute hour day-of-month month weekday), got {count}" == (
        error.reason
    )


@pytest.mark.parametrize(
    "expression", ["@daily", "@hourly", "@weekly", "@monthly", "@yearly", "@every 1h", "@reboot"]
)
def test_shorthands_are_rejected(expression: str) -> None:
    error = rejected(expression)
    assert error.field is None
    assert "shorthand" in error.reason


# --- ranges of values -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expression", "field", "shown"),
    [
        ("60 * * * *", "minute", "60 is out of range 0-59"),
        ("0 24 * * *", "hour", "24 is out of range 0-23"),
        ("0 0 0 * *", "day-of-month", "0 is out of range 1-31"),
        ("0 0 32 * *", "day-of-month", "32 is out of range 1-31"),
        ("0 0 * 0 *", "month", "0 is out of range 1-12"),
        ("0 0 * 13 *", "month", "13 is out of range 1-12"),
        ("0 0 * * 0", "weekday", "0 is out of range 1-7 (1=Sunday ... 7=Saturday)"),
        ("0 0 * * 8", "weekday", "8 is out of range 1-7 (1=Sunday ... 7=Saturday)"),
        ("0 0 * * 0-5", "weekday", "range start 0 is out of range"),
        ("50-61 * * * *", "minute", "range end 61 is out of range 0-59"),
        ("99999999999999999999 * * * *", "minute", "out of range 0-59"),
    ],
)
def test_values_outside_the_field_are_rejected(expression: str, field: str, shown: str) -> None:
    error = rejected(expression)
    assert error.field == field
    assert shown in error.reason
    assert f"in the {field} field" in str(error)


def test_bounds_of_every_field_are_accepted() -> None:
    assert field_sets("0,59 0,23 1,31 1,12 1,7") == (
        {0, 59},
        {0, 23},
        {1, 31},
        {1, 12},
        {1, 7},
    )


def test_leading_zeros_are_fine() -> None:
    assert field_sets("007 08 09 010 0001") == ({7}, {8}, {9}, {10}, {1})
    assert CronCalendar.parse("*/05 * * * *").minutes == set(range(0, 60, 5))


def test_weekday_numbering_is_1_sunday_to_7_saturday() -> None:
    saturday = utc(2025, 6, 7, 12)
    assert saturday.weekday() == 5
    assert CronCalendar.parse("0 9 * * 1").next_after(saturday) == utc(2025, 6, 8, 9)  # Sunday
    assert CronCalendar.parse("0 9 * * 2").next_after(saturday) == utc(2025, 6, 9, 9)  # Monday
    assert CronCalendar.parse("0 9 * * 7").next_after(saturday) == utc(2025, 6, 14, 9)
    for number in range(1, 8):
        found = CronCalendar.parse(f"0 0 * * {number}").next_after(saturday)
        assert found is not None
        # date.isoweekday(): Monday=1 ... Sunday=7; crate: Sunday=1 ... Saturday=7.
        assert found.isoweekday() % 7 + 1 == number


# --- names ------------------------------------------------------------------------------

MONTHS = [
    ("jan", "january"),
    ("feb", "february"),
    ("mar", "march"),
    ("apr", "april"),
    ("may", "may"),
    ("jun", "june"),
    ("jul", "july"),
    ("aug", "august"),
    ("sep", "september"),
    ("oct", "october"),
    ("nov", "november"),
    ("dec", "december"),
]
WEEKDAYS = [
    ("sun", "sunday"),
    ("mon", "monday"),
    ("tue", "tues", "tuesday"),
    ("wed", "wednesday"),
    ("thu", "thurs", "thursday"),
    ("fri", "friday"),
    ("sat", "saturday"),
]


@pytest.mark.parametrize("number", range(1, 13))
def test_month_names_in_any_case(number: int) -> None:
    for name in MONTHS[number - 1]:
        for spelling in (name, name.upper(), name.capitalize(), name.swapcase().capitalize()):
            assert CronCalendar.parse(f"0 0 1 {spelling} *").months == {number}


@pytest.mark.parametrize("number", range(1, 8))
def test_weekday_names_in_any_case(number: int) -> None:
    for name in WEEKDAYS[number - 1]:
        for spelling in (name, name.upper(), name.capitalize()):
            assert CronCalendar.parse(f"0 0 * * {spelling}").weekdays == {number}


@pytest.mark.parametrize(
    ("expression", "field"),
    [
        ("0 0 1 sept *", "month"),
        ("0 0 1 Sept *", "month"),
        ("0 0 1 janu *", "month"),
        ("0 0 1 ja *", "month"),
        ("0 0 * * thur", "weekday"),
        ("0 0 * * tu", "weekday"),
        ("0 0 * * weds", "weekday"),
    ],
)
def test_unknown_spellings_are_rejected(expression: str, field: str) -> None:
    error = rejected(expression)
    assert error.field == field
    assert f"is not a {field} name" in error.reason


def test_names_run_into_numbers_are_rejected() -> None:
    error = rejected("0 0 * * sunday1")
    assert error.field == "weekday"
    assert "'sunday1' is neither a number nor a weekday name" in error.reason
    assert "'5x' is not a number" in rejected("5x * * * *").reason


@pytest.mark.parametrize(
    ("expression", "field"),
    [
        ("0 0 * Thu *", "month"),
        ("0 0 * * Jan", "weekday"),
        ("jan * * * *", "minute"),
        ("0 mon * * *", "hour"),
        ("0 0 mon * *", "day-of-month"),
    ],
)
def test_names_only_in_their_own_field(expression: str, field: str) -> None:
    assert rejected(expression).field == field


def test_named_ranges_and_lists() -> None:
    assert CronCalendar.parse("0 0 * * Mon-Fri").weekdays == {2, 3, 4, 5, 6}
    assert CronCalendar.parse("0 0 * * tues-THURSDAY").weekdays == {3, 4, 5}
    assert CronCalendar.parse("0 0 * * SAT,sun").weekdays == {7, 1}
    assert CronCalendar.parse("0 0 1 March-May *").months == {3, 4, 5}
    assert CronCalendar.parse("0 0 1 jan,Jul,3 *").months == {1, 7, 3}


# --- list items, ranges and steps ------------------------------------------------------


@pytest.mark.parametrize(
    ("field_index", "maximum", "first"),
    [(0, 59, 0), (1, 23, 0), (2, 31, 1), (3, 12, 1), (4, 7, 1)],
)
def test_step_bounds_per_field(field_index: int, maximum: int, first: int) -> None:
    def expression(token: str) -> str:
        tokens = ["*"] * 5
        tokens[field_index] = token
        return " ".join(tokens)

    sets = field_sets(expression(f"*/{maximum}"))
    expected = {first, maximum} if first + maximum <= maximum else {first}
    assert sets[field_index] == expected
    assert field_sets(expression("*/1"))[field_index] == set(range(first, maximum + 1))
    for bad_step in (0, maximum + 1, 1000):
        error = rejected(expression(f"*/{bad_step}"))
        assert error.field == FIELDS[field_index]
        assert f"step {bad_step}" in error.reason
        assert f"out of range 1-{maximum}" in error.reason


def test_design_step_examples() -> None:
    assert CronCalendar.parse("*/59 * * * *").minutes == {0, 59}
    for expression, field in [
        ("*/0 * * * *", "minute"),
        ("*/60 * * * *", "minute"),
        ("0 */24 * * *", "hour"),
        ("0 0 */32 * *", "day-of-month"),
        ("0 0 * */13 *", "month"),
        ("0 0 * * */8", "weekday"),
    ]:
        assert rejected(expression).field == field


def test_step_forms() -> None:
    assert CronCalendar.parse("5/15 * * * *").minutes == {5, 20, 35, 50}
    assert CronCalendar.parse("1-10/3 * * * *").minutes == {1, 4, 7, 10}
    assert CronCalendar.parse("10-20/20 * * * *").minutes == {10}
    assert CronCalendar.parse("0 0 */10 * *").days_of_month == {1, 11, 21, 31}
    assert CronCalendar.parse("0 0 1 */5 *").months == {1, 6, 11}
    assert CronCalendar.parse("0 0 * * */3").weekdays == {1, 4, 7}
    assert CronCalendar.parse("0 0 * * Mon-Fri/2").weekdays == {2, 4, 6}
    assert CronCalendar.parse("0 0 1 Feb-Nov/3 *").months == {2, 5, 8, 11}
    assert CronCalendar.parse("0 0 ?/2 * *").days_of_month == set(range(1, 32, 2))
    assert CronCalendar.parse("0 0 * * ?/2").weekdays == {1, 3, 5, 7}
    assert CronCalendar.parse("0 22/1 * * *").hours == {22, 23}
    assert CronCalendar.parse("59/30 * * * *").minutes == {59}


@pytest.mark.parametrize(
    ("expression", "field", "shown"),
    [
        ("0 0 * * Wed/2", "weekday", "single name cannot take a step"),
        ("0 0 1 Jan/2 *", "month", "single name cannot take a step"),
        ("*/5/2 * * * *", "minute", "more than one '/'"),
        ("1-2-3 * * * *", "minute", "more than one '-'"),
        ("-5 * * * *", "minute", "missing an end"),
        ("5- * * * *", "minute", "missing an end"),
        ("/5 * * * *", "minute", "missing value"),
        ("5/ * * * *", "minute", "step '' in '5/' is not a number"),
        ("*/x * * * *", "minute", "step 'x' in '*/x' is not a number"),
        ("*-5 * * * *", "minute", "range start '*' is not a number"),
        ("1-* * * * *", "minute", "range end '*' is not a number"),
        ("0 0 ?/0 * *", "day-of-month", "step 0"),
        ("1-10/* * * * *", "minute", "step '*' in '1-10/*' is not a number"),
        ("** * * * *", "minute", "not a number"),
    ],
)
def test_malformed_items_are_rejected(expression: str, field: str, shown: str) -> None:
    error = rejected(expression)
    assert error.field == field
    assert shown in error.reason


def test_a_range_whose_ends_are_equal_is_that_value() -> None:
    assert CronCalendar.parse("5-5 * * * *").minutes == {5}
    assert CronCalendar.parse("0 0 * * Wed-Wed").weekdays == {4}
    assert CronCalendar.parse("0 0 * * Wed-Wed/3").weekdays == {4}


@pytest.mark.parametrize(
    ("expression", "field"),
    [
        ("5-2 * * * *", "minute"),
        ("40-20 * * * *", "minute"),
        ("0 22-2 * * *", "hour"),
        ("0 0 31-1 * *", "day-of-month"),
        ("0 0 * Dec-Jan *", "month"),
        ("0 0 * * Sat-Sun", "weekday"),
        ("0 0 * * 7-1", "weekday"),
    ],
)
def test_reversed_ranges_do_not_wrap(expression: str, field: str) -> None:
    error = rejected(expression)
    assert error.field == field
    assert "reversed" in error.reason


@pytest.mark.parametrize(
    ("expression", "field"),
    [
        ("0 0 1-Jun * *", "day-of-month"),
        ("0 0 * 1-Jun *", "month"),
        ("0 0 * Jan-6 *", "month"),
        ("0 0 * * Mon-5", "weekday"),
        ("0 0 * * 2-Fri/2", "weekday"),
    ],
)
def test_a_range_mixing_number_and_name_is_rejected(expression: str, field: str) -> None:
    error = rejected(expression)
    assert error.field == field
    assert "mixes a number and a name" in error.reason


def test_question_mark_only_in_day_of_month_and_weekday() -> None:
    assert field_sets("0 0 ? * ?") == ({0}, {0}, ALL_DAYS, ALL_MONTHS, ALL_WEEKDAYS)
    assert CronCalendar.parse("0 0 ? * Wed") == CronCalendar.parse("0 0 * * 4")
    for expression, field in [
        ("? * * * *", "minute"),
        ("* ? * * *", "hour"),
        ("* * * ? *", "month"),
        ("?/5 * * * *", "minute"),
    ]:
        error = rejected(expression)
        assert error.field == field
        assert "'?' is allowed only" in error.reason


@pytest.mark.parametrize(
    ("expression", "field"),
    [
        ("0 9 L * *", "day-of-month"),
        ("0 9 l * *", "day-of-month"),
        ("0 9 LW * *", "day-of-month"),
        ("0 9 15W * *", "day-of-month"),
        ("0 9 L-3 * *", "day-of-month"),
        ("0 9 * * 5L", "weekday"),
        ("0 9 * * L", "weekday"),
        ("H * * * *", "minute"),
        ("H/5 * * * *", "minute"),
        ("0 H * * *", "hour"),
    ],
)
def test_l_w_h_are_not_supported(expression: str, field: str) -> None:
    error = rejected(expression)
    assert error.field == field
    assert "not supported" in error.reason


def test_hash_is_not_supported() -> None:
    error = rejected("0 0 * * 2#1")
    assert error.field == "weekday"
    assert "'#'" in error.reason
    assert "not supported" in error.reason


@pytest.mark.parametrize("token", ["1,,2", ",1", "1,", ",", "1,,"])
def test_empty_list_items_are_rejected(token: str) -> None:
    error = rejected(f"0 0 {token} * *")
    assert error.field == "day-of-month"
    assert "empty list item" in error.reason


def test_lists_union_their_items() -> None:
    assert CronCalendar.parse("0,20,40 9-11 * * *").minutes == {0, 20, 40}
    assert CronCalendar.parse("1,1,1-3,*/30 * * * *").minutes == {0, 1, 2, 3, 30}
    assert CronCalendar.parse("0 0 ?,1 * *").days_of_month == ALL_DAYS


@pytest.mark.parametrize(
    ("expression", "field"),
    [
        ("61 * * * *", "minute"),
        ("0 x * * *", "hour"),
        ("0 0 1-40 * *", "day-of-month"),
        ("0 0 * foo *", "month"),
        ("0 0 * * Mon-Sat/9", "weekday"),
    ],
)
def test_error_messages_name_the_field(expression: str, field: str) -> None:
    error = rejected(expression)
    assert error.field == field
    assert error.expression == expression
    assert str(error).startswith(f"invalid cron expression {expression!r} in the {field} field: ")


# --- the date search --------------------------------------------------------------------


def test_day_of_month_and_weekday_intersect() -> None:
    calendar = CronCalendar.parse("0 0 13 * Fri")
    found = list(islice(calendar.iter_after(utc(2025, 1, 1)), 12))
    assert found[:2] == [utc(2025, 6, 13), utc(2026, 2, 13)]
    assert all(instant.day == 13 and instant.weekday() == 4 for instant in found)
    # Every Friday the 13th in 2025-2028, found independently.
    expected = [
        datetime.combine(day, datetime.min.time(), UTC)
        for day in (date(2025, 1, 1) + timedelta(days=n) for n in range(4 * 366))
        if day.day == 13 and day.weekday() == 4 and day.year <= 2028
    ]
    assert [instant for instant in found if instant.year <= 2028] == expected


def test_a_date_that_never_exists_parses_and_never_fires() -> None:
    for expression in ("0 0 30 2 *", "0 0 31 2 *", "0 0 31 4,6,9,11 *", "* * 30,31 2 *"):
        calendar = CronCalendar.parse(expression)
        assert calendar.next_after(utc(1970, 1, 1)) is None
        assert calendar.next_after(utc(1960, 1, 1)) is None
        assert list(calendar.iter_after(utc(2025, 1, 1))) == []
        assert not calendar.matches(utc(2025, 3, 2))


def test_february_29_only_in_leap_years() -> None:
    calendar = CronCalendar.parse("0 0 29 2 *")
    found = list(calendar.iter_after(utc(1970, 1, 1)))
    assert [instant.year for instant in found] == list(range(1972, 2097, 4))
    assert utc(2000, 2, 29) in found  # divisible by 400: leap
    assert calendar.next_after(utc(2096, 3, 1)) is None  # 2100 is not a leap year


def test_2100_is_not_a_leap_year_but_is_in_the_calendar() -> None:
    assert CronCalendar.parse("0 0 28 2 *").next_after(utc(2100, 1, 1)) == utc(2100, 2, 28)
    assert CronCalendar.parse("0 0 * 2 *").next_after(utc(2100, 2, 28)) is None
    assert CronCalendar.parse("0 0 * * *").next_after(utc(2100, 2, 28)) == utc(2100, 3, 1)


def test_month_lengths() -> None:
    calendar = CronCalendar.parse("0 0 31 * *")
    found = list(islice(calendar.iter_after(utc(2025, 1, 1)), 7))
    assert [instant.month for instant in found] == [1, 3, 5, 7, 8, 10, 12]
    assert CronCalendar.parse("0 0 30 * *").next_after(utc(2025, 1, 30)) == utc(2025, 3, 30)


def test_wraps_over_hour_day_month_and_year() -> None:
    calendar = CronCalendar.parse("59 23 31 12 *")
    assert calendar.next_after(utc(2025, 12, 31, 23, 59)) == utc(2026, 12, 31, 23, 59)
    assert CronCalendar.parse("*/7 * * * *").next_after(utc(2025, 3, 14, 9, 56)) == utc(
        2025, 3, 14, 10, 0
    )
    assert CronCalendar.parse("0 0 1 * *").next_after(utc(2025, 12, 15)) == utc(2026, 1, 1)
    assert CronCalendar.parse("30 5,17 * * *").next_after(utc(2025, 3, 14, 17, 31)) == utc(
        2025, 3, 15, 5, 30
    )


def test_exhausted_after_the_last_minute_of_2100() -> None:
    every_minute = CronCalendar.parse("* * * * *")
    assert every_minute.next_after(utc(2100, 12, 31, 23, 58, 59, 999000)) == LAST_INSTANT
    assert every_minute.next_after(LAST_INSTANT) is None
    assert every_minute.next_after(LAST_INSTANT - timedelta(microseconds=1)) == LAST_INSTANT
    assert list(every_minute.iter_after(utc(2100, 12, 31, 23, 57))) == [
        utc(2100, 12, 31, 23, 58),
        LAST_INSTANT,
    ]
    assert every_minute.next_after(utc(2101, 6, 1)) is None
    assert every_minute.next_after(datetime.max.replace(tzinfo=UTC)) is None
    assert CronCalendar.parse("30 6 1 1 *").next_after(utc(2100, 1, 1, 6, 30)) is None
    yearly = CronCalendar.parse("0 0 1 1 *")
    assert len(list(yearly.iter_after(utc(1960, 1, 1)))) == 2100 - 1970 + 1


def test_never_before_1970() -> None:
    every_minute = CronCalendar.parse("* * * * *")
    assert every_minute.next_after(utc(1969, 12, 31, 23, 59, 59, 999000)) == FIRST_INSTANT
    assert every_minute.next_after(FIRST_INSTANT) == utc(1970, 1, 1, 0, 1)
    assert every_minute.next_after(datetime.min.replace(tzinfo=UTC)) == FIRST_INSTANT
    # An offset that would overflow if converted to UTC first.
    far_east = datetime.min.replace(tzinfo=timezone(timedelta(hours=14)))
    assert every_minute.next_after(far_east) == FIRST_INSTANT
    assert CronCalendar.parse("0 0 1 * *").next_after(utc(1965, 5, 5)) == FIRST_INSTANT
    assert CronCalendar.parse("0 6 * * Thu").next_after(utc(1969, 12, 31, 23)) == utc(1970, 1, 1, 6)
    assert CronCalendar.parse("0 0 * * Mon").next_after(utc(1900, 1, 1)) == utc(1970, 1, 5)
    assert not every_minute.matches(utc(1969, 12, 31, 23, 59))


def test_strictly_after_to_the_millisecond_and_below() -> None:
    calendar = CronCalendar.parse("30 * * * *")
    fire = utc(2025, 3, 14, 9, 30)
    assert calendar.next_after(fire) == utc(2025, 3, 14, 10, 30)
    assert calendar.next_after(fire - timedelta(milliseconds=1)) == fire
    assert calendar.next_after(fire - timedelta(microseconds=1)) == fire
    assert calendar.next_after(fire + timedelta(microseconds=1)) == utc(2025, 3, 14, 10, 30)
    assert calendar.next_after(fire + timedelta(milliseconds=1)) == utc(2025, 3, 14, 10, 30)
    assert calendar.next_after(fire - timedelta(minutes=1)) == fire


def test_other_offsets_are_converted_and_results_are_utc() -> None:
    plus_one = timezone(timedelta(hours=1))
    calendar = CronCalendar.parse("30 9 * * *")
    # 10:29 at +01:00 is 09:29Z: the fire time 09:30Z is one minute later.
    found = calendar.next_after(datetime(2025, 3, 14, 10, 29, tzinfo=plus_one))
    assert found == utc(2025, 3, 14, 9, 30)
    assert found is not None
    assert found.tzinfo is UTC
    assert calendar.matches(datetime(2025, 3, 14, 10, 30, tzinfo=plus_one))
    assert not calendar.matches(datetime(2025, 3, 14, 9, 30, tzinfo=plus_one))


class _NoOffset(tzinfo):
    def utcoffset(self, dt: datetime | None) -> timedelta | None:
        return None

    def dst(self, dt: datetime | None) -> timedelta | None:
        return None

    def tzname(self, dt: datetime | None) -> str | None:
        return None


@pytest.mark.parametrize(
    "instant", [datetime(2025, 1, 1), datetime(2025, 1, 1, tzinfo=_NoOffset())]
)
def test_naive_datetimes_are_rejected(instant: datetime) -> None:
    calendar = CronCalendar.parse("* * * * *")
    with pytest.raises(ValueError, match=r"naive datetime .* timezone-aware"):
        calendar.next_after(instant)
    with pytest.raises(ValueError, match="naive"):
        calendar.iter_after(instant)  # at the call, not at the first next()
    with pytest.raises(ValueError, match="naive"):
        calendar.matches(instant)


@pytest.mark.parametrize("value", [date(2025, 1, 1), "2025-01-01T00:00:00Z", 0, None])
def test_non_datetimes_are_rejected(value: object) -> None:
    calendar = CronCalendar.parse("* * * * *")
    with pytest.raises(TypeError, match="timezone-aware datetime"):
        calendar.next_after(value)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        calendar.matches(value)  # type: ignore[arg-type]


def test_matches_is_minute_precise() -> None:
    calendar = CronCalendar.parse("15 8 * * Mon-Fri")
    assert calendar.matches(utc(2025, 6, 9, 8, 15))  # a Monday
    assert not calendar.matches(utc(2025, 6, 9, 8, 15, 1))
    assert not calendar.matches(utc(2025, 6, 9, 8, 15, 0, 1))
    assert not calendar.matches(utc(2025, 6, 9, 8, 16))
    assert not calendar.matches(utc(2025, 6, 8, 8, 15))  # a Sunday
    assert CronCalendar.parse("59 23 31 12 *").matches(LAST_INSTANT)
    assert not CronCalendar.parse("* * * * *").matches(LAST_INSTANT + timedelta(minutes=1))


def test_iter_after_runs_in_order_until_exhausted() -> None:
    calendar = CronCalendar.parse("0 0 1 1 *")
    found = list(calendar.iter_after(utc(2090, 6, 1)))
    assert found == [utc(year, 1, 1) for year in range(2091, 2101)]


# --- the value ---------------------------------------------------------------------------


def test_fields_are_frozensets_and_expression_is_the_original_text() -> None:
    calendar = CronCalendar.parse(" 0,30  9-17 ? * Mon-Fri ")
    assert calendar.expression == " 0,30  9-17 ? * Mon-Fri "
    assert calendar.minutes == frozenset({0, 30})
    assert calendar.hours == frozenset(range(9, 18))
    assert calendar.days_of_month == ALL_DAYS
    assert calendar.months == ALL_MONTHS
    assert calendar.weekdays == frozenset({2, 3, 4, 5, 6})
    for values in (calendar.minutes, calendar.days_of_month, calendar.weekdays):
        assert type(values) is frozenset


def test_equality_and_hash_follow_the_normalized_sets() -> None:
    a = CronCalendar.parse("0 9 * * Mon-Fri")
    b = CronCalendar.parse("00 09 ? * 2-6")
    c = CronCalendar.parse("0 9 * * Mon-Sat")
    assert a == b
    assert hash(a) == hash(b)
    assert a != c
    assert len({a, b, c}) == 2
    text: object = "0 9 * * Mon-Fri"
    assert a != text


def test_repr_shows_the_expression() -> None:
    assert repr(CronCalendar.parse("0 9 * * Mon-Fri")) == "CronCalendar.parse('0 9 * * Mon-Fri')"


def test_frozen() -> None:
    calendar = CronCalendar.parse("0 9 * * *")
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        calendar.minutes = frozenset({1})  # type: ignore[misc]
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        calendar.expression = "1 * * * *"  # type: ignore[misc]
    assert calendar.minutes == {0}


def test_pickle_round_trip() -> None:
    calendar = CronCalendar.parse("*/15 9-17 * * Mon-Fri")
    copy = pickle.loads(pickle.dumps(calendar))
    assert copy == calendar
    assert copy.expression == calendar.expression
    assert copy.next_after(utc(2025, 6, 6, 17, 50)) == utc(2025, 6, 9, 9, 0)


def test_direct_construction_validates_the_sets() -> None:
    hours, days, months, weekdays = (
        frozenset(values) for values in (ALL_HOURS, ALL_DAYS, ALL_MONTHS, ALL_WEEKDAYS)
    )
    with pytest.raises(ValueError, match="minutes must be a non-empty frozenset"):
        CronCalendar("", frozenset(), hours, days, months, weekdays)
    with pytest.raises(ValueError, match="minutes must be a non-empty frozenset"):
        CronCalendar("", {5}, hours, days, months, weekdays)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="weekdays values must be integers in 1-7"):
        CronCalendar("", frozenset({5}), hours, days, months, frozenset({0}))
    built = CronCalendar("x", frozenset({5}), hours, days, months, weekdays)
    assert built == CronCalendar.parse("5 * * * *")


# --- dependencies -----------------------------------------------------------------------


def test_calendar_module_imports_only_stdlib_attrs_and_core() -> None:
    source = Path(calendar_module.__file__).read_text(encoding="utf-8")
    imported: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module)
    assert imported, "the walk found no imports at all"
    outside = {
        name
        for name in imported
        if name.split(".")[0] not in sys.stdlib_module_names
        and name.split(".")[0] != "attrs"
        and name != "steeple.core.errors"
    }
    assert outside == set()


def test_importing_the_calendar_loads_no_third_party_module() -> None:
    script = (
        "import sys\n"
        "before = set(sys.modules)\n"
        "import steeple.core.calendar\n"
        "print('\\n'.join(sorted(set(sys.modules) - before)))\n"
    )
    completed = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60
    )
    loaded = {line.split(".")[0] for line in completed.stdout.split()}
    assert "steeple" in loaded
    third_party = loaded - set(sys.stdlib_module_names) - {"attrs", "attr", "steeple"}
    # `_`-prefixed C helpers of the stdlib (e.g. _bisect) are in stdlib_module_names too.
    assert third_party == set(), third_party
    assert "croniter" not in loaded


def test_the_memo_of_next_after_is_bounded_and_never_changes_an_answer() -> None:
    remembering = CronCalendar.parse("*/7 3-5 * * Mon-Fri")
    start = datetime(2026, 1, 1, tzinfo=UTC)
    instants = [start + timedelta(minutes=13 * i) for i in range(1_000)]
    for instant in instants * 2:  # the second pass reads remembered answers
        fresh = CronCalendar.parse("*/7 3-5 * * Mon-Fri")
        assert remembering.next_after(instant) == fresh.next_after(instant)
        assert len(remembering._found) <= calendar_module._MEMO_SIZE


def test_the_shared_calendar_of_an_expression_is_one_parsed_calendar() -> None:
    shared = calendar_module.shared_calendar("*/5 * * * *")
    assert shared is calendar_module.shared_calendar("*/5 * * * *")
    assert shared == CronCalendar.parse("*/5 * * * *")
    assert shared.next_after(utc(2026, 1, 1, 0, 5)) == utc(2026, 1, 1, 0, 10)
    with pytest.raises(InvalidCronExpression):
        calendar_module.shared_calendar("61 * * * *")


@pytest.mark.parametrize(
    "hostile",
    [["* * * * *"], {"cron": 1}, None, 5, 1.5, b"* * * * *", "\ud800", "\0", "x" * 10_000],
    ids=["list", "dict", "None", "int", "float", "bytes", "surrogate", "NUL", "10KB"],
)
def test_the_shared_calendar_refuses_what_parse_refuses_with_its_typed_error(
    hostile: object,
) -> None:
    with pytest.raises(InvalidCronExpression):
        calendar_module.shared_calendar(hostile)  # type: ignore[arg-type]
