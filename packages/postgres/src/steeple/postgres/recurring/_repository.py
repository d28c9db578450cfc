"""The engine's repository port on one asyncpg connection inside one locked transaction.

Translation only: rows to the port's values and back, one statement per method (arrays
through ``unnest`` for the set-based writes, spelled as ``text[]`` by ``text_array``).
Nothing here decides anything.

The control row is held for as short a time as possible: a set-based write is sent with
the next statement of the transaction instead of on its own, either before the next read
or, when it is the transaction's last write, in one statement with the namespace's
recorded time and counters (``WITH written AS (<write>) UPDATE recurring_namespaces``):
one round trip fewer per transaction, the same statements in the same order.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

import asyncpg

from steeple.core.leases import ClaimRule
from steeple.core.occurrences import OccurrenceState
from steeple.core.policies import MissedRunPolicy
from steeple.engine import (
    DefinitionRow,
    DefinitionUpdate,
    NamespaceState,
    OccurrenceChange,
    OccurrenceRow,
    ServerClockReading,
)
from steeple.postgres._arrays import text_array
from steeple.postgres._durability import AnyConnection
from steeple.postgres.recurring._sql import Queries

__all__ = ["PostgresRepository", "namespace_state"]


def _affected(status: str) -> int:
    try:
        return int(status.rsplit(" ", 1)[-1])
    except ValueError:
        return 0


def _bytes(value: Any) -> bytes | None:
    return None if value is None else bytes(value)


def namespace_state(row: asyncpg.Record, sent: float) -> NamespaceState:
    """Return the namespace state of a row read by ``lock_namespace``.

    ``sent`` is ``time.monotonic()`` when the statement was sent (its server clock's).
    """
    return NamespaceState(
        recorded_time=row["recorded_time"],
        definition_count=row["definition_count"],
        occurrence_count=row["occurrence_count"],
        binding=bytes(row["binding"]),
        binding_key_id=row["binding_key_id"],
        server_clock=ServerClockReading(row["server_time"], sent),
    )


def _definition(row: asyncpg.Record) -> DefinitionRow:
    return DefinitionRow(
        name=row["name"],
        sealed=bytes(row["sealed"]),
        key_id=row["key_id"],
        cron=row["cron"],
        policy=MissedRunPolicy(row["policy"]),
        first_after=row["first_after"],
        state=row["state"],
        cursor=row["cursor_at"],
        next_due_at=row["next_due_at"],
        created_at=row["created_at"],
        cancelled_at=row["cancelled_at"],
    )


def _occurrence(row: asyncpg.Record) -> OccurrenceRow:
    return OccurrenceRow(
        occurrence_id=row["id"],
        definition_name=row["definition_name"],
        due_at=row["due_at"],
        state=OccurrenceState(row["state"]),
        attempts=row["attempts"],
        window_ends_at=row["window_ends_at"],
        created_at=row["created_at"],
        updated_at=row["updated_at"],
        finished_at=row["finished_at"],
        next_attempt_at=row["next_attempt_at"],
        last_error=row["last_error"],
        lease_expires_at=row["lease_expires_at"],
        lease_revision=row["lease_revision"],
        lease_digest=_bytes(row["lease_capability"]),
        content=_bytes(row.get("content")),
        key_id=row.get("key_id"),
    )


class PostgresRepository:
    """:class:`steeple.engine.RecurringRepository` on a connection holding the control row."""

    def __init__(
        self, conn: AnyConnection, queries: Queries, namespace: str, state: NamespaceState
    ) -> None:
        self._conn = conn
        self._q = queries
        self._ns = namespace
        self.namespace = state  # the control row as locked
        self._pending: tuple[str, tuple[Any, ...]] | None = None

    async def _write(self, sql: str, *args: Any) -> None:
        """Queue a write to go with the next statement (see the module docstring)."""
        await self.flush()
        self._pending = (sql, args)

    async def flush(self) -> None:
        """Send the queued write, if any (before a read, and before the commit)."""
        if self._pending is not None:
            sql, args = self._pending
            self._pending = None
            await self._conn.execute(sql, *args)

    async def _fetch(self, sql: str, *args: Any) -> list[asyncpg.Record]:
        await self.flush()
        return await self._conn.fetch(sql, *args)

    async def record_namespace(
        self, recorded_time: datetime, definition_delta: int, occurrence_delta: int
    ) -> None:
        """Write the shared time and adjust the counters (with the queued write, if any)."""
        pending, self._pending = self._pending, None
        if pending is None:
            await self._conn.execute(
                self._q.touch_namespace, self._ns, recorded_time, definition_delta, occurrence_delta
            )
            return
        sql, args = pending
        await self._conn.execute(
            self._q.with_touch(sql, len(args)),
            *args,
            recorded_time,
            definition_delta,
            occurrence_delta,
        )

    async def reseal_binding(self, binding: bytes, key_id: str) -> None:
        """Replace the sealed configuration binding."""
        await self.flush()
        await self._conn.execute(self._q.reseal_binding, self._ns, binding, key_id)

    async def definition(self, name: str) -> DefinitionRow | None:
        """Return the definition named ``name``, or ``None``."""
        rows = await self._fetch(self._q.select_definition, self._ns, name)
        return _definition(rows[0]) if rows else None

    async def definitions(self, after: str | None, limit: int) -> Sequence[DefinitionRow]:
        """Return a page of definitions by name."""
        rows = await self._fetch(self._q.list_definitions, self._ns, after, limit)
        return [_definition(r) for r in rows]

    async def due_definitions(self, due_by: datetime, limit: int) -> Sequence[DefinitionRow]:
        """Return the definitions due by ``due_by``, oldest due first."""
        rows = await self._fetch(self._q.due_definitions, self._ns, due_by, limit)
        return [_definition(r) for r in rows]

    async def definitions_named(self, names: Sequence[str]) -> Sequence[DefinitionRow]:
        """Return the definitions with these names (one statement)."""
        rows = await self._fetch(self._q.select_definitions, self._ns, list(names))
        return [_definition(r) for r in rows]

    async def insert_definitions(self, rows: Sequence[DefinitionRow]) -> None:
        """Store new definitions (one statement)."""
        await self._write(
            self._q.insert_definitions,
            self._ns,
            [r.name for r in rows],
            text_array(r.sealed for r in rows),
            [r.key_id for r in rows],
            [r.cron for r in rows],
            [r.policy.value for r in rows],
            text_array(r.first_after for r in rows),
            [r.state for r in rows],
            text_array(r.cursor for r in rows),
            text_array(r.next_due_at for r in rows),
            text_array(r.created_at for r in rows),
            text_array(r.cancelled_at for r in rows),
        )

    async def update_definitions(self, updates: Sequence[DefinitionUpdate]) -> None:
        """Write the updates (one statement)."""
        if not updates:
            return
        await self._write(
            self._q.update_definitions,
            self._ns,
            [u.name for u in updates],
            [u.state for u in updates],
            text_array(u.cursor for u in updates),
            text_array(u.next_due_at for u in updates),
            text_array(u.cancelled_at for u in updates),
        )

    async def occurrences(self, ids: Sequence[str]) -> Sequence[OccurrenceRow]:
        """Return the occurrences with these ids, content included."""
        rows = await self._fetch(self._q.read_occurrences, self._ns, list(ids))
        return [_occurrence(r) for r in rows]

    async def occurrence_page(
        self, after: tuple[datetime, str] | None, limit: int
    ) -> Sequence[OccurrenceRow]:
        """Return a page of occurrences by (due time, id)."""
        due, occurrence_id = after if after is not None else (None, None)
        rows = await self._fetch(self._q.list_occurrences, self._ns, due, occurrence_id, limit)
        return [_occurrence(r) for r in rows]

    async def claimable(
        self, rule: ClaimRule, now: datetime, limit: int
    ) -> Sequence[OccurrenceRow]:
        """Return what ``rule`` admits at ``now``, oldest due first."""
        rows = await self._fetch(self._q.claimable(rule), self._ns, now, limit)
        return [_occurrence(r) for r in rows]

    async def insert_occurrences(self, rows: Sequence[OccurrenceRow]) -> None:
        """Store new occurrences (one statement)."""
        await self._write(
            self._q.insert_occurrences,
            self._ns,
            [r.occurrence_id for r in rows],
            [r.definition_name for r in rows],
            text_array(r.due_at for r in rows),
            [r.state.value for r in rows],
            text_array(r.attempts for r in rows),
            text_array(r.window_ends_at for r in rows),
            text_array(r.created_at for r in rows),
            text_array(r.updated_at for r in rows),
            text_array(r.content for r in rows),
            [r.key_id for r in rows],
        )

    async def update_occurrences(self, changes: Sequence[OccurrenceChange]) -> None:
        """Write the changes (one statement)."""
        if not changes:
            return
        await self._write(
            self._q.update_occurrences,
            self._ns,
            [c.occurrence_id for c in changes],
            [c.state.value for c in changes],
            text_array(c.attempts for c in changes),
            text_array(c.next_attempt_at for c in changes),
            [c.last_error for c in changes],
            text_array(c.lease_expires_at for c in changes),
            text_array(c.lease_revision for c in changes),
            text_array(c.lease_digest for c in changes),
            text_array(c.updated_at for c in changes),
            text_array(c.finished_at for c in changes),
            text_array(c.erase_content for c in changes),
        )

    async def window_ended(
        self, states: frozenset[OccurrenceState], ended_by: datetime
    ) -> Sequence[OccurrenceRow]:
        """Return the occurrences in ``states`` whose window ended by ``ended_by``."""
        rows = await self._fetch(self._q.window_ended(states), self._ns, ended_by)
        return [_occurrence(r) for r in rows]

    async def occurrences_of(
        self, definition_name: str, states: frozenset[OccurrenceState]
    ) -> Sequence[OccurrenceRow]:
        """Return a definition's occurrences in ``states``."""
        rows = await self._fetch(self._q.occurrences_of(states), self._ns, definition_name)
        return [_occurrence(r) for r in rows]

    async def delete_occurrences(
        self, states: frozenset[OccurrenceState], finished_before: datetime, limit: int
    ) -> int:
        """Delete the oldest finished occurrences in ``states``; return how many."""
        await self.flush()
        status = await self._conn.execute(self._q.purge(states), self._ns, finished_before, limit)
        return _affected(status)
