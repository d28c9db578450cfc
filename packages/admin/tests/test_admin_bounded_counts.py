"""The dashboard labels counts that stopped at their cap or are estimates, and shows limits."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from steeple.admin import _pages
from steeple.admin.tasks import Overview, QueueRecord, TaskFilter


class _Links:
    def tasks(self, where: TaskFilter) -> str:
        return f"/tasks?state={where.state}&queue={where.queue}"


def test_bounded_counts_are_labelled() -> None:
    overview = Overview(
        counts={"pending": 12_000_000, "running": 3, "succeeded": 10_000},
        ends_at=datetime(2031, 1, 1, tzinfo=UTC),
        bucket_seconds=60.0,
        finished={},
        bounds={"pending": "about", "succeeded": "at_least"},
    )
    html = _pages.counts_section(_Links(), overview)  # type: ignore[arg-type]
    assert "about 12 M" in html
    assert "10,000+" in html
    assert "estimates" in html
    assert overview.to_json()["count_bounds"] == {"pending": "about", "succeeded": "at_least"}
    queue = QueueRecord(
        "big", False, None, None, None, pending=10_000, running=2, pending_capped=True
    )
    rows = _pages.queues_section(_Links(), [queue], actions=False)  # type: ignore[arg-type]
    assert "10,000+" in rows
    assert queue.to_json()["pending_capped"] is True


def test_estimates_round_as_people_say_them() -> None:
    assert _pages.bounded(10_400_000, "about") == "about 10.4 M"
    assert _pages.bounded(120_000, "about") == "about 120 k"
    assert _pages.bounded(10_000, "at_least") == "10,000+"
    assert _pages.bounded(42, None) == "42"


def test_the_queue_list_shows_per_key_limits() -> None:
    queue = QueueRecord(
        "imports",
        False,
        None,
        None,
        None,
        pending=3,
        running=1,
        max_running_per_key=1,
        rate_limit_per_key=10,
        rate_period_per_key=timedelta(seconds=1),
    )
    rows = _pages.queues_section(_Links(), [queue], actions=False)  # type: ignore[arg-type]
    assert "at most 1 running per key" in rows
    assert "10 starts per key per 1 s" in rows
    shown = queue.to_json()
    assert (shown["max_running_per_key"], shown["rate_period_per_key_seconds"]) == (1, 1.0)
