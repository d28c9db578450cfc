"""The SQLite store's errors: storage failures a file can have, each a RecurringStorageError.

Every one subclasses :class:`~steeple.core.errors.RecurringStorageError`, so a caller that
handles the recurring contract's storage errors handles these too; the subclasses say
what to do about the file.
"""

from __future__ import annotations

from steeple.core.errors import RecurringStorageError

__all__ = [
    "SqliteCorruptionError",
    "SqliteDiskFullError",
    "SqliteDurabilityError",
    "SqliteReadOnlyError",
    "SqliteStorageError",
]


class SqliteStorageError(RecurringStorageError):
    """SQLite failed or refused; nothing of the call was committed.

    Attributes:
        sqlite_error: SQLite's error name (``SQLITE_FULL``...), when SQLite gave one.
    """

    def __init__(self, message: str, *, sqlite_error: str | None = None) -> None:
        super().__init__(message)
        self.sqlite_error = sqlite_error


class SqliteDiskFullError(SqliteStorageError):
    """The file system holding the database is full (``SQLITE_FULL``): free space."""


class SqliteCorruptionError(SqliteStorageError):
    """The file is damaged or is not a database (``SQLITE_CORRUPT`` / ``SQLITE_NOTADB``)."""


class SqliteReadOnlyError(SqliteStorageError):
    """The database cannot be written (a read-only file, directory or file system)."""


class SqliteDurabilityError(SqliteStorageError):
    """The file cannot be kept durable (WAL refused, ``synchronous`` not ``FULL``)."""
