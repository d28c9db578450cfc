"""Property tests of CronCalendar against an independent reference written here.

The reference reads expressions with a regular expression of its own and checks dates by
brute force (minute by minute over short gaps, day by day over long ones). It shares no code
with ``steeple.core.calendar``: only the rules of DESIGN.md.
"""

from __future__ import annotations

import re
from datetime import UTC, date, datetime, timedelta, timezone
from itertools import islice
from zoneinfo import ZoneInfo

import pytest
from hypothesis import assume, event, given, settings
from hypothesis import strategies as st

from steeple.core.calendar import CronCalendar
from steeple.core.errors import InvalidCronExpression

# --- the reference ----------------------------------------------------------------------

REF_MONTHS = {
    name: number
    for number, names in enumerate(
        [
            "jan january",
            "feb february",
            "mar march",
            "apr april",
            "may",
            "jun june",
            "jul july",
            "aug august",
            "sep september",
            "oct october",
            "nov november",
            "dec december",
        ],
        start=1,
    )
    for name in names.split()
}
REF_WEEKDAYS = {
    name: number
    for number, names in enumerate(
        [
            "sun sunday",
            "mon monday",
            "tue tues tuesday",
            "wed wednesday",
            "thu thurs thursday",
            "fri friday",
            "sat saturday",
        ],
        start=1,
    )
    for name in names.split()
}
# (lowest, highest, names or None, whether '?' is allowed)
REF_FIELDS: list[tuple[int, int, dict[str, int] | None, bool]] = [
    (0, 59, None, False),
    (0, 23, None, False),
    (1, 31, None, True),
    (1, 12, REF_MONTHS, False),
    (1, 7, REF_WEEKDAYS, True),
]
REF_ITEM = re.compile(
    r"(?:(?P<any>[*?])|(?P<a>[0-9]+|[A-Za-z]+)(?:-(?P<b>[0-9]+|[A-Za-z]+))?)(?:/(?P<step>[0-9]+))?"
)
REF_FIRST = datetime(1970, 1, 1, tzinfo=UTC)
REF_LAST = datetime(2100, 12, 31, 23, 59, tzinfo=UTC)

Sets = tuple[frozenset[int], frozenset[int], frozenset[int], frozenset[int], frozenset[int]]


def ref_value(text: str, names: dict[str, int] | None) -> int | None:
    if text.isdigit():
        return int(text)
    if names is None:
        return None
    return names.get(text.lower())


def ref_field(token: str, field: int) -> set[int] | None:
    lowest, highest, names, any_ok = REF_FIELDS[field]
    values: set[int] = set()
    for item in token.split(","):
        match = REF_ITEM.fullmatch(item)
        if match is None:
            return None
        step = 1 if match["step"] is None else int(match["step"])
        if not 1 <= step <= highest:
            return None
        if match["any"] is not None:
            if match["any"] == "?" and not any_ok:
                return None
            first, last = lowest, highest
        elif match["b"] is None:
            if match["a"].isalpha() and match["step"] is not None:
                return None  # a single name takes no step
            first_value = ref_value(match["a"], names)
            if first_value is None or not lowest <= first_value <= highest:
                return None
            first = first_value
            last = highest if match["step"] is not None else first_value
        else:
            if match["a"].isdigit() != match["b"].isdigit():
                return None
            first_value = ref_value(match["a"], names)
            last_value = ref_value(match["b"], names)
            if first_value is None or last_value is None:
                return None
            if not lowest <= first_value <= last_value <= highest:
                return None
            first, last = first_value, last_value
        values.update(range(first, last + 1, step))
    return values


def ref_parse(expression: str) -> Sets | None:
    if len(expression) > 1000 or re.search(r"[^ \t\r\n0-9A-Za-z*?,/-]", expression):
        return None
    tokens = [token for token in re.split(r"[ \t\r\n]+", expression) if token]
    if len(tokens) != 5:
        return None
    sets = [ref_field(token, index) for index, token in enumerate(tokens)]
    if any(values is None for values in sets):
        return None
    minutes, hours, days, months, weekdays = (frozenset(values or ()) for values in sets)
    return minutes, hours, days, months, weekdays


def ref_day_ok(sets: Sets, day: date) -> bool:
    # isoweekday: Monday=1 ... Sunday=7; the crate's numbering: Sunday=1 ... Saturday=7.
    return day.day in sets[2] and day.month in sets[3] and day.isoweekday() % 7 + 1 in sets[4]


def ref_matches(sets: Sets, instant: datetime) -> bool:
    return (
        REF_FIRST <= instant <= REF_LAST
        and instant.second == 0
        and instant.microsecond == 0
        and instant.minute in sets[0]
        and instant.hour in sets[1]
        and ref_day_ok(sets, instant.date())
    )


def ref_assert_none_between(sets: Sets, low: datetime, high: datetime) -> None:
    """Assert no fire time lies strictly between ``low`` and ``high`` (both UTC)."""
    low = max(low, REF_FIRST - timedelta(microseconds=1))
    high = min(high, REF_LAST + timedelta(minutes=1))
    if high <= low:
        return
    event("gap up to a day" if high - low <= timedelta(days=1) else "gap over a day")
    if high - low <= timedelta(days=1):
        # Minute by minute.
        instant = low.replace(second=0, microsecond=0)
        while instant < high:
            if instant > low:
                assert not ref_matches(sets, instant), f"missed {instant}"
            instant += timedelta(minutes=1)
        return
    # Day by day: a matching day strictly inside the gap always holds a fire time, since
    # no field is empty; the two end days are checked minute by minute against the bounds.
    first_day, last_day = low.date(), high.date()
    ordinal = first_day.toordinal()
    while ordinal <= last_day.toordinal():
        day = date.fromordinal(ordinal)
        if ref_day_ok(sets, day):
            if first_day < day < last_day:
                raise AssertionError(f"missed a fire time on {day}")
            for hour in sets[1]:
                for minute in sets[0]:
                    instant = datetime(day.year, day.month, day.day, hour, minute, tzinfo=UTC)
                    assert not (low < instant < high and ref_matches(sets, instant)), (
                        f"missed {instant}"
                    )
        ordinal += 1


# --- strategies --------------------------------------------------------------------------


def cased(name: str) -> st.SearchStrategy[str]:
    return st.sampled_from([name, name.upper(), name.capitalize()])


@st.composite
def field_items(draw: st.DrawFn, field: int) -> str:
    lowest, highest, names, any_ok = REF_FIELDS[field]

    def number(value: int) -> str:
        return draw(st.sampled_from(["", "0"])) + str(value)

    kinds = ["star", "point", "range", "star_step", "point_step", "range_step"]
    if any_ok:
        kinds.append("any")
    if names is not None:
        kinds += ["name", "name_range"]
    kind = draw(st.sampled_from(kinds))
    step = draw(st.integers(1, highest))
    a = draw(st.integers(lowest, highest))
    b = draw(st.integers(a, highest))
    if kind == "star":
        return "*"
    if kind == "any":
        return draw(st.sampled_from(["?", f"?/{step}"]))
    if kind == "point":
        return number(a)
    if kind == "range":
        return f"{number(a)}-{number(b)}"
    if kind == "star_step":
        return f"*/{step}"
    if kind == "point_step":
        return f"{number(a)}/{step}"
    if kind == "range_step":
        return f"{number(a)}-{number(b)}/{step}"
    assert names is not None
    spelled = {value: [n for n, v in names.items() if v == value] for value in names.values()}
    name_a = draw(cased(draw(st.sampled_from(spelled[a]))))
    if kind == "name":
        return name_a
    name_b = draw(cased(draw(st.sampled_from(spelled[b]))))
    suffix = draw(st.sampled_from(["", f"/{step}"]))
    return f"{name_a}-{name_b}{suffix}"


@st.composite
def valid_fields(draw: st.DrawFn, field: int) -> str:
    # Half the time the whole field is `*`, so that many expressions fire often.
    if draw(st.booleans()):
        return "*"
    items = draw(st.lists(field_items(field), min_size=1, max_size=3))
    return ",".join(items)


separators = st.sampled_from([" ", "  ", "\t", "\r\n", " \n\t"])
edges = st.sampled_from(["", " ", "\n", "\t "])


@st.composite
def valid_expressions(draw: st.DrawFn) -> str:
    fields = [draw(valid_fields(index)) for index in range(5)]
    text = fields[0]
    for token in fields[1:]:
        text += draw(separators) + token
    return draw(edges) + text + draw(edges)


instants = st.one_of(
    st.datetimes(
        min_value=datetime(1965, 1, 1),
        max_value=datetime(2101, 3, 1),
        timezones=st.just(UTC),
    ),
    # Near the two ends of the calendar.
    st.datetimes(
        min_value=datetime(1969, 12, 25), max_value=datetime(1970, 1, 10), timezones=st.just(UTC)
    ),
    st.datetimes(
        min_value=datetime(2100, 11, 1), max_value=datetime(2101, 1, 2), timezones=st.just(UTC)
    ),
)

noise = st.one_of(
    st.text(alphabet="0123456789*?,/-", max_size=7),
    st.text(alphabet="0123456789*?,/-LWHJANFEBSEPTMONTUESTHURSFRIDAYjanseptuesthurs#@", max_size=9),
)
ALL_NAMES = sorted(set(REF_MONTHS) | set(REF_WEEKDAYS) | {"sept", "thur", "tu", "l", "w"})


@st.composite
def near_miss_items(draw: st.DrawFn, field: int) -> str:
    """Items at and just past the edges: values and steps one out, reversed or mixed ranges."""
    lowest, highest, names, _ = REF_FIELDS[field]
    value = st.one_of(
        st.sampled_from([lowest - 1, lowest, highest, highest + 1])
        .filter(lambda v: v >= 0)
        .map(str),
        st.integers(lowest, highest).map(str),
        st.sampled_from(ALL_NAMES),
        st.sampled_from(sorted(names or ALL_NAMES)),
    )
    a, b = draw(value), draw(value)
    step = draw(st.sampled_from(["", "/0", "/1", f"/{highest}", f"/{highest + 1}", "/"]))
    forms = ["point", "range", "reversed", "mixed", "name_step", "star", "any"]
    form = draw(st.sampled_from(forms))
    if form == "name_step":
        name = draw(st.sampled_from(sorted(names or ALL_NAMES)))
        return f"{name}/{draw(st.integers(1, highest))}"
    if form == "mixed" and names is not None:
        number, name = str(draw(st.integers(lowest, highest))), draw(st.sampled_from(sorted(names)))
        return (f"{number}-{name}" if draw(st.booleans()) else f"{name}-{number}") + step
    if form == "reversed":
        end = draw(st.integers(lowest, highest - 1))
        return f"{end + 1}-{end}{step}"
    if form in ("point", "mixed"):
        return a + step
    if form == "range":
        return f"{a}-{b}{step}"
    return ("*" if form == "star" else "?") + step


@st.composite
def noisy_expressions(draw: st.DrawFn) -> str:
    """Five valid fields, then usually one defect: a near miss, noise, a field valid only
    elsewhere (names in the wrong field, `?` in the minute...), or a field too many or few."""
    tokens = [draw(valid_fields(index)) for index in range(5)]
    position = draw(st.integers(0, 4))
    defect = draw(st.sampled_from(["none", "near", "near", "near", "noise", "moved", "count"]))
    if defect == "near":
        items = draw(st.lists(near_miss_items(position), min_size=1, max_size=2))
        tokens[position] = ",".join([*items, *([tokens[position]] * draw(st.integers(0, 1)))])
    elif defect == "noise":
        tokens[position] = draw(noise)
    elif defect == "moved":
        tokens[position] = draw(valid_fields(draw(st.integers(0, 4))))
    elif defect == "count":
        tokens = tokens[: draw(st.integers(0, 6))] + tokens[: draw(st.integers(0, 2))]
    return draw(separators).join(tokens)


# --- properties --------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(valid_expressions())
def test_valid_expressions_parse_to_the_reference_sets(expression: str) -> None:
    expected = ref_parse(expression)
    assert expected is not None, expression
    calendar = CronCalendar.parse(expression)
    assert (
        calendar.minutes,
        calendar.hours,
        calendar.days_of_month,
        calendar.months,
        calendar.weekdays,
    ) == expected


@settings(max_examples=400, deadline=None)
@given(noisy_expressions())
def test_parser_accepts_exactly_what_the_reference_accepts(expression: str) -> None:
    expected = ref_parse(expression)
    event("accepted" if expected is not None else "rejected")
    if expected is None:
        with pytest.raises(InvalidCronExpression):
            CronCalendar.parse(expression)
    else:
        calendar = CronCalendar.parse(expression)
        assert (
            calendar.minutes,
            calendar.hours,
            calendar.days_of_month,
            calendar.months,
            calendar.weekdays,
        ) == expected


@settings(max_examples=300, deadline=None)
@given(valid_expressions(), instants)
def test_next_instants_are_exactly_the_reference_fire_times(
    expression: str, start: datetime
) -> None:
    sets = ref_parse(expression)
    assert sets is not None
    calendar = CronCalendar.parse(expression)
    found = list(islice(calendar.iter_after(start), 5))
    previous = start
    for instant in found:
        assert instant.tzinfo is UTC
        assert instant > previous
        assert REF_FIRST <= instant <= REF_LAST
        assert ref_matches(sets, instant), instant
        assert calendar.matches(instant)
        ref_assert_none_between(sets, previous, instant)
        # Exclusivity to the millisecond, from both sides.
        assert calendar.next_after(instant - timedelta(milliseconds=1)) == instant
        assert calendar.next_after(previous) == instant
        previous = instant
    event(f"{len(found)} instants found")
    if len(found) < 5:
        # Exhausted: nothing left up to the end of the calendar.
        ref_assert_none_between(sets, previous, REF_LAST + timedelta(minutes=1))
        assert calendar.next_after(previous) is None


@settings(max_examples=200, deadline=None)
@given(valid_expressions(), instants)
def test_matches_agrees_with_the_reference(expression: str, instant: datetime) -> None:
    sets = ref_parse(expression)
    assert sets is not None
    calendar = CronCalendar.parse(expression)
    whole_minute = instant.replace(second=0, microsecond=0)
    assert calendar.matches(whole_minute) == ref_matches(sets, whole_minute)
    assert calendar.matches(instant) == ref_matches(sets, instant)


@settings(max_examples=100, deadline=None)
@given(valid_expressions(), valid_expressions())
def test_equal_sets_mean_equal_calendars(first: str, second: str) -> None:
    a, b = CronCalendar.parse(first), CronCalendar.parse(second)
    same_sets = ref_parse(first) == ref_parse(second)
    assert (a == b) == same_sets
    if same_sets:
        assert hash(a) == hash(b)


@settings(max_examples=150, deadline=None)
@given(valid_expressions(), instants)
def test_iteration_agrees_with_repeated_next_after(expression: str, start: datetime) -> None:
    calendar = CronCalendar.parse(expression)
    assume(calendar.next_after(start) is not None)
    stepped: list[datetime] = []
    current: datetime | None = start
    for _ in range(20):
        current = calendar.next_after(current) if current is not None else None
        if current is None:
            break
        stepped.append(current)
    assert list(islice(calendar.iter_after(start), 20)) == stepped


@settings(max_examples=200, deadline=None)
@given(valid_expressions(), instants, st.integers(-23 * 60, 23 * 60))
def test_an_instant_in_any_offset_is_the_same_instant_in_utc(
    expression: str, start: datetime, minutes: int
) -> None:
    """A UTC instant takes the short way through ``next_after``; any other offset (and a
    UTC zone that is not ``datetime.UTC``) is converted first: the answer is the same."""
    calendar = CronCalendar.parse(expression)
    expected = calendar.next_after(start)
    shifted = start.astimezone(timezone(timedelta(minutes=minutes)))
    assert calendar.next_after(shifted) == expected
    assert CronCalendar.parse(expression).next_after(shifted) == expected  # a cold memo
    assert calendar.next_after(start.astimezone(ZoneInfo("UTC"))) == expected


def test_instants_asked_once_each_get_their_own_answer() -> None:
    # next_after remembers answers by the identity of the instant asked; a fresh instant
    # object, even one made where a freed one lived, is never given another's answer.
    calendar = CronCalendar.parse("*/5 * * * *")
    base = datetime(2026, 3, 1, tzinfo=UTC)
    for step in range(600):
        minutes = step * 7 % 1440
        instant = base + timedelta(minutes=minutes, seconds=step % 60)
        expected = base + timedelta(minutes=minutes - minutes % 5 + 5)
        assert calendar.next_after(instant) == expected
        # Asked again with the same object: the same answer.
        assert calendar.next_after(instant) == expected
