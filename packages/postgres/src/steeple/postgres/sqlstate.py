"""What PostgreSQL's error codes (SQLSTATE) mean to steeple: the one table every package reads.

The queue, the recurring store, the work-queue broker and the admin CLI translate a
driver's failure into their own typed errors; which failure it was is decided here, once,
from the SQLSTATE that asyncpg and psycopg errors both carry (``exc.sqlstate``), and for
the failures that carry none (a connection closed under the driver) from the driver's
own exception types.
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "CANNOT_CONNECT_NOW",
    "DISK_FULL",
    "INVALID_AUTHORIZATION",
    "INVALID_CATALOG_NAME",
    "INVALID_PASSWORD",
    "LOCK_NOT_AVAILABLE",
    "QUERY_CANCELED",
    "READ_ONLY_TRANSACTION",
    "TOO_MANY_CONNECTIONS",
    "is_access_or_missing_object",
    "is_data_error",
    "is_data_exception",
    "is_insufficient_resources",
    "is_lost_connection",
    "is_message_refused",
    "is_missing_object",
    "is_not_installed",
    "is_session_ended",
    "sqlstate",
]

READ_ONLY_TRANSACTION: Final = "25006"
"""The session is read-only (a standby in recovery, ``default_transaction_read_only``)."""
DISK_FULL: Final = "53100"
TOO_MANY_CONNECTIONS: Final = "53300"
LOCK_NOT_AVAILABLE: Final = "55P03"
"""A lock wait exceeded ``lock_timeout`` (or ``NOWAIT``)."""
QUERY_CANCELED: Final = "57014"
"""A statement exceeded ``statement_timeout``, or was cancelled."""
CANNOT_CONNECT_NOW: Final = "57P03"
INVALID_CATALOG_NAME: Final = "3D000"
"""The database does not exist."""
INVALID_PASSWORD: Final = "28P01"  # noqa: S105 - an error code, not a password
INVALID_AUTHORIZATION: Final = "28000"
"""The role does not exist, or ``pg_hba.conf`` refuses this client."""

# The server ending the session: 57P01 admin_shutdown (pg_terminate_backend), 57P02
# crash_shutdown, 57P03 cannot_connect_now; class 08 is every connection exception.
_SESSION_ENDED: Final = frozenset({"57P01", "57P02", CANNOT_CONNECT_NOW})
# A table, column, function or schema that the statement names and the database lacks.
_MISSING_OBJECT: Final = frozenset({"42P01", "42703", "42883", "3F000"})
# The queue's tables or schema absent altogether.
_NOT_INSTALLED: Final = frozenset({"42P01", "3F000"})
# Classes of a statement refused for the values it carried: 22 data exception (out of
# range, bad text), 23 integrity (a CHECK), 54 program limit (too large).
_DATA_CLASSES: Final = frozenset({"22", "23", "54"})
# Classes of a message refused for its content by the work-queue broker: the same message
# fails the same way on every attempt (22: a character the encoding cannot hold; 54: an
# index row too large). Integrity (23) is the broker's own dedup, not the message's fault.
_MESSAGE_REFUSED_CLASSES: Final = frozenset({"22", "54"})


def sqlstate(exc: BaseException | None) -> str:
    """Return the SQLSTATE ``exc`` carries (asyncpg or psycopg), or ``""`` if none."""
    state = getattr(exc, "sqlstate", None)
    return state if isinstance(state, str) else ""


def is_session_ended(state: str) -> bool:
    """Tell whether the session is gone: a connection exception or the server ending it."""
    return state.startswith("08") or state in _SESSION_ENDED


def is_data_error(state: str) -> bool:
    """Tell whether a statement was refused for its values (it fails on every retry)."""
    return state[:2] in _DATA_CLASSES


def is_data_exception(state: str) -> bool:
    """Tell whether PostgreSQL cannot take a value as given (class 22)."""
    return state.startswith("22")


def is_message_refused(state: str) -> bool:
    """Tell whether a message's own content was refused (classes 22 and 54): permanent."""
    return state[:2] in _MESSAGE_REFUSED_CLASSES


def is_access_or_missing_object(state: str) -> bool:
    """Tell whether privileges or a missing object refused the statement (class 42)."""
    return state.startswith("42")


def is_insufficient_resources(state: str) -> bool:
    """Tell whether the server lacks resources (class 53: disk, memory, connections)."""
    return state.startswith("53")


def is_missing_object(state: str) -> bool:
    """Tell whether the statement names a table, column, function or schema that is absent."""
    return state in _MISSING_OBJECT


def is_not_installed(state: str) -> bool:
    """Tell whether the table or the schema itself is absent."""
    return state in _NOT_INSTALLED


def is_lost_connection(exc: BaseException) -> bool:
    """Tell whether a driver error without a SQLSTATE means the connection is closed."""
    module = type(exc).__module__
    if module.startswith("asyncpg"):
        import asyncpg

        # A backend ended under an idle connection (pg_terminate_backend) leaves asyncpg's
        # protocol mid-state: its next call reports InternalClientError, not a SQLSTATE.
        return isinstance(exc, asyncpg.exceptions.InternalClientError) or (
            isinstance(exc, asyncpg.InterfaceError) and "closed" in str(exc)
        )
    if module.startswith("psycopg"):
        import psycopg

        return isinstance(exc, psycopg.OperationalError) or (
            isinstance(exc, psycopg.InterfaceError) and "closed" in str(exc)
        )
    return False
