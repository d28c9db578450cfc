"""Installing and checking the queue schema: forward-only migrations shipped as package data."""

from __future__ import annotations

import importlib.resources
import re
from typing import Any, Final

from steeple.postgres._durability import (
    WRITABLE_QUERY,
    DurabilityProblem,
    check_schema_name,
    require_writable,
)
from steeple.postgres._ident import quote_ident, shown_name
from steeple.postgres.queue._driver import errors_typed
from steeple.postgres.queue.errors import (
    QueueConfigurationError,
    QueueTypeError,
    SchemaVersionMismatchError,
    UnfitDatabaseError,
)

__all__ = ["DEFAULT_SCHEMA", "LIBRARY_SCHEMA_VERSION", "check_schema", "install"]

DEFAULT_SCHEMA: Final = "steeple_queue"
_SCHEMA_NAME = re.compile(r"[a-z_][a-z0-9_]{0,62}")
_MIGRATIONS: Final[tuple[tuple[int, str], ...]] = (
    (1, "0001_create_queue_tables"),
    (2, "0002_due_work_survives_clock_steps"),
    (5, "0005_job_time_zones_and_trace_context"),
    (6, "0006_named_queues_and_limits"),
    (7, "0007_results_progress_and_failure_details"),
    (8, "0008_claim_reads_tasks_by_index"),
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
                f"INSERT INTO {quoted}.schema_migrations (version, name) VALUES ($1, $2)",
                version,
                name,
            )
    return LIBRARY_SCHEMA_VERSION


async def schema_version(conn: Any, schema: str) -> int:
    """Return the installed queue schema version (0 when not installed).

    Raises:
        QueueConfigurationError: invalid schema name.
    """
    from steeple.postgres.queue import _driver

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
