"""Nothing a broker does can kill the relay (issue 11, item 3), on every store.

A broker that raises a plain ``TypeError`` (or ``RuntimeError``, ``UnicodeEncodeError``)
for one occurrence: that occurrence is retried with backoff and ends a dead letter after
ten attempts (a fake clock runs the backoff), never left leased; the relay loop keeps
running and publishes every other occurrence, including ones that fall due afterwards.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from recurring_stores import OpenStore
from steeple.core.config import RecurringConfig, RecurringDefinition
from steeple.core.errors import RelayBrokerError
from steeple.core.messages import BrokerReceipt, ScheduledMessage
from steeple.core.occurrences import OccurrenceState
from steeple.core.policies import MissedRunPolicy
from steeple.engine import RecurringRelay, RelayStatistics
from steeple.testing import FakeClock, MemoryBroker

START = datetime(2031, 5, 17, 3, 14, 15, 926000, tzinfo=UTC)
S = OccurrenceState

FAILURES: dict[str, Callable[[], Exception]] = {
    "TypeError": lambda: TypeError("a RabbitMQ topic of 100 x '€' is 300 bytes"),
    "RuntimeError": lambda: RuntimeError("the client library gave up"),
    "UnicodeEncodeError": lambda: UnicodeEncodeError(
        "utf-8", "\ud800", 0, 1, "surrogates not allowed"
    ),
}


class PoisonedBroker(MemoryBroker):
    """A memory broker whose adapter raises an untyped exception for one payload."""

    def __init__(self, failure: Callable[[], Exception]) -> None:
        super().__init__()
        self.failure = failure
        self.poisoned = 0

    async def publish(
        self, message: ScheduledMessage, *, idempotency_key: str, timeout: float
    ) -> BrokerReceipt:
        if message.payload == b"poison":
            self.poisoned += 1
            raise self.failure()
        return await super().publish(message, idempotency_key=idempotency_key, timeout=timeout)


def every_minute(
    name: str, minutes_back: int, payload: bytes, cron: str = "* * * * *"
) -> RecurringDefinition:
    return RecurringDefinition(
        name,
        cron,
        START - timedelta(minutes=minutes_back),
        MissedRunPolicy.CATCH_UP,
        ScheduledMessage("reminders", "reminder.requested", payload),
    )


ONCE = "14 3 17 5 *"
"""Fires at 03:14 on 17 May: exactly one occurrence whatever the fake clock does."""


async def until(predicate: Callable[[], Awaitable[bool]], task: asyncio.Task[Any]) -> None:
    """Poll the stored state until ``predicate`` holds; fail if the loop task ended."""
    async with asyncio.timeout(60):
        while not await predicate():
            assert not task.done(), task
            await asyncio.sleep(0.01)


@pytest.mark.parametrize("failure", list(FAILURES), ids=list(FAILURES))
async def test_one_poisoned_occurrence_dies_and_the_loop_publishes_the_rest(
    open_store: OpenStore, failure: str
) -> None:
    clock = FakeClock(START)
    store = await open_store(RecurringConfig("survivors", 10, 1000), clock)
    await store.create(every_minute("good", 3, b"good"))
    await store.create(every_minute("poison", 1, b"poison", ONCE))
    broker = PoisonedBroker(FAILURES[failure])
    stats = RelayStatistics()
    relay = RecurringRelay(store, broker, idle_interval=0.01, statistics=stats)
    stop = asyncio.Event()
    task = asyncio.create_task(relay.run(stop))
    try:

        async def poison_is_dead() -> bool:
            items = (await store.occurrences()).items
            poisoned = [o for o in items if o.definition_name == "poison"]
            if not poisoned:
                return False  # not ticked yet
            [poison] = poisoned
            if poison.state is S.RETRY_WAIT:
                assert poison.next_attempt_at is not None
                clock.set(max(clock.now(), poison.next_attempt_at))  # run the backoff
            return poison.state is S.DEAD

        await until(poison_is_dead, task)
        items = (await store.occurrences()).items
        [poison] = [o for o in items if o.definition_name == "poison"]
        assert poison.attempts == 10
        assert poison.last_error == failure
        assert broker.poisoned == 10
        # (a good lease can also lapse when the fake clock jumps a backoff mid-relay:
        # a lost lease, reclaimed and published later)
        # whatever the broker raised, each failed attempt is counted as a relay failure
        assert stats.relay_failures >= 10
        assert relay.failed == stats.relay_failures
        good = [o for o in items if o.definition_name == "good"]
        assert len(good) >= 3  # the backoff ran ~8.5 fake minutes: more fell due meanwhile

        # The loop is still running: the next due minutes are published too.
        clock.advance(timedelta(minutes=2))
        expected = len(good) + 2

        async def later_published() -> bool:
            states = [
                o.state for o in (await store.occurrences()).items if o.definition_name == "good"
            ]
            return len(states) == expected and set(states) == {S.PUBLISHED}

        await until(later_published, task)
        assert not task.done()
    finally:
        stop.set()
        async with asyncio.timeout(10):
            await task
    assert relay.published == len(broker.published) >= 5
    assert all(message.payload == b"good" for message, _ in broker.published)
    assert relay.storage_failures == 0


async def test_an_untyped_broker_error_is_recorded_and_reported_typed(
    open_store: OpenStore,
) -> None:
    clock = FakeClock(START)
    store = await open_store(RecurringConfig("survivors", 10, 1000), clock)
    await store.create(every_minute("poison", 1, b"poison", ONCE))
    await store.tick(10)
    [lease] = await store.claim(10)
    with pytest.raises(RelayBrokerError) as info:
        await store.relay(lease, PoisonedBroker(FAILURES["TypeError"]))
    assert not info.value.permanent
    assert isinstance(info.value.__cause__, TypeError)
    # the broker's message (it may echo the topic) is neither in the error nor stored
    assert "€" not in str(info.value)
    [occ] = (await store.occurrences()).items
    assert (occ.state, occ.attempts, occ.last_error) == (S.RETRY_WAIT, 1, "TypeError")
    assert occ.next_attempt_at == clock.now() + timedelta(seconds=1)


async def test_a_cancelled_publication_propagates_and_the_lease_lapses_normally(
    open_store: OpenStore,
) -> None:
    clock = FakeClock(START)
    store = await open_store(RecurringConfig("survivors", 10, 1000), clock)
    await store.create(every_minute("d", 1, b"x"))
    await store.tick(10)
    [lease] = await store.claim(10)

    class Cancelled(MemoryBroker):
        async def publish(
            self, message: ScheduledMessage, *, idempotency_key: str, timeout: float
        ) -> BrokerReceipt:
            raise asyncio.CancelledError

    with pytest.raises(asyncio.CancelledError):
        await store.relay(lease, Cancelled())
    [occ] = (await store.occurrences()).items
    assert occ.state is S.LEASED  # not a publication failure: the caller was cancelled
    clock.advance(timedelta(seconds=60))
    [again] = await store.claim(10)
    broker = MemoryBroker()
    await store.relay(again, broker)
    assert len(broker.published) == 1


async def test_a_broker_returning_no_receipt_is_a_retryable_failure(
    open_store: OpenStore,
) -> None:
    clock = FakeClock(START)
    store = await open_store(RecurringConfig("survivors", 10, 1000), clock)
    await store.create(every_minute("d", 1, b"x"))
    await store.tick(10)
    [lease] = await store.claim(10)

    class NoReceipt(MemoryBroker):
        async def publish(self, message: Any, *, idempotency_key: str, timeout: float) -> Any:
            await super().publish(message, idempotency_key=idempotency_key, timeout=timeout)
            return None

    with pytest.raises(RelayBrokerError) as info:
        await store.relay(lease, NoReceipt())
    assert isinstance(info.value.__cause__, TypeError)
    [occ] = (await store.occurrences()).items
    assert occ.state is S.RETRY_WAIT
