"""Operator functions of the work queue: tasks, jobs, and queues (pause, resume, limits).

Tasks are listed, counted, shown (result, progress, attempts) and retried, with the recent
throughput;
jobs listed; queues listed, paused, resumed and limited across all workers.

What dashboards and command lines need beyond the producer and worker API. Every function
takes the caller's connection (an asyncpg connection or pool, or a psycopg
``AsyncConnection``) and the queue's schema; listings page with an exclusive cursor and
return metadata only (never a task's args or lease token). Cancelling and pruning are
:func:`steeple.postgres.queue.cancel` and :func:`~steeple.postgres.queue.prune_terminal`.
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Final, Literal, cast

import attrs

from steeple.core.records import Page
from steeple.core.tasks import TERMINAL_TASK_STATES as _TERMINAL
from steeple.core.tasks import TaskEvent, TaskState, parse_task_cursor, transition
from steeple.postgres.queue import _driver
from steeple.postgres.queue._admin_sql import admin_sql
from steeple.postgres.queue._driver import errors_typed
from steeple.postgres.queue._ops import MAX_RETENTION, TaskRun, run_state
from steeple.postgres.queue._queues import (
    COUNT_CAP,
    QueueInfo,
    TaskLimits,
    check_limits,
    limit_queue,
    limit_task,
    list_queues,
    list_task_limits,
    pause_queue,
    resume_queue,
)
from steeple.postgres.queue._schema import DEFAULT_SCHEMA, LIBRARY_SCHEMA_VERSION, entry_point
from steeple.postgres.queue._validate import (
    check_bool,
    check_int,
    check_name,
    check_queue,
    check_task_id,
    check_timedelta,
)
from steeple.postgres.queue.errors import (
    QueueConfigurationError,
    QueueTypeError,
    SchemaVersionMismatchError,
    TaskNotFoundError,
    TaskStateError,
)
from steeple.postgres.queue.jobs import JobInfo
from steeple.postgres.queue.tasks import Task, declared_task
from steeple.postgres.sqlstate import is_not_installed, sqlstate

if TYPE_CHECKING:
    from steeple.postgres.queue._app import TaskFunction

__all__ = [
    "COUNT_CAP",
    "MAX_PAGE",
    "BoundedCount",
    "QueueInfo",
    "TaskLimits",
    "Throughput",
    "check_limits",
    "count_by_state",
    "count_by_state_bounded",
    "count_prunable",
    "limit_queue",
    "limit_task",
    "list_jobs",
    "list_queues",
    "list_task_limits",
    "list_tasks",
    "pause_queue",
    "resume_queue",
    "retry_failed_task",
    "server_time",
    "task_args",
    "task_detail",
    "throughput",
]

MAX_PAGE: Final = 1000
"""The most rows one listing call returns."""


# undefined_table, invalid_schema_name: the queue is not installed in that schema.
async def _fetch(conn: Any, schema: str, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    """Run one statement; a schema without the queue's tables is a typed error."""
    try:
        return await _driver.fetch(conn, sql, *args)
    except Exception as exc:
        if is_not_installed(sqlstate(exc)):
            raise SchemaVersionMismatchError(schema, 0, LIBRARY_SCHEMA_VERSION) from None
        raise


def _contained_json(value: Any) -> str:
    """Return ``value`` as JSON text for a containment search (bounded like a task's args)."""
    try:
        text = json.dumps(value, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError):
        raise QueueTypeError("args_contain must be a JSON value") from None
    if len(text) > 4096:
        raise QueueConfigurationError("args_contain is over 4096 characters of JSON")
    return text


def _task_cursor(after: object) -> int:
    return parse_task_cursor(after, error=QueueConfigurationError, type_error=QueueTypeError)


def _newest_cursor(after: object) -> int | None:
    return None if after is None else _task_cursor(after)


def _instant(value: object, what: str) -> datetime | None:
    if value is None:
        return None
    if not isinstance(value, datetime):
        raise QueueTypeError(f"{what} must be a datetime or None, not {type(value).__name__}")
    if value.utcoffset() is None:
        raise QueueConfigurationError(f"{what} must be timezone-aware (steeple works in UTC)")
    return value


def _state(value: object) -> str | None:
    if value is None:
        return None
    if isinstance(value, TaskState):
        return value.value
    states = [s.value for s in TaskState]
    if not isinstance(value, str):
        raise QueueTypeError(
            f"state must be a TaskState, a str or None, not {type(value).__name__}"
        )
    if value not in states:
        raise QueueConfigurationError(f"state must be one of {', '.join(states)}")
    return value


@entry_point
async def list_tasks(
    conn: Any,
    *,
    schema: str = DEFAULT_SCHEMA,
    state: TaskState | str | None = None,
    task_name: str | Task[Any] | TaskFunction[Any] | None = None,
    after: str | None = None,
    limit: int = 100,
    created_after: datetime | None = None,
    created_before: datetime | None = None,
    newest_first: bool = False,
    queue: str | None = None,
    args_contain: Any = None,
) -> Page[TaskRun]:
    """List tasks in id order, optionally of one state, task name, queue and creation range.

    Args:
        conn: an asyncpg connection or pool, or a psycopg ``AsyncConnection``.
        schema: the queue's PostgreSQL schema.
        state: only tasks in this state (a :class:`~steeple.core.tasks.TaskState` or its
            value, e.g. ``"failed"``).
        task_name: only tasks of this name (or of this :class:`Task`, or function
            declared with ``@app.task``).
        after: the ``next_cursor`` of the previous page (exclusive); ``None`` for the first.
        limit: the most tasks returned (1..1000).
        created_after: only tasks created at or after this instant (timezone-aware).
        created_before: only tasks created before this instant (timezone-aware).
        newest_first: descending ids (the newest task first); the cursor then pages down.
        queue: only tasks of this named queue.
        args_contain: only tasks whose args contain this JSON value (PostgreSQL's jsonb
            ``@>``: ``{"to": "ada@example.com"}`` matches args with that key and value).
            Args can hold secrets: callers decide who may search them.

    Returns:
        A page of tasks (metadata only); ``next_cursor`` is ``None`` on the last page.

    Raises:
        SchemaVersionMismatchError: the queue is not installed in ``schema``.
        QueueConfigurationError: an unknown state, a malformed cursor or task name, a limit
            outside 1..1000, a naive instant, or an invalid schema name.
        QueueTypeError: an argument of the wrong type.
    """
    sql = admin_sql(schema)
    check_bool(newest_first, "newest_first")
    position = _newest_cursor(after) if newest_first else _task_cursor(after)
    wanted = _state(state)
    if task_name is not None and not isinstance(task_name, str):
        task_name = declared_task(task_name)[0].name
    if task_name is not None:
        check_name(task_name, "task_name")
    check_int(limit, "limit", 1, MAX_PAGE)
    since = _instant(created_after, "created_after")
    until = _instant(created_before, "created_before")
    statement = sql.list_tasks_newest if newest_first else sql.list_tasks
    if wanted == TaskState.PENDING.value:
        # An index walk that stops after the page, however long the backlog.
        statement = sql.list_pending
    if queue is not None:
        check_queue(queue)
    contained = None if args_contain is None else _contained_json(args_contain)
    rows = await _fetch(
        conn,
        schema,
        statement,
        position,
        wanted,
        task_name,
        limit + 1,
        since,
        until,
        queue,
        contained,
        *((newest_first,) if statement is sql.list_pending else ()),
    )
    items = [TaskRun.from_row(tuple(row)) for row in rows[:limit]]
    cursor = str(items[-1].id) if len(rows) > limit else None
    return Page(items=items, next_cursor=cursor)


@entry_point
async def task_detail(
    conn: Any, task_id: int, *, schema: str = DEFAULT_SCHEMA, history: int = 50
) -> TaskRun:
    """Return one task for an operator: state, progress, result and attempt history.

    :func:`~steeple.postgres.queue.run_state`, with a missing queue reported as such.
    Each failed attempt of ``history`` carries its exception type, message and traceback;
    the task's args and lease token are never read. ``TaskRun.to_json()`` renders it.

    Args:
        conn: an asyncpg connection or pool, or a psycopg ``AsyncConnection``.
        task_id: the task id.
        schema: the queue's PostgreSQL schema.
        history: how many of its latest attempts to return (0..1000).

    Raises:
        TaskNotFoundError: no such task (or it was pruned).
        SchemaVersionMismatchError: the queue is not installed in ``schema``.
        QueueConfigurationError: ``task_id`` outside 1..2**63-1, ``history`` outside 0..1000,
            or an invalid schema name.
        QueueTypeError: ``task_id`` or ``history`` is not an int.
    """
    try:
        return await run_state(conn, task_id, schema=schema, history=history)
    except Exception as exc:
        if is_not_installed(sqlstate(exc)):
            raise SchemaVersionMismatchError(schema, 0, LIBRARY_SCHEMA_VERSION) from None
        raise


@entry_point
async def count_by_state(conn: Any, *, schema: str = DEFAULT_SCHEMA) -> dict[TaskState, int]:
    """Return how many tasks are in each state (every state present, zeros included).

    Raises:
        SchemaVersionMismatchError: the queue is not installed in ``schema``.
        QueueConfigurationError: an invalid schema name.
        QueueTypeError: a schema that is not a str.
    """
    rows = await _fetch(conn, schema, admin_sql(schema).count_by_state)
    counts = dict.fromkeys(TaskState, 0)
    for state, count in rows:
        counts[TaskState(state)] = int(count)
    return counts


@attrs.frozen
class BoundedCount:
    """A count that a dashboard can afford on every refresh, and how far to trust it.

    Attributes:
        n: the number shown.
        bound: ``"exact"``; ``"at_least"`` (the count stopped at ``n``: say ``"10,000+"``);
            or ``"about"`` (``n`` is the planner's estimate from the table's statistics at
            its last ANALYZE: say ``"about 10 M"``).
    """

    n: int
    bound: Literal["exact", "at_least", "about"] = "exact"


@entry_point
async def count_by_state_bounded(
    conn: Any, *, schema: str = DEFAULT_SCHEMA
) -> dict[TaskState, BoundedCount]:
    """Count the tasks in each state, reading at most a few ten thousand index entries.

    What :func:`count_by_state` says exactly, for any table size: pending and running
    tasks are counted up to :data:`COUNT_CAP` each (the partial
    index of each state, walked in order), terminal ones up to that many in all (the most
    recently finished). A state past its cap reads ``"about"`` the estimate of the
    table's statistics when it has any (at least the count reached), else ``"at_least"``
    the count reached. A terminal state's exact count is known only while all terminal
    tasks number no more than the cap. Every state is present, zeros included.

    Raises:
        SchemaVersionMismatchError: the queue is not installed in ``schema``.
        QueueConfigurationError: an invalid schema name.
        QueueTypeError: a schema that is not a str.
    """
    sql = admin_sql(schema).count_by_state_bounded
    rows = await _fetch(conn, schema, sql, COUNT_CAP + 1, schema)
    counted: dict[str, int] = {}
    estimates: dict[str, int] = {}
    for key, n in rows:
        if key.startswith("about "):
            estimates[key.removeprefix("about ")] = int(n)
        else:
            counted[key] = int(n)
    terminal_total = sum(n for s, n in counted.items() if TaskState(s) in _TERMINAL)
    counts: dict[TaskState, BoundedCount] = {}
    for state in TaskState:
        n = counted.get(state.value, 0)
        reached = terminal_total > COUNT_CAP if state in _TERMINAL else n > COUNT_CAP
        if not reached:
            counts[state] = BoundedCount(n)
            continue
        n = min(n, COUNT_CAP)
        if state.value in estimates:
            counts[state] = BoundedCount(max(n, estimates[state.value]), "about")
        else:
            counts[state] = BoundedCount(n, "at_least")
    return counts


@entry_point
async def retry_failed_task(conn: Any, task_id: int, *, schema: str = DEFAULT_SCHEMA) -> TaskRun:
    """Send a failed task back to pending, to run again at once.

    The task keeps its id, ``run_id`` (the idempotency key its handler gives side effects),
    args, snapshot and attempt history. It runs at least once more: a task that used up its
    attempts gets one more (``max_attempts`` becomes ``attempts + 1``); a task that failed
    permanently with attempts left keeps those. Only failed tasks are retried: a succeeded
    or cancelled task is done for good, a pending or running one is already live.

    Args:
        conn: an asyncpg connection or pool, or a psycopg ``AsyncConnection``.
        task_id: the failed task's id.
        schema: the queue's PostgreSQL schema.

    Returns:
        The task as it is now (pending).

    Raises:
        TaskNotFoundError: no such task (or it was pruned).
        TaskStateError: the task is not failed, or a live task holds its dedup key.
        SchemaVersionMismatchError: the queue is not installed in ``schema``.
        QueueConfigurationError: ``task_id`` outside 1..2**63-1, or an invalid schema name.
        QueueTypeError: ``task_id`` is not an int.
    """
    sql = admin_sql(schema)
    rows = await _fetch(conn, schema, sql.retry, check_task_id(task_id))
    if not rows:
        raise TaskNotFoundError(task_id)
    before, changed, blocker = TaskState(rows[0][0]), int(rows[0][1]), rows[0][2]
    if not changed:
        if blocker is not None:
            raise TaskStateError(
                task_id,
                before.value,
                f"task {task_id} cannot be retried: task {blocker} of the same name holds its "
                "dedup key and is still pending or running",
            )
        raise TaskStateError(
            task_id,
            before.value,
            f"task {task_id} {_AS_FOUND.get(before.value, 'is ' + before.value)}; only failed "
            "tasks can be retried",
        )
    transition(before, TaskEvent.RETRY)  # the table's move (raises if the SQL made another)
    return await run_state(conn, task_id, schema=schema)


# How a refusal says the state it found, in words a person would use.
_AS_FOUND: Final = {
    "pending": "is still pending",
    "running": "is running",
    "succeeded": "already succeeded",
    "cancelled": "was cancelled",
}


@entry_point
async def count_prunable(conn: Any, older_than: timedelta, *, schema: str = DEFAULT_SCHEMA) -> int:
    """Count the tasks :func:`~steeple.postgres.queue.prune_terminal` would remove.

    Terminal tasks (succeeded, failed, cancelled) finished more than ``older_than`` ago, by
    the database server's clock; nothing is removed (a dry run).

    Raises:
        SchemaVersionMismatchError: the queue is not installed in ``schema``.
        QueueConfigurationError: ``older_than`` negative or over ~100 years, or an invalid
            schema name.
        QueueTypeError: ``older_than`` is not a timedelta.
    """
    sql = admin_sql(schema)
    check_timedelta(older_than, "older_than", timedelta(0), MAX_RETENTION)
    rows = await _fetch(conn, schema, sql.count_prunable, older_than)
    return int(rows[0][0])


@entry_point
async def list_jobs(
    conn: Any, *, schema: str = DEFAULT_SCHEMA, after: str | None = None, limit: int = 100
) -> Page[JobInfo]:
    """List recurring jobs by name (their args are not shown).

    Args:
        conn: an asyncpg connection or pool, or a psycopg ``AsyncConnection``.
        schema: the queue's PostgreSQL schema.
        after: the ``next_cursor`` of the previous page (a job name, exclusive).
        limit: the most jobs returned (1..1000).

    Raises:
        SchemaVersionMismatchError: the queue is not installed in ``schema``.
        QueueConfigurationError: a malformed cursor, a limit outside 1..1000, or an invalid
            schema name.
        QueueTypeError: an argument of the wrong type.
    """
    sql = admin_sql(schema)
    if after is not None:
        check_name(after, "after")
    check_int(limit, "limit", 1, MAX_PAGE)
    rows = await _fetch(conn, schema, sql.list_jobs, after or "", limit + 1)
    items = [JobInfo.from_row(tuple(row)) for row in rows[:limit]]
    cursor = items[-1].name if len(rows) > limit else None
    return Page(items=items, next_cursor=cursor)


@errors_typed
async def server_time(conn: Any) -> datetime:
    """Return the database server's clock: the one that judges when tasks are due.

    Read it to place work relative to the server (``EnqueueOptions.at(...)``, a job's
    ``clock``) rather than this host, whose clock may disagree by any amount.

    Args:
        conn: an asyncpg connection or pool, or a psycopg ``AsyncConnection``.
    """
    ((now,),) = await _driver.fetch(conn, "SELECT clock_timestamp()")
    return cast(datetime, now)


@entry_point
async def task_args(conn: Any, task_id: int, *, schema: str = DEFAULT_SCHEMA) -> str:
    """Return a task's args as stored: the JSON text its producer encoded.

    Args can hold secrets: listings never return them; show them only to who may see them.

    Raises:
        TaskNotFoundError: no such task (or it was pruned).
        SchemaVersionMismatchError: the queue is not installed in ``schema``.
        QueueConfigurationError: ``task_id`` outside 1..2**63-1, or an invalid schema name.
        QueueTypeError: ``task_id`` is not an int.
    """
    sql = admin_sql(schema)
    rows = await _fetch(conn, schema, sql.task_args, check_task_id(task_id))
    if not rows:
        raise TaskNotFoundError(task_id)
    return str(rows[0][0])


@attrs.frozen
class Throughput:
    """Tasks finished per time bucket over a recent window, by terminal state.

    Attributes:
        ends_at: the end of the window: the database server's clock when it was read.
        bucket: the width of one bucket.
        finished: per terminal state, the count of each bucket, oldest bucket first (the
            last bucket ends at ``ends_at``).
        by_queue: per named queue that finished any task in the window, the count per
            terminal state over the whole window.
    """

    ends_at: datetime
    bucket: timedelta
    finished: dict[TaskState, tuple[int, ...]]
    by_queue: dict[str, dict[TaskState, int]] = attrs.field(factory=dict)


@entry_point
async def throughput(
    conn: Any,
    *,
    schema: str = DEFAULT_SCHEMA,
    window: timedelta = timedelta(hours=1),
    buckets: int = 60,
) -> Throughput:
    """Count the tasks that finished in each of ``buckets`` equal slices of the last ``window``.

    Judged on the database server's clock (the one that stamps ``finished_at``).

    Args:
        conn: an asyncpg connection or pool, or a psycopg ``AsyncConnection``.
        schema: the queue's PostgreSQL schema.
        window: how far back to look (1 second to 31 days).
        buckets: how many slices (1..1000).

    Raises:
        SchemaVersionMismatchError: the queue is not installed in ``schema``.
        QueueConfigurationError: a window or bucket count out of range, or an invalid
            schema name.
        QueueTypeError: an argument of the wrong type.
    """
    sql = admin_sql(schema)
    check_timedelta(window, "window", timedelta(seconds=1), timedelta(days=31))
    check_int(buckets, "buckets", 1, MAX_PAGE)
    width = window / buckets
    rows = await _fetch(conn, schema, sql.throughput, window, width)
    ends_at = rows[0][0]
    finished = {s: [0] * buckets for s in TaskState if s in _TERMINAL}
    by_queue: dict[str, dict[TaskState, int]] = {}
    for _, state, ago, count, queue in rows:
        if state is None:
            continue  # the row that carries the clock
        index = buckets - 1 - min(max(int(ago), 0), buckets - 1)
        finished[TaskState(state)][index] += int(count)
        per_state = by_queue.setdefault(str(queue), dict.fromkeys(finished, 0))
        per_state[TaskState(state)] += int(count)
    return Throughput(
        ends_at,
        width,
        {s: tuple(c) for s, c in finished.items()},
        dict(sorted(by_queue.items())),
    )
