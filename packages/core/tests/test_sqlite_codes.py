"""The one table of what SQLite's failures mean, checked against real sqlite3 errors."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from steeple.core import sqlite_codes
from steeple.core.errors import ConfigurationError
from steeple.core.sqlite_codes import SqliteFailure, sqlite_error_name, sqlite_failure


def test_the_codes_are_sqlites_own() -> None:
    codes = [name for name in sqlite_codes.__all__ if name.startswith("SQLITE_")]
    assert codes
    for name in codes:
        assert getattr(sqlite_codes, name) == getattr(sqlite3, name), name


def _raised(fn: object) -> sqlite3.Error:
    assert callable(fn)
    with pytest.raises(sqlite3.Error) as caught:
        fn()
    return caught.value


@pytest.fixture
def conn(tmp_path: Path) -> Iterator[sqlite3.Connection]:
    connection = sqlite3.connect(tmp_path / "db.sqlite", timeout=0, isolation_level=None)
    connection.execute("CREATE TABLE t (k TEXT PRIMARY KEY, v BLOB)")
    yield connection
    connection.close()


def test_a_lock_held_by_another_connection_is_locked(
    conn: sqlite3.Connection, tmp_path: Path
) -> None:
    other = sqlite3.connect(tmp_path / "db.sqlite", timeout=0, isolation_level=None)
    try:
        other.execute("BEGIN IMMEDIATE")
        exc = _raised(lambda: conn.execute("BEGIN IMMEDIATE"))
    finally:
        other.close()
    assert sqlite_failure(exc) is SqliteFailure.LOCKED
    assert sqlite_error_name(exc) == "SQLITE_BUSY"


def test_a_duplicate_key_is_a_constraint(conn: sqlite3.Connection) -> None:
    conn.execute("INSERT INTO t VALUES ('a', x'00')")
    exc = _raised(lambda: conn.execute("INSERT INTO t VALUES ('a', x'00')"))
    assert sqlite_failure(exc) is SqliteFailure.CONSTRAINT
    assert sqlite_error_name(exc) == "SQLITE_CONSTRAINT_PRIMARYKEY"  # an extended code


def test_a_value_over_the_length_limit_is_too_big(conn: sqlite3.Connection) -> None:
    conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, 100)
    exc = _raised(lambda: conn.execute("INSERT INTO t VALUES ('a', ?)", (b"x" * 1000,)))
    assert sqlite_failure(exc) is SqliteFailure.TOO_BIG


def test_an_interrupted_statement_is_interrupted(conn: sqlite3.Connection) -> None:
    conn.set_progress_handler(lambda: 1, 1)
    exc = _raised(lambda: conn.execute("SELECT count(*) FROM t"))
    assert sqlite_failure(exc) is SqliteFailure.INTERRUPTED


def test_a_file_that_is_not_a_database_is_corrupt(tmp_path: Path) -> None:
    path = tmp_path / "junk.sqlite"
    path.write_bytes(b"not a database, " * 256)
    junk = sqlite3.connect(path)
    try:
        exc = _raised(lambda: junk.execute("SELECT * FROM sqlite_master"))
    finally:
        junk.close()
    assert sqlite_failure(exc) is SqliteFailure.CORRUPT


def test_a_read_only_connection_refuses_writes(conn: sqlite3.Connection, tmp_path: Path) -> None:
    reader = sqlite3.connect(f"file:{tmp_path / 'db.sqlite'}?mode=ro", uri=True)
    try:
        exc = _raised(lambda: reader.execute("INSERT INTO t VALUES ('b', x'00')"))
    finally:
        reader.close()
    assert sqlite_failure(exc) is SqliteFailure.READ_ONLY


def test_a_file_in_a_missing_directory_cannot_open(tmp_path: Path) -> None:
    exc = _raised(lambda: sqlite3.connect(tmp_path / "missing" / "db.sqlite"))
    assert sqlite_failure(exc) is SqliteFailure.CANNOT_OPEN


def test_errors_without_a_code_are_read_by_their_class() -> None:
    assert sqlite_failure(sqlite3.DataError("string longer than INT_MAX bytes")) is (
        SqliteFailure.TOO_BIG
    )
    assert sqlite_failure(sqlite3.IntegrityError("refused")) is SqliteFailure.CONSTRAINT
    assert sqlite_failure(sqlite3.ProgrammingError("closed")) is SqliteFailure.OTHER
    # A message is never read: "locked" in the text of an uncoded error is not a lock.
    assert sqlite_failure(sqlite3.OperationalError("database is locked")) is SqliteFailure.OTHER
    assert sqlite_failure(ValueError("x")) is SqliteFailure.OTHER
    assert sqlite_error_name(sqlite3.OperationalError("x")) is None


def test_an_unknown_or_malformed_code_is_other() -> None:
    exc = sqlite3.OperationalError("x")
    exc.sqlite_errorcode = 1  # SQLITE_ERROR
    assert sqlite_failure(exc) is SqliteFailure.OTHER
    exc.sqlite_errorcode = True  # a bool is no code
    assert sqlite_failure(exc) is SqliteFailure.OTHER


def test_the_failure_kinds_refuse_a_foreign_value() -> None:
    with pytest.raises(ConfigurationError):
        SqliteFailure("bogus")
