"""One simulated year of 100 recurring definitions with 12 outages, on the in-memory store.

Prints the wall time, the simulated occurrences per second and the ratio to the target (a
year in under 60 s on the 2-core development machine), and the same for the CPU time the
run used (what it costs on an idle core; the machine is shared) with the load average.
``--breakdown`` runs it again with every store call timed, to show how much of the time
is the store's and how much the simulator's; ``--profile`` prints where the time goes.

    .venv/bin/python benchmarks/bench_simulate.py [--days 365] [--seed 1] [--breakdown]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import os
import pstats
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from steeple.core import MissedRunPolicy, RecurringConfig, RecurringDefinition, ScheduledMessage
from steeple.core.ports import Clock, RandomSource, RecurringStore
from steeple.testing.simulation import (
    BrokerModel,
    Interval,
    RelayCapacity,
    Scenario,
    SimulationResult,
    memory_store,
    run,
    simulate,
)

START = datetime(2026, 1, 1, tzinfo=UTC)
TARGET_S = 60.0


def definitions() -> list[RecurringDefinition]:
    """10 every five minutes, 30 hourly, 40 daily, 20 on weekdays; half catch-up, half coalesce."""
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
    """Twelve outages: the database down for six hours around the end of odd months, the
    broker down for two hours mid-month in even months; 0.1% failures and lost acks."""
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


class _Timed:
    """A store proxy that adds up the time spent in each store operation."""

    def __init__(self, store: RecurringStore, totals: dict[str, list[float]]) -> None:
        self._store = store
        self._totals = totals

    def __getattr__(self, name: str) -> Any:
        target = getattr(self._store, name)
        if name not in {
            "tick",
            "claim",
            "relay",
            "claim_and_relay",
            "occurrences",
            "purge_terminal",
            "schedules",
        }:
            return target
        totals = self._totals[name]

        async def timed(*args: Any, **kwargs: Any) -> Any:
            began = time.process_time()  # CPU time: other jobs share the machine
            try:
                return await target(*args, **kwargs)
            finally:
                totals[0] += time.process_time() - began
                totals[1] += 1

        return timed


def timed_factory(
    totals: dict[str, list[float]],
) -> Callable[[RecurringConfig, Clock, RandomSource], Awaitable[RecurringStore]]:
    async def factory(config: RecurringConfig, clock: Clock, random: RandomSource) -> Any:
        return _Timed(await memory_store(config, clock, random), totals)

    return factory


def report(result: SimulationResult, wall: float, cpu: float, load: tuple[float, float]) -> None:
    o = result.overall
    s = result.scenario
    outages = len(s.host_outages) + len(s.broker.outages)
    print(
        f"simulated {(s.end - s.start).days} days: {len(result.definitions)} definitions, "
        f"{outages} outages"
    )
    print(
        f"  materialized {o.materialized:,}  published {o.published:,}  dead {o.dead:,}  "
        f"expired {o.expired:,}  open {o.live:,}"
    )
    late = o.lateness
    print(f"  lateness p50 {late.p50} s  p99 {late.p99} s  max {late.max} s")
    print(f"  {result.hits}")
    year = (s.end - s.start).days / 365
    print(
        f"wall time {wall:.1f} s; {o.materialized / wall:,.0f} simulated occurrences/s; "
        f"{(s.end - s.start).total_seconds() / wall:,.0f}x real time; "
        f"target {TARGET_S:.0f} s for a year: {TARGET_S / wall * year:.2f}x"
    )
    # On a shared machine the wall time depends on the other jobs; the CPU time this
    # process used does much less (it is what the run costs on an idle core).
    print(
        f"CPU time {cpu:.1f} s; {o.materialized / cpu:,.0f} simulated occurrences per CPU "
        f"second; target on an idle core: {TARGET_S / cpu * year:.2f}x; "
        f"load average {load[0]:.2f} at the start, {load[1]:.2f} at the end"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--days", type=int, default=365)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--breakdown", action="store_true")
    args, _ = parser.parse_known_args()  # nox passes every bench the same arguments
    sc = scenario(args.days)
    profiler = cProfile.Profile() if args.profile else None
    load = os.getloadavg()[0]
    began, began_cpu = time.perf_counter(), time.process_time()
    if profiler is not None:
        profiler.enable()
    result = run(sc, seed=args.seed)
    if profiler is not None:
        profiler.disable()
    wall, cpu = time.perf_counter() - began, time.process_time() - began_cpu
    report(result, wall, cpu, (load, os.getloadavg()[0]))
    if profiler is not None:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    if args.breakdown:
        totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
        began = time.process_time()
        timed = asyncio.run(simulate(sc, args.seed, store=timed_factory(totals)))
        cpu = time.process_time() - began
        assert timed == result, "the timed run must give the same result"
        store = sum(t for t, _ in totals.values())
        print(f"CPU time breakdown (a second run with every store call timed: {cpu:.1f} s):")
        for name, (seconds, calls) in sorted(totals.items(), key=lambda kv: -kv[1][0]):
            print(
                f"  {name:15} {calls:>10,} calls {seconds:8.2f} s "
                f"{seconds / calls * 1e6:9.1f} us/call"
            )
        print(f"  {'store total':15} {'':>16} {store:8.2f} s")
        print(f"  {'simulator':15} {'':>16} {cpu - store:8.2f} s (event loop, timing proxy)")


if __name__ == "__main__":
    main()
