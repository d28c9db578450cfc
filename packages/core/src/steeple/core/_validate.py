"""Small validators shared by core's value types (private)."""

from __future__ import annotations

import unicodedata
from datetime import UTC, datetime, timedelta


def aware_utc(value: object, what: str) -> datetime:
    """Return ``value`` as an aware UTC datetime, or raise ValueError naming ``what``."""
    if not isinstance(value, datetime):
        raise TypeError(f"{what} must be a datetime, not {type(value).__name__}")
    if value.tzinfo is None or value.utcoffset() is None:
        raise ValueError(
            f"{what} must be timezone-aware (steeple works in UTC); "
            f"got naive {value.isoformat()}: use datetime(..., tzinfo=UTC)"
        )
    return value.astimezone(UTC)


def text(value: object, what: str, *, max_len: int, error: type[ValueError]) -> str:
    """Validate a non-empty, bounded, printable name-like string."""
    if not isinstance(value, str):
        raise error(f"{what} must be a str, not {type(value).__name__}")
    if not value or not value.strip():
        raise error(f"{what} must not be empty")
    if len(value) > max_len:
        raise error(f"{what} is {len(value)} characters; the limit is {max_len}")
    for ch in value:
        if unicodedata.category(ch) in {"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"}:
            raise error(f"{what} contains a control or invisible character {ch!r}; remove it")
    if value != value.strip():
        raise error(f"{what} must not start or end with whitespace")
    return value


def duration(value: object, what: str, error: type[ValueError]) -> timedelta:
    """Require a timedelta."""
    if not isinstance(value, timedelta):
        raise error(f"{what} must be a datetime.timedelta, not {type(value).__name__}")
    return value


def bounded_int(value: object, what: str, lo: int, hi: int, error: type[ValueError]) -> int:
    """Require an int (not bool) within [lo, hi]."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise error(f"{what} must be an int, not {type(value).__name__}")
    if not lo <= value <= hi:
        raise error(f"{what} must be between {lo} and {hi}; got {value}")
    return value
