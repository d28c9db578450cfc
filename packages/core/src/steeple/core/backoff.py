"""Exponential backoff with a cap, exact at any attempt number (no float overflow)."""

from __future__ import annotations

import enum
import math
from datetime import timedelta

import attrs

from steeple.core import limits
from steeple.core._validate import shown, unit_float
from steeple.core.errors import ConfigurationError, ConfigurationTypeError

__all__ = [
    "DATABASE_RETRY",
    "RELAY_BACKOFF",
    "Backoff",
    "FailureStreak",
    "StreakReport",
    "streak_failed",
]


@attrs.frozen
class Backoff:
    """Delay before retry number ``attempt`` (1-based): ``initial * factor**(attempt-1)``, capped.

    ``jitter`` in [0, 1] subtracts up to that fraction of the delay, scaled by a random
    draw the caller injects, so many failing workers do not retry in lockstep.

    Raises:
        ConfigurationError: non-positive initial delay, a cap below it, a factor outside
            1..2**31-1 (or not an int), jitter outside [0, 1] (NaN included) or not a number.
    """

    initial: timedelta = timedelta(seconds=1)
    maximum: timedelta = timedelta(minutes=5)
    factor: int = 2
    jitter: float = 0.0

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.initial, timedelta) or self.initial <= timedelta(0):
            raise ConfigurationError("backoff initial delay must be a positive timedelta")
        if not isinstance(self.maximum, timedelta) or self.maximum < self.initial:
            raise ConfigurationError("backoff maximum must be a timedelta >= the initial delay")
        if isinstance(self.factor, bool) or not isinstance(self.factor, int):
            raise ConfigurationTypeError(
                f"backoff factor must be an int, not {type(self.factor).__name__}"
            )
        if not 1 <= self.factor <= limits.MAX_BACKOFF_FACTOR:
            raise ConfigurationError(
                f"backoff factor must be between 1 and {limits.MAX_BACKOFF_FACTOR}; "
                f"got {shown(self.factor)}"
            )
        if (
            isinstance(self.jitter, bool)
            or not isinstance(self.jitter, int | float)
            or (isinstance(self.jitter, float) and math.isnan(self.jitter))
            or not 0.0 <= self.jitter <= 1.0
        ):
            raise ConfigurationError("backoff jitter must be a number within [0, 1]")

    def delay(self, attempt: int, draw: float = 0.0) -> timedelta:
        """Return the delay after failed attempt number ``attempt`` (>= 1).

        Args:
            attempt: how many attempts have failed so far (1 for the first failure).
            draw: a random float in [0, 1) used for jitter; 0 means no jitter.

        Raises:
            ConfigurationError: ``attempt`` is not an int >= 1, or ``draw`` is NaN,
                infinite or not a number (finite draws are clamped into [0, 1]).
        """
        if isinstance(attempt, bool) or not isinstance(attempt, int):
            raise ConfigurationTypeError(f"attempt must be an int, not {type(attempt).__name__}")
        if attempt < 1:
            raise ConfigurationError(f"attempt numbers start at 1; got {shown(attempt)}")
        fraction = unit_float(draw, "draw")
        initial_us = self.initial // timedelta(microseconds=1)
        cap_us = self.maximum // timedelta(microseconds=1)
        # Integer arithmetic, stopping as soon as the cap is reached: attempt 10**9 is as
        # cheap and as exact as attempt 2.
        us = initial_us
        for _ in range(attempt - 1):
            if us >= cap_us:
                break
            us *= self.factor
            if self.factor == 1:
                break
        us = min(us, cap_us)
        if self.jitter and fraction:
            us -= int(us * self.jitter * fraction)
        return timedelta(microseconds=us)


RELAY_BACKOFF = Backoff(initial=timedelta(seconds=1), maximum=timedelta(minutes=5), factor=2)
"""The recurring relay's automatic retry backoff (stops after ten attempts or window end)."""


DATABASE_RETRY = Backoff(
    initial=timedelta(milliseconds=100), maximum=timedelta(seconds=5), factor=2, jitter=0.5
)
"""How long a worker loop waits before it retries a database operation that failed.

The first retry comes quickly (a single killed connection costs a tenth of a second);
an outage is retried at most every five seconds by each loop, half of that jittered so
the workers of a fleet do not reconnect in lockstep when the database returns.
"""


class StreakReport(enum.Enum):
    """What to say about a failure streak after one more failed attempt."""

    BEGAN = "began"
    """The first failure of a streak: report it, with its cause."""
    ONGOING = "ongoing"
    """A summary is due: the streak has lasted another reporting interval."""
    QUIET = "quiet"
    """Nothing to say yet: counted, reported with the next summary."""


@attrs.frozen
class FailureStreak:
    """A run of failed attempts to reach a dependency, on a monotonic clock in seconds.

    Pure: the caller passes ``now`` and keeps the returned value. One line when the
    streak begins, one summary per ``every`` seconds while it lasts, one when it ends,
    however many attempts fail in between.
    """

    since: float
    """When the first failure of the streak happened."""
    attempts: int
    """How many attempts have failed in the streak."""
    reported_at: float
    """When the streak was last reported."""

    def lasted(self, now: float) -> float:
        """Seconds from the first failure to ``now`` (never negative)."""
        return max(0.0, now - self.since)


def streak_failed(
    streak: FailureStreak | None, now: float, every: float
) -> tuple[FailureStreak, StreakReport]:
    """Count a failed attempt at ``now`` in ``streak`` (``None``: none yet); say what to report.

    The first failure begins a streak (:attr:`StreakReport.BEGAN`); later ones are quiet
    until ``every`` seconds have passed since the last report (:attr:`StreakReport.ONGOING`).
    """
    if streak is None:
        return FailureStreak(since=now, attempts=1, reported_at=now), StreakReport.BEGAN
    if now - streak.reported_at >= every:
        return (
            attrs.evolve(streak, attempts=streak.attempts + 1, reported_at=now),
            StreakReport.ONGOING,
        )
    return attrs.evolve(streak, attempts=streak.attempts + 1), StreakReport.QUIET
