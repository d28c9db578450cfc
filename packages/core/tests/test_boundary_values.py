"""Validators a boundary (HTTP route, command line) runs before anything reaches storage:
definition names, namespaces, occurrence ids and occurrences-listing cursors; and the
recorded time a clock error carries."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from steeple.core.calendar import FIRST_INSTANT, LAST_INSTANT
from steeple.core.config import validate_definition_name, validate_namespace
from steeple.core.errors import RecurringClockError, RecurringConfigurationError
from steeple.core.leases import GENERATION_BYTES, adopt_time, occurrence_id_for
from steeple.core.records import (
    occurrence_cursor,
    parse_occurrence_cursor,
    validate_occurrence_id,
)

HOSTILE_TEXT = [
    "",
    " ",
    "\x00",
    "a\x00b",
    "\ud800",
    "a\udfffb",
    "\u2028",
    "\ufeff",
    "x" * 10_240,
    " padded",
]
NOT_STR = [None, 5, 2**64, 1.5, float("nan"), b"abc", ["a"], {"a": 1}, True]

ids = st.binary(min_size=GENERATION_BYTES, max_size=GENERATION_BYTES).map(occurrence_id_for)
instants = st.datetimes(
    min_value=datetime(1970, 1, 1), max_value=datetime(2100, 12, 31, 23, 59), timezones=st.just(UTC)
)


@given(ids)
def test_every_generated_occurrence_id_is_valid(occurrence_id: str) -> None:
    assert validate_occurrence_id(occurrence_id) == occurrence_id


@pytest.mark.parametrize(
    "value",
    [*HOSTILE_TEXT, *NOT_STR, "A" * 32, "g" * 32, "a" * 31, "a" * 33, "٣" * 32, "a" * 31 + "\n"],
)
def test_malformed_occurrence_ids_are_refused(value: object) -> None:
    with pytest.raises(RecurringConfigurationError):
        validate_occurrence_id(value)


@given(instants, ids)
def test_cursors_round_trip_to_the_millisecond(due: datetime, occurrence_id: str) -> None:
    cursor = occurrence_cursor(due, occurrence_id)
    back, same = parse_occurrence_cursor(cursor)
    assert same == occurrence_id
    assert back == due.replace(microsecond=due.microsecond // 1000 * 1000)
    assert cursor.isascii()
    assert len(cursor) == 15 + 1 + 32


def test_cursor_bounds_are_the_calendar_years() -> None:
    oid = "0" * 32
    assert parse_occurrence_cursor(occurrence_cursor(FIRST_INSTANT, oid))[0] == FIRST_INSTANT
    assert parse_occurrence_cursor(occurrence_cursor(LAST_INSTANT, oid))[0] == LAST_INSTANT
    beyond = (LAST_INSTANT - FIRST_INSTANT) // timedelta(milliseconds=1) + 1
    with pytest.raises(RecurringConfigurationError):
        parse_occurrence_cursor(f"{beyond:015d}.{oid}")
    for bad_due in (FIRST_INSTANT - timedelta(milliseconds=1), LAST_INSTANT + timedelta(days=1)):
        with pytest.raises(RecurringConfigurationError):
            occurrence_cursor(bad_due, oid)
    with pytest.raises(RecurringConfigurationError):
        occurrence_cursor(datetime(2030, 1, 1), oid)  # naive


@pytest.mark.parametrize(
    "cursor",
    [
        *HOSTILE_TEXT,
        *NOT_STR,
        "999999999999999." + "a" * 32,  # beyond year 9999: an OverflowError before
        "000000000000001." + "a" * 31,
        "000000000000001." + "A" * 32,
        "00000000000001." + "a" * 32,
        "٠٠٠٠٠٠٠٠٠٠٠٠٠٠١." + "a" * 32,  # non-ASCII digits int() would accept
        "000000000000001." + "a" * 32 + "\x00",
        "000000000000001.",
        "000000000000001",
        "+00000000000001." + "a" * 32,
    ],
)
def test_malformed_cursors_are_refused(cursor: object) -> None:
    with pytest.raises(RecurringConfigurationError, match="cursor"):
        parse_occurrence_cursor(cursor)


@given(st.text(max_size=40))
def test_parsing_any_text_is_a_cursor_or_a_typed_refusal(text: str) -> None:
    try:
        due, occurrence_id = parse_occurrence_cursor(text)
    except RecurringConfigurationError:
        return
    assert occurrence_cursor(due, occurrence_id) == text


@pytest.mark.parametrize("value", [*HOSTILE_TEXT, *NOT_STR, "n" * 201])
def test_definition_names_refused(value: object) -> None:
    with pytest.raises(RecurringConfigurationError):
        validate_definition_name(value)


def test_definition_names_accepted() -> None:
    for name in ("minutely", "n" * 200, "billing/eu-west", "日次レポート", "a b"):
        assert validate_definition_name(name) == name


@pytest.mark.parametrize("value", [*HOSTILE_TEXT, *NOT_STR, "Ops", "-ops", "o" * 64, "ops/x"])
def test_namespaces_refused_without_echoing_long_values(value: object) -> None:
    with pytest.raises(RecurringConfigurationError) as info:
        validate_namespace(value)
    assert len(str(info.value)) < 300


def test_clock_error_carries_both_instants() -> None:
    recorded = datetime(2031, 1, 1, 12, tzinfo=UTC)
    local = recorded - timedelta(seconds=6)
    with pytest.raises(RecurringClockError) as info:
        adopt_time(recorded, local)
    assert info.value.recorded_time == recorded
    assert info.value.local_time == local
    assert "trails" in str(info.value)
    plain = RecurringClockError("raised by a store that does not know the instants")
    assert plain.recorded_time is None
    assert plain.local_time is None
