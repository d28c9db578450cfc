"""The worker's view of a connection pool: asyncpg (the default) or psycopg_pool.

The worker needs five things from a pool: run one statement, run one statement that must
not wait behind the pool's other users (lease renewals), run a function on one connection
(materialization, checks), keep one connection LISTENing, and know its size.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Final, Protocol, TypeVar

import asyncpg

from steeple.postgres._durability import (
    SERVER_QUERY,
    TABLES_QUERY,
    DurabilityProblem,
    require_durable_server,
    require_permanent_tables,
)
from steeple.postgres.queue import _driver
from steeple.postgres.queue._cluster import guard_for
from steeple.postgres.queue.errors import UnfitDatabaseError

__all__ = [
    "DB_ERRORS",
    "KEEPALIVE_SETTINGS",
    "SERVER_SETTINGS",
    "WorkerDb",
    "check_durable",
    "keep_session",
    "listening_on",
    "open_db",
]

T = TypeVar("T")
LOG = logging.getLogger("steeple.postgres.queue")
_ADMIT_DEADLINE: Final = 10.0
"""Seconds a new connection's identity read may take when the caller set no deadline."""
_BUSY_AFTER: Final = 0.25
"""Seconds an urgent statement waits for a pooled connection before it takes the reserve."""


def _busy_after(full: bool, timeout: float) -> float | None:
    """How long an urgent statement waits for a pooled connection (``None``: its deadline).

    A pool with an idle connection or room for a new one starves nobody (and opening a
    connection may take long on a slow link: no short bound for that); a pool whose every
    connection is out gets a short one, then the reserve is used.
    """
    return min(_BUSY_AFTER, timeout / 4) if full else None


def _db_errors() -> tuple[type[BaseException], ...]:
    errors: list[type[BaseException]] = [
        asyncpg.PostgresError,
        asyncpg.InterfaceError,
        # A connection left mid-protocol (e.g. by a cut network) reports this.
        asyncpg.exceptions.InternalClientError,
        OSError,
        TimeoutError,
    ]
    try:
        import psycopg
        import psycopg_pool
    except ImportError:  # psycopg is an optional extra
        return tuple(errors)
    errors += [psycopg.Error, psycopg_pool.PoolTimeout]
    return tuple(errors)


DB_ERRORS: Final = _db_errors()
"""What a broken, slow or refusing database raises through either driver."""


KEEPALIVE_SETTINGS: Final[dict[str, str]] = {
    # A client that goes silent mid-statement (a cut or blackholed network) leaves its
    # backend "active" holding row locks, and no statement or idle timeout fires; only TCP
    # notices, after ~2 h by default. Keepalives and a user timeout bound that to well
    # under a minute, so a vanished worker's locks (and a held LISTEN) are released.
    "tcp_keepalives_idle": "10",
    "tcp_keepalives_interval": "5",
    "tcp_keepalives_count": "3",
    "tcp_user_timeout": "30000",
}
"""Server-side TCP keepalive settings for every queue connection."""

SERVER_SETTINGS: Final[dict[str, str]] = {
    **KEEPALIVE_SETTINGS,
    "application_name": "steeple-queue",
}
"""``server_settings`` of the pools the worker opens itself."""

# Applied to listener connections, which may come from a caller's pool (session-level:
# asyncpg's reset on release and a psycopg connection's close undo them).
_SET_KEEPALIVES: Final = "SELECT " + ", ".join(
    f"set_config('{name}', '{value}', false)" for name, value in KEEPALIVE_SETTINGS.items()
)


async def keep_session(conn: asyncpg.Connection) -> None:
    """Release a connection to a pool the worker opened without asyncpg's reset query.

    asyncpg's default reset (``pg_advisory_unlock_all(); CLOSE ALL; UNLISTEN *; RESET ALL``)
    is one more round trip on every release, on the path of every claim and completion.
    The worker's statements leave no session state behind (every setting they change is
    transaction-local, they take no session advisory lock and open no cursor), the
    listener undoes its own (``UNLISTEN``, ``RESET ALL``) before it gives its connection
    back, and asyncpg still rolls back an open transaction and drops the connection's
    listeners before calling this. Pools a caller passes keep their own reset.
    """


_UNLISTEN_ERRORS: Final[tuple[type[BaseException], ...]] = (*DB_ERRORS, asyncio.CancelledError)


class WorkerDb(Protocol):
    """A pool as the worker uses it."""

    def max_size(self) -> int:
        """Return the most connections the pool opens."""
        ...

    async def fetch(self, sql: str, *args: Any, timeout: float) -> list[tuple[Any, ...]]:
        """Run one statement (``$n`` placeholders) and return its rows as tuples."""
        ...

    async def fetch_reserved(self, sql: str, *args: Any, timeout: float) -> list[tuple[Any, ...]]:
        """Run one statement that must not wait behind the pool's other users.

        It takes a pooled connection as :meth:`fetch` does, but when every connection of
        the pool is out it waits for one only a short bound, then takes the worker's one
        reserved connection (see :class:`_Reserve`): a pool shared with an
        application whose handlers hold every connection cannot starve it.
        """
        ...

    async def close_reserve(self) -> None:
        """Close the reserved connection, if it was opened (whoever owns the pool)."""
        ...

    async def with_connection(self, fn: Callable[[Any], Awaitable[T]], *, timeout: float) -> T:
        """Run ``fn(conn)`` on one pooled connection within ``timeout`` seconds.

        ``fn`` may be run a second time, on another connection, when the first refused
        its first statement unsent (it had broken while idle in the pool): ``fn`` is one
        transaction, or reads only.
        """
        ...

    async def listen(
        self,
        channel: str,
        on_notify: Callable[[str], None],
        name: str,
        stop: asyncio.Event,
        *,
        on_listening: Callable[[], None] | None = None,
    ) -> None:
        """LISTEN on a dedicated connection until ``stop`` is set; raise when it dies.

        ``on_listening`` is called once LISTEN is in place (notifications from then on are
        delivered); ``on_notify`` then receives "" once (for anything enqueued while
        nobody listened) and each payload.
        """
        ...

    async def close(self) -> None:
        """Close the pool (only called for pools the worker opened)."""
        ...


class _ClusterGate:
    """Admits each pooled connection once: only on the cluster and timeline the worker knows.

    The first statement on a connection the worker has not used yet is the worker's
    :class:`~steeple.postgres.queue.ClusterGuard` check (one round trip); later uses of
    the same connection cost a set lookup. Caller-provided pools are covered too (no pool
    hook).
    """

    def __init__(self) -> None:
        self.guard = guard_for("steeple queue worker")
        self._admitted: weakref.WeakSet[Any] = weakref.WeakSet()

    async def admit(self, conn: Any, key: Any) -> bool:
        """Check ``conn`` (its driver connection ``key``) unless it was admitted before.

        Returns:
            Whether the identity was read now (``False``: admitted before, nothing sent).

        Raises:
            QueueClusterError: another cluster, or a stale node (logged).
        """
        if key in self._admitted:
            return False
        await self.guard.check(conn)
        self._admitted.add(key)
        return True


class _PoolBusyError(Exception):
    """The pool gave no connection within an urgent statement's short bound."""


class _Reserve:
    """One connection of the worker's own, for statements the pool must not starve.

    Opened on first need with the pool's own connect arguments (so it reaches the same
    server as the same role, one connection beyond the pool's size), admitted by the
    pool's cluster gate like any pooled connection, used by one statement at a time.
    Any failure closes it; the next need opens a new one (the caller's retry and backoff
    pace that). Closed when the worker stops.
    """

    def __init__(
        self,
        gate: _ClusterGate,
        connect: Callable[[], Awaitable[Any]],
        discard: Callable[[Any], None],
    ) -> None:
        self._gate = gate
        self._connect = connect
        self._discard = discard
        self._conn: Any = None
        self._lock = asyncio.Lock()
        self.opened = 0
        """How many times the reserved connection was opened (tests, diagnostics)."""

    async def fetch(self, sql: str, *args: Any, timeout: float) -> list[tuple[Any, ...]]:
        async with asyncio.timeout(timeout), self._lock:
            try:
                if self._conn is None:
                    self._conn = await self._connect()
                    self.opened += 1
                await self._gate.admit(self._conn, self._conn)
                return await _driver.fetch(self._conn, sql, *args)
            except BaseException:
                self._drop()
                raise

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                self._discard(conn)

    async def close(self) -> None:
        async with self._lock:
            conn, self._conn = self._conn, None
        if conn is None:
            return
        try:
            async with asyncio.timeout(2.0):
                await conn.close()
        except _UNLISTEN_ERRORS:
            # Unreachable (or we are being cancelled): close it without a goodbye.
            with contextlib.suppress(Exception):
                self._discard(conn)


class _AsyncpgDb:
    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool
        self._gate = _ClusterGate()
        self.reserve = _Reserve(self._gate, self._connect_like_pool, _terminate)

    async def _connect_like_pool(self) -> asyncpg.Connection:
        # The pool's own connect (its arguments, ``connect`` and ``init`` callbacks), but a
        # connection the pool does not track: it is never handed to the application.
        connect = self._pool._get_new_connection  # type: ignore[attr-defined]
        conn: asyncpg.Connection = await connect()
        with contextlib.suppress(*DB_ERRORS):
            await conn.execute(_SET_KEEPALIVES)
        return conn

    async def _admit(self, conn: Any, timeout: float | None) -> None:
        # The pool hands out a new proxy each time; the driver connection behind it is
        # what lives as long as the session. Bounded: a link that died right after it
        # opened must not hang the caller (the connection is then discarded).
        async with asyncio.timeout(timeout or _ADMIT_DEADLINE):
            await self._gate.admit(conn, getattr(conn, "_con", conn))

    def max_size(self) -> int:
        return int(self._pool.get_max_size())

    @contextlib.asynccontextmanager
    async def _acquire(self, timeout: float | None, busy_after: float | None) -> AsyncIterator[Any]:
        """Lend a pooled connection; :class:`_PoolBusyError` if none came in ``busy_after``."""
        if busy_after is None:
            async with self._pool.acquire(timeout=timeout) as conn:
                yield conn
            return
        try:
            conn = await self._pool.acquire(timeout=busy_after)
        except TimeoutError:
            raise _PoolBusyError from None
        try:
            yield conn
        finally:
            await self._pool.release(conn)

    async def _on_fresh(
        self,
        use: Callable[[Any], Awaitable[T]],
        acquire_timeout: float | None,
        busy_after: float | None = None,
    ) -> T:
        """Run ``use(conn)`` on a pooled connection, which is discarded if anything fails.

        A connection whose backend ended while it sat idle in the pool (say by
        ``pg_terminate_backend``) can still look open: asyncpg refuses the first statement
        on it (``InternalClientError``) before sending anything. Nothing ran, so ``use``
        runs again on another connection.
        """
        # Every idle connection may have been ended at once: try each, then a new one.
        for _ in range(self.max_size()):
            async with self._acquire(acquire_timeout, busy_after) as conn:
                try:
                    await self._admit(conn, acquire_timeout)
                    return await use(conn)
                except asyncpg.exceptions.InternalClientError as exc:
                    _discard(conn)
                    if not _never_sent(exc):
                        raise
                except BaseException:
                    _discard(conn)
                    raise
        async with self._acquire(acquire_timeout, busy_after) as conn:
            try:
                await self._admit(conn, acquire_timeout)
                return await use(conn)
            except BaseException:
                _discard(conn)
                raise

    async def fetch(self, sql: str, *args: Any, timeout: float) -> list[tuple[Any, ...]]:
        async def run(conn: Any) -> list[tuple[Any, ...]]:
            return [tuple(r) for r in await conn.fetch(sql, *args, timeout=timeout)]

        return await self._on_fresh(run, timeout)

    async def fetch_reserved(self, sql: str, *args: Any, timeout: float) -> list[tuple[Any, ...]]:
        async def run(conn: Any) -> list[tuple[Any, ...]]:
            return [tuple(r) for r in await conn.fetch(sql, *args, timeout=timeout)]

        pool = self._pool
        full = pool.get_idle_size() == 0 and pool.get_size() >= pool.get_max_size()
        try:
            return await self._on_fresh(run, timeout, _busy_after(full, timeout))
        except _PoolBusyError:
            return await self.reserve.fetch(sql, *args, timeout=timeout)

    async def close_reserve(self) -> None:
        await self.reserve.close()

    async def with_connection(self, fn: Callable[[Any], Awaitable[T]], *, timeout: float) -> T:
        async def run(conn: Any) -> T:
            work = asyncio.ensure_future(fn(conn))
            try:
                done, _ = await asyncio.wait({work}, timeout=timeout)
            except BaseException:
                work.cancel()
                raise
            if not done:
                # Cancelling alone is not enough: a ROLLBACK on the way out would wait on
                # the same dead socket. Closing the connection fails all its I/O.
                _terminate(conn)
                with contextlib.suppress(BaseException):
                    await asyncio.wait_for(work, 1.0)
                raise TimeoutError(f"no answer within {timeout} s")
            return work.result()

        return await self._on_fresh(run, timeout)

    async def listen(
        self,
        channel: str,
        on_notify: Callable[[str], None],
        name: str,
        stop: asyncio.Event,
        *,
        on_listening: Callable[[], None] | None = None,
    ) -> None:
        async def run(conn: Any) -> bool:
            return await _listen_on(conn, channel, on_notify, name, stop, on_listening)

        if await self._on_fresh(run, None) and not stop.is_set():
            raise ConnectionError("the listener connection was closed")

    async def close(self) -> None:
        try:
            async with asyncio.timeout(5.0):
                await self._pool.close()
        except TimeoutError:
            # Graceful close waits on every socket; a dead network must not hang shutdown.
            self._pool.terminate()


async def _listen_on(
    conn: Any,
    channel: str,
    on_notify: Callable[[str], None],
    name: str,
    stop: asyncio.Event,
    on_listening: Callable[[], None] | None,
) -> bool:
    """LISTEN on asyncpg ``conn`` until ``stop`` is set or it is lost; return whether it was."""

    def notified(_conn: object, _pid: int, _channel: str, payload: object) -> None:
        on_notify(payload if isinstance(payload, str) else "")

    lost = asyncio.Event()  # this connection's (an earlier one may still report)
    conn.add_termination_listener(lambda _c: lost.set())
    # Named so operators (and tests) can tell the listener apart.
    await conn.execute("SELECT set_config('application_name', $1, false)", name[:63])
    await conn.execute(_SET_KEEPALIVES)
    await conn.add_listener(channel, notified)
    if on_listening is not None:
        on_listening()
    on_notify("")  # anything enqueued while nobody was listening
    while not stop.is_set() and not lost.is_set():
        await _wait_any((stop, lost), 5.0)
        if not stop.is_set() and not lost.is_set():
            # A cheap probe: a silently dead socket fails here.
            async with asyncio.timeout(5.0):
                await conn.execute("SELECT 1")
    if not _is_closed(conn):
        try:
            async with asyncio.timeout(2.0):
                await conn.remove_listener(channel, notified)
                # Its name and keepalives back to the pool's (see keep_session).
                await conn.execute("RESET ALL")
        except _UNLISTEN_ERRORS:
            # Unreachable (or we are being cancelled): never pool it again.
            _terminate(conn)
            raise
    return lost.is_set()


def _discard(conn: Any) -> None:
    """Close a pooled connection on which an operation failed, whatever the failure.

    It is never handed back to the pool: a cut connection may be mid-message, a timed-out
    or cancelled statement may still run, and a session ended by the server (say by
    ``pg_terminate_backend``) reports the end as an ordinary server error while its
    protocol waits for an answer that never comes. The next user of any of them would fail
    ("another operation is in progress") or block; a new connection costs one round trip.
    """
    if not _is_closed(conn):
        _terminate(conn)


def _never_sent(exc: BaseException) -> bool:
    """Tell whether asyncpg refused a statement before sending it: its protocol was busy.

    asyncpg says so only in the message ("cannot switch to state N; another operation
    is in progress"); anything else is not known to be unsent.
    """
    return str(exc).startswith("cannot switch to state")


def _terminate(conn: Any) -> None:
    """Close ``conn`` at once, unless it was already released to the pool (not ours)."""
    with contextlib.suppress(asyncpg.InterfaceError):
        conn.terminate()


def _is_closed(conn: Any) -> bool:
    """Whether ``conn`` is closed, or no longer ours to use (already back in the pool).

    asyncpg's pool proxy raises ``InterfaceError`` on any call once it was released (a
    pool closed or terminated under us does that): such a connection is not ours to
    unlisten or terminate, and the error must not replace the one being handled.
    """
    try:
        return bool(conn.is_closed())
    except asyncpg.InterfaceError:
        return True


class _PsycopgDb:
    def __init__(self, pool: Any) -> None:
        self._pool = pool
        self._gate = _ClusterGate()
        self.reserve = _Reserve(self._gate, self._connect_like_pool, _finish_psycopg)

    async def _connect_like_pool(self) -> Any:
        kwargs = dict(self._pool.kwargs or {})
        kwargs["autocommit"] = True  # one statement at a time, each its own transaction
        conninfo = self._pool.conninfo
        if callable(conninfo):
            conninfo = await conninfo()
        conn = await self._pool.connection_class.connect(conninfo, **kwargs)
        with contextlib.suppress(*DB_ERRORS):
            await conn.execute(_SET_KEEPALIVES)
        return conn

    def max_size(self) -> int:
        return int(self._pool.max_size)

    async def _admit(self, conn: Any) -> None:
        await self._gate.admit(conn, conn)  # leaves an idle connection idle

    async def fetch(self, sql: str, *args: Any, timeout: float) -> list[tuple[Any, ...]]:
        async with asyncio.timeout(timeout), self._pool.connection() as conn:
            try:
                await self._admit(conn)
                return await _driver.fetch(conn, sql, *args)
            except BaseException:
                await _close_psycopg(conn)
                raise

    async def fetch_reserved(self, sql: str, *args: Any, timeout: float) -> list[tuple[Any, ...]]:
        import psycopg_pool

        stats = self._pool.get_stats()
        full = stats.get("pool_available", 0) == 0 and stats.get("pool_size", 0) >= int(
            self._pool.max_size
        )
        wait = _busy_after(full, timeout) or timeout
        pooled = False  # a PoolTimeout before a connection came: the pool is busy
        try:
            async with (
                asyncio.timeout(timeout),
                self._pool.connection(timeout=wait) as conn,
            ):
                pooled = True
                try:
                    await self._admit(conn)
                    return await _driver.fetch(conn, sql, *args)
                except BaseException:
                    await _close_psycopg(conn)
                    raise
        except psycopg_pool.PoolTimeout:
            if pooled or not full:
                raise
        return await self.reserve.fetch(sql, *args, timeout=timeout)

    async def close_reserve(self) -> None:
        await self.reserve.close()

    async def with_connection(self, fn: Callable[[Any], Awaitable[T]], *, timeout: float) -> T:
        async with asyncio.timeout(timeout), self._pool.connection() as conn:
            try:
                await self._admit(conn)
                return await fn(conn)
            except BaseException:
                await _close_psycopg(conn)
                raise

    async def listen(
        self,
        channel: str,
        on_notify: Callable[[str], None],
        name: str,
        stop: asyncio.Event,
        *,
        on_listening: Callable[[], None] | None = None,
    ) -> None:
        import psycopg

        kwargs = dict(self._pool.kwargs or {})
        kwargs["autocommit"] = True
        kwargs["application_name"] = name[:63]
        # A dedicated connection: a pooled one would be reset (and unlistened) on return.
        async with await psycopg.AsyncConnection.connect(self._pool.conninfo, **kwargs) as conn:
            await conn.execute(_SET_KEEPALIVES)
            await conn.execute(f'LISTEN "{channel}"')
            if on_listening is not None:
                on_listening()
            on_notify("")
            while not stop.is_set():
                async for note in conn.notifies(timeout=1.0):
                    on_notify(note.payload)
                if not stop.is_set():
                    async with asyncio.timeout(5.0):
                        await conn.execute("SELECT 1")

    async def close(self) -> None:
        await self._pool.close()


def _finish_psycopg(conn: Any) -> None:
    """Close a psycopg connection at once, without a round trip (its socket may be dead)."""
    conn.pgconn.finish()


async def _close_psycopg(conn: Any) -> None:
    """Close a psycopg connection on which an operation failed: the pool then replaces it."""
    with contextlib.suppress(Exception):
        await conn.close()


def open_db(pool: Any) -> WorkerDb | None:
    """Wrap an asyncpg or psycopg_pool pool; ``None`` for anything else."""
    if isinstance(pool, asyncpg.Pool):
        return _AsyncpgDb(pool)
    try:
        import psycopg_pool
    except ImportError:
        return None
    if isinstance(pool, psycopg_pool.AsyncConnectionPool):
        return _PsycopgDb(pool)
    return None


class _DirectListener:
    """A pool whose wake-up listener LISTENs on a direct connection of its own.

    Everything but :meth:`listen` goes to the pool (which may lead through a transaction
    pooler); the listener opens a connection from ``dsn`` (straight to PostgreSQL) for each
    LISTEN and closes it when LISTEN ends.
    """

    def __init__(self, db: WorkerDb, dsn: str) -> None:
        self._db = db
        self._dsn = dsn

    def max_size(self) -> int:
        return self._db.max_size()

    async def fetch(self, sql: str, *args: Any, timeout: float) -> list[tuple[Any, ...]]:
        return await self._db.fetch(sql, *args, timeout=timeout)

    async def fetch_reserved(self, sql: str, *args: Any, timeout: float) -> list[tuple[Any, ...]]:
        return await self._db.fetch_reserved(sql, *args, timeout=timeout)

    async def close_reserve(self) -> None:
        await self._db.close_reserve()

    async def with_connection(self, fn: Callable[[Any], Awaitable[T]], *, timeout: float) -> T:
        return await self._db.with_connection(fn, timeout=timeout)

    async def listen(
        self,
        channel: str,
        on_notify: Callable[[str], None],
        name: str,
        stop: asyncio.Event,
        *,
        on_listening: Callable[[], None] | None = None,
    ) -> None:
        async with asyncio.timeout(30.0):
            conn = await asyncpg.connect(self._dsn, server_settings={"application_name": name[:63]})
        try:
            lost = await _listen_on(conn, channel, on_notify, name, stop, on_listening)
        except BaseException:
            _terminate(conn)
            raise
        try:
            async with asyncio.timeout(2.0):
                await conn.close()
        except _UNLISTEN_ERRORS:
            _terminate(conn)
            raise
        if lost and not stop.is_set():
            raise ConnectionError("the listener connection was closed")

    async def close(self) -> None:
        await self._db.close()


def listening_on(db: WorkerDb, listen_dsn: str | None) -> WorkerDb:
    """``db``, with its wake-up listener on a direct connection from ``listen_dsn`` if given."""
    return db if listen_dsn is None else _DirectListener(db, listen_dsn)


async def _wait_any(events: tuple[asyncio.Event, ...], timeout: float) -> None:
    if any(e.is_set() for e in events):
        return
    waiters = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()


async def check_durable(conn: Any, schema: str, tables: tuple[str, ...]) -> None:
    """Refuse a server, session or schema that could lose acknowledged work.

    The checks are the recurring store's (``steeple.postgres._durability``), run through
    either driver.

    Raises:
        UnfitDatabaseError: ``fsync`` or ``full_page_writes`` off, ``synchronous_commit``
            off, a standby or read-only session, or an unlogged/temporary/missing table.
    """
    try:
        (row,) = await _driver.fetch(conn, SERVER_QUERY)
        require_durable_server(*row)
        rows = await _driver.fetch(conn, TABLES_QUERY, schema, list(tables))
        require_permanent_tables(schema, tables, dict(rows))
    except DurabilityProblem as exc:
        raise UnfitDatabaseError(str(exc), setting=exc.setting) from None
