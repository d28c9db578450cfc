"""Instants as integer microseconds since the epoch: cheap to compare, exact to convert."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Final

__all__ = ["EPOCH", "MICROSECOND", "align_up", "from_us", "span_us", "to_us"]

EPOCH: Final = datetime(1970, 1, 1, tzinfo=UTC)
MICROSECOND: Final = timedelta(microseconds=1)


def to_us(instant: datetime) -> int:
    """Return an aware instant as microseconds since the epoch."""
    return (instant - EPOCH) // MICROSECOND


def from_us(us: int) -> datetime:
    """Return microseconds since the epoch as an aware UTC datetime."""
    return EPOCH + timedelta(microseconds=us)


def span_us(delta: timedelta) -> int:
    """Return a duration in microseconds."""
    return delta // MICROSECOND


def align_up(us: int, origin: int, step: int) -> int:
    """Return the first instant of the grid ``origin + k * step`` at or after ``us``."""
    if us <= origin:
        return origin
    return origin + -(-(us - origin) // step) * step
