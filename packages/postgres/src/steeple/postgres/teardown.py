"""Teardown: drop a schema steeple made, and everything in it.

Neither product ships a down migration; a deployment removes a store or a queue
deliberately, with the deployment role. :func:`drop_schema` is that one step, with the
schema name quoted the one way steeple writes identifiers (``steeple demo --fresh --dsn``
uses it on the demo's two schemas).
"""

from __future__ import annotations

from typing import Any

from steeple.core.errors import ConfigurationError
from steeple.postgres._ident import InvalidIdentifierError, quote_ident

__all__ = ["drop_schema"]


async def drop_schema(conn: Any, schema: str) -> bool:
    """Drop ``schema`` and everything in it (``DROP SCHEMA ... CASCADE``), if it exists.

    Args:
        conn: an asyncpg connection (the deployment role, or the schema's owner).
        schema: the schema's name, used literally (any text PostgreSQL can hold).

    Returns:
        Whether the schema existed.

    Raises:
        ConfigurationError: a name PostgreSQL cannot hold (empty, NUL, a lone surrogate,
            over 63 bytes).
    """
    try:
        quoted = quote_ident(schema, what="schema")
    except InvalidIdentifierError as exc:
        raise ConfigurationError(str(exc)) from None
    existed = await conn.fetchval(
        "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_namespace WHERE nspname = $1)", schema
    )
    await conn.execute(f"DROP SCHEMA IF EXISTS {quoted} CASCADE")
    return bool(existed)
