"""Clocks: the port's production implementation. The only wall-clock reader in core."""

from __future__ import annotations

from datetime import UTC, datetime

__all__ = ["SystemClock", "is_simulated"]


class SystemClock:
    """The real UTC wall clock. Use it in production; tests inject a fake."""

    def now(self) -> datetime:
        """Return the current instant, timezone-aware in UTC."""
        return datetime.now(UTC)

    def __repr__(self) -> str:
        return "SystemClock()"


def is_simulated(clock: object) -> bool:
    """Whether ``clock`` declares that it runs on simulated time (``simulated = True``).

    A store that can read its server's clock judges every other clock against it (see
    :func:`steeple.core.leases.check_server_clock`); a simulation's or a test's clock,
    deliberately far from the real time, declares itself so and is not judged.
    """
    return getattr(clock, "simulated", False) is True
