"""The simulator's results are those of the reference store, to the bit.

The digests below were recorded with the relay workers running the worker's batched
claim-and-relay rounds, on the engine as it was before values built from values it had
already checked stopped being checked again (the trusted constructors must change
nothing). Each digest covers the whole result with every
occurrence's trace: due and materialization instants, state, attempts, publication
instant, lateness, backlog samples and the count of every kind of store call. A change of
any of them, for any occurrence, fails the test.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import attrs
import pytest

from steeple.core import MissedRunPolicy, RecurringConfig, RecurringDefinition, ScheduledMessage
from steeple.testing.simulation import (
    BrokerModel,
    ClockRegression,
    Interval,
    RelayCapacity,
    Scenario,
    ScheduleChange,
    SimulationResult,
    Ticking,
    run,
)

MESSAGE = ScheduledMessage("jobs", "job.run", b'{"report": "daily"}', {"tenant": "acme"})


def month_end() -> Scenario:
    """Three days of the benchmark's mix of 100 definitions (every five minutes, hourly,
    daily, weekdays; half catch-up, half coalesce) over a month end: the host down for six
    hours, the broker down for one, 1% failed publications and 1% lost acknowledgements."""
    start = datetime(2026, 1, 30, tzinfo=UTC)
    crons = ["*/5 * * * *"] * 10
    crons += [f"{(i * 5) % 60} * * * *" for i in range(30)]
    crons += [f"{(i * 5) % 60} {i % 24} * * *" for i in range(40)]
    crons += [f"{(i * 15) % 60} {6 + i % 12} * * Mon-Fri" for i in range(20)]
    definitions = [
        RecurringDefinition(
            f"job-{i:03d}",
            cron,
            start,
            MissedRunPolicy.CATCH_UP if i % 2 == 0 else MissedRunPolicy.COALESCE,
            MESSAGE,
        )
        for i, cron in enumerate(crons)
    ]
    return Scenario(
        RecurringConfig("reference", 1000, 100_000),
        definitions,
        start,
        start + timedelta(days=3),
        relay=RelayCapacity(workers=2, rate=100.0, claim_limit=100),
        broker=BrokerModel(
            outages=[Interval.parse("2026-02-01T09:00Z/PT1H")],
            failure_rate=0.01,
            ack_loss_rate=0.01,
        ),
        host_outages=[Interval.parse("2026-01-31T22:00Z/PT6H")],
    )


def turbulent() -> Scenario:
    """Six hours of everything at once on a short window: a slow relay that falls behind,
    frequent failures (dead letters, expiries), a host and a broker outage, clock steps
    inside and beyond the tolerance, a schedule cancelled and another created."""
    t0 = datetime(2026, 3, 2, 6, 0, 11, tzinfo=UTC)
    config = RecurringConfig(
        "turbulent",
        20,
        1000,
        delivery_window=timedelta(minutes=20),
        lease_duration=timedelta(seconds=20),
    )

    def at(hours: float, minutes: float = 0, seconds: float = 0) -> datetime:
        return t0 + timedelta(hours=hours, minutes=minutes, seconds=seconds)

    def every(name: str, cron: str, policy: MissedRunPolicy) -> RecurringDefinition:
        return RecurringDefinition(name, cron, t0, policy, MESSAGE)

    return Scenario(
        config,
        [
            every("every-2", "*/2 * * * *", MissedRunPolicy.CATCH_UP),
            every("every-3", "*/3 * * * *", MissedRunPolicy.COALESCE),
            every("every-5", "*/5 * * * *", MissedRunPolicy.CATCH_UP),
            every("hourly", "0 * * * *", MissedRunPolicy.CATCH_UP),
        ],
        t0,
        at(6),
        ticking=Ticking(interval=timedelta(seconds=5), budget=4),
        relay=RelayCapacity(
            workers=2, rate=0.05, claim_limit=4, poll_interval=timedelta(seconds=5)
        ),
        broker=BrokerModel(
            outages=[Interval(at(1, 40), at(2, 5))], failure_rate=0.3, ack_loss_rate=0.1
        ),
        host_outages=[Interval(at(3, 2), at(4, 1))],
        clock_regressions=[
            ClockRegression(at(0, 50, 2.5), timedelta(seconds=4)),
            ClockRegression(at(4, 30, 1), timedelta(seconds=40)),
        ],
        changes=[
            ScheduleChange(
                at(1, 50),
                cancel=["every-3"],
                create=[every("every-7", "3-59/7 * * * *", MissedRunPolicy.COALESCE)],
            )
        ],
        sample_interval=timedelta(minutes=10),
    )


def digest(result: SimulationResult) -> str:
    return hashlib.sha256(result.dumps(indent=None).encode()).hexdigest()


# (scenario, seed, (materialized, published, dead, expired, open), digest of the result)
REFERENCE = [
    (
        month_end,
        1,
        (10490, 10349, 141, 0, 0),
        "3247dda2508960abaa8ba36ababfc763e0c5722753c9555a7f0a6638ea26ab09",
    ),
    (
        month_end,
        2,
        (10490, 10350, 140, 0, 0),
        "e2bda9eb38dad57e0272890c4cda892bcb9a90024f6367517e76ac6f1589d6c4",
    ),
    (
        turbulent,
        3,
        (322, 305, 13, 1, 0),
        "773ed49ffd3916479b67edebf6bcf9f9d3322f3d1ad61f4a29081d060e6fc40c",
    ),
    (
        turbulent,
        4,
        (322, 306, 13, 0, 0),
        "6ed1c91d47661f8b3ccc9b5f7c03aee64172912066961cd82661562d24c4ac27",
    ),
]


@pytest.mark.parametrize(
    ("make", "seed", "counts", "expected"),
    REFERENCE,
    ids=["month-end-1", "month-end-2", "turbulent-3", "turbulent-4"],
)
def test_a_simulation_is_the_reference_runs_result(
    make: Callable[[], Scenario], seed: int, counts: tuple[int, ...], expected: str
) -> None:
    result = run(make(), seed=seed, trace=True)
    o = result.overall
    # The counts first: a difference there says more than a digest.
    assert (o.materialized, o.published, o.dead, o.expired, o.live) == counts
    assert digest(result) == expected


def test_the_digest_sees_a_single_occurrence_change() -> None:
    # The digest covers each occurrence's trace: one publication a microsecond later
    # (the smallest difference a store could make) changes it.
    result = run(turbulent(), seed=3, trace=True)
    assert result.occurrences is not None
    first = next(o for o in result.occurrences if o.published_at is not None)
    assert first.published_at is not None
    moved = attrs.evolve(first, published_at=first.published_at + timedelta(microseconds=1))
    changed = attrs.evolve(
        result,
        occurrences=tuple(moved if o is first else o for o in result.occurrences),
    )
    assert digest(changed) != digest(result)
