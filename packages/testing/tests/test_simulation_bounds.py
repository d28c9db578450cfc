"""Bounding a simulation: its work estimated from the calendars, progress, stopping early."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest

from steeple.core import MissedRunPolicy, RecurringConfig, RecurringDefinition, ScheduledMessage
from steeple.testing.simulation import (
    BrokerModel,
    Interval,
    Scenario,
    ScenarioError,
    ScheduleChange,
    SimulationResult,
    estimate_occurrences,
    run,
)

T0 = datetime(2026, 3, 2, 6, 0, 11, tzinfo=UTC)
MESSAGE = ScheduledMessage("jobs", "job.run", b"{}")
CONFIG = RecurringConfig("sim", 10_000, 100_000, delivery_window=timedelta(hours=2))


def definition(
    name: str,
    cron: str,
    policy: MissedRunPolicy = MissedRunPolicy.CATCH_UP,
    first_after: datetime = T0,
) -> RecurringDefinition:
    return RecurringDefinition(name, cron, first_after, policy, MESSAGE)


def busy(days: float = 2) -> Scenario:
    return Scenario(
        CONFIG,
        [
            definition("every-5m", "*/5 * * * *"),
            definition("hourly", "0 * * * *", MissedRunPolicy.COALESCE),
            definition("nightly", "0 2 * * *"),
        ],
        T0,
        T0 + timedelta(days=days),
        host_outages=[Interval(T0 + timedelta(hours=5), T0 + timedelta(hours=7))],
        broker=BrokerModel(failure_rate=0.05, ack_loss_rate=0.02),
    )


def test_the_estimate_is_exact_when_every_calendar_has_few_due_times() -> None:
    change_at = T0 + timedelta(days=1, hours=3)
    scenario = Scenario(
        CONFIG,
        [
            definition("every-10m", "*/10 * * * *"),
            definition("nightly", "0 2 * * *", MissedRunPolicy.COALESCE),
            # Created before the range: its calendar counts from first_after (catch-up).
            definition("weekday", "15 */3 * * 1-5", first_after=T0 - timedelta(days=1)),
            definition("never-in-range", "0 0 1 1 *"),
        ],
        T0,
        T0 + timedelta(days=4),
        changes=[
            ScheduleChange(
                change_at,
                cancel=("every-10m",),
                create=(definition("half-hourly", "*/30 * * * *"),),
            )
        ],
    )
    result = run(scenario, seed=3, trace=True)
    assert estimate_occurrences(scenario) == len(result.due_runs())
    assert estimate_occurrences(scenario) > 0


def test_a_busy_calendar_is_extrapolated_exactly_when_its_rate_is_even() -> None:
    start = datetime(2026, 1, 1, tzinfo=UTC)
    scenario = Scenario(
        CONFIG,
        [definition("minutely", "* * * * *", first_after=start)],
        start,
        start + timedelta(days=30),
    )
    # 43,200 minutes in 30 days, far beyond the due times counted one by one.
    assert estimate_occurrences(scenario) == 30 * 24 * 60


def test_a_hostile_scenario_stops_counting_past_the_limit() -> None:
    start = datetime(2026, 1, 1, tzinfo=UTC)
    definitions = [definition(f"d{i}", "* * * * *", first_after=start) for i in range(10_000)]
    scenario = Scenario(CONFIG, definitions, start, start + timedelta(days=3660))
    estimate = estimate_occurrences(scenario, stop_after=5_000_000)
    # Past the limit after the first definition: 5,270,400 minutes, not the 5e10 in all.
    assert 5_000_000 < estimate == 3660 * 24 * 60
    assert estimate_occurrences(scenario, stop_after=0) == 3660 * 24 * 60


@pytest.mark.parametrize("stop_after", [-1, True, 1.5, "10"])
def test_a_bad_limit_is_refused(stop_after: object) -> None:
    with pytest.raises(ScenarioError, match="stop_after"):
        estimate_occurrences(busy(), stop_after=stop_after)  # type: ignore[arg-type]


def test_a_bad_scenario_is_refused() -> None:
    with pytest.raises(ScenarioError, match="Scenario"):
        estimate_occurrences("scenario")  # type: ignore[arg-type]


def test_progress_is_reported_and_changes_nothing() -> None:
    scenario = busy()
    plain = run(scenario, seed=7)
    reports: list[tuple[datetime, float]] = []

    def progress(at: datetime, done: float) -> None:
        reports.append((at, done))

    watched = run(scenario, seed=7, progress=progress)
    assert watched == plain
    assert watched.dumps() == plain.dumps()
    assert watched.stopped_at is None
    assert "stopped_at" not in json.loads(watched.dumps())
    assert len(reports) > 3
    times = [at for at, _ in reports]
    shares = [done for _, done in reports]
    assert times == sorted(times)
    assert shares == sorted(shares)
    assert all(scenario.start <= at < scenario.end for at in times)
    assert all(0 <= done <= 1 for done in shares)


def check_partial(partial: SimulationResult, whole: SimulationResult) -> None:
    scenario = whole.scenario
    assert partial.stopped_at is not None
    assert scenario.start < partial.stopped_at < scenario.end
    assert 0 < partial.overall.materialized < whole.overall.materialized
    o = partial.overall
    assert o.materialized == o.published + o.dead + o.expired + o.cancelled + o.live
    series = partial.series
    assert len(series.times) == len(series.backlog["all"]) == len(series.published["all"])
    assert len(series.times) < len(whole.series.times)
    assert series.times[-1] <= partial.stopped_at + timedelta(seconds=1)
    assert json.loads(partial.dumps())["stopped_at"].startswith(f"{partial.stopped_at:%Y-%m-%d}")


def test_returning_false_stops_between_events_with_the_result_so_far() -> None:
    scenario = busy()
    whole = run(scenario, seed=7)
    middle = scenario.start + (scenario.end - scenario.start) / 2
    seen: list[datetime] = []

    def progress(at: datetime, done: float) -> bool:
        seen.append(at)
        return at < middle

    partial = run(scenario, seed=7, progress=progress)
    check_partial(partial, whole)
    assert partial.stopped_at == seen[-1]
    # What was published before the stop is what the whole run published by then.
    published_by = sum(
        n
        for t, n in zip(whole.series.times, whole.series.published["all"], strict=True)
        if t <= partial.series.times[-2]
    )
    assert sum(partial.series.published["all"][:-1]) == published_by


def test_ctrl_c_in_the_progress_callback_stops_with_a_partial_result() -> None:
    scenario = busy()
    whole = run(scenario, seed=7)
    calls = 0

    def progress(at: datetime, done: float) -> None:
        nonlocal calls
        calls += 1
        if done > 0.3:
            raise KeyboardInterrupt

    partial = run(scenario, seed=7, progress=progress, trace=True)
    check_partial(partial, whole)
    assert partial.occurrences is not None
    assert len(partial.occurrences) == partial.overall.materialized
    assert calls > 1
