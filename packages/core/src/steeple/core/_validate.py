"""Small validators shared by core's value types (private).

Every check raises a :class:`~steeple.core.errors.SteepleError` subclass (which is also the
``ValueError`` / ``TypeError`` a caller already catches), never a bare builtin, and every
message it builds is safe to log: values are shown through :func:`shown` (bounded, lone
surrogates escaped, no ``repr`` that can itself fail).
"""

from __future__ import annotations

import enum
import math
from datetime import UTC, datetime, timedelta
from typing import Any

from steeple.core.errors import ConfigurationError, ConfigurationTypeError, shown
from steeple.core.errors import _plain as plain
from steeple.core.names import check_name

__all__ = [
    "INT64_MAX",
    "TypedEnumType",
    "aware_utc",
    "bounded_int",
    "byte_string",
    "duration",
    "encodable",
    "plain",
    "shown",
    "text",
    "unit_float",
]

INT64_MAX = 2**63 - 1
"""The largest value a stored integer (PostgreSQL ``bigint``, SQLite ``INTEGER``) holds."""


def _type_error(error: type[ValueError], message: str) -> ValueError:
    """Build the caller's error, as a TypeError too when it is a plain ConfigurationError."""
    if error is ConfigurationError:
        return ConfigurationTypeError(message)
    return error(message)


def aware_utc(value: object, what: str) -> datetime:
    """Return ``value`` as an aware UTC datetime.

    Raises:
        ConfigurationTypeError: ``value`` is not a datetime.
        ConfigurationError: ``value`` is naive, or its offset is broken, or converting it
            to UTC leaves the datetime range (``datetime.min`` with a positive offset).
    """
    if type(value) is datetime and value.tzinfo is UTC:
        # Already what is asked for (astimezone would return it as is): every instant the
        # stores pass around is one, and this runs several times per call.
        return value
    if not isinstance(value, datetime):
        raise ConfigurationTypeError(f"{what} must be a datetime, not {type(value).__name__}")
    try:
        offset = value.utcoffset()
    except Exception as exc:  # a third-party tzinfo may fail in any way
        raise ConfigurationError(
            f"{what} has a tzinfo whose utcoffset() fails ({type(exc).__name__})"
        ) from None
    if value.tzinfo is None or offset is None:
        raise ConfigurationError(
            f"{what} must be timezone-aware (steeple works in UTC); "
            f"got naive {value.isoformat()}: use datetime(..., tzinfo=UTC)"
        )
    try:
        return value.astimezone(UTC)
    except (OverflowError, ValueError, TypeError):
        raise ConfigurationError(
            f"{what} ({value.isoformat()}) is outside the range of datetime once converted to UTC"
        ) from None


def encodable(value: str, what: str, error: type[ValueError] = ConfigurationError) -> str:
    """Require a str that UTF-8 can encode (no lone surrogates).

    Raises:
        error: ``value`` holds a lone surrogate (U+D800..U+DFFF): no broker, database or
            file can store it.
    """
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = value[exc.start]
        raise error(
            f"{what} contains the lone surrogate {shown(bad)} at position {exc.start}, "
            "which has no UTF-8 encoding; fix the text's decoding"
        ) from None
    return value


def text(value: object, what: str, *, max_len: int, error: type[ValueError]) -> str:
    """Validate a name-like string by the library's one name rule (see :mod:`steeple.core.names`).

    Raises:
        error: not a str, empty or blank, longer than ``max_len``, holding a control,
            format, separator, invisible or unencodable character, or starting/ending with
            whitespace.
    """
    return check_name(value, what, max_len=max_len, error=error)


def duration(value: object, what: str, error: type[ValueError]) -> timedelta:
    """Require a timedelta.

    Raises:
        error: ``value`` is not a ``datetime.timedelta``.
    """
    if not isinstance(value, timedelta):
        raise _type_error(error, f"{what} must be a datetime.timedelta, not {type(value).__name__}")
    return value


def bounded_int(value: object, what: str, lo: int, hi: int, error: type[ValueError]) -> int:
    """Require an int (not bool) within [lo, hi].

    Raises:
        error: not an int (bools included), or outside ``[lo, hi]``.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise _type_error(error, f"{what} must be an int, not {type(value).__name__}")
    if not lo <= value <= hi:
        raise error(f"{what} must be between {lo} and {hi}; got {shown(value)}")
    return value


def unit_float(value: object, what: str) -> float:
    """Require a finite real number (int or float, not bool); clamp it into [0, 1].

    Raises:
        ConfigurationTypeError: not an int or float.
        ConfigurationError: NaN or infinite.
    """
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigurationTypeError(
            f"{what} must be a float in [0, 1], not {type(value).__name__}"
        )
    if isinstance(value, int):
        # float() of a huge int overflows; only its side of the interval matters.
        return float(min(max(value, 0), 1))
    if not math.isfinite(value):
        raise ConfigurationError(f"{what} must be a finite float in [0, 1], not {value}")
    return min(max(value, 0.0), 1.0)


def byte_string(value: object, what: str, *, max_len: int) -> bytes:
    """Require bytes-like input of at most ``max_len`` bytes; return it as ``bytes``.

    Raises:
        ConfigurationTypeError: not bytes, bytearray or memoryview (a str included).
        ConfigurationError: longer than ``max_len``.
    """
    if type(value) is bytes and len(value) <= max_len:
        return value  # what bytes(value) would return, as is (checked on every lease)
    if not isinstance(value, bytes | bytearray | memoryview):
        raise ConfigurationTypeError(f"{what} must be bytes, not {type(value).__name__}")
    raw = bytes(value)
    if len(raw) > max_len:
        raise ConfigurationError(f"{what} is {len(raw)} bytes; the limit is {max_len}")
    return raw


class TypedEnumType(enum.EnumType):
    """Metaclass of core's enums (str values): an unknown value raises ConfigurationError.

    ``OccurrenceState("bogus")`` raises :class:`~steeple.core.errors.ConfigurationError`
    (a ``ValueError``, as before) naming the valid values, instead of the standard
    ``Enum`` lookup, which hashes and ``repr``s whatever it is given (a hostile object's
    ``__hash__`` or ``__repr__`` may raise anything; an int over 4300 digits has no repr).
    """

    def __call__(cls, value: Any, *args: Any, **kwargs: Any) -> Any:
        """Look a member up by its value (or build an enum, with more arguments)."""
        if args or kwargs:
            return super().__call__(value, *args, **kwargs)
        members: type = cls  # an enum class: its instances are its members
        if isinstance(value, members):
            return value
        if isinstance(value, str):
            # str.__str__ gives a plain str: a subclass's own __hash__/__eq__ never runs.
            found = cls._value2member_map_.get(str.__str__(value))
            if found is not None:
                return found
        listed: list[enum.Enum] = list(cls.__members__.values())
        valid = ", ".join(repr(member.value) for member in listed)
        raise ConfigurationError(
            f"{shown(value)} is not a valid {cls.__name__}; use one of {valid}"
        )
