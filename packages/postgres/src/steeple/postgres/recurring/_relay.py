"""The relay loop lives in :mod:`steeple.engine.relay_loop`; this path keeps old imports working."""

from steeple.engine.relay_loop import RecurringRelay, RelayStatistics

__all__ = ["RecurringRelay", "RelayStatistics"]
