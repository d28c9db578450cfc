"""Missed-run policies and the pure planning of a tick.

:func:`plan_tick` answers "which due instants should this tick materialize, and where
does the cursor go" from a calendar, an exclusive cursor, the observed current time and a
budget. It does no I/O: the store materializes what the plan says and advances the cursor
in the same transaction.
"""

from __future__ import annotations

import enum
from datetime import datetime
from typing import Protocol

import attrs

from steeple.core import limits
from steeple.core._validate import TypedEnumType, aware_utc, bounded_int, shown
from steeple.core.errors import ConfigurationTypeError, RecurringConfigurationError

__all__ = ["DueCalendar", "MissedRunPolicy", "TickPlan", "plan_tick", "validate_budget"]


class MissedRunPolicy(enum.Enum, metaclass=TypedEnumType):
    """How a recurring definition treats due times that passed while nothing ticked.

    ``CATCH_UP`` preserves every missed due time, oldest first, bounded by the tick budget.
    ``COALESCE`` emits the oldest outstanding due time once, then advances past the
    observed current time. ``RUN_ONCE`` is the work queue's misfire policy: one task for
    the missed cursor, then the next future time.
    """

    CATCH_UP = "catch_up"
    COALESCE = "coalesce"
    RUN_ONCE = "run_once"


class DueCalendar(Protocol):
    """What planning needs from a calendar (:class:`~steeple.core.calendar.CronCalendar`)."""

    def next_after(self, instant: datetime) -> datetime | None:
        """Return the first due instant strictly after ``instant``, or ``None`` if exhausted."""
        ...


def validate_budget(n: int, what: str = "budget") -> int:
    """Return ``n`` if it is an int in 1..100 (tick budgets, claim limits, page sizes).

    Raises:
        RecurringConfigurationError: ``n`` is not an int (bools included) or outside 1..100.
    """
    return bounded_int(n, what, limits.MIN_BATCH, limits.MAX_BATCH, RecurringConfigurationError)


@attrs.frozen
class TickPlan:
    """What one tick of one definition materializes.

    Attributes:
        due: the due instants to materialize, oldest first (at most the budget).
        cursor: the new exclusive cursor (the store persists it), or ``None`` when the
            calendar is exhausted (no due instant will ever follow).
        exhausted: no due instant follows the new cursor; the definition is finished.
        next_due: the first due instant after the new cursor (``None`` when exhausted);
            the store may show it as the schedule's next due time.
    """

    due: tuple[datetime, ...]
    cursor: datetime | None
    exhausted: bool
    next_due: datetime | None = attrs.field(default=None, kw_only=True)


def _next(calendar: DueCalendar, instant: datetime) -> datetime | None:
    # A calendar is a port: what it answers is checked like any other input.
    found = calendar.next_after(instant)
    return None if found is None else aware_utc(found, "the calendar's next due instant")


def _finish(due: list[datetime], cursor: datetime, calendar: DueCalendar) -> TickPlan:
    following = _next(calendar, cursor)
    if following is None:
        return TickPlan(due=tuple(due), cursor=None, exhausted=True, next_due=None)
    return TickPlan(due=tuple(due), cursor=cursor, exhausted=False, next_due=following)


def plan_tick(
    policy: MissedRunPolicy,
    calendar: DueCalendar,
    cursor: datetime,
    now: datetime,
    budget: int,
) -> TickPlan:
    """Plan one tick of one definition.

    ``CATCH_UP`` emits every due instant in ``(cursor, now]``, oldest first, at most
    ``budget`` of them; the new cursor is the last one emitted (or unchanged). Repeated
    ticks therefore emit every due instant exactly once.

    ``COALESCE`` and ``RUN_ONCE`` emit the first due instant after ``cursor`` if it is at
    or before ``now``, and move the cursor to ``now`` (so the next due instant is the
    calendar's first after ``now``); otherwise they emit nothing and keep the cursor.

    Args:
        policy: the definition's missed-run policy.
        calendar: the definition's calendar.
        cursor: the exclusive cursor: the last materialized due instant, or the
            definition's ``first_after`` before its first tick.
        now: the observed current time.
        budget: the most instants to emit (1..100).

    Raises:
        RecurringConfigurationError: ``budget`` outside 1..100 or not an int, or an
            unknown policy.
        ConfigurationTypeError: ``calendar`` has no ``next_after``.
        ConfigurationError: the calendar answered something other than an aware
            datetime or ``None``.
        ConfigurationError: ``cursor`` or ``now`` is naive (a ``ValueError``).
        ConfigurationTypeError: ``cursor`` or ``now`` is not a datetime (a ``TypeError``).
    """
    validate_budget(budget)
    if not callable(getattr(calendar, "next_after", None)):
        raise ConfigurationTypeError(
            f"calendar must have a next_after method (a CronCalendar), not {shown(calendar)}"
        )
    cursor = aware_utc(cursor, "cursor")
    now = aware_utc(now, "now")
    if policy is MissedRunPolicy.CATCH_UP:
        due: list[datetime] = []
        position = cursor
        while len(due) < budget:
            candidate = _next(calendar, position)
            if candidate is None or candidate > now:
                break
            due.append(candidate)
            position = candidate
        return _finish(due, position, calendar)
    if policy in (MissedRunPolicy.COALESCE, MissedRunPolicy.RUN_ONCE):
        oldest = _next(calendar, cursor)
        if oldest is not None and oldest <= now:
            return _finish([oldest], now, calendar)
        return _finish([], cursor, calendar)
    raise RecurringConfigurationError(f"unknown missed-run policy {shown(policy)}")
