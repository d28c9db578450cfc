"""Exponential backoff with a cap, exact at any attempt number (no float overflow)."""

from __future__ import annotations

from datetime import timedelta

import attrs

from steeple.core.errors import ConfigurationError

__all__ = ["RELAY_BACKOFF", "Backoff"]


@attrs.frozen
class Backoff:
    """Delay before retry number ``attempt`` (1-based): ``initial * factor**(attempt-1)``, capped.

    ``jitter`` in [0, 1] subtracts up to that fraction of the delay, scaled by a random
    draw the caller injects, so many failing workers do not retry in lockstep.

    Raises:
        ConfigurationError: non-positive initial delay, a cap below it, factor < 1,
            jitter outside [0, 1].
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
        if isinstance(self.factor, bool) or not isinstance(self.factor, int) or self.factor < 1:
            raise ConfigurationError("backoff factor must be an int >= 1")
        if (
            isinstance(self.jitter, bool)
            or not isinstance(self.jitter, int | float)
            or not 0.0 <= self.jitter <= 1.0
        ):
            raise ConfigurationError("backoff jitter must be a number within [0, 1]")

    def delay(self, attempt: int, draw: float = 0.0) -> timedelta:
        """Return the delay after failed attempt number ``attempt`` (>= 1).

        Args:
            attempt: how many attempts have failed so far (1 for the first failure).
            draw: a random float in [0, 1) used for jitter; 0 means no jitter.

        Raises:
            ConfigurationError: ``attempt`` is not an int >= 1.
        """
        if isinstance(attempt, bool) or not isinstance(attempt, int):
            raise ConfigurationError(f"attempt must be an int, not {type(attempt).__name__}")
        if attempt < 1:
            raise ConfigurationError(f"attempt numbers start at 1; got {attempt}")
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
        if self.jitter and draw:
            us -= int(us * self.jitter * min(max(draw, 0.0), 1.0))
        return timedelta(microseconds=us)


RELAY_BACKOFF = Backoff(initial=timedelta(seconds=1), maximum=timedelta(minutes=5), factor=2)
"""The recurring relay's automatic retry backoff (stops after ten attempts or window end)."""
