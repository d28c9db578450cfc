"""Fail-closed checks shared by steeple's PostgreSQL adapters.

Before a store does any work it verifies that PostgreSQL will keep what it acknowledges
(permanent tables, ``fsync``, ``full_page_writes``, ``synchronous_commit``, a writable
primary), that a remote connection uses verified TLS, and that the runtime role holds the
privileges it needs and no more than it should.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, TypeAlias
from urllib.parse import parse_qs, unquote, urlsplit

import asyncpg

from steeple.core.cluster import ClusterIdentity
from steeple.core.dsn import check_dsn
from steeple.core.errors import ConfigurationError
from steeple.postgres._ident import quote_ident, shown_name
from steeple.postgres.sqlstate import (
    DISK_FULL,
    READ_ONLY_TRANSACTION,
    TOO_MANY_CONNECTIONS,
    is_insufficient_resources,
    sqlstate,
)

if TYPE_CHECKING:
    from asyncpg.pool import PoolConnectionProxy

__all__ = [
    "IDENTITY_QUERY",
    "SERVER_QUERY",
    "TABLES_QUERY",
    "WRITABLE_QUERY",
    "AnyConnection",
    "DurabilityProblem",
    "check_privileges",
    "check_schema_name",
    "check_server_durability",
    "check_tables_permanent",
    "check_transport",
    "cluster_identity",
    "quote_ident",
    "require_durable_server",
    "require_permanent_tables",
    "require_writable",
    "write_refusal",
]

_VERIFIED_SSL_MODES = frozenset({"verify-full", "verify-ca"})
# Every synchronous_commit value except "off" flushes the local WAL before COMMIT returns
# (see require_durable_server and the operations guide's durability checks).
_DURABLE_SYNC_COMMIT = frozenset({"on", "local", "remote_write", "remote_apply"})


AnyConnection: TypeAlias = (
    "asyncpg.Connection[asyncpg.Record] | PoolConnectionProxy[asyncpg.Record]"
)
"""A plain or pooled asyncpg connection."""


class DurabilityProblem(Exception):
    """Internal: a failed check, turned into the adapter's own typed error by the caller."""

    def __init__(self, message: str, *, setting: str) -> None:
        super().__init__(message)
        self.setting = setting


def _is_loopback(host: str) -> bool:
    if not host or host.startswith("/") or host.startswith("@"):
        return True  # a Unix-domain socket (path or abstract namespace)
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _dsn_hosts(dsn: str) -> tuple[list[str], dict[str, list[str]]]:
    parts = urlsplit(dsn)
    if parts.scheme not in {"postgres", "postgresql"}:
        raise DurabilityProblem("the DSN must be a postgresql:// URI", setting="dsn")
    query = parse_qs(parts.query)
    netloc = parts.netloc.rpartition("@")[2]
    hosts: list[str] = []
    for item in netloc.split(","):
        if item.startswith("["):
            hosts.append(item[1 : item.find("]")])
        else:
            hosts.append(unquote(item.rpartition(":")[0] if ":" in item else item))
    for listed in query.get("host", []):
        hosts.extend(listed.split(","))  # host=a,b: several hosts (a failover setup)
    if not any(hosts):
        hosts = [os.environ.get("PGHOST", "")]
    return [h for h in hosts if h is not None], query


def check_transport(dsn: str) -> None:
    """Refuse a remote connection that does not verify the server's certificate.

    A Unix socket or a loopback host may use any mode. Any other host requires
    ``sslmode=verify-full`` or ``verify-ca`` (in the DSN or ``PGSSLMODE``).

    Raises:
        DurabilityProblem: with ``setting="dsn"`` when the DSN is malformed (see
            :func:`steeple.core.dsn.check_dsn`; the message never quotes the DSN), with
            ``setting="sslmode"`` when TLS is not verified.
    """
    try:
        check_dsn(dsn)
    except ConfigurationError as exc:
        raise DurabilityProblem(str(exc), setting="dsn") from None
    hosts, query = _dsn_hosts(dsn)
    remote = [h for h in hosts if not _is_loopback(h)]
    if not remote:
        return
    modes = query.get("sslmode") or [os.environ.get("PGSSLMODE", "prefer")]
    mode = modes[-1]
    if mode not in _VERIFIED_SSL_MODES:
        raise DurabilityProblem(
            f"the connection to {remote[0]!r} is remote and uses sslmode={mode!r}; remote "
            "connections require verified TLS: add sslmode=verify-full (or verify-ca) and "
            "sslrootcert to the DSN",
            setting="sslmode",
        )


SERVER_QUERY = (
    "SELECT current_setting('fsync') AS fsync,"
    " current_setting('full_page_writes') AS full_page_writes,"
    " current_setting('synchronous_commit') AS synchronous_commit,"
    " pg_is_in_recovery() AS in_recovery,"
    " current_setting('default_transaction_read_only') AS default_ro,"
    " current_setting('transaction_read_only') AS tx_ro"
)
"""What :func:`require_durable_server` judges, one row in that column order (any driver)."""

IDENTITY_QUERY = (
    "SELECT s.system_identifier,"
    # A primary writes on the timeline of its current WAL file (the first 8 hex digits of
    # its name): right after a promotion, before any checkpoint records it. A standby has no
    # current WAL position (it is refused as read-only anyway): its last checkpoint's.
    " CASE WHEN pg_is_in_recovery()"
    " THEN (SELECT c.timeline_id FROM pg_catalog.pg_control_checkpoint() c)"
    " ELSE ('x' || substr(pg_catalog.pg_walfile_name(pg_catalog.pg_current_wal_lsn()), 1, 8))"
    "::bit(32)::integer END"
    " FROM pg_catalog.pg_control_system() s"
)
"""``(system_identifier, timeline)`` of the node a connection reached (any driver, any role).

Read once per new connection; :func:`cluster_identity` turns the row into the value
:class:`steeple.core.cluster.ClusterWatch` judges."""


def cluster_identity(row: Sequence[object]) -> ClusterIdentity:
    """Read an :data:`IDENTITY_QUERY` row as a :class:`~steeple.core.cluster.ClusterIdentity`."""
    system_identifier, timeline = row[0], row[1]
    assert isinstance(system_identifier, int)
    assert isinstance(timeline, int)
    return ClusterIdentity(system_identifier=system_identifier, timeline=timeline)


WRITABLE_QUERY = (
    "SELECT pg_is_in_recovery() AS in_recovery,"
    " current_setting('default_transaction_read_only') AS default_ro,"
    " current_setting('transaction_read_only') AS tx_ro"
)
"""What :func:`require_writable` judges, one row in that column order (any driver)."""

TABLES_QUERY = (
    "SELECT c.relname::text, c.relpersistence::text FROM pg_catalog.pg_class c"
    " JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace"
    " WHERE n.nspname = $1 AND c.relname = ANY($2::text[]) AND c.relkind IN ('r', 'p')"
)
"""``(relname, relpersistence)`` of the named tables of a schema; ``$1`` schema, ``$2`` names."""


def require_writable(in_recovery: object, default_ro: object, tx_ro: object) -> None:
    """Refuse a standby or a read-only session (the :data:`WRITABLE_QUERY` row).

    Raises:
        DurabilityProblem: ``setting="pg_is_in_recovery"`` for a standby,
            ``setting="default_transaction_read_only"`` for a read-only session.
    """
    if in_recovery:
        raise DurabilityProblem(
            "PostgreSQL is a standby in recovery (pg_is_in_recovery() is true), which is "
            "read-only; connect to the writable primary",
            setting="pg_is_in_recovery",
        )
    if default_ro != "off" or tx_ro != "off":
        raise DurabilityProblem(
            "the session is read-only (default_transaction_read_only is on for the server, "
            "database, role or connection); use a writable primary and a writable role",
            setting="default_transaction_read_only",
        )


def require_durable_server(
    fsync: object,
    full_page_writes: object,
    synchronous_commit: object,
    in_recovery: object,
    default_ro: object,
    tx_ro: object,
) -> None:
    """Refuse settings that could lose acknowledged commits (the :data:`SERVER_QUERY` row).

    Every ``synchronous_commit`` level but ``off`` flushes the local WAL before a commit
    returns, so on, local, remote_write and remote_apply are accepted (on a single node
    they all wait for the local flush; with synchronous standbys the three remote levels
    wait for them too).

    Raises:
        DurabilityProblem: naming the setting at fault (``fsync``, ``full_page_writes``,
            ``synchronous_commit``, ``pg_is_in_recovery``, ``default_transaction_read_only``).
    """
    if fsync != "on":
        raise DurabilityProblem(
            "PostgreSQL runs with fsync=off, so a crash can lose or corrupt committed work; "
            "set fsync=on",
            setting="fsync",
        )
    if full_page_writes != "on":
        raise DurabilityProblem(
            "PostgreSQL runs with full_page_writes=off, so a crash can corrupt pages; set "
            "full_page_writes=on",
            setting="full_page_writes",
        )
    if synchronous_commit not in _DURABLE_SYNC_COMMIT:
        raise DurabilityProblem(
            f"synchronous_commit is {synchronous_commit!r} for this session (server, "
            "database, role or connection option), so acknowledged commits can be lost in a "
            "crash; remove that setting (ALTER ROLE ... RESET synchronous_commit)",
            setting="synchronous_commit",
        )
    require_writable(in_recovery, default_ro, tx_ro)


def require_permanent_tables(schema: str, tables: Sequence[str], found: Mapping[str, str]) -> None:
    """Require every table to exist and be permanent (``found``: the :data:`TABLES_QUERY` rows).

    Raises:
        DurabilityProblem: ``setting="missing_table"`` when a table does not exist,
            ``setting="relpersistence"`` when one is unlogged or temporary.
    """
    for table in tables:
        if table not in found:
            raise DurabilityProblem(
                f"table {schema}.{table} does not exist; run initialize (or install) with the "
                "deployment role first (connect never creates or repairs tables)",
                setting="missing_table",
            )
        persistence = found[table]
        if persistence != "p":
            kind = "unlogged" if persistence == "u" else "temporary"
            raise DurabilityProblem(
                f"table {schema}.{table} is {kind} (pg_class.relpersistence={persistence!r}), "
                f"so its rows do not survive a crash; run ALTER TABLE {schema}.{table} "
                "SET LOGGED",
                setting="relpersistence",
            )


def check_schema_name(schema: str) -> None:
    """Refuse a schema name PostgreSQL reserves (``pg_*``, ``information_schema``).

    ``pg_temp`` names the session's temporary schema: tables created or read through it
    would be temporary (gone with the session, invisible to every other connection), and
    the other reserved names belong to the system.

    Raises:
        DurabilityProblem: ``setting="schema"``.
    """
    # PostgreSQL's own rule (IsReservedName) is this case-sensitive prefix.
    if schema.startswith("pg_") or schema == "information_schema":
        what = (
            "the session's temporary schema, whose tables vanish with the session"
            if schema.startswith("pg_temp")
            else "a system schema"
        )
        raise DurabilityProblem(
            f"schema {shown_name(schema)} is reserved by PostgreSQL ({what}); choose another name",
            setting="schema",
        )


def write_refusal(exc: BaseException) -> tuple[str, str] | None:
    """Explain a server error that says the database cannot take this write, by SQLSTATE.

    Works for asyncpg and psycopg errors (both carry ``sqlstate``).

    Returns:
        ``(setting, message)``, setting ``"read_only"`` (SQLSTATE 25006) or ``"disk_full"``
        (53100), or ``"insufficient_resources"`` (other class 53 errors: memory, limits);
        ``None`` for any other error.
    """
    state = sqlstate(exc)
    if state == READ_ONLY_TRANSACTION:
        return (
            "read_only",
            "PostgreSQL refused the write because the session is read-only (SQLSTATE "
            "25006: a standby in recovery, or default_transaction_read_only=on); nothing "
            "was stored: use the writable primary",
        )
    if state == DISK_FULL:
        return (
            "disk_full",
            "PostgreSQL is out of disk space (SQLSTATE 53100, disk full); nothing was "
            "stored: free space on the server",
        )
    if state == TOO_MANY_CONNECTIONS:
        return (
            "insufficient_resources",
            "PostgreSQL refused the connection: too many connections (SQLSTATE 53300); "
            "nothing was stored: the role's CONNECTION LIMIT or the server's "
            "max_connections is below what the pools open; raise it, or give the pools a "
            "smaller max_size (work goes on, slower, on the connections already open)",
        )
    if is_insufficient_resources(state):
        return (
            "insufficient_resources",
            f"PostgreSQL lacks resources (SQLSTATE {state}: out of memory or a configured "
            "limit); nothing was stored",
        )
    return None


async def check_server_durability(conn: AnyConnection) -> None:
    """Refuse a server or session that could lose acknowledged commits or cannot write.

    Raises:
        DurabilityProblem: see :func:`require_durable_server`.
    """
    row = await conn.fetchrow(SERVER_QUERY)
    assert row is not None
    require_durable_server(*row)


async def check_tables_permanent(conn: AnyConnection, schema: str, tables: Sequence[str]) -> None:
    """Require every table to exist in ``schema`` and be permanent (not unlogged or temp).

    Raises:
        DurabilityProblem: see :func:`require_permanent_tables`.
    """
    rows = await conn.fetch(TABLES_QUERY, schema, list(tables))
    require_permanent_tables(schema, tables, {r[0]: r[1] for r in rows})


async def check_privileges(
    conn: AnyConnection, schema: str, required: Mapping[str, Sequence[str]]
) -> list[str]:
    """Check the runtime role: fail on a missing privilege, report excess power.

    Args:
        conn: a connection as the runtime role.
        schema: the schema holding the tables.
        required: table name -> privileges the runtime needs on it.

    Returns:
        Warnings for a role that is a superuser, owns a table or can CREATE in the schema.

    Raises:
        DurabilityProblem: ``setting="privilege"`` naming the first missing privilege.
    """
    role = await conn.fetchrow(
        "SELECT current_user AS name, r.rolsuper, r.rolbypassrls,"
        " has_schema_privilege(current_user, $1, 'USAGE') AS usage,"
        " has_schema_privilege(current_user, $1, 'CREATE') AS can_create"
        " FROM pg_catalog.pg_roles r WHERE r.rolname = current_user",
        schema,
    )
    assert role is not None
    name = role["name"]
    if not role["usage"]:
        raise DurabilityProblem(
            f"role {name!r} lacks USAGE on schema {schema!r}; run GRANT USAGE ON SCHEMA "
            f"{quote_ident(schema)} TO {quote_ident(name)} (see grants.sql)",
            setting="privilege",
        )
    qualified = {t: f"{quote_ident(schema)}.{quote_ident(t)}" for t in required}
    for table, privileges in required.items():
        for privilege in privileges:
            ok = await conn.fetchval(
                "SELECT has_table_privilege(current_user, $1, $2)", qualified[table], privilege
            )
            if not ok:
                raise DurabilityProblem(
                    f"role {name!r} lacks {privilege} on table {schema}.{table}; run GRANT "
                    f"{privilege} ON {qualified[table]} TO {quote_ident(name)} (see grants.sql)",
                    setting="privilege",
                )
    warnings: list[str] = []
    if role["rolsuper"]:
        warnings.append(
            f"runtime role {name!r} is a superuser; use a role with only the grants in grants.sql"
        )
    owned = await conn.fetch(
        "SELECT c.relname FROM pg_catalog.pg_class c"
        " JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace"
        " WHERE n.nspname = $1 AND c.relname = ANY($2::text[])"
        " AND pg_has_role(current_user, c.relowner, 'USAGE')",
        schema,
        list(required),
    )
    if owned and not role["rolsuper"]:
        tables = ", ".join(sorted(r["relname"] for r in owned))
        warnings.append(
            f"runtime role {name!r} owns (or is a member of the owner of) {tables}; the "
            "runtime role should not be able to alter or drop the tables"
        )
    if role["can_create"] and not role["rolsuper"]:
        warnings.append(
            f"runtime role {name!r} has CREATE on schema {schema!r}; the runtime role "
            "should hold only USAGE"
        )
    return warnings
