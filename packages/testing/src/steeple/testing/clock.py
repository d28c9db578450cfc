"""A controllable clock for tests: time moves only when the test says so."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import attrs

__all__ = ["FakeClock"]


def _aware(instant: object, what: str) -> datetime:
    if not isinstance(instant, datetime):
        raise TypeError(f"{what} must be a datetime, not {type(instant).__name__}")
    if instant.tzinfo is None or instant.utcoffset() is None:
        raise ValueError(
            f"{what} must be timezone-aware (steeple works in UTC); got naive "
            f"{instant.isoformat()}: use datetime(..., tzinfo=UTC)"
        )
    return instant.astimezone(UTC)


@attrs.define(init=False)
class FakeClock:
    """A :class:`steeple.core.ports.Clock` whose time only moves when told to.

    Start it at an odd instant (not midnight, not the real time) so that code that
    secretly reads the wall clock instead of the injected clock stands out.

    Args:
        start: the first instant ``now()`` returns (timezone-aware).

    Raises:
        ValueError: ``start`` is naive.
        TypeError: ``start`` is not a datetime.
    """

    _now: datetime
    simulated = True
    """It runs on simulated time: never judged against a database server's clock."""

    def __init__(self, start: datetime) -> None:
        self._now = _aware(start, "start")

    def now(self) -> datetime:
        """Return the current fake instant (aware, UTC)."""
        return self._now

    def advance(self, delta: timedelta) -> datetime:
        """Move time forward by ``delta`` and return the new instant.

        Raises:
            ValueError: ``delta`` is negative (use :meth:`set` to move backwards on purpose).
            TypeError: ``delta`` is not a timedelta.
        """
        if not isinstance(delta, timedelta):
            raise TypeError(f"delta must be a timedelta, not {type(delta).__name__}")
        if delta < timedelta(0):
            raise ValueError(
                f"advance() only moves forward (got {delta}); use set() to move the clock "
                "backwards deliberately"
            )
        self._now = self._now + delta
        return self._now

    def set(self, instant: datetime) -> None:
        """Jump to ``instant``, forwards or backwards (to simulate clock regressions).

        Raises:
            ValueError: ``instant`` is naive.
            TypeError: ``instant`` is not a datetime.
        """
        self._now = _aware(instant, "instant")

    def __repr__(self) -> str:
        return f"FakeClock(now={self._now.isoformat()!r})"
