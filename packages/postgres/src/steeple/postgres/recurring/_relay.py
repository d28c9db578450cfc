"""The relay loop lives in :mod:`steeple.engine.relay`; this path keeps old imports working."""

from steeple.engine.relay import RecurringRelay, RelayStatistics

__all__ = ["RecurringRelay", "RelayStatistics"]
