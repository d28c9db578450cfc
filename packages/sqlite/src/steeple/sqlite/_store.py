"""The embedded recurring-publication store: the engine over one SQLite file.

:class:`SqliteRecurringStore` is the recurring engine (:mod:`steeple.engine`, which holds
every operation and, through the core, every decision) over a SQLite adapter of the
engine's persistence port. This module does what is SQLite's own: one connection on one
dedicated thread, the file and its durability, deadlines and the mapping of SQLite's
errors.

Each call is one whole unit on that thread: ``BEGIN IMMEDIATE`` (the file's write lock,
the namespace's control row), the engine's work, ``COMMIT``. The coroutine that awaits it
may be cancelled or time out; the thread then rolls the unit back (unless it is already
committing) before it runs anything else, so no call leaves a transaction open.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sqlite3
import stat
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path
from typing import Self, TypeVar

import attrs

from steeple.core import limits
from steeple.core.config import RecurringConfig
from steeple.core.errors import (
    RecurringConfigurationError,
    RecurringDeadlineError,
    RecurringNotFoundError,
    RecurringStorageError,
    SteepleError,
)
from steeple.core.ports import Clock, RandomSource, Sealer
from steeple.engine import EngineStore, RecurringEngine, read_clock, recurring_errors
from steeple.engine.opening import check_parts, install_namespace, open_namespace
from steeple.engine.ports import RepositoryWork, StoredNamespace
from steeple.runtime.sqlitelock import retry_while_locked
from steeple.sqlite import _sql
from steeple.sqlite._file import (
    close_quietly,
    create_file,
    map_error,
    open_database,
    read_only_reason,
)
from steeple.sqlite._repository import SqliteRepository, microseconds, namespace_state
from steeple.sqlite.errors import SqliteReadOnlyError, SqliteStorageError

__all__ = ["SqliteRecurringStore"]

_CALL_DEADLINE = limits.CALL_DEADLINE.total_seconds()
_GRACE = 5.0
"""How long past the deadline a caller waits for a thread stuck in the OS (a stalled disk)."""
_PROGRESS_OPS = 1000
"""SQLite virtual-machine steps between deadline/cancellation checks of a statement."""

_log = logging.getLogger("steeple.sqlite")

T = TypeVar("T")


@attrs.define
class _Call:
    """One call as the store's thread sees it."""

    deadline: float
    abandoned: bool = False  # the awaiting coroutine was cancelled or timed out
    finishing: bool = False  # committing or rolling back: never interrupted

    def interrupted(self) -> str:
        if self.abandoned:
            return "the caller was cancelled"
        return f"the deadline ({_CALL_DEADLINE:g} s per call) passed"

    def check(self, what: str, waiting: str = "") -> None:
        if self.abandoned:
            raise RecurringStorageError(f"{what}: the caller was cancelled; nothing was stored")
        if time.monotonic() >= self.deadline:
            raise RecurringDeadlineError(
                f"{what}: the deadline ({_CALL_DEADLINE:g} s per call) passed{waiting}; "
                "nothing was stored"
            )


@attrs.frozen
class _SqliteOpening:
    """The open sequence's reads and writes on the thread's connection."""

    conn: sqlite3.Connection
    schema: str
    name: str
    probe: bool
    """Probe that the file takes writes once the namespace is found (connect)."""
    schema_version: int = _sql.SCHEMA_VERSION

    async def stored_version(self) -> object:
        found = self.conn.execute(_sql.READ_VERSION).fetchone()
        return None if found is None else found[0]

    async def namespace(self) -> StoredNamespace | None:
        row = self.conn.execute(_sql.READ_NAMESPACE, (self.name,)).fetchone()
        if row is None:
            return None
        if self.probe:
            # A read-only file, directory or mount still opens and reads: find out now.
            self.conn.execute(_sql.PROBE_WRITE, (self.name,))
        state = namespace_state(row)
        assert state.binding is not None  # the column is NOT NULL
        return StoredNamespace(state.binding, state.recorded_time)

    async def insert_namespace(self, binding: bytes, key_id: str, now: datetime) -> None:
        stamp = microseconds(now)
        self.conn.execute(_sql.INSERT_NAMESPACE, (self.name, binding, key_id, stamp, stamp))

    async def server_clock(self) -> None:
        # SQLite has no server: the file is read and written on this host, whose clock is
        # the only one there is. A host whose clock runs ahead is not refused here.
        return None


class _SqliteStorage:
    """The engine's :class:`~steeple.engine.RecurringStorage` port on one thread's connection.

    Only the thread touches the connection (and the event loop the engine's work runs
    on there); the event loop that awaits a call only waits for its result.
    """

    def __init__(self, path: Path, namespace: str) -> None:
        self.path = path
        self.namespace = namespace
        self.closed = False
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="steeple-sqlite")
        self._conn: sqlite3.Connection | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._call: _Call | None = None

    # --- the awaiting side -----------------------------------------------------------------

    async def run(self, what: str, fn: Callable[[_Call], T]) -> T:
        """Run ``fn`` on the store's thread within the call deadline.

        Raises:
            RecurringStorageError: the store is closed, or ``fn`` failed (typed).
            RecurringDeadlineError: the deadline passed (``fn`` was rolled back, or if the
                thread is stuck in the OS, its outcome is unknown).
        """
        if self.closed:
            raise RecurringStorageError(f"{what}: the store is closed")
        call = _Call(time.monotonic() + _CALL_DEADLINE)
        try:
            future = self._executor.submit(self._on_thread, call, what, fn)
        except RuntimeError:
            raise RecurringStorageError(f"{what}: the store is closed") from None
        backstop = asyncio.timeout(_CALL_DEADLINE + _GRACE)
        try:
            async with backstop:
                return await asyncio.wrap_future(future)
        except BaseException:
            # Cancelled, timed out or failed: a unit still running rolls back at its next
            # check (a queued one never starts), and the thread runs nothing else first.
            call.abandoned = True
            if backstop.expired():
                raise RecurringDeadlineError(
                    f"{what}: SQLite did not answer within {_CALL_DEADLINE + _GRACE:g} s "
                    "(a stalled disk?); the outcome is unknown"
                ) from None
            raise

    async def transaction(self, operation: str, work: RepositoryWork[T]) -> T:
        """Run ``work`` in one ``BEGIN IMMEDIATE`` transaction on the store's thread.

        Raises:
            RecurringNotFoundError: the namespace no longer exists in the file.
            RecurringStorageError, RecurringDeadlineError: SQLite failed, the deadline
                passed, the caller was cancelled, or the store is closed; nothing was
                committed.
        """
        return await self.run(operation, lambda call: self._transaction(call, operation, work))

    async def close(self) -> None:
        """Close the connection once the queued calls are done; stop the thread."""
        if self.closed:
            return
        self.closed = True
        future = self._executor.submit(self._close)
        self._executor.shutdown(wait=False)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(_CALL_DEADLINE + _GRACE):
                await asyncio.shield(asyncio.wrap_future(future))

    # --- the thread's side -----------------------------------------------------------------

    def _on_thread(self, call: _Call, what: str, fn: Callable[[_Call], T]) -> T:
        self._call = call
        try:
            call.check(what, " while it waited behind this store's earlier calls")
            return fn(call)
        except sqlite3.Error as exc:
            raise map_error(exc, what, path=self.path, interrupted=call.interrupted()) from exc
        except SteepleError:
            raise
        except Exception as exc:
            # A value SQLite cannot bind (an int beyond 64 bits, a lone surrogate), or a
            # file the OS refuses: typed at the boundary.
            raise SqliteStorageError(
                f"{what}: the SQLite store failed ({type(exc).__name__})"
            ) from exc
        finally:
            self._call = None

    def _progress(self) -> int:
        # Called by SQLite every _PROGRESS_OPS steps of a statement: non-zero interrupts it
        # (SQLITE_INTERRUPT), and the unit rolls back.
        call = self._call
        if call is None or call.finishing:
            return 0
        return int(call.abandoned or time.monotonic() >= call.deadline)

    def connection(self, call: _Call, *, create: bool = False) -> sqlite3.Connection:
        """Return the thread's connection, opened (and checked) on first use or after a discard."""
        if self._conn is None:
            conn = open_database(self.path, create=create, deadline=call.deadline)
            conn.set_progress_handler(self._progress, _PROGRESS_OPS)
            self._conn = conn
        return self._conn

    def _begin(self, conn: sqlite3.Connection, call: _Call) -> None:
        retry_while_locked(lambda: conn.execute("BEGIN IMMEDIATE"), call.deadline)

    def _commit(self, conn: sqlite3.Connection, call: _Call, what: str) -> None:
        call.check(what)
        call.finishing = True
        conn.execute("COMMIT")

    def _rollback(self, conn: sqlite3.Connection, call: _Call) -> None:
        call.finishing = True
        if not conn.in_transaction:
            return  # SQLite already rolled back (a full disk, an I/O error), or committed
        try:
            conn.execute("ROLLBACK")
        except sqlite3.Error:
            # Closing the connection rolls back for sure; the next call reopens it.
            self._conn = None
            close_quietly(conn)

    def _transaction(self, call: _Call, what: str, work: RepositoryWork[T]) -> T:
        conn = self.connection(call)
        self._begin(conn, call)
        try:
            row = conn.execute(_sql.READ_NAMESPACE, (self.namespace,)).fetchone()
            if row is None:
                raise RecurringNotFoundError(
                    f"namespace {self.namespace!r} no longer exists in {self.path}"
                )
            repository = SqliteRepository(conn, self.namespace, namespace_state(row))
            result = self._complete(work(repository))
            self._commit(conn, call, what)
            return result
        except BaseException:
            self._rollback(conn, call)
            raise

    def _complete(self, work: Awaitable[T]) -> T:
        # The engine's work never waits on anything but this thread's connection, whose
        # reads and writes never suspend: it completes on the thread's own event loop.
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
        return self._loop.run_until_complete(work)

    def install(self, call: _Call, config: RecurringConfig, keyring: Sealer, clock: Clock) -> None:
        """Create the file (0600), the schema and the namespace, once each (initialize)."""
        try:
            create_file(self.path)
        except OSError as exc:
            why = exc.strerror or type(exc).__name__
            reason = read_only_reason(self.path)
            if reason is not None:
                raise SqliteReadOnlyError(
                    f"initialize: cannot create {self.path}: {reason} ({why})"
                ) from None
            raise SqliteStorageError(f"initialize: cannot create {self.path} ({why})") from None
        conn = self.connection(call, create=True)
        self._begin(conn, call)
        try:
            for statement in _sql.SCHEMA:
                conn.execute(statement)
            conn.execute(_sql.INSERT_VERSION, (microseconds(read_clock(clock)),))
            opening = _SqliteOpening(conn, str(self.path), self.namespace, probe=False)
            self._complete(install_namespace(opening, config, keyring, clock))
            self._commit(conn, call, "initialize")
        except BaseException:
            self._rollback(conn, call)
            raise

    def verify(self, call: _Call, config: RecurringConfig, keyring: Sealer, clock: Clock) -> int:
        """Run connect's checks (the file takes writes: probed, rolled back); return its mode."""
        if not self.path.is_file():
            raise SqliteStorageError(
                f"connect: {self.path} does not exist (or is not a file); run initialize first"
            )
        conn = self.connection(call)
        self._begin(conn, call)
        try:
            if not conn.execute(_sql.HAS_VERSION_TABLE).fetchone()[0]:
                raise SqliteStorageError(
                    f"connect: {self.path} holds no steeple recurring store; run initialize"
                )
            opening = _SqliteOpening(conn, str(self.path), self.namespace, probe=True)
            self._complete(open_namespace(opening, config, keyring, clock))
        finally:
            self._rollback(conn, call)
        return stat.S_IMODE(os.stat(self.path).st_mode)

    def _close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            close_quietly(conn)
        loop, self._loop = self._loop, None
        if loop is not None:
            loop.close()


def _check_path(path: object) -> Path:
    if not isinstance(path, str | os.PathLike):
        raise RecurringConfigurationError("path must be a str or os.PathLike naming a file")
    text = os.fspath(path)
    if not isinstance(text, str):
        raise RecurringConfigurationError("path must be a str or os.PathLike naming a file")
    if text in ("", ":memory:") or text.startswith("file:") or "\x00" in text:
        raise RecurringConfigurationError(
            "path must name a file on disk (not empty, ':memory:', a URI or with NUL): "
            "the store keeps its state durable there"
        )
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise RecurringConfigurationError("path must be encodable as UTF-8") from None
    return Path(text).absolute()


def _check_inputs(path: object, config: object, keyring: object, clock: object) -> Path:
    check_parts(config, keyring, clock, sealer_is="keyring")
    return _check_path(path)


@attrs.define(repr=False)
class SqliteRecurringStore(EngineStore):
    """Recurring publications in one SQLite file, for one namespace, single node, embedded.

    Build it with :meth:`initialize` (creates the file) or :meth:`connect`. Every call is
    one transaction on the store's own thread with a 10-second deadline (lock waits
    included). The file is in WAL mode with ``synchronous=FULL``: a call that returned is
    on disk. Several stores (threads or processes on one machine) may share a file; their
    calls are serialized by its write lock.

    Attributes:
        warnings: problems found at connect (a file readable by group or others); also
            logged (logger ``steeple.sqlite``).
    """

    _path: Path
    _config: RecurringConfig
    _clock: Clock
    _storage: _SqliteStorage
    _engine: RecurringEngine
    warnings: list[str] = attrs.field(factory=list)

    # --- construction ----------------------------------------------------------------------

    @classmethod
    async def initialize(
        cls,
        path: str | os.PathLike[str],
        config: RecurringConfig,
        keyring: Sealer,
        clock: Clock,
        *,
        random: RandomSource | None = None,
    ) -> Self:
        """Create the file (mode 0600), its schema and the namespace once, then connect.

        Concurrent initializers (tasks or processes) converge; initializing an existing
        namespace with the same configuration and keyring is a no-op.

        Raises:
            RecurringConfigurationError: bad arguments, or the namespace exists with a
                different configuration (or keyring).
            SqliteDurabilityError: the file system cannot hold the file in WAL mode with
                ``synchronous=FULL`` (or SQLite is older than 3.37).
            SqliteReadOnlyError, SqliteDiskFullError, SqliteCorruptionError: the file
                cannot be written, its disk is full, or it is not a sound database.
            RecurringSchemaVersionError: the file holds another schema version.
            RecurringStorageError: the file cannot be created or opened.
            RecurringDeadlineError: the file stayed locked past the deadline.
            RecurringClockError: the clock trails the recorded time by more than 5 s.
        """
        file = _check_inputs(path, config, keyring, clock)
        storage = _SqliteStorage(file, config.namespace)
        try:
            with recurring_errors("initialize"):
                await storage.run(
                    "initialize", lambda call: storage.install(call, config, keyring, clock)
                )
                return await cls._open(storage, config, keyring, clock, random)
        except BaseException:
            await storage.close()
            raise

    @classmethod
    async def connect(
        cls,
        path: str | os.PathLike[str],
        config: RecurringConfig,
        keyring: Sealer,
        clock: Clock,
        *,
        random: RandomSource | None = None,
    ) -> Self:
        """Open an initialized file; never creates, repairs or changes anything.

        Checks WAL mode and ``synchronous=FULL``, that the file takes writes, the schema
        version and the configuration binding.

        Raises:
            RecurringConfigurationError: bad arguments, or a configuration/keyring that
                does not match the namespace's binding.
            RecurringNotFoundError: the namespace was never initialized in this file.
            SqliteDurabilityError: the file is not in WAL mode (run initialize), or
                ``synchronous=FULL`` cannot be set.
            SqliteReadOnlyError, SqliteCorruptionError: the file cannot be written, or is
                not a sound database.
            RecurringSchemaVersionError: the file holds another schema version.
            RecurringStorageError: the file is missing, holds no store, or cannot be opened.
            RecurringDeadlineError: the file stayed locked past the deadline.
            RecurringClockError: the clock trails the recorded time by more than 5 s.
        """
        file = _check_inputs(path, config, keyring, clock)
        storage = _SqliteStorage(file, config.namespace)
        try:
            with recurring_errors("connect"):
                return await cls._open(storage, config, keyring, clock, random)
        except BaseException:
            await storage.close()
            raise

    @classmethod
    async def _open(
        cls,
        storage: _SqliteStorage,
        config: RecurringConfig,
        keyring: Sealer,
        clock: Clock,
        random: RandomSource | None,
    ) -> Self:
        mode = await storage.run(
            "connect", lambda call: storage.verify(call, config, keyring, clock)
        )
        warnings = []
        if mode & 0o077:
            warnings.append(
                f"{storage.path} has mode {mode:o}: group or others may read it "
                "(definition names and calendars are plaintext); chmod 600 it"
            )
        for warning in warnings:
            _log.warning("steeple sqlite store: %s", warning)
        engine = RecurringEngine(storage, config, keyring, clock, random)
        return cls(
            path=storage.path,
            config=config,
            clock=clock,
            storage=storage,
            engine=engine,
            warnings=warnings,
        )

    # --- lifecycle -------------------------------------------------------------------------

    @property
    def path(self) -> Path:
        """The database file."""
        return self._path

    async def close(self) -> None:
        """Close this store's connection and thread (not other stores'). Idempotent."""
        await self._storage.close()

    def __repr__(self) -> str:
        return (
            f"SqliteRecurringStore(namespace={self._config.namespace!r}, "
            f"path={str(self._path)!r}, closed={self._storage.closed})"
        )
