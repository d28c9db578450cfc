"""The one rule for every name the library stores: what an operator reads, types and filters on.

Schedule (definition) names, work-queue queue names, task names, job names and worker ids
all follow it (a namespace follows a stricter one:
:func:`~steeple.core.config.validate_namespace`).
A name is shown on a dashboard and a terminal and typed back into a filter, so two names
that look the same must be the same name: a name is refused when it is empty or blank,
longer than its limit, starts or ends with whitespace, or holds a character a reader
cannot see or that changes how the text around it is shown -- control characters (NUL,
ESC, newline...), format characters (zero-width spaces and joiners, bidi overrides and
isolates, the byte-order mark), the Unicode line and paragraph separators, invisible
fillers (Hangul fillers, the combining grapheme joiner), lone surrogates, private-use and
unassigned code points. Names are compared exactly: nothing is trimmed or normalized.
"""

from __future__ import annotations

import unicodedata
from typing import Final

from steeple.core.errors import ConfigurationError, ConfigurationTypeError
from steeple.core.limits import MAX_NAME_LENGTH

__all__ = ["MAX_NAME_LENGTH", "check_name", "name_problem"]

_REFUSED_CATEGORIES: Final = frozenset({"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"})
"""Controls, format characters, lone surrogates, private use, unassigned, separators."""
_INVISIBLE: Final = frozenset(
    {
        "\u034f",  # combining grapheme joiner
        "\u115f",  # Hangul choseong filler
        "\u1160",  # Hangul jungseong filler
        "\u17b4",  # Khmer vowel inherent aq
        "\u17b5",  # Khmer vowel inherent aa
        "\u2800",  # braille pattern blank
        "\u3164",  # Hangul filler
        "\uffa0",  # halfwidth Hangul filler
    }
)
"""Letters and marks that render as nothing (not format characters, so listed by hand)."""
_KINDS: Final = {
    "Cc": "a control character",
    "Cf": "a format character (zero-width, bidi control or byte-order mark)",
    "Cs": "a lone surrogate (not encodable)",
    "Co": "a private-use character",
    "Cn": "an unassigned code point",
    "Zl": "a line separator",
    "Zp": "a paragraph separator",
}


def name_problem(value: str, what: str, *, max_len: int = MAX_NAME_LENGTH) -> str | None:
    """Say in one line why the str ``value`` is not a valid name (``None``: it is one)."""
    if not value or value.isspace():
        return f"{what} must not be empty or blank (a name is 1..{max_len} characters)"
    if len(value) > max_len:
        return f"{what} is {len(value)} characters; a name is 1..{max_len}"
    for position, ch in enumerate(value):
        category = unicodedata.category(ch)
        if ch in _INVISIBLE or category in _REFUSED_CATEGORIES:
            kind = _KINDS.get(category, "an invisible filler")
            return (
                f"{what} must not contain a control or invisible character: {kind}, "
                f"U+{ord(ch):04X} at position {position}"
            )
    if value != value.strip():
        return f"{what} must not start or end with whitespace (names are compared exactly)"
    return None


def check_name(
    value: object,
    what: str,
    *,
    max_len: int = MAX_NAME_LENGTH,
    error: type[ValueError] = ConfigurationError,
    type_error: type[ValueError] | None = None,
) -> str:
    """Return ``value`` if it is a valid name (see the module's rule), else raise.

    Args:
        value: the name.
        what: what the name is, for the message (``"queue"``, ``"task name"``...).
        max_len: the most characters.
        error: raised for an invalid str (a ``ValueError`` subclass of the caller's).
        type_error: raised for a value that is not a str (default: ``error``, or
            :class:`~steeple.core.errors.ConfigurationTypeError` for a plain
            ``ConfigurationError``).

    Raises:
        error: empty or blank, too long, leading or trailing whitespace, or a control,
            format (bidi, zero-width), separator, invisible, surrogate, private-use or
            unassigned character. The message is one line and names the position.
        type_error: not a str.
    """
    if not isinstance(value, str):
        kind = type_error or (ConfigurationTypeError if error is ConfigurationError else error)
        raise kind(f"{what} must be a str, not {type(value).__name__}")
    problem = name_problem(value, what, max_len=max_len)
    if problem is not None:
        raise error(problem)
    return value
