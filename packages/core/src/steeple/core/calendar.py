"""TEMPORARY PLACEHOLDER written by the lead so `import steeple.core` works meanwhile.

The calendar helper replaces this whole file with the real implementation.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime


class CronCalendar:
    """Do nothing yet (placeholder)."""

    expression: str

    @classmethod
    def parse(cls, expr: str) -> CronCalendar:
        """Do nothing yet (placeholder)."""
        raise NotImplementedError

    def next_after(self, instant: datetime) -> datetime | None:
        """Do nothing yet (placeholder)."""
        raise NotImplementedError

    def iter_after(self, instant: datetime) -> Iterator[datetime]:
        """Do nothing yet (placeholder)."""
        raise NotImplementedError
