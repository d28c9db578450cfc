"""One simulated year of 100 recurring definitions with 12 outages, on the in-memory store.

Prints the simulated occurrences per second and the wall time; the target is a year in
under 60 s on the development machine (2 cores). ``--profile`` prints where the time goes.

    .venv/bin/python benchmarks/bench_simulate.py [--days 365] [--seed 1] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from datetime import UTC, datetime, timedelta

from steeple.core import MissedRunPolicy, RecurringConfig, RecurringDefinition, ScheduledMessage
from steeple.testing.simulation import (
    BrokerModel,
    Interval,
    RelayCapacity,
    Scenario,
    SimulationResult,
    run,
)

START = datetime(2026, 1, 1, tzinfo=UTC)


def definitions() -> list[RecurringDefinition]:
    """10 every five minutes, 30 hourly, 40 daily, 20 on weekdays; half catch-up, half coalesce."""
    crons = [f"{i % 5}-59/5 * * * *".replace("0-59/5", "*/5") for i in range(10)]
    crons = ["*/5 * * * *"] * 10
    crons += [f"{(i * 5) % 60} * * * *" for i in range(30)]
    crons += [f"{(i * 5) % 60} {i % 24} * * *" for i in range(40)]
    crons += [f"{(i * 15) % 60} {6 + i % 12} * * Mon-Fri" for i in range(20)]
    message = ScheduledMessage("jobs", "job.run", b"{}")
    return [
        RecurringDefinition(
            f"job-{i:03d}",
            cron,
            START,
            MissedRunPolicy.CATCH_UP if i % 2 == 0 else MissedRunPolicy.COALESCE,
            message,
        )
        for i, cron in enumerate(crons)
    ]


def scenario(days: int) -> Scenario:
    """Twelve outages over the year: a six-hour database outage on the last evening of odd
    months, a two-hour broker outage mid-month in even months."""
    host, broker = [], []
    for month in range(1, 13):
        first_next = datetime(2026 + month // 12, month % 12 + 1, 1, tzinfo=UTC)
        if month % 2:
            host.append(Interval(first_next - timedelta(hours=2), first_next + timedelta(hours=4)))
        else:
            mid = datetime(2026, month, 15, 9, tzinfo=UTC)
            broker.append(Interval(mid, mid + timedelta(hours=2)))
    end = START + timedelta(days=days)
    return Scenario(
        RecurringConfig("bench", 1000, 100_000),
        definitions(),
        START,
        end,
        relay=RelayCapacity(workers=2, rate=100.0, claim_limit=100),
        broker=BrokerModel(
            outages=[b for b in broker if b.start < end], failure_rate=0.001, ack_loss_rate=0.001
        ),
        host_outages=[h for h in host if h.start < end],
    )


def report(result: SimulationResult, wall: float) -> None:
    o = result.overall
    print(
        f"simulated {result.scenario.end - result.scenario.start} with "
        f"{len(result.definitions)} definitions, "
        f"{len(result.scenario.host_outages) + len(result.scenario.broker.outages)} outages"
    )
    print(
        f"  materialized {o.materialized:,}  published {o.published:,}  dead {o.dead:,}  "
        f"expired {o.expired:,}  live {o.live:,}"
    )
    print(f"  lateness p50 {o.lateness.p50} s  p99 {o.lateness.p99} s  max {o.lateness.max} s")
    print(f"  hits {result.hits}")
    print(f"wall time {wall:.1f} s; {o.materialized / wall:,.0f} simulated occurrences/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--days", type=int, default=365)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    sc = scenario(args.days)
    profiler = cProfile.Profile() if args.profile else None
    began = time.perf_counter()
    if profiler is not None:
        profiler.enable()
    result = run(sc, seed=args.seed)
    if profiler is not None:
        profiler.disable()
    wall = time.perf_counter() - began
    report(result, wall)
    if profiler is not None:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
