"""How much work a scenario is, from the calendars alone (no store, no clock): cheap."""

from __future__ import annotations

from datetime import datetime
from typing import Final

from steeple.core.config import RecurringDefinition
from steeple.testing.simulation._scenario import Scenario, ScenarioError

__all__ = ["estimate_occurrences"]

_EXACT: Final = 1000
"""Due times counted one by one per definition; a busier calendar is extrapolated."""


def _spans(scenario: Scenario) -> list[tuple[RecurringDefinition, datetime]]:
    """Each definition with the instant its calendar stops counting (as ``due_runs`` does)."""
    created = [(scenario.start, d) for d in scenario.definitions]
    created += [(c.at, d) for c in scenario.changes for d in c.create]
    spans = []
    for since, definition in created:
        stop = min(
            [scenario.end]
            + [c.at for c in scenario.changes if definition.name in c.cancel and c.at >= since]
        )
        spans.append((definition, stop))
    return spans


def _count(definition: RecurringDefinition, stop: datetime) -> int:
    first = definition.cron.next_after(definition.first_after)
    if first is None or first >= stop:
        return 0
    count = 0
    last = first
    for due in definition.cron.iter_after(definition.first_after):
        if due >= stop:
            return count
        count += 1
        last = due
        if count >= _EXACT:
            break
    else:
        return count
    # A busy calendar: the rate of its first due times carried over the rest of the span.
    spanned = (last - first).total_seconds()
    total = (stop - first).total_seconds()
    if spanned <= 0:
        return count
    return max(count, round((count - 1) * total / spanned) + 1)


def estimate_occurrences(scenario: Scenario, *, stop_after: int | None = None) -> int:
    """Return about how many due times the run materializes: its work, before running it.

    Counts each definition's due times from its ``first_after`` to the end of the range
    (or its scheduled cancellation), as :meth:`SimulationResult.due_runs` lists them. A
    definition with at most 1,000 due times in its span is counted exactly; a busier
    one is extrapolated from the spacing of its first 1,000. Fast whatever the range: at
    most 1,000 calendar steps per definition.

    Args:
        scenario: the what-if.
        stop_after: stop counting once the total exceeds this and return the total so far
            (already more than ``stop_after``): a hostile scenario is refused at once.

    Raises:
        ScenarioError: ``scenario`` is not a Scenario, or ``stop_after`` is negative.
    """
    if not isinstance(scenario, Scenario):
        raise ScenarioError(f"scenario must be a Scenario, not {type(scenario).__name__}")
    if stop_after is not None and (
        isinstance(stop_after, bool) or not isinstance(stop_after, int) or stop_after < 0
    ):
        raise ScenarioError("stop_after must be an int of at least 0")
    total = 0
    for definition, stop in _spans(scenario):
        total += _count(definition, stop)
        if stop_after is not None and total > stop_after:
            return total
    return total
