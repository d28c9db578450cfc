"""Clocks: the port's production implementation. The only wall-clock reader in core."""

from __future__ import annotations

from datetime import UTC, datetime

__all__ = ["SystemClock"]


class SystemClock:
    """The real UTC wall clock. Use it in production; tests inject a fake."""

    def now(self) -> datetime:
        """Return the current instant, timezone-aware in UTC."""
        return datetime.now(UTC)

    def __repr__(self) -> str:
        return "SystemClock()"
