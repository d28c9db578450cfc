"""What SQLite's failures mean to steeple: the one table the SQLite store and journal read.

The SQLite recurring store (``steeple.sqlite``) and the SQLite journal broker
(``steeple.brokers.sqlite``) translate a ``sqlite3`` failure into their own typed errors;
which failure it was is decided here, once, from the result code the standard library's
``sqlite3`` errors carry (``exc.sqlite_errorcode``: an extended code whose low byte is the
primary one), and for the errors the ``sqlite3`` module raises itself, which carry none,
from their DB-API class. The codes are SQLite's documented, stable values: the core does no
I/O and does not import ``sqlite3``.
"""

from __future__ import annotations

import enum
from typing import Final

from steeple.core._validate import TypedEnumType

__all__ = [
    "SQLITE_BUSY",
    "SQLITE_CANTOPEN",
    "SQLITE_CONSTRAINT",
    "SQLITE_CORRUPT",
    "SQLITE_FULL",
    "SQLITE_INTERRUPT",
    "SQLITE_IOERR",
    "SQLITE_LOCKED",
    "SQLITE_MISMATCH",
    "SQLITE_NOTADB",
    "SQLITE_READONLY",
    "SQLITE_TOOBIG",
    "SqliteFailure",
    "sqlite_error_name",
    "sqlite_failure",
]

# SQLite's primary result codes (https://www.sqlite.org/rescode.html), as ``sqlite3`` names them.
SQLITE_BUSY: Final = 5
SQLITE_LOCKED: Final = 6
SQLITE_READONLY: Final = 8
SQLITE_INTERRUPT: Final = 9
SQLITE_IOERR: Final = 10
SQLITE_CORRUPT: Final = 11
SQLITE_FULL: Final = 13
SQLITE_CANTOPEN: Final = 14
SQLITE_TOOBIG: Final = 18
SQLITE_CONSTRAINT: Final = 19
SQLITE_MISMATCH: Final = 20
SQLITE_NOTADB: Final = 26


class SqliteFailure(enum.Enum, metaclass=TypedEnumType):
    """What a ``sqlite3`` failure was (see :func:`sqlite_failure`)."""

    LOCKED = "locked"
    """Another connection or process held the lock past the wait (``SQLITE_BUSY``,
    ``SQLITE_LOCKED``): nothing was written; it may succeed later."""
    INTERRUPTED = "interrupted"
    """The statement was interrupted (``SQLITE_INTERRUPT``: a deadline, a caller gone)."""
    FULL = "full"
    """The database or its file system is full (``SQLITE_FULL``)."""
    CORRUPT = "corrupt"
    """The file is damaged or is not a database (``SQLITE_CORRUPT``, ``SQLITE_NOTADB``)."""
    READ_ONLY = "read_only"
    """The database cannot be written (``SQLITE_READONLY``)."""
    CANNOT_OPEN = "cannot_open"
    """The file, or its ``-wal``/``-shm`` files, cannot be opened (``SQLITE_CANTOPEN``)."""
    IO_ERROR = "io_error"
    """The operating system reported an I/O error (``SQLITE_IOERR``)."""
    TOO_BIG = "too_big"
    """A value over SQLite's length limit (``SQLITE_TOOBIG``, or the module's
    ``DataError``): it will never fit."""
    CONSTRAINT = "constraint"
    """A constraint refused the row (``SQLITE_CONSTRAINT``, ``SQLITE_MISMATCH``, or the
    module's ``IntegrityError``)."""
    OTHER = "other"
    """Any other failure."""


_BY_CODE: Final = {
    SQLITE_BUSY: SqliteFailure.LOCKED,
    SQLITE_LOCKED: SqliteFailure.LOCKED,
    SQLITE_INTERRUPT: SqliteFailure.INTERRUPTED,
    SQLITE_FULL: SqliteFailure.FULL,
    SQLITE_CORRUPT: SqliteFailure.CORRUPT,
    SQLITE_NOTADB: SqliteFailure.CORRUPT,
    SQLITE_READONLY: SqliteFailure.READ_ONLY,
    SQLITE_CANTOPEN: SqliteFailure.CANNOT_OPEN,
    SQLITE_IOERR: SqliteFailure.IO_ERROR,
    SQLITE_TOOBIG: SqliteFailure.TOO_BIG,
    SQLITE_CONSTRAINT: SqliteFailure.CONSTRAINT,
    SQLITE_MISMATCH: SqliteFailure.CONSTRAINT,
}
# The DB-API classes the sqlite3 module raises without a result code (a string longer
# than SQLite can bind is a DataError raised before SQLite sees it).
_BY_CLASS: Final = {"DataError": SqliteFailure.TOO_BIG, "IntegrityError": SqliteFailure.CONSTRAINT}


def _primary_code(exc: BaseException) -> int | None:
    code = getattr(exc, "sqlite_errorcode", None)
    if isinstance(code, bool) or not isinstance(code, int):
        return None
    return code & 0xFF


def sqlite_failure(exc: BaseException) -> SqliteFailure:
    """Return what the ``sqlite3`` error ``exc`` was, from its result code or its class."""
    code = _primary_code(exc)
    if code is not None:
        return _BY_CODE.get(code, SqliteFailure.OTHER)
    for cls in type(exc).__mro__:
        failure = _BY_CLASS.get(cls.__name__)
        if failure is not None:
            return failure
    return SqliteFailure.OTHER


def sqlite_error_name(exc: BaseException) -> str | None:
    """Return SQLite's name of the error (``SQLITE_BUSY_SNAPSHOT``...), if it gave one."""
    name = getattr(exc, "sqlite_errorname", None)
    return name if isinstance(name, str) else None
