"""The relay loop lives in :mod:`steeple.engine.relay`; this path keeps old imports working."""

from steeple.engine.relay import RecurringRelay

__all__ = ["RecurringRelay"]
