"""Retrying database work: each loop's backoff, and the one report of an unreachable database.

Every loop of the worker (claims, the wake-up listener, maintenance, lease renewal,
completions) waits before retrying a failed statement by core's ``DATABASE_RETRY`` policy
(:class:`Retry`, one per loop, jittered by the worker's random source). While the database
cannot be reached (connections refused, lost or unanswered), the loops do not log each
attempt: :class:`DatabaseReporter` logs the first failure with its cause, then one summary
per ``every`` seconds ("database unreachable for 12 s, 240 failed attempts"), and one line
when a statement succeeds again; ``health()`` names the outage meanwhile. Failures the
server answered (a lock timeout, a refused write) are still logged by their loop, each
retry spaced by the same backoff.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Final

from steeple.core.backoff import DATABASE_RETRY, Backoff, FailureStreak, StreakReport, streak_failed
from steeple.core.ports import RandomSource
from steeple.postgres.queue._driver import describe_db_error, typed_db_error
from steeple.postgres.queue.errors import QueueUnavailableError

__all__ = ["REPORT_EVERY", "DatabaseReporter", "Retry", "unreachable"]

LOG: Final = logging.getLogger("steeple.postgres.queue")

REPORT_EVERY = 10.0
"""Seconds between the summary lines of one outage."""


def unreachable(exc: BaseException) -> bool:
    """Tell whether ``exc`` means the database could not be reached or did not answer.

    A lost or refused connection, or no answer in time. Not: an error the server sent (a
    lock or statement timeout, a refused write, a bad statement), which says it is up.
    """
    if isinstance(exc, TimeoutError):
        return True
    return isinstance(typed_db_error(exc), QueueUnavailableError)


class Retry:
    """One loop's retry schedule: the delay after each consecutive failure, jittered."""

    def __init__(self, random: RandomSource, policy: Backoff = DATABASE_RETRY) -> None:
        self._random = random
        self._policy = policy
        self.failures = 0
        """Consecutive failures so far (0 after a success)."""

    def failed(self) -> float:
        """Count a failure; return the seconds to wait before the next attempt."""
        self.failures += 1
        return self._policy.delay(self.failures, self._random.random()).total_seconds()

    def succeeded(self) -> None:
        """Start over: the next failure waits the policy's first delay."""
        self.failures = 0


class DatabaseReporter:
    """The worker's one report of an unreachable database: rate-limited logs, a health line."""

    def __init__(
        self, *, every: float | None = None, now: Callable[[], float] = time.monotonic
    ) -> None:
        self._every = REPORT_EVERY if every is None else every
        self._now = now
        self._streak: FailureStreak | None = None
        self._latest = ""

    def failed(self, activity: str, exc: BaseException) -> bool:
        """Count a failed attempt of ``activity``; return whether this reporter logged it.

        ``False``: the failure is not an unreachable database (the server answered); the
        caller logs it.
        """
        if not unreachable(exc):
            return False
        self._latest = f"{activity}: {describe_db_error(exc)}"
        self._streak, report = streak_failed(self._streak, self._now(), self._every)
        if report is StreakReport.BEGAN:
            LOG.warning(
                "database connection failed (%s); every loop retries with backoff (up to %g "
                "s apart), with one summary every %g s while the database is unreachable",
                self._latest,
                DATABASE_RETRY.maximum.total_seconds(),
                self._every,
            )
        elif report is StreakReport.ONGOING:
            streak = self._streak
            LOG.warning(
                "database unreachable for %.0f s, %d failed attempts (latest: %s)",
                streak.lasted(self._now()),
                streak.attempts,
                self._latest,
            )
        return True

    def succeeded(self) -> None:
        """Record that a statement was answered: an outage, if any, is over."""
        streak = self._streak
        if streak is None:
            return
        self._streak = None
        LOG.warning(
            "database reachable again after %.1f s (%d failed attempts)",
            streak.lasted(self._now()),
            streak.attempts,
        )

    def reason(self) -> str | None:
        """Return the health line while the database is unreachable, else ``None``."""
        streak = self._streak
        if streak is None:
            return None
        return (
            f"database unreachable for {streak.lasted(self._now()):.0f} s, "
            f"{streak.attempts} failed attempts (latest: {self._latest})"
        )
