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
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path
from typing import Self, TypeVar

import attrs

from steeple.core import limits
from steeple.core.config import RecurringConfig, RecurringDefinition
from steeple.core.entropy import SystemRandom
from steeple.core.errors import (
    RecurringConfigurationError,
    RecurringConflictError,
    RecurringDeadlineError,
    RecurringNotFoundError,
    RecurringSchemaVersionError,
    RecurringStorageError,
    SteepleError,
)
from steeple.core.leases import adopt_time
from steeple.core.messages import BrokerReceipt
from steeple.core.ports import Clock, MessageBroker, RandomSource, Sealer
from steeple.core.records import (
    Lease,
    OccurrenceInfo,
    Page,
    RelayOutcome,
    ScheduleInfo,
    TickResult,
)
from steeple.engine import (
    NamespaceState,
    RecurringEngine,
    RecurringRepository,
    read_clock,
    recurring_errors,
    seal_binding,
    verify_binding,
)
from steeple.sqlite import _sql
from steeple.sqlite._file import (
    busy_retry,
    close_quietly,
    create_file,
    map_error,
    open_database,
    read_only_reason,
)
from steeple.sqlite._repository import SqliteRepository, microseconds, namespace_state
from steeple.sqlite.errors import SqliteReadOnlyError, SqliteStorageError

__all__ = ["SqliteRecurringStore"]

_log = logging.getLogger("steeple.sqlite")

T = TypeVar("T")

_CALL_DEADLINE = limits.CALL_DEADLINE.total_seconds()
_GRACE = 5.0
"""How long past the deadline a caller waits for a thread stuck in the OS (a stalled disk)."""
_PROGRESS_OPS = 1000
"""SQLite virtual-machine steps between deadline/cancellation checks of a statement."""


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
class _Found:
    """What ``connect`` reads from the file."""

    state: NamespaceState
    mode: int


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

    async def transaction(
        self, operation: str, work: Callable[[RecurringRepository], Awaitable[T]]
    ) -> T:
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
        busy_retry(lambda: conn.execute("BEGIN IMMEDIATE"), call.deadline)

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

    def _transaction(
        self, call: _Call, what: str, work: Callable[[RecurringRepository], Awaitable[T]]
    ) -> T:
        conn = self.connection(call)
        self._begin(conn, call)
        try:
            row = conn.execute(_sql.READ_NAMESPACE, (self.namespace,)).fetchone()
            if row is None:
                raise RecurringNotFoundError(
                    f"namespace {self.namespace!r} no longer exists in {self.path}"
                )
            repository = SqliteRepository(conn, self.namespace, namespace_state(row))
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
            # The engine's work never waits on anything but this repository, whose methods
            # run here and never suspend: it completes within this one unit.
            result = self._loop.run_until_complete(work(repository))
            self._commit(conn, call, what)
            return result
        except BaseException:
            self._rollback(conn, call)
            raise

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
            (version,) = conn.execute(_sql.READ_VERSION).fetchone()
            if version != _sql.SCHEMA_VERSION:
                raise RecurringSchemaVersionError(str(self.path), version, _sql.SCHEMA_VERSION)
            row = conn.execute(_sql.READ_NAMESPACE, (self.namespace,)).fetchone()
            if row is not None:
                verify_binding(keyring, config, bytes(row[0]))
            else:
                now = microseconds(read_clock(clock))
                binding = seal_binding(keyring, config)
                conn.execute(
                    _sql.INSERT_NAMESPACE,
                    (self.namespace, binding, keyring.primary_key_id, now, now),
                )
            self._commit(conn, call, "initialize")
        except BaseException:
            self._rollback(conn, call)
            raise

    def verify(self, call: _Call) -> _Found:
        """Read what ``connect`` checks, and probe that the file takes writes (rolled back)."""
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
            found = conn.execute(_sql.READ_VERSION).fetchone()
            version = None if found is None else found[0]
            if version != _sql.SCHEMA_VERSION:
                raise RecurringSchemaVersionError(str(self.path), version, _sql.SCHEMA_VERSION)
            row = conn.execute(_sql.READ_NAMESPACE, (self.namespace,)).fetchone()
            if row is None:
                raise RecurringNotFoundError(
                    f"namespace {self.namespace!r} does not exist in {self.path}; run "
                    "initialize first"
                )
            # A read-only file, directory or mount still opens and reads: find out now.
            conn.execute(_sql.PROBE_WRITE, (self.namespace,))
        finally:
            self._rollback(conn, call)
        return _Found(namespace_state(row), stat.S_IMODE(os.stat(self.path).st_mode))

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
    if not isinstance(config, RecurringConfig):
        raise RecurringConfigurationError("config must be a RecurringConfig")
    if not all(callable(getattr(keyring, m, None)) for m in ("seal", "open")):
        raise RecurringConfigurationError("keyring must implement the Sealer protocol")
    if not callable(getattr(clock, "now", None)):
        raise RecurringConfigurationError("clock must implement the Clock protocol")
    return _check_path(path)


@attrs.define(repr=False)
class SqliteRecurringStore:
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
        found = await storage.run("connect", storage.verify)
        binding = found.state.binding
        assert binding is not None  # the column is NOT NULL
        verify_binding(keyring, config, binding)
        adopt_time(found.state.recorded_time, read_clock(clock))
        warnings = []
        if found.mode & 0o077:
            warnings.append(
                f"{storage.path} has mode {found.mode:o}: group or others may read it "
                "(definition names and calendars are plaintext); chmod 600 it"
            )
        for warning in warnings:
            _log.warning("steeple sqlite store: %s", warning)
        engine = RecurringEngine(
            storage, config, keyring, clock, random if random is not None else SystemRandom()
        )
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

    @property
    def config(self) -> RecurringConfig:
        """The namespace's configuration."""
        return self._config

    @property
    def namespace(self) -> str:
        """The namespace this store serves."""
        return self._config.namespace

    async def close(self) -> None:
        """Close this store's connection and thread (not other stores'). Idempotent."""
        await self._storage.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        return (
            f"SqliteRecurringStore(namespace={self._config.namespace!r}, "
            f"path={str(self._path)!r}, closed={self._storage.closed})"
        )

    # --- the engine's operations -----------------------------------------------------------

    async def create(self, definition: RecurringDefinition) -> ScheduleInfo:
        """Create an immutable definition, or replay an identical earlier creation.

        Returns:
            The definition's metadata (the original metadata on a replay).

        Raises:
            RecurringConfigurationError: ``definition`` is not a RecurringDefinition.
            RecurringConflictError: the name exists (active or cancelled) with a different
                definition.
            RecurringCapacityError: the namespace holds ``max_definitions`` already.
            RecurringKeyringError: the stored definition cannot be opened (its key is
                missing: also an ``UnknownKeyIdError`` naming the key id).
            RecurringStorageError: SQLite failed (typed subclasses in
                :mod:`steeple.sqlite.errors`).
            RecurringDeadlineError: the deadline passed (a lock held elsewhere).
            RecurringClockError: the clock trails the recorded time by more than 5 s.
        """
        return await self._engine.create(definition)

    async def create_many(
        self, definitions: Sequence[RecurringDefinition]
    ) -> list[ScheduleInfo | RecurringConflictError]:
        """Create up to 100 definitions in one transaction; each judged as ``create``.

        Each entry is created, replays an identical definition (stored, or earlier in the
        batch) or conflicts; a conflict is that entry's result. The quota holds for the
        batch: if the new definitions do not all fit, none is created.

        Returns:
            One result per definition, in order: its metadata, or the
            :class:`RecurringConflictError` a single ``create`` raises.

        Raises:
            RecurringConfigurationError: not a sequence of at most 100 definitions.
            RecurringCapacityError: the new definitions would exceed ``max_definitions``;
                nothing was created.
            RecurringKeyringError: a stored definition cannot be opened.
            RecurringStorageError: SQLite failed.
            RecurringDeadlineError: the deadline passed.
            RecurringClockError: the clock trails the recorded time by more than 5 s.
        """
        return await self._engine.create_many(definitions)

    async def cancel(self, name: str) -> ScheduleInfo:
        """Cancel a definition permanently; its name stays reserved and counts to the quota.

        Its unfinished occurrences are cancelled and their content erased at once. A
        publication already in flight cannot be recalled. Cancelling twice is a no-op.

        Raises:
            RecurringConfigurationError: ``name`` is not a str.
            RecurringNotFoundError: no definition of that name in this namespace.
            RecurringKeyringError: the definition cannot be opened for its metadata.
            RecurringStorageError: SQLite failed.
            RecurringDeadlineError: the deadline passed.
            RecurringClockError: the clock trails the recorded time by more than 5 s.
        """
        return await self._engine.cancel(name)

    async def schedules(self, after: str | None = None, limit: int = 100) -> Page[ScheduleInfo]:
        """List definitions' metadata by name, after the exclusive cursor ``after``.

        Raises:
            RecurringConfigurationError: ``limit`` outside 1..100.
            RecurringKeyringError: a listed definition cannot be opened.
            RecurringStorageError: SQLite failed.
            RecurringDeadlineError: the deadline passed.
            RecurringClockError: the clock trails the recorded time by more than 5 s.
        """
        return await self._engine.schedules(after, limit)

    async def tick(self, budget: int) -> TickResult:
        """Materialize due occurrences, oldest first, at most ``budget`` (1-100).

        Materialization and cursor advancement commit together; when the occurrence
        quota cannot hold the whole batch, nothing is stored.

        Raises:
            RecurringConfigurationError: ``budget`` outside 1..100.
            RecurringCapacityError: the batch would exceed ``max_occurrences``.
            RecurringKeyringError: a definition cannot be opened.
            RecurringStorageError: SQLite failed.
            RecurringDeadlineError: the deadline passed.
            RecurringClockError: the clock trails the recorded time by more than 5 s.
        """
        return await self._engine.tick(budget)

    async def claim(self, limit: int) -> list[Lease]:
        """Lease up to ``limit`` (1-100) publishable occurrences, oldest due first.

        Each lease gets a fresh random capability and a new revision, fencing any earlier
        holder, and ends no later than the delivery window. Expired work is classified
        (and its content erased) first.

        Raises:
            RecurringConfigurationError: ``limit`` outside 1..100.
            RecurringStorageError: SQLite failed.
            RecurringDeadlineError: the deadline passed.
            RecurringClockError: the clock trails the recorded time by more than 5 s.
        """
        return await self._engine.claim(limit)

    async def relay(self, lease: Lease, broker: MessageBroker) -> BrokerReceipt:
        """Publish a leased occurrence and record the outcome.

        One transaction re-checks the live lease and opens the content; the broker is
        called outside any transaction, bounded by the remaining lease and 10 s; a second
        transaction records the outcome, fenced by the lease's capability and revision.
        Anything the broker raises is recorded (retry with backoff, dead after ten
        attempts or when permanent).

        Returns:
            The broker's receipt (also when the definition was cancelled meanwhile).

        Raises:
            RelayLeaseLostError: the lease expired, was fenced by a newer claim, or the
                occurrence is no longer leased.
            RelayAcknowledgementError: the broker accepted but the outcome is uncertain;
                carries ``.receipt``; the occurrence is republished under the same key.
            RelayBrokerTimeoutError: the broker did not answer in time (retried later).
            RelayBrokerError: the broker failed, whatever it raised; ``permanent``
                failures become dead letters.
            RecurringKeyringError: the content cannot be opened (now a dead letter).
            RecurringStorageError: SQLite failed.
            RecurringDeadlineError: the deadline passed.
            RecurringClockError: the clock trails the recorded time by more than 5 s.
        """
        return await self._engine.relay(lease, broker)

    async def relay_many(
        self,
        leases: Sequence[Lease],
        broker: MessageBroker,
        *,
        concurrency: int = limits.RELAY_CONCURRENCY,
    ) -> list[RelayOutcome]:
        """Publish up to 100 leased occurrences and record each outcome (three steps).

        One transaction checks every lease; the publications run concurrently (at most
        ``concurrency`` at once) outside any transaction, each bounded by its remaining
        lease and 10 s; one transaction records the outcomes, each fenced by its own
        capability and revision.

        Returns:
            One :class:`RelayOutcome` per lease, in order: the receipt, or the error a
            single ``relay`` of that lease raises.

        Raises:
            RecurringConfigurationError: not a sequence of at most 100 Leases, no
                ``publish`` on ``broker``, or ``concurrency`` outside 1..100.
            RecurringStorageError: SQLite failed before anything was published.
            RecurringDeadlineError: the deadline passed before publication.
            RecurringClockError: the clock trails the recorded time by more than 5 s.
        """
        return await self._engine.relay_many(leases, broker, concurrency=concurrency)

    async def claim_and_relay(
        self,
        limit: int,
        broker: MessageBroker,
        *,
        concurrency: int = limits.RELAY_CONCURRENCY,
    ) -> list[RelayOutcome]:
        """Claim up to ``limit`` (1-100) occurrences and relay them (``claim`` + ``relay_many``).

        The claim and the relay's check of the new leases are one transaction; the
        publications and the recording are ``relay_many``'s.

        Returns:
            One :class:`RelayOutcome` per occurrence claimed, oldest due first.

        Raises:
            RecurringConfigurationError: ``limit`` or ``concurrency`` outside 1..100, or
                no ``publish`` on ``broker``.
            RecurringStorageError: SQLite failed; nothing was claimed or published.
            RecurringDeadlineError: the deadline passed.
            RecurringClockError: the clock trails the recorded time by more than 5 s.
        """
        return await self._engine.claim_and_relay(limit, broker, concurrency=concurrency)

    async def retry_failed(self, occurrence_id: str) -> OccurrenceInfo:
        """Give a dead occurrence a fresh automatic attempt budget inside its window.

        Raises:
            RecurringNotFoundError: no such occurrence in this namespace (or purged).
            RecurringInvalidStateError: the occurrence is not dead, or its window ended.
            RecurringStorageError: SQLite failed.
            RecurringDeadlineError: the deadline passed.
            RecurringClockError: the clock trails the recorded time by more than 5 s.
        """
        return await self._engine.retry_failed(occurrence_id)

    async def occurrences(self, after: str | None = None, limit: int = 100) -> Page[OccurrenceInfo]:
        """List occurrences' metadata by (due time, id), after the exclusive cursor ``after``.

        Expired work is classified (and its content erased) first. No payloads, no lease
        credentials.

        Raises:
            RecurringConfigurationError: ``limit`` outside 1..100, or a cursor this store
                did not return.
            RecurringStorageError: SQLite failed.
            RecurringDeadlineError: the deadline passed.
            RecurringClockError: the clock trails the recorded time by more than 5 s.
        """
        return await self._engine.occurrences(after, limit)

    async def purge_terminal(self, older_than: datetime, limit: int = 100) -> int:
        """Remove at most ``limit`` (1-100) terminal occurrences finished before ``older_than``.

        Expired work is classified first. Returns how many were removed.

        Raises:
            RecurringConfigurationError: ``limit`` outside 1..100, or a naive cutoff.
            RecurringStorageError: SQLite failed.
            RecurringDeadlineError: the deadline passed.
            RecurringClockError: the clock trails the recorded time by more than 5 s.
        """
        return await self._engine.purge_terminal(older_than, limit)
