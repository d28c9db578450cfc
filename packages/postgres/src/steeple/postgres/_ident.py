"""The one way steeple writes a PostgreSQL identifier into SQL.

Identifiers cannot be bind parameters, so schema, table and role names are quoted here and
nowhere else: double quotes around the name, embedded double quotes doubled. A statement is
composed from quoted names, never by substituting text into text that was already quoted
(a substituted name could land inside another one's quotes).
"""

from __future__ import annotations

__all__ = ["IDENTIFIER_MAX_BYTES", "InvalidIdentifierError", "quote_ident", "shown_name"]

IDENTIFIER_MAX_BYTES = 63
"""PostgreSQL's NAMEDATALEN - 1: a longer name is silently truncated into another name."""

_SHOWN_CHARS = 40


class InvalidIdentifierError(ValueError):
    """Internal: a name PostgreSQL cannot hold exactly; callers raise their own typed error."""


def shown_name(name: object) -> str:
    """Render a (possibly hostile) name for a one-line message: bounded and escaped."""
    if not isinstance(name, str):
        return f"<{type(name).__name__}>"
    shown = name if len(name) <= _SHOWN_CHARS else name[: _SHOWN_CHARS - 3] + "..."
    return repr(shown)  # repr escapes quotes, control characters and lone surrogates


def quote_ident(name: object, *, what: str = "identifier") -> str:
    """Quote ``name`` as one PostgreSQL identifier that means exactly ``name``.

    Any character is allowed except NUL; quotes, semicolons, braces, spaces and Unicode are
    kept literally. ``what`` names the value in the error ("schema", "role").

    Raises:
        InvalidIdentifierError: (a ValueError) not a str, empty, holding NUL or a lone
            surrogate, or longer than 63 bytes in UTF-8 (PostgreSQL would truncate it).
    """
    if not isinstance(name, str):
        raise InvalidIdentifierError(f"{what} must be a str, not {type(name).__name__}")
    if not name:
        raise InvalidIdentifierError(f"{what} must not be empty")
    if "\x00" in name:
        raise InvalidIdentifierError(f"{what} {shown_name(name)} contains NUL; remove it")
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError:
        raise InvalidIdentifierError(
            f"{what} {shown_name(name)} is not valid text (a lone surrogate or undecodable "
            "byte); write it in UTF-8"
        ) from None
    if size > IDENTIFIER_MAX_BYTES:
        raise InvalidIdentifierError(
            f"{what} {shown_name(name)} is {size} bytes in UTF-8; PostgreSQL names hold at "
            f"most {IDENTIFIER_MAX_BYTES}"
        )
    return '"' + name.replace('"', '""') + '"'
