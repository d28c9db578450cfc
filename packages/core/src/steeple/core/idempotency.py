"""Idempotency keys: deterministic, purpose-separated, identical on every attempt."""

from __future__ import annotations

import functools
import hashlib
from datetime import UTC, datetime, timedelta
from typing import Any

from steeple.core._validate import aware_utc, byte_string, encodable
from steeple.core.errors import ConfigurationTypeError

__all__ = ["PUBLISH_PURPOSE", "idempotency_key", "trusted_idempotency_key"]

PUBLISH_PURPOSE = "steeple.recurring.publish.v1"
"""The purpose tag of keys used to publish recurring occurrences."""

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MS = timedelta(milliseconds=1)


_MAX_PART_BYTES = 64 * 1024
"""Longest identity part accepted (names are at most 200 characters)."""


def _text_part(value: object, what: str) -> bytes:
    if not isinstance(value, str):
        raise ConfigurationTypeError(f"{what} must be a str, not {type(value).__name__}")
    try:
        return value.encode("utf-8")
    except UnicodeEncodeError:
        encodable(value, what)  # raises the error that says which character
        raise


def _part(raw: bytes) -> bytes:
    # Length-prefixed so that ("ab", "c") and ("a", "bc") can never produce the same key.
    return len(raw).to_bytes(4, "big") + raw


def idempotency_key(
    *, purpose: str, namespace: str, definition_name: str, due_at: datetime, generation: bytes
) -> str:
    """Return the idempotency key of one occurrence for one purpose.

    The key depends only on the occurrence's identity (namespace, definition, due instant,
    random generation) and the purpose, so every attempt, worker and restart derives the
    same key, and keys made for different purposes never collide.

    Raises:
        ConfigurationTypeError: a name is not a str, ``due_at`` not a datetime, or
            ``generation`` not bytes (each also a ``TypeError``).
        ConfigurationError: a name holds a lone surrogate (no UTF-8 form), ``due_at`` is
            naive, or ``generation`` is over 64 KiB (each also a ``ValueError``).
    """
    digest = _prefix(_text_part(purpose, "purpose"), _text_part(namespace, "namespace")).copy()
    due_ms = (aware_utc(due_at, "due_at") - _EPOCH) // _MS
    for part in (
        _text_part(definition_name, "definition_name"),
        str(due_ms).encode(),
        byte_string(generation, "generation", max_len=_MAX_PART_BYTES),
    ):
        digest.update(_part(part))
    return f"stp1-{digest.hexdigest()[:48]}"


def trusted_idempotency_key(
    *, purpose: str, namespace: str, definition_name: str, due_at: datetime, generation: bytes
) -> str:
    """Return :func:`idempotency_key` of values a store read from its own rows, unchecked.

    For the engine only (a relay derives one key per publication): the names, the aware
    due instant and the generation are what it stored after checking them. A test
    requires both functions to return the same key for the same values.
    """
    digest = _named_prefix(purpose, namespace, definition_name).copy()
    due = str((due_at - _EPOCH) // _MS).encode()
    digest.update(_part(due) + _part(generation))
    return f"stp1-{digest.hexdigest()[:48]}"


@functools.lru_cache(maxsize=4096)
def _named_prefix(purpose: str, namespace: str, definition_name: str) -> Any:
    # A relay derives a key per publication, and a definition's keys share their first
    # three parts: hashed once per definition, copied for each key.
    digest = _prefix(purpose.encode(), namespace.encode()).copy()
    digest.update(_part(definition_name.encode()))
    return digest


@functools.lru_cache(maxsize=64)
def _prefix(purpose: bytes, namespace: bytes) -> Any:
    # Every key of a namespace and purpose starts with the same two parts: hashed once,
    # copied for each key (the same digest as hashing them every time).
    digest = hashlib.sha256()
    digest.update(_part(purpose))
    digest.update(_part(namespace))
    return digest
