"""plan_namespace_tick: which due times a tick emits across definitions.

Property tests against an independent model: every definition runs a ``*/n``-minute
calendar (n divides 60), whose due times the model computes by arithmetic on the epoch,
never through the calendar code.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from steeple.core import CronCalendar, RecurringConfigurationError
from steeple.core.policies import (
    DueDefinition,
    MissedRunPolicy,
    NamespaceTickPlan,
    plan_namespace_tick,
)

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
BASE = datetime(2031, 5, 17, 3, 14, 15, 926000, tzinfo=UTC)
PERIODS = (1, 2, 3, 5, 6, 10, 15, 20, 30, 60)
NAMES = ("alpha", "beta", "gamma", "delta", "epsilon")


def cron_for(period: int) -> str:
    return "0 * * * *" if period == 60 else f"*/{period} * * * *"


def model_next(period: int, after: datetime) -> datetime:
    step = timedelta(minutes=period)
    return EPOCH + ((after - EPOCH) // step + 1) * step


@attrs.frozen
class ModelDefinition:
    name: str
    period: int
    policy: MissedRunPolicy
    cursor: datetime

    def due(self, now: datetime) -> list[datetime]:
        """Every due time the model says this definition has outstanding at ``now``."""
        out: list[datetime] = []
        at = self.cursor
        while (following := model_next(self.period, at)) <= now:
            out.append(following)
            if self.policy is MissedRunPolicy.COALESCE:
                break
            at = following
        return out

    def to_due(self) -> DueDefinition:
        return DueDefinition(
            self.name,
            self.policy,
            CronCalendar.parse(cron_for(self.period)),
            self.cursor,
            model_next(self.period, self.cursor),
        )


@st.composite
def namespaces(draw: st.DrawFn) -> tuple[list[ModelDefinition], datetime, int]:
    names = draw(st.lists(st.sampled_from(NAMES), min_size=1, max_size=5, unique=True))
    definitions = [
        ModelDefinition(
            name,
            draw(st.sampled_from(PERIODS)),
            draw(st.sampled_from([MissedRunPolicy.CATCH_UP, MissedRunPolicy.COALESCE])),
            BASE - timedelta(seconds=draw(st.integers(0, 6 * 3600))),
        )
        for name in names
    ]
    now = BASE + timedelta(seconds=draw(st.integers(-3600, 3600)))
    return definitions, now, draw(st.integers(1, 100))


def expected_emitted(
    definitions: list[ModelDefinition], now: datetime, budget: int
) -> list[tuple[str, datetime]]:
    candidates = sorted((due, d.name) for d in definitions for due in d.due(now))
    return [(name, due) for due, name in candidates[:budget]]


def advance(definitions: list[ModelDefinition], plan: NamespaceTickPlan) -> list[ModelDefinition]:
    moved = {a.name: a for a in plan.advanced}
    return [
        attrs.evolve(d, cursor=moved[d.name].cursor) if d.name in moved else d for d in definitions
    ]


@settings(max_examples=400, deadline=None)
@given(namespaces())
def test_a_tick_emits_exactly_the_oldest_due_times_across_definitions(
    case: tuple[list[ModelDefinition], datetime, int],
) -> None:
    definitions, now, budget = case
    plan = plan_namespace_tick([d.to_due() for d in definitions], now, budget)
    assert list(plan.emitted) == expected_emitted(definitions, now, budget)
    assert len(plan.emitted) <= budget
    # Oldest first, ties by name; nothing in the future.
    assert [(due, name) for name, due in plan.emitted] == sorted(
        (due, name) for name, due in plan.emitted
    )
    assert all(due <= now for _, due in plan.emitted)


@settings(max_examples=300, deadline=None)
@given(namespaces())
def test_each_emitting_definition_advances_to_where_the_model_says(
    case: tuple[list[ModelDefinition], datetime, int],
) -> None:
    definitions, now, budget = case
    plan = plan_namespace_tick([d.to_due() for d in definitions], now, budget)
    by_name = {d.name: d for d in definitions}
    emitters = sorted({name for name, _ in plan.emitted})
    assert [a.name for a in plan.advanced] == emitters
    for a in plan.advanced:
        d = by_name[a.name]
        last = max(due for name, due in plan.emitted if name == a.name)
        expected_cursor = now if d.policy is MissedRunPolicy.COALESCE else last
        assert a.cursor == expected_cursor
        assert a.next_due == model_next(d.period, expected_cursor)
        assert not a.exhausted
    assert plan.exhausted == ()


@settings(max_examples=200, deadline=None)
@given(namespaces())
def test_repeated_ticks_emit_every_due_time_exactly_once(
    case: tuple[list[ModelDefinition], datetime, int],
) -> None:
    definitions, now, budget = case
    outstanding = {(d.name, due) for d in definitions for due in d.due(now)}
    seen: list[tuple[str, datetime]] = []
    for _ in range(10_000):
        plan = plan_namespace_tick([d.to_due() for d in definitions], now, budget)
        if not plan.emitted:
            break
        seen.extend(plan.emitted)
        definitions = advance(definitions, plan)
    assert len(seen) == len(set(seen))
    catch_up = {d.name for d in definitions if d.policy is MissedRunPolicy.CATCH_UP}
    # Catch-up definitions emit every outstanding due time; coalescing ones only their
    # oldest, once.
    assert {s for s in seen if s[0] in catch_up} == {o for o in outstanding if o[0] in catch_up}
    for d in definitions:
        if d.policy is MissedRunPolicy.COALESCE:
            assert len([s for s in seen if s[0] == d.name]) <= 1


@settings(max_examples=300, deadline=None)
@given(namespaces())
def test_the_budget_earliest_definitions_decide_the_plan(
    case: tuple[list[ModelDefinition], datetime, int],
) -> None:
    """A store may pass only the ``budget`` definitions with the earliest (next due, name):
    the plan is the same (the PostgreSQL adapter's query relies on it)."""
    definitions, now, budget = case
    due = [d.to_due() for d in definitions]
    earliest = sorted(
        (d for d in due if d.next_due is not None and d.next_due <= now),
        key=lambda d: (d.next_due, d.name),
    )[:budget]
    assert plan_namespace_tick(due, now, budget) == plan_namespace_tick(earliest, now, budget)


def test_definitions_not_due_or_without_a_next_due_time_take_no_part() -> None:
    every = CronCalendar.parse("* * * * *")
    later = DueDefinition("later", MissedRunPolicy.CATCH_UP, every, BASE, BASE + timedelta(hours=1))
    finished = DueDefinition("finished", MissedRunPolicy.CATCH_UP, every, BASE, None)
    plan = plan_namespace_tick([later, finished], BASE + timedelta(minutes=5), 10)
    assert plan == NamespaceTickPlan((), (), ())


def test_exhaustion_is_reported_once_the_last_due_time_is_emitted() -> None:
    last = CronCalendar.parse("59 23 31 12 *")
    cursor = datetime(2100, 1, 1, tzinfo=UTC)
    due = last.next_after(cursor)
    assert due is not None
    final = DueDefinition("last", MissedRunPolicy.CATCH_UP, last, cursor, due)
    plan = plan_namespace_tick([final], due + timedelta(days=1), 10)
    assert plan.emitted == (("last", due),)
    assert plan.exhausted == ("last",)
    [advanced] = plan.advanced
    assert advanced.exhausted
    assert advanced.next_due is None
    assert advanced.cursor == due  # never None: stores keep a cursor


def test_a_stale_next_due_time_emits_nothing() -> None:
    every = CronCalendar.parse("*/5 * * * *")
    cursor = datetime(2031, 5, 17, 3, 20, tzinfo=UTC)
    stale = DueDefinition("stale", MissedRunPolicy.CATCH_UP, every, cursor, cursor)
    plan = plan_namespace_tick([stale], cursor + timedelta(minutes=2), 10)
    assert plan.emitted == ()


def test_a_name_given_twice_is_planned_once() -> None:
    every = CronCalendar.parse("* * * * *")
    one = DueDefinition("one", MissedRunPolicy.COALESCE, every, BASE, model_next(1, BASE))
    plan = plan_namespace_tick([one, one], BASE + timedelta(minutes=3), 10)
    assert [name for name, _ in plan.emitted] == ["one"]


@pytest.mark.parametrize("budget", [0, 101, -1, True, 2.0, None])
def test_budget_outside_1_to_100_is_refused(budget: object) -> None:
    with pytest.raises(RecurringConfigurationError):
        plan_namespace_tick([], BASE, budget)  # type: ignore[arg-type]


def test_naive_now_is_refused() -> None:
    with pytest.raises(ValueError, match=r"naive|aware"):
        plan_namespace_tick([], datetime(2031, 1, 1), 10)


def test_a_due_definitions_cursor_and_calendar_are_checked() -> None:
    # Checked once when the definition is taken in (the plans then trust them).
    every = CronCalendar.parse("* * * * *")
    naive = DueDefinition(
        "naive", MissedRunPolicy.CATCH_UP, every, datetime(2031, 5, 17), model_next(1, BASE)
    )
    with pytest.raises(ValueError, match=r"naive|aware"):
        plan_namespace_tick([naive], BASE + timedelta(minutes=3), 10)
    odd = DueDefinition(
        "odd",
        MissedRunPolicy.CATCH_UP,
        object(),  # type: ignore[arg-type]
        BASE,
        model_next(1, BASE),
    )
    with pytest.raises(TypeError, match="next_after"):
        plan_namespace_tick([odd], BASE + timedelta(minutes=3), 10)


def test_refusals_name_the_input_to_fix() -> None:
    every = CronCalendar.parse("* * * * *")
    with pytest.raises(ValueError, match=r"^now must be timezone-aware"):
        plan_namespace_tick([], datetime(2031, 1, 1), 10)
    with pytest.raises(
        TypeError, match=r"^definitions must be an iterable of DueDefinition, not int$"
    ):
        plan_namespace_tick(3, BASE, 10)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^definitions must hold DueDefinition values, not str$"):
        plan_namespace_tick(["alpha"], BASE, 10)  # type: ignore[list-item]
    unnamed = DueDefinition(7, MissedRunPolicy.CATCH_UP, every, BASE, BASE)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^a definition's name must be a str, not int$"):
        plan_namespace_tick([unnamed], BASE, 10)
    naive_due = DueDefinition("alpha", MissedRunPolicy.CATCH_UP, every, BASE, datetime(2031, 1, 1))
    with pytest.raises(ValueError, match=r"^next_due must be timezone-aware"):
        plan_namespace_tick([naive_due], BASE, 10)


def test_a_due_time_exactly_at_now_is_emitted() -> None:
    # Due times are whole minutes; a tick observed exactly on one emits it, whether it is
    # the recorded next due time or one reached while catching up.
    every = CronCalendar.parse("* * * * *")
    cursor = datetime(2031, 5, 17, 3, 0, tzinfo=UTC)
    on_time = DueDefinition(
        "on-time", MissedRunPolicy.CATCH_UP, every, cursor, cursor + timedelta(minutes=1)
    )
    now = cursor + timedelta(minutes=1)
    assert plan_namespace_tick([on_time], now, 10).emitted == (("on-time", now),)
    later = cursor + timedelta(minutes=3)
    assert plan_namespace_tick([on_time], later, 10).emitted == tuple(
        ("on-time", cursor + timedelta(minutes=n)) for n in (1, 2, 3)
    )


def test_a_definition_without_work_does_not_stop_the_others() -> None:
    every = CronCalendar.parse("* * * * *")
    five = CronCalendar.parse("*/5 * * * *")
    cursor = datetime(2031, 5, 17, 3, 20, tzinfo=UTC)
    now = cursor + timedelta(minutes=2)
    finished = DueDefinition("a-finished", MissedRunPolicy.CATCH_UP, every, cursor, None)
    # Recorded as due before the others, but nothing follows the cursor before now.
    stale = DueDefinition("b-stale", MissedRunPolicy.CATCH_UP, five, cursor, cursor)
    due = DueDefinition(
        "c-due", MissedRunPolicy.COALESCE, every, cursor, cursor + timedelta(minutes=1)
    )
    plan = plan_namespace_tick([finished, stale, due], now, 10)
    assert plan.emitted == (("c-due", cursor + timedelta(minutes=1)),)


def test_a_naive_cursor_is_refused_by_its_name() -> None:
    every = CronCalendar.parse("* * * * *")
    naive = DueDefinition(
        "naive", MissedRunPolicy.CATCH_UP, every, datetime(2031, 5, 17), model_next(1, BASE)
    )
    with pytest.raises(ValueError, match=r"^cursor must be timezone-aware"):
        plan_namespace_tick([naive], BASE + timedelta(minutes=3), 10)
