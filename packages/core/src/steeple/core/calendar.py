"""The cron calendar: five-field expressions with the semantics of the Rust ``cron`` crate 0.17.

An expression ``"m h dom mon dow"`` means what the crate means by ``"0 m h dom mon dow"``:
seconds fixed at zero, weekdays numbered 1=Sunday ... 7=Saturday, day-of-month and weekday
restrictions *intersect*, and the calendar spans 1970-01-01T00:00Z through
2100-12-31T23:59Z (after that it is exhausted). Everything is UTC.

The parser maps each field to its set of values and names the field at fault when it
rejects one. The search walks year, month, day, hour and minute in turn, jumping to the
next allowed value of each; it never steps minute by minute, so even an expression that
never fires (``0 0 30 2 *``) answers after at most ~131 years x 12 months x 31 days checks.
Pure: no clock, no randomness, no I/O.
"""

from __future__ import annotations

import re
from bisect import bisect_left
from collections.abc import Iterator
from datetime import UTC, date, datetime, timedelta
from functools import lru_cache, partial
from typing import Any, Final

import attrs

from steeple.core.errors import ConfigurationError, ConfigurationTypeError, InvalidCronExpression

__all__ = [
    "FIRST_INSTANT",
    "LAST_INSTANT",
    "MAX_EXPRESSION_LENGTH",
    "CronCalendar",
    "shared_calendar",
]

#: The first instant the calendar can produce (it is itself a candidate fire time).
FIRST_INSTANT: Final = datetime(1970, 1, 1, tzinfo=UTC)
#: The last instant the calendar can produce; past it the calendar is exhausted.
LAST_INSTANT: Final = datetime(2100, 12, 31, 23, 59, tzinfo=UTC)
#: Longer expressions are rejected before parsing (no legitimate one comes close).
MAX_EXPRESSION_LENGTH: Final = 1000

_LAST_YEAR: Final = 2100
_ONE_MINUTE: Final = timedelta(minutes=1)

# Only ASCII space, tab, CR and LF separate fields (the crate's whitespace); anything else
# outside this alphabet (NBSP, other Unicode spaces, NUL, non-ASCII digits...) is rejected.
_TOKEN: Final = re.compile(r"[^ \t\r\n]+")
_OUTSIDE_GRAMMAR: Final = re.compile(r"[^0-9A-Za-z*?,/\- \t\r\n]")

_MONTH_NAMES: Final[dict[str, int]] = {
    "jan": 1, "january": 1,
    "feb": 2, "february": 2,
    "mar": 3, "march": 3,
    "apr": 4, "april": 4,
    "may": 5,
    "jun": 6, "june": 6,
    "jul": 7, "july": 7,
    "aug": 8, "august": 8,
    "sep": 9, "september": 9,
    "oct": 10, "october": 10,
    "nov": 11, "november": 11,
    "dec": 12, "december": 12,
}  # fmt: skip

# Crate numbering: 1=Sunday ... 7=Saturday.
_WEEKDAY_NAMES: Final[dict[str, int]] = {
    "sun": 1, "sunday": 1,
    "mon": 2, "monday": 2,
    "tue": 3, "tues": 3, "tuesday": 3,
    "wed": 4, "wednesday": 4,
    "thu": 5, "thurs": 5, "thursday": 5,
    "fri": 6, "friday": 6,
    "sat": 7, "saturday": 7,
}  # fmt: skip


@attrs.frozen
class _FieldSpec:
    """How one of the five fields is read."""

    name: str
    minimum: int
    maximum: int
    names: dict[str, int] | None  # None: names are not allowed in this field
    allows_any: bool  # whether `?` is accepted (day-of-month and weekday only)
    hint: str = ""


_MINUTE: Final = _FieldSpec("minute", 0, 59, None, allows_any=False)
_HOUR: Final = _FieldSpec("hour", 0, 23, None, allows_any=False)
_DAY_OF_MONTH: Final = _FieldSpec("day-of-month", 1, 31, None, allows_any=True)
_MONTH: Final = _FieldSpec("month", 1, 12, _MONTH_NAMES, allows_any=False)
_WEEKDAY: Final = _FieldSpec(
    "weekday", 1, 7, _WEEKDAY_NAMES, allows_any=True, hint=" (1=Sunday ... 7=Saturday)"
)
_FIELDS: Final = (_MINUTE, _HOUR, _DAY_OF_MONTH, _MONTH, _WEEKDAY)


# Quartz-style extensions the crate does not support: `L`, `5L`, `LW`, `15W`, `H`, `H/5`.
_UNSUPPORTED: Final = re.compile(r"\d*(?:L|W|LW)|H(?:/\d+)?|L-\d+", re.IGNORECASE)


class _FieldError(Exception):
    """Internal: a field was rejected; turned into InvalidCronExpression with the field named."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _describe_character(char: str) -> str:
    if char.isprintable() and not char.isspace():
        return f"{char!r} (U+{ord(char):04X})"
    return f"U+{ord(char):04X}"


def _tokenize(expression: str) -> list[str]:
    """Split on runs of ASCII space/tab/CR/LF; reject any character outside the grammar."""
    outside = _OUTSIDE_GRAMMAR.search(expression)
    if outside is None:
        return _TOKEN.findall(expression)
    char = outside.group()
    # The field holding the character: how many tokens start before it.
    position = len(_TOKEN.findall(expression, 0, outside.start()))
    if outside.start() > 0 and expression[outside.start() - 1] not in " \t\r\n":
        position -= 1  # the character continues the token before it
    field = _FIELDS[position].name if position < len(_FIELDS) else None
    if char == "@" and position == 0:
        field = None
        reason = "shorthands such as @daily are not supported; write the five fields"
    elif char.isspace():
        reason = (
            f"contains {_describe_character(char)}, a space that is not a field "
            "separator (only ASCII space, tab, CR and LF separate fields)"
        )
    else:
        reason = f"contains the character {_describe_character(char)}, which is not allowed"
        if char == "#":
            reason += " ('#' is not supported)"
    raise InvalidCronExpression(expression, reason, field=field)


def _number(text: str, spec: _FieldSpec, what: str) -> int:
    if not text:
        raise _FieldError(f"missing {what}")
    if not (text.isascii() and text.isdigit()):
        if spec.names is not None:
            raise _FieldError(f"{what} {text!r} is neither a number nor a {spec.name} name")
        raise _FieldError(f"{what} {text!r} is not a number")
    value = int(text)
    if not spec.minimum <= value <= spec.maximum:
        raise _FieldError(
            f"{value} is out of range {spec.minimum}-{spec.maximum}{spec.hint}"
            if what == "value"
            else f"{what} {value} is out of range {spec.minimum}-{spec.maximum}{spec.hint}"
        )
    return value


def _is_name(text: str) -> bool:
    return bool(text) and text.isascii() and text.isalpha()


def _name(text: str, spec: _FieldSpec) -> int:
    if spec.names is None:
        raise _FieldError(f"names such as {text!r} are not allowed in the {spec.name} field")
    value = spec.names.get(text.lower())
    if value is None:
        raise _FieldError(f"{text!r} is not a {spec.name} name")
    return value


def _bound(text: str, spec: _FieldSpec, what: str) -> int:
    """One end of a range or a single point: a number or (month/weekday) a name."""
    if _is_name(text):
        return _name(text, spec)
    return _number(text, spec, what)


def _parse_step(step_text: str, item: str, spec: _FieldSpec) -> int:
    """Read the step after an item's '/'."""
    if "/" in step_text:
        raise _FieldError(f"{item!r} has more than one '/'")
    if not (step_text.isascii() and step_text.isdigit()):
        raise _FieldError(f"step {step_text!r} in {item!r} is not a number")
    step = int(step_text)
    if not 1 <= step <= spec.maximum:
        raise _FieldError(f"step {step} in {item!r} is out of range 1-{spec.maximum}")
    return step


def _parse_range(base: str, item: str, spec: _FieldSpec, step: int) -> range:
    """Read an item's ``start-end`` part, stepped."""
    start_text, _, end_text = base.partition("-")
    if "-" in end_text:
        raise _FieldError(f"{item!r} has more than one '-'")
    if not start_text or not end_text:
        raise _FieldError(f"range {base!r} is missing an end")
    if _is_name(start_text) != _is_name(end_text):
        raise _FieldError(f"range {base!r} mixes a number and a name")
    start = _bound(start_text, spec, "range start")
    end = _bound(end_text, spec, "range end")
    if start > end:
        raise _FieldError(f"range {base!r} is reversed (ranges do not wrap around)")
    return range(start, end + 1, step)


def _parse_item(item: str, spec: _FieldSpec) -> range:
    """One comma-separated item of a field to the range of values it selects."""
    if not item:
        raise _FieldError("empty list item")
    if _UNSUPPORTED.fullmatch(item):
        raise _FieldError("'L', 'W', '#' and 'H' are not supported")
    base, slash, step_text = item.partition("/")
    step = _parse_step(step_text, item, spec) if slash else 1
    if base in ("*", "?"):
        if base == "?" and not spec.allows_any:
            raise _FieldError("'?' is allowed only in the day-of-month and weekday fields")
        return range(spec.minimum, spec.maximum + 1, step)
    if "-" in base:
        return _parse_range(base, item, spec, step)
    if _is_name(base):
        value = _name(base, spec)
        if slash:
            raise _FieldError(f"a single name cannot take a step ({item!r})")
        return range(value, value + 1)
    value = _number(base, spec, "value")
    # `a/n` runs from a up to the field's maximum.
    return range(value, spec.maximum + 1 if slash else value + 1, step)


def _parse_field(token: str, spec: _FieldSpec) -> frozenset[int]:
    values: set[int] = set()
    for item in token.split(","):
        values.update(_parse_item(item, spec))
    return frozenset(values)


# Days per month in a common year, indexed by month; February gains a day in leap years.
_MONTH_DAYS: Final = (0, 31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31)


def _is_leap(year: int) -> bool:
    return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)


def _days_in_month(year: int, month: int) -> int:
    if month == 2 and _is_leap(year):
        return 29
    return _MONTH_DAYS[month]


def _require_aware(instant: object) -> datetime:
    if not isinstance(instant, datetime):
        raise ConfigurationTypeError(
            f"expected a timezone-aware datetime, got {type(instant).__name__}"
        )
    try:
        offset = instant.utcoffset()
    except Exception as exc:  # a third-party tzinfo may fail in any way
        raise ConfigurationError(
            f"the datetime's tzinfo fails to give an offset ({type(exc).__name__})"
        ) from None
    if instant.tzinfo is None or offset is None:
        raise ConfigurationError(
            f"naive datetime {instant.isoformat()} rejected: instants must be timezone-aware "
            "(UTC), e.g. datetime(..., tzinfo=datetime.UTC)"
        )
    return instant


def _check_values(
    name: str, minimum: int, maximum: int, _instance: object, _attribute: object, value: object
) -> None:
    # Direct construction (bypassing parse) must not build a calendar the search can't run.
    # Bound with functools.partial, not built as a closure at import: mutation testing
    # (mutants/core_mutmut.py) can then swap the check per run.
    if not isinstance(value, frozenset):
        raise ConfigurationTypeError(f"{name} must be a non-empty frozenset")
    if not value:
        raise ConfigurationError(f"{name} must be a non-empty frozenset")
    if not all(type(v) is int and minimum <= v <= maximum for v in value):
        raise ConfigurationError(f"{name} values must be integers in {minimum}-{maximum}")


def _check_expression(_instance: object, _attribute: object, value: Any) -> None:
    # Direct construction: the text is shown in reprs and stored, so it must be a str.
    if not isinstance(value, str):
        raise ConfigurationTypeError(f"expression must be a str, not {type(value).__name__}")


# Answers of CronCalendar.next_after a calendar remembers (then starts over). Small on
# purpose: the engine keeps up to 1,024 calendars alive, and the gain is from the same
# minutes asked again within a tick (measured: 14 simulated days ran 7,594 occurrences/s
# with 4,096 answers kept and 7,348 with 128, within the run-to-run noise).
_MEMO_SIZE = 128
_UNKNOWN: Final = object()


@attrs.frozen(repr=False)
class CronCalendar:
    """A parsed five-field cron expression (see the module docstring for the rules).

    Build one with :meth:`parse`. Two calendars are equal (and hash alike) when their
    field value sets are equal, whatever the spelling: ``0 9 * * Mon-Fri`` equals
    ``0 9 ? * 2-6``.

    Attributes:
        expression: the text given to :meth:`parse` (not normalized).
        minutes: minutes of the hour that fire, 0-59.
        hours: hours of the day that fire, 0-23.
        days_of_month: days of the month that fire, 1-31.
        months: months that fire, 1-12.
        weekdays: weekdays that fire, 1=Sunday ... 7=Saturday.
    """

    expression: str = attrs.field(eq=False, validator=_check_expression)
    minutes: frozenset[int] = attrs.field(validator=partial(_check_values, "minutes", 0, 59))
    hours: frozenset[int] = attrs.field(validator=partial(_check_values, "hours", 0, 23))
    days_of_month: frozenset[int] = attrs.field(
        validator=partial(_check_values, "days_of_month", 1, 31)
    )
    months: frozenset[int] = attrs.field(validator=partial(_check_values, "months", 1, 12))
    weekdays: frozenset[int] = attrs.field(validator=partial(_check_values, "weekdays", 1, 7))
    # Sorted tuples for the search, derived from the sets above.
    _minute_list: tuple[int, ...] = attrs.field(init=False, eq=False)
    _hour_list: tuple[int, ...] = attrs.field(init=False, eq=False)
    _day_list: tuple[int, ...] = attrs.field(init=False, eq=False)
    _month_list: tuple[int, ...] = attrs.field(init=False, eq=False)
    # Python's date.weekday() numbering (Monday=0), indexed by that number.
    _weekday_mask: tuple[bool, ...] = attrs.field(init=False, eq=False)
    # False when no allowed (month, day) pair exists in any year (`0 0 30 2 *`).
    _can_fire: bool = attrs.field(init=False, eq=False)
    # Recent answers of next_after by search start: the search is pure, and a namespace's
    # definitions ask the same calendar for the same minutes (ticks, then their plans).
    _found: dict[datetime, datetime | None] = attrs.field(init=False, eq=False)
    # Recent answers of next_after by the identity of the instant asked (with the instant).
    _asked: dict[int, tuple[datetime, datetime | None]] = attrs.field(init=False, eq=False)

    def __attrs_post_init__(self) -> None:
        # Frozen class: derived fields are set once here, through object.__setattr__.
        set_ = object.__setattr__
        set_(self, "_minute_list", tuple(sorted(self.minutes)))
        set_(self, "_hour_list", tuple(sorted(self.hours)))
        set_(self, "_day_list", tuple(sorted(self.days_of_month)))
        set_(self, "_month_list", tuple(sorted(self.months)))
        # crate weekday w (1=Sunday) is Python weekday (w - 2) % 7 (Monday=0, Sunday=6).
        python_weekdays = {(w - 2) % 7 for w in self.weekdays}
        set_(self, "_weekday_mask", tuple(d in python_weekdays for d in range(7)))
        longest = max(29 if m == 2 else _MONTH_DAYS[m] for m in self.months)
        can_fire = min(self.days_of_month) <= longest
        set_(self, "_can_fire", can_fire)
        set_(self, "_found", {})
        set_(self, "_asked", {})

    @classmethod
    def parse(cls, expression: str) -> CronCalendar:
        """Parse and validate a five-field cron expression.

        Args:
            expression: ``"minute hour day-of-month month weekday"``, fields separated by
                runs of ASCII space, tab, CR or LF.

        Returns:
            The calendar.

        Raises:
            InvalidCronExpression: the expression is not a string, is longer than
                1000 characters, holds a character outside the grammar (NUL, a Unicode
                space, a non-ASCII digit, ``L``/``W``/``#``/``@`` forms...), does not have
                exactly five fields, or a field is invalid; ``.field`` names the field at
                fault (``"minute"``, ``"hour"``, ``"day-of-month"``, ``"month"``,
                ``"weekday"``) or is ``None`` when the fault is the whole expression.
        """
        if not isinstance(expression, str):
            raise InvalidCronExpression(
                f"<{type(expression).__name__}>",
                f"expected a str, got {type(expression).__name__}",
            )
        if len(expression) > MAX_EXPRESSION_LENGTH:
            raise InvalidCronExpression(
                expression,
                f"longer than {MAX_EXPRESSION_LENGTH} characters ({len(expression)})",
            )
        tokens = _tokenize(expression)
        if len(tokens) != len(_FIELDS):
            raise InvalidCronExpression(
                expression,
                f"expected 5 fields (minute hour day-of-month month weekday), got {len(tokens)}",
            )
        sets: list[frozenset[int]] = []
        for token, spec in zip(tokens, _FIELDS, strict=True):
            try:
                sets.append(_parse_field(token, spec))
            except _FieldError as error:
                raise InvalidCronExpression(
                    expression, f"{token!r}: {error.reason}", field=spec.name
                ) from None
        minutes, hours, days_of_month, months, weekdays = sets
        return cls(expression, minutes, hours, days_of_month, months, weekdays)

    def __repr__(self) -> str:
        return f"CronCalendar.parse({self.expression!r})"

    def matches(self, instant: datetime) -> bool:
        """Tell whether ``instant`` is one of the calendar's fire times.

        A fire time is a whole minute (seconds and microseconds zero) from
        1970-01-01T00:00Z through 2100-12-31T23:59Z whose five fields are all allowed.

        Raises:
            ConfigurationError: ``instant`` is naive (a ``ValueError``).
            ConfigurationTypeError: ``instant`` is not a datetime (a ``TypeError``).
        """
        instant = _require_aware(instant)
        if instant < FIRST_INSTANT or instant > LAST_INSTANT:
            return False
        utc = instant.astimezone(UTC)
        return (
            utc.second == 0
            and utc.microsecond == 0
            and utc.minute in self.minutes
            and utc.hour in self.hours
            and utc.day in self.days_of_month
            and utc.month in self.months
            and self._weekday_mask[utc.weekday()]
        )

    def next_after(self, instant: datetime) -> datetime | None:
        """Return the first fire time strictly after ``instant``.

        Args:
            instant: a timezone-aware datetime (any offset; compared exactly, so an
                instant 1 ms before a fire time yields that fire time, and the fire time
                itself yields the next one).

        Returns:
            An aware UTC datetime on a whole minute, never before 1970-01-01T00:00Z;
            ``None`` when no fire time remains before the end of 2100-12-31T23:59Z.

        Raises:
            ConfigurationError: ``instant`` is naive (a ``ValueError``).
            ConfigurationTypeError: ``instant`` is not a datetime (a ``TypeError``).
        """
        exact = type(instant) is datetime and instant.tzinfo is UTC
        if exact:
            # The very instant object asked before (a plan's answer is the next plan's
            # cursor, and definitions sharing a calendar ask with the same objects): its
            # answer, without building the search start or hashing it. Each entry holds
            # its instant alive, so no other object can have that id while it lives.
            asked = self._asked.get(id(instant))
            if asked is not None:
                return asked[1]
        else:
            # Anything but an aware UTC datetime (what every store passes) is checked.
            instant = _require_aware(instant)
        answer = self._next_after_checked(instant)
        if exact:
            by_id = self._asked
            if len(by_id) >= _MEMO_SIZE:
                by_id.clear()  # bounded; refilled by the instants in use
            by_id[id(instant)] = (instant, answer)
        return answer

    def _next_after_checked(self, instant: datetime) -> datetime | None:
        """:meth:`next_after` of an aware instant."""
        if not self._can_fire or instant >= LAST_INSTANT:
            return None
        if instant < FIRST_INSTANT:
            # Compared before converting: astimezone() can overflow near datetime.min.
            start = FIRST_INSTANT
        else:
            utc = instant if instant.tzinfo is UTC else instant.astimezone(UTC)
            if utc.second or utc.microsecond:
                utc = utc.replace(second=0, microsecond=0)
            start = utc + _ONE_MINUTE  # a fire time (a whole minute) asks from the next
        found = self._found
        # One lookup (not `in` then a read): another thread may clear the memo between two.
        answer = found.get(start, _UNKNOWN)
        if answer is not _UNKNOWN:
            return answer  # type: ignore[return-value]  # a datetime or None once stored
        if len(found) >= _MEMO_SIZE:
            found.clear()  # bounded; refilled by the instants in use
        computed = found[start] = self._first_at_or_after(start)
        return computed

    def iter_after(self, instant: datetime) -> Iterator[datetime]:
        """Every fire time strictly after ``instant``, in order, until the calendar ends.

        Raises:
            ConfigurationError: ``instant`` is naive (a ``ValueError``).
            ConfigurationTypeError: ``instant`` is not a datetime (a ``TypeError``).
        """
        # Validated here, not inside the generator, so bad input fails at the call.
        first = self.next_after(instant)
        return self._iterate_from(first)

    def _iterate_from(self, current: datetime | None) -> Iterator[datetime]:
        while current is not None:
            yield current
            current = self._first_at_or_after(current + _ONE_MINUTE)

    def _first_at_or_after(self, start: datetime, last_year: int = _LAST_YEAR) -> datetime | None:
        """Return the first fire time at or after ``start``, a whole UTC minute.

        ``last_year`` ends the search after that year. ``steeple.core.zoned`` reads the
        result as a wall-clock time and searches into 2101 (a wall time there can still be
        an instant of 2100 in zones east of UTC).
        """
        minutes, hours = self._minute_list, self._hour_list
        days, months, weekday_mask = self._day_list, self._month_list, self._weekday_mask
        year, month, day = start.year, start.month, start.day
        hour, minute = start.hour, start.minute
        while year <= last_year:
            month_index = bisect_left(months, month)
            if month_index == len(months):
                year, month, day, hour, minute = year + 1, 1, 1, 0, 0
                continue
            if months[month_index] != month:
                month, day, hour, minute = months[month_index], 1, 0, 0
            last_day = _days_in_month(year, month)
            # One date object per month; each day's weekday follows by arithmetic.
            first_weekday = date(year, month, 1).weekday()
            day_index = bisect_left(days, day)
            while day_index < len(days) and days[day_index] <= last_day:
                candidate = days[day_index]
                if candidate != day:
                    hour, minute = 0, 0
                if weekday_mask[(first_weekday + candidate - 1) % 7]:
                    hour_index = bisect_left(hours, hour)
                    if hour_index < len(hours):
                        first_minute = minute if hours[hour_index] == hour else 0
                        minute_index = bisect_left(minutes, first_minute)
                        if minute_index < len(minutes):
                            return datetime(
                                year, month, candidate, hours[hour_index],
                                minutes[minute_index], tzinfo=UTC,
                            )  # fmt: skip
                        if hour_index + 1 < len(hours):
                            return datetime(
                                year, month, candidate, hours[hour_index + 1], minutes[0],
                                tzinfo=UTC,
                            )  # fmt: skip
                # The next candidate day starts at midnight.
                hour, minute = 0, 0
                day_index += 1
            if month == 12:
                year, month = year + 1, 1
            else:
                month += 1
            day, hour, minute = 1, 0, 0
        return None


def shared_calendar(expression: str) -> CronCalendar:
    """Return the one calendar of ``expression`` the process shares (parsed once).

    Parsing is pure, and a shared calendar shares its memo: a tick and a simulation
    asking after the same fire time find it computed once.

    Raises:
        InvalidCronExpression: as :meth:`CronCalendar.parse` (a value that is not a str
            too, hashable or not).
    """
    if type(expression) is not str:
        return CronCalendar.parse(expression)  # refuses it; only a str is cached
    return _parsed(expression)


@lru_cache(maxsize=1024)
def _parsed(expression: str) -> CronCalendar:
    return CronCalendar.parse(expression)
