"""Array parameters spelled as ``text[]``, which asyncpg encodes without asking the server."""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from datetime import UTC, datetime

__all__ = ["array_literal", "text_array"]

# asyncpg's timestamptz encoder sends these two instants as PostgreSQL's infinities.
_INFINITY = datetime.max.replace(tzinfo=UTC)
_NEGATIVE_INFINITY = datetime.min.replace(tzinfo=UTC)


def _text(value: object) -> str | None:
    if value is None:
        return None
    if isinstance(value, bool):  # before int: bool is one
        return "true" if value else "false"
    if isinstance(value, bytes | bytearray | memoryview):
        return "\\x" + bytes(value).hex()  # bytea's hex input format
    if isinstance(value, datetime):
        if value.tzinfo is not None and value in (_INFINITY, _NEGATIVE_INFINITY):
            return "infinity" if value == _INFINITY else "-infinity"
        return value.isoformat()
    return str(value)


def text_array(values: Iterable[object]) -> list[str | None]:
    r"""Spell an array parameter as text: the statement casts it (``$1::text[]::bigint[]``).

    asyncpg knows ``text[]`` without asking the server, but on a fresh connection its
    first use of a statement with a ``bigint[]``, ``uuid[]``, ``integer[]``,
    ``timestamptz[]``, ``bytea[]`` or ``boolean[]`` parameter introspects the type first:
    extra round trips (8 instead of 2 measured through a delaying proxy), and a statement
    that times out closes its connection, so on a slow link the next one is fresh and slow
    again. ``None`` stays NULL; booleans are ``true``/``false``; bytes are in bytea's hex
    format (``\x…``), which the server reads whatever ``bytea_output`` says; datetimes are
    in ISO 8601 with their offset, which it reads whatever its DateStyle (aware ones: the
    two instants asyncpg sends as ``±infinity`` are sent so here too).
    """
    return [_text(v) for v in values]


def array_literal(values: Iterable[int | uuid.UUID]) -> str:
    """Spell ints or UUIDs as one array literal (``{1,2}``), cast by the statement.

    The statement reads it as ``$1::text::bigint[]`` (or ``uuid[]``).
    Neither needs quoting in an array literal, and one ``text`` parameter costs the driver
    one value to encode where a ``text[]`` costs one (with its checks) per element: the
    worker's completion batches carry hundreds.
    """
    return "{" + ",".join(map(str, values)) + "}"
