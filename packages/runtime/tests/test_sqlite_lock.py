"""The one wait for a locked SQLite file: retried while locked, until the deadline, else raised."""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from steeple.core.sqlite_codes import SqliteFailure, sqlite_failure
from steeple.runtime.sqlitelock import retry_while_locked


@pytest.fixture
def two_connections(tmp_path: Path) -> Iterator[tuple[sqlite3.Connection, sqlite3.Connection]]:
    """A connection holding the file's write lock, and one that is refused at once."""
    path = tmp_path / "locked.sqlite3"
    holder = sqlite3.connect(path, isolation_level=None)
    other = sqlite3.connect(path, isolation_level=None, timeout=0)
    try:
        holder.execute("CREATE TABLE t (x INTEGER)")
        holder.execute("BEGIN EXCLUSIVE")
        yield holder, other
    finally:
        other.close()
        holder.close()


def test_a_lock_is_waited_for_until_it_is_free(
    two_connections: tuple[sqlite3.Connection, sqlite3.Connection],
) -> None:
    holder, other = two_connections
    attempts = 0

    def write() -> int:
        nonlocal attempts
        attempts += 1
        if attempts == 3:
            holder.execute("ROLLBACK")  # the holder lets go before the third attempt
        other.execute("BEGIN IMMEDIATE")
        other.execute("INSERT INTO t VALUES (1)")
        other.execute("COMMIT")
        return attempts

    assert retry_while_locked(write, time.monotonic() + 60) == 3


def test_past_the_deadline_the_lock_refusal_is_raised(
    two_connections: tuple[sqlite3.Connection, sqlite3.Connection],
) -> None:
    _holder, other = two_connections
    attempts = 0

    def write() -> None:
        nonlocal attempts
        attempts += 1
        other.execute("BEGIN IMMEDIATE")

    with pytest.raises(sqlite3.OperationalError) as caught:
        retry_while_locked(write, time.monotonic())
    assert sqlite_failure(caught.value) is SqliteFailure.LOCKED
    assert attempts == 1


def test_any_other_failure_is_raised_at_once(tmp_path: Path) -> None:
    conn = sqlite3.connect(tmp_path / "plain.sqlite3")
    attempts = 0

    def read() -> None:
        nonlocal attempts
        attempts += 1
        conn.execute("SELECT * FROM missing")

    try:
        with pytest.raises(sqlite3.OperationalError, match="no such table"):
            retry_while_locked(read, time.monotonic() + 60)
    finally:
        conn.close()
    assert attempts == 1
