"""Idempotency keys: deterministic, purpose-separated, identical on every attempt."""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime, timedelta

__all__ = ["PUBLISH_PURPOSE", "idempotency_key"]

PUBLISH_PURPOSE = "steeple.recurring.publish.v1"
"""The purpose tag of keys used to publish recurring occurrences."""

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def _part(value: str | bytes) -> bytes:
    raw = value.encode() if isinstance(value, str) else value
    # Length-prefixed so that ("ab", "c") and ("a", "bc") can never produce the same key.
    return len(raw).to_bytes(4, "big") + raw


def idempotency_key(
    *, purpose: str, namespace: str, definition_name: str, due_at: datetime, generation: bytes
) -> str:
    """Return the idempotency key of one occurrence for one purpose.

    The key depends only on the occurrence's identity (namespace, definition, due instant,
    random generation) and the purpose, so every attempt, worker and restart derives the
    same key, and keys made for different purposes never collide.
    """
    due_ms = (due_at.astimezone(UTC) - _EPOCH) // timedelta(milliseconds=1)
    digest = hashlib.sha256()
    for part in (purpose, namespace, definition_name, str(due_ms), generation):
        digest.update(_part(part))
    return f"stp1-{digest.hexdigest()[:48]}"
