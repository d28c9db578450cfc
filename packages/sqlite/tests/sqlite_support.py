"""Helpers the SQLite store's tests share (imported by bare name; see conftest.py)."""

from __future__ import annotations

import sqlite3
import subprocess
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from steeple.core.config import RecurringConfig, RecurringDefinition
from steeple.core.messages import ScheduledMessage
from steeple.core.policies import MissedRunPolicy
from steeple.keyring import Keyring, StorageKey

Mount = Callable[[str], Path]
"""``mount(size)`` mounts a tmpfs of ``size`` (``"2m"``) and returns its directory."""

START = datetime(2031, 5, 17, 3, 14, 15, 926000, tzinfo=UTC)
KEYRING = Keyring(StorageKey("k1", b"\x2a" * 32))
CONFIG = RecurringConfig("files", max_definitions=10, max_occurrences=10_000)
TOPIC, MESSAGE_TYPE = "topic.sealed-away", "type.sealed-away"
MINUTE_US = 60_000_000


def remount(path: Path, mode: str) -> None:
    """Remount the tmpfs at ``path`` ``ro`` or ``rw`` (no file may be open for writing)."""
    subprocess.run(["mount", "-o", f"remount,{mode}", str(path)], check=True, capture_output=True)


def definition(
    name: str, minutes_back: int = 10, payload: bytes = b"payload"
) -> RecurringDefinition:
    """A minutely catch-up definition with ``minutes_back`` occurrences due at START."""
    return RecurringDefinition(
        name,
        "* * * * *",
        START - timedelta(minutes=minutes_back),
        MissedRunPolicy.CATCH_UP,
        ScheduledMessage(TOPIC, MESSAGE_TYPE, payload, {"x-header": "header-value"}),
    )


def query(path: Path, sql: str, *args: Any) -> list[Any]:
    """Read the file with a plain sqlite3 connection (the test's own)."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        return conn.execute(sql, args).fetchall()
    finally:
        conn.close()


def integrity(path: Path) -> str:
    """``PRAGMA integrity_check``'s verdict on the file."""
    return str(query(path, "PRAGMA integrity_check")[0][0])


def consistent(path: Path, namespace: str = CONFIG.namespace) -> int:
    """Check the namespace's counters match its rows and each minutely definition holds
    exactly its due times up to its cursor (no gap, nothing beyond, nothing twice).

    Returns how many occurrences the namespace holds.
    """
    [(definitions, occurrences)] = query(
        path,
        "SELECT definition_count, occurrence_count FROM recurring_namespaces WHERE namespace = ?",
        namespace,
    )
    assert (
        definitions
        == query(path, "SELECT count(*) FROM recurring_definitions WHERE namespace = ?", namespace)[
            0
        ][0]
    )
    assert (
        occurrences
        == query(path, "SELECT count(*) FROM recurring_occurrences WHERE namespace = ?", namespace)[
            0
        ][0]
    )
    for name, first_after, cursor in query(
        path,
        "SELECT name, first_after, cursor_at FROM recurring_definitions WHERE namespace = ?",
        namespace,
    ):
        dues = [
            d
            for (d,) in query(
                path,
                "SELECT due_at FROM recurring_occurrences WHERE namespace = ?"
                " AND definition_name = ? ORDER BY due_at",
                namespace,
                name,
            )
        ]
        first = (first_after // MINUTE_US + 1) * MINUTE_US
        expected = list(range(first, cursor + 1, MINUTE_US)) if cursor >= first else []
        assert dues == expected, name
    return int(occurrences)
