"""Simulate recurring publications on the domain alone: no database, no broker, a fake clock.

Describe a what-if as a :class:`Scenario` (definitions, a time range, tick and relay
capacity, broker failures, host outages, clock regressions, schedule changes) and
:func:`run` it: the real store logic (the in-memory reference store, which decides
through steeple's core exactly as the PostgreSQL store does) runs on a fake clock that
jumps from one interesting instant to the next, so months take seconds. The
:class:`SimulationResult` counts what was materialized, published, dead-lettered, expired
and cancelled, per definition, per policy and overall, with the lateness distribution,
backlog over time and the limits hit; it serializes to JSON. Same scenario, same seed:
an equal result.

Example::

    from datetime import UTC, datetime, timedelta
    from steeple.core import MissedRunPolicy, RecurringConfig, RecurringDefinition
    from steeple.core import ScheduledMessage
    from steeple.testing.simulation import Interval, Scenario, run

    start = datetime(2026, 1, 30, tzinfo=UTC)
    nightly = RecurringDefinition(
        "nightly-billing", "0 2 * * *", start, MissedRunPolicy.CATCH_UP,
        ScheduledMessage("billing", "billing.run", b""),
    )
    scenario = Scenario(
        RecurringConfig("what-if", 100, 100_000), [nightly], start, start + timedelta(days=3),
        host_outages=[Interval.parse("2026-01-31T22:00Z/PT6H")],
    )
    result = run(scenario, seed=1)
    print(result.overall.lateness.max)
"""

from __future__ import annotations

import asyncio
import concurrent.futures

from steeple.core.config import RecurringConfig
from steeple.core.ports import Clock, MessageBroker, RandomSource, RecurringStore
from steeple.testing.recurring import InMemoryRecurringStore
from steeple.testing.simulation._broker import SimulatedBroker
from steeple.testing.simulation._driver import Progress, SimulationError, StoreFactory, drive
from steeple.testing.simulation._estimate import estimate_occurrences
from steeple.testing.simulation._result import (
    DefinitionResult,
    DueRun,
    Hits,
    Lateness,
    OccurrenceOutcome,
    Series,
    SimulationResult,
    Stats,
)
from steeple.testing.simulation._scenario import (
    CALENDAR_END,
    BrokerModel,
    ClockRegression,
    Interval,
    RelayCapacity,
    Scenario,
    ScenarioError,
    ScheduleChange,
    Ticking,
    parse_instant,
    parse_iso_duration,
)

__all__ = [
    "CALENDAR_END",
    "BrokerModel",
    "ClockRegression",
    "DefinitionResult",
    "DueRun",
    "Hits",
    "Interval",
    "Lateness",
    "OccurrenceOutcome",
    "Progress",
    "RelayCapacity",
    "Scenario",
    "ScenarioError",
    "ScheduleChange",
    "Series",
    "SimulatedBroker",
    "SimulationError",
    "SimulationResult",
    "Stats",
    "StoreFactory",
    "Ticking",
    "estimate_occurrences",
    "memory_store",
    "parse_instant",
    "parse_iso_duration",
    "run",
    "simulate",
]


async def memory_store(
    config: RecurringConfig, clock: Clock, random: RandomSource
) -> RecurringStore:
    """Build the in-memory reference store (no sealer: content stays in memory as is)."""
    return InMemoryRecurringStore(config, clock, random=random)


async def simulate(
    scenario: Scenario,
    seed: int = 0,
    *,
    store: StoreFactory = memory_store,
    broker: MessageBroker | None = None,
    trace: bool = False,
    progress: Progress | None = None,
) -> SimulationResult:
    """Run ``scenario`` on a fake clock and return what happened (the async form of :func:`run`).

    Args:
        scenario: the what-if.
        seed: seeds the store's random source (generations, capabilities, jitter) and the
            broker failure model.
        store: builds the store under simulation from ``(config, clock, random)``; the
            in-memory reference store by default. Any
            :class:`~steeple.core.ports.RecurringStore` works (the PostgreSQL store too:
            that is how the simulator is shown to be the same domain).
        broker: where accepted publications go behind the failure model (for instance a
            :class:`~steeple.testing.MemoryBroker` to inspect them); by default a broker
            that only deduplicates.
        trace: also return each occurrence's outcome (memory grows with the run).
        progress: called every few hundred events with the simulated instant and the
            share of the range done (0 to 1); it changes nothing in the result. Returning
            False (or raising KeyboardInterrupt) stops the run between two events: the
            result then covers the range up to that instant (``stopped_at`` says where).

    Raises:
        ScenarioError: ``seed`` is not an int, or ``broker`` is not a MessageBroker.
        SimulationError: the store did something the simulator cannot account for.
        RecurringError: the store refused a definition or failed (not expected from the
            in-memory store once the scenario validated).
    """
    return await drive(scenario, seed, store, inner_broker=broker, trace=trace, progress=progress)


def run(
    scenario: Scenario,
    seed: int = 0,
    *,
    trace: bool = False,
    progress: Progress | None = None,
) -> SimulationResult:
    """Run ``scenario`` on the in-memory reference store; see :func:`simulate`.

    Works inside a running event loop too (a notebook): the run then gets its own thread.

    Raises:
        ScenarioError: ``seed`` is not an int.
        SimulationError: the store did something the simulator cannot account for.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(simulate(scenario, seed, trace=trace, progress=progress))
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        work = simulate(scenario, seed, trace=trace, progress=progress)
        return pool.submit(asyncio.run, work).result()
