"""Named queues' settings for all workers: pause and resume, global and rate limits.

Stored in the schema's ``settings`` table (one row per queue, or per task name across
queues), read by every claim (see migration 0006): a pause or limit applies to every claim
that starts after it commits, in every worker. A row without a pause or limit is deleted, so
queues without settings stay on the claim's fast path.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any, Final

import attrs

from steeple.postgres.queue import _driver
from steeple.postgres.queue._schema import (
    DEFAULT_SCHEMA,
    entry_point,
    notify_channel,
    validate_schema,
)
from steeple.postgres.queue._sql import DURABLE, PENDING, RUNNING
from steeple.postgres.queue._validate import check_int, check_name, check_queue, check_seconds
from steeple.postgres.queue.errors import QueueConfigurationError

__all__ = [
    "MAX_RATE_LIMIT",
    "MAX_RUNNING_LIMIT",
    "PER_KEY_ARGUMENTS",
    "UNSERVED_AFTER",
    "QueueInfo",
    "TaskLimits",
    "check_limits",
    "limit_queue",
    "limit_task",
    "list_queues",
    "list_task_limits",
    "pause_queue",
    "resume_queue",
]

MAX_RUNNING_LIMIT: Final = 1_000_000
"""The largest global concurrency limit."""
MAX_RATE_LIMIT: Final = 10_000
"""The most starts a rate limit allows per period (the claim keeps a log of them)."""
_MAX_PERIOD: Final = 86_400.0
_MAX_LISTED: Final = 1000
COUNT_CAP: Final = 10_000
"""The most tasks counted per queue and state: past it a queue's count reads "10,000+"
(``QueueInfo.pending_capped``), so that a backlog of millions costs a listing no more than
a backlog of ten thousand. Each count walks the partial index of its state."""
UNSERVED_AFTER: Final = timedelta(minutes=5)
"""How long due work may wait, with nothing of its queue running, before the queue is
judged unserved (a worker LISTENing claims due work at once, and polls every second by
default; one told to poll less often than this may be judged unserved between polls)."""
_QUEUE: Final = "queue"
_TASK: Final = "task"
_SETTINGS: Final = (
    "paused, max_running, rate_limit, rate_period, key_max_running, key_rate_limit, key_rate_period"
)


@attrs.frozen
class QueueInfo:
    """A named queue: its settings for all workers and what it holds now.

    Attributes:
        name: the queue's name.
        paused: no worker claims from it (running tasks finish).
        max_running: the most of its tasks running at once across all workers, or None.
        rate_limit: the most of its tasks started per ``rate_period``, or None.
        rate_period: the rate limit's sliding window, or None.
        pending: tasks waiting in it (due or not).
        running: tasks of it running now.
        due_since: since when its oldest due pending task has been due (the later of its
            run time and its creation, on the database server's clock), or None.
        unserved: no worker appears to serve it: it is not paused, none of its tasks
            runs, no rate-limited start happened lately, and due work has waited longer
            than :func:`list_queues`' ``unserved_after``. Judged from the tasks alone
            (workers do not register themselves): a queue no live worker serves, or whose
            workers do not register that task, looks like this. Only :func:`list_queues`
            judges it (False elsewhere).
        pending_capped: ``pending`` is :data:`COUNT_CAP` and the queue holds more (at
            least that many; they are not counted). ``due_since`` is then judged among the
            first :data:`COUNT_CAP` pending tasks in claim order (priority, then due time).
        running_capped: the same for ``running``.
        max_running_per_key: the most of its tasks with one ``limit_key`` running at once
            across all workers, or None.
        rate_limit_per_key: the most of its tasks with one ``limit_key`` started per
            ``rate_period_per_key``, or None.
        rate_period_per_key: the per-key rate limit's sliding window, or None.
    """

    name: str
    paused: bool
    max_running: int | None
    rate_limit: int | None
    rate_period: timedelta | None
    pending: int = 0
    running: int = 0
    due_since: datetime | None = None
    unserved: bool = False
    pending_capped: bool = False
    running_capped: bool = False
    max_running_per_key: int | None = None
    rate_limit_per_key: int | None = None
    rate_period_per_key: timedelta | None = None

    def to_json(self) -> dict[str, Any]:
        """Return a JSON-ready dict (windows in seconds, instants in ISO 8601)."""
        return {
            "name": self.name,
            "paused": self.paused,
            "pending": self.pending,
            "pending_capped": self.pending_capped,
            "running": self.running,
            "running_capped": self.running_capped,
            "max_running": self.max_running,
            "rate_limit": self.rate_limit,
            "rate_period_seconds": _seconds(self.rate_period),
            "max_running_per_key": self.max_running_per_key,
            "rate_limit_per_key": self.rate_limit_per_key,
            "rate_period_per_key_seconds": _seconds(self.rate_period_per_key),
            "due_since": None if self.due_since is None else self.due_since.isoformat(),
            "unserved": self.unserved,
        }


def _seconds(period: timedelta | None) -> float | None:
    return None if period is None else period.total_seconds()


@attrs.frozen
class TaskLimits:
    """The limits of one task name across all queues and workers.

    Attributes:
        task_name: the task's name.
        max_running: the most tasks of that name running at once, or None.
        rate_limit: the most of them started per ``rate_period``, or None.
        rate_period: the rate limit's sliding window, or None.
        max_running_per_key: the most of them with one ``limit_key`` running at once, or
            None.
        rate_limit_per_key: the most of them with one ``limit_key`` started per
            ``rate_period_per_key``, or None.
        rate_period_per_key: the per-key rate limit's sliding window, or None.
    """

    task_name: str
    max_running: int | None
    rate_limit: int | None
    rate_period: timedelta | None
    max_running_per_key: int | None = None
    rate_limit_per_key: int | None = None
    rate_period_per_key: timedelta | None = None


_WHOLE: Final = ("max_running", "rate_limit", "per")
PER_KEY_ARGUMENTS: Final = ("max_running_per_key", "rate_limit_per_key", "per_key")
"""The per-key limits' argument names, for :func:`check_limits`' errors."""


def check_limits(
    max_running: object, rate_limit: object, per: object, *, what: tuple[str, str, str] = _WHOLE
) -> tuple[int | None, int | None, timedelta | None]:
    """Check limits as :func:`limit_queue` takes them; return them with ``per`` a timedelta.

    ``what``: the three arguments' names, for the errors.

    Raises:
        QueueConfigurationError: a limit out of range, ``rate_limit`` without ``per`` (or
            the reverse).
        QueueTypeError: a value of the wrong type.
    """
    if max_running is not None:
        check_int(max_running, what[0], 1, MAX_RUNNING_LIMIT)
    if (rate_limit is None) != (per is None):
        raise QueueConfigurationError(f"give {what[1]} and {what[2]} together (or neither)")
    period = None
    if rate_limit is not None:
        check_int(rate_limit, what[1], 1, MAX_RATE_LIMIT)
        period = timedelta(seconds=check_seconds(per, what[2], 0.001, _MAX_PERIOD))
    return max_running, rate_limit, period  # type: ignore[return-value]


async def _write(conn: Any, schema: str, statement: str, *args: Any) -> list[Any]:
    """Run one settings change; delete the row if it no longer holds anything; wake workers.

    The deletion is a statement of its own (one statement cannot change a row twice); it
    re-checks the row, so a limit another operator set in between is kept.
    """
    s = validate_schema(schema)
    rows = await _driver.fetch(
        conn,
        f"""WITH changed AS ({statement.format(s=s)})
        SELECT changed.scope, changed.name,
               {", ".join(f"changed.{c}" for c in _SETTINGS.split(", "))}, pg_notify($1, '')
        FROM changed, {DURABLE}""",
        notify_channel(schema),
        *args,
    )
    scope, *row = rows[0]
    await _driver.fetch(
        conn,
        f"""DELETE FROM {s}.settings
        WHERE scope = $1 AND name = $2 AND NOT paused AND max_running IS NULL
          AND rate_limit IS NULL AND key_max_running IS NULL AND key_rate_limit IS NULL""",
        scope,
        row[0],
    )
    # A key's window outlives no per-key rate limit (as recent_starts is cleared above).
    await _driver.fetch(
        conn,
        f"""DELETE FROM {s}.key_starts k WHERE k.scope = $1 AND k.name = $2
        AND NOT EXISTS (SELECT 1 FROM {s}.settings t
                        WHERE t.scope = $1 AND t.name = $2 AND t.key_rate_limit IS NOT NULL)""",
        scope,
        row[0],
    )
    return row


def _bounded(n: int) -> tuple[int, bool]:
    """Return a count of at most COUNT_CAP + 1 as (count shown, capped)."""
    return (COUNT_CAP, True) if n > COUNT_CAP else (n, False)


async def _counts(conn: Any, schema: str, queue: str) -> tuple[int, bool, int, bool]:
    s = validate_schema(schema)
    # count_states walks each state's partial index and stops after COUNT_CAP + 1.
    rows = await _driver.fetch(
        conn, f"SELECT state, n FROM {s}.count_states($1, $2)", COUNT_CAP + 1, queue
    )
    counted = {state: int(n) for state, n in rows}
    return (
        *_bounded(counted.get(PENDING.value, 0)),
        *_bounded(counted.get(RUNNING.value, 0)),
    )


async def _queue_info(conn: Any, schema: str, row: list[Any]) -> QueueInfo:
    name, paused, max_running, rate_limit, rate_period, *per_key = row[:8]
    pending, pending_capped, running, running_capped = await _counts(conn, schema, name)
    return QueueInfo(
        name,
        paused,
        max_running,
        rate_limit,
        rate_period,
        pending,
        running,
        pending_capped=pending_capped,
        running_capped=running_capped,
        max_running_per_key=per_key[0],
        rate_limit_per_key=per_key[1],
        rate_period_per_key=per_key[2],
    )


@entry_point
async def pause_queue(conn: Any, queue: str, *, schema: str = DEFAULT_SCHEMA) -> QueueInfo:
    """Pause ``queue`` for every worker: no claim that starts after this commits takes from it.

    Running tasks finish; pending and newly enqueued tasks wait. Idempotent. Workers see it
    at their next claim (at most one poll interval away).

    Args:
        conn: an asyncpg connection or pool, or a psycopg ``AsyncConnection``.
        queue: the queue's name.
        schema: the queue's PostgreSQL schema.

    Raises:
        QueueConfigurationError: an invalid queue or schema name.
        QueueTypeError: a queue name that is not a str.
    """
    check_queue(queue)
    row = await _write(
        conn,
        schema,
        f"""INSERT INTO {{s}}.settings AS t (scope, name, paused) VALUES ('{_QUEUE}', $2, true)
        ON CONFLICT (scope, name) DO UPDATE SET paused = true, updated_at = clock_timestamp()
        RETURNING t.scope, t.name, {_SETTINGS}""",
        queue,
    )
    return await _queue_info(conn, schema, row)


@entry_point
async def resume_queue(conn: Any, queue: str, *, schema: str = DEFAULT_SCHEMA) -> QueueInfo:
    """Resume a paused ``queue`` and wake the workers; idempotent (a queue never paused too).

    Raises:
        QueueConfigurationError: an invalid queue or schema name.
        QueueTypeError: a queue name that is not a str.
    """
    check_queue(queue)
    row = await _write(
        conn,
        schema,
        f"""INSERT INTO {{s}}.settings AS t (scope, name) VALUES ('{_QUEUE}', $2)
        ON CONFLICT (scope, name) DO UPDATE SET paused = false, updated_at = clock_timestamp()
        RETURNING t.scope, t.name, {_SETTINGS}""",
        queue,
    )
    return await _queue_info(conn, schema, row)


_SET_LIMITS: Final = """INSERT INTO {{s}}.settings AS t (scope, name, max_running, rate_limit,
    rate_period, key_max_running, key_rate_limit, key_rate_period)
    VALUES ('{scope}', $2, $3, $4, $5::interval, $6, $7, $8::interval)
    ON CONFLICT (scope, name) DO UPDATE SET
        max_running = EXCLUDED.max_running, rate_limit = EXCLUDED.rate_limit,
        rate_period = EXCLUDED.rate_period, key_max_running = EXCLUDED.key_max_running,
        key_rate_limit = EXCLUDED.key_rate_limit, key_rate_period = EXCLUDED.key_rate_period,
        recent_starts = CASE WHEN EXCLUDED.rate_limit IS NULL THEN '{{{{}}}}'::timestamptz[]
                             ELSE t.recent_starts END,
        updated_at = clock_timestamp()
    RETURNING t.scope, t.name, {settings}"""


@entry_point
async def limit_queue(
    conn: Any,
    queue: str,
    *,
    max_running: int | None = None,
    rate_limit: int | None = None,
    per: float | timedelta | None = None,
    max_running_per_key: int | None = None,
    rate_limit_per_key: int | None = None,
    per_key: float | timedelta | None = None,
    schema: str = DEFAULT_SCHEMA,
) -> QueueInfo:
    """Set the limits of ``queue`` across all workers (replacing its previous limits).

    Every claim holds the queue's settings row locked while it counts, so concurrent
    claimers never exceed a limit between them. ``None`` removes a limit; a pause is kept.

    Args:
        conn: an asyncpg connection or pool, or a psycopg ``AsyncConnection``.
        queue: the queue's name.
        max_running: the most of its tasks running at once (1..1,000,000), or None.
        rate_limit: the most of its tasks started in any window of ``per`` (1..10,000).
        per: the rate limit's window: seconds or a timedelta (0.001 s .. 1 day).
        max_running_per_key: the most of its tasks with one ``limit_key`` (see
            :class:`EnqueueOptions`) running at once (1..1,000,000), or None. A task whose
            key is full waits; the claim takes the tasks of other keys behind it.
        rate_limit_per_key: the most of its tasks with one ``limit_key`` started in any
            window of ``per_key`` (1..10,000), or None.
        per_key: the per-key rate limit's window (as ``per``).
        schema: the queue's PostgreSQL schema.

    Raises:
        QueueConfigurationError: a limit out of range, ``rate_limit`` without ``per`` (or
            the reverse, and the same for the per-key pair), an invalid queue or schema name.
        QueueTypeError: an argument of the wrong type.
    """
    check_queue(queue)
    limits = check_limits(max_running, rate_limit, per)
    keyed = check_limits(max_running_per_key, rate_limit_per_key, per_key, what=PER_KEY_ARGUMENTS)
    row = await _write(
        conn,
        schema,
        _SET_LIMITS.format(scope=_QUEUE, settings=_SETTINGS),
        queue,
        *limits,
        *keyed,
    )
    return await _queue_info(conn, schema, row)


@entry_point
async def limit_task(
    conn: Any,
    task_name: str,
    *,
    max_running: int | None = None,
    rate_limit: int | None = None,
    per: float | timedelta | None = None,
    max_running_per_key: int | None = None,
    rate_limit_per_key: int | None = None,
    per_key: float | timedelta | None = None,
    schema: str = DEFAULT_SCHEMA,
) -> TaskLimits:
    """Set the limits of the tasks named ``task_name`` in all queues, across all workers.

    Arguments and errors as for :func:`limit_queue` (a key's tasks of that name are
    counted in all queues together); ``None`` everywhere removes them.
    """
    check_name(task_name, "task_name")
    limits = check_limits(max_running, rate_limit, per)
    keyed = check_limits(max_running_per_key, rate_limit_per_key, per_key, what=PER_KEY_ARGUMENTS)
    row = await _write(
        conn,
        schema,
        _SET_LIMITS.format(scope=_TASK, settings=_SETTINGS),
        task_name,
        *limits,
        *keyed,
    )
    return TaskLimits(row[0], *row[2:5], *row[5:8])


@entry_point
async def list_queues(
    conn: Any, *, schema: str = DEFAULT_SCHEMA, unserved_after: timedelta = UNSERVED_AFTER
) -> list[QueueInfo]:
    """List the queues that hold live tasks or have settings, by name (at most 1000).

    Each is judged ``unserved`` when no worker appears to claim from it: see
    :attr:`QueueInfo.unserved`. Counts stop at :data:`COUNT_CAP` per queue and state
    (``pending_capped``, ``running_capped``): the listing walks indexes and answers as fast
    over a backlog of millions as over a few tasks.

    Args:
        conn: an asyncpg connection or pool, or a psycopg ``AsyncConnection``.
        schema: the queue's PostgreSQL schema.
        unserved_after: how long due work may wait, with nothing of the queue running,
            before the queue is judged unserved (1 s .. 1 day; default 5 minutes).

    Raises:
        QueueConfigurationError: an invalid schema name, or ``unserved_after`` out of range.
        QueueTypeError: ``unserved_after`` is not a timedelta or a number of seconds.
    """
    s = validate_schema(schema)
    wait = timedelta(seconds=check_seconds(unserved_after, "unserved_after", 1.0, _MAX_PERIOD))
    first = COUNT_CAP + 1
    rows = await _driver.fetch(
        conn,
        f"""WITH live AS (
            -- live_queues skip-scans the partial indexes; count_states stops after
            -- COUNT_CAP + 1 tasks per state: no pass over a backlog of millions.
            SELECT q.queue,
                   max(c.n) FILTER (WHERE c.state = '{PENDING.value}') AS pending,
                   max(c.n) FILTER (WHERE c.state = '{RUNNING.value}') AS running,
                   max(c.due_since) FILTER (WHERE c.state = '{PENDING.value}') AS due_since
            FROM {s}.live_queues({_MAX_LISTED}) AS q
            CROSS JOIN LATERAL {s}.count_states({first}, q.queue) AS c
            GROUP BY q.queue
        ), named AS (
            SELECT name, {_SETTINGS},
                   (SELECT max(t) FROM unnest(recent_starts) AS t) AS last_start
            FROM {s}.settings WHERE scope = '{_QUEUE}'
        ), now AS (SELECT clock_timestamp() - $1::interval AS since)
        SELECT coalesce(named.name, live.queue), coalesce(named.paused, false),
               named.max_running, named.rate_limit, named.rate_period,
               coalesce(live.pending, 0), coalesce(live.running, 0),
               CASE WHEN live.due_since <= clock_timestamp() THEN live.due_since END,
               coalesce(NOT coalesce(named.paused, false) AND live.running = 0
                        AND live.due_since < now.since
                        AND (named.last_start IS NULL OR named.last_start < now.since), false),
               named.key_max_running, named.key_rate_limit, named.key_rate_period
        FROM named FULL JOIN live ON live.queue = named.name CROSS JOIN now
        ORDER BY 1
        LIMIT {_MAX_LISTED}""",
        wait,
    )
    listed = []
    for row in rows:
        name, paused, max_running, rate_limit, period, pending, running, due, unserved = row[:9]
        pending, pending_capped = _bounded(int(pending))
        running, running_capped = _bounded(int(running))
        listed.append(
            QueueInfo(
                name,
                paused,
                max_running,
                rate_limit,
                period,
                pending,
                running,
                due,
                unserved,
                pending_capped,
                running_capped,
                *row[9:12],
            )
        )
    return listed


@entry_point
async def list_task_limits(conn: Any, *, schema: str = DEFAULT_SCHEMA) -> list[TaskLimits]:
    """List the task names that have limits, by name (at most 1000).

    Raises:
        QueueConfigurationError: an invalid schema name.
    """
    s = validate_schema(schema)
    rows = await _driver.fetch(
        conn,
        f"""SELECT name, max_running, rate_limit, rate_period, key_max_running, key_rate_limit,
               key_rate_period FROM {s}.settings
        WHERE scope = '{_TASK}' ORDER BY name LIMIT {_MAX_LISTED}""",
    )
    return [TaskLimits(*row) for row in rows]
