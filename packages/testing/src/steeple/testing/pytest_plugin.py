"""pytest plugin for steeple (entry point ``pytest11``): fake clock, seeded randomness, broker.

The fake clock starts at an odd instant, 2031-05-17T03:14:15.926Z, so that code which
reads the wall clock instead of the injected clock produces visibly wrong times.
"""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from steeple.engine.memory_broker import MemoryBroker
from steeple.testing.clock import FakeClock
from steeple.testing.entropy import DeterministicRandom

__all__ = ["FAKE_EPOCH", "deterministic_random", "fake_clock", "memory_broker"]

FAKE_EPOCH = datetime(2031, 5, 17, 3, 14, 15, 926000, tzinfo=UTC)
"""Where the ``fake_clock`` fixture starts."""


@pytest.fixture
def fake_clock() -> FakeClock:
    """Return a :class:`FakeClock` at :data:`FAKE_EPOCH` (moves only when the test moves it)."""
    return FakeClock(FAKE_EPOCH)


@pytest.fixture
def deterministic_random() -> DeterministicRandom:
    """Return a :class:`DeterministicRandom` seeded with 0."""
    return DeterministicRandom(0)


@pytest.fixture
def memory_broker() -> MemoryBroker:
    """Return a fresh :class:`MemoryBroker` with no faults queued."""
    return MemoryBroker()
