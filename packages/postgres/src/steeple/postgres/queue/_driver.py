"""One small face over the three drivers the queue accepts: asyncpg, psycopg async, psycopg sync.

SQL is written once with asyncpg's ``$n`` placeholders; for psycopg it is rewritten to named
``%(pn)s`` placeholders (once, cached). Rows come back as plain tuples either way; the SQL
casts jsonb to text so both drivers return the same Python types. psycopg statements are
sent unprepared, whatever the connection's ``prepare_threshold``: a named prepared
statement would not survive a transaction pooler (see :mod:`steeple.postgres.pooler`).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Literal, ParamSpec, TypeVar

from steeple.postgres._durability import write_refusal
from steeple.postgres.queue.errors import (
    QueueDeadlineError,
    QueueError,
    QueueUnavailableError,
    UnfitDatabaseError,
    UnsupportedConnectionError,
)
from steeple.postgres.sqlstate import (
    LOCK_NOT_AVAILABLE,
    QUERY_CANCELED,
    is_lost_connection,
    is_session_ended,
    sqlstate,
)
from steeple.postgres.sqlstate import is_data_error as is_data_error_state

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


def in_transaction(conn: Any) -> bool:
    """Tell (without I/O) whether ``conn`` is inside a transaction (none for a pool)."""
    if connection_kind(conn) == "asyncpg":
        is_in = getattr(conn, "is_in_transaction", None)  # a pool has none
        return bool(is_in()) if is_in is not None else False
    import psycopg

    return bool(conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE)


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
            await cur.execute(to_psycopg(sql), _named(args), prepare=False)
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
        cur.execute(to_psycopg(sql), _named(args), prepare=False)
        if cur.description is None:
            return []
        return [tuple(r) for r in cur.fetchall()]


def typed_db_error(exc: BaseException) -> QueueError | None:
    """Translate a driver's failure into the queue's typed error, or ``None``.

    ``None``: not a database failure of the kinds below (leave it as it is). This is the
    one translation every queue function run on a caller's connection goes through (and
    the worker's health reasons): a refused write (read-only, disk full, resources) is an
    :class:`UnfitDatabaseError`; a lock or statement timeout, or no answer in time, a
    :class:`QueueDeadlineError`; a lost connection a :class:`QueueUnavailableError`.
    Works for asyncpg and psycopg alike (both carry ``sqlstate``).
    """
    if isinstance(exc, QueueError):
        return exc
    refusal = write_refusal(exc)
    if refusal is not None:
        setting, message = refusal
        return UnfitDatabaseError(message, setting=setting)
    state = sqlstate(exc)
    if state == LOCK_NOT_AVAILABLE:
        return QueueDeadlineError(
            "a lock wait exceeded lock_timeout (SQLSTATE 55P03): another session holds the "
            "rows or table; nothing was changed, try again"
        )
    if state == QUERY_CANCELED:
        return QueueDeadlineError(
            "the statement exceeded statement_timeout or was cancelled (SQLSTATE 57014); "
            "nothing was changed, try again"
        )
    if isinstance(exc, TimeoutError):
        return QueueDeadlineError(
            "the database did not answer in time; a write's outcome is unknown, read it back"
        )
    if is_session_ended(state):
        return QueueUnavailableError(
            f"the database connection was lost (SQLSTATE {state}: terminated by an "
            "administrator, a server shutdown or the network); a write's outcome is unknown, "
            "read it back on a new connection"
        )
    if isinstance(exc, OSError) or is_lost_connection(exc):
        return QueueUnavailableError(
            f"the database connection was lost ({type(exc).__name__}); a write's outcome is "
            "unknown, read it back on a new connection"
        )
    return None


def is_data_error(exc: BaseException) -> bool:
    """Tell whether the database refused a statement for the values it carried.

    Such a statement fails again however often it is retried (unlike a lost connection, a
    timeout or a refused write), so a batch that hits one is split to find the bad value.
    Works for asyncpg and psycopg alike.
    """
    return is_data_error_state(sqlstate(exc))


def describe_db_error(exc: BaseException) -> str:
    """Say in one line what a database failure was (for logs and health reasons).

    Never the driver's full text (it can quote values): the typed error's message, or the
    error's type and SQLSTATE.
    """
    typed = typed_db_error(exc)
    if typed is not None:
        return str(typed)
    state = sqlstate(exc)
    if state:
        return f"PostgreSQL failed (SQLSTATE {state}, {type(exc).__name__})"
    return f"{type(exc).__name__}"


def _typed(exc: Exception) -> QueueError | None:
    typed = typed_db_error(exc)
    return None if typed is exc else typed


def errors_typed(fn: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R]]:
    """Raise the queue's typed error (see :func:`typed_db_error`) for a database failure.

    For every public function run on a caller's connection: the driver's error stays the
    ``__cause__``; the caller's transaction, if any, is aborted either way.
    """

    @functools.wraps(fn)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return await fn(*args, **kwargs)
        except Exception as exc:
            typed = _typed(exc)
            if typed is None:
                raise
            raise typed from exc

    return wrapper


def errors_typed_sync(fn: Callable[P, R]) -> Callable[P, R]:
    """Like :func:`errors_typed`, for the psycopg (sync) functions."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            typed = _typed(exc)
            if typed is None:
                raise
            raise typed from exc

    return wrapper
