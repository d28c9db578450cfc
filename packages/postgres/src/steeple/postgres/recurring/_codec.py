"""Translation between domain values and what the recurring tables hold.

Sealed columns hold canonical JSON (sorted keys, no whitespace), so an identical
definition always encodes to identical plaintext and can be compared after opening.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg

from steeple.core import records
from steeple.core.config import RecurringConfig, RecurringDefinition
from steeple.core.errors import RecurringStorageError
from steeple.core.messages import ScheduledMessage
from steeple.core.occurrences import OccurrenceState
from steeple.core.policies import MissedRunPolicy
from steeple.core.records import OccurrenceInfo, ScheduleInfo

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MS = timedelta(milliseconds=1)


def _canonical(value: Mapping[str, Any]) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def epoch_ms(instant: datetime) -> int:
    """Milliseconds since the epoch of an aware instant."""
    return (instant - _EPOCH) // _MS


def occurrence_cursor(due_at: datetime, occurrence_id: str) -> str:
    """Return the exclusive listing cursor after the occurrence ``(due_at, id)``."""
    return records.occurrence_cursor(due_at, occurrence_id)


def parse_occurrence_cursor(cursor: object) -> tuple[datetime | None, str | None]:
    """Return the ``(due_at, id)`` position of a cursor (``(None, None)`` for no cursor).

    Raises:
        RecurringConfigurationError: not a cursor this store returned.
    """
    if cursor is None:
        return None, None
    return records.parse_occurrence_cursor(cursor)


def message_document(message: ScheduledMessage) -> dict[str, Any]:
    """Return the JSON-ready form of a message (payload in base64)."""
    return {
        "topic": message.topic,
        "message_type": message.message_type,
        "payload": base64.b64encode(message.payload).decode("ascii"),
        "headers": dict(message.headers),
    }


def encode_message(message: ScheduledMessage) -> bytes:
    """Canonical plaintext of an occurrence's frozen message."""
    return _canonical(message_document(message))


def decode_message(raw: bytes) -> ScheduledMessage:
    """Rebuild a message from :func:`encode_message` output.

    Raises:
        RecurringStorageError: the plaintext is not a message document.
    """
    try:
        doc = json.loads(raw)
        return ScheduledMessage(
            doc["topic"],
            doc["message_type"],
            base64.b64decode(doc["payload"], validate=True),
            doc["headers"],
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise RecurringStorageError(f"stored message content is malformed ({exc})") from None


def encode_definition(definition: RecurringDefinition) -> bytes:
    """Canonical plaintext of a definition: everything that makes it what it is."""
    return _canonical(
        {
            "name": definition.name,
            "cron": definition.cron.expression,
            "first_after_ms": epoch_ms(definition.first_after),
            "policy": definition.policy.value,
            "message": message_document(definition.message),
        }
    )


def definition_message_plaintext(raw: bytes) -> bytes:
    """Return the :func:`encode_message` plaintext of a definition's message.

    Raises:
        RecurringStorageError: the plaintext is not a definition document.
    """
    try:
        doc = json.loads(raw)
        message = doc["message"]
        if not isinstance(message, dict):
            raise TypeError("message is not an object")
        return _canonical(message)
    except (ValueError, KeyError, TypeError) as exc:
        raise RecurringStorageError(f"stored definition is malformed ({exc})") from None


def encode_binding(config: RecurringConfig) -> bytes:
    """Canonical plaintext of a namespace's configuration binding."""
    return _canonical({"steeple.recurring.binding": 1, **config.fingerprint()})


def schedule_info(row: asyncpg.Record) -> ScheduleInfo:
    """Metadata of a definition row (no payload, no headers)."""
    return ScheduleInfo(
        name=row["name"],
        cron=row["cron"],
        policy=MissedRunPolicy(row["policy"]),
        first_after=row["first_after"],
        topic=row["topic"],
        message_type=row["message_type"],
        state=row["state"],
        next_due_at=row["next_due_at"],
        created_at=row["created_at"],
        cancelled_at=row["cancelled_at"],
    )


def occurrence_info(row: asyncpg.Record) -> OccurrenceInfo:
    """Metadata of an occurrence row (no content, no lease credentials)."""
    return OccurrenceInfo(
        occurrence_id=row["id"],
        definition_name=row["definition_name"],
        due_at=row["due_at"],
        state=OccurrenceState(row["state"]),
        attempts=row["attempts"],
        window_ends_at=row["window_ends_at"],
        created_at=row["created_at"],
        next_attempt_at=row["next_attempt_at"],
        last_error=row["last_error"],
    )
