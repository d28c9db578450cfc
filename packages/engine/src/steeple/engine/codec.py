"""The plaintext the engine seals, listing cursors, and the records it hands out.

Sealed plaintext is canonical JSON (sorted keys, no whitespace, ASCII), so an identical
message always encodes to identical bytes. Definitions seal their whole document (name,
calendar, first_after, policy and message); occurrences seal their frozen message.
"""

from __future__ import annotations

import base64
import functools
import json
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any, Final

from steeple.core import records
from steeple.core._frozen import new, writable
from steeple.core.config import RecurringConfig, RecurringDefinition
from steeple.core.errors import (
    ConfigurationError,
    RecurringStorageError,
)
from steeple.core.messages import ScheduledMessage
from steeple.core.policies import MissedRunPolicy
from steeple.core.records import OccurrenceInfo, ScheduleInfo
from steeple.engine.ports import DefinitionRow, OccurrenceRow

__all__ = [
    "decode_definition",
    "decode_message",
    "definition_message_plaintext",
    "encode_binding",
    "encode_definition",
    "encode_message",
    "epoch_ms",
    "occurrence_cursor",
    "occurrence_info",
    "occurrence_infos",
    "parse_occurrence_cursor",
    "schedule_info",
]

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MS = timedelta(milliseconds=1)


def _canonical(value: Mapping[str, Any]) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def epoch_ms(instant: datetime) -> int:
    """Milliseconds since the epoch of an aware instant."""
    return (instant - _EPOCH) // _MS


def occurrence_cursor(due_at: datetime, occurrence_id: str) -> str:
    """Return the exclusive listing cursor after the occurrence ``(due_at, id)``.

    The format is core's (:func:`steeple.core.records.occurrence_cursor`), shared with the
    admin app's validation.

    Raises:
        RecurringConfigurationError: ``due_at`` is naive or outside 1970-2100, or
            ``occurrence_id`` is malformed.
    """
    return records.occurrence_cursor(due_at, occurrence_id)


def parse_occurrence_cursor(cursor: object) -> tuple[datetime, str] | None:
    """Return the ``(due_at, id)`` position of a cursor (``None`` for no cursor).

    Raises:
        RecurringConfigurationError: not a cursor a store returned
            (:func:`steeple.core.records.parse_occurrence_cursor`).
    """
    if cursor is None:
        return None
    return records.parse_occurrence_cursor(cursor)


def _message_document(message: ScheduledMessage) -> dict[str, Any]:
    return {
        "topic": message.topic,
        "message_type": message.message_type,
        "payload": base64.b64encode(message.payload).decode("ascii"),
        "headers": dict(message.headers),
    }


def encode_message(message: ScheduledMessage) -> bytes:
    """Canonical plaintext of an occurrence's frozen message."""
    return _canonical(_message_document(message))


def _message(doc: object) -> ScheduledMessage:
    if not isinstance(doc, dict):
        raise TypeError("a message document is an object")
    return ScheduledMessage(
        doc["topic"],
        doc["message_type"],
        base64.b64decode(doc["payload"], validate=True),
        doc["headers"],
    )


_CACHED_BYTES = 16 * 1024
"""Longest plaintext whose decoding is remembered (the caches stay under a few MiB)."""


def decode_message(raw: bytes) -> ScheduledMessage:
    """Rebuild a message from :func:`encode_message` output.

    Raises:
        RecurringStorageError: the plaintext is not a message document.
    """
    if type(raw) is bytes and len(raw) <= _CACHED_BYTES:
        # Every occurrence of a definition carries the same plaintext, and the message is
        # immutable: decoded once (a failure is not remembered, it raises every time).
        return _decode_message_cached(raw)
    return _decode_message(raw)


@functools.lru_cache(maxsize=256)
def _decode_message_cached(raw: bytes) -> ScheduledMessage:
    return _decode_message(raw)


def _decode_message(raw: bytes) -> ScheduledMessage:
    try:
        return _message(json.loads(raw))
    except (ValueError, KeyError, TypeError, ConfigurationError) as exc:
        raise RecurringStorageError(
            f"stored message content is malformed ({type(exc).__name__})"
        ) from None


def encode_definition(definition: RecurringDefinition) -> bytes:
    """Canonical plaintext of a definition: everything that makes it what it is."""
    return _canonical(
        {
            "name": definition.name,
            "cron": definition.cron.expression,
            "first_after_ms": epoch_ms(definition.first_after),
            "policy": definition.policy.value,
            "message": _message_document(definition.message),
        }
    )


def decode_definition(raw: bytes) -> RecurringDefinition:
    """Rebuild a definition from :func:`encode_definition` output.

    Raises:
        RecurringStorageError: the plaintext is not a definition document.
    """
    try:
        doc = json.loads(raw)
        if not isinstance(doc, dict) or not isinstance(doc["first_after_ms"], int):
            raise TypeError("a definition document is an object with first_after_ms")
        return RecurringDefinition(
            doc["name"],
            doc["cron"],
            _EPOCH + doc["first_after_ms"] * _MS,
            MissedRunPolicy(doc["policy"]),
            _message(doc["message"]),
        )
    except (ValueError, KeyError, TypeError, OverflowError, ConfigurationError) as exc:
        raise RecurringStorageError(
            f"stored definition is malformed ({type(exc).__name__})"
        ) from None


def definition_message_plaintext(raw: bytes) -> bytes:
    """Return the :func:`encode_message` plaintext of a definition's message.

    Raises:
        RecurringStorageError: the plaintext is not a definition document.
    """
    if type(raw) is bytes and len(raw) <= _CACHED_BYTES:
        # Every tick of a definition opens the same document: its message is read once.
        return _definition_message_cached(raw)
    return _definition_message(raw)


@functools.lru_cache(maxsize=256)
def _definition_message_cached(raw: bytes) -> bytes:
    return _definition_message(raw)


def _definition_message(raw: bytes) -> bytes:
    try:
        doc = json.loads(raw)
        message = doc["message"]
        if not isinstance(message, dict):
            raise TypeError("message is not an object")
        return _canonical(message)
    except (ValueError, KeyError, TypeError) as exc:
        raise RecurringStorageError(
            f"stored definition is malformed ({type(exc).__name__})"
        ) from None


def encode_binding(config: RecurringConfig) -> bytes:
    """Canonical plaintext of a namespace's configuration binding."""
    return _canonical({"steeple.recurring.binding": 1, **config.fingerprint()})


def schedule_info(row: DefinitionRow, message: ScheduledMessage) -> ScheduleInfo:
    """Metadata of a definition (topic and type from its opened message; no payload)."""
    return ScheduleInfo(
        name=row.name,
        cron=row.cron,
        policy=row.policy,
        first_after=row.first_after,
        topic=message.topic,
        message_type=message.message_type,
        state=row.state,
        next_due_at=row.next_due_at,
        created_at=row.created_at,
        cancelled_at=row.cancelled_at,
    )


def occurrence_info(row: OccurrenceRow) -> OccurrenceInfo:
    """Metadata of an occurrence (no content, no lease credentials)."""
    return occurrence_infos((row,))[0]


def occurrence_infos(rows: Iterable[OccurrenceRow]) -> list[OccurrenceInfo]:
    """Metadata of each occurrence of ``rows``, in order (what a listing page returns).

    Each is filled in as a plain object and then made an :class:`OccurrenceInfo`
    (:mod:`steeple.core._frozen`): a listing builds one per stored occurrence, from values
    the store holds. A test requires them equal to what the constructor builds.
    """
    infos: list[OccurrenceInfo] = []
    append = infos.append
    for r in rows:
        info: Any = new(_WRITABLE_INFO)
        info.occurrence_id = r.occurrence_id
        info.definition_name = r.definition_name
        info.due_at = r.due_at
        info.state = r.state
        info.attempts = r.attempts
        info.window_ends_at = r.window_ends_at
        info.created_at = r.created_at
        info.next_attempt_at = r.next_attempt_at
        info.last_error = r.last_error
        info.__class__ = OccurrenceInfo
        append(info)
    return infos


_WRITABLE_INFO: Final = writable(OccurrenceInfo)
