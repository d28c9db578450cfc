"""The one wait for a SQLite file's lock, shared by the SQLite store and the SQLite journal.

SQLite refuses some conflicts at once with "database is locked", without waiting for its
busy timeout (a switch to WAL while another connection writes the file; a recovery in
progress), and a busy timeout short enough to keep one statement text per connection waits
only a little per attempt. Both callers retry here, sleeping on their own thread (never an
event loop's), until a monotonic deadline.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable
from typing import Final, TypeVar

from steeple.core.sqlite_codes import SqliteFailure, sqlite_failure

__all__ = ["retry_while_locked"]

T = TypeVar("T")

_FIRST_PAUSE: Final = 0.002
_LONGEST_PAUSE: Final = 0.05


def retry_while_locked(fn: Callable[[], T], deadline: float) -> T:
    """Run ``fn`` until SQLite no longer refuses it as locked, or until ``deadline``.

    Between attempts it sleeps 2 ms, doubling to at most 50 ms. ``deadline`` is a
    :func:`time.monotonic` instant; an attempt is not started when its pause would reach it.

    Raises:
        sqlite3.OperationalError: ``fn``'s own, when it is not a lock refusal
            (:func:`steeple.core.sqlite_codes.sqlite_failure` says which is), or when
            the deadline came first.
    """
    pause = _FIRST_PAUSE
    while True:
        try:
            return fn()
        except sqlite3.OperationalError as exc:
            locked = sqlite_failure(exc) is SqliteFailure.LOCKED
            if not locked or time.monotonic() + pause >= deadline:
                raise
        time.sleep(pause)
        pause = min(pause * 2, _LONGEST_PAUSE)
