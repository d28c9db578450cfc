"""steeple.postgres.queue.admin: listings, counts, retries and dry runs for operators."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta
from typing import Any

import asyncpg
import pytest

from steeple.core.tasks import TaskEvent, TaskState, transition
from steeple.postgres import queue as pq
from steeple.postgres._arrays import array_literal
from steeple.postgres.queue import EnqueueOptions, Task, admin, enqueue
from steeple.postgres.queue._sql import queue_sql

pytestmark = pytest.mark.postgres

SECRET = "secret-args-" + uuid.uuid4().hex


async def _enqueue(conn: asyncpg.Connection, schema: str, name: str, **options: Any) -> int:
    task: Task[Any] = Task(name)
    opts = EnqueueOptions(**options)
    return (await enqueue(conn, task, {"secret": SECRET}, opts, schema=schema)).id


async def _claim(conn: asyncpg.Connection, schema: str, name: str) -> tuple[int, Any]:
    sql = queue_sql(schema)
    give_up = await conn.fetchval(
        "SELECT extract(epoch FROM clock_timestamp())::double precision + 60"
    )
    (row,) = await conn.fetch(sql.claim, [name], 1, "w", give_up)
    return int(row["id"]), row["lease_token"]


async def _fail(conn: asyncpg.Connection, schema: str, name: str, **options: Any) -> int:
    """Enqueue a task named ``name`` and fail it for good (a permanent handler failure)."""
    task_id = await _enqueue(conn, schema, name, **options)
    claimed, token = await _claim(conn, schema, name)
    assert claimed == task_id
    assert await conn.fetch(queue_sql(schema).fail, task_id, token, "boom", "w", None, None, None)
    return task_id


async def test_list_tasks_pages_filters_and_shows_no_args(queue: Any) -> None:
    _, schema, conn = queue
    ids = [await _enqueue(conn, schema, "a") for _ in range(5)]
    ids += [await _enqueue(conn, schema, "b") for _ in range(2)]
    failed = await _fail(conn, schema, "c")

    first = await admin.list_tasks(conn, schema=schema, limit=3)
    assert [t.id for t in first.items] == ids[:3]
    assert first.next_cursor == str(ids[2])
    rest = await admin.list_tasks(conn, schema=schema, after=first.next_cursor, limit=100)
    assert [t.id for t in rest.items] == [*ids[3:], failed]
    assert rest.next_cursor is None

    only_b = await admin.list_tasks(conn, schema=schema, task_name="b")
    assert [t.id for t in only_b.items] == ids[5:]
    only_failed = await admin.list_tasks(conn, schema=schema, state=TaskState.FAILED)
    assert [(t.id, t.state, t.last_error) for t in only_failed.items] == [
        (failed, TaskState.FAILED, "boom")
    ]
    by_value = await admin.list_tasks(conn, schema=schema, state="pending", task_name="a")
    assert [t.id for t in by_value.items] == ids[:5]
    assert (await admin.list_tasks(conn, schema=schema, task_name="nobody")).items == []
    # metadata only: the args never leave the database through a listing
    assert SECRET not in repr(first) + repr(rest)
    assert not any(hasattr(t, "args") or hasattr(t, "lease_token") for t in rest.items)


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"state": "bogus"}, pq.QueueConfigurationError),
        ({"state": 3}, pq.QueueTypeError),
        ({"after": "x"}, pq.QueueConfigurationError),
        ({"after": "9" * 30}, pq.QueueConfigurationError),
        ({"after": 5}, pq.QueueTypeError),
        ({"limit": 0}, pq.QueueConfigurationError),
        ({"limit": 1001}, pq.QueueConfigurationError),
        ({"limit": True}, pq.QueueTypeError),
        ({"task_name": "a\x00b"}, pq.QueueConfigurationError),
        ({"task_name": "x" * 10_000}, pq.QueueConfigurationError),
        ({"schema": "Bad Schema"}, pq.QueueConfigurationError),
    ],
)
async def test_list_tasks_refuses_hostile_arguments(
    queue: Any, kwargs: dict[str, Any], error: type[Exception]
) -> None:
    _, schema, conn = queue
    with pytest.raises(error):
        await admin.list_tasks(conn, **{"schema": schema, **kwargs})


async def test_count_by_state_names_every_state(queue: Any) -> None:
    _, schema, conn = queue
    assert await admin.count_by_state(conn, schema=schema) == dict.fromkeys(TaskState, 0)
    for _ in range(3):
        await _enqueue(conn, schema, "a")
    await _fail(conn, schema, "f")
    pending = await _enqueue(conn, schema, "x")
    await queue_module_cancel(conn, schema, pending)
    counts = await admin.count_by_state(conn, schema=schema)
    assert counts == {
        TaskState.WAITING: 0,
        TaskState.PENDING: 3,
        TaskState.RUNNING: 0,
        TaskState.SUCCEEDED: 0,
        TaskState.FAILED: 1,
        TaskState.CANCELLED: 1,
    }


async def queue_module_cancel(conn: asyncpg.Connection, schema: str, task_id: int) -> None:
    assert await pq.cancel(conn, task_id, schema=schema) is TaskState.CANCELLED


async def test_retry_sends_a_failed_task_back_to_pending_for_another_attempt(queue: Any) -> None:
    _, schema, conn = queue
    exhausted = await _fail(conn, schema, "r", max_attempts=1)
    before = await pq.run_state(conn, exhausted, schema=schema)
    assert (before.state, before.attempts, before.max_attempts) == (TaskState.FAILED, 1, 1)

    after = await admin.retry_failed_task(conn, exhausted, schema=schema)
    assert after.state is transition(TaskState.FAILED, TaskEvent.RETRY) is TaskState.PENDING
    assert (after.attempts, after.max_attempts) == (1, 2)  # one more attempt granted
    assert after.run_id == before.run_id  # the idempotency key of side effects stays
    assert after.finished_at is None
    assert after.run_at == after.created_at  # due now on any clock, like immediate work
    assert after.last_error == "boom"  # history stays

    # a worker takes it again: attempt 2 of 2
    claimed, token = await _claim(conn, schema, "r")
    assert claimed == exhausted
    assert await conn.fetch(
        queue_sql(schema).complete,
        array_literal([claimed]),
        array_literal([token]),
        "w",
        [None],
        [None],
    )
    done = await pq.run_state(conn, exhausted, schema=schema)
    assert (done.state, done.attempts) == (TaskState.SUCCEEDED, 2)
    outcomes = await conn.fetch(
        f'SELECT attempt, outcome FROM "{schema}".attempts WHERE task_id = $1 ORDER BY id',
        exhausted,
    )
    assert [(r["attempt"], r["outcome"]) for r in outcomes] == [(1, "failed"), (2, "succeeded")]


async def test_retry_keeps_the_attempts_a_permanent_failure_left(queue: Any) -> None:
    _, schema, conn = queue
    task_id = await _fail(conn, schema, "p", max_attempts=5)
    after = await admin.retry_failed_task(conn, task_id, schema=schema)
    assert (after.state, after.attempts, after.max_attempts) == (TaskState.PENDING, 1, 5)


async def test_retry_refuses_tasks_that_are_not_failed_and_changes_nothing(queue: Any) -> None:
    _, schema, conn = queue
    pending = await _enqueue(conn, schema, "s")
    running = await _enqueue(conn, schema, "run")
    await _claim(conn, schema, "run")
    cancelled = await _enqueue(conn, schema, "c")
    await queue_module_cancel(conn, schema, cancelled)
    succeeded = await _enqueue(conn, schema, "ok")
    claimed, token = await _claim(conn, schema, "ok")
    await conn.fetch(
        queue_sql(schema).complete,
        array_literal([claimed]),
        array_literal([token]),
        "w",
        [None],
        [None],
    )
    for task_id, state in (
        (pending, TaskState.PENDING),
        (running, TaskState.RUNNING),
        (cancelled, TaskState.CANCELLED),
        (succeeded, TaskState.SUCCEEDED),
    ):
        before = await pq.run_state(conn, task_id, schema=schema)
        with pytest.raises(pq.TaskStateError) as refused:
            await admin.retry_failed_task(conn, task_id, schema=schema)
        assert refused.value.state == state.value
        # The state in words a person would use: never "is succeeded".
        said = {
            TaskState.PENDING: "is still pending",
            TaskState.RUNNING: "is running",
            TaskState.CANCELLED: "was cancelled",
            TaskState.SUCCEEDED: "already succeeded",
        }
        assert f"task {task_id} {said[state]};" in str(refused.value)
        assert await pq.run_state(conn, task_id, schema=schema) == before
    with pytest.raises(pq.TaskNotFoundError):
        await admin.retry_failed_task(conn, 987_654_321, schema=schema)
    for bad in (True, "1", 1.0):
        with pytest.raises(pq.QueueTypeError):
            await admin.retry_failed_task(conn, bad, schema=schema)  # type: ignore[arg-type]
    with pytest.raises(pq.QueueConfigurationError):
        await admin.retry_failed_task(conn, 2**64, schema=schema)


async def test_retry_refuses_while_a_live_task_holds_the_dedup_key(queue: Any) -> None:
    _, schema, conn = queue
    failed = await _fail(conn, schema, "d", dedup_key="invoice-7")
    live = await _enqueue(conn, schema, "d", dedup_key="invoice-7")
    with pytest.raises(pq.TaskStateError) as refused:
        await admin.retry_failed_task(conn, failed, schema=schema)
    assert f"task {live}" in str(refused.value)
    assert (await pq.run_state(conn, failed, schema=schema)).state is TaskState.FAILED
    await queue_module_cancel(conn, schema, live)
    retried = await admin.retry_failed_task(conn, failed, schema=schema)
    assert retried.state is TaskState.PENDING


async def test_retry_on_a_psycopg_connection(queue: Any) -> None:
    import psycopg

    dsn, schema, conn = queue
    task_id = await _fail(conn, schema, "pg")
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as pconn:
        retried = await admin.retry_failed_task(pconn, task_id, schema=schema)
        listed = await admin.list_tasks(pconn, schema=schema, state="pending")
        counts = await admin.count_by_state(pconn, schema=schema)
    assert retried.state is TaskState.PENDING
    assert [t.id for t in listed.items] == [task_id]
    assert counts[TaskState.PENDING] == 1


async def test_count_prunable_is_what_prune_removes(queue: Any) -> None:
    _, schema, conn = queue
    finished = [await _fail(conn, schema, "old") for _ in range(4)]
    await _enqueue(conn, schema, "live")
    # backdate three of them: finished two hours ago
    await conn.execute(
        f"UPDATE \"{schema}\".tasks SET finished_at = clock_timestamp() - interval '2 hours'"
        " WHERE id = ANY($1::bigint[])",
        finished[:3],
    )
    hour = timedelta(hours=1)
    assert await admin.count_prunable(conn, hour, schema=schema) == 3
    assert await admin.count_prunable(conn, timedelta(0), schema=schema) == 4
    assert await admin.count_prunable(conn, timedelta(days=1), schema=schema) == 0
    rows = await conn.fetchval(f'SELECT count(*) FROM "{schema}".tasks')
    assert rows == 5  # counting removed nothing
    assert await pq.prune_terminal(conn, hour, 100, schema=schema) == 3
    assert await admin.count_prunable(conn, hour, schema=schema) == 0
    with pytest.raises(pq.QueueConfigurationError):
        await admin.count_prunable(conn, timedelta(seconds=-1), schema=schema)
    with pytest.raises(pq.QueueTypeError):
        await admin.count_prunable(conn, 5, schema=schema)  # type: ignore[arg-type]


async def test_list_jobs_pages_by_name(queue: Any) -> None:
    _, schema, conn = queue
    task: Task[Any] = Task("report")
    for name in ("c-job", "a-job", "b-job"):
        await pq.jobs.create(conn, name, task, "*/5 * * * *", {"k": SECRET}, schema=schema)
    await pq.jobs.pause(conn, "b-job", schema=schema)
    first = await admin.list_jobs(conn, schema=schema, limit=2)
    assert [j.name for j in first.items] == ["a-job", "b-job"]
    assert first.items[1].paused
    assert first.next_cursor == "b-job"
    rest = await admin.list_jobs(conn, schema=schema, after=first.next_cursor)
    assert [j.name for j in rest.items] == ["c-job"]
    assert rest.next_cursor is None
    assert SECRET not in repr(first) + repr(rest)
    for bad in ({"limit": 0}, {"after": "a\x00"}, {"after": 3}):
        with pytest.raises(pq.QueueConfigurationError):
            await admin.list_jobs(conn, **{"schema": schema, **bad})


async def test_a_schema_without_the_queue_is_a_typed_error(pg_schema: tuple[str, str]) -> None:
    dsn, schema = pg_schema
    conn = await asyncpg.connect(dsn)
    try:
        calls: list[Callable[[], Awaitable[object]]] = [
            lambda: admin.list_tasks(conn, schema=schema),
            lambda: admin.count_by_state(conn, schema=schema),
            lambda: admin.retry_failed_task(conn, 1, schema=schema),
            lambda: admin.count_prunable(conn, timedelta(0), schema=schema),
            lambda: admin.list_jobs(conn, schema=schema),
            lambda: admin.list_tasks(conn, schema="no_such_schema_here"),
        ]
        for call in calls:
            with pytest.raises(pq.SchemaVersionMismatchError, match="version 0"):
                await call()
    finally:
        await conn.close()


async def test_server_time_is_the_servers_clock(queue: Any) -> None:
    _, _, conn = queue
    before = await conn.fetchval("SELECT clock_timestamp()")
    read = await admin.server_time(conn)
    after = await conn.fetchval("SELECT clock_timestamp()")
    assert before <= read <= after
    assert read.utcoffset() is not None


async def test_list_tasks_newest_first_and_by_creation_time(queue: Any) -> None:
    _, schema, conn = queue
    ids = [await _enqueue(conn, schema, "n") for _ in range(5)]
    first = await admin.list_tasks(conn, schema=schema, newest_first=True, limit=2)
    assert [t.id for t in first.items] == ids[:-3:-1]
    rest = await admin.list_tasks(
        conn, schema=schema, newest_first=True, after=first.next_cursor, limit=100
    )
    assert [t.id for t in rest.items] == ids[-3::-1]
    assert rest.next_cursor is None
    third = await pq.run_state(conn, ids[2], schema=schema)
    fourth = await pq.run_state(conn, ids[3], schema=schema)
    window = await admin.list_tasks(
        conn, schema=schema, created_after=third.created_at, created_before=fourth.created_at
    )
    assert [t.id for t in window.items] == [ids[2]]
    later = await admin.list_tasks(conn, schema=schema, created_after=fourth.created_at)
    assert [t.id for t in later.items] == ids[3:]
    task: Task[Any] = Task("n")
    mailed = await enqueue(conn, task, {}, EnqueueOptions(), schema=schema, queue="mail")
    only_mail = await admin.list_tasks(conn, schema=schema, queue="mail", newest_first=True)
    assert [(t.id, t.queue) for t in only_mail.items] == [(mailed.id, "mail")]
    assert len((await admin.list_tasks(conn, schema=schema, queue="default")).items) == 5


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"created_after": datetime(2026, 1, 1)}, pq.QueueConfigurationError),
        ({"created_before": "2026-01-01"}, pq.QueueTypeError),
        ({"newest_first": "yes"}, pq.QueueTypeError),
        ({"newest_first": True, "after": "-1"}, pq.QueueConfigurationError),
        ({"queue": ""}, pq.QueueConfigurationError),
        ({"queue": 5}, pq.QueueTypeError),
    ],
)
async def test_list_tasks_refuses_hostile_ranges(
    queue: Any, kwargs: dict[str, Any], error: type[Exception]
) -> None:
    _, schema, conn = queue
    with pytest.raises(error):
        await admin.list_tasks(conn, schema=schema, **kwargs)


async def test_args_and_throughput(queue: Any) -> None:
    _, schema, conn = queue
    failed = await _fail(conn, schema, "t")
    pending = await _enqueue(conn, schema, "t")
    assert await pq.cancel(conn, pending, schema=schema) is TaskState.CANCELLED
    assert SECRET in await admin.task_args(conn, failed, schema=schema)
    with pytest.raises(pq.TaskNotFoundError):
        await admin.task_args(conn, 2**62, schema=schema)
    seen = await admin.throughput(conn, schema=schema)
    assert seen.bucket == timedelta(minutes=1)
    assert seen.finished[TaskState.FAILED][-1] == 1
    assert seen.finished[TaskState.CANCELLED][-1] == 1
    assert sum(seen.finished[TaskState.SUCCEEDED]) == 0
    assert all(len(counts) == 60 for counts in seen.finished.values())
    # A task finished two hours ago is outside the window.
    await conn.execute(
        f"UPDATE \"{schema}\".tasks SET finished_at = finished_at - interval '2 hours'"
        " WHERE id = $1",
        failed,
    )
    later = await admin.throughput(conn, schema=schema, window=timedelta(minutes=10), buckets=5)
    assert later.bucket == timedelta(minutes=2)
    assert later.finished[TaskState.FAILED] == (0, 0, 0, 0, 0)
    assert later.ends_at >= seen.ends_at
    with pytest.raises(pq.QueueConfigurationError):
        await admin.throughput(conn, schema=schema, window=timedelta(0))
    with pytest.raises(pq.QueueConfigurationError):
        await admin.throughput(conn, schema=schema, buckets=0)
