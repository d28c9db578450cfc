"""Boundary checks of the queue's public entry points (private).

Every value a caller hands the queue is checked here before any I/O, so a bad one raises
:class:`QueueConfigurationError` (a ``ValueError``) or :class:`QueueTypeError` (also a
``TypeError``) saying what to fix, and never a driver's or the interpreter's error from deep
inside a statement (``UnicodeEncodeError``, ``DataError``, ``OverflowError``...).
"""

from __future__ import annotations

import math
import unicodedata
from datetime import timedelta
from typing import Final

from steeple.core.limits import MAX_NAME_LENGTH
from steeple.core.names import check_name as core_check_name
from steeple.core.tasks import check_task_id as core_check_task_id
from steeple.postgres.queue.errors import QueueConfigurationError, QueueTypeError

__all__ = [
    "DEFAULT_QUEUE",
    "INT32",
    "check_bool",
    "check_int",
    "check_name",
    "check_queue",
    "check_seconds",
    "check_task_id",
    "check_text",
    "check_timedelta",
    "storable_text",
]

INT32: Final = 2**31 - 1
# Cc: control characters (NUL among them: PostgreSQL text cannot hold it); Cs: lone
# surrogates (not encodable as UTF-8, so no driver can send them).
_REFUSED_CATEGORIES: Final = frozenset({"Cc", "Cs"})


def check_name(value: object, what: str, *, max_len: int = MAX_NAME_LENGTH) -> str:
    """Return ``value`` if it is a valid name by the library's one rule (:mod:`steeple.core.names`).

    For every name the queue stores and an operator filters on: queue, task, job and worker
    names. Compared exactly: nothing is trimmed.

    Raises:
        QueueTypeError: not a str.
        QueueConfigurationError: empty or blank, too long, leading or trailing whitespace,
            or a control, format (zero-width, bidi), separator, invisible or unencodable
            character.
    """
    return core_check_name(
        value, what, max_len=max_len, error=QueueConfigurationError, type_error=QueueTypeError
    )


def check_text(value: object, what: str, *, max_len: int = MAX_NAME_LENGTH) -> str:
    """Return ``value`` if it is a str of 1..max_len characters, none control or surrogate.

    For short free text the queue stores but never treats as a name: a dedup key (derived
    from the caller's data, compared only by the database) and a progress message.

    Raises:
        QueueTypeError: not a str.
        QueueConfigurationError: empty, too long, or a control character / lone surrogate.
    """
    if not isinstance(value, str):
        raise QueueTypeError(f"{what} must be a str, not {type(value).__name__}")
    if not 1 <= len(value) <= max_len:
        raise QueueConfigurationError(
            f"{what} must be a str of 1..{max_len} characters, got {len(value)}"
        )
    for ch in value:
        if unicodedata.category(ch) in _REFUSED_CATEGORIES:
            kind = "lone surrogate" if "\ud800" <= ch <= "\udfff" else "control character"
            raise QueueConfigurationError(
                f"{what} must not contain a {kind} (U+{ord(ch):04X}); remove it"
            )
    return value


DEFAULT_QUEUE: Final = "default"
"""The queue a task or recurring job belongs to unless told otherwise."""


def check_queue(value: object) -> str:
    """Return ``value`` if it is a valid queue name (as :func:`check_name`, 1-200 chars).

    Raises:
        QueueTypeError: not a str.
        QueueConfigurationError: not a valid name (see :func:`check_name`).
    """
    return check_name(value, "queue")


def check_bool(value: object, what: str) -> bool:
    """Return ``value`` if it is a bool.

    Raises:
        QueueTypeError: anything else (``"no"`` is truthy: refuse it rather than guess).
    """
    if not isinstance(value, bool):
        raise QueueTypeError(f"{what} must be True or False, not {type(value).__name__}")
    return value


def check_int(value: object, what: str, lo: int, hi: int) -> int:
    """Return ``value`` if it is an int (not a bool) within [lo, hi].

    Raises:
        QueueTypeError: not an int.
        QueueConfigurationError: out of range.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise QueueTypeError(f"{what} must be an int, not {type(value).__name__}")
    if not lo <= value <= hi:
        raise QueueConfigurationError(f"{what} must be an int of {lo}..{hi}, got {_show(value)}")
    return value


def _show(value: int) -> str:
    # str() of an int beyond 4300 digits raises ValueError: never let a message do that.
    return str(value) if abs(value) < 10**30 else f"an int of {value.bit_length()} bits"


def check_task_id(value: object, what: str = "task_id") -> int:
    """Return ``value`` if it is a task id, by core's one rule (1 .. 2**63 - 1).

    Raises:
        QueueTypeError: not an int (or a bool).
        QueueConfigurationError: 0, negative, or beyond a bigint.
    """
    return core_check_task_id(
        value, what=what, error=QueueConfigurationError, type_error=QueueTypeError
    )


def check_timedelta(value: object, what: str, lo: timedelta, hi: timedelta) -> timedelta:
    """Return ``value`` if it is a timedelta within [lo, hi].

    Raises:
        QueueTypeError: not a timedelta.
        QueueConfigurationError: out of range.
    """
    if not isinstance(value, timedelta):
        raise QueueTypeError(f"{what} must be a datetime.timedelta, not {type(value).__name__}")
    if not lo <= value <= hi:
        raise QueueConfigurationError(f"{what} must be a timedelta of {lo} .. {hi}, got {value}")
    return value


def check_seconds(value: object, what: str, minimum: float, maximum: float) -> float:
    """Return ``value`` (seconds as an int/float, or a timedelta) as float seconds.

    Raises:
        QueueTypeError: not a number or timedelta.
        QueueConfigurationError: NaN, infinite, or outside [minimum, maximum].
    """
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, bool) or not isinstance(value, int | float):
        raise QueueTypeError(
            f"{what} must be seconds (int or float) or a timedelta, not {type(value).__name__}"
        )
    else:
        try:
            seconds = float(value)
        except OverflowError:  # an int too large for a float
            seconds = math.inf
    if not math.isfinite(seconds) or not minimum <= seconds <= maximum:
        raise QueueConfigurationError(
            f"{what} must be a finite number of seconds within {minimum:g}..{maximum:g}, "
            f"got {seconds!r}"
        )
    return seconds


def storable_text(text: str) -> str:
    """Return ``text`` as PostgreSQL text can hold it: lone surrogates and NUL escaped.

    For text the queue records but did not choose (a handler's error message).
    """
    if "\x00" in text:
        text = text.replace("\x00", "\\x00")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text
