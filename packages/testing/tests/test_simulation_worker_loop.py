"""The simulated relay workers call the store as ``steeple worker``'s relay loop does.

A spy store records the relay calls of one :class:`~steeple.engine.RecurringRelay`
round and of a simulation with the same claim limit: both relay through batched
``claim_and_relay`` calls only (never ``claim`` and ``relay``), with the same limit and the
same concurrency. If the worker's loop changes its calls, this fails until the simulator
follows.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from steeple.core import (
    MissedRunPolicy,
    RecurringConfig,
    RecurringDefinition,
    ScheduledMessage,
    limits,
)
from steeple.core.ports import Clock, RandomSource, RecurringStore
from steeple.engine.relay_loop import RecurringRelay
from steeple.testing import FakeClock, MemoryBroker
from steeple.testing.entropy import DeterministicRandom
from steeple.testing.simulation import RelayCapacity, Scenario, memory_store, simulate

START = datetime(2026, 1, 1, 0, 0, 7, tzinfo=UTC)
RELAY_CALLS = {"claim", "relay", "relay_many", "claim_and_relay"}


class Spy:
    """Forwards to a store and records its relay calls (name, positional args, keywords)."""

    def __init__(self, store: RecurringStore, calls: list[tuple[str, int, int]]) -> None:
        self._store = store
        self._calls = calls

    def __getattr__(self, name: str) -> Any:
        target = getattr(self._store, name)
        if name not in RELAY_CALLS:
            return target

        async def spied(*args: Any, **kwargs: Any) -> Any:
            first = args[0]
            limit = (
                first if isinstance(first, int) else len(first) if isinstance(first, list) else 1
            )
            concurrency = kwargs.get("concurrency", limits.RELAY_CONCURRENCY)
            self._calls.append((name, limit, concurrency))
            return await target(*args, **kwargs)

        return spied


def definitions() -> list[RecurringDefinition]:
    message = ScheduledMessage("jobs", "job.run", b"{}")
    return [
        RecurringDefinition(f"job-{i}", "*/5 * * * *", START, MissedRunPolicy.CATCH_UP, message)
        for i in range(12)
    ]


async def test_a_simulated_worker_relays_with_the_relay_loops_calls() -> None:
    config = RecurringConfig("loop", 20, 1000)
    worker_calls: list[tuple[str, int, int]] = []
    clock = FakeClock(START)
    store = await memory_store(config, clock, DeterministicRandom(1))
    spy: Any = Spy(store, worker_calls)
    for definition in definitions():
        await spy.create(definition)
    clock.advance(timedelta(minutes=5))
    relay = RecurringRelay(spy, MemoryBroker(), claim_limit=7, loop_lag_threshold=None)
    assert await relay.run_once() > 0
    await store.close()

    simulated_calls: list[tuple[str, int, int]] = []

    async def factory(config: RecurringConfig, clock: Clock, random: RandomSource) -> Any:
        return Spy(await memory_store(config, clock, random), simulated_calls)

    scenario = Scenario(
        config,
        definitions(),
        START,
        START + timedelta(hours=1),
        relay=RelayCapacity(workers=2, rate=100.0, claim_limit=7),
    )
    result = await simulate(scenario, 1, store=factory)
    assert result.overall.published == result.overall.materialized > 7

    assert worker_calls == [("claim_and_relay", 7, limits.RELAY_CONCURRENCY)]
    assert simulated_calls
    assert set(simulated_calls) == {("claim_and_relay", 7, limits.RELAY_CONCURRENCY)}
