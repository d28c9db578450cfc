"""Recurring jobs in a time zone, on a real PostgreSQL: daylight-saving nights, shorthands.

Materialization is driven the way a worker drives it, one tick a minute, with the instant
given explicitly (``materialize_due(..., clock=)``, the seam the job tests use: by default
it reads the server's clock). The expected fire times are written out by hand from the
rules in ``packages/core/README.md`` (a skipped time of day runs once at the end of the gap,
a repeated one once at its first occurrence, interval expressions follow real time), not
computed with the calendar under test.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta, timezone
from typing import Any
from zoneinfo import ZoneInfo

import asyncpg
import pytest

from queue_support import QueueFixture
from steeple.core.config import RecurringDefinition
from steeple.core.errors import ConfigurationError, InvalidCronExpression, InvalidTimeZoneError
from steeple.core.messages import ScheduledMessage
from steeple.core.policies import MissedRunPolicy
from steeple.core.zoned import ZonedCalendar
from steeple.postgres.queue import JobNotFoundError, Task, _schema, install, jobs
from steeple.testing import FakeClock

REPORT: Task[Any] = Task("report")
MINUTE = timedelta(minutes=1)


def utc(
    year: int, month: int, day: int, hour: int = 0, minute: int = 0, second: int = 0
) -> datetime:
    return datetime(year, month, day, hour, minute, second, tzinfo=UTC)


async def _occurrences(conn: asyncpg.Connection, schema: str, job: str) -> list[datetime]:
    rows = await conn.fetch(
        f'SELECT t.scheduled_for, t.run_at FROM "{schema}".tasks t '
        f'JOIN "{schema}".jobs j ON j.id = t.job_id WHERE j.name = $1 ORDER BY t.scheduled_for',
        job,
    )
    assert all(r["run_at"] == r["scheduled_for"] for r in rows)
    return [r["scheduled_for"] for r in rows]


async def _tick_every_minute(
    conn: asyncpg.Connection, schema: str, clock: FakeClock, until: datetime
) -> None:
    """Materialize once a minute from the clock's time through ``until``, as a worker does."""
    while clock.now() < until:
        clock.advance(MINUTE)
        await jobs.materialize_due(conn, schema=schema, clock=clock)


async def test_berlin_spring_forward_runs_the_skipped_time_once_after_the_gap(
    queue: QueueFixture,
) -> None:
    """2024-03-31: 02:00 CET became 03:00 CEST; 02:30 that night did not exist."""
    _dsn, schema, conn = queue
    clock = FakeClock(utc(2024, 3, 30, 22, 0))  # 23:00 CET, the evening before
    info = await jobs.create(
        conn, "nightly", REPORT, "30 2 * * *", {}, schema=schema, clock=clock,
        timezone="Europe/Berlin",
    )  # fmt: skip
    assert info.timezone == "Europe/Berlin"
    assert info.next_run_at == utc(2024, 3, 31, 1, 0)  # 03:00 CEST, the end of the gap
    await _tick_every_minute(conn, schema, clock, utc(2024, 3, 31, 4, 0))
    # Once, at the first instant after the gap: not at 00:30Z (02:30 read as CEST) nor at
    # 01:30Z (02:30 read as CET), and never twice.
    assert await _occurrences(conn, schema, "nightly") == [utc(2024, 3, 31, 1, 0)]
    after = await jobs.get(conn, "nightly", schema=schema)
    assert after.next_run_at == utc(2024, 4, 1, 0, 30)  # 02:30 CEST the next night
    clock.set(utc(2024, 4, 1, 0, 29, 59))
    assert await jobs.materialize_due(conn, schema=schema, clock=clock) == 0
    clock.set(utc(2024, 4, 1, 0, 30))
    assert await jobs.materialize_due(conn, schema=schema, clock=clock) == 1


async def test_berlin_fall_back_runs_the_repeated_time_once_at_its_first_occurrence(
    queue: QueueFixture,
) -> None:
    """2024-10-27: 03:00 CEST became 02:00 CET; 02:30 happened twice that night."""
    _dsn, schema, conn = queue
    clock = FakeClock(utc(2024, 10, 26, 22, 0))  # midnight CEST
    info = await jobs.create(
        conn, "nightly", REPORT, "30 2 * * *", {}, schema=schema, clock=clock,
        timezone=ZoneInfo("Europe/Berlin"),
    )  # fmt: skip
    assert info.timezone == "Europe/Berlin"  # a ZoneInfo is stored by its name
    await _tick_every_minute(conn, schema, clock, utc(2024, 10, 27, 4, 0))
    # 02:30 CEST (00:30Z) ran; 02:30 CET (01:30Z), the second pass, did not.
    assert await _occurrences(conn, schema, "nightly") == [utc(2024, 10, 27, 0, 30)]
    after = await jobs.get(conn, "nightly", schema=schema)
    assert after.next_run_at == utc(2024, 10, 28, 1, 30)  # 02:30 CET the next night


async def test_new_york_hourly_follows_real_time_through_the_repeated_hour(
    queue: QueueFixture,
) -> None:
    """2024-11-03: 02:00 EDT became 01:00 EST; @hourly is an interval expression."""
    _dsn, schema, conn = queue
    clock = FakeClock(utc(2024, 11, 3, 3, 30))  # 23:30 EDT
    await jobs.create(
        conn, "hourly", REPORT, "@hourly", {}, schema=schema, clock=clock,
        timezone="America/New_York",
    )  # fmt: skip
    await _tick_every_minute(conn, schema, clock, utc(2024, 11, 3, 8, 30))
    # 00:00 EDT, 01:00 EDT, 01:00 EST, 02:00 EST, 03:00 EST: one an hour of real time.
    assert await _occurrences(conn, schema, "hourly") == [
        utc(2024, 11, 3, hour, 0) for hour in (4, 5, 6, 7, 8)
    ]


async def test_lord_howe_half_hour_shifts(queue: QueueFixture) -> None:
    """Lord Howe Island moves its clocks by 30 minutes: +10:30 in winter, +11 in summer."""
    _dsn, schema, conn = queue
    # Spring, 2024-10-06 02:00 +10:30 became 02:30 +11: 02:15 did not exist.
    clock = FakeClock(utc(2024, 10, 5, 14, 0))
    await jobs.create(
        conn, "spring", REPORT, "15 2 * * *", {}, schema=schema, clock=clock,
        timezone="Australia/Lord_Howe",
    )  # fmt: skip
    await _tick_every_minute(conn, schema, clock, utc(2024, 10, 5, 17, 0))
    assert await _occurrences(conn, schema, "spring") == [utc(2024, 10, 5, 15, 30)]  # 02:30 +11
    assert (await jobs.get(conn, "spring", schema=schema)).next_run_at == utc(2024, 10, 6, 15, 15)

    # Autumn, 2024-04-07 02:00 +11 became 01:30 +10:30: 01:30-01:59 happened twice.
    clock = FakeClock(utc(2024, 4, 6, 13, 30))
    for name, cron in (("autumn", "45 1 * * *"), ("quarterly", "*/15 * * * *")):
        await jobs.create(
            conn, name, REPORT, cron, {}, schema=schema, clock=clock,
            timezone="Australia/Lord_Howe",
        )  # fmt: skip
    await _tick_every_minute(conn, schema, clock, utc(2024, 4, 6, 16, 30))
    # A time of day: once, at 01:45 +11 (14:45Z); not at 01:45 +10:30 (15:15Z).
    assert await _occurrences(conn, schema, "autumn") == [utc(2024, 4, 6, 14, 45)]
    # An interval: every 15 minutes of real time, both passes included, none doubled.
    start = utc(2024, 4, 6, 13, 45)
    assert await _occurrences(conn, schema, "quarterly") == [
        start + timedelta(minutes=15 * i) for i in range(12)
    ]


async def test_sao_paulo_daily_before_and_after_brazil_abolished_dst(queue: QueueFixture) -> None:
    """Brazil skipped midnight on 2018-11-04 (00:00 -03 became 01:00 -02), and from 2019 on
    has no daylight-saving time: the same job follows the rules of each year."""
    _dsn, schema, conn = queue
    clock = FakeClock(utc(2018, 11, 3, 23, 0))  # 20:00 -03
    await jobs.create(
        conn, "daily", REPORT, "@daily", {}, schema=schema, clock=clock,
        timezone="America/Sao_Paulo",
    )  # fmt: skip
    await _tick_every_minute(conn, schema, clock, utc(2018, 11, 4, 5, 0))
    assert await _occurrences(conn, schema, "daily") == [utc(2018, 11, 4, 3, 0)]  # 01:00 -02
    after_2018 = await jobs.get(conn, "daily", schema=schema)
    assert after_2018.next_run_at == utc(2018, 11, 5, 2, 0)  # midnight -02 (summer time)

    clock.set(utc(2019, 11, 2, 23, 0))
    await jobs.reschedule(conn, "daily", "@daily", schema=schema, clock=clock)  # from now
    await _tick_every_minute(conn, schema, clock, utc(2019, 11, 3, 5, 0))
    assert (await _occurrences(conn, schema, "daily"))[1:] == [utc(2019, 11, 3, 3, 0)]
    after_2019 = await jobs.get(conn, "daily", schema=schema)
    assert after_2019.next_run_at == utc(2019, 11, 4, 3, 0)  # midnight -03: no DST any more


@pytest.mark.parametrize(
    ("shorthand", "first"),
    [
        ("@hourly", utc(2026, 3, 4, 6, 0)),
        ("@daily", utc(2026, 3, 5, 0, 0)),
        ("@midnight", utc(2026, 3, 5, 0, 0)),
        ("@weekly", utc(2026, 3, 8, 0, 0)),  # Sunday
        ("@monthly", utc(2026, 4, 1, 0, 0)),
        ("@yearly", utc(2027, 1, 1, 0, 0)),
        ("@annually", utc(2027, 1, 1, 0, 0)),
        ("  @DAILY\t", utc(2026, 3, 5, 0, 0)),
    ],
)
async def test_jobs_take_the_shorthands(
    queue: QueueFixture, shorthand: str, first: datetime
) -> None:
    _dsn, schema, conn = queue
    clock = FakeClock(utc(2026, 3, 4, 5, 6, 7))  # a Wednesday
    info = await jobs.create(conn, "short", REPORT, shorthand, {}, schema=schema, clock=clock)
    assert info.cron == shorthand  # stored as written
    assert info.timezone == "UTC"
    assert info.next_run_at == first
    clock.set(first)
    assert await jobs.materialize_due(conn, schema=schema, clock=clock) == 1
    assert await _occurrences(conn, schema, "short") == [first]


async def test_a_shorthand_in_a_zone(queue: QueueFixture) -> None:
    _dsn, schema, conn = queue
    clock = FakeClock(utc(2026, 7, 1, 12, 0))
    info = await jobs.ensure_job(
        conn, "tokyo", REPORT, "@daily", {}, schema=schema, clock=clock, timezone="Asia/Tokyo"
    )
    assert info.next_run_at == utc(2026, 7, 1, 15, 0)  # midnight +09


@pytest.mark.parametrize(
    "cron", ["@daily", "@hourly", "@weekly", "@monthly", "@yearly", "@annually", "@midnight"]
)
def test_recurring_publications_stay_five_fields_in_utc(cron: str) -> None:
    """Seed 000's definitions take neither shorthands nor a zoned calendar."""
    message = ScheduledMessage("topic", "type", b"{}")
    after = utc(2026, 1, 1)
    with pytest.raises(InvalidCronExpression, match="shorthands"):
        RecurringDefinition("d", cron, after, MissedRunPolicy.CATCH_UP, message)
    zoned = ZonedCalendar.parse(cron, "Europe/Berlin")
    with pytest.raises(InvalidCronExpression, match="must be a str"):
        RecurringDefinition("d", zoned, after, MissedRunPolicy.CATCH_UP, message)


HOSTILE_ZONES: list[object] = [
    "Mars/Olympus_Mons",
    "europe/berlin",  # names are case-sensitive
    "",
    "../../etc/passwd",
    "/etc/localtime",
    "localtime",  # the host's own zone: would differ between workers
    "posixrules",
    "Europe/Berlin\x00",
    "Europe/\ud800",
    "Europe/Berlin ",
    "x" * 10_000,
    5,
    b"Europe/Berlin",
    timezone(timedelta(hours=2)),  # a fixed offset has no daylight-saving rules to follow
    ["Europe/Berlin"],
]


@pytest.mark.parametrize("zone", HOSTILE_ZONES)
async def test_hostile_zones_get_the_typed_error_and_nothing_is_stored(
    queue: QueueFixture, zone: object
) -> None:
    _dsn, schema, conn = queue
    clock = FakeClock(utc(2026, 3, 4, 5, 6, 7))
    for declare in (jobs.create, jobs.ensure_job):
        with pytest.raises(InvalidTimeZoneError) as caught:
            await declare(
                conn, "z", REPORT, "@daily", {}, schema=schema, clock=clock,
                timezone=zone,  # type: ignore[arg-type]
            )  # fmt: skip
        assert isinstance(caught.value, ConfigurationError)
        assert isinstance(caught.value, ValueError)
        message = str(caught.value)
        assert len(message) < 400
        message.encode("utf-8")  # printable: no lone surrogates
        assert "\x00" not in message
    assert await conn.fetchval(f'SELECT count(*) FROM "{schema}".jobs') == 0

    before = await jobs.create(conn, "kept", REPORT, "@daily", {}, schema=schema, clock=clock)
    with pytest.raises(InvalidTimeZoneError):
        await jobs.reschedule(
            conn, "kept", "@hourly", schema=schema, clock=clock,
            timezone=zone,  # type: ignore[arg-type]
        )  # fmt: skip
    assert await jobs.get(conn, "kept", schema=schema) == before


async def test_ensure_compares_the_zone_as_well_as_the_cron(queue: QueueFixture) -> None:
    _dsn, schema, conn = queue
    clock = FakeClock(utc(2026, 3, 4, 5, 6, 7))
    first = await jobs.ensure_job(
        conn, "j", REPORT, "0 9 * * *", {}, schema=schema, clock=clock, timezone="Europe/Berlin"
    )
    assert first.next_run_at == utc(2026, 3, 4, 8, 0)  # 09:00 CET
    clock.advance(timedelta(minutes=5))
    same = await jobs.ensure_job(
        conn, "j", REPORT, "0 9 * * *", {}, schema=schema, clock=clock,
        timezone=ZoneInfo("Europe/Berlin"),
    )  # fmt: skip
    assert same == first  # the same declaration: nothing changed, not even updated_at

    moved = await jobs.ensure_job(
        conn, "j", REPORT, "0 9 * * *", {}, schema=schema, clock=clock,
        timezone="America/New_York",
    )  # fmt: skip
    assert moved.timezone == "America/New_York"
    assert moved.cursor_at == clock.now()  # a new calendar restarts the cursor from now
    assert moved.next_run_at == utc(2026, 3, 4, 14, 0)  # 09:00 EST

    back_to_utc = await jobs.ensure_job(
        conn, "j", REPORT, "0 9 * * *", {}, schema=schema, clock=clock
    )
    assert back_to_utc.timezone == "UTC"
    assert back_to_utc.next_run_at == utc(2026, 3, 4, 9, 0)


async def test_reschedule_keeps_the_zone_unless_given_and_resume_uses_it(
    queue: QueueFixture,
) -> None:
    _dsn, schema, conn = queue
    clock = FakeClock(utc(2026, 3, 4, 5, 6, 7))
    await jobs.create(
        conn, "j", REPORT, "0 9 * * *", {}, schema=schema, clock=clock, timezone="Asia/Kolkata"
    )
    kept = await jobs.reschedule(conn, "j", "30 10 * * *", schema=schema, clock=clock)
    assert (kept.cron, kept.timezone) == ("30 10 * * *", "Asia/Kolkata")
    assert kept.next_run_at == utc(2026, 3, 5, 5, 0)  # 10:30 +05:30 tomorrow (it is 10:36)
    moved = await jobs.reschedule(
        conn, "j", "@daily", schema=schema, clock=clock, timezone="Pacific/Kiritimati"
    )
    assert (moved.cron, moved.timezone) == ("@daily", "Pacific/Kiritimati")
    assert moved.next_run_at == utc(2026, 3, 4, 10, 0)  # midnight +14
    utc_again = await jobs.reschedule(
        conn, "j", "@daily", schema=schema, clock=clock, timezone=None
    )
    assert utc_again.timezone == "UTC"
    await jobs.reschedule(
        conn, "j", "0 9 * * *", schema=schema, clock=clock, timezone="Asia/Kolkata"
    )
    await jobs.pause(conn, "j", schema=schema)
    clock.set(utc(2026, 3, 5, 4, 0))
    resumed = await jobs.resume(conn, "j", schema=schema, clock=clock)
    assert resumed.timezone == "Asia/Kolkata"
    assert resumed.next_run_at == utc(2026, 3, 6, 3, 30)  # 09:00 +05:30, the day after
    with pytest.raises(JobNotFoundError):
        await jobs.reschedule(conn, "nope", "@daily", schema=schema, timezone="Europe/Berlin")


async def test_a_zone_this_host_does_not_know_skips_that_job_only(
    queue: QueueFixture, caplog: pytest.LogCaptureFixture
) -> None:
    """A row naming a zone this worker's tz database lacks (another host's newer database,
    or a hand-written row) must not stop the other jobs' materialization."""
    _dsn, schema, conn = queue
    clock = FakeClock(utc(2026, 3, 4, 5, 6, 7))
    for name in ("alien", "fine"):
        await jobs.create(conn, name, REPORT, "*/10 * * * *", {}, schema=schema, clock=clock)
    await conn.execute(
        f"""UPDATE "{schema}".jobs SET timezone = 'Mars/Olympus_Mons' WHERE name = 'alien'"""
    )
    clock.set(utc(2026, 3, 4, 5, 10))
    with caplog.at_level(logging.WARNING, logger="steeple.postgres.queue"):
        assert await jobs.materialize_due(conn, schema=schema, clock=clock) == 1
    assert await _occurrences(conn, schema, "fine") == [utc(2026, 3, 4, 5, 10)]
    assert await _occurrences(conn, schema, "alien") == []
    assert "cannot be materialized here" in caplog.text
    assert "Mars/Olympus_Mons" in caplog.text
    alien = await jobs.get(conn, "alien", schema=schema)
    assert alien.next_run_at == utc(2026, 3, 4, 5, 10)  # untouched: another worker may know it


async def test_jobs_of_a_version_2_schema_become_utc_jobs(pg_schema: tuple[str, str]) -> None:
    """Upgrading a database installed before time zones: existing jobs keep firing in UTC."""
    dsn, schema = pg_schema
    conn = await asyncpg.connect(dsn)
    try:
        old = tuple(m for m in _schema._MIGRATIONS if m[0] <= 2)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(_schema, "_MIGRATIONS", old)
            patch.setattr(_schema, "LIBRARY_SCHEMA_VERSION", 2)
            assert await _schema.install(conn, schema=schema) == 2
        await conn.execute(
            f"""INSERT INTO "{schema}".jobs (name, task_name, cron, args, priority, max_attempts,
                lease_duration, backoff_initial_us, backoff_maximum_us, backoff_factor,
                backoff_jitter, cursor_at, next_run_at)
            VALUES ('old', 'report', '0 * * * *', '{{}}', 0, 5, '60 s', 1000000, 300000000, 2,
                    0, $1, $2)""",
            utc(2026, 3, 4, 5, 6), utc(2026, 3, 4, 6, 0),
        )  # fmt: skip
        await install(conn, schema=schema)
        info = await jobs.get(conn, "old", schema=schema)
        assert (info.cron, info.timezone) == ("0 * * * *", "UTC")
        clock = FakeClock(utc(2026, 3, 4, 6, 0))
        assert await jobs.materialize_due(conn, schema=schema, clock=clock) == 1
        assert (await jobs.get(conn, "old", schema=schema)).next_run_at == utc(2026, 3, 4, 7, 0)
        assert await conn.fetchval(f'SELECT trace_context FROM "{schema}".tasks') is None
    finally:
        await conn.close()
