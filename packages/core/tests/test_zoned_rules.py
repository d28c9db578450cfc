"""ZonedCalendar: the documented daylight-saving rules, shorthands, bounds and hostile input.

Every expected instant below is worked out by hand from the tz database's transitions
(noted beside each case) and the rules in ``steeple.core.zoned``'s docstring; the property
tests in ``test_zoned_properties.py`` check the same rules against a brute-force walk.
"""

from __future__ import annotations

import subprocess
import sys
from datetime import UTC, datetime, timedelta, timezone
from itertools import islice, pairwise
from pathlib import Path
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import pytest

import steeple.core
from steeple.core.calendar import CronCalendar
from steeple.core.errors import (
    ConfigurationError,
    InvalidCronExpression,
    InvalidTimeZoneError,
    SteepleError,
)
from steeple.core.policies import MissedRunPolicy, plan_tick
from steeple.core.zoned import SHORTHANDS, ZonedCalendar


def utc(*fields: int) -> datetime:
    year, month, day, hour, minute, second = (*fields, 0, 0, 0)[:6]
    return datetime(year, month, day, hour, minute, second, tzinfo=UTC)


def fires(expression: str, zone: str, after: datetime, count: int) -> list[datetime]:
    return list(islice(ZonedCalendar.parse(expression, zone).iter_after(after), count))


def local(instants: list[datetime], zone: str) -> list[str]:
    """Render instants as wall time and offset, for readable assertions."""
    return [f"{i.astimezone(ZoneInfo(zone)):%Y-%m-%d %H:%M%z}" for i in instants]


# --- Europe/Berlin: 2024-03-31 02:00 CET -> 03:00 CEST (01:00Z);
#                   2024-10-27 03:00 CEST -> 02:00 CET (01:00Z), 02:00-02:59 twice ---------


def test_berlin_time_in_the_spring_gap_runs_once_at_the_end_of_the_gap() -> None:
    got = fires("30 2 * * *", "Europe/Berlin", utc(2024, 3, 30, 12), 2)
    assert got == [utc(2024, 3, 31, 1), utc(2024, 4, 1, 0, 30)]
    assert local(got, "Europe/Berlin") == ["2024-03-31 03:00+0200", "2024-04-01 02:30+0200"]
    calendar = ZonedCalendar.parse("30 2 * * *", "Europe/Berlin")
    assert calendar.matches(utc(2024, 3, 31, 1))  # 03:00 CEST: the end of the gap
    assert not calendar.matches(utc(2024, 3, 31, 1, 30))  # 03:30 CEST
    assert not calendar.matches(utc(2024, 3, 30, 1))  # 02:00 CET the day before
    assert not calendar.matches(datetime(2024, 3, 31, 1, 0, 1, tzinfo=UTC))


def test_berlin_several_times_in_the_gap_run_once_together() -> None:
    # 02:00, 02:15, 02:30, 02:45 do not exist on 2024-03-31: one run at 03:00 CEST.
    got = fires("*/15 2 * * *", "Europe/Berlin", utc(2024, 3, 30, 12), 5)
    assert got[:2] == [utc(2024, 3, 31, 1), utc(2024, 4, 1, 0)]


def test_berlin_interval_expression_keeps_real_time_across_the_gap() -> None:
    got = fires("*/15 * * * *", "Europe/Berlin", utc(2024, 3, 31, 0, 30), 3)
    assert local(got, "Europe/Berlin") == [
        "2024-03-31 01:45+0100",
        "2024-03-31 03:00+0200",
        "2024-03-31 03:15+0200",
    ]
    assert [b - a for a, b in pairwise(got)] == [timedelta(minutes=15)] * 2


def test_berlin_repeated_time_of_day_runs_once_at_its_first_occurrence() -> None:
    got = fires("30 2 * * *", "Europe/Berlin", utc(2024, 10, 26, 12), 2)
    assert local(got, "Europe/Berlin") == ["2024-10-27 02:30+0200", "2024-10-28 02:30+0100"]


def test_berlin_every_30_minutes_neither_drops_nor_doubles_in_the_repeated_hour() -> None:
    got = fires("*/30 * * * *", "Europe/Berlin", utc(2024, 10, 27, 0), 5)
    assert local(got, "Europe/Berlin") == [
        "2024-10-27 02:30+0200",
        "2024-10-27 02:00+0100",
        "2024-10-27 02:30+0100",
        "2024-10-27 03:00+0100",
        "2024-10-27 03:30+0100",
    ]
    assert {b - a for a, b in pairwise(got)} == {timedelta(minutes=30)}


# --- America/New_York: 2024-03-10 02:00 EST -> 03:00 EDT (07:00Z);
#                       2024-11-03 02:00 EDT -> 01:00 EST (06:00Z), 01:00-01:59 twice ------


def ny(expression: str, after: datetime, count: int) -> list[str]:
    return local(fires(expression, "America/New_York", after, count), "America/New_York")


def test_new_york_spring_gap() -> None:
    assert ny("30 2 * * *", utc(2024, 3, 10, 5), 2) == [
        "2024-03-10 03:00-0400",
        "2024-03-11 02:30-0400",
    ]
    # Hourly is an interval expression: 02:00 never happens, the hours stay an hour apart.
    assert ny("0 * * * *", utc(2024, 3, 10, 5, 30), 3) == [
        "2024-03-10 01:00-0500",
        "2024-03-10 03:00-0400",
        "2024-03-10 04:00-0400",
    ]
    # Every minute of 2 am is an interval expression too: nothing on the day without 2 am.
    assert fires("* 2 * * *", "America/New_York", utc(2024, 3, 10, 5), 1) == [utc(2024, 3, 11, 6)]


def test_new_york_autumn_repeat() -> None:
    assert ny("30 1 * * *", utc(2024, 11, 3, 4), 2) == [
        "2024-11-03 01:30-0400",
        "2024-11-04 01:30-0500",
    ]
    assert ny("@hourly", utc(2024, 11, 3, 4, 30), 3) == [
        "2024-11-03 01:00-0400",
        "2024-11-03 01:00-0500",
        "2024-11-03 02:00-0500",
    ]
    assert ny("0 1,2 * * *", utc(2024, 11, 3, 4), 3) == [
        "2024-11-03 01:00-0400",
        "2024-11-03 02:00-0500",
        "2024-11-04 01:00-0500",
    ]


def test_new_york_hour_restricted_steps_are_times_of_day() -> None:
    """The documented price of the rule: ``*/15 0-5`` names times of day, fired once each."""
    calendar = ZonedCalendar.parse("*/15 0-5 * * *", "America/New_York")
    assert not calendar.interval
    got = list(islice(calendar.iter_after(utc(2024, 11, 3, 5, 40)), 2))
    assert local(got, "America/New_York") == ["2024-11-03 01:45-0400", "2024-11-03 02:00-0500"]
    assert got[1] - got[0] == timedelta(minutes=75)


# --- Australia/Lord_Howe: 30-minute shifts.
#     2024-04-07 02:00 (+11) -> 01:30 (+10:30) at 15:00Z, 01:30-01:59 twice;
#     2024-10-06 02:00 (+10:30) -> 02:30 (+11) at 15:30Z, 02:00-02:29 skipped -----------------


def test_lord_howe_half_hour_gap() -> None:
    got = fires("15 2 * * *", "Australia/Lord_Howe", utc(2024, 10, 5, 12), 2)
    assert local(got, "Australia/Lord_Howe") == ["2024-10-06 02:30+1100", "2024-10-07 02:15+1100"]
    assert got[0] == utc(2024, 10, 5, 15, 30)
    got = fires("*/30 * * * *", "Australia/Lord_Howe", utc(2024, 10, 5, 14, 50), 3)
    assert local(got, "Australia/Lord_Howe") == [
        "2024-10-06 01:30+1030",
        "2024-10-06 02:30+1100",
        "2024-10-06 03:00+1100",
    ]


def test_lord_howe_half_hour_repeat() -> None:
    got = fires("45 1 * * *", "Australia/Lord_Howe", utc(2024, 4, 6, 12), 2)
    assert local(got, "Australia/Lord_Howe") == ["2024-04-07 01:45+1100", "2024-04-08 01:45+1030"]
    got = fires("*/15 * * * *", "Australia/Lord_Howe", utc(2024, 4, 6, 14, 30), 4)
    assert local(got, "Australia/Lord_Howe") == [
        "2024-04-07 01:45+1100",
        "2024-04-07 01:30+1030",
        "2024-04-07 01:45+1030",
        "2024-04-07 02:00+1030",
    ]


# --- zones that abolished DST --------------------------------------------------------------


def test_sao_paulo_midnight_transitions_then_none_after_2019() -> None:
    # 2018-11-04 00:00 (-03) -> 01:00 (-02): midnight does not exist; @daily runs at 01:00.
    got = fires("@daily", "America/Sao_Paulo", utc(2018, 11, 2, 12), 3)
    assert local(got, "America/Sao_Paulo") == [
        "2018-11-03 00:00-0300",
        "2018-11-04 01:00-0200",
        "2018-11-05 00:00-0200",
    ]
    # 2019-02-17 00:00 (-02) -> 2019-02-16 23:00 (-03): 23:30 on the 16th happens twice.
    got = fires("30 23 * * *", "America/Sao_Paulo", utc(2019, 2, 16, 12), 2)
    assert local(got, "America/Sao_Paulo") == ["2019-02-16 23:30-0200", "2019-02-17 23:30-0300"]
    # DST was abolished in 2019: November 2019 has no gap, midnight is plain -03.
    got = fires("@daily", "America/Sao_Paulo", utc(2019, 11, 2, 12), 3)
    assert got == [utc(2019, 11, 3, 3), utc(2019, 11, 4, 3), utc(2019, 11, 5, 3)]


def test_moscow_2011_permanent_summer_time_and_2014_return() -> None:
    # 2011-03-27 02:00 (+03) -> 03:00 (+04) for good: no autumn repeat in 2011.
    assert fires("30 2 * * *", "Europe/Moscow", utc(2011, 3, 26, 12), 2) == [
        utc(2011, 3, 26, 23),
        utc(2011, 3, 27, 22, 30),
    ]
    assert fires("30 1 * * *", "Europe/Moscow", utc(2011, 10, 29, 12), 2) == [
        utc(2011, 10, 29, 21, 30),
        utc(2011, 10, 30, 21, 30),
    ]
    # 2014-10-26 02:00 (+04) -> 01:00 (+03): 01:30 runs once, on the first pass.
    got = fires("30 1 * * *", "Europe/Moscow", utc(2014, 10, 25, 12), 2)
    assert local(got, "Europe/Moscow") == ["2014-10-26 01:30+0400", "2014-10-27 01:30+0300"]


# --- southern hemisphere: Australia/Sydney 2025-04-06 03:00 (+11) -> 02:00 (+10) at
#     16:00Z; 2025-10-05 02:00 (+10) -> 03:00 (+11) at 16:00Z ------------------------------


def test_sydney_autumn_in_april_and_spring_in_october() -> None:
    got = fires("30 2 * * *", "Australia/Sydney", utc(2025, 4, 5, 6), 2)
    assert local(got, "Australia/Sydney") == ["2025-04-06 02:30+1100", "2025-04-07 02:30+1000"]
    got = fires("30 2 * * *", "Australia/Sydney", utc(2025, 10, 4, 6), 2)
    assert local(got, "Australia/Sydney") == ["2025-10-05 03:00+1100", "2025-10-06 02:30+1100"]
    assert got[0] == utc(2025, 10, 4, 16)


# --- odd corners of the database --------------------------------------------------------------


def test_a_whole_skipped_day_runs_its_times_once_at_the_end_of_the_gap() -> None:
    # Pacific/Apia skipped 2011-12-30: 2011-12-29 24:00 (-10) became 2011-12-31 00:00 (+14).
    got = fires("0 9 * * *", "Pacific/Apia", utc(2011, 12, 29, 12), 3)
    assert local(got, "Pacific/Apia") == [
        "2011-12-29 09:00-1000",
        "2011-12-31 00:00+1400",
        "2011-12-31 09:00+1400",
    ]


def test_a_non_minute_offset() -> None:
    # Africa/Monrovia was -00:44:30 until 1972-01-07 00:44:30Z: fire times fell on :30 s.
    got = fires("0 0 * * *", "Africa/Monrovia", utc(1972, 1, 5), 3)
    assert got == [
        datetime(1972, 1, 5, 0, 44, 30, tzinfo=UTC),
        datetime(1972, 1, 6, 0, 44, 30, tzinfo=UTC),
        # Midnight of the 7th fell in the 44.5-minute gap: the first instant after it.
        datetime(1972, 1, 7, 0, 44, 30, tzinfo=UTC),
    ]


def test_east_of_utc_the_last_wall_year_still_counts_and_then_it_ends() -> None:
    # 2101-01-01 00:00 in Kiritimati (+14) is 2100-12-31T10:00Z, inside the calendar.
    calendar = ZonedCalendar.parse("@yearly", "Pacific/Kiritimati")
    assert calendar.next_after(utc(2100, 6, 1)) == utc(2100, 12, 31, 10)
    assert calendar.next_after(utc(2100, 12, 31, 10)) is None
    # West of UTC the same wall time is past the end.
    west = ZonedCalendar.parse("@yearly", "America/Los_Angeles")
    assert west.next_after(utc(2100, 6, 1)) is None
    assert west.next_after(datetime.max.replace(tzinfo=UTC)) is None
    assert list(west.iter_after(utc(2099, 6, 1))) == [utc(2100, 1, 1, 8)]


def test_nothing_before_1970() -> None:
    tokyo = ZonedCalendar.parse("0 9 * * *", "Asia/Tokyo")  # 09:00 JST = 00:00Z
    assert tokyo.next_after(utc(1960, 1, 1)) == utc(1970, 1, 1)
    assert tokyo.next_after(datetime.min.replace(tzinfo=UTC)) == utc(1970, 1, 1)
    early = ZonedCalendar.parse("0 8 * * *", "Asia/Tokyo")  # 1969-12-31T23:00Z: too early
    assert early.next_after(utc(1960, 1, 1)) == utc(1970, 1, 1, 23)
    assert not early.matches(utc(1969, 12, 31, 23))


def test_never_firing_expressions_are_exhausted_at_once() -> None:
    assert ZonedCalendar.parse("0 0 30 2 *", "Europe/Berlin").next_after(utc(2024, 1, 1)) is None


# --- UTC is CronCalendar ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "zone", [None, "UTC", UTC, timezone(timedelta(0)), ZoneInfo("UTC"), "Etc/UTC"]
)
def test_utc_is_the_default_and_equals_cron_calendar(zone: object) -> None:
    calendar = ZonedCalendar.parse("*/7 3-5 13 * Fri", zone)  # type: ignore[arg-type]
    plain = CronCalendar.parse("*/7 3-5 13 * Fri")
    start = utc(2024, 1, 1)
    assert list(islice(calendar.iter_after(start), 20)) == list(islice(plain.iter_after(start), 20))
    assert ZonedCalendar.parse("0 0 * * *").zone == "UTC"


# --- shorthands -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("shorthand", "fields"),
    [
        ("@hourly", "0 * * * *"),
        ("@daily", "0 0 * * *"),
        ("@midnight", "0 0 * * *"),
        ("@weekly", "0 0 * * Sun"),
        ("@monthly", "0 0 1 * *"),
        ("@yearly", "0 0 1 1 *"),
        ("@annually", "0 0 1 1 *"),
        ("@DAILY", "0 0 * * *"),
        (" @Weekly\n", "0 0 * * 1"),
    ],
)
def test_shorthands(shorthand: str, fields: str) -> None:
    assert ZonedCalendar.parse(shorthand, "Europe/Berlin") == ZonedCalendar.parse(
        fields, "Europe/Berlin"
    )
    assert shorthand.strip().lower() in SHORTHANDS


def test_weekly_is_sunday_midnight() -> None:
    assert fires("@weekly", "UTC", utc(2025, 1, 1), 2) == [utc(2025, 1, 5), utc(2025, 1, 12)]


@pytest.mark.parametrize("text", ["@daily", "@hourly", "@weekly", "@yearly"])
def test_cron_calendar_still_refuses_shorthands(text: str) -> None:
    """Seed 000's recurring publications stay UTC-only five-field cron."""
    with pytest.raises(InvalidCronExpression, match="shorthands"):
        CronCalendar.parse(text)


@pytest.mark.parametrize(
    "text", ["@reboot", "@every 5m", "@daily 0", "@", "@fortnightly", "@\x00", "@\ud800"]
)
def test_unknown_shorthands_are_rejected(text: str) -> None:
    with pytest.raises(InvalidCronExpression, match="unknown shorthand"):
        ZonedCalendar.parse(text, "Europe/Berlin")


# --- the interval / time-of-day classes ----------------------------------------------------


@pytest.mark.parametrize(
    ("expression", "interval"),
    [
        ("*/15 * * * *", True),
        ("0 * * * *", True),
        ("0 0-23 * * *", True),
        ("* 9 * * *", True),
        ("0-59 9 * * *", True),
        ("@hourly", True),
        ("30 2 * * *", False),
        ("*/15 0-5 * * *", False),
        ("0 */2 * * *", False),
        ("@daily", False),
    ],
)
def test_the_class_depends_only_on_the_field_sets(expression: str, interval: bool) -> None:
    assert ZonedCalendar.parse(expression, "Europe/Berlin").interval is interval


# --- the work queue's planning takes it as it is -------------------------------------------


def test_plan_tick_runs_a_zoned_calendar() -> None:
    calendar = ZonedCalendar.parse("30 2 * * *", "Europe/Berlin")
    plan = plan_tick(
        MissedRunPolicy.RUN_ONCE, calendar, utc(2024, 3, 30, 12), utc(2024, 3, 31, 6), 1
    )
    assert plan.due == (utc(2024, 3, 31, 1),)
    assert plan.next_due == utc(2024, 4, 1, 0, 30)


# --- values, reprs, errors -------------------------------------------------------------------


def test_equality_repr_and_tzinfo() -> None:
    a = ZonedCalendar.parse("@daily", "Europe/Berlin")
    b = ZonedCalendar.parse("0 0 * * *", ZoneInfo("Europe/Berlin"))
    assert a == b
    assert hash(a) == hash(b)
    assert a != ZonedCalendar.parse("@daily", "Europe/Paris")
    assert repr(a) == "ZonedCalendar.parse('@daily', 'Europe/Berlin')"
    assert a.tzinfo == ZoneInfo("Europe/Berlin")
    assert ZonedCalendar.parse("@daily").tzinfo is UTC
    assert steeple.core.ZonedCalendar is ZonedCalendar
    assert steeple.core.InvalidTimeZoneError is InvalidTimeZoneError


@pytest.mark.parametrize("method", ["next_after", "matches", "iter_after"])
def test_naive_and_non_datetimes_are_refused(method: str) -> None:
    calendar = ZonedCalendar.parse("@daily", "Europe/Berlin")
    with pytest.raises(ValueError, match="naive"):
        getattr(calendar, method)(datetime(2024, 1, 1))
    with pytest.raises(TypeError, match="timezone-aware datetime"):
        getattr(calendar, method)("2024-01-01T00:00Z")


@pytest.mark.parametrize(
    ("zone", "reason"),
    [
        ("Mars/Olympus_Mons", "unknown time zone"),
        ("Europe", "unknown time zone"),
        ("", "not an IANA time zone name"),
        ("../../etc/passwd", "not an IANA time zone name"),
        ("/etc/localtime", "not an IANA time zone name"),
        ("Europe/../UTC", "not an IANA time zone name"),
        (" Europe/Berlin", "not an IANA time zone name"),
        ("Europe/Berlin\x00", "not an IANA time zone name"),
        ("Europe/\ud800", "not an IANA time zone name"),
        ("Europe/Berlin\u00a0", "not an IANA time zone name"),
        ("x" * 10_000, "longer than 128 characters"),
        ("localtime", "this host's own zone"),
        ("posixrules", "this host's own zone"),
        (5, "expected an IANA zone name"),
        (b"Europe/Berlin", "expected an IANA zone name"),
        (3.5, "expected an IANA zone name"),
        (timezone(timedelta(hours=2)), "expected an IANA zone name"),
        (["Europe/Berlin"], "expected an IANA zone name"),
    ],
)
def test_bad_zones_raise_the_typed_error(zone: object, reason: str) -> None:
    with pytest.raises(InvalidTimeZoneError, match=reason) as caught:
        ZonedCalendar.parse("@daily", zone)  # type: ignore[arg-type]
    error = caught.value
    assert isinstance(error, ConfigurationError)
    assert isinstance(error, ValueError)
    assert isinstance(error, SteepleError)
    assert len(str(error)) < 400
    assert "\x00" not in str(error)
    str(error).encode("utf-8")  # lone surrogates are escaped, so the message prints


def test_a_zoneinfo_of_the_hosts_own_zone_is_refused() -> None:
    # /usr/share/zoneinfo/localtime links to /etc/localtime: a different zone on each host.
    try:
        zone = ZoneInfo("localtime")
    except (ZoneInfoNotFoundError, ValueError, OSError):
        pytest.skip("this host's tz database has no 'localtime' entry")
    with pytest.raises(InvalidTimeZoneError, match="this host's own zone"):
        ZonedCalendar.parse("@daily", zone)


def test_a_zoneinfo_without_a_name_is_refused(tmp_path: Path) -> None:
    source = Path("/usr/share/zoneinfo/Europe/Berlin")
    if not source.exists():
        pytest.skip("no system tz database file to read")
    with source.open("rb") as handle:
        nameless = ZoneInfo.from_file(handle)
    with pytest.raises(InvalidTimeZoneError, match="no IANA name"):
        ZonedCalendar.parse("@daily", nameless)


def test_a_missing_tz_database_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    class NoDatabase(ZoneInfo):
        def __new__(cls, key: str) -> NoDatabase:
            raise ZoneInfoNotFoundError(key)

    monkeypatch.setattr("zoneinfo.ZoneInfo", NoDatabase)
    with pytest.raises(InvalidTimeZoneError, match="no IANA time zone database is installed"):
        ZonedCalendar.parse("@daily", "Europe/Berlin")
    # UTC needs no database.
    assert ZonedCalendar.parse("@daily", "UTC").zone == "UTC"


@pytest.mark.parametrize(
    "expression", [None, 5, b"0 0 * * *", "0 0 * *", "\x00", "0 0 * * * *", "x" * 10_000]
)
def test_bad_expressions_raise_the_cron_error(expression: object) -> None:
    with pytest.raises(InvalidCronExpression):
        ZonedCalendar.parse(expression, "Europe/Berlin")  # type: ignore[arg-type]


def test_the_readme_example_runs() -> None:
    """The README's "How the work queue's jobs use it" snippet is executed as written."""
    readme = Path(__file__).resolve().parents[1] / "README.md"
    text = readme.read_text()
    section = text[text.index("### How the work queue's jobs use it") :]
    snippet = section[section.index("```python") + len("```python") : section.index("```\n\n")]
    assert "plan_tick" in snippet
    exec(compile(snippet, str(readme), "exec"), {})


def test_importing_core_does_not_load_zoneinfo() -> None:
    """zoneinfo (and the sysconfig it loads) come only when a zone name is parsed."""
    script = (
        "import sys\n"
        "import steeple.core\n"
        "from steeple.core import ZonedCalendar\n"
        "ZonedCalendar.parse('@daily')\n"
        "print('zoneinfo' in sys.modules)\n"
        "ZonedCalendar.parse('@daily', 'Europe/Berlin')\n"
        "print('zoneinfo' in sys.modules)\n"
    )
    completed = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60
    )
    assert completed.stdout.split() == ["False", "True"]


def test_direct_construction_checks_types() -> None:
    calendar = CronCalendar.parse("0 0 * * *")
    assert ZonedCalendar("0 0 * * *", calendar, "UTC", UTC) == ZonedCalendar.parse("@daily")
    with pytest.raises(TypeError):
        ZonedCalendar("0 0 * * *", "0 0 * * *", "UTC", UTC)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        ZonedCalendar("0 0 * * *", calendar, "UTC", "UTC")  # type: ignore[arg-type]
