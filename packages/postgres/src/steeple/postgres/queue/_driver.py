"""One small face over the three drivers the queue accepts: asyncpg, psycopg async, psycopg sync.

SQL is written once with asyncpg's ``$n`` placeholders; for psycopg it is rewritten to named
``%(pn)s`` placeholders (once, cached). Rows come back as plain tuples either way; the SQL
casts jsonb to text so both drivers return the same Python types.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Literal, ParamSpec, TypeVar

from steeple.postgres._durability import write_refusal
from steeple.postgres.queue.errors import UnfitDatabaseError, UnsupportedConnectionError

Kind = Literal["asyncpg", "psycopg_async", "psycopg_sync"]
P = ParamSpec("P")
R = TypeVar("R")

_PLACEHOLDER = re.compile(r"\$(\d+)")


def connection_kind(conn: object) -> Kind:
    """Tell which driver ``conn`` belongs to, by type (no I/O).

    Raises:
        UnsupportedConnectionError: neither asyncpg nor psycopg.
    """
    module = type(conn).__module__
    if module.startswith("asyncpg"):
        import asyncpg
        import asyncpg.pool

        if isinstance(conn, asyncpg.Connection | asyncpg.pool.PoolConnectionProxy | asyncpg.Pool):
            return "asyncpg"
    elif module.startswith("psycopg"):
        import psycopg

        if isinstance(conn, psycopg.AsyncConnection):
            return "psycopg_async"
        if isinstance(conn, psycopg.Connection):
            return "psycopg_sync"
    raise UnsupportedConnectionError(
        f"expected an asyncpg connection/pool or a psycopg connection, not {type(conn).__name__}"
    )


@functools.lru_cache(maxsize=256)
def to_psycopg(sql: str) -> str:
    """Rewrite ``$n`` placeholders to psycopg's ``%(pn)s`` (and escape literal percent signs)."""
    return _PLACEHOLDER.sub(r"%(p\1)s", sql.replace("%", "%%"))


def _named(args: Sequence[Any]) -> dict[str, Any]:
    return {f"p{i}": value for i, value in enumerate(args, start=1)}


async def fetch(conn: Any, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    """Run ``sql`` on an async connection (asyncpg or psycopg) and return all rows as tuples.

    Raises:
        UnsupportedConnectionError: ``conn`` is a sync or unknown connection.
    """
    kind = connection_kind(conn)
    if kind == "asyncpg":
        return [tuple(r) for r in await conn.fetch(sql, *args)]
    if kind == "psycopg_async":
        async with conn.cursor() as cur:
            await cur.execute(to_psycopg(sql), _named(args))
            if cur.description is None:
                return []
            return [tuple(r) for r in await cur.fetchall()]
    raise UnsupportedConnectionError(
        "a psycopg sync connection needs the *_sync function (e.g. enqueue_sync)"
    )


def fetch_sync(conn: Any, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    """Run ``sql`` on a psycopg sync connection and return all rows as tuples.

    Raises:
        UnsupportedConnectionError: ``conn`` is not a psycopg sync connection.
    """
    if connection_kind(conn) != "psycopg_sync":
        raise UnsupportedConnectionError("the *_sync functions need a psycopg (sync) Connection")
    with conn.cursor() as cur:
        cur.execute(to_psycopg(sql), _named(args))
        if cur.description is None:
            return []
        return [tuple(r) for r in cur.fetchall()]


def _refused(exc: Exception) -> UnfitDatabaseError | None:
    refusal = write_refusal(exc)
    if refusal is None:
        return None
    setting, message = refusal
    return UnfitDatabaseError(message, setting=setting)


def refusals_typed(fn: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R]]:
    """Turn a server's refusal to store (read-only, disk full) into UnfitDatabaseError.

    For the functions that write on a caller's connection: the driver's error stays the
    ``__cause__``; the caller's transaction is aborted either way.
    """

    @functools.wraps(fn)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return await fn(*args, **kwargs)
        except Exception as exc:
            typed = _refused(exc)
            if typed is None:
                raise
            raise typed from exc

    return wrapper


def refusals_typed_sync(fn: Callable[P, R]) -> Callable[P, R]:
    """Like :func:`refusals_typed`, for the psycopg (sync) functions."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            typed = _refused(exc)
            if typed is None:
                raise
            raise typed from exc

    return wrapper
