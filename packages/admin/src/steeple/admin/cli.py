"""The ``steeple`` command: demo, deployment, workers, inspection and operator actions.

Exit codes: 0 success; 1 the operation was refused or failed (not found, wrong state);
2 usage (bad options or arguments); 3 configuration (DSN, keys, namespace settings);
4 unavailable (PostgreSQL, the broker or the embedded server cannot be reached).
Errors are one line on stderr, followed by what to do.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import logging
import os
import secrets
import sys
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import attrs
import typer
from rich.console import Console
from rich.table import Table

from steeple.admin import simulate_cli
from steeple.admin._backend import Target, classify, connect_store, initialize_store
from steeple.admin.app import occurrence_json, schedule_json
from steeple.admin.settings import (
    DSN_ENV,
    KEYS_ENV,
    CliError,
    ExitCode,
    NamespaceSettings,
    load_keyring,
    parse_duration,
    redact_dsn,
    resolve_dsn,
)
from steeple.core.dsn import scrub

if TYPE_CHECKING:
    from steeple.admin.queue_admin import PostgresTaskAdmin
    from steeple.core.records import Page
    from steeple.postgres import PostgresRecurringStore

__all__ = ["app", "main"]

T = TypeVar("T")
R = TypeVar("R")

_EXIT_CODES_HELP = "Exit codes: 0 ok, 1 refused or failed, 2 usage, 3 configuration, 4 unavailable."

app = typer.Typer(
    name="steeple",
    help="steeple: durable scheduled work on PostgreSQL.\n\n" + _EXIT_CODES_HELP,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
keys_app = typer.Typer(
    help="Storage keys: generate one, show the key ids in use.", no_args_is_help=True
)
admin_app = typer.Typer(help="The admin web app.", no_args_is_help=True)
app.add_typer(keys_app, name="keys")
app.add_typer(admin_app, name="admin")

out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)

# --- shared options --------------------------------------------------------------------------

DsnOpt = Annotated[
    str | None,
    typer.Option(
        "--dsn",
        envvar=DSN_ENV,
        show_envvar=True,
        show_default=False,
        help="PostgreSQL URL (postgresql://user@host:5432/db).",
    ),
]
SchemaOpt = Annotated[
    str,
    typer.Option("--schema", envvar="STEEPLE_SCHEMA", help="PostgreSQL schema of the store."),
]
NamespaceOpt = Annotated[
    str,
    typer.Option("--namespace", "-n", envvar="STEEPLE_NAMESPACE", help="steeple namespace."),
]
QueueSchemaOpt = Annotated[
    str | None,
    typer.Option(
        "--queue-schema",
        envvar="STEEPLE_QUEUE_SCHEMA",
        show_default=False,
        help="Schema of the work queue (default: <schema>_queue).",
    ),
]
KeysFileOpt = Annotated[
    Path | None,
    typer.Option(
        "--keys-file",
        envvar="STEEPLE_KEYS_FILE",
        show_default=False,
        help=f"File of storage keys (id:base64, one per line; first = primary). "
        f"Default: the {KEYS_ENV} environment variable.",
    ),
]
MaxDefinitionsOpt = Annotated[
    int,
    typer.Option(
        "--max-definitions",
        envvar="STEEPLE_MAX_DEFINITIONS",
        help="Namespace quota of definitions (must match initialization).",
    ),
]
MaxOccurrencesOpt = Annotated[
    int,
    typer.Option(
        "--max-occurrences",
        envvar="STEEPLE_MAX_OCCURRENCES",
        help="Namespace quota of occurrences (must match initialization).",
    ),
]
WindowOpt = Annotated[
    str,
    typer.Option(
        "--delivery-window",
        envvar="STEEPLE_DELIVERY_WINDOW",
        help="Delivery window, e.g. 1d (must match initialization).",
    ),
]
LeaseOpt = Annotated[
    str,
    typer.Option(
        "--lease",
        envvar="STEEPLE_LEASE",
        help="Lease duration, e.g. 60s (must match initialization).",
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]
LimitOpt = Annotated[int, typer.Option("--limit", help="Rows per page (1-100).")]
AfterOpt = Annotated[
    str | None, typer.Option("--after", help="Exclusive cursor from a previous page.")
]

# (name, option, default) of the options that say where a command works, in --help order.
_PLACE_OPTIONS: tuple[tuple[str, Any, Any], ...] = (
    ("dsn", DsnOpt, None),
    ("schema", SchemaOpt, "steeple"),
    ("namespace", NamespaceOpt, "default"),
)
_LISTING_OPTIONS: tuple[tuple[str, Any, Any], ...] = (
    ("as_json", JsonOpt, False),
    ("limit", LimitOpt, 100),
    ("after", AfterOpt, None),
)
_QUEUE_OPTIONS: tuple[tuple[str, Any, Any], ...] = (("queue_schema", QueueSchemaOpt, None),)
_STORE_OPTIONS: tuple[tuple[str, Any, Any], ...] = (
    ("keys_file", KeysFileOpt, None),
    ("max_definitions", MaxDefinitionsOpt, 1000),
    ("max_occurrences", MaxOccurrencesOpt, 100_000),
    ("delivery_window", WindowOpt, "1d"),
    ("lease", LeaseOpt, "60s"),
)


def _target(
    dsn: str | None,
    schema: str,
    namespace: str,
    keys_file: Path | None,
    *,
    queue_schema: str | None = None,
    max_definitions: int = 1000,
    max_occurrences: int = 100_000,
    delivery_window: str = "1d",
    lease: str = "60s",
) -> Target:
    _remember(dsn or os.environ.get(DSN_ENV))
    resolved = resolve_dsn(dsn)
    assert resolved is not None
    settings = NamespaceSettings(
        namespace=namespace,
        max_definitions=max_definitions,
        max_occurrences=max_occurrences,
        delivery_window=parse_duration(delivery_window, what="--delivery-window"),
        lease_duration=parse_duration(lease, what="--lease"),
    )
    return Target(resolved, schema, settings, keys_file, queue_schema)


@attrs.frozen
class _Where:
    """The shared options of one command invocation (see :func:`_where_options`)."""

    dsn: str | None = attrs.field(repr=lambda dsn: repr(dsn and redact_dsn(dsn)))
    schema: str
    namespace: str
    queue_schema: str | None = None
    keys_file: Path | None = None
    max_definitions: int = 1000
    max_occurrences: int = 100_000
    delivery_window: str = "1d"
    lease: str = "60s"

    def target(self) -> Target:
        """Build the command's target; a bad option ends the command with its exit code."""
        return _guard(
            lambda: _target(
                self.dsn,
                self.schema,
                self.namespace,
                self.keys_file,
                queue_schema=self.queue_schema,
                max_definitions=self.max_definitions,
                max_occurrences=self.max_occurrences,
                delivery_window=self.delivery_window,
                lease=self.lease,
            )
        )


@attrs.frozen
class _Listing:
    """The paging options of a listing command (see :func:`_listing_options`)."""

    as_json: bool = False
    limit: int = 100
    after: str | None = None


def _where_options(
    *, queue: bool = False, store: bool = True
) -> Callable[[Callable[..., R]], Callable[..., R]]:
    """Give a command the shared options in place of its ``where: _Where`` parameter.

    The options are ``--dsn --schema --namespace``, then ``--queue-schema`` (``queue``),
    then the keys and namespace settings (``store``).
    """
    bundle = (
        *_PLACE_OPTIONS,
        *(_QUEUE_OPTIONS if queue else ()),
        *(_STORE_OPTIONS if store else ()),
    )
    return _expand_options("where", bundle, _Where)


def _listing_options() -> Callable[[Callable[..., R]], Callable[..., R]]:
    """Give a command ``--json --limit --after`` in place of its ``listing: _Listing``."""
    return _expand_options("listing", _LISTING_OPTIONS, _Listing)


def _expand_options(
    placeholder: str, bundle: tuple[tuple[str, Any, Any], ...], build: Callable[..., Any]
) -> Callable[[Callable[..., R]], Callable[..., R]]:
    """Replace the ``placeholder`` parameter by the ``bundle`` options, in its place.

    typer reads the rewritten signature, so every command lists the options in the same
    order with the same help; the command receives ``build(**options)`` as ``placeholder``.
    """
    names = [name for name, _, _ in bundle]

    def decorate(command: Callable[..., R]) -> Callable[..., R]:
        params: list[inspect.Parameter] = []
        for param in inspect.signature(command, eval_str=True).parameters.values():
            if param.name == placeholder:
                params.extend(
                    inspect.Parameter(
                        name,
                        inspect.Parameter.POSITIONAL_OR_KEYWORD,
                        default=default,
                        annotation=option,
                    )
                    for name, option, default in bundle
                )
            else:
                params.append(param.replace(kind=inspect.Parameter.POSITIONAL_OR_KEYWORD))

        @functools.wraps(command)
        def wrapper(**kwargs: Any) -> R:
            kwargs[placeholder] = build(**{name: kwargs.pop(name) for name in names})
            return command(**kwargs)

        wrapper.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        return wrapper

    return decorate


# DSNs this invocation was given: every error line is scrubbed of their secrets.
_given_dsns: list[str] = []
_MAX_LINE = 1000


def _remember(dsn: str | None) -> str | None:
    if dsn is not None and dsn not in _given_dsns:
        _given_dsns.append(dsn)
    return dsn


def _one_line(text: str) -> str:
    """Scrub ``text`` of any given DSN's secrets and make it one bounded, printable line."""
    for dsn in (*_given_dsns, os.environ.get(DSN_ENV)):
        if dsn:
            text = scrub(text, dsn)
    text = " ".join(text.split())
    # Lone surrogates (from undecodable arguments) cannot be written to stdout/stderr.
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= _MAX_LINE else text[: _MAX_LINE - 3] + "..."


def _fail(error: CliError) -> typer.Exit:
    err.print(f"steeple: error: {_one_line(str(error))}", markup=False)
    if error.hint:
        err.print(f"  what to do: {_one_line(error.hint)}", markup=False)
    return typer.Exit(int(error.code))


def _run(body: Callable[[], Coroutine[Any, Any, T]], target: Target | None = None) -> T:
    """Run an async command body; turn every failure into one line and an exit code."""
    try:
        return asyncio.run(body())
    except typer.Exit:
        raise
    except KeyboardInterrupt:
        err.print("steeple: interrupted")
        raise typer.Exit(130) from None
    except Exception as exc:
        if os.environ.get("STEEPLE_DEBUG"):
            raise
        raise _fail(classify(exc, target)) from None


def _on_store(target: Target, op: Callable[[PostgresRecurringStore], Awaitable[T]]) -> T:
    """Connect to the target's recurring store, run ``op`` on it, close it (as :func:`_run`)."""

    async def body() -> T:
        store = await connect_store(target)
        try:
            return await op(store)
        finally:
            await store.close()

    return _run(body, target)


def _on_queue(target: Target, op: Callable[[PostgresTaskAdmin], Awaitable[T]]) -> T:
    """Open the target's work queue, run ``op`` on it, close it (as :func:`_run`)."""

    async def body() -> T:
        from steeple.admin.queue_admin import PostgresTaskAdmin

        async with PostgresTaskAdmin.open(target.dsn, schema=target.queue_schema) as admin:
            return await op(admin)

    return _run(body, target)


def _guard(fn: Callable[[], T]) -> T:
    try:
        return fn()
    except CliError as exc:
        raise _fail(exc) from None


def _typed(fn: Callable[[], T]) -> T:
    """Run ``fn``; a library configuration error becomes a configuration exit."""
    from steeple.core.errors import ConfigurationError

    try:
        return fn()
    except ConfigurationError as exc:
        raise CliError(str(exc), code=ExitCode.CONFIG) from None


def _check_limit(limit: int) -> None:
    if not 1 <= limit <= 100:
        raise _fail(CliError("--limit must be between 1 and 100", code=ExitCode.USAGE))


def _when(value: datetime | None) -> str:
    return "-" if value is None else value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")


def _print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2) + "\n")


def _print_page(
    page: Page[T],
    *,
    as_json: bool,
    to_json: Callable[[T], Any],
    title: str,
    columns: Iterable[str],
    row: Callable[[T], Sequence[str]],
) -> None:
    """Print one page of a listing as JSON or as a table, with the next page's cursor."""
    if as_json:
        _print_json({"items": [to_json(i) for i in page.items], "next_cursor": page.next_cursor})
        return
    table = Table(title=title)
    for column in columns:
        table.add_column(column)
    for item in page.items:
        table.add_row(*row(item))
    out.print(table)
    if page.next_cursor:
        out.print(f"more: --after {page.next_cursor}", markup=False)


# --- deployment --------------------------------------------------------------------------------


@app.command()
@_where_options()
def initialize(
    where: _Where,
    grant_to: Annotated[
        str | None,
        typer.Option(
            "--grant-to",
            help="Also grant this runtime role exactly the privileges it needs (grants.sql).",
        ),
    ] = None,
) -> None:
    """Create the recurring store's schema and a namespace (deployment role; idempotent)."""
    target = where.target()
    if grant_to is not None:
        from steeple.postgres import runtime_grant_statements

        # A name that cannot be granted literally is refused before anything is created.
        _guard(lambda: _typed(lambda: runtime_grant_statements(grant_to, where.schema)))

    async def body() -> None:
        store = await initialize_store(target)
        await store.close()
        if grant_to is not None:
            import asyncpg

            from steeple.postgres import grant_runtime_role

            conn = await asyncpg.connect(target.dsn, timeout=10)
            try:
                await grant_runtime_role(conn, grant_to, where.schema)
            finally:
                await conn.close()

    _run(body, target)
    out.print(
        _one_line(
            f"initialized namespace {where.namespace!r} in schema {where.schema!r} at "
            f"{redact_dsn(target.dsn)}"
        ),
        markup=False,
    )
    if grant_to is not None:
        out.print(
            _one_line(f"granted the runtime privileges on {where.schema!r} to role {grant_to!r}"),
            markup=False,
        )


@app.command()
@_where_options(queue=True, store=False)
def migrate(where: _Where) -> None:
    """Install or upgrade the work queue's tables (idempotent, forward-only)."""
    target = where.target()

    async def body() -> int:
        import asyncpg

        from steeple.postgres.queue import install

        conn = await asyncpg.connect(target.dsn, timeout=10)
        try:
            return int(await install(conn, schema=target.queue_schema))
        finally:
            await conn.close()

    version = _run(body, target)
    out.print(f"work queue schema {target.queue_schema!r} is at version {version}", markup=False)


# --- inspection --------------------------------------------------------------------------------


@app.command()
@_where_options()
@_listing_options()
def schedules(where: _Where, listing: _Listing) -> None:
    """List recurring definitions (metadata only)."""
    _check_limit(listing.limit)
    target = where.target()
    page = _on_store(
        target, lambda store: store.schedules(after=listing.after, limit=listing.limit)
    )
    _print_page(
        page,
        as_json=listing.as_json,
        to_json=schedule_json,
        title=f"schedules in {where.namespace}",
        columns=("name", "cron", "policy", "state", "topic", "next due (UTC)"),
        row=lambda s: (s.name, s.cron, s.policy.value, s.state, s.topic, _when(s.next_due_at)),
    )


@app.command()
@_where_options()
@_listing_options()
def occurrences(where: _Where, listing: _Listing) -> None:
    """List occurrences (metadata only: never payloads or lease credentials)."""
    _check_limit(listing.limit)
    target = where.target()
    page = _on_store(
        target, lambda store: store.occurrences(after=listing.after, limit=listing.limit)
    )
    _print_page(
        page,
        as_json=listing.as_json,
        to_json=occurrence_json,
        title=f"occurrences in {where.namespace}",
        columns=("id", "definition", "due (UTC)", "state", "attempts", "last error"),
        row=lambda o: (
            o.occurrence_id,
            o.definition_name,
            _when(o.due_at),
            o.state.value,
            str(o.attempts),
            o.last_error or "",
        ),
    )


@app.command()
@_where_options(queue=True, store=False)
@_listing_options()
def tasks(
    where: _Where,
    state: Annotated[str | None, typer.Option("--state", help="Only tasks in this state.")] = None,
    *,
    listing: _Listing,
) -> None:
    """List work-queue tasks (metadata only: never arguments or lease tokens)."""
    _check_limit(listing.limit)
    target = where.target()
    page = _on_queue(
        target,
        lambda admin: admin.tasks(after=listing.after, limit=listing.limit, state=state),
    )
    _print_page(
        page,
        as_json=listing.as_json,
        to_json=lambda t: t.to_json(),
        title=f"tasks in {target.queue_schema}",
        columns=("id", "name", "state", "attempts", "run at (UTC)", "last error"),
        row=lambda t: (
            str(t.task_id),
            t.name,
            t.state,
            f"{t.attempts}/{t.max_attempts}",
            _when(t.run_at),
            t.last_error or "",
        ),
    )


# --- operator actions --------------------------------------------------------------------------


@app.command()
@_where_options(queue=True)
def cancel(
    name: Annotated[
        str | None, typer.Argument(help="Name of the recurring definition to cancel.")
    ] = None,
    task: Annotated[
        int | None,
        typer.Option(
            "--task", min=1, max=2**63 - 1, help="Cancel this work-queue task id instead."
        ),
    ] = None,
    *,
    where: _Where,
) -> None:
    """Cancel a recurring definition for good (NAME), or a task (--task ID)."""
    if (name is None) == (task is None):
        raise _fail(
            CliError(
                "give either a definition NAME or --task ID",
                code=ExitCode.USAGE,
                hint="steeple cancel NAME  |  steeple cancel --task 42",
            )
        )
    target = where.target()
    if task is not None:
        task_id = task
        state = _on_queue(target, lambda admin: admin.cancel(task_id))
        if state is None:
            raise _fail(
                CliError(
                    f"there is no task {task_id}", code=ExitCode.FAILED, hint="see `steeple tasks`"
                )
            )
        if state != "cancelled":
            raise _fail(
                CliError(f"task {task_id} already finished ({state})", code=ExitCode.FAILED)
            )
        out.print(f"cancelled task {task_id}")
        return
    definition = name
    assert definition is not None
    info = _on_store(target, lambda store: store.cancel(definition))
    out.print(f"cancelled definition {info.name!r} (state {info.state})", markup=False)


@app.command()
@_where_options()
def retry(
    occurrence_id: Annotated[str, typer.Argument(help="Id of a dead occurrence.")],
    where: _Where,
) -> None:
    """Give a dead occurrence a fresh attempt budget (inside its delivery window)."""
    target = where.target()
    info = _on_store(target, lambda store: store.retry_failed(occurrence_id))
    out.print(f"occurrence {info.occurrence_id} is {info.state.value} again", markup=False)


@app.command()
@_where_options(queue=True)
def purge(
    older_than: Annotated[
        str, typer.Option("--older-than", help="Only records finished before this age (7d).")
    ] = "7d",
    limit: LimitOpt = 100,
    include_tasks: Annotated[
        bool, typer.Option("--tasks", help="Prune terminal work-queue tasks instead.")
    ] = False,
    *,
    where: _Where,
) -> None:
    """Remove terminal occurrences (or tasks with --tasks) older than --older-than."""
    _check_limit(limit)
    age = _guard(lambda: parse_duration(older_than, what="--older-than"))
    target = where.target()
    cutoff = datetime.now(UTC) - age
    if include_tasks:
        removed = _on_queue(target, lambda admin: admin.prune(cutoff, limit))
    else:
        removed = _on_store(target, lambda store: store.purge_terminal(cutoff, limit))
    what = "tasks" if include_tasks else "occurrences"
    out.print(f"purged {removed} terminal {what} older than {older_than}", markup=False)


# --- keys ---------------------------------------------------------------------------------------


@keys_app.command("generate")
def keys_generate(
    key_id: Annotated[
        str | None, typer.Option("--id", help="Key id (default: key-YYYYMMDD-HHMMSS).")
    ] = None,
) -> None:
    """Print a new 32-byte storage key as id:base64 (a secret: store it as one)."""
    from steeple.keyring import StorageKey

    chosen = key_id or datetime.now(UTC).strftime("key-%Y%m%d-%H%M%S")
    try:
        key = StorageKey.generate(chosen)
    except ValueError as exc:
        raise _fail(CliError(str(exc), code=ExitCode.USAGE)) from None
    sys.stdout.write(f"{key.key_id}:{key.to_base64()}\n")
    err.print(
        f"this is a secret: put it in {KEYS_ENV} or a keys file (chmod 600); "
        "to rotate, put the new key first and keep the old ones after it",
        markup=False,
    )


@keys_app.command("show")
def keys_show(
    keys_file: KeysFileOpt = None,
    dsn: DsnOpt = None,
    schema: SchemaOpt = "steeple",
    namespace: NamespaceOpt = "default",
    as_json: JsonOpt = False,
) -> None:
    """Show the configured key ids (the first seals), never the key material.

    With --dsn (or STEEPLE_DATABASE_URL) it also counts the namespace's records sealed under
    each key id: a previous key with none can be retired; an id in use but not configured
    must be added back.
    """
    keyring = _guard(lambda: load_keyring(keys_file))
    ids = list(keyring.key_ids)
    _remember(dsn or os.environ.get(DSN_ENV))
    chosen = _guard(lambda: resolve_dsn(dsn, required=False))
    usage: dict[str, int] | None = None
    if chosen is not None:
        target = Target(chosen, schema, NamespaceSettings(namespace))

        async def body() -> dict[str, int]:
            return await sealed_key_usage(chosen, schema, namespace)

        usage = _run(body, target)
    rows = []
    for key_id in dict.fromkeys([*ids, *(usage or {})]):
        role = ("primary" if key_id == ids[0] else "previous") if key_id in ids else "missing"
        rows.append(
            {
                "key_id": key_id,
                "role": role,
                "records": None if usage is None else usage.get(key_id, 0),
            }
        )
    if as_json:
        _print_json({"primary": ids[0], "key_ids": ids, "keys": rows})
        return
    table = Table(title="storage keys")
    table.add_column("key id")
    table.add_column("role")
    if usage is not None:
        table.add_column(f"records in {namespace}", justify="right")
    for row in rows:
        role = {
            "primary": "primary (seals)",
            "previous": "previous (opens only)",
            "missing": "NOT CONFIGURED: add it back",
        }[str(row["role"])]
        cells = [str(row["key_id"]), role]
        if usage is not None:
            cells.append(str(row["records"]))
        table.add_row(*cells)
    out.print(table)


async def sealed_key_usage(dsn: str, schema: str, namespace: str) -> dict[str, int]:
    """Count a namespace's sealed records (binding, definitions, occurrences) per key id.

    Raises:
        CliError: (config) the schema is not initialized; driver errors otherwise.
    """
    import asyncpg

    from steeple.postgres._ident import InvalidIdentifierError, quote_ident

    try:
        quoted = quote_ident(schema, what="schema")
    except InvalidIdentifierError as exc:
        raise CliError(str(exc), code=ExitCode.CONFIG, hint="check --schema") from None
    conn = await asyncpg.connect(dsn, timeout=10)
    try:
        if not await conn.fetchval(
            "SELECT to_regclass($1) IS NOT NULL", f"{quoted}.recurring_namespaces"
        ):
            raise CliError(
                f"schema {schema!r} holds no recurring store",
                code=ExitCode.CONFIG,
                hint="run `steeple initialize` first, or check --schema",
            )
        rows = await conn.fetch(
            f"""SELECT key_id, count(*) AS n FROM (
                SELECT binding_key_id AS key_id FROM {quoted}.recurring_namespaces
                 WHERE namespace = $1
                UNION ALL SELECT key_id FROM {quoted}.recurring_definitions
                 WHERE namespace = $1
                UNION ALL SELECT key_id FROM {quoted}.recurring_occurrences
                 WHERE namespace = $1 AND key_id IS NOT NULL
            ) AS sealed GROUP BY key_id ORDER BY key_id""",
            namespace,
        )
    finally:
        await conn.close()
    return {str(r["key_id"]): int(r["n"]) for r in rows}


# --- worker -------------------------------------------------------------------------------------


@app.command()
@_where_options(queue=True)
def worker(
    app_ref: Annotated[
        str, typer.Option("--app", help="module:object giving a steeple.admin.WorkerApp.")
    ],
    where: _Where,
) -> None:
    """Run the recurring relay and/or the task worker of your application until stopped.

    SIGINT or SIGTERM stops it gracefully: in-flight work finishes, nothing new starts.
    """
    from steeple.admin.worker import load_worker_app, run_worker

    target = where.target()
    spec = _guard(lambda: load_worker_app(app_ref))

    async def body() -> None:
        await run_worker(spec, target, log=lambda line: err.print(_one_line(line), markup=False))

    _run(body, target)
    err.print("steeple worker: stopped")


# --- admin ------------------------------------------------------------------------------------


@admin_app.command("serve")
@_where_options(queue=True)
def admin_serve(
    where: _Where,
    host: Annotated[str, typer.Option("--host", help="Interface to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=1, max=65535, help="TCP port.")] = 8520,
) -> None:
    """Serve the admin app for one namespace (HTTP basic auth with STEEPLE_ADMIN_TOKEN).

    Sign in with any user name and the token as password (or send
    ``Authorization: Bearer <token>``). State-changing API calls also need the
    ``X-Steeple-CSRF`` header equal to STEEPLE_ADMIN_CSRF_TOKEN (disabled if unset).
    """
    from steeple.admin.serve import serve

    target = where.target()
    token = os.environ.get("STEEPLE_ADMIN_TOKEN", "")
    if len(token) < 16:
        raise _fail(
            CliError(
                "STEEPLE_ADMIN_TOKEN is not set (or shorter than 16 characters)",
                code=ExitCode.CONFIG,
                hint=f"export STEEPLE_ADMIN_TOKEN={secrets.token_urlsafe(24)}",
            )
        )
    csrf = os.environ.get("STEEPLE_ADMIN_CSRF_TOKEN") or None
    if csrf is not None and len(csrf) < 16:
        raise _fail(
            CliError(
                "STEEPLE_ADMIN_CSRF_TOKEN must be at least 16 characters", code=ExitCode.CONFIG
            )
        )
    keyring = _guard(target.keyring)
    err.print(
        f"steeple admin: http://{host}:{port}/ui/{where.namespace} "
        f"(state changes {'enabled' if csrf else 'disabled: set STEEPLE_ADMIN_CSRF_TOKEN'})",
        markup=False,
    )
    _run(lambda: serve(target, keyring, token=token, csrf_token=csrf, host=host, port=port), target)


# --- demo ---------------------------------------------------------------------------------------


@app.command()
def demo(
    dsn: DsnOpt = None,
    schema: SchemaOpt = "steeple_demo",
    namespace: NamespaceOpt = "demo",
    data_dir: Annotated[
        Path,
        typer.Option(
            "--data-dir",
            help="Where the demo keeps its PostgreSQL cluster, "
            "key and journal (kept between runs).",
        ),
    ] = Path(".steeple/demo"),
    fresh: Annotated[
        bool,
        typer.Option(
            "--fresh",
            help="Start over: delete the data directory (with --dsn: drop the demo's schemas).",
        ),
    ] = False,
    duration: Annotated[float, typer.Option("--duration", help="Seconds to run (1-55).")] = 20.0,
    speed: Annotated[
        float, typer.Option("--speed", help="Clock speed-up for recurring schedules (1-600).")
    ] = 60.0,
    lose_every: Annotated[
        int,
        typer.Option(
            "--lose-ack-every",
            help="Lose the broker acknowledgement of every "
            "n-th publication, to show deduplication (0: never).",
        ),
    ] = 7,
) -> None:
    """Run both products end to end on the embedded default, with live progress.

    A private PostgreSQL, the SQLite journal broker, recurring publications on an
    accelerated clock, and work-queue tasks; a summary at the end. Without --dsn (or
    STEEPLE_DATABASE_URL) it starts a private PostgreSQL in --data-dir.
    """
    from steeple.admin.demo import DemoOptions, run_demo

    if not 1 <= duration <= 55:
        raise _fail(CliError("--duration must be between 1 and 55 seconds", code=ExitCode.USAGE))
    if lose_every < 0:
        raise _fail(CliError("--lose-ack-every must be 0 or more", code=ExitCode.USAGE))
    if not 1 <= speed <= 600:
        raise _fail(CliError("--speed must be between 1 and 600", code=ExitCode.USAGE))
    _remember(dsn or os.environ.get(DSN_ENV))
    chosen = _guard(lambda: resolve_dsn(dsn, required=False))
    options = DemoOptions(
        dsn=chosen,
        schema=schema,
        namespace=namespace,
        data_dir=data_dir.absolute(),
        fresh=fresh,
        duration=duration,
        speed=speed,
        lose_every=lose_every,
    )
    _run(lambda: run_demo(options, out))


app.command(name="simulate")(simulate_cli.simulate)


def main() -> None:
    """Run the ``steeple`` command."""
    # Library warnings (e.g. a superuser runtime role) go to stderr as one line each.
    logging.basicConfig(level=logging.WARNING, format="steeple: warning: %(message)s")
    app()
