"""Missed-run planning: property tests against an independent brute-force enumerator."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from datetime import UTC, date, datetime, timedelta

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from steeple.core import (
    ConfigurationError,
    ConfigurationTypeError,
    CronCalendar,
    RecurringConfigurationError,
)
from steeple.core.policies import MissedRunPolicy, TickPlan, plan_tick, validate_budget

MINUTE = timedelta(minutes=1)


LAST = datetime(2100, 12, 31, 23, 59, tzinfo=UTC)  # the calendar's documented end


@attrs.frozen
class Spec:
    """A generated calendar: its expression and, independently, the sets it means.

    ``None`` means "any". Weekdays use cron numbering (1=Sunday ... 7=Saturday), and
    day-of-month and weekday restrictions intersect.
    """

    expression: str
    minutes: frozenset[int]
    hours: frozenset[int]
    days: frozenset[int] | None = None
    months: frozenset[int] | None = None
    weekdays: frozenset[int] | None = None
    max_gap: timedelta = timedelta(days=2)

    def day_matches(self, d: date) -> bool:
        cron_weekday = d.isoweekday() % 7 + 1
        return (
            (self.days is None or d.day in self.days)
            and (self.months is None or d.month in self.months)
            and (self.weekdays is None or cron_weekday in self.weekdays)
        )

    def matches(self, t: datetime) -> bool:
        return (
            t.second == 0
            and t.microsecond == 0
            and t.minute in self.minutes
            and t.hour in self.hours
            and self.day_matches(t.date())
        )


def _pick(draw: st.DrawFn, lo: int, hi: int, most: int) -> list[int]:
    return sorted(draw(st.lists(st.integers(lo, hi), min_size=1, max_size=most, unique=True)))


def _csv(values: list[int]) -> str:
    return ",".join(map(str, values))


ANY_MINUTE, ANY_HOUR = frozenset(range(60)), frozenset(range(24))
SPARSE_GAP = timedelta(days=400)


@st.composite
def specs(draw: st.DrawFn) -> Spec:
    kind = draw(
        st.sampled_from(
            ["daily", "hourly", "step", "multi", "monthly", "weekly", "yearly", "friday13"]
        )
    )
    m, h = draw(st.integers(0, 59)), draw(st.integers(0, 23))
    if kind == "daily":
        return Spec(f"{m} {h} * * *", frozenset({m}), frozenset({h}), max_gap=SPARSE_GAP)
    if kind == "hourly":
        return Spec(f"{m} * * * *", frozenset({m}), ANY_HOUR)
    if kind == "step":
        k = draw(st.integers(1, 59))
        return Spec(f"*/{k} * * * *", frozenset(range(0, 60, k)), ANY_HOUR)
    if kind == "multi":
        ms, hs = _pick(draw, 0, 59, 4), _pick(draw, 0, 23, 4)
        return Spec(f"{_csv(ms)} {_csv(hs)} * * *", frozenset(ms), frozenset(hs))
    if kind == "monthly":
        ds = _pick(draw, 1, 31, 3)
        return Spec(
            f"{m} {h} {_csv(ds)} * *",
            frozenset({m}),
            frozenset({h}),
            days=frozenset(ds),
            max_gap=SPARSE_GAP,
        )
    if kind == "weekly":
        ws = _pick(draw, 1, 7, 3)
        return Spec(
            f"{m} {h} * * {_csv(ws)}",
            frozenset({m}),
            frozenset({h}),
            weekdays=frozenset(ws),
            max_gap=SPARSE_GAP,
        )
    if kind == "yearly":  # includes dates that never exist (Feb 30) and leap days
        d, mon = draw(st.integers(1, 31)), draw(st.integers(1, 12))
        return Spec(
            f"{m} {h} {d} {mon} *",
            frozenset({m}),
            frozenset({h}),
            days=frozenset({d}),
            months=frozenset({mon}),
            max_gap=SPARSE_GAP,
        )
    d, w = draw(st.integers(1, 31)), draw(st.integers(1, 7))
    return Spec(
        f"{m} {h} {d} * {w}",
        frozenset({m}),
        frozenset({h}),
        days=frozenset({d}),
        weekdays=frozenset({w}),
        max_gap=SPARSE_GAP,
    )


def brute_iter(spec: Spec, after: datetime) -> Iterator[datetime]:
    """Every matching instant strictly after ``after``, by walking day after day."""
    day = after.date()
    while day <= LAST.date():
        if spec.day_matches(day):
            for hour in sorted(spec.hours):
                for minute in sorted(spec.minutes):
                    t = datetime(day.year, day.month, day.day, hour, minute, tzinfo=UTC)
                    if t > after:
                        yield t
        day += timedelta(days=1)


def brute_due(spec: Spec, cursor: datetime, now: datetime) -> list[datetime]:
    """Every instant in (cursor, now] the spec matches."""
    return list(itertools.takewhile(lambda t: t <= now, brute_iter(spec, cursor)))


def brute_next(spec: Spec, after: datetime) -> datetime | None:
    """The first matching instant strictly after ``after``; None past the calendar's end."""
    return next(brute_iter(spec, after), None)


def check_tail(plan: TickPlan, spec: Spec, expected_cursor: datetime) -> None:
    """The plan's cursor, exhaustion and next due time agree with the brute force."""
    following = brute_next(spec, expected_cursor)
    if following is None:
        assert plan.cursor is None
        assert plan.exhausted is True
        assert plan.next_due is None
    else:
        assert plan.cursor == expected_cursor
        assert plan.exhausted is False
        assert plan.next_due == following


def test_brute_force_enumerator_sanity() -> None:
    friday13 = Spec(
        "0 0 13 * 6", frozenset({0}), frozenset({0}), days=frozenset({13}), weekdays=frozenset({6})
    )
    assert brute_next(friday13, datetime(2026, 1, 1, tzinfo=UTC)) == datetime(
        2026, 2, 13, tzinfo=UTC
    )
    feb30 = Spec(
        "0 0 30 2 *", frozenset({0}), frozenset({0}), days=frozenset({30}), months=frozenset({2})
    )
    assert brute_next(feb30, datetime(2090, 1, 1, tzinfo=UTC)) is None
    assert CronCalendar.parse(friday13.expression).next_after(
        datetime(2026, 1, 1, tzinfo=UTC)
    ) == datetime(2026, 2, 13, tzinfo=UTC)


instants = st.datetimes(
    min_value=datetime(1990, 1, 1), max_value=datetime(2100, 6, 1), timezones=st.just(UTC)
)
fractions = st.floats(0, 1)
budgets = st.integers(1, 100)


@settings(max_examples=300, deadline=None)
@given(specs(), instants, fractions, budgets)
def test_catch_up_emits_exactly_the_oldest_due_times(
    spec: Spec, cursor: datetime, fraction: float, budget: int
) -> None:
    now = cursor + spec.max_gap * fraction
    calendar = CronCalendar.parse(spec.expression)
    plan = plan_tick(MissedRunPolicy.CATCH_UP, calendar, cursor, now, budget)
    everything = brute_due(spec, cursor, now)
    assert list(plan.due) == everything[:budget]
    check_tail(plan, spec, plan.due[-1] if plan.due else cursor)
    assert all(d.utcoffset() == timedelta(0) for d in plan.due)


@settings(max_examples=200, deadline=None)
@given(specs(), instants, fractions, budgets)
def test_repeated_catch_up_ticks_emit_every_due_time_exactly_once(
    spec: Spec, cursor: datetime, fraction: float, budget: int
) -> None:
    now = cursor + spec.max_gap * fraction
    calendar = CronCalendar.parse(spec.expression)
    emitted: list[datetime] = []
    position: datetime | None = cursor
    ticks = 0
    while position is not None:
        plan = plan_tick(MissedRunPolicy.CATCH_UP, calendar, position, now, budget)
        ticks += 1
        assert len(plan.due) <= budget
        emitted.extend(plan.due)
        if not plan.due:
            assert plan.cursor in (position, None)
            break
        position = plan.cursor
        assert ticks <= 3000
    expected = brute_due(spec, cursor, now)
    assert emitted == expected  # each once, oldest first, nothing missing
    if position is not None:
        assert ticks == -(-len(expected) // budget) + 1


@settings(max_examples=200, deadline=None)
@given(
    specs(),
    instants,
    st.lists(fractions, min_size=1, max_size=6),
    budgets,
    st.sampled_from([MissedRunPolicy.CATCH_UP, MissedRunPolicy.COALESCE]),
)
def test_advancing_clock_never_duplicates_or_goes_backwards(
    spec: Spec,
    start: datetime,
    steps: list[float],
    budget: int,
    policy: MissedRunPolicy,
) -> None:
    calendar = CronCalendar.parse(spec.expression)
    cursor: datetime | None = start
    now = start
    emitted: list[datetime] = []
    for step in steps:
        now += spec.max_gap * step / len(steps)
        if cursor is None:  # exhausted: a store stops ticking this definition
            break
        plan = plan_tick(policy, calendar, cursor, now, budget)
        outstanding = brute_due(spec, cursor, now)
        if policy is MissedRunPolicy.COALESCE:
            assert list(plan.due) == outstanding[:1]
            check_tail(plan, spec, now if plan.due else cursor)
        else:
            assert list(plan.due) == outstanding[:budget]
            check_tail(plan, spec, plan.due[-1] if plan.due else cursor)
        emitted.extend(plan.due)
        cursor = plan.cursor
    assert emitted == sorted(set(emitted))  # strictly increasing: no duplicates
    assert all(spec.matches(d) for d in emitted)
    if policy is MissedRunPolicy.CATCH_UP and cursor is not None:
        # Every due time up to the cursor was emitted, none skipped.
        assert emitted == brute_due(spec, start, cursor)


@settings(max_examples=300, deadline=None)
@given(
    specs(),
    instants,
    fractions,
    budgets,
    st.sampled_from([MissedRunPolicy.COALESCE, MissedRunPolicy.RUN_ONCE]),
)
def test_coalesce_emits_at_most_one_then_advances_past_now(
    spec: Spec, cursor: datetime, fraction: float, budget: int, policy: MissedRunPolicy
) -> None:
    now = cursor + spec.max_gap * fraction
    calendar = CronCalendar.parse(spec.expression)
    plan = plan_tick(policy, calendar, cursor, now, budget)
    outstanding = brute_due(spec, cursor, now)
    if outstanding:
        assert plan.due == (outstanding[0],)  # the oldest outstanding due time
        check_tail(plan, spec, now)
        if plan.next_due is not None:
            assert plan.next_due > now
        # A second tick at the same observed time has nothing more to do.
        again = plan_tick(policy, calendar, now, now, budget)
        assert again.due == ()
    else:
        assert plan.due == ()
        check_tail(plan, spec, cursor)


def test_catch_up_worked_example() -> None:
    calendar = CronCalendar.parse("*/15 * * * *")
    cursor = datetime(2030, 5, 1, 10, 0, tzinfo=UTC)
    now = datetime(2030, 5, 1, 11, 7, 30, tzinfo=UTC)
    plan = plan_tick(MissedRunPolicy.CATCH_UP, calendar, cursor, now, 3)
    assert plan == TickPlan(
        due=(
            datetime(2030, 5, 1, 10, 15, tzinfo=UTC),
            datetime(2030, 5, 1, 10, 30, tzinfo=UTC),
            datetime(2030, 5, 1, 10, 45, tzinfo=UTC),
        ),
        cursor=datetime(2030, 5, 1, 10, 45, tzinfo=UTC),
        exhausted=False,
        next_due=datetime(2030, 5, 1, 11, 0, tzinfo=UTC),
    )
    rest = plan_tick(MissedRunPolicy.CATCH_UP, calendar, plan.cursor, now, 3)  # type: ignore[arg-type]
    assert rest.due == (datetime(2030, 5, 1, 11, 0, tzinfo=UTC),)


def test_coalesce_worked_example() -> None:
    calendar = CronCalendar.parse("*/15 * * * *")
    cursor = datetime(2030, 5, 1, 10, 0, tzinfo=UTC)
    now = datetime(2030, 5, 1, 11, 7, 30, tzinfo=UTC)
    plan = plan_tick(MissedRunPolicy.COALESCE, calendar, cursor, now, 100)
    assert plan.due == (datetime(2030, 5, 1, 10, 15, tzinfo=UTC),)
    assert plan.cursor == now
    assert plan.next_due == datetime(2030, 5, 1, 11, 15, tzinfo=UTC)


def test_due_time_equal_to_now_is_due_and_cursor_is_exclusive() -> None:
    calendar = CronCalendar.parse("0 12 * * *")
    noon = datetime(2030, 1, 1, 12, 0, tzinfo=UTC)
    for policy in MissedRunPolicy:
        assert plan_tick(policy, calendar, noon - MINUTE, noon, 1).due == (noon,)
        assert plan_tick(policy, calendar, noon, noon, 1).due == ()
        assert plan_tick(policy, calendar, noon - MINUTE, noon - MINUTE / 60, 1).due == ()


@pytest.mark.parametrize("policy", list(MissedRunPolicy))
def test_exhaustion_after_the_last_instant(policy: MissedRunPolicy) -> None:
    calendar = CronCalendar.parse("0 0 31 12 *")
    last = datetime(2100, 12, 31, tzinfo=UTC)
    cursor = datetime(2100, 6, 1, tzinfo=UTC)
    now = datetime(2101, 6, 1, tzinfo=UTC)
    plan = plan_tick(policy, calendar, cursor, now, 10)
    assert plan.due == (last,)
    assert plan.exhausted is True
    assert plan.cursor is None
    assert plan.next_due is None
    # Nothing ever follows: a later tick from the last due time plans nothing, exhausted.
    after = plan_tick(policy, calendar, last, now, 10)
    assert after == TickPlan(due=(), cursor=None, exhausted=True, next_due=None)


def test_not_yet_exhausted_before_the_last_instant() -> None:
    calendar = CronCalendar.parse("0 0 31 12 *")
    cursor = datetime(2099, 12, 31, tzinfo=UTC)
    plan = plan_tick(MissedRunPolicy.CATCH_UP, calendar, cursor, cursor + MINUTE, 5)
    assert plan.due == ()
    assert plan.exhausted is False
    assert plan.next_due == datetime(2100, 12, 31, tzinfo=UTC)


def test_never_firing_calendar_is_exhausted_immediately() -> None:
    calendar = CronCalendar.parse("0 0 30 2 *")
    t = datetime(2030, 1, 1, tzinfo=UTC)
    plan = plan_tick(MissedRunPolicy.CATCH_UP, calendar, t, t + timedelta(days=400), 100)
    assert plan == TickPlan(due=(), cursor=None, exhausted=True)


def test_clock_behind_cursor_plans_nothing() -> None:
    calendar = CronCalendar.parse("* * * * *")
    cursor = datetime(2030, 1, 1, 12, tzinfo=UTC)
    for policy in MissedRunPolicy:
        plan = plan_tick(policy, calendar, cursor, cursor - timedelta(hours=1), 100)
        assert plan.due == ()
        assert plan.cursor == cursor


def test_budget_caps_a_long_outage() -> None:
    calendar = CronCalendar.parse("* * * * *")
    cursor = datetime(2030, 1, 1, tzinfo=UTC)
    plan = plan_tick(MissedRunPolicy.CATCH_UP, calendar, cursor, cursor + timedelta(days=1), 100)
    assert len(plan.due) == 100
    assert plan.due[0] == cursor + MINUTE
    assert plan.cursor == cursor + 100 * MINUTE


@pytest.mark.parametrize("budget", [0, -1, 101, 10**6, True, False, 1.0, "5", None])
def test_budgets_outside_range_are_typed_errors(budget: object) -> None:
    calendar = CronCalendar.parse("* * * * *")
    t = datetime(2030, 1, 1, tzinfo=UTC)
    with pytest.raises(RecurringConfigurationError, match="budget"):
        plan_tick(MissedRunPolicy.CATCH_UP, calendar, t, t, budget)  # type: ignore[arg-type]
    with pytest.raises(RecurringConfigurationError):
        validate_budget(budget)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="limit"):
        validate_budget(budget, "limit")  # type: ignore[arg-type]


@pytest.mark.parametrize("n", [1, 2, 50, 99, 100])
def test_budgets_in_range_are_returned(n: int) -> None:
    assert validate_budget(n) == n


def test_naive_instants_rejected_clearly() -> None:
    calendar = CronCalendar.parse("* * * * *")
    aware = datetime(2030, 1, 1, tzinfo=UTC)
    naive = datetime(2030, 1, 1)
    with pytest.raises(ValueError, match="cursor must be timezone-aware"):
        plan_tick(MissedRunPolicy.CATCH_UP, calendar, naive, aware, 1)
    with pytest.raises(ValueError, match="now must be timezone-aware"):
        plan_tick(MissedRunPolicy.CATCH_UP, calendar, aware, naive, 1)


def test_unknown_policy_rejected() -> None:
    calendar = CronCalendar.parse("* * * * *")
    t = datetime(2030, 1, 1, tzinfo=UTC)
    with pytest.raises(RecurringConfigurationError, match="policy"):
        plan_tick("catch_up", calendar, t, t, 1)  # type: ignore[arg-type]


def test_policy_values_unchanged() -> None:
    assert [p.value for p in MissedRunPolicy] == ["catch_up", "coalesce", "run_once"]


def test_refusals_name_the_budget_the_calendar_and_the_policy() -> None:
    calendar = CronCalendar.parse("* * * * *")
    t = datetime(2030, 1, 1, tzinfo=UTC)
    with pytest.raises(RecurringConfigurationError, match=r"^budget must be between 1 and 100"):
        validate_budget(0)
    with pytest.raises(
        ConfigurationTypeError,
        match=r"^calendar must have a next_after method \(a CronCalendar\), not 'hourly'$",
    ):
        plan_tick(MissedRunPolicy.CATCH_UP, "hourly", t, t, 1)  # type: ignore[arg-type]
    with pytest.raises(RecurringConfigurationError, match=r"^unknown missed-run policy 'hourly'$"):
        plan_tick("hourly", calendar, t, t, 1)  # type: ignore[arg-type]


class _NaiveCalendar:
    """A calendar (a port) that answers a naive instant."""

    def next_after(self, instant: datetime) -> datetime | None:
        return instant.replace(tzinfo=None) + MINUTE


@pytest.mark.parametrize("policy", list(MissedRunPolicy))
def test_a_calendar_answering_a_naive_instant_is_named_as_the_culprit(
    policy: MissedRunPolicy,
) -> None:
    t = datetime(2030, 1, 1, tzinfo=UTC)
    with pytest.raises(
        ConfigurationError, match=r"^the calendar's next due instant must be timezone-aware"
    ):
        plan_tick(policy, _NaiveCalendar(), t, t + MINUTE, 1)
