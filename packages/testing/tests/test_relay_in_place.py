"""A broker that publishes in place: same outcomes as the concurrent path, no tasks.

A broker saying ``publishes_in_place = True`` (the simulator's model) has a batch's
messages published one after the other in the caller's task; the outcomes, the order of
the publications and everything stored equal what the concurrent path (a task per
publication, under a deadline) gives for the same broker.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import pytest

from steeple.core import MissedRunPolicy, RecurringConfig, RecurringDefinition, ScheduledMessage
from steeple.core.errors import (
    BrokerUnavailableError,
    RelayAcknowledgementError,
    RelayBrokerError,
)
from steeple.core.messages import BrokerReceipt
from steeple.core.records import RelayOutcome
from steeple.testing import FakeClock
from steeple.testing.entropy import DeterministicRandom
from steeple.testing.simulation import memory_store

AT = datetime(2026, 1, 1, 12, tzinfo=UTC)


class _Recording:
    """Accepts, fails or loses the acknowledgement by position; notes the task of each."""

    def __init__(self, in_place: bool) -> None:
        self.publishes_in_place = in_place
        self.tasks: list[asyncio.Task[object] | None] = []
        self.keys: list[str] = []

    async def publish(
        self, message: ScheduledMessage, *, idempotency_key: str, timeout: float
    ) -> BrokerReceipt:
        self.tasks.append(asyncio.current_task())
        self.keys.append(idempotency_key)
        receipt = BrokerReceipt(broker="recording", idempotency_key=idempotency_key)
        if len(self.keys) % 3 == 1:
            raise BrokerUnavailableError("down")
        if len(self.keys) % 3 == 2:
            raise RelayAcknowledgementError(receipt, "lost")
        return receipt


async def _round(in_place: bool) -> tuple[_Recording, list[RelayOutcome], object]:
    clock = FakeClock(AT)
    store = await memory_store(RecurringConfig("in-place", 50, 500), clock, DeterministicRandom(5))
    message = ScheduledMessage("jobs", "job.run", b"{}")
    for i in range(4):
        await store.create(
            RecurringDefinition(f"job-{i}", "* * * * *", AT, MissedRunPolicy.CATCH_UP, message)
        )
    clock.advance(timedelta(minutes=3))
    await store.tick(100)
    broker = _Recording(in_place)
    outcomes = await store.claim_and_relay(100, broker, concurrency=5)
    page = await store.occurrences(limit=100)
    await store.close()
    return broker, outcomes, [(o.occurrence_id, o.state, o.attempts) for o in page.items]


@pytest.mark.parametrize("in_place", [True, False])
async def test_in_place_publications_run_in_the_callers_task(in_place: bool) -> None:
    broker, outcomes, _ = await _round(in_place)
    assert len(outcomes) == len(broker.tasks) == 12
    caller = asyncio.current_task()
    if in_place:
        assert all(task is caller for task in broker.tasks)
    else:
        assert caller not in broker.tasks
        assert len(set(map(id, broker.tasks))) == 12


async def test_in_place_gives_the_concurrent_paths_outcomes() -> None:
    concurrent, outcomes, stored = await _round(False)
    in_place, outcomes_in_place, stored_in_place = await _round(True)
    assert in_place.keys == concurrent.keys
    assert [(o.occurrence_id, o.receipt, type(o.error)) for o in outcomes_in_place] == [
        (o.occurrence_id, o.receipt, type(o.error)) for o in outcomes
    ]
    assert {type(o.error) for o in outcomes} == {
        type(None),
        RelayAcknowledgementError,
        RelayBrokerError,
    }
    assert stored_in_place == stored


class _Unanswering(_Recording):
    """Cannot say whether it publishes in place (its attribute raises)."""

    @property
    def publishes_in_place(self) -> bool:
        raise RuntimeError("no answer")

    @publishes_in_place.setter
    def publishes_in_place(self, value: bool) -> None:
        pass


async def test_a_broker_that_cannot_say_publishes_the_usual_way() -> None:
    clock = FakeClock(AT)
    store = await memory_store(RecurringConfig("unsure", 50, 500), clock, DeterministicRandom(5))
    message = ScheduledMessage("jobs", "job.run", b"{}")
    await store.create(
        RecurringDefinition("job", "* * * * *", AT, MissedRunPolicy.CATCH_UP, message)
    )
    clock.advance(timedelta(minutes=3))
    await store.tick(100)
    broker = _Unanswering(True)
    outcomes = await store.claim_and_relay(100, broker, concurrency=5)
    assert len(outcomes) == len(broker.tasks) == 3
    assert asyncio.current_task() not in broker.tasks
    await store.close()
