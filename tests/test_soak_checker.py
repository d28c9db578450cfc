"""The soak's recurring checker catches a lost, a doubled and an unpublished occurrence.

The soak itself (``tests/test_soak.py``) only ever sees the checker pass; these feed it
made-up stores and streams, so that a checker that cannot fail is caught here.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from soak import check_recurring
from steeple.core import (
    MissedRunPolicy,
    OccurrenceInfo,
    OccurrenceState,
    RecurringDefinition,
    ScheduledMessage,
)

START = datetime(2031, 3, 4, 5, 0, tzinfo=UTC)
UNTIL = START + timedelta(minutes=4)  # every minute: 5:01 .. 5:04; every two: 5:02, 5:04
DEFINITIONS = {
    name: RecurringDefinition(
        name, cron, START, MissedRunPolicy.CATCH_UP, ScheduledMessage("t", "m", name.encode())
    )
    for name, cron in (("a", "* * * * *"), ("b", "*/2 * * * *"))
}


def occurrence(
    name: str, minute: int, state: OccurrenceState = OccurrenceState.PUBLISHED
) -> OccurrenceInfo:
    due = START + timedelta(minutes=minute)
    return OccurrenceInfo(
        occurrence_id=f"{name}-{minute}",
        definition_name=name,
        due_at=due,
        state=state,
        attempts=1,
        window_ends_at=due + timedelta(days=1),
        created_at=due,
    )


def complete() -> tuple[list[OccurrenceInfo], list[tuple[str, str]]]:
    items = [occurrence("a", m) for m in (1, 2, 3, 4)] + [occurrence("b", m) for m in (2, 4)]
    entries = [(f"key-{o.occurrence_id}", o.definition_name) for o in items]
    return items, entries


def test_a_complete_run_passes_and_is_counted() -> None:
    items, entries = complete()
    # An occurrence due after the load stopped, not published yet, is no loss.
    items.append(occurrence("a", 5, OccurrenceState.PENDING))
    assert check_recurring(DEFINITIONS, items, entries, UNTIL) == {
        "recurring_occurrences": 7,
        "recurring_published": 6,
        "stream_entries": 6,
    }


def test_an_instant_never_published_is_lost() -> None:
    items, entries = complete()
    items[2] = occurrence("a", 3, OccurrenceState.PENDING)
    with pytest.raises(AssertionError, match="lost"):
        check_recurring(DEFINITIONS, items, entries, UNTIL)
    del items[2]
    with pytest.raises(AssertionError, match="lost"):
        check_recurring(DEFINITIONS, items, entries, UNTIL)


def test_an_instant_stored_twice_fails() -> None:
    items, entries = complete()
    items.append(occurrence("b", 4))
    with pytest.raises(AssertionError, match="stored twice"):
        check_recurring(DEFINITIONS, items, entries, UNTIL)


def test_two_stream_entries_under_one_key_fail() -> None:
    items, entries = complete()
    entries.append(entries[0])
    with pytest.raises(AssertionError, match="twice under one idempotency key"):
        check_recurring(DEFINITIONS, items, entries, UNTIL)


def test_a_published_occurrence_missing_from_the_stream_fails() -> None:
    items, entries = complete()
    del entries[-1]
    with pytest.raises(AssertionError, match="b: 2 published, 1 keys"):
        check_recurring(DEFINITIONS, items, entries, UNTIL)


def test_more_keys_than_occurrences_fail() -> None:
    items, entries = complete()
    entries.append(("key-extra", "a"))
    with pytest.raises(AssertionError, match="a: 4 published, 5 keys, 4 stored"):
        check_recurring(DEFINITIONS, items, entries, UNTIL)
    entries[-1] = ("key-extra", "z")
    with pytest.raises(AssertionError, match="unknown payloads"):
        check_recurring(DEFINITIONS, items, entries, UNTIL)
