"""The work queue: migrate, tasks, enqueue, jobs (recurring jobs), queues.

tasks: list, show, retry, cancel; jobs: list, create, ensure, pause, resume, reschedule,
delete; queues: list, pause, resume, limit.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer

from steeple.admin._cli import output
from steeple.admin._cli.options import (
    JsonOpt,
    Listing,
    Typer,
    Where,
    YesOpt,
    listing_options,
    where_options,
)
from steeple.admin._cli.output import fail, guard, say
from steeple.admin.settings import CliError, ExitCode, parse_duration
from steeple.core.tasks import MAX_TASK_ID

if TYPE_CHECKING:
    from steeple.postgres.queue import EnqueueOptions, QueueInfo, TaskRun
    from steeple.postgres.queue.jobs import JobInfo

__all__ = ["cancel_task", "register"]

T = TypeVar("T")

tasks_app = Typer(
    help="Work-queue tasks: list them (the default), show, retry or cancel one.",
    invoke_without_command=True,
    rich_markup_mode=None,
)
jobs_app = Typer(
    help="The work queue's recurring jobs: list them (the default), create, ensure, pause, "
    "resume, reschedule, delete.",
    invoke_without_command=True,
    rich_markup_mode=None,
)

queues_app = Typer(
    help="The work queue's named queues: list them (the default), pause, resume, limit.",
    invoke_without_command=True,
    rich_markup_mode=None,
)


def register(app: typer.Typer) -> None:
    """Add the work queue's commands to ``app``."""
    app.command()(migrate)
    app.add_typer(tasks_app, name="tasks")
    app.command()(enqueue)
    app.add_typer(jobs_app, name="jobs")
    app.add_typer(queues_app, name="queues")
    from steeple.admin._cli.workflows import workflows_app

    app.add_typer(workflows_app, name="workflows")


@where_options(queue=True, store=False)
def migrate(where: Where) -> None:
    """Install or upgrade the work queue's tables (idempotent, forward-only)."""
    target = guard(where.target)

    async def body() -> int:

        from steeple.postgres.queue import install

        conn = await target.connect()
        try:
            return int(await install(conn, schema=target.queue_schema))
        finally:
            await conn.close()

    version = output.run(body, target)
    say(f"work queue schema {target.queue_schema!r} is at version {version}")


# --- tasks -----------------------------------------------------------------------------------

StateOpt = Annotated[
    str | None,
    typer.Option(
        "--state",
        show_default=False,
        help="Only tasks in this state: pending, running, succeeded, failed or cancelled.",
    ),
]
NameOpt = Annotated[
    str | None, typer.Option("--name", show_default=False, help="Only tasks of this task name.")
]
TaskIdArg = Annotated[int, typer.Argument(min=1, max=MAX_TASK_ID, help="The task id.")]


def _check_state(state: str | None) -> None:
    from steeple.core.tasks import TaskState

    states = [s.value for s in TaskState]
    if state is not None and state not in states:
        raise fail(
            CliError(
                f"--state {output.one_line(repr(state[:40]))} is not a task state",
                code=ExitCode.USAGE,
                hint="use one of " + ", ".join(states),
            )
        )


def _check_name(value: str, what: str) -> str:
    """Refuse (usage) a value no name can be: the library's one name rule, exact (no trim)."""
    from steeple.core.names import check_name

    return output.typed(lambda: check_name(value, what), code=ExitCode.USAGE)


OldestFirstOpt = Annotated[
    bool,
    typer.Option(
        "--oldest-first",
        help="List the oldest tasks first (default: the newest first, so a busy queue's "
        "latest work is on the first page).",
    ),
]


def _list_tasks(
    where: Where, listing: Listing, state: str | None, name: str | None, oldest_first: bool
) -> None:
    output.check_limit(listing.limit)
    _check_state(state)
    if name is not None:
        guard(lambda: _check_name(name, "--name (a task name)"))
    target = guard(where.target)

    async def page(conn: Any) -> Any:
        from steeple.postgres.queue import admin

        return await admin.list_tasks(
            conn,
            schema=target.queue_schema,
            state=state,
            task_name=name,
            after=listing.after,
            limit=listing.limit,
            newest_first=not oldest_first,
        )

    from steeple.admin.queue_admin import task_record

    listed = output.on_queue(target, page)
    output.print_page(
        listed,
        as_json=listing.as_json,
        to_json=lambda t: task_record(t).to_json(),
        title=f"tasks in {target.queue_schema}, {'oldest' if oldest_first else 'newest'} first",
        elastic="last error",
        columns=("id", "name", "queue", "state", "attempts", "run at (UTC)", "last error"),
        row=lambda t: (
            str(t.id),
            t.task_name,
            t.queue,
            t.state.value,
            t.attempts_shown,
            output.short_when(t.run_at),
            t.last_error or "",
        ),
    )


@tasks_app.callback()
@where_options(queue=True, store=False)
@listing_options()
def tasks(
    ctx: typer.Context,
    where: Where,
    listing: Listing,
    state: StateOpt = None,
    name: NameOpt = None,
    oldest_first: OldestFirstOpt = False,
) -> None:
    """Work-queue tasks (metadata only: never arguments or lease tokens).

    Without a subcommand, list them (newest first).
    """
    if ctx.invoked_subcommand is None:
        _list_tasks(where, listing, state, name, oldest_first)


@tasks_app.command("list")
@where_options(queue=True, store=False)
@listing_options()
def tasks_list(
    where: Where,
    listing: Listing,
    state: StateOpt = None,
    name: NameOpt = None,
    oldest_first: OldestFirstOpt = False,
) -> None:
    """List tasks, newest first (metadata only)."""
    _list_tasks(where, listing, state, name, oldest_first)


_MAX_SHOWN_RESULT = 2000


def _print_run(run: TaskRun, as_json: bool) -> None:
    fields = run.to_json()
    if as_json:
        output.print_json(fields)
        return
    history = fields.pop("history")
    fields.pop("result")
    progress = fields.pop("progress")
    # Attempts read as what happens next ("1, not retried"), not as a promise of more.
    fields["attempts"] = run.attempts_shown
    width = max(len(k) for k in (*fields, "progress", "result"))

    def field(key: str, value: object) -> None:
        # The value goes through the one escaping, on one line; the padding is kept.
        shown = "-" if value is None else " ".join(str(value).split())
        say(f"{key:<{width}}  {shown}", keep_spacing=True)

    for key, value in fields.items():
        field(key, value)
    if progress is not None:
        shown = f"{progress['fraction']:.0%}"
        if "message" in progress:
            shown += f" {progress['message']}"
        field("progress", shown)
    if run.result is not None:
        # Compact JSON escapes control characters: a result cannot steer the terminal.
        text = json.dumps(run.result, separators=(",", ":"))
        if len(text) > _MAX_SHOWN_RESULT:
            text = text[: _MAX_SHOWN_RESULT - 3] + "... (see --json)"
        field("result", text)
    if history:
        say(f"attempts ({len(history)}):")
        for attempt in history:
            error = f"  {' '.join(attempt['error'].split())}" if attempt["error"] else ""
            say(
                f"  #{attempt['attempt']} {attempt['outcome']} on "
                f"{attempt['worker_id'] or '-'} at {attempt['finished_at']}{error}",
                keep_spacing=True,
            )
    failed = [a for a in history if a["traceback"]]
    if failed:
        latest = failed[-1]
        say(f"traceback of attempt {latest['attempt']} ({latest['error_type']}):")
        for line in latest["traceback"].splitlines():
            # Each line keeps its indentation; control characters are still shown escaped.
            say(line, keep_spacing=True)


@tasks_app.command("show")
@where_options(queue=True, store=False)
def tasks_show(task_id: TaskIdArg, where: Where, as_json: JsonOpt = False) -> None:
    """Show one task: state, progress, result, attempts, the latest traceback.

    Never its arguments.
    """
    from steeple.postgres import queue

    target = guard(where.target)

    async def show(conn: Any) -> TaskRun:
        return await _task_or_fail(
            queue.admin.task_detail(conn, task_id, schema=target.queue_schema), task_id
        )

    _print_run(output.on_queue(target, show), as_json)


async def _task_or_fail(call: Awaitable[T], task_id: int) -> T:
    from steeple.postgres.queue import TaskNotFoundError

    try:
        return await call
    except TaskNotFoundError:
        raise CliError(
            f"there is no task {task_id}", code=ExitCode.FAILED, hint="see steeple tasks"
        ) from None


@tasks_app.command("retry")
@where_options(queue=True, store=False)
def tasks_retry(task_id: TaskIdArg, where: Where, as_json: JsonOpt = False) -> None:
    """Send a failed task back to pending, to run again at once.

    It keeps its id, run_id and history, and gets at least one more attempt.
    """
    from steeple.postgres.queue import TaskStateError, admin

    target = guard(where.target)

    async def retried(conn: Any) -> TaskRun:
        try:
            return await _task_or_fail(
                admin.retry_failed_task(conn, task_id, schema=target.queue_schema), task_id
            )
        except TaskStateError as exc:
            raise CliError(str(exc), code=ExitCode.FAILED) from None

    run = output.on_queue(target, retried)
    if as_json:
        _print_run(run, True)
        return
    say(
        f"task {run.id} ({run.task_name}) is {run.state.value} again: attempt "
        f"{run.attempts + 1} of {run.max_attempts} runs next"
    )


@tasks_app.command("cancel")
@where_options(queue=True, store=False)
def tasks_cancel(task_id: TaskIdArg, where: Where, yes: YesOpt = False) -> None:
    """Cancel a pending or running task (its worker is fenced out). Asks first."""
    cancel_task(task_id, yes=yes, where=where)


def cancel_task(task_id: int, *, yes: bool, where: Where) -> None:
    """Confirm, then cancel task ``task_id`` (``steeple tasks cancel`` and ``cancel --task``)."""
    from steeple.core.tasks import TaskState
    from steeple.postgres import queue

    output.confirm(f"Cancel task {task_id}?", yes=yes, what=f"cancel task {task_id}")
    target = guard(where.target)
    state = output.on_queue(
        target,
        lambda conn: _task_or_fail(
            queue.cancel(conn, task_id, schema=target.queue_schema), task_id
        ),
    )
    if state is not TaskState.CANCELLED:
        raise fail(
            CliError(f"task {task_id} already finished ({state.value})", code=ExitCode.FAILED)
        )
    say(f"cancelled task {task_id}")


# --- enqueue ---------------------------------------------------------------------------------


def _json_args(text: str) -> Any:
    import json

    def refuse(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    try:
        return json.loads(text, parse_constant=refuse)
    except RecursionError:
        raise CliError("--args is nested too deeply", code=ExitCode.USAGE) from None
    except ValueError as exc:
        raise CliError(
            f"--args is not JSON: {exc}",
            code=ExitCode.USAGE,
            hint="""write it like --args '{"to": "ada@example.com"}'""",
        ) from None


def _options(
    at: str | None,
    delay: str | None,
    priority: int | None,
    max_attempts: int | None,
    dedup_key: str | None = None,
    queue_name: str | None = None,
    limit_key: str | None = None,
) -> EnqueueOptions:
    from steeple.admin._cli.recurring import _instant
    from steeple.postgres.queue import EnqueueOptions

    if at is not None and delay is not None:
        raise CliError("give --at or --in, not both", code=ExitCode.USAGE)
    extra: dict[str, Any] = {}
    if priority is not None:
        extra["priority"] = priority
    if max_attempts is not None:
        extra["max_attempts"] = max_attempts
    if dedup_key is not None:
        extra["dedup_key"] = dedup_key
    if queue_name is not None:
        extra["queue"] = queue_name
    if limit_key is not None:
        extra["limit_key"] = limit_key

    def build() -> EnqueueOptions:
        if at is not None:
            return EnqueueOptions.at(_instant(at, "--at"), **extra)
        if delay is not None:
            return EnqueueOptions.after(parse_duration(delay, what="--in"), **extra)
        return EnqueueOptions.immediate(**extra)

    return output.typed(build, code=ExitCode.USAGE)


def _encodable(kind: Any, value: Any) -> None:
    """Refuse (usage) arguments the task cannot store: a lone surrogate, a NUL, over 1 MiB."""
    from steeple.postgres.queue import ArgsEncodingError

    try:
        kind.encode(value)
    except ArgsEncodingError as exc:
        raise CliError(f"--args: {exc}", code=ExitCode.USAGE) from None


ArgsOpt = Annotated[str, typer.Option("--args", help="The task's arguments as JSON (default: {}).")]
PriorityOpt = Annotated[
    int | None,
    typer.Option("--priority", show_default=False, help="Higher runs first (default: 0)."),
]
MaxAttemptsOpt = Annotated[
    int | None,
    typer.Option(
        "--max-attempts", show_default=False, help="Attempts before it fails (default: 5)."
    ),
]
QueueOpt = Annotated[
    str | None,
    typer.Option(
        "--queue", show_default=False, help="The named queue it waits in (default: default)."
    ),
]

LimitKeyOpt = Annotated[
    str | None,
    typer.Option(
        "--limit-key",
        show_default=False,
        help="The key its queue's per-key limits count it under (a customer, a tenant).",
    ),
]


@where_options(queue=True, store=False)
def enqueue(
    task: Annotated[str, typer.Argument(help="The task name (the one its handler serves).")],
    where: Where,
    args: ArgsOpt = "{}",
    at: Annotated[
        str | None,
        typer.Option(
            "--at",
            show_default=False,
            help="Run at this ISO 8601 instant, e.g. 2026-01-31T22:00Z (server clock).",
        ),
    ] = None,
    delay: Annotated[
        str | None,
        typer.Option("--in", show_default=False, help="Run this long from now, e.g. 10m."),
    ] = None,
    priority: PriorityOpt = None,
    max_attempts: MaxAttemptsOpt = None,
    dedup_key: Annotated[
        str | None,
        typer.Option(
            "--dedup-key",
            show_default=False,
            help="At most one live task of this name with this key: a duplicate returns "
            "the existing task.",
        ),
    ] = None,
    queue_name: QueueOpt = None,
    limit_key: LimitKeyOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Enqueue one task (now, at a time, or after a delay) into a named queue."""
    from steeple.postgres.queue import Task

    value = guard(lambda: _json_args(args))
    options = guard(
        lambda: _options(at, delay, priority, max_attempts, dedup_key, queue_name, limit_key)
    )
    kind: Task[Any] = guard(lambda: output.typed(lambda: Task(task), code=ExitCode.USAGE))
    guard(lambda: _encodable(kind, value))
    target = guard(where.target)

    async def put(conn: Any) -> Any:
        from steeple.postgres import queue

        return await queue.enqueue(conn, kind, value, options, schema=target.queue_schema)

    enqueued = output.on_queue(target, put)
    if as_json:
        output.print_json(
            {
                "task_id": enqueued.id,
                "deduplicated": enqueued.deduplicated,
                "queue": options.queue,
            }
        )
    elif enqueued.deduplicated:
        say(f"task {enqueued.id} ({task}) already holds that dedup key: nothing was enqueued")
    else:
        due = "now" if at is None and delay is None else (at or f"in {delay}")
        say(f"enqueued task {enqueued.id} ({task}) in queue {options.queue!r}, due {due}")


# --- jobs ------------------------------------------------------------------------------------

JobNameArg = Annotated[str, typer.Argument(help="The job's name.")]


def _job_row(job: JobInfo) -> tuple[str, ...]:
    return (
        job.name,
        job.task_name,
        job.cron,
        job.timezone,
        job.queue,
        "paused" if job.paused else "active",
        output.when(job.next_run_at),
    )


def _say_job(job: JobInfo, verb: str, as_json: bool) -> None:
    if as_json:
        output.print_json(job.to_json())
        return
    state = "paused" if job.paused else f"next run {output.when(job.next_run_at)} UTC"
    zone = "" if job.timezone == "UTC" else f" ({job.timezone})"
    say(
        f"{verb} job {job.name!r}: {job.task_name} at {job.cron!r}{zone}, {state}, "
        f"queue {job.queue!r}"
    )


def _list_jobs(where: Where, listing: Listing) -> None:
    output.check_limit(listing.limit)
    target = guard(where.target)

    async def page(conn: Any) -> Any:
        from steeple.postgres.queue import admin

        return await admin.list_jobs(
            conn, schema=target.queue_schema, after=listing.after, limit=listing.limit
        )

    output.print_page(
        output.on_queue(target, page),
        as_json=listing.as_json,
        to_json=lambda job: job.to_json(),
        title=f"recurring jobs in {target.queue_schema}",
        columns=("name", "task", "cron", "time zone", "queue", "state", "next run (UTC)"),
        row=_job_row,
    )


@jobs_app.callback()
@where_options(queue=True, store=False)
@listing_options()
def jobs(ctx: typer.Context, where: Where, listing: Listing) -> None:
    """List the work queue's recurring jobs, or run a subcommand on one."""
    if ctx.invoked_subcommand is None:
        _list_jobs(where, listing)


@jobs_app.command("list")
@where_options(queue=True, store=False)
@listing_options()
def jobs_list(where: Where, listing: Listing) -> None:
    """List recurring jobs by name (their arguments are not shown)."""
    _list_jobs(where, listing)


def _cron(cron: str, timezone: str | None = None) -> str:
    """Refuse (usage) a calendar the job could not have: core's own parse, zone included."""
    from steeple.core.zoned import ZonedCalendar

    if timezone is None:
        output.typed(lambda: ZonedCalendar.parse(cron), code=ExitCode.USAGE)
    else:
        output.typed(lambda: ZonedCalendar.parse(cron, timezone), code=ExitCode.USAGE)
    return cron


def _job_call(name: str, where: Where, call: Callable[[Any, str], Awaitable[T]]) -> T:
    guard(lambda: _check_name(name, "job name"))
    target = guard(where.target)

    async def op(conn: Any) -> T:
        from steeple.postgres.queue import JobExistsError, JobNotFoundError

        try:
            return await call(conn, target.queue_schema)
        except (JobExistsError, JobNotFoundError) as exc:
            hint = "see steeple jobs" if isinstance(exc, JobNotFoundError) else (
                "use steeple jobs ensure to bring it to this definition"
            )  # fmt: skip
            raise CliError(str(exc), code=ExitCode.FAILED, hint=hint) from None

    return output.on_queue(target, op)


def _declare(
    verb: str,
    name: str,
    task: str,
    cron: str,
    timezone: str,
    args: str,
    priority: int | None,
    max_attempts: int | None,
    queue: str,
    where: Where,
    as_json: bool,
) -> None:
    from steeple.postgres.queue import Task, jobs

    value = guard(lambda: _json_args(args))
    guard(lambda: _cron(cron, timezone))
    options = guard(lambda: _options(None, None, priority, max_attempts))
    kind: Task[Any] = guard(lambda: output.typed(lambda: Task(task), code=ExitCode.USAGE))
    guard(lambda: _check_queue(queue))
    guard(lambda: _encodable(kind, value))
    declare = jobs.create if verb == "created" else jobs.ensure_job
    job = _job_call(
        name,
        where,
        lambda conn, schema: declare(
            conn, name, kind, cron, value, options, schema=schema, timezone=timezone, queue=queue
        ),
    )
    _say_job(job, verb, as_json)


TaskOpt = Annotated[str, typer.Option("--task", help="The task each run becomes.")]
CronOpt = Annotated[
    str,
    typer.Option(
        "--cron", help="Five-field cron expression, or @hourly, @daily, @weekly, @monthly..."
    ),
]
TimezoneOpt = Annotated[
    str,
    typer.Option(
        "--timezone", help="IANA time zone whose wall clock the cron follows, e.g. Europe/Berlin."
    ),
]
JobQueueOpt = Annotated[
    str,
    typer.Option(
        "--queue",
        help="The named queue its runs wait in: one a worker serves (an @app.task(queue=...) "
        "task's workers serve that queue).",
    ),
]


@jobs_app.command("create")
@where_options(queue=True, store=False)
def jobs_create(
    name: JobNameArg,
    task: TaskOpt,
    cron: CronOpt,
    where: Where,
    timezone: TimezoneOpt = "UTC",
    args: ArgsOpt = "{}",
    priority: PriorityOpt = None,
    max_attempts: MaxAttemptsOpt = None,
    queue: JobQueueOpt = "default",
    as_json: JsonOpt = False,
) -> None:
    """Create a recurring job; its first run is the first due time after now."""
    _declare(
        "created", name, task, cron, timezone, args, priority, max_attempts, queue, where, as_json
    )


@jobs_app.command("ensure")
@where_options(queue=True, store=False)
def jobs_ensure(
    name: JobNameArg,
    task: TaskOpt,
    cron: CronOpt,
    where: Where,
    timezone: TimezoneOpt = "UTC",
    args: ArgsOpt = "{}",
    priority: PriorityOpt = None,
    max_attempts: MaxAttemptsOpt = None,
    queue: JobQueueOpt = "default",
    as_json: JsonOpt = False,
) -> None:
    """Create a recurring job, or bring an existing one to this definition (idempotent).

    A changed cron restarts its schedule from now; a paused job stays paused.
    """
    _declare(
        "ensured", name, task, cron, timezone, args, priority, max_attempts, queue, where, as_json
    )


@jobs_app.command("pause")
@where_options(queue=True, store=False)
def jobs_pause(name: JobNameArg, where: Where, as_json: JsonOpt = False) -> None:
    """Stop a job making tasks (tasks it made still run). Idempotent."""
    from steeple.postgres.queue import jobs

    job = _job_call(name, where, lambda conn, schema: jobs.pause(conn, name, schema=schema))
    _say_job(job, "paused", as_json)


@jobs_app.command("resume")
@where_options(queue=True, store=False)
def jobs_resume(name: JobNameArg, where: Where, as_json: JsonOpt = False) -> None:
    """Resume a paused job from now (runs due while paused are not made up). Idempotent."""
    from steeple.postgres.queue import jobs

    job = _job_call(name, where, lambda conn, schema: jobs.resume(conn, name, schema=schema))
    _say_job(job, "resumed", as_json)


@jobs_app.command("reschedule")
@where_options(queue=True, store=False)
def jobs_reschedule(
    name: JobNameArg,
    cron: Annotated[str, typer.Argument(help="The new cron expression (or @daily, ...).")],
    where: Where,
    timezone: Annotated[
        str | None,
        typer.Option(
            "--timezone",
            show_default=False,
            help="A new IANA time zone for it (default: the job keeps its own).",
        ),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Give a job a new cron expression; its next run is the first due time after now."""
    from steeple.postgres.queue import jobs

    guard(lambda: _cron(cron, timezone))

    def reschedule(conn: Any, schema: str) -> Awaitable[JobInfo]:
        if timezone is None:
            return jobs.reschedule(conn, name, cron, schema=schema)
        return jobs.reschedule(conn, name, cron, schema=schema, timezone=timezone)

    job = _job_call(name, where, reschedule)
    _say_job(job, "rescheduled", as_json)


@jobs_app.command("delete")
@where_options(queue=True, store=False)
def jobs_delete(name: JobNameArg, where: Where, yes: YesOpt = False) -> None:
    """Delete a job (tasks it already made are kept). Asks first; --yes skips the question."""
    from steeple.postgres.queue import jobs

    guard(lambda: _check_name(name, "job name"))
    output.confirm(f"Delete the recurring job {name!r}?", yes=yes, what=f"delete job {name!r}")

    _job_call(name, where, lambda conn, schema: jobs.delete(conn, name, schema=schema))
    say(f"deleted job {name!r}")


# --- queues ----------------------------------------------------------------------------------

QueueNameArg = Annotated[str, typer.Argument(help="The queue's name.")]


def _limits_text(info: QueueInfo) -> str:
    parts = []
    if info.max_running is not None:
        parts.append(f"at most {info.max_running} running")
    if info.rate_limit is not None and info.rate_period is not None:
        parts.append(f"at most {info.rate_limit} starts per {info.rate_period.total_seconds():g} s")
    if info.max_running_per_key is not None:
        parts.append(f"at most {info.max_running_per_key} running per key")
    if info.rate_limit_per_key is not None and info.rate_period_per_key is not None:
        seconds = info.rate_period_per_key.total_seconds()
        parts.append(f"at most {info.rate_limit_per_key} starts per key per {seconds:g} s")
    return ", ".join(parts) or "none"


def _say_queue(info: QueueInfo, verb: str, as_json: bool) -> None:
    if as_json:
        output.print_json(info.to_json())
        return
    state = "paused" if info.paused else "active"
    say(
        f"{verb} queue {info.name!r}: {state}, limits: {_limits_text(info)}; "
        f"{info.pending} pending, {info.running} running"
    )


def _queue_call(where: Where, call: Callable[[Any, str], Awaitable[T]]) -> T:
    target = guard(where.target)
    return output.on_queue(target, lambda conn: call(conn, target.queue_schema))


def _check_queue(name: str) -> str:
    """Refuse (usage) a name no queue can have: the library's own check."""
    from steeple.postgres.queue import EnqueueOptions

    output.typed(lambda: EnqueueOptions(queue=name), code=ExitCode.USAGE)
    return name


def _list_queues(where: Where, as_json: bool) -> None:
    from steeple.postgres.queue import admin

    found = _queue_call(where, lambda conn, schema: admin.list_queues(conn, schema=schema))
    if as_json:
        output.print_json([q.to_json() for q in found])
        return
    output.print_table(
        "named queues",
        ("queue", "state", "limits", "pending", "running"),
        [
            (
                q.name,
                ("paused" if q.paused else "active") + (", unserved" if q.unserved else ""),
                _limits_text(q),
                str(q.pending),
                str(q.running),
            )
            for q in found
        ],
    )


@queues_app.callback()
@where_options(queue=True, store=False)
def queues(ctx: typer.Context, where: Where, as_json: JsonOpt = False) -> None:
    """List the named queues (those holding live tasks or settings), or run a subcommand."""
    if ctx.invoked_subcommand is None:
        _list_queues(where, as_json)


@queues_app.command("list")
@where_options(queue=True, store=False)
def queues_list(where: Where, as_json: JsonOpt = False) -> None:
    """List the named queues: paused or not, limits, pending and running tasks."""
    _list_queues(where, as_json)


@queues_app.command("pause")
@where_options(queue=True, store=False)
def queues_pause(
    name: QueueNameArg, where: Where, yes: YesOpt = False, as_json: JsonOpt = False
) -> None:
    """Stop every worker claiming from a queue (running tasks finish). Asks first."""
    from steeple.postgres.queue import admin

    guard(lambda: _check_queue(name))
    output.confirm(f"Pause queue {name!r} for every worker?", yes=yes, what=f"pause queue {name!r}")
    info = _queue_call(where, lambda conn, schema: admin.pause_queue(conn, name, schema=schema))
    _say_queue(info, "paused", as_json)


@queues_app.command("resume")
@where_options(queue=True, store=False)
def queues_resume(name: QueueNameArg, where: Where, as_json: JsonOpt = False) -> None:
    """Let workers claim from a paused queue again (they are woken at once). Idempotent."""
    from steeple.postgres.queue import admin

    guard(lambda: _check_queue(name))
    info = _queue_call(where, lambda conn, schema: admin.resume_queue(conn, name, schema=schema))
    _say_queue(info, "resumed", as_json)


@queues_app.command("limit")
@where_options(queue=True, store=False)
def queues_limit(
    name: QueueNameArg,
    where: Where,
    max_running: Annotated[
        int | None,
        typer.Option(
            "--max-running",
            show_default=False,
            help="At most this many of its tasks running at once in all workers.",
        ),
    ] = None,
    rate: Annotated[
        int | None,
        typer.Option(
            "--rate", show_default=False, help="At most this many starts per --per (all workers)."
        ),
    ] = None,
    per: Annotated[
        str | None,
        typer.Option("--per", show_default=False, help="The rate's window, e.g. 1s or 1m."),
    ] = None,
    max_running_per_key: Annotated[
        int | None,
        typer.Option(
            "--max-running-per-key",
            show_default=False,
            help="At most this many of its tasks with one limit key running at once.",
        ),
    ] = None,
    rate_per_key: Annotated[
        int | None,
        typer.Option(
            "--rate-per-key",
            show_default=False,
            help="At most this many starts of one limit key per --per-key.",
        ),
    ] = None,
    per_key: Annotated[
        str | None,
        typer.Option("--per-key", show_default=False, help="The per-key rate's window."),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Set (replace) a queue's limits for all workers; with no option, remove them.

    The per-key limits hold each limit key (given at enqueue) apart: a full key's tasks
    wait while the other keys' tasks run.
    """
    from steeple.postgres.queue import admin

    guard(lambda: _check_queue(name))
    window = None if per is None else guard(lambda: parse_duration(per, what="--per"))
    key_window = (
        None if per_key is None else guard(lambda: parse_duration(per_key, what="--per-key"))
    )
    keyed = (max_running_per_key, rate_per_key, key_window)

    async def limit(conn: Any, schema: str) -> QueueInfo:
        return await admin.limit_queue(
            conn,
            name,
            max_running=max_running,
            rate_limit=rate,
            per=window,
            max_running_per_key=keyed[0],
            rate_limit_per_key=keyed[1],
            per_key=keyed[2],
            schema=schema,
        )

    def check() -> object:
        admin.check_limits(max_running, rate, window)
        names = ("--max-running-per-key", "--rate-per-key", "--per-key")
        return admin.check_limits(*keyed, what=names)

    guard(lambda: output.typed(check, code=ExitCode.USAGE))
    info = _queue_call(where, limit)
    _say_queue(info, "limited", as_json)
