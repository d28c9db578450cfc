"""Operator functions over a recurring namespace that need no keyring: key usage, dry runs.

They read the tables the store wrote, on the caller's asyncpg connection (or pool), and
never open sealed content: what they return (key ids, counts, the sealed binding) is
metadata. The store itself (:class:`~steeple.postgres.PostgresRecurringStore`) does
everything that changes a namespace.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Final

import attrs

from steeple.core.config import validate_namespace
from steeple.core.errors import RecurringConfigurationError, RecurringStorageError
from steeple.core.occurrences import OCCURRENCE_TRANSITIONS, OccurrenceEvent
from steeple.postgres._ident import InvalidIdentifierError, quote_ident

__all__ = ["SealedBinding", "count_purgeable", "namespace_binding", "sealed_key_usage"]

# What purge_terminal removes: every state the lifecycle table lets PURGE leave.
_PURGEABLE: Final = tuple(
    sorted(s.value for (s, event) in OCCURRENCE_TRANSITIONS if event is OccurrenceEvent.PURGE)
)


@attrs.frozen
class SealedBinding:
    """A namespace's configuration binding as stored: sealed, with the key id that sealed it.

    Open it with the keyring the namespace uses (``Keyring.binding_fields``) to read the
    configuration the namespace was initialized with.

    Attributes:
        namespace: the namespace.
        sealed: the sealed binding (an envelope; see ``steeple.keyring``).
        key_id: the id of the key that sealed it.
    """

    namespace: str
    sealed: bytes = attrs.field(repr=False)
    key_id: str


def _schema(schema: str) -> str:
    try:
        return quote_ident(schema, what="schema")
    except InvalidIdentifierError as exc:
        raise RecurringConfigurationError(str(exc)) from None


async def _require_store(conn: Any, quoted: str, schema: str) -> None:
    found = await conn.fetchval(
        "SELECT to_regclass($1) IS NOT NULL", f"{quoted}.recurring_namespaces"
    )
    if not found:
        raise RecurringStorageError(
            f"schema {schema!r} holds no recurring store (initialize it first)"
        )


async def sealed_key_usage(conn: Any, *, schema: str, namespace: str) -> dict[str, int]:
    """Count a namespace's sealed records (binding, definitions, occurrences) per key id.

    A previous key no record uses any more can be retired from the keyring; a key id in use
    that the keyring lacks must be added back before those records can be opened.

    Args:
        conn: an asyncpg connection or pool.
        schema: the store's PostgreSQL schema.
        namespace: the namespace (an unknown one has no records: ``{}``).

    Returns:
        ``{key id: records sealed under it}``, in key id order.

    Raises:
        RecurringConfigurationError: a schema name PostgreSQL cannot hold, or a malformed
            namespace name.
        RecurringStorageError: the schema holds no recurring store.
    """
    quoted = _schema(schema)
    validate_namespace(namespace)
    await _require_store(conn, quoted, schema)
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
    return {str(r["key_id"]): int(r["n"]) for r in rows}


async def count_purgeable(conn: Any, older_than: datetime, *, schema: str, namespace: str) -> int:
    """Count the occurrences ``purge_terminal(older_than)`` could remove, removing nothing.

    Terminal occurrences (published, dead, expired, cancelled) finished before
    ``older_than``. ``purge_terminal`` first classifies work whose delivery window ended
    as expired, so it may remove more than this dry run counts; and it removes at most its
    ``limit`` per call.

    Raises:
        RecurringConfigurationError: a naive ``older_than``, a schema name PostgreSQL
            cannot hold, or a malformed namespace name.
        RecurringStorageError: the schema holds no recurring store.
    """
    if not isinstance(older_than, datetime) or older_than.utcoffset() is None:
        raise RecurringConfigurationError(
            "older_than must be a timezone-aware datetime (steeple works in UTC)"
        )
    quoted = _schema(schema)
    validate_namespace(namespace)
    await _require_store(conn, quoted, schema)
    return int(
        await conn.fetchval(
            f"SELECT count(*) FROM {quoted}.recurring_occurrences"
            " WHERE namespace = $1 AND state = ANY($2::text[]) AND finished_at < $3",
            namespace,
            list(_PURGEABLE),
            older_than,
        )
    )


async def namespace_binding(conn: Any, *, schema: str, namespace: str) -> SealedBinding | None:
    """Return the namespace's sealed configuration binding, or ``None`` if it has none.

    Raises:
        RecurringConfigurationError: a schema name PostgreSQL cannot hold, or a malformed
            namespace name.
        RecurringStorageError: the schema holds no recurring store.
    """
    quoted = _schema(schema)
    validate_namespace(namespace)
    await _require_store(conn, quoted, schema)
    row = await conn.fetchrow(
        f"SELECT binding, binding_key_id FROM {quoted}.recurring_namespaces WHERE namespace = $1",
        namespace,
    )
    if row is None:
        return None
    return SealedBinding(namespace, bytes(row["binding"]), str(row["binding_key_id"]))
