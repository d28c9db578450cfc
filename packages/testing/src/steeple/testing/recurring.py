"""The in-memory reference recurring store: the engine over dicts.

:class:`InMemoryRecurringStorage` is the smallest complete adapter of the engine's
persistence port (:mod:`steeple.engine.ports`): each method reads or writes rows of two
dicts (indexed by state), and a transaction undoes its writes when the engine's work
raises (so a failed call stores nothing). :class:`InMemoryRecurringStore`
is it under :class:`~steeple.engine.EngineStore`: every rule of the contract comes from the
engine and the core, exactly as for the PostgreSQL store. Everything a database
adds (durability, SQL deadlines, privileges, several processes) is out of scope.

Without a sealer, content is kept as plaintext bytes (in memory only); with one,
definitions and occurrence content are sealed as in every other store.
"""

from __future__ import annotations

import asyncio
import bisect
import operator
from collections.abc import Iterator, Sequence
from datetime import datetime
from typing import Final, TypeVar

import attrs

from steeple.core.config import RecurringConfig
from steeple.core.errors import (
    RecurringStorageError,
)
from steeple.core.leases import ClaimRule
from steeple.core.occurrences import OccurrenceState
from steeple.core.ports import Clock, RandomSource, Sealer
from steeple.engine import (
    DefinitionRow,
    DefinitionUpdate,
    EngineStore,
    NamespaceState,
    OccurrenceChange,
    OccurrenceRow,
    RecurringEngine,
    RepositoryWork,
)

__all__ = ["InMemoryRecurringStorage", "InMemoryRecurringStore"]

T = TypeVar("T")


class _Unsealed:
    """Keeps content as plaintext: the store was built without a sealer (memory only)."""

    primary_key_id: Final = "unsealed"

    def seal(self, plaintext: bytes, *, namespace: str, purpose: str, identity: str) -> bytes:
        return bytes(plaintext)

    def open(self, sealed: bytes, *, namespace: str, purpose: str, identity: str) -> bytes:
        return bytes(sealed)


_LISTING_ORDER: Final = operator.attrgetter("due_at", "occurrence_id")
"""A listing's order: by due time, then id (unique: it is also the cursor's position)."""

_Undo = tuple[bool, str, DefinitionRow | OccurrenceRow | None]
"""One undo entry: (is an occurrence, key, the row before the write or ``None`` if new)."""


class _Repository:
    """The port's repository, writing straight into the storage's tables.

    Every write first notes the row it replaces in the transaction's undo log, so a
    failed transaction is rolled back by replaying the log backwards (no copies).
    """

    def __init__(self, storage: InMemoryRecurringStorage, state: NamespaceState) -> None:
        self._storage = storage
        self.namespace = state
        self.recorded: datetime | None = state.recorded_time

    async def record_namespace(
        self, recorded_time: datetime, definition_delta: int, occurrence_delta: int
    ) -> None:
        # The counters are the dicts' sizes: the deltas need no storing.
        self.recorded = recorded_time

    async def reseal_binding(self, binding: bytes, key_id: str) -> None:
        raise RecurringStorageError("the in-memory store keeps no configuration binding")

    async def definition(self, name: str) -> DefinitionRow | None:
        return self._storage.definitions.get(name)

    async def definitions(self, after: str | None, limit: int) -> Sequence[DefinitionRow]:
        stored = self._storage.definitions
        names = sorted(n for n in stored if after is None or n > after)
        return [stored[n] for n in names[:limit]]

    async def due_definitions(self, due_by: datetime, limit: int) -> Sequence[DefinitionRow]:
        due = sorted(key for key in self._storage.due.values() if key[0] <= due_by)
        stored = self._storage.definitions
        return [stored[name] for _, name in due[:limit]]

    async def definitions_named(self, names: Sequence[str]) -> Sequence[DefinitionRow]:
        stored = self._storage.definitions
        return [stored[n] for n in dict.fromkeys(names) if n in stored]

    async def insert_definitions(self, rows: Sequence[DefinitionRow]) -> None:
        storage = self._storage
        for row in rows:
            if row.name in storage.definitions:
                raise RecurringStorageError(f"definition {row.name!r} is stored already")
            storage.put_definition(row.name, row)

    async def update_definitions(self, updates: Sequence[DefinitionUpdate]) -> None:
        storage = self._storage
        stored, due, undo = storage.definitions, storage.due, storage.undo_log
        for u in updates:
            name = u.name
            current = stored[name]
            if undo is not None:
                undo.append((False, name, current))
            # put_definition, for a stored row.
            stored[name] = u.applied_to(current)
            if u.next_due_at is None:
                due.pop(name, None)
            else:
                due[name] = (u.next_due_at, name)

    async def occurrences(self, ids: Sequence[str]) -> Sequence[OccurrenceRow]:
        stored = self._storage.occurrences
        return [stored[i] for i in dict.fromkeys(ids) if i in stored]

    async def occurrence_page(
        self, after: tuple[datetime, str] | None, limit: int
    ) -> Sequence[OccurrenceRow]:
        ordered = sorted(self._storage.occurrences.values(), key=_LISTING_ORDER)
        if after is not None:
            del ordered[: bisect.bisect_right(ordered, after, key=_LISTING_ORDER)]
        return ordered[:limit]

    async def claimable(
        self, rule: ClaimRule, now: datetime, limit: int
    ) -> Sequence[OccurrenceRow]:
        stored = self._storage.occurrences
        ready = sorted(
            (o.due_at, o.definition_name, o.occurrence_id)
            for o in self._storage.in_states(rule.states)
            if rule.admits(
                o.state,
                now,
                window_ends_at=o.window_ends_at,
                lease_expires_at=o.lease_expires_at,
                next_attempt_at=o.next_attempt_at,
            )
        )
        return [stored[i] for _, _, i in ready[:limit]]

    async def insert_occurrences(self, rows: Sequence[OccurrenceRow]) -> None:
        storage = self._storage
        stored, identities, undo = storage.occurrences, storage.identities, storage.undo_log
        by_state = storage.by_state
        for row in rows:
            occurrence_id = row.occurrence_id
            identity = (row.definition_name, row.due_at)
            if occurrence_id in stored or identity in identities:
                raise RecurringStorageError(f"occurrence {occurrence_id} is stored already")
            # put_occurrence, for a new row: nothing to replace, every index gains it.
            if undo is not None:
                undo.append((True, occurrence_id, None))
            stored[occurrence_id] = row
            identities.add(identity)
            by_state[row.state._value_][occurrence_id] = None

    async def update_occurrences(self, changes: Sequence[OccurrenceChange]) -> None:
        storage = self._storage
        stored = storage.occurrences
        undo = storage.undo_log
        by_state = storage.by_state
        for change in changes:
            # put_occurrence, for a change: it keeps the row's identity (applied_to copies
            # the definition and due time), so only the state index may move.
            occurrence_id = change.occurrence_id
            old = stored[occurrence_id]
            row = change.applied_to(old)
            if undo is not None:
                undo.append((True, occurrence_id, old))
            stored[occurrence_id] = row
            if old.state is not row.state:
                by_state[old.state._value_].pop(occurrence_id, None)
                by_state[row.state._value_][occurrence_id] = None

    async def window_ended(
        self, states: frozenset[OccurrenceState], ended_by: datetime
    ) -> Sequence[OccurrenceRow]:
        stored = self._storage.occurrences
        by_state = self._storage.by_state
        # Every call classifies expiry first: the live states' ids, read without a generator.
        return [
            o
            for state in states
            for o in map(stored.__getitem__, by_state[state._value_])
            if o.window_ends_at <= ended_by
        ]

    async def occurrences_of(
        self, definition_name: str, states: frozenset[OccurrenceState]
    ) -> Sequence[OccurrenceRow]:
        return [o for o in self._storage.in_states(states) if o.definition_name == definition_name]

    async def delete_occurrences(
        self, states: frozenset[OccurrenceState], finished_before: datetime, limit: int
    ) -> int:
        storage = self._storage
        stored = storage.occurrences
        by_state = storage.by_state
        finished = [
            o
            for state in states
            for o in map(stored.__getitem__, by_state[state._value_])
            if o.finished_at is not None and o.finished_at < finished_before
        ]
        if len(finished) > limit:
            # Only more than a page needs the order: the oldest finished go first.
            finished = sorted(
                finished,
                key=lambda o: (o.finished_at, o.due_at, o.definition_name, o.occurrence_id),
            )[:limit]
        storage.delete_occurrences(finished)
        return len(finished)


class InMemoryRecurringStorage:
    """The engine's persistence port held in two dicts of rows (the reference adapter).

    One transaction at a time (an :class:`asyncio.Lock` stands for the control row).
    The rows are the port's frozen values; the repository writes them straight into the
    dicts and notes each row it replaces, and a transaction whose work raises puts those
    back, so a call that raises stores nothing. Occurrences are also indexed by state
    (what claims, expiry and purges select by) and by ``(definition_name, due_at)``
    (their identity), and definitions by their next due time (what a tick selects by): a
    read touches the rows it may return, or those rows' index entries, not every row kept.

    Tests may replace a stored occurrence in :attr:`occurrences` with one that differs
    in any column but its state, definition and due time (the indexed ones).
    """

    def __init__(self) -> None:
        self.definitions: dict[str, DefinitionRow] = {}
        self.occurrences: dict[str, OccurrenceRow] = {}
        self.identities: set[tuple[str, datetime]] = set()
        self.due: dict[str, tuple[datetime, str]] = {}
        """``(next_due_at, name)`` of each definition that has a next due time, by name."""
        self.recorded: datetime | None = None
        self.closed = False
        self.by_state: dict[str, dict[str, None]] = {s._value_: {} for s in OccurrenceState}
        """Occurrence ids by state value (a str hashes in C, an enum member in Python)."""
        self.undo_log: list[_Undo] | None = None
        """The open transaction's undo log (``None`` outside a transaction)."""
        self._lock = asyncio.Lock()

    def in_states(self, states: frozenset[OccurrenceState]) -> Iterator[OccurrenceRow]:
        """Yield the stored occurrences in ``states`` (any order)."""
        stored = self.occurrences
        by_state = self.by_state
        for state in states:
            for occurrence_id in by_state[state._value_]:
                yield stored[occurrence_id]

    def put_definition(self, name: str, row: DefinitionRow) -> None:
        """Store ``row`` under ``name`` (noting what it replaces for a rollback)."""
        if self.undo_log is not None:
            self.undo_log.append((False, name, self.definitions.get(name)))
        self._place_definition(name, row)

    def _place_definition(self, name: str, row: DefinitionRow | None) -> None:
        if row is None:
            self.definitions.pop(name, None)
            self.due.pop(name, None)
            return
        self.definitions[name] = row
        if row.next_due_at is None:
            self.due.pop(name, None)
        else:
            self.due[name] = (row.next_due_at, name)

    def put_occurrence(self, occurrence_id: str, row: OccurrenceRow | None) -> None:
        """Store ``row`` under ``occurrence_id``, or delete it (``None``); keep the indexes."""
        old = self.occurrences.get(occurrence_id)
        if self.undo_log is not None:
            self.undo_log.append((True, occurrence_id, old))
        self._place(occurrence_id, old, row)

    def delete_occurrences(self, rows: Sequence[OccurrenceRow]) -> None:
        """Delete the stored ``rows`` (noting each for a rollback); keep the indexes."""
        stored = self.occurrences
        by_state = self.by_state
        identities = self.identities
        undo = self.undo_log
        for row in rows:
            occurrence_id = row.occurrence_id
            old = stored.pop(occurrence_id)
            if undo is not None:
                undo.append((True, occurrence_id, old))
            by_state[old.state._value_].pop(occurrence_id, None)
            identities.discard((old.definition_name, old.due_at))

    def _place(
        self, occurrence_id: str, old: OccurrenceRow | None, row: OccurrenceRow | None
    ) -> None:
        if row is None:
            if old is not None:
                del self.occurrences[occurrence_id]
                self.by_state[old.state._value_].pop(occurrence_id, None)
                self.identities.discard((old.definition_name, old.due_at))
            return
        self.occurrences[occurrence_id] = row
        if old is None:
            self.identities.add((row.definition_name, row.due_at))
        elif old.definition_name != row.definition_name or old.due_at != row.due_at:
            self.identities.discard((old.definition_name, old.due_at))
            self.identities.add((row.definition_name, row.due_at))
        if old is None or old.state is not row.state:
            if old is not None:
                self.by_state[old.state._value_].pop(occurrence_id, None)
            self.by_state[row.state._value_][occurrence_id] = None

    def _roll_back(self, undo: list[_Undo]) -> None:
        for is_occurrence, key, before in reversed(undo):
            if is_occurrence:
                assert before is None or isinstance(before, OccurrenceRow)
                self._place(key, self.occurrences.get(key), before)
            else:
                assert before is None or isinstance(before, DefinitionRow)
                self._place_definition(key, before)

    async def transaction(self, operation: str, work: RepositoryWork[T]) -> T:
        """Run ``work`` on the rows; undo its writes if it raises.

        Raises:
            RecurringStorageError: the store is closed.
        """
        if self.closed:
            raise RecurringStorageError(f"{operation}: the store is closed")
        lock = self._lock
        await lock.acquire()  # `async with`, without its two awaits per call
        try:
            state = NamespaceState(self.recorded, len(self.definitions), len(self.occurrences))
            repo = _Repository(self, state)
            undo: list[_Undo] = []
            self.undo_log = undo
            try:
                result = await work(repo)
            except BaseException:
                self._roll_back(undo)
                raise
            finally:
                self.undo_log = None
            self.recorded = repo.recorded
            return result
        finally:
            lock.release()


@attrs.define(init=False, repr=False)
class InMemoryRecurringStore(EngineStore):
    """The reference :class:`steeple.core.ports.RecurringStore`, held in memory.

    :class:`InMemoryRecurringStorage` under :class:`~steeple.engine.EngineStore` (the
    operations, documented there, are the engine's, as in every store).

    Args:
        config: the namespace's configuration (quotas, delivery window, lease).
        clock: where time comes from (a :class:`~steeple.testing.FakeClock` in tests).
        random: capabilities and generations; the OS's randomness by default.
        sealer: if given, definition and occurrence content is kept sealed under the
            ``"definition"`` / ``"occurrence"`` purposes, as the PostgreSQL store does.

    Raises:
        RecurringConfigurationError: ``config`` is not a RecurringConfig.
    """

    _config: RecurringConfig
    _clock: Clock
    _storage: InMemoryRecurringStorage
    _engine: RecurringEngine

    def __init__(
        self,
        config: RecurringConfig,
        clock: Clock,
        *,
        random: RandomSource | None = None,
        sealer: Sealer | None = None,
    ) -> None:
        self._storage = InMemoryRecurringStorage()
        self._engine = RecurringEngine(
            self._storage,
            config,
            sealer if sealer is not None else _Unsealed(),
            clock,
            random,
        )
        self._config = config
        self._clock = clock

    @property
    def _occurrences(self) -> dict[str, OccurrenceRow]:
        # Tests reach in to look at (and tamper with) stored occurrences.
        return self._storage.occurrences

    @property
    def _definitions(self) -> dict[str, DefinitionRow]:
        return self._storage.definitions

    def __repr__(self) -> str:
        return (
            f"InMemoryRecurringStore(namespace={self._config.namespace!r}, "
            f"definitions={len(self._definitions)}, occurrences={len(self._occurrences)})"
        )

    async def close(self) -> None:
        """Close the store; later calls raise :class:`RecurringStorageError`."""
        self._storage.closed = True
