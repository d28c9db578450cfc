"""The admin shows the queue's own records: no copies, no converters, one JSON form each."""

from __future__ import annotations

import subprocess
import sys
from datetime import UTC, datetime, timedelta

import pytest

from steeple.admin import tasks as admin_tasks
from steeple.postgres.queue import TaskAttempt
from steeple.postgres.queue.admin import QueueInfo
from steeple.postgres.queue.jobs import JobInfo


def test_the_admin_names_are_the_queue_records() -> None:
    assert admin_tasks.AttemptRecord is TaskAttempt
    assert admin_tasks.QueueRecord is QueueInfo
    assert admin_tasks.JobRecord is JobInfo
    with pytest.raises(AttributeError, match="no attribute 'NoSuchRecord'"):
        _ = admin_tasks.NoSuchRecord


def test_reading_the_admin_port_does_not_import_the_queue() -> None:
    # The CLI imports the port on every command: the queue (and its drivers) only when used.
    code = "import sys, steeple.admin.tasks; print('steeple.postgres.queue' in sys.modules)"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert done.stdout.strip() == "False"


def test_a_job_and_a_queue_have_one_json_form() -> None:
    at = datetime(2026, 1, 2, 3, 4, tzinfo=UTC)
    job = JobInfo(
        "nightly", "report", "0 3 * * *", False, at, at, 0, 3, timedelta(minutes=5), at, at
    )
    assert job.to_json() == {
        "name": "nightly",
        "task_name": "report",
        "cron": "0 3 * * *",
        "timezone": "UTC",
        "queue": "default",
        "paused": False,
        "next_run_at": at.isoformat(),
        "priority": 0,
        "max_attempts": 3,
        "lease_duration_seconds": 300.0,
        "created_at": at.isoformat(),
        "updated_at": at.isoformat(),
    }
    queue = QueueInfo("mail", True, 4, 10, timedelta(minutes=1), pending=7, due_since=at)
    shown = queue.to_json()
    assert shown["rate_period_seconds"] == 60.0
    assert shown["rate_period_per_key_seconds"] is None
    assert (shown["pending"], shown["pending_capped"], shown["due_since"]) == (
        7,
        False,
        at.isoformat(),
    )
