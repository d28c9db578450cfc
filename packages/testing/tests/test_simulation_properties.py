"""Every scenario the simulator accepts simulates: no parameters end in a simulator error.

Hypothesis draws short scenarios over the whole parameter space (calendars, policies,
ticking, relay capacity and concurrency, broker faults, host outages, clock steps back
anywhere in the range, the last instants included) and each must run to a result that
accounts for every occurrence it materialized.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from steeple.core import MissedRunPolicy, RecurringConfig, RecurringDefinition, ScheduledMessage
from steeple.core.errors import ConfigurationError
from steeple.testing.simulation import (
    BrokerModel,
    ClockRegression,
    Interval,
    RelayCapacity,
    Scenario,
    Ticking,
    run,
)

START = datetime(2026, 1, 1, tzinfo=UTC)
MESSAGE = ScheduledMessage("jobs", "job.run", b"{}")
CRONS = ["*/5 * * * *", "*/1 * * * *", "0 * * * *", "30 23 * * *", "*/15 * * * Mon-Fri"]

seconds = st.integers(min_value=0, max_value=2 * 86_400)


def _interval(start: int, length: int) -> Interval:
    return Interval(START + timedelta(seconds=start), START + timedelta(seconds=start + length))


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    span = draw(st.integers(min_value=600, max_value=2 * 86_400))
    crons = draw(st.lists(st.sampled_from(CRONS), min_size=1, max_size=3))
    definitions = [
        RecurringDefinition(
            f"job-{i}",
            cron,
            START,
            draw(st.sampled_from([MissedRunPolicy.CATCH_UP, MissedRunPolicy.COALESCE])),
            MESSAGE,
        )
        for i, cron in enumerate(crons)
    ]
    window = timedelta(seconds=draw(st.sampled_from([60, 3600, 86_400])))
    lease = timedelta(seconds=draw(st.sampled_from([1, 30, 300])))
    quota = draw(st.sampled_from([10, 100, 100_000]))
    rate = draw(st.sampled_from([None, 0.05, 1.0, 100.0]))
    relay = RelayCapacity(
        workers=draw(st.integers(min_value=1, max_value=3)),
        rate=rate,
        claim_limit=draw(st.integers(min_value=1, max_value=100)),
        concurrency=draw(st.integers(min_value=1, max_value=100)),
        poll_interval=timedelta(seconds=draw(st.sampled_from([1, 5]))),
    )
    ticking = Ticking(
        interval=timedelta(seconds=draw(st.sampled_from([1, 5, 60]))),
        budget=draw(st.integers(min_value=1, max_value=100)),
    )
    ends = st.integers(min_value=1, max_value=8 * 3600)
    broker = BrokerModel(
        outages=[_interval(draw(seconds), draw(ends)) for _ in range(draw(st.integers(0, 2)))],
        failure_rate=draw(st.sampled_from([0.0, 0.1, 0.9])),
        ack_loss_rate=draw(st.sampled_from([0.0, 0.1])),
    )
    host = [_interval(draw(seconds), draw(ends)) for _ in range(draw(st.integers(0, 2)))]
    # Steps back anywhere in the range, the last seconds included, up to the 7-day limit.
    regressions = [
        ClockRegression(
            START + timedelta(seconds=draw(st.integers(min_value=0, max_value=span))),
            timedelta(seconds=draw(st.sampled_from([1, 4, 6, 120, 3600, 7 * 86_400]))),
        )
        for _ in range(draw(st.integers(0, 2)))
    ]
    try:
        config = RecurringConfig("prop", 10, quota, delivery_window=window, lease_duration=lease)
        return Scenario(
            config,
            definitions,
            START,
            START + timedelta(seconds=span),
            ticking=ticking,
            relay=relay,
            broker=broker,
            host_outages=host,
            clock_regressions=regressions,
        )
    except ConfigurationError:
        # Refused with a one-line message: not a scenario the simulator accepted.
        return draw(st.nothing())


@settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
@given(scenario=scenarios(), seed=st.integers(min_value=0, max_value=2**32))
def test_every_accepted_scenario_simulates(scenario: Scenario, seed: int) -> None:
    result = run(scenario, seed=seed)
    o = result.overall
    assert o.materialized == o.published + o.dead + o.expired + o.cancelled + o.live


def test_a_step_back_just_before_the_end_still_gives_a_result() -> None:
    # The step leaves the host clock trailing the recorded time beyond the tolerance at
    # the end: the last listing fails as it would, and the final tally still counts.
    scenario = Scenario(
        RecurringConfig("prop", 10, 1000),
        [RecurringDefinition("every-5", "*/5 * * * *", START, MissedRunPolicy.CATCH_UP, MESSAGE)],
        START,
        START + timedelta(days=1),
        clock_regressions=[ClockRegression.parse("2026-01-01T23:59Z/PT2M")],
    )
    result = run(scenario, seed=1)
    assert result.overall.materialized == result.overall.published == 287
    assert result.hits.clock_errors > 0
