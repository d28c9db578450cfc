"""Missed-run policies: what a tick materializes when due times were missed."""

from __future__ import annotations

import enum

__all__ = ["MissedRunPolicy"]


class MissedRunPolicy(enum.Enum):
    """How a recurring definition treats due times that passed while nothing ticked.

    ``CATCH_UP`` preserves every missed due time, oldest first, bounded by the tick budget.
    ``COALESCE`` emits the oldest outstanding due time once, then advances past the
    observed current time. ``RUN_ONCE`` is the work queue's misfire policy: one task for
    the missed cursor, then the next future time.
    """

    CATCH_UP = "catch_up"
    COALESCE = "coalesce"
    RUN_ONCE = "run_once"
