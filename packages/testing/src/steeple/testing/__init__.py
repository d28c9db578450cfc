"""Testing support for steeple: fakes, the reference store, conformance suites, a plugin.

A fake clock, a seeded random source, a memory broker, the in-memory reference recurring
store, conformance suites and a pytest plugin.

Conformance suites live in :mod:`steeple.testing.conformance.recurring` and
:mod:`steeple.testing.conformance.brokers`.
"""

from steeple.engine.memory_broker import BrokerFault, MemoryBroker
from steeple.testing.clock import FakeClock
from steeple.testing.entropy import DeterministicRandom
from steeple.testing.recurring import InMemoryRecurringStore

__all__ = [
    "BrokerFault",
    "DeterministicRandom",
    "FakeClock",
    "InMemoryRecurringStore",
    "MemoryBroker",
]
