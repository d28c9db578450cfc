"""Recurring publications: initialize, schedules, occurrences, cancel, retry, purge."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from steeple.admin._cli import output
from steeple.admin._cli.options import (
    DryRunOpt,
    Listing,
    Typer,
    Where,
    YesOpt,
    listing_options,
    where_options,
)
from steeple.admin._cli.output import fail, guard, on_store, plural, say
from steeple.admin.settings import CliError, ExitCode, parse_duration
from steeple.core.tasks import MAX_TASK_ID

if TYPE_CHECKING:
    from steeple.core.config import RecurringDefinition
    from steeple.core.records import ScheduleInfo

__all__ = ["register"]

schedules_app = Typer(
    help="Recurring definitions: list them (the default), create them.",
    invoke_without_command=True,
    rich_markup_mode=None,
)


def register(app: typer.Typer) -> None:
    """Add the recurring publications' commands to ``app``."""
    app.command()(initialize)
    app.add_typer(schedules_app, name="schedules")
    app.command()(occurrences)
    app.command()(cancel)
    app.command()(retry)
    app.command()(purge)


@where_options()
def initialize(
    where: Where,
    grant_to: Annotated[
        str | None,
        typer.Option(
            "--grant-to",
            show_default=False,
            help="Also grant this runtime role exactly the privileges it needs (grants.sql).",
        ),
    ] = None,
) -> None:
    """Create the recurring store's schema and a namespace (deployment role; idempotent)."""
    from steeple.admin._backend import initialize_store, quiet_role_warnings
    from steeple.admin.settings import redact_dsn

    target = guard(where.target)
    if grant_to is not None:
        from steeple.postgres import runtime_grant_statements

        # A name that cannot be granted literally is refused before anything is created.
        guard(lambda: output.typed(lambda: runtime_grant_statements(grant_to, target.schema)))

    async def body() -> None:
        # The deployment role may well be a superuser: the runtime-role warning is not for it.
        with quiet_role_warnings():
            store = await initialize_store(target)
        await store.close()
        if grant_to is not None:
            from steeple.postgres import grant_runtime_role

            conn = await target.connect()
            try:
                await grant_runtime_role(conn, grant_to, target.schema)
            finally:
                await conn.close()

    output.run(body, target)
    say(
        f"initialized namespace {target.namespace!r} in schema {target.schema!r} at "
        f"{redact_dsn(target.dsn)}"
    )
    if grant_to is not None:
        say(f"granted the runtime privileges on {target.schema!r} to role {grant_to!r}")


# --- schedules -------------------------------------------------------------------------------


def _list_schedules(where: Where, listing: Listing) -> None:
    from steeple.admin.app import schedule_json

    output.check_limit(listing.limit)
    target = guard(where.target)
    page = on_store(target, lambda store: store.schedules(after=listing.after, limit=listing.limit))
    output.print_page(
        page,
        as_json=listing.as_json,
        to_json=schedule_json,
        title=f"schedules in {target.namespace}",
        columns=("name", "cron", "policy", "state", "topic", "next due (UTC)"),
        row=lambda s: (
            s.name,
            s.cron,
            s.policy.value,
            s.state,
            s.topic,
            output.when(s.next_due_at),
        ),
    )


@schedules_app.callback()
@where_options()
@listing_options()
def schedules(ctx: typer.Context, where: Where, listing: Listing) -> None:
    """Recurring definitions (metadata only); without a subcommand, list them."""
    if ctx.invoked_subcommand is None:
        _list_schedules(where, listing)


@schedules_app.command("list")
@where_options()
@listing_options()
def schedules_list(where: Where, listing: Listing) -> None:
    """List recurring definitions (metadata only)."""
    _list_schedules(where, listing)


_POLICY_HELP = "Missed-run policy: catch_up (every missed run) or coalesce (one for all)."


@schedules_app.command("create")
@where_options()
def schedules_create(
    where: Where,
    name: Annotated[
        str | None, typer.Option("--name", show_default=False, help="Definition name.")
    ] = None,
    cron: Annotated[
        str | None,
        typer.Option("--cron", show_default=False, help="Five-field cron expression (UTC)."),
    ] = None,
    topic: Annotated[
        str | None,
        typer.Option(
            "--topic", show_default=False, help="Broker topic (with --file: the default)."
        ),
    ] = None,
    message_type: Annotated[
        str | None,
        typer.Option(
            "--message-type",
            show_default=False,
            help="Message type (with --file: the default).",
        ),
    ] = None,
    policy: Annotated[str, typer.Option("--policy", help=_POLICY_HELP)] = "catch_up",
    first_after: Annotated[
        str | None,
        typer.Option(
            "--first-after",
            show_default=False,
            help="Exclusive start, an ISO 8601 instant such as 2026-01-31T22:00Z (default: "
            "now; give it to make re-running the command a no-op).",
        ),
    ] = None,
    payload: Annotated[
        str | None,
        typer.Option("--payload", show_default=False, help="Payload as UTF-8 text."),
    ] = None,
    payload_file: Annotated[
        Path | None,
        typer.Option("--payload-file", show_default=False, help="Payload read from a file."),
    ] = None,
    header: Annotated[
        list[str] | None,
        typer.Option("--header", show_default=False, help="A message header, KEY=VALUE."),
    ] = None,
    file: Annotated[
        Path | None,
        typer.Option(
            "--file",
            show_default=False,
            help="Create every definition of a JSON or TOML definitions file instead "
            "(the format steeple simulate reads).",
        ),
    ] = None,
) -> None:
    """Create recurring definitions, from options or a definitions file.

    Definitions are immutable: creating one that exists with the same content changes
    nothing (so a deployment can run this every time); a different one under an existing
    name is refused.
    """
    now = datetime.now(UTC)
    start = guard(lambda: _instant(first_after, "--first-after") if first_after else now)
    if file is not None:
        flags = {
            "--name": name,
            "--cron": cron,
            "--payload": payload,
            "--payload-file": payload_file,
            "--header": header,
        }
        given = [flag for flag, value in flags.items() if value]
        if given:
            raise fail(
                CliError(
                    f"--file takes the definitions from the file; drop {', '.join(given)}",
                    code=ExitCode.USAGE,
                )
            )
        definitions = guard(lambda: _from_file(file, start, topic, message_type))
    else:
        definitions = [
            guard(
                lambda: _from_options(
                    name, cron, topic, message_type, policy, start, payload, payload_file, header
                )
            )
        ]
    target = guard(where.target)

    async def body() -> list[ScheduleInfo]:
        from steeple.admin._backend import connect_store
        from steeple.core.errors import RecurringConflictError

        store = await connect_store(target)
        created: list[ScheduleInfo] = []
        try:
            for definition in definitions:
                try:
                    created.append(await store.create(definition))
                except RecurringConflictError as exc:
                    done = f" ({len(created)} before it were created)" if created else ""
                    hint = None if first_after else (
                        "--first-after defaults to now: give the one it was created with "
                        "(or first_after in the file) to make re-runs a no-op"
                    )  # fmt: skip
                    raise CliError(f"{exc}{done}", code=ExitCode.FAILED, hint=hint) from None
        finally:
            await store.close()
        return created

    for info in output.run(body, target):
        say(
            f"schedule {info.name!r}: {info.cron} ({info.policy.value}), next due "
            f"{output.when(info.next_due_at)} UTC, state {info.state}"
        )


def _instant(text: str, what: str) -> datetime:
    # The one instant parser: the definitions file's (and steeple simulate's).
    from steeple.core.errors import ConfigurationError
    from steeple.core.instants import parse_instant

    try:
        return parse_instant(text)
    except ConfigurationError as exc:
        raise CliError(f"{what}: {exc}", code=ExitCode.USAGE) from None


def _from_file(
    path: Path, start: datetime, topic: str | None, message_type: str | None
) -> list[RecurringDefinition]:
    from steeple.admin.definitions_file import DefinitionDefaults, load_definitions
    from steeple.core.errors import ConfigurationError

    try:
        return load_definitions(path, DefinitionDefaults(start, topic, message_type))
    except ConfigurationError as exc:
        raise CliError(
            str(exc), code=ExitCode.USAGE, hint="see steeple schedules create --help"
        ) from None


def _from_options(
    name: str | None,
    cron: str | None,
    topic: str | None,
    message_type: str | None,
    policy: str,
    start: datetime,
    payload: str | None,
    payload_file: Path | None,
    header: list[str] | None,
) -> RecurringDefinition:
    from steeple.admin.definitions_file import definitions_from_data

    missing = [o for o, v in (("--name", name), ("--cron", cron), ("--topic", topic),
                              ("--message-type", message_type)) if v is None]  # fmt: skip
    if missing:
        raise CliError(
            f"give {', '.join(missing)} (or --file FILE)",
            code=ExitCode.USAGE,
            hint="steeple schedules create --name nightly --cron '0 2 * * *' --topic billing "
            "--message-type billing.run",
        )
    if payload is not None and payload_file is not None:
        raise CliError("give --payload or --payload-file, not both", code=ExitCode.USAGE)
    item: dict[str, Any] = {
        "name": name,
        "cron": cron,
        "policy": policy,
        "first_after": start,
        "topic": topic,
        "message_type": message_type,
        "headers": _headers(header or []),
    }
    if payload is not None:
        item["payload"] = payload
    if payload_file is not None:
        item["payload_base64"] = _read_payload(payload_file)
    from steeple.core.errors import ConfigurationError

    try:
        (definition,) = definitions_from_data([item])
    except ConfigurationError as exc:
        raise CliError(str(exc), code=ExitCode.USAGE) from None
    return definition


def _headers(items: list[str]) -> dict[str, str]:
    headers: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise CliError(
                "--header takes KEY=VALUE", code=ExitCode.USAGE, hint="--header team=finance"
            )
        headers[key] = value
    return headers


def _read_payload(path: Path) -> str:
    import base64

    try:
        with path.open("rb") as handle:
            data = handle.read(64 * 1024 + 1)
    except OSError as exc:
        raise CliError(
            f"cannot read --payload-file {str(path)!r}: {exc.strerror or type(exc).__name__}",
            code=ExitCode.USAGE,
        ) from None
    return base64.b64encode(data).decode("ascii")


# --- occurrences and operator actions --------------------------------------------------------


@where_options()
@listing_options()
def occurrences(where: Where, listing: Listing) -> None:
    """List occurrences (metadata only: never payloads or lease credentials)."""
    from steeple.admin.app import occurrence_json

    output.check_limit(listing.limit)
    target = guard(where.target)
    page = on_store(
        target, lambda store: store.occurrences(after=listing.after, limit=listing.limit)
    )
    output.print_page(
        page,
        as_json=listing.as_json,
        to_json=occurrence_json,
        title=f"occurrences in {target.namespace}",
        columns=("id", "definition", "due (UTC)", "state", "attempts", "last error"),
        row=lambda o: (
            o.occurrence_id,
            o.definition_name,
            output.when(o.due_at),
            o.state.value,
            str(o.attempts),
            o.last_error or "",
        ),
    )


@where_options(queue=True)
def cancel(
    name: Annotated[
        str | None, typer.Argument(show_default=False, help="Name of the recurring definition.")
    ] = None,
    task: Annotated[
        int | None,
        typer.Option(
            "--task",
            min=1,
            max=MAX_TASK_ID,
            show_default=False,
            help="Cancel this work-queue task id instead (as steeple tasks cancel).",
        ),
    ] = None,
    yes: YesOpt = False,
    *,
    where: Where,
) -> None:
    """Cancel a recurring definition for good (NAME), or a task (--task ID).

    A cancelled definition publishes nothing more and its name stays taken. Asks first;
    --yes skips the question.
    """
    if (name is None) == (task is None):
        raise fail(
            CliError(
                "give either a definition NAME or --task ID",
                code=ExitCode.USAGE,
                hint="steeple cancel NAME  |  steeple cancel --task 42",
            )
        )
    if task is not None:
        from steeple.admin._cli.queue import cancel_task

        cancel_task(task, yes=yes, where=where)
        return
    definition = name
    assert definition is not None
    output.confirm(
        f"Cancel the recurring definition {definition!r} for good? Its name stays taken.",
        yes=yes,
        what=f"cancel {definition!r}",
    )
    target = guard(where.target)
    info = on_store(target, lambda store: store.cancel(definition))
    say(f"cancelled definition {info.name!r} (state {info.state})")


@where_options()
def retry(
    occurrence_id: Annotated[str, typer.Argument(help="Id of a dead occurrence.")],
    where: Where,
) -> None:
    """Give a dead occurrence a fresh attempt budget (inside its delivery window)."""
    target = guard(where.target)
    info = on_store(target, lambda store: store.retry_failed(occurrence_id))
    say(f"occurrence {info.occurrence_id} is {info.state.value} again")


@where_options(queue=True)
def purge(
    older_than: Annotated[
        str,
        typer.Option(
            "--older-than", help="Only records that finished at least this long ago (7d, 12h)."
        ),
    ] = "7d",
    limit: Annotated[
        int,
        typer.Option(
            "--limit",
            help="The most records this run removes (1-100); run it again to remove more.",
        ),
    ] = 100,
    include_tasks: Annotated[
        bool, typer.Option("--tasks", help="Prune terminal work-queue tasks instead.")
    ] = False,
    dry_run: DryRunOpt = False,
    yes: YesOpt = False,
    *,
    where: Where,
) -> None:
    """Remove terminal occurrences (or tasks, with --tasks) older than --older-than.

    Occurrences that were published, expired, cancelled or dead; tasks that succeeded,
    failed or were cancelled. --dry-run counts them and removes nothing. Asks first;
    --yes skips the question.
    """
    output.check_limit(limit)
    age = guard(lambda: parse_duration(older_than, what="--older-than"))
    noun = "task" if include_tasks else "occurrence"
    what = noun + "s"
    if not dry_run:
        output.confirm(
            f"Remove up to {limit} terminal {what} finished more than {older_than} ago?",
            yes=yes,
            what=f"purge {what}",
        )
    target = guard(where.target)
    if dry_run:
        eligible = _count_purgeable(target, age, include_tasks)
        say(
            f"dry run: {plural(eligible, 'terminal ' + noun)} finished more than {older_than} "
            "ago; a purge "
            f"would remove {min(eligible, limit)} of them (--limit {limit}); nothing was removed"
        )
        return
    if include_tasks:
        from steeple.postgres import queue

        # The age is judged on the database server's clock, as the queue judges due times.
        removed = output.on_queue(
            target, lambda conn: queue.prune_terminal(conn, age, limit, schema=target.queue_schema)
        )
    else:
        cutoff = datetime.now(UTC) - age
        removed = on_store(target, lambda store: store.purge_terminal(cutoff, limit))
    more = " (the limit: run it again to remove more)" if removed == limit else ""
    say(f"purged {plural(removed, 'terminal ' + noun)} older than {older_than}{more}")


def _count_purgeable(target: Any, age: timedelta, tasks: bool) -> int:
    if tasks:
        from steeple.postgres.queue import admin

        return output.on_queue(
            target, lambda conn: admin.count_prunable(conn, age, schema=target.queue_schema)
        )

    async def count() -> int:

        from steeple.postgres.recurring import admin as recurring_admin

        conn = await target.connect()
        try:
            return await recurring_admin.count_purgeable(
                conn, datetime.now(UTC) - age, schema=target.schema, namespace=target.namespace
            )
        finally:
            await conn.close()

    return output.run(count, target)
