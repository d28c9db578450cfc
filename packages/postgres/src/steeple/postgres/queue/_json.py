"""The one check and encoder for every JSON value the queue stores in a ``jsonb`` column.

``jsonb`` does not keep JSON text: it parses numbers into ``numeric`` and writes them back
positionally (``1e20`` comes back as ``100000000000000000000``, an int for Python;
``1e300`` as 301 digits), has no negative zero (``-0.0`` comes back as ``0.0``), and
prints ``", "`` and ``": "`` between items. So a value's stored text can be far longer than
Python's JSON, and its numbers can change type. :func:`storable_json` writes every float
the way ``numeric`` keeps it (positionally, with a ``.0`` when integral, so it stays a
float), refuses what cannot come back equal (``-0.0``, non-str object keys, ints beyond
``numeric``), and measures the size of the text the database will hold.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from decimal import Decimal
from typing import Any, Final, TypeVar

__all__ = ["storable_json"]

# An escaped NUL (an odd run of backslashes before u0000): PostgreSQL's jsonb refuses it.
_JSON_NUL: Final = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")
# The separators jsonb prints, so the text sent is the length of the text stored.
_ENCODER: Final = json.JSONEncoder(
    separators=(", ", ": "), allow_nan=False, ensure_ascii=False, check_circular=True
)
# numeric keeps at most 131072 digits before the decimal point: 10**131072 overflows it.
_NUMERIC_INT_LIMIT: Final = 10**131072
# Every int below 2**435411 is below 10**131072; only longer ones are compared exactly.
_NUMERIC_SAFE_BITS: Final = 435411
# Python writes a float in exponent form outside [1e-4, 1e16) (``repr``); ``numeric``
# rewrites those positionally. Inside this narrower band the C encoder's text is already
# what the database keeps; outside it the exact form is computed per float.
_PLAIN_LOW: Final = 1e-4
_PLAIN_HIGH: Final = 1e15

_CONTAINERS: Final = (dict, list, tuple)

_E = TypeVar("_E", bound=Exception)


class _Refused(Exception):
    """A value that would not come back equal: its reason, for the caller's typed error."""


def _reason(exc: BaseException) -> str:
    text = str(exc)
    return text if len(text) <= 200 else text[:197] + "..."


def _check_keys(container: dict[Any, Any]) -> None:
    """Refuse a non-str object key (JSON turns it into a str, and two keys can collide)."""
    for key in container:
        if type(key) is not str and not isinstance(key, str):
            raise _Refused(
                f"has an object key of type {type(key).__name__}; JSON object keys are "
                "str (it would come back as a str, or collide with one): use str keys"
            )


def _float_needs_exact(item: float) -> bool:
    """Whether ``item`` is outside the band the C encoder writes as stored; refuse ``-0.0``."""
    size = abs(item)
    if _PLAIN_LOW <= size < _PLAIN_HIGH:
        return False
    if size == 0.0:
        if math.copysign(1.0, item) < 0.0:
            raise _Refused("holds -0.0, which the database stores as 0.0; use 0.0 (or a string)")
        return False
    return True


def _needs_exact_numbers(value: object) -> bool:
    """Check what the C encoder cannot see; return whether a float needs its exact form.

    Raises:
        _Refused: a non-str object key (JSON turns it into a str, and two keys can
            collide), a ``-0.0``, or an int too long for ``numeric``.
    """
    exact = False
    containers: list[Any] = [[value]]
    while containers:
        container = containers.pop()
        if isinstance(container, dict):
            _check_keys(container)
            items: Iterable[Any] = container.values()
        else:
            items = container
        for item in items:
            kind = type(item)
            if kind is str or kind is bool or item is None:
                continue
            if isinstance(item, float):
                if _float_needs_exact(item):
                    exact = True
            elif isinstance(item, int):
                if item.bit_length() > _NUMERIC_SAFE_BITS and abs(item) >= _NUMERIC_INT_LIMIT:
                    raise _Refused(
                        "holds an int of more than 131072 digits, beyond what the database "
                        "stores; store it as a string"
                    )
            elif isinstance(item, _CONTAINERS):
                containers.append(item)
    return exact


def _float_text(value: float) -> str:
    """``value`` as ``numeric`` keeps it: positional, with ``.0`` if it has no fraction.

    Python's shortest round-trip digits, written without an exponent, parse back to the
    same float; the ``.0`` keeps the scale ``numeric`` prints, so it reads back a float.
    """
    text = float.__repr__(value)
    if "e" not in text:
        return text
    plain = format(Decimal(text), "f")
    return plain if "." in plain else plain + ".0"


def _exact(value: Any, parts: list[str]) -> None:
    """Append ``value``'s JSON text to ``parts`` (floats in their stored form).

    Called only after the C encoder accepted ``value``, so every type here is valid.
    """
    if isinstance(value, str):
        parts.append(json.encoder.encode_basestring(value))
    elif value is None:
        parts.append("null")
    elif value is True:
        parts.append("true")
    elif value is False:
        parts.append("false")
    elif isinstance(value, int):
        parts.append(int.__repr__(value))
    elif isinstance(value, float):
        parts.append(_float_text(value))
    elif isinstance(value, list | tuple):
        _exact_array(value, parts)
    elif isinstance(value, dict):
        _exact_object(value, parts)
    else:  # pragma: no cover - the C encoder refused it first
        raise TypeError(f"{type(value).__name__} is not JSON")


def _exact_array(value: list[Any] | tuple[Any, ...], parts: list[str]) -> None:
    parts.append("[")
    first = True
    for item in value:
        if not first:
            parts.append(", ")
        first = False
        _exact(item, parts)
    parts.append("]")


def _exact_object(value: dict[str, Any], parts: list[str]) -> None:
    parts.append("{")
    first = True
    for key, item in value.items():
        if not first:
            parts.append(", ")
        first = False
        parts.append(json.encoder.encode_basestring(key))
        parts.append(": ")
        _exact(item, parts)
    parts.append("}")


def storable_json(value: object, error: type[_E], subject: str, limit: int, kinds: str) -> str:
    """Return ``value`` as the JSON text the database stores, within ``limit`` bytes.

    The one check for what the queue stores as JSON (task args, job args, handler
    results, progress, trace contexts): what passes comes back from the database equal
    to ``value`` (same numbers, same types; tuples come back as lists), or it is refused.
    The size is that of the text ``jsonb`` holds (its spacing, numbers written out).
    Every refusal is ``error`` naming ``subject``, with what to do (``kinds``).

    Raises:
        error: not JSON-encodable (NaN, infinity, a set, an object, a cycle, nesting too
            deep), a non-str object key, ``-0.0``, an int beyond the database's numbers,
            a NUL character or a lone surrogate (PostgreSQL cannot store either), or more
            than ``limit`` bytes as stored.
    """
    try:
        text = _ENCODER.encode(value)
        if _needs_exact_numbers(value):
            parts: list[str] = []
            _exact(value, parts)
            text = "".join(parts)
    except RecursionError:
        raise error(f"{subject} nests too deeply for JSON (or holds a cycle)") from None
    except _Refused as exc:
        raise error(f"{subject} cannot be stored exactly as JSON: it {exc}") from None
    except (TypeError, ValueError) as exc:
        raise error(f"{subject} cannot be stored as JSON ({_reason(exc)}); {kinds}") from None
    if "\\u0000" in text and _JSON_NUL.search(text):
        raise error(f"{subject} contains a NUL character, which cannot be stored")
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError:
        raise error(
            f"{subject} contains a lone surrogate (not valid Unicode); remove it or encode "
            "the data, e.g. as base64"
        ) from None
    if size > limit:
        raise error(
            f"{subject} is {size} bytes of JSON as stored, over the {limit}-byte limit; "
            "store large data elsewhere and pass a reference"
        )
    return text
