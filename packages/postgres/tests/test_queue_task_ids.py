"""Every queue entry point reads a task id by core's one rule: an int of 1 .. 2**63 - 1.

A bool, float or str is a :class:`QueueTypeError`; 0, a negative id and anything beyond a
bigint a :class:`QueueConfigurationError` (never a ``TaskNotFoundError`` from a query that
ran, nor a driver's overflow), the same on PostgreSQL as in the in-memory queue.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from steeple.core.tasks import MAX_TASK_ID
from steeple.postgres.queue import (
    App,
    QueueConfigurationError,
    QueueTypeError,
    Task,
    Workflow,
    cancel,
    run_state,
    workflow_state,
)
from steeple.postgres.queue.admin import (
    list_tasks,
    retry_failed_task,
    task_args,
    task_detail,
)
from steeple.postgres.queue.testing import InMemoryQueue

WRONG_TYPES = [True, False, 1.0, "1", None]
OUT_OF_RANGE = [0, -1, -(2**63), 2**63, 2**64, 10**5000]


def repr_id(value: object) -> str:
    """A test id that ``str`` of a 5000-digit int cannot break."""
    return f"int-{value.bit_length()}-bits" if type(value) is int else repr(value)


Lookup = Callable[[Any, Any, str], Awaitable[object]]
LOOKUPS: dict[str, Lookup] = {
    "run_state": lambda conn, task_id, schema: run_state(conn, task_id, schema=schema),
    "cancel": lambda conn, task_id, schema: cancel(conn, task_id, schema=schema),
    "task_detail": lambda conn, task_id, schema: task_detail(conn, task_id, schema=schema),
    "task_args": lambda conn, task_id, schema: task_args(conn, task_id, schema=schema),
    "retry_failed_task": lambda conn, task_id, schema: retry_failed_task(
        conn, task_id, schema=schema
    ),
    "workflow_state": lambda conn, task_id, schema: workflow_state(conn, task_id, schema=schema),
}


@pytest.mark.postgres
@pytest.mark.parametrize("lookup", sorted(LOOKUPS))
async def test_postgres_refuses_every_hostile_task_id_typed(queue: Any, lookup: str) -> None:
    _dsn, schema, conn = queue
    for value in WRONG_TYPES:
        with pytest.raises(QueueTypeError, match="from 1 to"):
            await LOOKUPS[lookup](conn, value, schema)
    for value in OUT_OF_RANGE:
        with pytest.raises(QueueConfigurationError, match="from 1 to") as caught:
            await LOOKUPS[lookup](conn, value, schema)
        assert not isinstance(caught.value, QueueTypeError)


@pytest.mark.parametrize("value", WRONG_TYPES + OUT_OF_RANGE, ids=repr_id)
async def test_the_in_memory_queue_refuses_them_alike(value: object) -> None:
    memory = InMemoryQueue(App())
    wrong_type = isinstance(value, bool) or not isinstance(value, int)
    expected = QueueTypeError if wrong_type else QueueConfigurationError
    with pytest.raises(expected, match="from 1 to"):
        await run_state(memory, value)  # type: ignore[arg-type]
    with pytest.raises(expected, match="from 1 to"):
        await cancel(memory, value)  # type: ignore[arg-type]
    with pytest.raises(expected, match="from 1 to"):
        memory.run_state(value)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", OUT_OF_RANGE, ids=repr_id)
def test_a_workflow_parent_is_a_task_id_too(value: int) -> None:
    with pytest.raises(QueueConfigurationError, match="a task id in after is a whole number"):
        Workflow().add(Task("child"), {}, after=[value])


@pytest.mark.parametrize(
    "after", [str(MAX_TASK_ID + 1), "1" * 20, "-1", "+1", " 1", "\uff11", "1\x00"]
)
async def test_a_listing_cursor_is_read_by_the_same_rule(after: str) -> None:
    with pytest.raises(QueueConfigurationError, match="cursor of a task listing") as caught:
        await list_tasks(object(), after=after)
    assert not isinstance(caught.value, QueueTypeError)
    with pytest.raises(QueueTypeError, match="cursor of a task listing"):
        await list_tasks(object(), after=1)  # type: ignore[arg-type]
