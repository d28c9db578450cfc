"""The work queue's recurring-job calendar: a cron expression in the wall-clock time of a zone.

:class:`ZonedCalendar` reads the five fields exactly as :class:`~steeple.core.calendar.
CronCalendar` does (same parser, same rules), also accepts the shorthands ``@hourly``,
``@daily`` (``@midnight``), ``@weekly``, ``@monthly`` and ``@yearly`` (``@annually``), and
matches them against the wall clock of an IANA time zone. Recurring publications
keep using :class:`CronCalendar` (UTC only, no shorthands); this module is for
the work queue's recurring jobs.

Daylight-saving rules (see the package README for worked examples). An expression is an
**interval** expression when its minute field or its hour field allows every value
(``*/15 * * * *``, ``0 * * * *``, ``* 9 * * *``); otherwise it names **times of day**
(``30 2 * * *``, ``0 9 * * Mon-Fri``, ``*/15 0-5 * * *``). The class depends only on the
field value sets, so equal calendars (``0 0-23 * * *`` and ``0 * * * *``) behave alike.

* Interval expressions follow real time: an instant fires when its wall-clock time
  matches. Wall times skipped by a spring-forward never occur, so they do not fire (the
  real-time rhythm goes on across the gap); wall times that occur twice in autumn fire on
  both passes (every 15 minutes of real time stays every 15 minutes: none dropped, none
  doubled).
* Time-of-day expressions fire once per matching wall time. A wall time that does not
  exist (skipped by a spring-forward) fires once, at the first instant after the gap;
  several such times in one gap fire once together. A wall time that occurs twice fires
  once, at its first occurrence (the earlier instant, ``fold=0``).

Bounds and errors follow :class:`CronCalendar`: results are aware UTC datetimes from
1970-01-01T00:00Z through 2100-12-31T23:59Z (then the calendar is exhausted: ``None``),
``next_after`` is strictly after its argument, naive datetimes raise ``ValueError``. In
UTC (the default) every result equals :class:`CronCalendar`'s.

Exactness: the search reads the zone only through ``zoneinfo`` and is exact for zones
whose offset changes are more than two days apart and at most a day large, as every zone
of the tz database is between 1970 and 2100 (closest pair: 6 days 23 hours, largest jump:
24 hours). Pure apart from ``zoneinfo`` loading the zone's rules when a name is parsed.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta, timezone, tzinfo
from typing import TYPE_CHECKING, Final

import attrs

from steeple.core.calendar import FIRST_INSTANT, LAST_INSTANT, CronCalendar, _require_aware
from steeple.core.errors import InvalidCronExpression, InvalidTimeZoneError

if TYPE_CHECKING:
    from zoneinfo import ZoneInfo

__all__ = ["DEFAULT_ZONE", "MAX_ZONE_NAME_LENGTH", "SHORTHANDS", "ZonedCalendar"]

#: The zone used when none is given: identical to :class:`CronCalendar`.
DEFAULT_ZONE: Final = "UTC"
#: Longer zone names are rejected before lookup (the longest IANA name has 32 characters).
MAX_ZONE_NAME_LENGTH: Final = 128
#: The shorthands (case-insensitive) and the five fields each stands for (weekday 1=Sunday).
SHORTHANDS: Final[dict[str, str]] = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * Sun",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}

_ONE_MINUTE: Final = timedelta(minutes=1)
_ONE_SECOND: Final = timedelta(seconds=1)
_EPSILON: Final = timedelta(microseconds=1)
# A wall time in 2101 can still be an instant of 2100 (offsets reach +14 h).
_WALL_LAST_YEAR: Final = 2101
# IANA names: ASCII letters, digits, '_', '-', '+', components separated by '/'; no dots,
# so no '..' can walk out of the tz database directory.
_ZONE_NAME: Final = re.compile(r"[A-Za-z0-9_+\-]+(?:/[A-Za-z0-9_+\-]+)*")
# Files of a tz database directory that name no fixed zone: ``localtime`` is the host's own
# zone (a link to /etc/localtime) and ``posixrules`` a build-time default. A job stored
# with one would fire at different instants on workers of different hosts.
_HOST_NAMES: Final = frozenset({"localtime", "posixrules"})
_ALL_MINUTES: Final = frozenset(range(60))
_ALL_HOURS: Final = frozenset(range(24))


def _expand_shorthand(expression: str) -> str:
    """Return the five fields of an ``@`` shorthand, or ``expression`` unchanged."""
    stripped = expression.strip(" \t\r\n")
    if not stripped.startswith("@"):
        return expression
    fields = SHORTHANDS.get(stripped.lower())
    if fields is None:
        known = ", ".join(SHORTHANDS)
        raise InvalidCronExpression(
            expression, f"unknown shorthand (known: {known}; @reboot and @every are not supported)"
        )
    return fields


def _host_zone(name: str) -> InvalidTimeZoneError:
    return InvalidTimeZoneError(
        name, "names this host's own zone, not an IANA zone: name the zone, e.g. 'Europe/Berlin'"
    )


def _load_zone(zone: object) -> tuple[str, tzinfo]:
    """Return the zone's IANA name and its tzinfo (``datetime.UTC`` for UTC itself)."""
    if zone is None or (isinstance(zone, str) and zone == DEFAULT_ZONE):
        return DEFAULT_ZONE, UTC
    if isinstance(zone, timezone) and zone == UTC:
        return DEFAULT_ZONE, UTC
    # Imported only past UTC: zoneinfo loads sysconfig, and UTC-only users (the recurring
    # publications, jobs without a zone) never need it.
    from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

    if isinstance(zone, ZoneInfo):
        if zone.key is None:
            raise InvalidTimeZoneError(
                "<ZoneInfo>", "a ZoneInfo read from a file has no IANA name; pass the name"
            )
        if zone.key in _HOST_NAMES:
            raise _host_zone(zone.key)
        return (DEFAULT_ZONE, UTC) if zone.key == DEFAULT_ZONE else (zone.key, zone)
    if not isinstance(zone, str):
        raise InvalidTimeZoneError(
            f"<{type(zone).__name__}>",
            f"expected an IANA zone name (str) or a zoneinfo.ZoneInfo, got {type(zone).__name__}",
        )
    if len(zone) > MAX_ZONE_NAME_LENGTH:
        raise InvalidTimeZoneError(
            zone, f"longer than {MAX_ZONE_NAME_LENGTH} characters ({len(zone)})"
        )
    if not _ZONE_NAME.fullmatch(zone):
        raise InvalidTimeZoneError(
            zone,
            "not an IANA time zone name (ASCII letters, digits, '_', '-', '+', "
            "components separated by '/', e.g. 'Europe/Berlin')",
        )
    if zone in _HOST_NAMES:
        raise _host_zone(zone)
    try:
        return zone, ZoneInfo(zone)
    except (ZoneInfoNotFoundError, ValueError, OSError):
        pass
    try:
        ZoneInfo("Etc/UTC")
    except (ZoneInfoNotFoundError, ValueError, OSError):
        raise InvalidTimeZoneError(
            zone,
            "no IANA time zone database is installed: install the system's tzdata "
            "package or the 'tzdata' Python package",
        ) from None
    raise InvalidTimeZoneError(
        zone, "unknown time zone (names are case-sensitive, e.g. 'America/New_York')"
    ) from None


def _naive(moment: datetime) -> datetime:
    return moment.replace(tzinfo=None)


def _offset_of(moment: datetime) -> timedelta:
    # Aware datetimes of a ZoneInfo always have an offset; None only for naive ones.
    offset = moment.utcoffset()
    return timedelta(0) if offset is None else offset


def _ceil_minute(moment: datetime) -> datetime:
    if moment.second or moment.microsecond:
        return moment.replace(second=0, microsecond=0) + _ONE_MINUTE
    return moment


@attrs.frozen(repr=False)
class ZonedCalendar:
    """A cron expression evaluated in the wall-clock time of an IANA zone.

    Build one with :meth:`parse`. The module docstring states the daylight-saving rules.
    Two calendars are equal when their field sets and zone names are equal
    (``@daily`` equals ``0 0 * * *`` in the same zone).

    Attributes:
        expression: the text given to :meth:`parse` (shorthand or five fields).
        calendar: the five fields, parsed by :class:`CronCalendar` (shorthand expanded).
        zone: the IANA zone name (``"UTC"`` by default).
        interval: True when the minute or the hour field allows every value: the
            expression follows real time across daylight-saving changes; False when it
            names times of day (fired once each, see the module docstring).
    """

    # Type checks so that direct construction (bypassing parse) cannot build a calendar
    # the search would fail on.
    expression: str = attrs.field(eq=False, validator=attrs.validators.instance_of(str))
    calendar: CronCalendar = attrs.field(validator=attrs.validators.instance_of(CronCalendar))
    zone: str = attrs.field(validator=attrs.validators.instance_of(str))
    _tz: tzinfo = attrs.field(eq=False, validator=attrs.validators.instance_of(tzinfo))  # type: ignore[type-abstract]
    interval: bool = attrs.field(init=False, eq=False)

    def __attrs_post_init__(self) -> None:
        calendar = self.calendar
        interval = calendar.minutes == _ALL_MINUTES or calendar.hours == _ALL_HOURS
        object.__setattr__(self, "interval", interval)

    @classmethod
    def parse(cls, expression: str, zone: str | ZoneInfo | None = DEFAULT_ZONE) -> ZonedCalendar:
        """Parse a cron expression or shorthand to be evaluated in ``zone``.

        Args:
            expression: five fields as :meth:`CronCalendar.parse` reads them, or one of
                ``@hourly``, ``@daily``, ``@midnight``, ``@weekly``, ``@monthly``,
                ``@yearly``, ``@annually`` (case-insensitive).
            zone: an IANA zone name such as ``"Europe/Berlin"``, a ``zoneinfo.ZoneInfo``,
                ``datetime.UTC`` or ``None`` (both UTC). Default ``"UTC"``, which needs no
                tz database.

        Returns:
            The calendar.

        Raises:
            InvalidCronExpression: the expression is invalid (see :meth:`CronCalendar.
                parse`) or an unknown shorthand.
            InvalidTimeZoneError: ``zone`` is of the wrong type, longer than 128
                characters, not of the form of an IANA name, unknown, the host's own zone
                (``localtime``, ``posixrules``), or no tz database is installed.
        """
        name, tz = _load_zone(zone)
        # A non-str expression goes to CronCalendar.parse, which raises the typed error.
        fields = _expand_shorthand(expression) if isinstance(expression, str) else expression
        return cls(expression, CronCalendar.parse(fields), name, tz)

    def __repr__(self) -> str:
        return f"ZonedCalendar.parse({self.expression!r}, {self.zone!r})"

    @property
    def tzinfo(self) -> tzinfo:
        """The zone as a tzinfo (``datetime.UTC`` for UTC), to show due times locally."""
        return self._tz

    # --- public queries -------------------------------------------------------------------

    def matches(self, instant: datetime) -> bool:
        """Tell whether ``instant`` is one of the calendar's fire times (rules above).

        Raises:
            ValueError: ``instant`` is naive.
            TypeError: ``instant`` is not a datetime.
        """
        instant = _require_aware(instant)
        if self._tz is UTC:
            return self.calendar.matches(instant)
        if instant < FIRST_INSTANT or instant > LAST_INSTANT:
            return False
        utc = instant.astimezone(UTC)
        local = utc.astimezone(self._tz)
        if (
            local.second == 0
            and local.microsecond == 0
            and self._wall_matches(_naive(local))
            and (self.interval or local.fold == 0)
        ):
            return True
        if self.interval:
            return False
        # A time-of-day expression also fires at the first instant after a gap that
        # swallowed one of its wall times.
        before = self._offset(utc - _EPSILON)
        after = _offset_of(local)
        if after <= before:
            return False
        gap_start, gap_end = _naive(utc) + before, _naive(utc) + after
        found = self._first_wall_at_or_after(_ceil_minute(gap_start))
        return found is not None and found < gap_end

    def next_after(self, instant: datetime) -> datetime | None:
        """Return the first fire time strictly after ``instant``.

        Args:
            instant: a timezone-aware datetime (any offset, compared exactly).

        Returns:
            An aware UTC datetime, never before 1970-01-01T00:00Z; ``None`` when no fire
            time remains through 2100-12-31T23:59Z.

        Raises:
            ValueError: ``instant`` is naive.
            TypeError: ``instant`` is not a datetime.
        """
        instant = _require_aware(instant)
        if self._tz is UTC:
            return self.calendar.next_after(instant)
        if not self.calendar._can_fire or instant >= LAST_INSTANT:
            return None
        # Compared before converting: astimezone() can overflow near datetime.min.
        start = FIRST_INSTANT - _EPSILON if instant < FIRST_INSTANT else instant.astimezone(UTC)
        found = self._next_after(start)
        return found if found is not None and found <= LAST_INSTANT else None

    def iter_after(self, instant: datetime) -> Iterator[datetime]:
        """Every fire time strictly after ``instant``, in order, until the calendar ends.

        Raises:
            ValueError: ``instant`` is naive.
            TypeError: ``instant`` is not a datetime.
        """
        first = self.next_after(instant)  # validated here, not in the generator
        return self._iterate_from(first)

    def _iterate_from(self, current: datetime | None) -> Iterator[datetime]:
        while current is not None:
            yield current
            current = self.next_after(current)

    # --- the search -----------------------------------------------------------------------

    def _wall_matches(self, wall: datetime) -> bool:
        """Match the five fields against a wall time (no 1970-2100 bounds: walls pass them)."""
        calendar = self.calendar
        # Python's weekday() is Monday=0 ... Sunday=6; the crate's is Sunday=1 ... Saturday=7.
        return (
            wall.minute in calendar.minutes
            and wall.hour in calendar.hours
            and wall.day in calendar.days_of_month
            and wall.month in calendar.months
            and (wall.weekday() + 1) % 7 + 1 in calendar.weekdays
        )

    def _first_wall_at_or_after(self, wall: datetime) -> datetime | None:
        """Return the first matching wall time at or after ``wall`` (naive, whole minute)."""
        found = self.calendar._first_at_or_after(wall.replace(tzinfo=UTC), _WALL_LAST_YEAR)
        return None if found is None else _naive(found)

    def _offset(self, instant: datetime) -> timedelta:
        return _offset_of(instant.astimezone(self._tz))

    def _transition(self, low: datetime, high: datetime) -> datetime:
        """Return the first instant in ``(low, high]`` whose offset differs from ``low``'s.

        Called only where the zone's offset changes once in that interval (a gap or a
        fold found by the caller). The tz database records transitions in whole seconds,
        so the bisection runs over whole seconds (about 12 steps for an hour).
        """
        first = self._offset(low)
        low = low.replace(microsecond=0)  # same offset: no transition inside a second
        if high.microsecond:
            high = high.replace(microsecond=0) + _ONE_SECOND
        while high - low > _ONE_SECOND:
            middle = low + timedelta(seconds=(high - low) // _ONE_SECOND // 2)
            if self._offset(middle) == first:
                low = middle
            else:
                high = middle
        return high

    def _next_after(self, after: datetime) -> datetime | None:
        """Return the first fire time strictly after ``after`` (aware UTC), bounds unchecked."""
        tz = self._tz
        local = after.astimezone(tz)
        wall0 = _naive(local)
        best: datetime | None = None
        if self.interval and local.fold == 0:
            before, later = _offset_of(local), _offset_of(local.replace(fold=1))
            if later < before:
                # ``after`` is on the first pass through wall times that will repeat: the
                # second pass of those up to ``wall0`` also comes after it.
                best = self._second_pass_after(after, wall0, before, later)
        wall = wall0.replace(second=0, microsecond=0) + _ONE_MINUTE
        while True:
            candidate = self._first_wall_at_or_after(wall)
            if candidate is None:
                return best
            first_offset = _offset_of(candidate.replace(tzinfo=tz, fold=0))
            second_offset = _offset_of(candidate.replace(tzinfo=tz, fold=1))
            first = (candidate - first_offset).replace(tzinfo=UTC)
            if first_offset == second_offset:
                if first > after:
                    return first if best is None else min(first, best)
            elif first_offset > second_offset:
                # Occurs twice: the first pass, and for interval expressions the second.
                second = (candidate - second_offset).replace(tzinfo=UTC)
                for occurrence in (first, second) if self.interval else (first,):
                    if occurrence > after:
                        return occurrence if best is None else min(occurrence, best)
            else:
                # Skipped by a gap: ``first`` (old offset) lies after the transition, the
                # new-offset reading before it.
                end = self._transition((candidate - second_offset).replace(tzinfo=UTC), first)
                if not self.interval and end > after:
                    return end
                # Interval expressions have nothing in the gap: resume after it.
                candidate = _naive(end.astimezone(tz))
                wall = _ceil_minute(candidate)
                continue
            wall = candidate + _ONE_MINUTE

    def _second_pass_after(
        self, after: datetime, wall0: datetime, before: timedelta, later: timedelta
    ) -> datetime | None:
        """Return an interval expression's first second-pass fire time after ``after``.

        ``after`` is on the first pass through a repeated interval of wall times (its
        offset ``before`` drops to ``later`` at the transition); the repeated interval
        starts at the transition's new wall time.
        """
        transition = self._transition(after, after + (before - later))
        repeat_start = _naive(transition) + later
        found = self._first_wall_at_or_after(_ceil_minute(repeat_start))
        if found is None or found > wall0:
            return None  # the forward search finds what fires on the first pass
        return (found - later).replace(tzinfo=UTC)
