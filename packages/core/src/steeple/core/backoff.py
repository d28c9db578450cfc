"""Exponential backoff with a cap, exact at any attempt number (no float overflow)."""

from __future__ import annotations

import math
from datetime import timedelta

import attrs

from steeple.core import limits
from steeple.core._validate import shown, unit_float
from steeple.core.errors import ConfigurationError, ConfigurationTypeError

__all__ = ["RELAY_BACKOFF", "Backoff"]


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
