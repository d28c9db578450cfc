"""The engine's repository port on one sqlite3 connection inside one BEGIN IMMEDIATE.

Translation only: rows to the port's values and back, instants as integer microseconds.
The methods are ``async`` (the port's shape) but run on the store's own thread, inside
the transaction it opened: they never suspend. Nothing here decides anything.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from steeple.core.leases import ClaimRule
from steeple.core.occurrences import OccurrenceState
from steeple.core.policies import MissedRunPolicy
from steeple.engine import (
    DefinitionRow,
    DefinitionUpdate,
    NamespaceState,
    OccurrenceChange,
    OccurrenceRow,
)
from steeple.sqlite import _sql

__all__ = ["SqliteRepository", "instant", "microseconds", "namespace_state"]

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_US = timedelta(microseconds=1)
_CHUNK = 512  # ids per IN list, well under SQLite's bound-parameter limit


def microseconds(at: datetime | None) -> int | None:
    """Return an aware instant as integer microseconds since the epoch (``None`` stays)."""
    return None if at is None else (at - _EPOCH) // _US


def instant(us: int | None) -> datetime | None:
    """Return the aware UTC instant ``us`` microseconds after the epoch."""
    return None if us is None else _EPOCH + timedelta(microseconds=us)


def _at(us: int) -> datetime:
    return _EPOCH + timedelta(microseconds=us)


def namespace_state(row: Sequence[Any]) -> NamespaceState:
    """Return the namespace state of a row read by ``READ_NAMESPACE``."""
    binding, key_id, recorded, definitions, occurrences = row
    return NamespaceState(instant(recorded), definitions, occurrences, bytes(binding), key_id)


def _definition(r: Sequence[Any]) -> DefinitionRow:
    return DefinitionRow(
        name=r[0],
        sealed=bytes(r[1]),
        key_id=r[2],
        cron=r[3],
        policy=MissedRunPolicy(r[4]),
        first_after=_at(r[5]),
        state=r[6],
        cursor=_at(r[7]),
        next_due_at=instant(r[8]),
        created_at=_at(r[9]),
        cancelled_at=instant(r[10]),
    )


def _occurrence(r: Sequence[Any]) -> OccurrenceRow:
    return OccurrenceRow(
        occurrence_id=r[0],
        definition_name=r[1],
        due_at=_at(r[2]),
        state=OccurrenceState(r[3]),
        attempts=r[4],
        window_ends_at=_at(r[5]),
        created_at=_at(r[6]),
        updated_at=_at(r[7]),
        finished_at=instant(r[8]),
        next_attempt_at=instant(r[9]),
        last_error=r[10],
        lease_expires_at=instant(r[11]),
        lease_revision=r[12],
        lease_digest=r[13],
        content=r[14] if len(r) > 14 else None,
        key_id=r[15] if len(r) > 15 else None,
    )


class SqliteRepository:
    """:class:`steeple.engine.RecurringRepository` on a connection holding the write lock."""

    def __init__(self, conn: sqlite3.Connection, namespace: str, state: NamespaceState) -> None:
        self._conn = conn
        self._ns = namespace
        self.namespace = state  # the control row as read under the lock

    def _rows(self, sql: str, params: Sequence[Any]) -> list[Any]:
        return self._conn.execute(sql, params).fetchall()

    def _by_keys(self, query: Callable[[int], str], keys: Sequence[str]) -> list[Any]:
        """Rows whose key is in ``keys`` (repeats ignored), ``_CHUNK`` keys per statement.

        Each list is padded to a power of two by repeating its last key: a handful of
        statement texts (SQLite's statement cache holds them all), whatever the batch sizes.
        """
        unique = list(dict.fromkeys(keys))
        rows: list[Any] = []
        for start in range(0, len(unique), _CHUNK):
            chunk = unique[start : start + _CHUNK]
            size = 1 << (len(chunk) - 1).bit_length()
            padded = chunk + chunk[-1:] * (size - len(chunk))
            rows.extend(self._rows(query(size), (self._ns, *padded)))
        return rows

    async def record_namespace(
        self, recorded_time: datetime, definition_delta: int, occurrence_delta: int
    ) -> None:
        """Write the shared time and adjust the counters."""
        self._conn.execute(
            _sql.TOUCH_NAMESPACE,
            (microseconds(recorded_time), definition_delta, occurrence_delta, self._ns),
        )

    async def reseal_binding(self, binding: bytes, key_id: str) -> None:
        """Replace the sealed configuration binding."""
        self._conn.execute(_sql.RESEAL_BINDING, (binding, key_id, self._ns))

    async def definition(self, name: str) -> DefinitionRow | None:
        """Return the definition named ``name``, or ``None``."""
        rows = self._rows(_sql.SELECT_DEFINITION, (self._ns, name))
        return _definition(rows[0]) if rows else None

    async def definitions(self, after: str | None, limit: int) -> Sequence[DefinitionRow]:
        """Return a page of definitions by name."""
        rows = self._rows(_sql.LIST_DEFINITIONS, (self._ns, after, after, limit))
        return [_definition(r) for r in rows]

    async def due_definitions(self, due_by: datetime, limit: int) -> Sequence[DefinitionRow]:
        """Return the definitions due by ``due_by``, oldest due first."""
        rows = self._rows(_sql.DUE_DEFINITIONS, (self._ns, microseconds(due_by), limit))
        return [_definition(r) for r in rows]

    async def definitions_named(self, names: Sequence[str]) -> Sequence[DefinitionRow]:
        """Return the definitions with these names."""
        return [_definition(r) for r in self._by_keys(_sql.definitions_named, names)]

    async def insert_definitions(self, rows: Sequence[DefinitionRow]) -> None:
        """Store new definitions (one prepared statement)."""
        self._conn.executemany(
            _sql.INSERT_DEFINITION,
            [
                (
                    self._ns,
                    r.name,
                    r.sealed,
                    r.key_id,
                    r.cron,
                    r.policy.value,
                    microseconds(r.first_after),
                    r.state,
                    microseconds(r.cursor),
                    microseconds(r.next_due_at),
                    microseconds(r.created_at),
                    microseconds(r.cancelled_at),
                )
                for r in rows
            ],
        )

    async def update_definitions(self, updates: Sequence[DefinitionUpdate]) -> None:
        """Write the updates (one prepared statement)."""
        self._conn.executemany(
            _sql.UPDATE_DEFINITION,
            [
                (
                    u.state,
                    microseconds(u.cursor),
                    microseconds(u.next_due_at),
                    microseconds(u.cancelled_at),
                    self._ns,
                    u.name,
                )
                for u in updates
            ],
        )

    async def occurrences(self, ids: Sequence[str]) -> Sequence[OccurrenceRow]:
        """Return the occurrences with these ids, content included."""
        return [_occurrence(r) for r in self._by_keys(_sql.read_occurrences, ids)]

    async def occurrence_page(
        self, after: tuple[datetime, str] | None, limit: int
    ) -> Sequence[OccurrenceRow]:
        """Return a page of occurrences by (due time, id)."""
        due, occurrence_id = after if after is not None else (None, None)
        due_us = microseconds(due)
        rows = self._rows(_sql.LIST_OCCURRENCES, (self._ns, due_us, due_us, occurrence_id, limit))
        return [_occurrence(r) for r in rows]

    async def claimable(
        self, rule: ClaimRule, now: datetime, limit: int
    ) -> Sequence[OccurrenceRow]:
        """Return what ``rule`` admits at ``now``, oldest due first."""
        rows = self._rows(_sql.claimable(rule), (self._ns, microseconds(now), limit))
        return [_occurrence(r) for r in rows]

    async def insert_occurrences(self, rows: Sequence[OccurrenceRow]) -> None:
        """Store new occurrences (one prepared statement)."""
        self._conn.executemany(
            _sql.INSERT_OCCURRENCE,
            [
                (
                    self._ns,
                    r.occurrence_id,
                    r.definition_name,
                    microseconds(r.due_at),
                    r.state.value,
                    r.attempts,
                    microseconds(r.window_ends_at),
                    microseconds(r.created_at),
                    microseconds(r.updated_at),
                    microseconds(r.finished_at),
                    microseconds(r.next_attempt_at),
                    r.last_error,
                    microseconds(r.lease_expires_at),
                    r.lease_revision,
                    r.lease_digest,
                    r.content,
                    r.key_id,
                )
                for r in rows
            ],
        )

    async def update_occurrences(self, changes: Sequence[OccurrenceChange]) -> None:
        """Write the changes (one prepared statement)."""
        self._conn.executemany(
            _sql.UPDATE_OCCURRENCE,
            [
                (
                    c.state.value,
                    c.attempts,
                    microseconds(c.next_attempt_at),
                    c.last_error,
                    microseconds(c.lease_expires_at),
                    c.lease_revision,
                    c.lease_digest,
                    microseconds(c.updated_at),
                    microseconds(c.finished_at),
                    c.erase_content,
                    c.erase_content,
                    self._ns,
                    c.occurrence_id,
                )
                for c in changes
            ],
        )

    async def window_ended(
        self, states: frozenset[OccurrenceState], ended_by: datetime
    ) -> Sequence[OccurrenceRow]:
        """Return the occurrences in ``states`` whose window ended by ``ended_by``."""
        rows = self._rows(_sql.window_ended(states), (self._ns, microseconds(ended_by)))
        return [_occurrence(r) for r in rows]

    async def occurrences_of(
        self, definition_name: str, states: frozenset[OccurrenceState]
    ) -> Sequence[OccurrenceRow]:
        """Return a definition's occurrences in ``states``."""
        rows = self._rows(_sql.occurrences_of(states), (self._ns, definition_name))
        return [_occurrence(r) for r in rows]

    async def delete_occurrences(
        self, states: frozenset[OccurrenceState], finished_before: datetime, limit: int
    ) -> int:
        """Delete the oldest finished occurrences in ``states``; return how many."""
        cursor = self._conn.execute(
            _sql.purge(states), (self._ns, microseconds(finished_before), limit)
        )
        return cursor.rowcount
