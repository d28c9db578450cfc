"""What a listing and every store call build: occurrence metadata and the error boundary."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import attrs
import pytest

from steeple.core.errors import (
    ConfigurationError,
    RecurringConfigurationError,
    RecurringNotFoundError,
    RelayLeaseLostError,
)
from steeple.core.occurrences import OccurrenceState
from steeple.core.records import OccurrenceInfo
from steeple.engine import OccurrenceRow, recurring_errors
from steeple.engine.codec import occurrence_info, occurrence_infos

T0 = datetime(2031, 5, 17, 3, 14, tzinfo=UTC)


def row(n: int) -> OccurrenceRow:
    # Every column its own value: a field built from another column shows.
    return OccurrenceRow(
        occurrence_id=f"{n:032x}",
        definition_name=f"d{n}",
        due_at=T0 + timedelta(minutes=n),
        state=OccurrenceState.RETRY_WAIT,
        attempts=n + 2,
        window_ends_at=T0 + timedelta(days=1, minutes=n),
        created_at=T0 - timedelta(minutes=n + 1),
        updated_at=T0 + timedelta(hours=1),
        finished_at=None,
        next_attempt_at=T0 + timedelta(minutes=n, seconds=30),
        last_error=f"Error{n}",
        lease_expires_at=T0 + timedelta(hours=2),
        lease_revision=7,
        lease_digest=b"d" * 32,
        content=b"sealed",
        key_id="k1",
    )


def by_name(r: OccurrenceRow) -> OccurrenceInfo:
    return OccurrenceInfo(
        occurrence_id=r.occurrence_id,
        definition_name=r.definition_name,
        due_at=r.due_at,
        state=r.state,
        attempts=r.attempts,
        window_ends_at=r.window_ends_at,
        created_at=r.created_at,
        next_attempt_at=r.next_attempt_at,
        last_error=r.last_error,
    )


def test_a_listing_page_builds_each_field_from_its_own_column() -> None:
    rows = [row(n) for n in range(3)]
    built = occurrence_infos(rows)
    assert built == [by_name(r) for r in rows]
    assert [occurrence_info(r) for r in rows] == built
    assert occurrence_infos([]) == []
    for info, r in zip(built, rows, strict=True):
        checked = by_name(r)
        assert type(info) is OccurrenceInfo
        assert hash(info) == hash(checked)
        assert repr(info) == repr(checked)
        with pytest.raises(attrs.exceptions.FrozenInstanceError):
            info.attempts = 0  # type: ignore[misc]


def test_the_error_boundary_maps_library_errors_and_passes_the_rest() -> None:
    with recurring_errors("nothing"):
        pass
    cause = ConfigurationError("bad value")
    with pytest.raises(RecurringConfigurationError) as caught, recurring_errors("listing"):
        raise cause
    assert caught.value.__cause__ is cause
    for passing in (
        RecurringNotFoundError("gone"),
        RelayLeaseLostError("lost"),
        ValueError("not the library's"),
    ):
        with pytest.raises(type(passing)) as kept, recurring_errors("x"):
            raise passing
        assert kept.value is passing
