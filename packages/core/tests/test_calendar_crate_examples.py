"""Every worked example produced by the real Rust `cron` crate 0.17 must hold for CronCalendar.

The examples live in ``tests/data/cron_examples.json``, a copy of the shared
``shared/cron_examples.json`` (the copy keeps the tests self-contained; a test checks the
copy still equals the shared file whenever that file is present).
"""

from __future__ import annotations

import json
import os
from datetime import UTC, datetime, timedelta
from itertools import islice, pairwise
from pathlib import Path
from typing import Any

import pytest

from steeple.core.calendar import CronCalendar
from steeple.core.errors import InvalidCronExpression

DATA = Path(__file__).resolve().parent / "data" / "cron_examples.json"
SHARED = Path(__file__).resolve().parents[3].parent / "shared" / "cron_examples.json"
IN_CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)

EXAMPLES: dict[str, Any] = json.loads(DATA.read_text(encoding="utf-8"))
VALID: list[dict[str, Any]] = EXAMPLES["valid"]
INVALID: list[dict[str, Any]] = EXAMPLES["invalid"]


def from_ms(ms: int) -> datetime:
    return EPOCH + timedelta(milliseconds=ms)


def to_ms(instant: datetime) -> int:
    return (instant - EPOCH) // timedelta(milliseconds=1)


def test_copy_matches_the_shared_examples() -> None:
    if not SHARED.exists():
        if IN_CI:
            pytest.fail(f"{SHARED} is missing; under CI=true the shared folder must be present")
        pytest.skip(f"{SHARED} is not present on this machine")
    assert json.loads(SHARED.read_text(encoding="utf-8")) == EXAMPLES


def test_the_examples_cover_what_they_should() -> None:
    # A truncated or emptied copy must not pass silently.
    assert EXAMPLES["crate_version"] == "0.17.0"
    assert len(VALID) >= 40
    assert len(INVALID) >= 25
    assert any(not case["next_ms"] for case in VALID)  # exhausted / never-firing cases
    reasons = {case["reject_reason"] for case in INVALID}
    assert {"crate_rejects", "field_count"} <= reasons
    assert reasons <= {"crate_rejects", "field_count", "token_form"}


@pytest.mark.parametrize(
    "case", VALID, ids=[f"{i}:{case['expr'].strip()}" for i, case in enumerate(VALID)]
)
def test_valid_example_gives_the_crates_next_instants(case: dict[str, Any]) -> None:
    calendar = CronCalendar.parse(case["expr"])
    start = from_ms(case["after_ms"])
    expected: list[int] = case["next_ms"]
    produced = list(islice(calendar.iter_after(start), 5))
    assert [to_ms(instant) for instant in produced] == expected
    assert all(instant.tzinfo is UTC for instant in produced)
    assert all(calendar.matches(instant) for instant in produced)
    # next_after agrees with the iterator, one step at a time.
    first = calendar.next_after(start)
    assert first == (produced[0] if produced else None)
    for before, after in pairwise(produced):
        assert calendar.next_after(before) == after
    if len(expected) < 5:
        # Fewer than five: the calendar is exhausted after the last one.
        last = produced[-1] if produced else start
        assert calendar.next_after(last) is None


@pytest.mark.parametrize(
    "case", INVALID, ids=[f"{i}:{case['expr']}" for i, case in enumerate(INVALID)]
)
def test_invalid_example_is_rejected(case: dict[str, Any]) -> None:
    with pytest.raises(InvalidCronExpression) as raised:
        CronCalendar.parse(case["expr"])
    error = raised.value
    assert isinstance(error, ValueError)
    assert error.reason
    assert case["expr"][:77] in str(error)
    if case["five_field_reject"] and not case["expr"].startswith("@"):
        assert error.field is None
        assert "expected 5 fields" in error.reason
    elif not case["five_field_reject"]:
        assert error.field in {"minute", "hour", "day-of-month", "month", "weekday"}
        assert f"in the {error.field} field" in str(error)
