"""Producing work on the caller's own connection, inside the caller's transaction."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final, TypeVar

import attrs

from steeple.postgres.queue import _driver, _metrics, _tracing
from steeple.postgres.queue._local import LocalQueue, local_queue
from steeple.postgres.queue._schema import DEFAULT_SCHEMA, entry_point, entry_point_sync
from steeple.postgres.queue._sql import QueueSql, queue_sql
from steeple.postgres.queue._validate import check_queue
from steeple.postgres.queue.errors import QueueConfigurationError, QueueError, QueueTypeError
from steeple.postgres.queue.tasks import (
    EnqueuedTask,
    EnqueueOptions,
    Task,
    declared_task,
    with_declared_queue,
)

if TYPE_CHECKING:
    from steeple.postgres.queue._app import TaskFunction

__all__ = ["MAX_ENQUEUE_MANY", "enqueue", "enqueue_many", "enqueue_many_sync", "enqueue_sync"]

A = TypeVar("A")
_DEFAULT_OPTIONS: Final = EnqueueOptions()
MAX_ENQUEUE_MANY: Final = 10_000
"""The most tasks one ``enqueue_many`` statement inserts."""
# A duplicate can finish between our insert and our lookup; a few rounds settle it.
_DEDUP_ROUNDS: Final = 5
# A version-4 UUID: byte 6 starts with the version (0100), byte 8 with the variant (10).
_UUID_VERSION_4: Final = bytes((b & 0x0F) | 0x40 for b in range(256))
_UUID_VARIANT: Final = bytes((b & 0x3F) | 0x80 for b in range(256))


def random_run_ids(count: int) -> bytes:
    """Return ``count`` random version-4 UUIDs, 16 bytes each, back to back.

    The run ids of a batch (``enqueue_many``'s last parameter): what ``gen_random_uuid()``
    makes, from the operating system's CSPRNG, in one read for the whole batch.
    """
    ids = bytearray(os.urandom(16 * count))
    ids[6::16] = ids[6::16].translate(_UUID_VERSION_4)
    ids[8::16] = ids[8::16].translate(_UUID_VARIANT)
    return bytes(ids)


def _checked(
    task: object, options: object, queue: object = None
) -> tuple[Task[Any], EnqueueOptions]:
    """Check the task, options and queue a caller passed; return the task and options to use.

    ``queue`` (when given) names the queue instead of ``options.queue``; otherwise a task
    declared with ``@app.task(queue=...)`` goes to its queue unless ``options`` name another.
    """
    checked, declared = declared_task(task)
    if options is None:
        options = _DEFAULT_OPTIONS
    elif not isinstance(options, EnqueueOptions):
        raise QueueTypeError(
            f"options must be EnqueueOptions or None, not {type(options).__name__}"
        )
    if queue is None:
        return checked, with_declared_queue(options, declared)
    return checked, attrs.evolve(options, queue=check_queue(queue))


def _params(
    sql: QueueSql, task: Task[Any], args_text: str, options: EnqueueOptions, trace: str | None
) -> list[Any]:
    priority, max_attempts, lease, b_init, b_max, b_factor, b_jitter = options.snapshot(task)
    return [
        task.name, args_text, priority, options.run_at, max_attempts, lease,
        b_init, b_max, b_factor, b_jitter, options.dedup_key, sql.channel, options.delay, trace,
        options.queue, options.limit_key,
    ]  # fmt: skip


def _sending(
    task: Task[Any], options: EnqueueOptions, count: int
) -> contextlib.AbstractContextManager[_tracing.Sending]:
    """Open the enqueue's producer span (a no-op unless tracing is active): see ``_tracing``."""
    return _tracing.sending(task.name, count, options.queue)


@entry_point
async def enqueue(
    conn: Any,
    task: Task[A] | TaskFunction[A],
    args: A,
    options: EnqueueOptions | None = None,
    *,
    schema: str = DEFAULT_SCHEMA,
    queue: str | None = None,
    after: Sequence[Any] | None = None,
    on_parent_failure: Any = "cancel",
) -> EnqueuedTask:
    """Create one task on ``conn`` (asyncpg or psycopg async), in the caller's transaction.

    The task commits or rolls back with the caller's transaction; workers are woken by a
    NOTIFY sent on commit. With a ``dedup_key`` and a live (pending or running) task of the
    same name and key, nothing is inserted and that task is returned.

    Args:
        conn: an asyncpg connection or pool, or a psycopg ``AsyncConnection``.
        task: the task definition, or a function declared with ``@app.task`` (its
            declared queue applies unless ``queue`` or ``options.queue`` name another).
        args: arguments of the task's args type.
        options: when and how it runs (default: now, priority 0, 60 s lease, 5 attempts).
        schema: the queue's PostgreSQL schema.
        queue: the named queue (1-200 chars); given, it replaces ``options.queue``
            (default ``"default"``).
        after: tasks (``EnqueuedTask`` or ids) it waits for: it stays ``waiting``, and
            no worker claims it, until every one of them succeeded (see the Workflows
            page). No ``dedup_key`` then.
        on_parent_failure: with ``after``: ``"cancel"`` (default) cancels it when one of
            them fails for good or is cancelled; ``"run"`` runs it once they all ended.

    Returns:
        The task's id, and whether an existing duplicate was returned.

    Raises:
        ArgsEncodingError: ``args`` cannot be encoded.
        UnsupportedConnectionError: ``conn`` is not an async asyncpg/psycopg connection.
        QueueConfigurationError: invalid schema or queue name.
        QueueTypeError: ``task`` is not a Task (or ``@app.task`` function), ``options`` not
            EnqueueOptions, or
            ``queue`` not a str.
        QueueError: the duplicate kept changing under us (pathological churn).
        UnfitDatabaseError: the server refused the write (a read-only standby or session,
            a full disk); nothing was stored.
        TaskNotFoundError: a task in ``after`` does not exist; nothing was stored.
    """
    sql = queue_sql(schema)
    if after is not None:
        from steeple.postgres.queue import _workflows

        graph = _workflows.single(task, args, options, queue, after, on_parent_failure)
        handle = await _workflows.enqueue_workflow(conn, graph, schema=schema)
        return EnqueuedTask(handle.ids[0])
    task, options = _checked(task, options, queue)
    local = local_queue(conn, schema)
    if local is None:
        _driver.connection_kind(conn)
    args_text = task.encode(args)
    if local is not None:
        return local.store(task, args_text, options)
    with _sending(task, options, 1) as sending:
        params = _params(sql, task, args_text, options, sending.carrier)
        for _ in range(_DEDUP_ROUNDS):
            rows = await _driver.fetch(conn, sql.enqueue, *params)
            if rows:
                _metrics.instruments().enqueued.add(
                    1, _metrics.task_attributes(task.name, options.queue)
                )
                return _enqueued(sending, int(rows[0][0]), deduplicated=False)
            found = await _driver.fetch(conn, sql.find_duplicate, task.name, options.dedup_key)
            if found:
                return _enqueued(sending, int(found[0][0]), deduplicated=True)
        raise QueueError(f"could not enqueue or find a live duplicate of {task.name!r}")


@entry_point_sync
def enqueue_sync(
    conn: Any,
    task: Task[A] | TaskFunction[A],
    args: A,
    options: EnqueueOptions | None = None,
    *,
    schema: str = DEFAULT_SCHEMA,
    queue: str | None = None,
    after: Sequence[Any] | None = None,
    on_parent_failure: Any = "cancel",
) -> EnqueuedTask:
    """Like :func:`enqueue`, for a psycopg (sync) ``Connection``.

    Raises:
        ArgsEncodingError: ``args`` cannot be encoded.
        UnsupportedConnectionError: ``conn`` is not a psycopg sync connection.
        QueueConfigurationError: invalid schema or queue name.
        QueueTypeError: ``task`` is not a Task (or ``@app.task`` function), ``options`` not
            EnqueueOptions, or
            ``queue`` not a str.
        QueueError: the duplicate kept changing under us (pathological churn).
        UnfitDatabaseError: the server refused the write (a read-only standby or session,
            a full disk); nothing was stored.
        TaskNotFoundError: a task in ``after`` does not exist; nothing was stored.
    """
    sql = queue_sql(schema)
    if after is not None:
        from steeple.postgres.queue import _workflows

        graph = _workflows.single(task, args, options, queue, after, on_parent_failure)
        handle = _workflows.enqueue_workflow_sync(conn, graph, schema=schema)
        return EnqueuedTask(handle.ids[0])
    task, options = _checked(task, options, queue)
    local = local_queue(conn, schema)
    if local is None:
        _driver.connection_kind(conn)
    args_text = task.encode(args)
    if local is not None:
        return local.store(task, args_text, options)
    with _sending(task, options, 1) as sending:
        params = _params(sql, task, args_text, options, sending.carrier)
        for _ in range(_DEDUP_ROUNDS):
            rows = _driver.fetch_sync(conn, sql.enqueue, *params)
            if rows:
                _metrics.instruments().enqueued.add(
                    1, _metrics.task_attributes(task.name, options.queue)
                )
                return _enqueued(sending, int(rows[0][0]), deduplicated=False)
            found = _driver.fetch_sync(conn, sql.find_duplicate, task.name, options.dedup_key)
            if found:
                return _enqueued(sending, int(found[0][0]), deduplicated=True)
        raise QueueError(f"could not enqueue or find a live duplicate of {task.name!r}")


def _enqueued(sending: _tracing.Sending, task_id: int, *, deduplicated: bool) -> EnqueuedTask:
    sending.enqueued(task_id, deduplicated=deduplicated)
    return EnqueuedTask(task_id, deduplicated=deduplicated)


def _many_params(
    task: Task[A] | TaskFunction[A],
    args_list: Sequence[A],
    options: EnqueueOptions | None,
    sql: QueueSql,
    queue: str | None,
    local: bool,
) -> tuple[list[Any], Task[A], EnqueueOptions]:
    """Check and encode a batch; the parameters lack the trace context (appended last).

    The args go as one JSON array text to the database, as a list of texts to a local
    queue (``local``).
    """
    task, options = _checked(task, options, queue)
    if not isinstance(args_list, Sequence) or isinstance(args_list, str | bytes | bytearray):
        raise QueueTypeError(
            f"args_list must be a sequence (list or tuple) of args, not {type(args_list).__name__}"
        )
    if options.dedup_key is not None:
        raise QueueConfigurationError("enqueue_many does not take a dedup_key; use enqueue")
    if len(args_list) > MAX_ENQUEUE_MANY:
        raise QueueConfigurationError(
            f"enqueue_many takes at most {MAX_ENQUEUE_MANY} tasks per call; got {len(args_list)}"
        )
    params = _params(sql, task, "", options, None)
    params[1] = [task.encode(a) for a in args_list] if local else task.encode_all(args_list)
    del params[10]  # no dedup key: the channel becomes $11, the delay $12
    del params[12]  # the trace context ($15) is the producer span's, added by the caller
    return params, task, options  # ... after the queue ($13) and the limit key ($14),
    # and so are the run ids ($16, random_run_ids)


@entry_point
async def enqueue_many(
    conn: Any,
    task: Task[A] | TaskFunction[A],
    args_list: Sequence[A],
    options: EnqueueOptions | None = None,
    *,
    schema: str = DEFAULT_SCHEMA,
    queue: str | None = None,
) -> list[int]:
    """Create many tasks of one kind with one statement, in the caller's transaction.

    Args:
        conn: an asyncpg connection or pool, or a psycopg ``AsyncConnection``.
        task: the task definition.
        args_list: the arguments, one task each (at most 10,000 per call).
        options: shared options (no ``dedup_key``).
        schema: the queue's PostgreSQL schema.
        queue: the named queue of every task (replaces ``options.queue`` when given).

    Returns:
        The new task ids, in the order of ``args_list``.

    Raises:
        ArgsEncodingError: any args cannot be encoded (nothing is inserted).
        QueueConfigurationError: a dedup key, too many tasks, or an invalid schema or queue
            name.
        QueueTypeError: not a Task, EnqueueOptions or a sequence of args.
        UnsupportedConnectionError: ``conn`` is not an async asyncpg/psycopg connection.
        UnfitDatabaseError: the server refused the write (a read-only standby or session,
            a full disk); nothing was stored.
    """
    sql = queue_sql(schema)
    params, task, checked = _many_params(
        task, args_list, options, sql, queue, isinstance(conn, LocalQueue)
    )
    local = local_queue(conn, schema)
    if local is not None:
        return local.store_many(task, params[1], checked)
    if not args_list:
        return []
    with _sending(task, checked, len(args_list)) as sending:
        rows = await _driver.fetch(
            conn, sql.enqueue_many, *params, sending.carrier, random_run_ids(len(args_list))
        )
    _metrics.instruments().enqueued.add(
        len(args_list), _metrics.task_attributes(task.name, checked.queue)
    )
    return [int(i) for i in rows[0][0]]


@entry_point_sync
def enqueue_many_sync(
    conn: Any,
    task: Task[A] | TaskFunction[A],
    args_list: Sequence[A],
    options: EnqueueOptions | None = None,
    *,
    schema: str = DEFAULT_SCHEMA,
    queue: str | None = None,
) -> list[int]:
    """Like :func:`enqueue_many`, for a psycopg (sync) ``Connection``.

    Raises:
        ArgsEncodingError: any args cannot be encoded (nothing is inserted).
        QueueConfigurationError: a dedup key, too many tasks, or an invalid schema or queue
            name.
        QueueTypeError: not a Task, EnqueueOptions or a sequence of args.
        UnsupportedConnectionError: ``conn`` is not a psycopg sync connection.
        UnfitDatabaseError: the server refused the write (a read-only standby or session,
            a full disk); nothing was stored.
    """
    sql = queue_sql(schema)
    params, task, checked = _many_params(
        task, args_list, options, sql, queue, isinstance(conn, LocalQueue)
    )
    local = local_queue(conn, schema)
    if local is not None:
        return local.store_many(task, params[1], checked)
    if not args_list:
        return []
    with _sending(task, checked, len(args_list)) as sending:
        rows = _driver.fetch_sync(
            conn, sql.enqueue_many, *params, sending.carrier, random_run_ids(len(args_list))
        )
    _metrics.instruments().enqueued.add(
        len(args_list), _metrics.task_attributes(task.name, checked.queue)
    )
    return [int(i) for i in rows[0][0]]
