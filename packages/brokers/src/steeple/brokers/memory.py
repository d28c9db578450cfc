"""The in-memory message broker: deduplication by key and fault injection, for tests.

The classes are :mod:`steeple.engine.memory_broker`'s (the test kit offers them too).
"""

from steeple.engine.memory_broker import BrokerFault, MemoryBroker

__all__ = ["BrokerFault", "MemoryBroker"]
