"""What is SQLite's own: opening the file, durability checks, errors, lock waits.

Everything here runs on the store's thread (blocking calls), bounded by the call's
monotonic deadline.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import urllib.parse
from pathlib import Path

from steeple.core.errors import RecurringDeadlineError, RecurringStorageError
from steeple.core.sqlite_codes import SqliteFailure, sqlite_error_name, sqlite_failure
from steeple.runtime.sqlitelock import retry_while_locked
from steeple.sqlite._sql import MIN_SQLITE
from steeple.sqlite.errors import (
    SqliteCorruptionError,
    SqliteDiskFullError,
    SqliteDurabilityError,
    SqliteReadOnlyError,
    SqliteStorageError,
)

__all__ = ["create_file", "map_error", "open_database", "read_only_reason"]


FILE_MODE = 0o600
LOCK_POLL_MS = 100
"""SQLite's busy timeout: how long one attempt waits for a lock.

Short and fixed (a busy timeout that changed with every call's deadline would be a new
statement text each time, flooding the statement cache): the store's lock wait is
:func:`~steeple.runtime.sqlitelock.retry_while_locked` until the call's deadline.
"""
_SYNCHRONOUS_FULL = 2


def read_only_reason(path: Path) -> str | None:
    """Say why ``path`` cannot be written, if the OS says it cannot."""
    try:
        if os.statvfs(path.parent).f_flag & os.ST_RDONLY:
            return "its file system is mounted read-only"
    except OSError:
        return None
    if path.exists() and not os.access(path, os.W_OK):
        return "the file is not writable by this user"
    if not os.access(path.parent, os.W_OK):
        return "its directory is not writable by this user (WAL needs -wal and -shm files)"
    return None


# Failures that may mean the file cannot be written at all: told apart by asking the OS.
_MAYBE_UNWRITABLE = frozenset(
    {SqliteFailure.CANNOT_OPEN, SqliteFailure.READ_ONLY, SqliteFailure.IO_ERROR}
)

# The typed error and its advice for each failure that has one of its own.
_TYPED: dict[SqliteFailure, tuple[type[SqliteStorageError], str]] = {
    SqliteFailure.FULL: (
        SqliteDiskFullError,
        "the database or its file system is full ({name}); nothing was committed: free "
        "space and retry",
    ),
    SqliteFailure.CORRUPT: (
        SqliteCorruptionError,
        "the file is damaged or is not a steeple database ({name}); nothing was committed: "
        "restore it from a backup",
    ),
    SqliteFailure.READ_ONLY: (
        SqliteReadOnlyError,
        "the database cannot be written ({name}): check the permissions of the file, its "
        "-wal and -shm files and its directory, and that the file system is mounted "
        "read-write",
    ),
    SqliteFailure.CANNOT_OPEN: (
        SqliteStorageError,
        "SQLite cannot open the file or its -wal/-shm files ({name}): check that it exists "
        "(initialize creates it) and that its directory is writable",
    ),
}


def map_error(
    exc: sqlite3.Error, what: str, *, path: Path | None = None, interrupted: str = ""
) -> RecurringStorageError:
    """Return the typed error for a sqlite3 failure of ``what``; nothing was committed.

    Which failure it was is :func:`steeple.core.sqlite_codes.sqlite_failure`'s to say.
    ``interrupted`` explains an ``SQLITE_INTERRUPT`` (the deadline, or a caller gone);
    ``path`` lets a refusal to open or write be told apart as a read-only file.
    """
    failure, name = sqlite_failure(exc), sqlite_error_name(exc)
    if failure in _MAYBE_UNWRITABLE and path is not None:
        reason = read_only_reason(path)
        if reason is not None:
            return SqliteReadOnlyError(
                f"{what}: {path} cannot be written: {reason} ({name})", sqlite_error=name
            )
    if failure is SqliteFailure.LOCKED:
        return RecurringDeadlineError(
            f"{what}: the write lock was not free before the deadline (10 s per call): "
            "another connection or process holds it; nothing was stored"
        )
    if failure is SqliteFailure.INTERRUPTED:
        return RecurringDeadlineError(
            f"{what}: {interrupted or 'the statement was interrupted'}; nothing was stored"
        )
    typed = _TYPED.get(failure)
    if typed is not None:
        error_type, advice = typed
        return error_type(f"{what}: {advice.format(name=name)}", sqlite_error=name)
    if name is None:
        return SqliteStorageError(f"{what}: SQLite failed ({type(exc).__name__}: {exc})")
    return SqliteStorageError(f"{what}: SQLite failed ({name}: {exc})", sqlite_error=name)


def create_file(path: Path) -> None:
    """Create ``path`` readable and writable by its owner only (0600), if it is missing.

    SQLite gives the ``-wal`` and ``-shm`` files the database file's permissions. The new
    directory entry is made durable.
    """
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, FILE_MODE)
    except FileExistsError:
        return
    try:
        os.fchmod(fd, FILE_MODE)  # whatever the umask
        os.fsync(fd)
    finally:
        os.close(fd)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def open_database(
    path: Path, *, create: bool, deadline: float, vfs: str | None = None
) -> sqlite3.Connection:
    """Open ``path`` in WAL mode with ``synchronous=FULL``, or refuse it.

    ``create`` allows switching a file to WAL (``initialize``); ``connect`` refuses a file
    that is not in WAL mode rather than change it. ``vfs`` is for tests (a VFS that
    cannot do WAL).

    Raises:
        SqliteDurabilityError: SQLite is too old, or WAL mode or ``synchronous=FULL``
            cannot be had on this file (its file system or VFS).
        RecurringStorageError: the file cannot be opened (typed as :func:`map_error` says).
        RecurringDeadlineError: the file stayed locked past the deadline.
    """
    if sqlite3.sqlite_version_info < MIN_SQLITE:
        raise SqliteDurabilityError(
            f"the SQLite store needs SQLite {'.'.join(map(str, MIN_SQLITE))} or newer; this "
            f"Python uses {sqlite3.sqlite_version}"
        )
    query = {"mode": "rwc" if create else "rw"}
    if vfs is not None:
        query["vfs"] = vfs
    uri = f"file:{urllib.parse.quote(str(path))}?{urllib.parse.urlencode(query)}"
    what = "initialize" if create else "connect"
    try:
        conn = sqlite3.connect(uri, uri=True, timeout=0, isolation_level=None)
    except sqlite3.Error as exc:
        raise map_error(exc, f"{what}: opening {path}", path=path) from None
    try:
        conn.execute(f"PRAGMA busy_timeout = {LOCK_POLL_MS}")
        _check_durable(conn, path, create, deadline)
        conn.execute("PRAGMA foreign_keys = ON")
        conn.execute("PRAGMA trusted_schema = OFF")
    except sqlite3.Error as exc:
        conn.close()
        raise map_error(exc, f"{what}: opening {path}", path=path) from None
    except BaseException:
        conn.close()
        raise
    return conn


def _check_durable(conn: sqlite3.Connection, path: Path, create: bool, deadline: float) -> None:
    # Reading the header can meet a lock (a recovery, another opener): retried in time.
    mode = str(
        retry_while_locked(lambda: conn.execute("PRAGMA journal_mode").fetchone()[0], deadline)
    )
    if mode.lower() != "wal" and create:
        # Concurrent first opens of a new file: all but one fail at once with "database
        # is locked" (no busy wait for a journal-mode change); retried until the deadline.
        mode = str(
            retry_while_locked(
                lambda: conn.execute("PRAGMA journal_mode = WAL").fetchone()[0], deadline
            )
        )
    if mode.lower() != "wal":
        hint = (
            "the file system or VFS cannot provide WAL's shared memory"
            if create
            else "run initialize to set it"
        )
        raise SqliteDurabilityError(f"{path}: journal_mode is {mode!r}, not 'wal' ({hint})")
    conn.execute("PRAGMA synchronous = FULL")
    synchronous = conn.execute("PRAGMA synchronous").fetchone()[0]
    if synchronous != _SYNCHRONOUS_FULL:
        raise SqliteDurabilityError(
            f"{path}: synchronous is {synchronous}, not FULL (2): commits would not be durable"
        )


def close_quietly(conn: sqlite3.Connection) -> None:
    """Close ``conn``; closing rolls back any open transaction."""
    with contextlib.suppress(sqlite3.Error):
        conn.close()
