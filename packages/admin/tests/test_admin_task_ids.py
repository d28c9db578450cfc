"""The admin app and the CLI read task ids and cursors by the core's one rule."""

from __future__ import annotations

from steeple.admin import tasks as admin_tasks
from steeple.core import tasks as core_tasks


def test_the_admin_task_id_rules_are_the_cores() -> None:
    assert admin_tasks.validate_task_id is core_tasks.check_task_id
    assert admin_tasks.parse_task_cursor is core_tasks.parse_task_cursor
    assert admin_tasks.MAX_TASK_ID == core_tasks.MAX_TASK_ID
