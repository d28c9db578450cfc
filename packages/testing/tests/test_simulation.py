"""The simulator: event-driven runs equal polling runs, determinism, accounting, faults, input."""

from __future__ import annotations

import asyncio
import json
import math
from datetime import UTC, datetime, timedelta

import pytest

from steeple.core import (
    MissedRunPolicy,
    RecurringConfig,
    RecurringDefinition,
    ScheduledMessage,
)
from steeple.core.errors import ConfigurationError
from steeple.core.occurrences import OccurrenceState
from steeple.testing.simulation import (
    BrokerModel,
    ClockRegression,
    Interval,
    RelayCapacity,
    Scenario,
    ScenarioError,
    ScheduleChange,
    SimulationResult,
    Ticking,
    memory_store,
    parse_instant,
    parse_iso_duration,
    run,
)
from steeple.testing.simulation._driver import drive

UTC_ = UTC
T0 = datetime(2026, 3, 2, 6, 0, 11, tzinfo=UTC)
MESSAGE = ScheduledMessage("jobs", "job.run", b"{}")
CONFIG = RecurringConfig(
    "sim", 20, 1000, delivery_window=timedelta(hours=2), lease_duration=timedelta(seconds=20)
)


def at(hours: float = 0, minutes: float = 0, seconds: float = 0) -> datetime:
    return T0 + timedelta(hours=hours, minutes=minutes, seconds=seconds)


def definition(
    name: str, cron: str, policy: MissedRunPolicy = MissedRunPolicy.CATCH_UP
) -> RecurringDefinition:
    return RecurringDefinition(name, cron, T0, policy, MESSAGE)


def busy_scenario(**overrides: object) -> Scenario:
    """Six hours with a host outage, a broker outage, random failures and lost acks, a
    clock step inside the tolerance, one beyond it, a slow relay and a schedule change."""
    values: dict[str, object] = {
        "ticking": Ticking(interval=timedelta(seconds=5), budget=3),
        "relay": RelayCapacity(
            workers=2,
            rate=0.1,
            claim_limit=3,
            poll_interval=timedelta(seconds=5),
            concurrency=1,
        ),
        "broker": BrokerModel(
            outages=[Interval(at(1, 40), at(2, 5))], failure_rate=0.1, ack_loss_rate=0.1
        ),
        "host_outages": [Interval(at(3, 2), at(4, 1))],
        "clock_regressions": [
            ClockRegression(at(0, 50, 2.5), timedelta(seconds=4)),
            ClockRegression(at(4, 30, 1), timedelta(seconds=40)),
        ],
        "changes": [
            ScheduleChange(
                at(1, 50),
                cancel=["every-7"],
                create=[
                    RecurringDefinition(
                        "every-7-v2", "3-59/7 * * * *", at(1, 50), MissedRunPolicy.COALESCE, MESSAGE
                    )
                ],
            )
        ],
        "sample_interval": timedelta(minutes=10),
    }
    values.update(overrides)
    return Scenario(
        CONFIG,
        [
            definition("every-5", "*/5 * * * *"),
            definition("every-7", "*/7 * * * *", MissedRunPolicy.COALESCE),
            definition("hourly", "0 * * * *"),
            definition("at-the-half", "30 * * * *", MissedRunPolicy.COALESCE),
        ],
        T0,
        at(6),
        **values,  # type: ignore[arg-type]
    )


def outcomes(result: SimulationResult) -> list[dict[str, object]]:
    assert result.occurrences is not None
    return [o.to_json() for o in result.occurrences]


def fine_grained_scenario() -> Scenario:
    """Two hours on a one-second grid with clock steps right after due instants: the
    store's recorded time decides whether the stepped-back clock still sees them due."""
    return Scenario(
        CONFIG,
        [
            definition("every-5", "*/5 * * * *"),
            definition("every-3", "*/3 * * * *", MissedRunPolicy.COALESCE),
        ],
        T0,
        at(2),
        relay=RelayCapacity(workers=1, rate=None, claim_limit=2),
        broker=BrokerModel(failure_rate=0.2, ack_loss_rate=0.1),
        clock_regressions=[
            ClockRegression(
                T0.replace(minute=15, second=0, microsecond=500_000), timedelta(seconds=4)
            ),
            ClockRegression(
                T0.replace(minute=45, second=0, microsecond=500_000), timedelta(seconds=30)
            ),
            ClockRegression(T0.replace(hour=7, minute=20, second=1), timedelta(seconds=5)),
        ],
        sample_interval=timedelta(minutes=5),
    )


@pytest.mark.parametrize("make", [busy_scenario, fine_grained_scenario])
async def test_jumping_from_event_to_event_ends_every_occurrence_as_polling_every_instant(
    make: object,
) -> None:
    # The polling run calls tick and claim at every grid instant (what the worker loops
    # do); the event-driven run skips the calls that find nothing. Same outcome for every
    # occurrence: the skipped calls were empty, so the jumps change nothing.
    scenario = make()  # type: ignore[operator]
    jumping = await drive(scenario, 11, memory_store, trace=True)
    polling = await drive(scenario, 11, memory_store, trace=True, exhaustive=True)
    assert outcomes(jumping) == outcomes(polling)
    assert jumping.overall == polling.overall
    assert jumping.series.max_lateness == polling.series.max_lateness
    # Polling made many more calls; the jumps made few.
    assert polling.hits.claims > 5 * jumping.hits.claims
    assert polling.hits.ticks > 10 * jumping.hits.ticks
    hits = jumping.hits
    assert hits.broker_failures > 0
    assert hits.acknowledgements_lost > 0
    assert hits.duplicates > 0
    assert hits.clock_errors > 0


def test_the_busy_scenario_reaches_what_it_was_built_to_reach() -> None:
    result = run(busy_scenario(), seed=11, trace=True)
    assert result.hits.saturated_ticks > 0
    states = {o.state for o in result.occurrences or ()}
    assert {OccurrenceState.PUBLISHED, OccurrenceState.DEAD, OccurrenceState.CANCELLED} <= states


def test_a_clock_step_inside_the_tolerance_is_absorbed_by_the_recorded_time() -> None:
    # 06:15:00 is due; the clock steps back 4 s at 06:15:00.5, after the tick at 06:15:00
    # recorded that instant: every later call adopts it, so nothing waits for the clock.
    result = run(fine_grained_scenario(), seed=11, trace=True)
    due = [o for o in result.occurrences or () if o.due_at == T0.replace(minute=18, second=0)]
    assert due
    # 06:18 falls after the step: the host clock reads 4 s behind, so it is seen 4 s late.
    assert all(o.materialized_at == T0.replace(minute=18, second=0) for o in due)
    assert all(o.published_at == T0.replace(minute=18, second=4) for o in due if o.attempts == 1)


def test_the_same_seed_gives_the_same_result_and_another_seed_another() -> None:
    scenario = busy_scenario()
    first, again = run(scenario, seed=5, trace=True), run(scenario, seed=5, trace=True)
    assert first == again
    assert first.dumps() == again.dumps()
    other = run(scenario, seed=6, trace=True)
    assert other.dumps() != first.dumps()


def test_every_materialized_occurrence_is_accounted_for_once() -> None:
    result = run(busy_scenario(), seed=2, trace=True)
    assert result.occurrences is not None
    o = result.overall
    assert o.materialized == len(result.occurrences)
    assert o.materialized == o.published + o.dead + o.expired + o.cancelled + o.live
    assert sum(d.stats.materialized for d in result.definitions) == o.materialized
    assert sum(p.materialized for p in result.policies.values()) == o.materialized
    assert o.lateness.count == o.published
    assert sum(o_.attempts for o_ in result.occurrences) == o.attempts
    # Each (definition, due instant) once: nothing materialized twice.
    keys = [(x.definition_name, x.due_at) for x in result.occurrences]
    assert len(keys) == len(set(keys))
    # The series: one backlog sample and one lateness bucket per sample interval.
    series = result.series
    assert len(series.times) == 36
    for key in ("catch_up", "coalesce", "all"):
        assert len(series.backlog[key]) == len(series.times)
        assert len(series.published[key]) == len(series.times)
    assert sum(series.published["all"]) == o.published
    worst = max(v for v in series.max_lateness["all"] if v is not None)
    assert worst == o.lateness.max


def test_catch_up_replays_every_missed_due_instant_and_coalesce_one() -> None:
    scenario = Scenario(
        CONFIG,
        [
            definition("catch-up", "*/10 * * * *"),
            definition("coalesce", "*/10 * * * *", MissedRunPolicy.COALESCE),
        ],
        T0,
        at(3),
        host_outages=[Interval(at(1), at(2))],
    )
    result = run(scenario, seed=1, trace=True)
    assert result.occurrences is not None
    by_name: dict[str, list[datetime]] = {}
    for o in result.occurrences:
        assert o.state is OccurrenceState.PUBLISHED
        by_name.setdefault(o.definition_name, []).append(o.due_at)
    tens = [T0.replace(second=0) + timedelta(minutes=10 * k) for k in range(1, 19)]
    assert by_name["catch-up"] == tens
    # The outage (07:00:11-08:00:11) missed 07:10 .. 08:00; coalesce emits 07:10 once.
    missed = [t for t in tens if at(1) <= t < at(2)]
    assert by_name["coalesce"] == [t for t in tens if t not in missed[1:]]
    restart = [o for o in result.occurrences if o.materialized_at == at(2)]
    assert len(restart) == len(missed) + 1
    late = result.definitions[0].stats.lateness
    assert late.max == pytest.approx((at(2) - missed[0]).total_seconds(), abs=1)


def test_relay_capacity_bounds_how_fast_a_backlog_drains() -> None:
    many = [definition(f"job-{i:02d}", "15 7 * * *") for i in range(20)]
    patient = RecurringConfig("sim", 20, 1000, lease_duration=timedelta(seconds=120))
    scenario = Scenario(
        patient,
        many,
        T0,
        at(2),
        relay=RelayCapacity(workers=1, rate=0.5, claim_limit=100, concurrency=1),
        ticking=Ticking(budget=100),
    )
    result = run(scenario, seed=1)
    late = result.overall.lateness
    assert result.overall.published == 20
    assert result.hits.claims == 1  # one batch, as the worker claims it
    # One publication at a time, 2 s each: the last of 20 is acknowledged 40 s after the
    # due instant.
    assert late.max == pytest.approx(40.0)
    assert late.p50 == pytest.approx(20.0)


def test_a_batch_publishes_concurrency_at_a_time_at_the_workers_rate() -> None:
    many = [definition(f"job-{i:02d}", "15 7 * * *") for i in range(20)]
    patient = RecurringConfig("sim", 20, 1000, lease_duration=timedelta(seconds=120))
    scenario = Scenario(
        patient,
        many,
        T0,
        at(2),
        relay=RelayCapacity(workers=1, rate=0.125, claim_limit=100, concurrency=4),
        ticking=Ticking(budget=100),
    )
    result = run(scenario, seed=1, trace=True)
    assert result.hits.claims == 1
    # Four at a time, each taking 8 s: five waves, acknowledged 8, 16, ... 40 s after the
    # due instant (0.5 publications per second, as one at a time taking 2 s each).
    late = sorted(
        (o.published_at - o.due_at).total_seconds()
        for o in result.occurrences or ()
        if o.published_at is not None
    )
    assert late == [8.0 * (1 + k // 4) for k in range(20)]


def test_a_broker_that_always_fails_dead_letters_after_ten_attempts() -> None:
    scenario = busy_scenario(
        broker=BrokerModel(failure_rate=1.0), host_outages=(), clock_regressions=(), changes=()
    )
    result = run(scenario, seed=3, trace=True)
    assert result.overall.published == 0
    finished = [o for o in result.occurrences or () if o.state is OccurrenceState.DEAD]
    assert finished
    assert {o.attempts for o in finished} == {10}


def test_lost_acknowledgements_are_republished_under_the_same_key() -> None:
    scenario = busy_scenario(
        broker=BrokerModel(ack_loss_rate=0.5), host_outages=(), clock_regressions=(), changes=()
    )
    result = run(scenario, seed=3, trace=True)
    hits = result.hits
    assert hits.acknowledgements_lost > 0
    # Every lost acknowledgement was retried; the broker recognised the key each time it
    # had already accepted the message.
    assert hits.duplicates > 0
    assert hits.duplicates <= hits.acknowledgements_lost


def test_a_full_occurrence_quota_refuses_ticks_until_a_purge_makes_room() -> None:
    small = RecurringConfig(
        "tiny", 5, 6, delivery_window=timedelta(hours=2), lease_duration=timedelta(seconds=20)
    )
    scenario = Scenario(
        small,
        [definition(f"minutely-{i}", "* * * * *") for i in range(3)],
        T0,
        at(1),
        broker=BrokerModel(outages=[Interval(at(0, 10), at(0, 40))]),
    )
    result = run(scenario, seed=1, trace=True)
    assert result.hits.capacity_errors > 0
    o = result.overall
    assert o.materialized == o.published + o.dead + o.expired + o.cancelled + o.live
    assert o.dead > 0


async def test_run_works_inside_a_running_event_loop() -> None:
    # As in a notebook: the run gets its own thread and loop.
    assert asyncio.get_running_loop()
    result = run(busy_scenario(), seed=1)
    assert result.overall.materialized > 0


def test_results_serialize_to_json() -> None:
    result = run(busy_scenario(), seed=4, trace=True)
    data = json.loads(result.dumps())
    assert data["seed"] == 4
    assert data["overall"]["materialized"] == result.overall.materialized
    assert data["scenario"]["host_outages"] == ["2026-03-02T09:02:11Z/2026-03-02T10:01:11Z"]
    assert data["scenario"]["clock_regressions"][1] == {"at": "2026-03-02T10:30:12Z", "by_s": 40.0}
    assert len(data["series"]["times"]) == len(data["series"]["backlog"]["all"])
    assert {d["name"] for d in data["definitions"]} == {
        "every-5",
        "every-7",
        "hourly",
        "at-the-half",
        "every-7-v2",
    }
    assert data["occurrences"][0]["state"] in {s.value for s in OccurrenceState}


# --- input -----------------------------------------------------------------------------------


def test_iso_8601_intervals_durations_and_instants() -> None:
    assert Interval.parse("2026-01-31T22:00Z/PT6H") == Interval(
        datetime(2026, 1, 31, 22, tzinfo=UTC), datetime(2026, 2, 1, 4, tzinfo=UTC)
    )
    assert Interval.parse("2026-01-31T22:00Z/2026-02-01T01:30+01:00").end == datetime(
        2026, 2, 1, 0, 30, tzinfo=UTC
    )
    assert Interval.parse("PT30M/2026-01-31T22:00Z").start == datetime(
        2026, 1, 31, 21, 30, tzinfo=UTC
    )
    assert parse_iso_duration("P1DT2H3M4.5S") == timedelta(days=1, hours=2, minutes=3, seconds=4.5)
    assert parse_iso_duration("P2W") == timedelta(weeks=2)
    assert parse_instant("2026-01-31T22:00:00+02:00") == datetime(2026, 1, 31, 20, tzinfo=UTC)
    regression = ClockRegression.parse("2026-02-01T03:00Z/PT3S")
    assert regression == ClockRegression(datetime(2026, 2, 1, 3, tzinfo=UTC), timedelta(seconds=3))


@pytest.mark.parametrize(
    "text",
    [
        "2026-02-01T04:00Z/2026-01-31T22:00Z",  # reversed
        "2026-01-31T22:00Z/2026-01-31T22:00Z",  # empty
        "2026-01-31T22:00/PT6H",  # naive
        "2026-01-31T22:00Z",  # no second part
        "2026-01-31T22:00Z/PT6H/PT1H",
        "2026-01-31T22:00Z/P1M",  # months are not a fixed length
        "2026-01-31T22:00Z/P",
        "2026-01-31T22:00Z/PT",
        "2026-01-31T22:00Z/-PT6H",
        "2026-01-31T22:00Z/PT6H\x00",
        "２０２６-01-31T22:00Z/PT6H",  # non-ASCII digits
        "9999-12-31T22:00Z/P999999D",  # leaves the datetime range
        "x" * 10_000,
        "2026-01-31T22:00Z/" + "9" * 10_000 + "S",
        "",
        "/",
    ],
)
def test_malformed_intervals_are_refused_with_one_short_line(text: str) -> None:
    with pytest.raises(ScenarioError) as caught:
        Interval.parse(text)
    message = str(caught.value)
    assert "\n" not in message
    assert len(message) < 200
    assert isinstance(caught.value, ValueError)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("broker", {"failure_rate": math.nan}),
        ("broker", {"failure_rate": math.inf}),
        ("broker", {"failure_rate": -0.1}),
        ("broker", {"ack_loss_rate": 1.5}),
        ("broker", {"failure_rate": 0.6, "ack_loss_rate": 0.6}),
        ("broker", {"failure_rate": True}),
        ("broker", {"failure_rate": "0.1"}),
        ("relay", {"rate": math.nan}),
        ("relay", {"rate": 0}),
        ("relay", {"rate": -1.0}),
        ("relay", {"rate": math.inf}),
        ("relay", {"workers": 0}),
        ("relay", {"workers": 10**20}),
        ("relay", {"claim_limit": 101}),
        ("relay", {"poll_interval": timedelta(0)}),
        ("relay", {"poll_interval": timedelta(microseconds=1500)}),
        ("ticking", {"budget": 0}),
        ("ticking", {"budget": 2**70}),
        ("ticking", {"interval": timedelta(seconds=-1)}),
        ("ticking", {"interval": 1.0}),
    ],
)
def test_bad_capacities_and_rates_are_refused(field: str, value: dict[str, object]) -> None:
    kinds = {"broker": BrokerModel, "relay": RelayCapacity, "ticking": Ticking}
    with pytest.raises(ConfigurationError):
        kinds[field](**value)


@pytest.mark.parametrize(
    "overrides",
    [
        {"end": T0},  # empty range
        {"end": T0 - timedelta(days=1)},  # reversed
        {"end": datetime(2101, 1, 1, 0, 1, tzinfo=UTC)},  # beyond the calendar
        {"end": datetime(2026, 3, 3)},  # naive
        {"start": "2026-03-02"},
        {"definitions": [definition("twice", "* * * * *"), definition("twice", "*/2 * * * *")]},
        {"definitions": ["* * * * *"]},
        {"sample_interval": timedelta(milliseconds=10)},
        {"clock_regressions": [ClockRegression(T0 - timedelta(hours=1), timedelta(seconds=1))]},
        {"clock_regressions": ["2026-03-02T07:00Z/PT3S"]},
        {"changes": [ScheduleChange(T0 + timedelta(hours=1), cancel=["nobody"])]},
        {
            "changes": [
                ScheduleChange(T0 + timedelta(minutes=20), cancel=["later"]),
                ScheduleChange(
                    T0 + timedelta(minutes=30), create=[definition("later", "* * * * *")]
                ),
            ]
        },
        {"changes": [ScheduleChange(T0 + timedelta(days=9))]},
        {"host_outages": ["2026-03-02T07:00Z/PT1H"]},
        {"config": "sim"},
    ],
)
def test_bad_scenarios_are_refused(overrides: dict[str, object]) -> None:
    values: dict[str, object] = {
        "config": CONFIG,
        "definitions": [definition("one", "* * * * *")],
        "start": T0,
        "end": T0 + timedelta(hours=1),
    }
    values.update(overrides)
    with pytest.raises(ScenarioError):
        Scenario(**values)  # type: ignore[arg-type]


def test_a_clock_regression_of_more_than_a_week_is_refused() -> None:
    with pytest.raises(ScenarioError):
        ClockRegression(T0, timedelta(days=8))
    with pytest.raises(ScenarioError):
        ClockRegression(T0, timedelta(0))


def test_more_definitions_than_the_quota_are_refused() -> None:
    with pytest.raises(ScenarioError, match="quota"):
        Scenario(
            RecurringConfig("q", 1, 10),
            [definition("a", "* * * * *"), definition("b", "* * * * *")],
            T0,
            at(1),
        )


def test_a_bad_seed_is_refused() -> None:
    scenario = busy_scenario()
    with pytest.raises(ScenarioError):
        run(scenario, seed="1")  # type: ignore[arg-type]
    with pytest.raises(ScenarioError):
        run(scenario, seed=True)


def test_the_simulator_imports_only_the_domain() -> None:
    # No driver, no cryptography, no plotting: a notebook needs steeple-core and
    # steeple-testing only.
    import ast
    import subprocess
    import sys
    from pathlib import Path

    import steeple.testing.simulation as simulation

    allowed = ("steeple.core", "steeple.testing", "steeple.engine", "attrs", "__future__")
    stdlib = set(sys.stdlib_module_names)
    for path in Path(simulation.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module]
            for name in names:
                assert name.startswith(allowed) or name.split(".")[0] in stdlib, (path, name)
    probe = (
        "import sys, steeple.testing.simulation as s\n"
        "bad = [m for m in ('asyncpg', 'cryptography', 'matplotlib', 'steeple.postgres',"
        " 'steeple.keyring', 'psycopg') if m in sys.modules]\n"
        "print(bad)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    assert done.stdout.strip() == "[]"


def test_due_runs_show_every_due_instant_and_what_coalesce_folded_away() -> None:
    # Down from 07:00 to 08:00 (the first tick at 06:00:11 sees nothing due): the coalesce
    # definition's 07:00 run carries 07:15 to 08:00, which no occurrence stands for.
    scenario = Scenario(
        CONFIG,
        [
            definition("quarterly", "*/15 * * * *", MissedRunPolicy.COALESCE),
            definition("hourly", "0 * * * *"),
        ],
        T0,
        at(3),
        host_outages=[
            Interval(datetime(2026, 3, 2, 7, tzinfo=UTC), datetime(2026, 3, 2, 8, tzinfo=UTC))
        ],
    )
    result = run(scenario, seed=1, trace=True)
    runs = result.due_runs()
    quarterly = [r for r in runs if r.definition_name == "quarterly"]
    # 06:15 to 09:00: every instant of the calendar in the range, materialized or not.
    assert [r.due_at for r in quarterly] == [
        datetime(2026, 3, 2, 6, 15, tzinfo=UTC) + timedelta(minutes=15 * k) for k in range(12)
    ]
    seven = datetime(2026, 3, 2, 7, tzinfo=UTC)
    folded = [r for r in quarterly if r.state is None]
    assert [r.due_at for r in folded] == [seven + timedelta(minutes=15 * k) for k in range(1, 5)]
    assert {r.coalesced_into for r in folded} == {seven}
    carrier = next(r for r in quarterly if r.due_at == seven)
    assert carrier.state is OccurrenceState.PUBLISHED
    assert carrier.lateness is not None
    assert 3600 <= carrier.lateness < 3601
    assert carrier.published_at == seven + timedelta(seconds=carrier.lateness)
    # Catch-up folds nothing: each due instant has its own occurrence.
    hourly = [r for r in runs if r.definition_name == "hourly"]
    assert [r.due_at.hour for r in hourly] == [7, 8, 9]
    assert all(r.state is OccurrenceState.PUBLISHED and r.coalesced_into is None for r in hourly)
    untraced = run(scenario, seed=1)
    with pytest.raises(ValueError, match="trace=True"):
        untraced.due_runs()


def test_due_runs_agree_with_the_counts_in_a_busy_run() -> None:
    result = run(busy_scenario(), seed=2, trace=True)
    runs = result.due_runs()
    made = {(o.definition_name, o.due_at): o for o in result.occurrences or ()}
    assert {(r.definition_name, r.due_at) for r in runs if r.state is not None} == set(made)
    for job in result.definitions:
        mine = [r for r in runs if r.definition_name == job.name]
        states = [r.state for r in mine]
        assert states.count(OccurrenceState.PUBLISHED) == job.stats.published
        assert states.count(OccurrenceState.DEAD) == job.stats.dead
        assert states.count(OccurrenceState.EXPIRED) == job.stats.expired
        assert states.count(OccurrenceState.CANCELLED) == job.stats.cancelled
        for run_ in mine:
            if run_.coalesced_into is not None:
                assert job.policy is MissedRunPolicy.COALESCE
                assert run_.state is None
                carrier = made[(job.name, run_.coalesced_into)]
                assert carrier.due_at < run_.due_at <= carrier.materialized_at
    # The definition cancelled at 01:50 has no due run after it.
    cancelled_at = at(1, 50)
    assert all(r.due_at < cancelled_at for r in runs if r.definition_name == "every-7")
    assert any(r.coalesced_into is not None for r in runs)
