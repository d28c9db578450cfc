from __future__ import annotations

from hypothesis import HealthCheck, settings

from steeple.core.config import RecurringConfig
from steeple.core.ports import Clock, RecurringStore
from steeple.testing import DeterministicRandom, InMemoryRecurringStore
from steeple.testing.conformance.recurring import run_recurring_conformance


async def make_store(config: RecurringConfig, clock: Clock) -> RecurringStore:
    return InMemoryRecurringStore(config, clock, random=DeterministicRandom(7))


def test_in_memory_store_passes_the_recurring_conformance_suite() -> None:
    run_recurring_conformance(
        make_store,
        settings=settings(
            max_examples=80,
            stateful_step_count=30,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
