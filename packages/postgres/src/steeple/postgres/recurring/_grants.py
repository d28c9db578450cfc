"""The runtime role's grants, built from :data:`RUNTIME_PRIVILEGES` one statement at a time.

Each GRANT is composed from names quoted by :func:`steeple.postgres._ident.quote_ident` and
runs alone over the extended protocol (which refuses a second statement), all inside one
transaction: a hostile schema or role name is granted literally or refused, and nothing
else in the database changes.
"""

from __future__ import annotations

from steeple.core.errors import RecurringConfigurationError
from steeple.postgres._durability import AnyConnection
from steeple.postgres._ident import InvalidIdentifierError, quote_ident, shown_name
from steeple.postgres.recurring._sql import RUNTIME_PRIVILEGES

__all__ = ["grant_runtime_role", "runtime_grant_statements"]

# Table privileges are keywords, not identifiers: only these may be written into a GRANT.
_TABLE_PRIVILEGES = frozenset({"SELECT", "INSERT", "UPDATE", "DELETE"})
# PostgreSQL reads these role names specially even when quoted: "public" is every role,
# "none" is reserved. Roles named pg_* are the server's predefined roles.
_SPECIAL_ROLES = frozenset({"public", "none"})


def _quoted(name: object, what: str) -> str:
    try:
        return quote_ident(name, what=what)
    except InvalidIdentifierError as exc:
        raise RecurringConfigurationError(str(exc)) from None


def runtime_grant_statements(role: str, schema: str = "steeple") -> list[str]:
    """Return the GRANT statements that give ``role`` the runtime privileges, one per item.

    ``GRANT USAGE ON SCHEMA`` first, then one ``GRANT <privilege> ON TABLE`` per
    (privilege, table) pair of :data:`RUNTIME_PRIVILEGES`.

    Raises:
        RecurringConfigurationError: a role or schema name PostgreSQL cannot hold exactly
            (empty, NUL, a lone surrogate, over 63 bytes), or a role name that does not
            mean one role (``public``, ``none``, a predefined ``pg_*`` role).
    """
    quoted_schema = _quoted(schema, "schema")
    quoted_role = _quoted(role, "role")
    if role in _SPECIAL_ROLES or role.startswith("pg_"):
        raise RecurringConfigurationError(
            f"role {shown_name(role)} is not a runtime role PostgreSQL can grant to "
            "('public' means every role, 'none' is reserved, pg_* are predefined roles); "
            "create a dedicated role: CREATE ROLE steeple_runtime LOGIN"
        )
    statements = [f"GRANT USAGE ON SCHEMA {quoted_schema} TO {quoted_role}"]
    for table, privileges in RUNTIME_PRIVILEGES.items():
        for privilege in privileges:
            if privilege not in _TABLE_PRIVILEGES:
                raise AssertionError(f"unexpected table privilege {privilege!r}")
            statements.append(
                f"GRANT {privilege} ON TABLE {quoted_schema}.{quote_ident(table)} TO {quoted_role}"
            )
    return statements


async def grant_runtime_role(conn: AnyConnection, role: str, schema: str = "steeple") -> None:
    """Grant ``role`` exactly the runtime privileges (``recurring/grants.sql``).

    Run it as the deployment role (the tables' owner) after ``initialize``. The role must
    exist; names are used literally (quotes, semicolons, braces and Unicode included). The
    grants run one statement at a time in one transaction (a savepoint when the caller
    already holds one): all of them are granted, or none.

    Raises:
        RecurringConfigurationError: an invalid role or schema name (see
            :func:`runtime_grant_statements`), a role that does not exist, or a schema
            without the recurring store's tables.
        asyncpg.PostgresError: the server refused a grant (e.g. the current role does not
            own the tables).
    """
    statements = runtime_grant_statements(role, schema)
    async with conn.transaction():
        if not await conn.fetchval("SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = $1", role):
            raise RecurringConfigurationError(
                f"role {shown_name(role)} does not exist; create it first "
                "(CREATE ROLE ... LOGIN) as a role with CREATEROLE"
            )
        quoted_schema = quote_ident(schema)
        missing = [
            table
            for table in RUNTIME_PRIVILEGES
            if not await conn.fetchval(
                "SELECT to_regclass($1) IS NOT NULL", f"{quoted_schema}.{quote_ident(table)}"
            )
        ]
        if missing:
            raise RecurringConfigurationError(
                f"schema {shown_name(schema)} holds no recurring store (no {missing[0]}); "
                "run initialize first, or check the schema name"
            )
        for statement in statements:
            # fetch() sends one statement over the extended protocol: a second statement in
            # the text would be refused by the server, never run.
            await conn.fetch(statement)
