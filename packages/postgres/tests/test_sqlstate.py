"""The one SQLSTATE table: its codes are the drivers' names, and each decision reads it."""

from __future__ import annotations

import asyncpg
import psycopg
import pytest

from steeple.postgres import sqlstate as s
from steeple.postgres._durability import write_refusal
from steeple.postgres.queue._driver import is_data_error, typed_db_error
from steeple.postgres.queue.errors import (
    QueueDeadlineError,
    QueueUnavailableError,
    UnfitDatabaseError,
)

# Each named code, with the class asyncpg raises for it and psycopg's name for it.
NAMED = [
    (s.READ_ONLY_TRANSACTION, asyncpg.ReadOnlySQLTransactionError, "ReadOnlySqlTransaction"),
    (s.DISK_FULL, asyncpg.DiskFullError, "DiskFull"),
    (s.TOO_MANY_CONNECTIONS, asyncpg.TooManyConnectionsError, "TooManyConnections"),
    (s.LOCK_NOT_AVAILABLE, asyncpg.LockNotAvailableError, "LockNotAvailable"),
    (s.QUERY_CANCELED, asyncpg.QueryCanceledError, "QueryCanceled"),
    (s.CANNOT_CONNECT_NOW, asyncpg.CannotConnectNowError, "CannotConnectNow"),
    (s.INVALID_CATALOG_NAME, asyncpg.InvalidCatalogNameError, "InvalidCatalogName"),
    (s.INVALID_PASSWORD, asyncpg.InvalidPasswordError, "InvalidPassword"),
    (
        s.INVALID_AUTHORIZATION,
        asyncpg.InvalidAuthorizationSpecificationError,
        "InvalidAuthorizationSpecification",
    ),
]


@pytest.mark.parametrize(("code", "asyncpg_class", "psycopg_name"), NAMED)
def test_named_codes_are_the_drivers_codes(
    code: str, asyncpg_class: type[asyncpg.PostgresError], psycopg_name: str
) -> None:
    assert asyncpg_class.sqlstate == code
    assert psycopg.errors.lookup(code).__name__ == psycopg_name


class _Err(Exception):
    def __init__(self, sqlstate: object) -> None:
        super().__init__("driver text that may quote a value")
        self.sqlstate = sqlstate


def test_sqlstate_reads_either_driver_and_nothing_else() -> None:
    assert s.sqlstate(asyncpg.LockNotAvailableError("x")) == "55P03"
    assert s.sqlstate(psycopg.errors.lookup("57014")("x")) == "57014"
    assert s.sqlstate(_Err(None)) == ""
    assert s.sqlstate(_Err(42)) == ""
    assert s.sqlstate(ValueError("x")) == ""
    assert s.sqlstate(None) == ""


@pytest.mark.parametrize(
    ("code", "classes"),
    [
        ("08006", {"session_ended"}),
        ("57P01", {"session_ended"}),
        ("57P02", {"session_ended"}),
        ("57P03", {"session_ended"}),
        ("22003", {"data_error", "data_exception", "message_refused"}),
        ("23514", {"data_error"}),
        ("54000", {"data_error", "message_refused"}),
        ("42501", {"access_or_missing_object"}),
        ("42P01", {"access_or_missing_object", "missing_object", "not_installed"}),
        ("42703", {"access_or_missing_object", "missing_object"}),
        ("42883", {"access_or_missing_object", "missing_object"}),
        ("3F000", {"missing_object", "not_installed"}),
        ("53100", {"insufficient_resources"}),
        ("53200", {"insufficient_resources"}),
        ("55P03", set()),
        ("57014", set()),
        ("40001", set()),
        ("", set()),
    ],
)
def test_every_class_of_code_is_decided_once(code: str, classes: set[str]) -> None:
    predicates = {
        "session_ended": s.is_session_ended,
        "data_error": s.is_data_error,
        "data_exception": s.is_data_exception,
        "message_refused": s.is_message_refused,
        "access_or_missing_object": s.is_access_or_missing_object,
        "insufficient_resources": s.is_insufficient_resources,
        "missing_object": s.is_missing_object,
        "not_installed": s.is_not_installed,
    }
    assert {name for name, holds in predicates.items() if holds(code)} == classes


@pytest.mark.parametrize(
    ("code", "typed"),
    [
        ("55P03", QueueDeadlineError),
        ("57014", QueueDeadlineError),
        ("08006", QueueUnavailableError),
        ("57P01", QueueUnavailableError),
        ("25006", UnfitDatabaseError),
        ("53100", UnfitDatabaseError),
        ("53300", UnfitDatabaseError),
    ],
)
def test_the_queue_translates_through_the_table(code: str, typed: type[Exception]) -> None:
    for exc in (_Err(code), psycopg.errors.lookup(code)("x")):
        error = typed_db_error(exc)
        assert type(error) is typed
        assert "driver text" not in str(error)
    assert typed_db_error(_Err("40001")) is None
    assert is_data_error(_Err("23505"))
    assert not is_data_error(_Err("40001"))


def test_write_refusals_name_the_setting() -> None:
    assert write_refusal(_Err("25006"))[0] == "read_only"  # type: ignore[index]
    assert write_refusal(_Err("53100"))[0] == "disk_full"  # type: ignore[index]
    assert write_refusal(_Err("53400"))[0] == "insufficient_resources"  # type: ignore[index]
    assert write_refusal(_Err("22003")) is None
    assert write_refusal(_Err(None)) is None


def test_a_closed_connection_without_a_code_is_recognised_per_driver() -> None:
    assert s.is_lost_connection(asyncpg.InterfaceError("connection is closed"))
    assert s.is_lost_connection(asyncpg.exceptions.InternalClientError("mid-state"))
    assert not s.is_lost_connection(asyncpg.InterfaceError("another interface problem"))
    assert s.is_lost_connection(psycopg.OperationalError("server closed the connection"))
    assert not s.is_lost_connection(ValueError("closed"))
