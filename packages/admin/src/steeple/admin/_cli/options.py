"""The options commands share, in bundles, and how their values are resolved.

A command names a placeholder parameter (``where: Where``, ``listing: Listing``) and a
decorator (:func:`where_options`, :func:`listing_options`) puts the bundle's options in its
place, so every command lists them in the same order with the same help.

Precedence, for every setting: the command-line flag, then its environment variable, then
the settings file (``steeple.toml`` or ``--config``), then the built-in default.
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Final, TypeVar

import attrs
import typer
from typer.core import TyperCommand, TyperGroup

from steeple.admin.settings import (
    CONFIG_ENV,
    DSN_ENV,
    KEYS_ENV,
    SETTINGS_FILE,
    CliError,
    ExitCode,
    NamespaceSettings,
    SettingsFile,
    load_settings_file,
    parse_duration,
    redact_dsn,
    resolve_dsn,
)

if TYPE_CHECKING:
    from steeple.admin._backend import Target
    from steeple.admin.embedded import EmbeddedPostgres
    from steeple.postgres.pooler import Pooler

__all__ = [
    "DEFAULTS",
    "WHERE_PANEL",
    "AfterOpt",
    "ConfigOpt",
    "DryRunOpt",
    "DsnOpt",
    "GroupedCommand",
    "GroupedGroup",
    "JsonOpt",
    "KeysFileOpt",
    "LimitOpt",
    "Listing",
    "NamespaceOpt",
    "SchemaOpt",
    "Typer",
    "Where",
    "YesOpt",
    "listing_options",
    "remember_dsn",
    "stop_embedded",
    "where_options",
]

R = TypeVar("R")
F = TypeVar("F", bound=Callable[..., Any])

DEFAULTS: Final[dict[str, Any]] = {
    "schema": "steeple",
    "namespace": "default",
    "max_definitions": 1000,
    "max_occurrences": 100_000,
    "delivery_window": timedelta(days=1),
    "lease": timedelta(seconds=60),
}
"""What a setting is when no flag, environment variable or settings file gives it."""

_FROM_FILE = f"(default: as in {SETTINGS_FILE}, else {{}})"
WHERE_PANEL: Final = "Where (every command: flag, else environment, else steeple.toml)"
"""The heading the connection and namespace options are listed under in every --help."""

DsnOpt = Annotated[
    str | None,
    typer.Option(
        "--dsn",
        rich_help_panel=WHERE_PANEL,
        envvar=DSN_ENV,
        show_envvar=True,
        show_default=False,
        help="PostgreSQL URL, postgresql://user@host:5432/db, or libpq key=value pairs, "
        "'host=db1,db2 dbname=app user=app' (default: dsn or embedded in "
        f"{SETTINGS_FILE}).",
    ),
]
ConfigOpt = Annotated[
    Path | None,
    typer.Option(
        "--config",
        rich_help_panel=WHERE_PANEL,
        envvar=CONFIG_ENV,
        show_envvar=True,
        show_default=False,
        help=f"Settings file (default: {SETTINGS_FILE} in the current directory, if any).",
    ),
]
PoolerOpt = Annotated[
    str | None,
    typer.Option(
        "--pooler",
        rich_help_panel=WHERE_PANEL,
        envvar="STEEPLE_POOLER",
        show_envvar=True,
        show_default=False,
        help="'transaction' when the DSN leads through a connection pooler in transaction "
        "mode (PgBouncer pool_mode = transaction); default: pooler in "
        f"{SETTINGS_FILE}, else a direct connection.",
    ),
]
SchemaOpt = Annotated[
    str | None,
    typer.Option(
        "--schema",
        rich_help_panel=WHERE_PANEL,
        envvar="STEEPLE_SCHEMA",
        show_envvar=True,
        show_default=False,
        help="PostgreSQL schema of the recurring store " + _FROM_FILE.format("steeple") + ".",
    ),
]
NamespaceOpt = Annotated[
    str | None,
    typer.Option(
        "--namespace",
        "-n",
        rich_help_panel=WHERE_PANEL,
        envvar="STEEPLE_NAMESPACE",
        show_envvar=True,
        show_default=False,
        help="Recurring namespace " + _FROM_FILE.format("default") + ".",
    ),
]
QueueSchemaOpt = Annotated[
    str | None,
    typer.Option(
        "--queue-schema",
        rich_help_panel=WHERE_PANEL,
        envvar="STEEPLE_QUEUE_SCHEMA",
        show_envvar=True,
        show_default=False,
        help="PostgreSQL schema of the work queue (default: queue_schema in "
        f"{SETTINGS_FILE}, else SCHEMA_queue).",
    ),
]
KeysFileOpt = Annotated[
    Path | None,
    typer.Option(
        "--keys-file",
        rich_help_panel=WHERE_PANEL,
        envvar="STEEPLE_KEYS_FILE",
        show_envvar=True,
        show_default=False,
        help=f"File of storage keys, id:base64 one per line, first = primary (default: "
        f"{KEYS_ENV}, else keys_file in {SETTINGS_FILE}).",
    ),
]
MaxDefinitionsOpt = Annotated[
    int | None,
    typer.Option(
        "--max-definitions",
        rich_help_panel=WHERE_PANEL,
        envvar="STEEPLE_MAX_DEFINITIONS",
        show_envvar=True,
        show_default=False,
        help="Namespace quota of definitions, as initialized " + _FROM_FILE.format("1000") + ".",
    ),
]
MaxOccurrencesOpt = Annotated[
    int | None,
    typer.Option(
        "--max-occurrences",
        rich_help_panel=WHERE_PANEL,
        envvar="STEEPLE_MAX_OCCURRENCES",
        show_envvar=True,
        show_default=False,
        help="Namespace quota of occurrences, as initialized " + _FROM_FILE.format("100000") + ".",
    ),
]
WindowOpt = Annotated[
    str | None,
    typer.Option(
        "--delivery-window",
        rich_help_panel=WHERE_PANEL,
        envvar="STEEPLE_DELIVERY_WINDOW",
        show_envvar=True,
        show_default=False,
        help="Delivery window, as initialized, e.g. 1d " + _FROM_FILE.format("1d") + ".",
    ),
]
LeaseOpt = Annotated[
    str | None,
    typer.Option(
        "--lease",
        rich_help_panel=WHERE_PANEL,
        envvar="STEEPLE_LEASE",
        show_envvar=True,
        show_default=False,
        help="Lease duration, as initialized, e.g. 60s " + _FROM_FILE.format("60s") + ".",
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]
LimitOpt = Annotated[int, typer.Option("--limit", help="Rows per page (1-100).")]
AfterOpt = Annotated[
    str | None,
    typer.Option("--after", show_default=False, help="Exclusive cursor from a previous page."),
]
YesOpt = Annotated[
    bool,
    typer.Option(
        "--yes", "-y", help="Do it without asking (needed when there is no terminal to ask on)."
    ),
]
DryRunOpt = Annotated[bool, typer.Option("--dry-run", help="Count what would go; change nothing.")]

# (name, option, default) of each bundle, in --help order.
_PLACE: Final = (
    ("dsn", DsnOpt, None),
    ("config", ConfigOpt, None),
    ("pooler", PoolerOpt, None),
)
_SCHEMA: Final = (("schema", SchemaOpt, None),)
_NAMESPACE: Final = (("namespace", NamespaceOpt, None),)
_QUEUE: Final = (("queue_schema", QueueSchemaOpt, None),)
_STORE: Final = (
    ("keys_file", KeysFileOpt, None),
    ("max_definitions", MaxDefinitionsOpt, None),
    ("max_occurrences", MaxOccurrencesOpt, None),
    ("delivery_window", WindowOpt, None),
    ("lease", LeaseOpt, None),
)
_LISTING: Final = (
    ("as_json", JsonOpt, False),
    ("limit", LimitOpt, 100),
    ("after", AfterOpt, None),
)

# DSNs this invocation was given: every error line is scrubbed of their secrets.
given_dsns: list[str] = []
# Embedded servers this invocation started (stopped when the command ends).
_embedded: list[EmbeddedPostgres] = []


def remember_dsn(dsn: str | None) -> str | None:
    """Note a DSN this invocation was given, so output is scrubbed of its secrets."""
    if dsn and dsn not in given_dsns:
        given_dsns.append(dsn)
    return dsn


def stop_embedded() -> None:
    """Stop the embedded servers this invocation started (their data stays)."""
    while _embedded:
        _embedded.pop().stop()


def _given(value: str | None) -> str | None:
    """Treat an empty value as not given (an unset variable exported as empty)."""
    return value if value else None


@attrs.frozen
class Where:
    """The place options of one command invocation, as given (``None``: not given)."""

    dsn: str | None = attrs.field(default=None, repr=lambda d: repr(d and redact_dsn(d)))
    config: Path | None = None
    pooler: str | None = None
    schema: str | None = None
    namespace: str | None = None
    queue_schema: str | None = None
    keys_file: Path | None = None
    max_definitions: int | None = None
    max_occurrences: int | None = None
    delivery_window: str | None = None
    lease: str | None = None

    def settings_file(self) -> SettingsFile:
        """Read the settings file (``--config``, else ``./steeple.toml`` if present).

        Raises:
            CliError: (config) an unreadable or malformed file.
        """
        return load_settings_file(self.config)

    def target(self, *, embedded: bool = True) -> Target:
        """Resolve every setting and return where the command works.

        Without a DSN anywhere but with ``embedded`` in the settings file, starts the
        embedded PostgreSQL in that directory for the rest of the command (``embedded``
        false: refuse instead).

        Raises:
            CliError: no database given; a malformed DSN, file or value.
        """
        from steeple.admin._backend import Target

        remember_dsn(self.dsn)
        remember_dsn(os.environ.get(DSN_ENV))
        file = self.settings_file()
        remember_dsn(file.dsn)
        dsn = _given(self.dsn) or file.dsn
        on_embedded = dsn is None and file.embedded is not None and embedded
        if on_embedded:
            assert file.embedded is not None
            dsn = _start_embedded(file.embedded)
        resolved = remember_dsn(resolve_dsn(dsn, required=True))
        assert resolved is not None
        # The file's listen_dsn (steeple worker: --listen-dsn / STEEPLE_LISTEN_DSN win).
        remember_dsn(file.listen_dsn)
        listen_dsn = remember_dsn(
            resolve_dsn(file.listen_dsn, source="listen_dsn in the settings file")
            if file.listen_dsn
            else None
        )
        schema = self.schema if self.schema is not None else file.schema
        settings = NamespaceSettings(
            namespace=_pick(self.namespace, file.namespace, "namespace"),
            max_definitions=_pick(self.max_definitions, file.max_definitions, "max_definitions"),
            max_occurrences=_pick(self.max_occurrences, file.max_occurrences, "max_occurrences"),
            delivery_window=_duration(
                self.delivery_window, "--delivery-window", file.delivery_window, "delivery_window"
            ),
            lease_duration=_duration(self.lease, "--lease", file.lease, "lease"),
        )
        return Target(
            resolved,
            schema if schema is not None else DEFAULTS["schema"],
            settings,
            self.keys_file,
            _given(self.queue_schema) or file.queue_schema,
            fallback_keys_file=file.keys_file,
            embedded=on_embedded,
            pooler=_pooler(_given(self.pooler) or file.pooler),
            listen_dsn=listen_dsn,
        )


def _pooler(value: str | None) -> Pooler | None:
    from steeple.postgres.pooler import PoolerProblem, check_pooler

    try:
        return check_pooler(value)
    except PoolerProblem as exc:
        raise CliError(
            str(exc),
            code=ExitCode.CONFIG,
            hint=f"fix --pooler or STEEPLE_POOLER (or pooler in {SETTINGS_FILE})",
        ) from None


def _pick(flag: Any, from_file: Any, name: str) -> Any:
    if flag is not None:
        return flag
    return from_file if from_file is not None else DEFAULTS[name]


def _duration(flag: str | None, option: str, from_file: timedelta | None, name: str) -> timedelta:
    if flag is not None:
        return parse_duration(flag, what=option)
    chosen: timedelta = from_file if from_file is not None else DEFAULTS[name]
    return chosen


def _start_embedded(data_dir: Path) -> str:
    from steeple.admin.embedded import EmbeddedPostgres

    if not (data_dir / "pgdata").is_dir():
        raise CliError(
            f"the settings file names an embedded PostgreSQL in {str(data_dir)!r}, but it "
            "holds none",
            code=ExitCode.CONFIG,
            hint="run steeple demo first (it creates it), or set dsn instead of embedded",
        )
    server = EmbeddedPostgres(data_dir)
    dsn = server.start()
    _embedded.append(server)
    return dsn


@attrs.frozen
class Listing:
    """The paging options of a listing command."""

    as_json: bool = False
    limit: int = 100
    after: str | None = None


def where_options(
    *, queue: bool = False, store: bool = True, namespace: bool | None = None
) -> Callable[[Callable[..., R]], Callable[..., R]]:
    """Give a command the place options in place of its ``where: Where`` parameter.

    ``--dsn --config --schema``, then ``--namespace`` (``namespace``, default: ``store``),
    ``--queue-schema`` (``queue``), then the keys and namespace settings (``store``).
    """
    with_namespace = store if namespace is None else namespace
    bundle = (
        *_PLACE,
        *_SCHEMA,
        *(_NAMESPACE if with_namespace else ()),
        *(_QUEUE if queue else ()),
        *(_STORE if store else ()),
    )
    return _expand_options("where", bundle, Where)


def listing_options() -> Callable[[Callable[..., R]], Callable[..., R]]:
    """Give a command ``--json --limit --after`` in place of its ``listing: Listing``."""
    return _expand_options("listing", _LISTING, Listing)


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


def _format_grouped(command: Any, ctx: Any, formatter: Any) -> None:
    """List a command's own options first, then each titled group (the place options)."""
    arguments: list[tuple[str, str]] = []
    own: list[tuple[str, str]] = []
    panels: dict[str, list[tuple[str, str]]] = {}
    for param in command.get_params(ctx):
        record = param.get_help_record(ctx)
        if record is None:
            continue
        if param.param_type_name == "argument":
            arguments.append(record)
            continue
        panel = getattr(param, "rich_help_panel", None)
        (panels.setdefault(panel, []) if panel else own).append(record)
    for title, records in (("Arguments", arguments), ("Options", own), *panels.items()):
        if records:
            with formatter.section(title):
                formatter.write_dl(records)


class GroupedCommand(TyperCommand):
    """A command whose --help lists the place options under one heading, after its own."""

    def format_options(self, ctx: Any, formatter: Any) -> None:
        _format_grouped(self, ctx, formatter)


class GroupedGroup(TyperGroup):
    """A command group whose --help lists the place options as :class:`GroupedCommand`."""

    def format_options(self, ctx: Any, formatter: Any) -> None:
        _format_grouped(self, ctx, formatter)
        self.format_commands(ctx, formatter)


class Typer(typer.Typer):
    """A ``typer.Typer`` whose commands and groups list their place options apart."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("cls", GroupedGroup)
        kwargs.setdefault("rich_markup_mode", None)
        super().__init__(**kwargs)

    def command(self, name: str | None = None, **kwargs: Any) -> Callable[[F], F]:
        """Declare a command (as ``typer.Typer.command``), of class :class:`GroupedCommand`."""
        kwargs.setdefault("cls", GroupedCommand)
        decorate: Callable[[F], F] = super().command(name, **kwargs)
        return decorate
