"""Recurring jobs: cron definitions the worker materializes into ordinary task rows.

A job's options and args are a template. When an occurrence is due, the materializer
copies them onto a new task and advances the job's cursor in ONE transaction; later edits
or deletion of the job never change that task. Due jobs are locked with ``FOR UPDATE SKIP
LOCKED`` and a unique ``(job_id, scheduled_for)`` index on tasks, so several workers never
materialize the same occurrence twice.

A job's cron expression (five fields, or ``@hourly``, ``@daily``, ``@weekly``, ``@monthly``,
``@yearly``) follows the wall clock of its IANA time zone (``timezone=``, default ``"UTC"``)
with the daylight-saving rules of :class:`steeple.core.zoned.ZonedCalendar`: a time of day
skipped by a spring-forward runs once at the first instant after the gap, a time of day
repeated in autumn runs once (its first occurrence), and interval expressions (every
minute or every hour of the day) follow real time. Due instants are stored in UTC.

Misfire policy ``run_once``: after downtime, one task for the oldest missed due time, then
the cursor jumps to now (the next task is the next future due time). Pausing stops
materialization; resuming or rescheduling restarts from the current time (occurrences due
while paused are not owed).

Times come from the database server's clock, the one that also judges when tasks are due
(claims compare ``run_at`` with it), unless a :class:`~steeple.core.ports.Clock` is injected
(tests and simulations). Never from this host's clock: the two may disagree by any amount.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, Final, TypeVar, cast

import attrs

from steeple.core.errors import ConfigurationError
from steeple.core.policies import MissedRunPolicy, plan_tick
from steeple.core.ports import Clock
from steeple.core.zoned import DEFAULT_ZONE, ZonedCalendar
from steeple.postgres.queue import _driver
from steeple.postgres.queue._crashpoints import crash_point
from steeple.postgres.queue._schema import (
    DEFAULT_SCHEMA,
    entry_point,
    notify_channel,
    validate_schema,
)
from steeple.postgres.queue._shared import LOG
from steeple.postgres.queue._validate import DEFAULT_QUEUE, check_int, check_queue
from steeple.postgres.queue.errors import (
    JobExistsError,
    JobNotFoundError,
    QueueConfigurationError,
    QueueError,
    QueueTypeError,
)
from steeple.postgres.queue.tasks import (
    EnqueueOptions,
    Task,
    _check_name,
    declared_task,
    with_declared_queue,
)

if TYPE_CHECKING:
    from zoneinfo import ZoneInfo

    from steeple.postgres.queue._app import TaskFunction

    Zone = str | ZoneInfo | None

__all__ = [
    "JobInfo",
    "create",
    "delete",
    "ensure",
    "ensure_job",
    "get",
    "materialize_due",
    "pause",
    "reschedule",
    "resume",
]

A = TypeVar("A")
_DEFAULT_OPTIONS: Final = EnqueueOptions()
_COLUMNS: Final = (
    "name, task_name, cron, paused, next_run_at, cursor_at, priority, max_attempts, "
    "lease_duration, created_at, updated_at, timezone, queue"
)
_TEMPLATE: Final = (
    "task_name, cron, timezone, args, priority, max_attempts, lease_duration, "
    "backoff_initial_us, backoff_maximum_us, backoff_factor, backoff_jitter, queue"
)
# The calendar: a change of either restarts the cursor from now.
_CALENDAR_KEPT: Final = "(j.cron, j.timezone) = (EXCLUDED.cron, EXCLUDED.timezone)"

_OLD_TEMPLATE: Final = ", ".join(f"j.{c}" for c in _TEMPLATE.split(", "))
_NEW_TEMPLATE: Final = ", ".join(f"EXCLUDED.{c}" for c in _TEMPLATE.split(", "))


@attrs.frozen
class JobInfo:
    """A recurring job as stored (its args are not shown).

    Attributes:
        name: the job's unique name.
        task_name: the task each occurrence becomes.
        cron: the cron expression as given (five fields or an ``@`` shorthand), read in
            ``timezone``.
        paused: whether materialization is paused.
        next_run_at: the next due instant (``None`` once the calendar is exhausted).
        cursor_at: the exclusive cursor (last materialized due time, or when (re)started).
        priority: snapshot priority of materialized tasks.
        max_attempts: snapshot attempt limit.
        lease_duration: snapshot lease duration.
        created_at: creation time.
        updated_at: last change.
        timezone: the IANA zone whose wall clock ``cron`` follows (``"UTC"`` by default).
        queue: the named queue its occurrences are enqueued into.
    """

    name: str
    task_name: str
    cron: str
    paused: bool
    next_run_at: datetime | None
    cursor_at: datetime
    priority: int
    max_attempts: int
    lease_duration: timedelta
    created_at: datetime
    updated_at: datetime
    timezone: str = DEFAULT_ZONE
    queue: str = DEFAULT_QUEUE

    @classmethod
    def from_row(cls, row: tuple[Any, ...]) -> JobInfo:
        """Build from a row of the job columns, in order."""
        return cls(*row)

    def to_json(self) -> dict[str, Any]:
        """Return a JSON-ready dict (never its args; instants in ISO 8601)."""
        return {
            "name": self.name,
            "task_name": self.task_name,
            "cron": self.cron,
            "timezone": self.timezone,
            "queue": self.queue,
            "paused": self.paused,
            "next_run_at": None if self.next_run_at is None else self.next_run_at.isoformat(),
            "priority": self.priority,
            "max_attempts": self.max_attempts,
            "lease_duration_seconds": self.lease_duration.total_seconds(),
            "created_at": self.created_at.isoformat(),
            "updated_at": self.updated_at.isoformat(),
        }


def _calendar(cron: str, zone: Zone) -> ZonedCalendar:
    """Parse a job's calendar (core decides what is valid: fields, shorthands, zones)."""
    return ZonedCalendar.parse(cron, zone)


def _first_after(calendar: ZonedCalendar, now: datetime) -> datetime:
    following = calendar.next_after(now)
    if following is None:
        raise QueueConfigurationError(
            f"cron expression {calendar.expression!r} never fires after {now:%Y-%m-%d}"
        )
    return following


def _check_clock(clock: object) -> Clock | None:
    if clock is not None and not callable(getattr(clock, "now", None)):
        raise QueueTypeError(
            f"clock must have a now() method (a steeple Clock) or be None, not "
            f"{type(clock).__name__}"
        )
    return clock  # type: ignore[return-value]


async def _now(conn: Any, clock: Clock | None) -> datetime:
    """Return the current instant: the injected clock's, else the database server's.

    The server's clock is the one that judges what is due (claims compare ``run_at`` with
    it), so by default job cursors and due times are read from it, never from this host's
    clock, which may disagree with it by any amount.
    """
    if clock is not None:
        now = clock.now()
        if not isinstance(now, datetime) or now.tzinfo is None or now.utcoffset() is None:
            raise QueueTypeError("clock.now() must return an aware datetime")
        try:
            return now.astimezone(UTC)
        except OverflowError:
            raise QueueConfigurationError("clock.now() is out of range in UTC") from None
    ((now,),) = await _driver.fetch(conn, "SELECT clock_timestamp()")
    return cast(datetime, now)


async def _declaration(
    conn: Any, name: str, schema: str, cron: str, timezone: Zone, clock: Clock | None
) -> tuple[str, ZonedCalendar, datetime, datetime]:
    """Check a declared job; return the quoted schema, its calendar, now and its first run."""
    _check_name(name, "job name")
    s = validate_schema(schema)
    calendar = _calendar(cron, timezone)
    now = await _now(conn, _check_clock(clock))
    return s, calendar, now, _first_after(calendar, now)


def _template(options: EnqueueOptions | None, queue: str | None) -> EnqueueOptions:
    if options is None:
        options = _DEFAULT_OPTIONS
    elif not isinstance(options, EnqueueOptions):
        raise QueueTypeError(
            f"options must be EnqueueOptions or None, not {type(options).__name__}"
        )
    if queue is not None:
        options = attrs.evolve(options, queue=check_queue(queue))
    if options.run_at is not None or options.delay is not None or options.dedup_key is not None:
        raise QueueConfigurationError(
            "recurring job options take no run_at, delay or dedup_key (the calendar decides when)"
        )
    return options


def _params(
    task: Task[A] | TaskFunction[A],
    calendar: ZonedCalendar,
    args: A,
    options: EnqueueOptions | None,
    queue: str | None,
) -> list[Any]:
    task, declared = declared_task(task)
    template = _template(options, queue)
    if queue is None:
        # A job of an ``@app.task(queue=...)`` task enqueues into the queue the app's
        # workers serve, unless its options name another.
        template = with_declared_queue(template, declared)
    priority, max_attempts, lease, b_init, b_max, b_factor, b_jitter = template.snapshot(task)
    return [task.name, calendar.expression, calendar.zone, task.encode(args), priority,
            max_attempts, lease, b_init, b_max, b_factor, b_jitter, template.queue]  # fmt: skip


@entry_point
async def create(
    conn: Any,
    name: str,
    task: Task[A] | TaskFunction[A],
    cron: str,
    args: A,
    options: EnqueueOptions | None = None,
    *,
    schema: str = DEFAULT_SCHEMA,
    clock: Clock | None = None,
    timezone: str | ZoneInfo | None = DEFAULT_ZONE,
    queue: str | None = None,
) -> JobInfo:
    """Create a recurring job; its first occurrence is the first due time after now.

    Args:
        conn: an asyncpg connection or pool, or a psycopg ``AsyncConnection``.
        name: the job's unique name (1-200 chars, no control characters).
        task: the task every occurrence becomes: a :class:`Task`, or a function declared
            with ``@app.task`` (its declared queue is the job's unless ``queue`` or
            ``options.queue`` name another).
        cron: a five-field cron expression or ``@hourly``, ``@daily``, ``@weekly``,
            ``@monthly``, ``@yearly``, read in the wall-clock time of ``timezone``.
        args: the args copied onto every occurrence.
        options: priority, lease, attempts and backoff copied onto every occurrence.
        schema: the queue's PostgreSQL schema.
        clock: a clock to read "now" from instead of the database server's (tests).
        timezone: an IANA zone name (``"Europe/Berlin"``) or a ``zoneinfo.ZoneInfo``;
            ``"UTC"`` (the default) or ``None`` for UTC. Daylight-saving rules: see
            :class:`steeple.core.zoned.ZonedCalendar`.
        queue: the named queue of every occurrence (replaces ``options.queue`` when given;
            default: the task's declared queue, else ``"default"``).

    Raises:
        JobExistsError: a job with that name exists.
        InvalidCronExpression: a malformed cron expression or unknown shorthand.
        InvalidTimeZoneError: a zone of the wrong type, not an IANA name, unknown, or
            no tz database installed (a ``ConfigurationError``, so a ``ValueError``).
        QueueConfigurationError: a bad name, queue or schema, a calendar that never fires, options
            with run_at, delay or dedup_key, a clock reading out of range.
        QueueTypeError: a task, options or clock of the wrong type.
        ArgsEncodingError: args that cannot be encoded.
    """
    s, calendar, now, following = await _declaration(conn, name, schema, cron, timezone, clock)
    params = _params(task, calendar, args, options, queue)
    rows = await _driver.fetch(
        conn,
        f"""INSERT INTO {s}.jobs (name, {_TEMPLATE}, cursor_at, next_run_at)
        VALUES ($1, $2, $3, $4, $5::text::jsonb, $6, $7, $8::interval, $9, $10, $11, $12,
                $13, $14, $15)
        ON CONFLICT (name) DO NOTHING
        RETURNING {_COLUMNS}""",
        name, *params, now, following,
    )  # fmt: skip
    if not rows:
        raise JobExistsError(name)
    return JobInfo.from_row(rows[0])


@entry_point
async def ensure_job(
    conn: Any,
    name: str,
    task: Task[A] | TaskFunction[A],
    cron: str,
    args: A,
    options: EnqueueOptions | None = None,
    *,
    schema: str = DEFAULT_SCHEMA,
    clock: Clock | None = None,
    timezone: str | ZoneInfo | None = DEFAULT_ZONE,
    queue: str | None = None,
) -> JobInfo:
    """Declare a recurring job at start-up: create it, or bring it to this definition.

    Idempotent: an identical declaration changes nothing (the cursor keeps its place). A
    changed cron or time zone restarts the cursor from now; changed args or options apply
    to occurrences materialized from now on. A paused job stays paused. Arguments as for
    :func:`create`.

    Raises:
        InvalidCronExpression: a malformed cron expression or unknown shorthand.
        InvalidTimeZoneError: a zone of the wrong type, not an IANA name, unknown, or
            no tz database installed.
        QueueConfigurationError: a bad name, queue or schema, a calendar that never fires, options
            with run_at, delay or dedup_key, a clock reading out of range.
        QueueTypeError: a task, options or clock of the wrong type.
        ArgsEncodingError: args that cannot be encoded.
    """
    s, calendar, now, following = await _declaration(conn, name, schema, cron, timezone, clock)
    params = _params(task, calendar, args, options, queue)
    rows = await _driver.fetch(
        conn,
        f"""INSERT INTO {s}.jobs AS j (name, {_TEMPLATE}, cursor_at, next_run_at)
        VALUES ($1, $2, $3, $4, $5::text::jsonb, $6, $7, $8::interval, $9, $10, $11, $12,
                $13, $14, $15)
        ON CONFLICT (name) DO UPDATE SET
            task_name = EXCLUDED.task_name, cron = EXCLUDED.cron, timezone = EXCLUDED.timezone,
            args = EXCLUDED.args,
            priority = EXCLUDED.priority, max_attempts = EXCLUDED.max_attempts,
            lease_duration = EXCLUDED.lease_duration,
            backoff_initial_us = EXCLUDED.backoff_initial_us,
            backoff_maximum_us = EXCLUDED.backoff_maximum_us,
            backoff_factor = EXCLUDED.backoff_factor, backoff_jitter = EXCLUDED.backoff_jitter,
            queue = EXCLUDED.queue,
            cursor_at = CASE WHEN {_CALENDAR_KEPT} THEN j.cursor_at ELSE EXCLUDED.cursor_at END,
            next_run_at = CASE WHEN {_CALENDAR_KEPT} THEN j.next_run_at
                               ELSE EXCLUDED.next_run_at END,
            updated_at = clock_timestamp()
        WHERE ({_OLD_TEMPLATE}) IS DISTINCT FROM ({_NEW_TEMPLATE})
        RETURNING {_COLUMNS}""",
        name, *params, now, following,
    )  # fmt: skip
    if rows:
        return JobInfo.from_row(rows[0])
    return await get(conn, name, schema=schema)


ensure = ensure_job


@entry_point
async def get(conn: Any, name: str, *, schema: str = DEFAULT_SCHEMA) -> JobInfo:
    """Return the job named ``name``.

    Raises:
        JobNotFoundError: no such job.
        QueueConfigurationError: a malformed name (no job can have it) or schema.
        QueueTypeError: a name that is not a str.
    """
    s = validate_schema(schema)
    _check_name(name, "job name")
    rows = await _driver.fetch(conn, f"SELECT {_COLUMNS} FROM {s}.jobs WHERE name = $1", name)
    if not rows:
        raise JobNotFoundError(name)
    return JobInfo.from_row(rows[0])


@entry_point
async def pause(conn: Any, name: str, *, schema: str = DEFAULT_SCHEMA) -> JobInfo:
    """Stop materializing the job (already materialized tasks still run). Idempotent.

    Raises:
        JobNotFoundError: no such job.
        QueueConfigurationError: a malformed name (no job can have it) or schema.
        QueueTypeError: a name that is not a str.
    """
    s = validate_schema(schema)
    _check_name(name, "job name")
    rows = await _driver.fetch(
        conn,
        f"""UPDATE {s}.jobs SET paused = true,
            updated_at = CASE WHEN paused THEN updated_at ELSE clock_timestamp() END
        WHERE name = $1 RETURNING {_COLUMNS}""",
        name,
    )
    if not rows:
        raise JobNotFoundError(name)
    return JobInfo.from_row(rows[0])


_KEEP: Final[Any] = object()
"""``reschedule``'s default zone: the job's own."""


async def _restart(
    conn: Any, name: str, schema: str, clock: Clock | None, cron: str | None, zone: Any
) -> JobInfo:
    """Resume (``cron`` None) or reschedule the job, its cursor restarted from now."""
    s = validate_schema(schema)
    _check_name(name, "job name")
    wanted = None if cron is None else _calendar(cron, DEFAULT_ZONE if zone is _KEEP else zone)
    now = await _now(conn, _check_clock(clock))
    for _ in range(5):
        current = await get(conn, name, schema=schema)
        if wanted is None and not current.paused:
            return current
        if wanted is None:
            calendar = _calendar(current.cron, current.timezone)
        elif zone is _KEEP:
            calendar = _calendar(wanted.expression, current.timezone)
        else:
            calendar = wanted
        following = _first_after(calendar, now)
        # Optimistic: apply only if the calendar we computed from is still the stored one.
        rows = await _driver.fetch(
            conn,
            f"""UPDATE {s}.jobs SET cron = $2, timezone = $7,
                paused = CASE WHEN $5 THEN false ELSE paused END,
                cursor_at = $3, next_run_at = $4, updated_at = clock_timestamp()
            WHERE name = $1 AND cron = $6 AND timezone = $8 RETURNING {_COLUMNS}""",
            name, calendar.expression, now, following, cron is None, current.cron,
            calendar.zone, current.timezone,
        )  # fmt: skip
        if rows:
            return JobInfo.from_row(rows[0])
    raise QueueError(f"job {name!r} kept changing; try again")


@entry_point
async def resume(
    conn: Any, name: str, *, schema: str = DEFAULT_SCHEMA, clock: Clock | None = None
) -> JobInfo:
    """Resume a paused job from now: the next occurrence is the first due time after now.

    Idempotent: resuming a running job changes nothing.

    Raises:
        JobNotFoundError: no such job.
        QueueConfigurationError: its calendar never fires again; a malformed name or schema.
        QueueTypeError: a name or clock of the wrong type.
        InvalidTimeZoneError: this host's tz database does not know the job's zone.
    """
    return await _restart(conn, name, schema, clock, None, _KEEP)


@entry_point
async def reschedule(
    conn: Any,
    name: str,
    cron: str,
    *,
    schema: str = DEFAULT_SCHEMA,
    clock: Clock | None = None,
    timezone: str | ZoneInfo | None = _KEEP,
) -> JobInfo:
    """Give the job a new cron expression; the next occurrence is its first after now.

    Tasks already materialized keep their time and snapshot. A paused job stays paused.

    Args:
        conn: an asyncpg connection or pool, or a psycopg ``AsyncConnection``.
        name: the job's name.
        cron: the new expression (five fields or an ``@`` shorthand).
        schema: the queue's PostgreSQL schema.
        clock: a clock to read "now" from instead of the database server's (tests).
        timezone: the new IANA zone (``"UTC"`` or ``None`` for UTC); when not given, the
            job keeps its zone.

    Raises:
        JobNotFoundError: no such job.
        InvalidCronExpression: a malformed cron expression or unknown shorthand.
        InvalidTimeZoneError: a zone of the wrong type, not an IANA name or unknown.
        QueueConfigurationError: a calendar that never fires; a malformed name or schema.
        QueueTypeError: a name or clock of the wrong type.
    """
    return await _restart(conn, name, schema, clock, cron, timezone)


@entry_point
async def delete(conn: Any, name: str, *, schema: str = DEFAULT_SCHEMA) -> None:
    """Delete the job. Tasks it already materialized are not touched.

    Raises:
        JobNotFoundError: no such job.
        QueueConfigurationError: a malformed name (no job can have it) or schema.
        QueueTypeError: a name that is not a str.
    """
    s = validate_schema(schema)
    _check_name(name, "job name")
    rows = await _driver.fetch(conn, f"DELETE FROM {s}.jobs WHERE name = $1 RETURNING id", name)
    if not rows:
        raise JobNotFoundError(name)


@entry_point
async def materialize_due(
    conn: Any, *, schema: str = DEFAULT_SCHEMA, clock: Clock | None = None, limit: int = 100
) -> int:
    """Turn due occurrences of up to ``limit`` jobs into tasks, in one transaction.

    The worker calls this in its maintenance loop; it is public so applications without
    a worker (or tests) can drive it. Each job's task insert and cursor advance commit
    together; jobs locked by another worker are skipped.

    Args:
        conn: an asyncpg connection or a psycopg ``AsyncConnection`` (not in a
            transaction).
        schema: the queue's PostgreSQL schema.
        clock: the clock deciding what is due (by default the database server's, which
            also judges when tasks are due; this host's clock may disagree with it).
        limit: the most jobs handled in this call (1..10000).

    Returns:
        How many tasks were created.

    Raises:
        QueueConfigurationError: ``limit`` outside 1..10000, an invalid schema name, a
            clock reading out of range.
        QueueTypeError: a clock of the wrong type.
    """
    s = validate_schema(schema)
    _check_clock(clock)
    check_int(limit, "limit", 1, 10_000)
    created = 0
    crash_point("queue.materialize.begin")
    async with conn.transaction():
        ((_, server_now),) = await _driver.fetch(
            conn, "SELECT set_config('synchronous_commit', 'on', true), clock_timestamp()"
        )
        now = server_now if clock is None else await _now(conn, clock)
        due_jobs = await _driver.fetch(
            conn,
            f"""SELECT id, cron, cursor_at, args::text, priority, max_attempts, lease_duration,
                       backoff_initial_us, backoff_maximum_us, backoff_factor, backoff_jitter,
                       task_name, timezone, queue
            FROM {s}.jobs
            WHERE NOT paused AND next_run_at IS NOT NULL AND next_run_at <= $1
            ORDER BY next_run_at
            LIMIT $2
            FOR UPDATE SKIP LOCKED""",
            now,
            limit,
        )
        for (job_id, cron, cursor_at, args, priority, max_attempts, lease,
             b_init, b_max, b_factor, b_jitter, task_name, zone, queue) in due_jobs:  # fmt: skip
            try:
                calendar = _calendar(cron, zone)
            except ConfigurationError as exc:
                # Validated when stored, so this host's tz database lacks the zone (or the
                # row was written by hand). Left as it is: a worker whose database knows
                # the zone materializes it; the others say why they cannot.
                LOG.warning("recurring job %s cannot be materialized here: %s", job_id, exc)
                continue
            plan = plan_tick(MissedRunPolicy.RUN_ONCE, calendar, cursor_at, now, 1)
            for due in plan.due:
                inserted = await _driver.fetch(
                    conn,
                    f"""INSERT INTO {s}.tasks (task_name, args, priority, run_at, max_attempts,
                        lease_duration, backoff_initial_us, backoff_maximum_us, backoff_factor,
                        backoff_jitter, job_id, scheduled_for, queue)
                    VALUES ($1, $2::text::jsonb, $3, $4, $5, $6::interval, $7, $8, $9, $10,
                            $11, $4, $12)
                    ON CONFLICT (job_id, scheduled_for) WHERE job_id IS NOT NULL DO NOTHING
                    RETURNING id""",
                    task_name, args, priority, due, max_attempts, lease, b_init, b_max,
                    b_factor, b_jitter, job_id, queue,
                )  # fmt: skip
                created += len(inserted)
                crash_point("queue.materialize.inserted")
            await _driver.fetch(
                conn,
                f"""UPDATE {s}.jobs SET cursor_at = coalesce($2, cursor_at), next_run_at = $3,
                    updated_at = clock_timestamp() WHERE id = $1""",
                job_id,
                plan.cursor,
                plan.next_due,
            )
        if created:
            await _driver.fetch(conn, "SELECT pg_notify($1, '')", notify_channel(schema))
    crash_point("queue.materialize.committed")
    return created


@entry_point
async def _undeclared(
    conn: Any,
    prefix: str,
    declared: list[str],
    *,
    schema: str = DEFAULT_SCHEMA,
    remove: bool = False,
) -> list[str]:
    """Return (``remove``: delete and return) the jobs named ``prefix...`` not in ``declared``.

    An App names the jobs it declares with its prefix, so a job with that prefix that it no
    longer declares was declared by an earlier version of its code. The check and the
    deletion are one statement: a job declared again meanwhile (same name) is not taken.
    """
    s = validate_schema(schema)
    verb = f"DELETE FROM {s}.jobs" if remove else f"SELECT name FROM {s}.jobs"
    rows = await _driver.fetch(
        conn,
        f"""{verb} WHERE left(name, length($1)) = $1 AND NOT (name = ANY($2::text[]))
        {"RETURNING name" if remove else "ORDER BY name"}""",
        prefix,
        declared,
    )
    return sorted(name for (name,) in rows)
