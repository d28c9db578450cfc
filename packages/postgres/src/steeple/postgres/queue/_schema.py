"""Installing and checking the queue schema: forward-only migrations shipped as package data."""

from __future__ import annotations

import contextlib
import functools
import importlib.resources
import re
import weakref
from collections.abc import Awaitable, Callable
from typing import Any, Final, ParamSpec, TypeVar

from steeple.postgres._durability import (
    WRITABLE_QUERY,
    DurabilityProblem,
    check_schema_name,
    require_writable,
)
from steeple.postgres._ident import quote_ident, shown_name
from steeple.postgres.queue import _driver
from steeple.postgres.queue._driver import errors_typed, errors_typed_sync
from steeple.postgres.queue.errors import (
    QueueConfigurationError,
    QueueError,
    QueueTypeError,
    SchemaVersionMismatchError,
    UnfitDatabaseError,
)
from steeple.postgres.sqlstate import is_missing_object, sqlstate

__all__ = [
    "DEFAULT_SCHEMA",
    "LIBRARY_SCHEMA_VERSION",
    "check_schema",
    "entry_point",
    "entry_point_sync",
    "install",
]

P = ParamSpec("P")
R = TypeVar("R")

DEFAULT_SCHEMA: Final = "steeple_queue"
_SCHEMA_NAME = re.compile(r"[a-z_][a-z0-9_]{0,62}")
_MIGRATIONS: Final[tuple[tuple[int, str], ...]] = (
    (1, "0001_create_queue_tables"),
    (2, "0002_due_work_survives_clock_steps"),
    (5, "0005_job_time_zones_and_trace_context"),
    (6, "0006_named_queues_and_limits"),
    (7, "0007_results_progress_and_failure_details"),
    (8, "0008_claim_reads_tasks_by_index"),
    (9, "0009_claim_in_one_statement"),
    (10, "0010_vacuum_and_bounded_counts"),
    (11, "0011_claim_limits_written_once"),
    (12, "0012_workflows"),
    (13, "0013_claim_walks_from_a_position"),
    (14, "0014_per_key_limits"),
    (15, "0015_workflow_limit_keys"),
    (16, "0016_complete_and_claim"),
    (17, "0017_limited_claim_planned_lean"),
    (18, "0018_claim_keeps_its_plans"),
    (19, "0019_pending_tasks_listed_by_id"),
)
LIBRARY_SCHEMA_VERSION: Final = _MIGRATIONS[-1][0]
"""The schema version this library reads and writes."""


def validate_schema(schema: str) -> str:
    """Return the quoted identifier of ``schema``.

    Raises:
        QueueConfigurationError: not a lowercase identifier of 1-63 characters, or a name
            PostgreSQL reserves (``pg_*``: ``pg_temp`` would make the tables temporary).
        QueueTypeError: not a str.
    """
    if not isinstance(schema, str):
        raise QueueTypeError(f"schema must be a str, not {type(schema).__name__}")
    if not _SCHEMA_NAME.fullmatch(schema):
        raise QueueConfigurationError(
            f"schema must be a lowercase identifier ([a-z_][a-z0-9_]*, at most 63 chars), "
            f"got {shown_name(schema)}"
        )
    try:
        check_schema_name(schema)
    except DurabilityProblem as exc:
        raise QueueConfigurationError(str(exc)) from None
    return quote_ident(schema, what="schema")


def notify_channel(schema: str) -> str:
    """Return the LISTEN/NOTIFY channel that wakes workers of ``schema``."""
    return f"steeple_q_{schema}"[:63]


def _migration_sql(directory: str, quoted_schema: str) -> str:
    text = (
        importlib.resources.files("steeple.postgres.queue")
        .joinpath("migrations", directory, "up.sql")
        .read_text(encoding="utf-8")
    )
    return text.replace("__SCHEMA__", quoted_schema)


@errors_typed
async def install(conn: Any, *, schema: str = DEFAULT_SCHEMA) -> int:
    """Create or migrate the queue schema; idempotent and safe to run concurrently.

    Runs in one transaction under an advisory lock keyed by the schema name, applies the
    migrations newer than the recorded version, and records each one.

    Args:
        conn: an asyncpg connection (not in a transaction).
        schema: the PostgreSQL schema to install into (created if missing).

    Returns:
        The schema version now installed.

    Raises:
        QueueConfigurationError: invalid or reserved schema name.
        SchemaVersionMismatchError: the database is newer than this library.
        UnfitDatabaseError: a standby or read-only session, or the server refused the
            write (a full disk); nothing was installed.
    """
    quoted = validate_schema(schema)
    async with conn.transaction():
        await conn.execute("SET LOCAL synchronous_commit = on")
        try:
            require_writable(*(await conn.fetchrow(WRITABLE_QUERY)))
        except DurabilityProblem as exc:
            raise UnfitDatabaseError(str(exc), setting=exc.setting) from None
        await conn.execute(
            "SELECT pg_advisory_xact_lock(hashtext('steeple_queue_install'), hashtext($1))",
            schema,
        )
        await conn.execute(f"CREATE SCHEMA IF NOT EXISTS {quoted}")
        await conn.execute(
            f"CREATE TABLE IF NOT EXISTS {quoted}.schema_migrations ("
            " version integer PRIMARY KEY,"
            " name text NOT NULL,"
            " applied_at timestamptz NOT NULL DEFAULT clock_timestamp())"
        )
        current = await conn.fetchval(
            f"SELECT coalesce(max(version), 0) FROM {quoted}.schema_migrations"
        )
        if current > LIBRARY_SCHEMA_VERSION:
            raise SchemaVersionMismatchError(schema, current, LIBRARY_SCHEMA_VERSION)
        for version, name in _MIGRATIONS:
            if version <= current:
                continue
            await conn.execute(_migration_sql(name, quoted))
            await conn.execute(
                # Each shipped migration records its own version (so it can be applied
                # by hand); recording it here too keeps any file that does not correct.
                f"INSERT INTO {quoted}.schema_migrations (version, name) VALUES ($1, $2)"
                " ON CONFLICT (version) DO NOTHING",
                version,
                name,
            )
    return LIBRARY_SCHEMA_VERSION


async def schema_version(conn: Any, schema: str) -> int:
    """Return the installed queue schema version (0 when not installed).

    Raises:
        QueueConfigurationError: invalid schema name.
    """
    quoted = validate_schema(schema)
    ((exists,),) = await _driver.fetch(
        conn, "SELECT to_regclass($1) IS NOT NULL", f"{quoted}.schema_migrations"
    )
    if not exists:
        return 0
    ((version,),) = await _driver.fetch(
        conn, f"SELECT coalesce(max(version), 0) FROM {quoted}.schema_migrations"
    )
    return int(version)


@errors_typed
async def check_schema(conn: Any, schema: str = DEFAULT_SCHEMA) -> None:
    """Fail unless the database holds exactly this library's queue schema version.

    Args:
        conn: an asyncpg connection or pool, or a psycopg ``AsyncConnection``.
        schema: the queue's PostgreSQL schema.

    Raises:
        SchemaVersionMismatchError: not installed, older or newer than the library.
        QueueConfigurationError: invalid schema name.
    """
    version = await schema_version(conn, schema)
    if version != LIBRARY_SCHEMA_VERSION:
        raise SchemaVersionMismatchError(schema, version, LIBRARY_SCHEMA_VERSION)


def _schema_version_sync(conn: Any, schema: str) -> int:
    """Like :func:`schema_version`, on a psycopg (sync) connection."""
    quoted = validate_schema(schema)
    ((exists,),) = _driver.fetch_sync(
        conn, "SELECT to_regclass($1) IS NOT NULL", f"{quoted}.schema_migrations"
    )
    if not exists:
        return 0
    ((version,),) = _driver.fetch_sync(
        conn, f"SELECT coalesce(max(version), 0) FROM {quoted}.schema_migrations"
    )
    return int(version)


# (session, schema) pairs already found at this library's version: each session's version
# is read once, before its first statement (a statement failing on a missing column would
# abort the caller's transaction, leaving nothing to read the version with; and a statement
# an old schema happens to accept must not write to it either). Weak: a closed connection
# or pool leaves the cache with its object.
_CURRENT: weakref.WeakKeyDictionary[Any, set[str]] = weakref.WeakKeyDictionary()


def _session(conn: Any) -> Any:
    """Return the object that lives exactly as long as ``conn``'s session (or pool)."""
    if _driver.connection_kind(conn) == "asyncpg":
        import asyncpg.pool

        # asyncpg hands out a new proxy object per acquire; the connection behind it
        # lasts. A pool cannot be weakly referenced; its queue of idle connections lives
        # exactly as long as it does.
        if isinstance(conn, asyncpg.pool.PoolConnectionProxy):
            return getattr(conn, "_con", None) or conn
        if isinstance(conn, asyncpg.Pool):
            return getattr(conn, "_queue", conn)
    return conn


def _cached(conn: Any, schema: str) -> bool:
    try:
        return schema in _CURRENT.get(_session(conn), ())
    except TypeError:  # not weakly referenceable: never cached
        return False


def _remember(conn: Any, schema: str) -> None:
    with contextlib.suppress(TypeError):  # not weakly referenceable: never cached
        _CURRENT.setdefault(_session(conn), set()).add(schema)


def _missing_object(exc: BaseException) -> bool:
    # What a statement of this library meets on an older (or absent) schema: a table,
    # column, function or the schema itself that its version lacks.
    return is_missing_object(sqlstate(exc))


def entry_point(fn: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R]]:
    """Make ``fn(conn, ..., schema=...)`` refuse a schema of another version, then type errors.

    A schema older or newer than the library (or absent) raises
    :class:`SchemaVersionMismatchError` naming both versions, never the driver's missing
    table or column. The version is read once per session (connection or pool) and schema,
    before its first statement; a statement that still meets a missing object (the schema
    was dropped and rebuilt since) has the version read again, when the session can.
    """
    typed = errors_typed(fn)

    @functools.wraps(fn)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        conn = args[0] if args else kwargs.get("conn")
        schema = kwargs.get("schema", DEFAULT_SCHEMA)
        if isinstance(schema, str) and _driver_kind_known(conn) and not _cached(conn, schema):
            await errors_typed(_require_current)(conn, schema)
        try:
            return await typed(*args, **kwargs)
        except Exception as exc:
            cause = exc if exc.__cause__ is None else exc.__cause__
            if not _missing_object(cause) or _driver.in_transaction(conn):
                raise
            version = await errors_typed(schema_version)(conn, schema)  # type: ignore[arg-type]
            if version == LIBRARY_SCHEMA_VERSION:
                raise
            raise SchemaVersionMismatchError(
                str(schema), version, LIBRARY_SCHEMA_VERSION
            ) from cause

    return wrapper


def entry_point_sync(fn: Callable[P, R]) -> Callable[P, R]:
    """Like :func:`entry_point`, for the psycopg (sync) functions."""
    typed = errors_typed_sync(fn)

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        conn = args[0] if args else kwargs.get("conn")
        schema = kwargs.get("schema", DEFAULT_SCHEMA)
        if (
            isinstance(schema, str)
            and _driver_kind_known(conn, sync=True)
            and not _cached(conn, schema)
        ):
            errors_typed_sync(_require_current_sync)(conn, schema)
        try:
            return typed(*args, **kwargs)
        except Exception as exc:
            cause = exc if exc.__cause__ is None else exc.__cause__
            if not _missing_object(cause) or _driver.in_transaction(conn):
                raise
            version = errors_typed_sync(_schema_version_sync)(conn, schema)  # type: ignore[arg-type]
            if version == LIBRARY_SCHEMA_VERSION:
                raise
            raise SchemaVersionMismatchError(
                str(schema), version, LIBRARY_SCHEMA_VERSION
            ) from cause

    return wrapper


def _driver_kind_known(conn: Any, *, sync: bool = False) -> bool:
    """Tell whether ``conn`` is a connection the entry point itself would accept."""
    try:
        kind = _driver.connection_kind(conn)
    except QueueError:
        return False  # the entry point says so itself
    return (kind == "psycopg_sync") == sync


async def _require_current(conn: Any, schema: str) -> None:
    version = await schema_version(conn, schema)
    if version != LIBRARY_SCHEMA_VERSION:
        raise SchemaVersionMismatchError(schema, version, LIBRARY_SCHEMA_VERSION)
    _remember(conn, schema)


def _require_current_sync(conn: Any, schema: str) -> None:
    version = _schema_version_sync(conn, schema)
    if version != LIBRARY_SCHEMA_VERSION:
        raise SchemaVersionMismatchError(schema, version, LIBRARY_SCHEMA_VERSION)
    _remember(conn, schema)
