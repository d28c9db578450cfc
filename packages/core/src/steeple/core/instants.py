"""Instants written as text: the one parser every input of steeple uses.

The ``steeple`` command, a definitions file and the simulator's scenarios all take
instants as ISO 8601 text with an explicit offset (``2026-01-31T22:00Z``); this module
reads them (pure: no clock).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Final

from steeple.core.errors import ConfigurationError, ConfigurationTypeError

__all__ = ["parse_instant"]

_MAX_TEXT: Final = 100


def _shown(text: str) -> str:
    return repr(text if len(text) <= 40 else text[:37] + "...")


def parse_instant(text: str) -> datetime:
    """Parse an ISO 8601 instant with an explicit offset (``2026-01-31T22:00Z``), in UTC.

    Raises:
        ConfigurationError: not an ISO 8601 date-time (or longer than 100 characters, or
            not ASCII), or one without ``Z`` or an offset; the message shows at most the
            start of the text.
        ConfigurationTypeError: ``text`` is not a str.
    """
    if not isinstance(text, str):
        raise ConfigurationTypeError(f"an instant must be a str, not {type(text).__name__}")
    value = text.strip()
    try:
        if len(value) > _MAX_TEXT or not value.isascii():
            raise ValueError
        parsed = datetime.fromisoformat(value)
    except ValueError:
        raise ConfigurationError(
            f"{_shown(text)} is not an ISO 8601 instant: write it like 2026-01-31T22:00Z"
        ) from None
    if parsed.tzinfo is None:
        raise ConfigurationError(
            f"the instant {_shown(text)} has no time zone: add Z (UTC) or an offset such as +01:00"
        )
    return parsed.astimezone(UTC)
