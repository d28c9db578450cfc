"""A host clock judged against the database server's clock, over the in-memory adapter.

:class:`ServerClocked` wraps the in-memory storage so each transaction's control row
carries a server clock reading (as the PostgreSQL store's lock statement does); the
host's clock is a scripted one. A host ahead of the server by more than 5 s is refused
before it moves the shared time, at the start of a transaction and at its commit; a host
within the bound, and any store without a server clock, work as before.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

import attrs
import pytest

from steeple.core.config import RecurringConfig, RecurringDefinition
from steeple.core.errors import RecurringClockError
from steeple.core.messages import ScheduledMessage
from steeple.core.policies import MissedRunPolicy
from steeple.engine import (
    RecurringEngine,
    RecurringRepository,
    RepositoryWork,
    ServerClockReading,
    judge_clock,
)
from steeple.keyring import Keyring, StorageKey
from steeple.testing import FakeClock
from steeple.testing.recurring import InMemoryRecurringStorage

T = TypeVar("T")
SERVER = datetime(2031, 5, 17, 3, 14, 15, 926000, tzinfo=UTC)
CONFIG = RecurringConfig("clock", 10, 100)
KEYRING = Keyring(StorageKey("k1", b"\x11" * 32))


class HostClock:
    """A host's wall clock (not simulated): each reading is the next offset from SERVER."""

    def __init__(self, *offsets: float) -> None:
        self.offsets = list(offsets)
        self.readings: list[datetime] = []

    def now(self) -> datetime:
        offset = self.offsets.pop(0) if len(self.offsets) > 1 else self.offsets[0]
        reading = SERVER + timedelta(seconds=offset)
        self.readings.append(reading)
        return reading


class _WithServerClock:
    def __init__(self, repo: RecurringRepository, reading: ServerClockReading) -> None:
        self._repo = repo
        self.namespace = attrs.evolve(repo.namespace, server_clock=reading)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._repo, name)


class ServerClocked(InMemoryRecurringStorage):
    """The in-memory adapter whose control row carries a server clock reading of SERVER."""

    def __init__(self, server: Callable[[], datetime] = lambda: SERVER) -> None:
        super().__init__()
        self.server = server

    async def transaction(self, operation: str, work: RepositoryWork[T]) -> T:
        async def with_server(repo: RecurringRepository) -> T:
            reading = ServerClockReading(self.server(), time.monotonic())
            return await work(_WithServerClock(repo, reading))

        return await super().transaction(operation, with_server)


def definition() -> RecurringDefinition:
    return RecurringDefinition(
        "d",
        "* * * * *",
        SERVER - timedelta(minutes=2, seconds=30),
        MissedRunPolicy.CATCH_UP,
        ScheduledMessage("topic", "type", b"p"),
    )


async def test_a_host_an_hour_ahead_is_refused_naming_the_skew() -> None:
    storage = ServerClocked()
    engine = RecurringEngine(storage, CONFIG, KEYRING, HostClock(3600))
    with pytest.raises(RecurringClockError, match="ahead of the database server's clock") as e:
        await engine.create(definition())
    assert "by 1:00:00" in str(e.value)
    assert e.value.skew is not None
    assert e.value.skew > timedelta(minutes=59, seconds=59)
    assert e.value.server_time == SERVER
    assert storage.recorded is None
    assert storage.definitions == {}


async def test_a_host_within_five_seconds_ahead_works() -> None:
    storage = ServerClocked()
    engine = RecurringEngine(storage, CONFIG, KEYRING, HostClock(4.9))
    await engine.create(definition())
    assert (await engine.tick(100)).materialized == 3  # due by 03:14:20.8, not an hour on
    assert storage.recorded == SERVER + timedelta(seconds=4.9)


async def test_a_clock_that_steps_ahead_during_a_transaction_records_nothing() -> None:
    storage = ServerClocked()
    engine = RecurringEngine(storage, CONFIG, KEYRING, HostClock(0, 0, 0, 3600, 0))
    await engine.create(definition())  # readings 0 (lock) and 0 (commit)
    before = storage.recorded
    with pytest.raises(RecurringClockError, match="ahead of the database server's clock"):
        await engine.tick(100)  # read 0 after the lock, +1 h at the commit
    assert storage.recorded == before
    assert storage.occurrences == {}
    # Stepped back: it works again, and ticks only what is due by the server's clock.
    assert (await engine.tick(100)).materialized == 3


async def test_the_round_trip_is_allowed_for() -> None:
    # A reading sent 2 s ago (a slow round trip, a lock wait): a host 6.5 s ahead of that
    # reading may be 4.5 s ahead in fact, and is not refused; 7.5 s is refused.
    sent_two_seconds_ago = ServerClockReading(SERVER, time.monotonic() - 2)
    judge_clock(HostClock(6.5), sent_two_seconds_ago)
    with pytest.raises(RecurringClockError, match=r"allowing for the 2\d\d\d ms round trip"):
        judge_clock(HostClock(7.5), sent_two_seconds_ago)


def test_simulated_clocks_and_stores_without_a_server_clock_are_not_judged() -> None:
    now = ServerClockReading(SERVER, time.monotonic())
    assert judge_clock(FakeClock(SERVER + timedelta(days=400)), now) > SERVER
    assert judge_clock(HostClock(3600), None) == SERVER + timedelta(hours=1)
