"""The in-memory reference recurring store: the engine over dicts.

:class:`InMemoryRecurringStorage` is the smallest complete adapter of the engine's
persistence port (:mod:`steeple.engine.ports`): each method reads or writes rows of two
dicts, and a transaction works on copies that replace the originals only when the
engine's work returns (so a failed call stores nothing). :class:`InMemoryRecurringStore`
composes it with :class:`~steeple.engine.RecurringEngine`: every rule of seed 000 comes
from the engine and the core, exactly as for the PostgreSQL store. Everything a database
adds (durability, SQL deadlines, privileges, several processes) is out of scope.

Without a sealer, content is kept as plaintext bytes (in memory only); with one,
definitions and occurrence content are sealed as in every other store.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime
from types import TracebackType
from typing import Final, TypeVar

import attrs

from steeple.core import limits
from steeple.core.config import RecurringConfig, RecurringDefinition
from steeple.core.entropy import SystemRandom
from steeple.core.errors import (
    RecurringConfigurationError,
    RecurringConflictError,
    RecurringStorageError,
)
from steeple.core.leases import ClaimRule
from steeple.core.messages import BrokerReceipt
from steeple.core.occurrences import OccurrenceState
from steeple.core.policies import MissedRunPolicy
from steeple.core.ports import Clock, MessageBroker, RandomSource, Sealer
from steeple.core.records import (
    Lease,
    OccurrenceInfo,
    Page,
    RelayOutcome,
    ScheduleInfo,
    TickResult,
)
from steeple.engine import (
    DefinitionRow,
    DefinitionUpdate,
    NamespaceState,
    OccurrenceChange,
    OccurrenceRow,
    RecurringEngine,
    RecurringRepository,
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


@attrs.define(repr=False)
class _Definition:
    """A stored definition (mutable, so tests can reach in)."""

    name: str
    sealed: bytes
    key_id: str
    cron: str
    policy: MissedRunPolicy
    first_after: datetime
    state: str
    cursor: datetime
    next_due_at: datetime | None
    created_at: datetime
    cancelled_at: datetime | None = None

    def row(self) -> DefinitionRow:
        return DefinitionRow(**attrs.asdict(self, recurse=False))


@attrs.define(repr=False)
class _Occurrence:
    """A stored occurrence (mutable, so tests can reach in)."""

    occurrence_id: str
    definition_name: str
    due_at: datetime
    state: OccurrenceState
    attempts: int
    window_ends_at: datetime
    created_at: datetime
    updated_at: datetime
    finished_at: datetime | None = None
    next_attempt_at: datetime | None = None
    last_error: str | None = None
    lease_expires_at: datetime | None = None
    lease_revision: int = 0
    lease_digest: bytes | None = None
    content: bytes | None = None
    key_id: str | None = None

    def row(self) -> OccurrenceRow:
        return OccurrenceRow(**attrs.asdict(self, recurse=False))


def _stored(row: OccurrenceRow) -> _Occurrence:
    return _Occurrence(**attrs.asdict(row, recurse=False))


class _Repository:
    """The port's repository over one transaction's copies of the dicts."""

    def __init__(
        self,
        state: NamespaceState,
        definitions: dict[str, _Definition],
        occurrences: dict[str, _Occurrence],
    ) -> None:
        self._state = state
        self.definitions_ = definitions
        self.occurrences_ = occurrences
        self.recorded: datetime | None = state.recorded_time

    @property
    def namespace(self) -> NamespaceState:
        return self._state

    async def record_namespace(
        self, recorded_time: datetime, definition_delta: int, occurrence_delta: int
    ) -> None:
        # The counters are the dicts' sizes: the deltas need no storing.
        self.recorded = recorded_time

    async def reseal_binding(self, binding: bytes, key_id: str) -> None:
        raise RecurringStorageError("the in-memory store keeps no configuration binding")

    async def definition(self, name: str) -> DefinitionRow | None:
        found = self.definitions_.get(name)
        return found.row() if found is not None else None

    async def definitions(self, after: str | None, limit: int) -> Sequence[DefinitionRow]:
        names = sorted(n for n in self.definitions_ if after is None or n > after)
        return [self.definitions_[n].row() for n in names[:limit]]

    async def due_definitions(self, due_by: datetime, limit: int) -> Sequence[DefinitionRow]:
        due = sorted(
            (d.next_due_at, d.name)
            for d in self.definitions_.values()
            if d.next_due_at is not None and d.next_due_at <= due_by
        )
        return [self.definitions_[name].row() for _, name in due[:limit]]

    async def definitions_named(self, names: Sequence[str]) -> Sequence[DefinitionRow]:
        return [self.definitions_[n].row() for n in dict.fromkeys(names) if n in self.definitions_]

    async def insert_definitions(self, rows: Sequence[DefinitionRow]) -> None:
        for row in rows:
            if row.name in self.definitions_:
                raise RecurringStorageError(f"definition {row.name!r} is stored already")
            self.definitions_[row.name] = _Definition(**attrs.asdict(row, recurse=False))

    async def update_definitions(self, updates: Sequence[DefinitionUpdate]) -> None:
        for u in updates:
            self.definitions_[u.name] = attrs.evolve(
                self.definitions_[u.name],
                state=u.state,
                cursor=u.cursor,
                next_due_at=u.next_due_at,
                cancelled_at=u.cancelled_at,
            )

    async def occurrences(self, ids: Sequence[str]) -> Sequence[OccurrenceRow]:
        return [self.occurrences_[i].row() for i in dict.fromkeys(ids) if i in self.occurrences_]

    async def occurrence_page(
        self, after: tuple[datetime, str] | None, limit: int
    ) -> Sequence[OccurrenceRow]:
        ordered = sorted(
            (o.due_at, o.occurrence_id)
            for o in self.occurrences_.values()
            if after is None or (o.due_at, o.occurrence_id) > after
        )
        return [self.occurrences_[i].row() for _, i in ordered[:limit]]

    async def claimable(
        self, rule: ClaimRule, now: datetime, limit: int
    ) -> Sequence[OccurrenceRow]:
        ready = sorted(
            (o.due_at, o.definition_name, o.occurrence_id)
            for o in self.occurrences_.values()
            if rule.admits(
                o.state,
                now,
                window_ends_at=o.window_ends_at,
                lease_expires_at=o.lease_expires_at,
                next_attempt_at=o.next_attempt_at,
            )
        )
        return [self.occurrences_[i].row() for _, _, i in ready[:limit]]

    async def insert_occurrences(self, rows: Sequence[OccurrenceRow]) -> None:
        taken = {(o.definition_name, o.due_at) for o in self.occurrences_.values()}
        for row in rows:
            identity = (row.definition_name, row.due_at)
            if row.occurrence_id in self.occurrences_ or identity in taken:
                raise RecurringStorageError(f"occurrence {row.occurrence_id} is stored already")
            taken.add(identity)
            self.occurrences_[row.occurrence_id] = _stored(row)

    async def update_occurrences(self, changes: Sequence[OccurrenceChange]) -> None:
        for change in changes:
            current = self.occurrences_[change.occurrence_id].row()
            self.occurrences_[change.occurrence_id] = _stored(change.applied_to(current))

    async def window_ended(
        self, states: frozenset[OccurrenceState], ended_by: datetime
    ) -> Sequence[OccurrenceRow]:
        return [
            o.row()
            for o in self.occurrences_.values()
            if o.state in states and o.window_ends_at <= ended_by
        ]

    async def occurrences_of(
        self, definition_name: str, states: frozenset[OccurrenceState]
    ) -> Sequence[OccurrenceRow]:
        return [
            o.row()
            for o in self.occurrences_.values()
            if o.definition_name == definition_name and o.state in states
        ]

    async def delete_occurrences(
        self, states: frozenset[OccurrenceState], finished_before: datetime, limit: int
    ) -> int:
        doomed = sorted(
            (o.finished_at, o.due_at, o.definition_name, o.occurrence_id)
            for o in self.occurrences_.values()
            if o.state in states and o.finished_at is not None and o.finished_at < finished_before
        )[:limit]
        for *_, occurrence_id in doomed:
            del self.occurrences_[occurrence_id]
        return len(doomed)


class InMemoryRecurringStorage:
    """The engine's persistence port held in two dicts (the reference adapter).

    One transaction at a time (an :class:`asyncio.Lock` stands for the control row); a
    transaction works on copies of the dicts that replace the originals when the work
    returns, so a call that raises stores nothing.
    """

    def __init__(self) -> None:
        self.definitions: dict[str, _Definition] = {}
        self.occurrences: dict[str, _Occurrence] = {}
        self.recorded: datetime | None = None
        self.closed = False
        self._lock = asyncio.Lock()

    async def transaction(
        self, operation: str, work: Callable[[RecurringRepository], Awaitable[T]]
    ) -> T:
        """Run ``work`` on copies of the rows; keep them only if it returns.

        Raises:
            RecurringStorageError: the store is closed.
        """
        if self.closed:
            raise RecurringStorageError(f"{operation}: the store is closed")
        async with self._lock:
            state = NamespaceState(self.recorded, len(self.definitions), len(self.occurrences))
            repo = _Repository(state, dict(self.definitions), dict(self.occurrences))
            result = await work(repo)
            self.definitions = repo.definitions_
            self.occurrences = repo.occurrences_
            self.recorded = repo.recorded
            return result


@attrs.define(init=False, repr=False)
class InMemoryRecurringStore:
    """The reference :class:`steeple.core.ports.RecurringStore`, held in memory.

    :class:`InMemoryRecurringStorage` plus :class:`~steeple.engine.RecurringEngine`.

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
        if not isinstance(config, RecurringConfig):
            raise RecurringConfigurationError("config must be a RecurringConfig")
        self._config = config
        self._clock = clock
        self._storage = InMemoryRecurringStorage()
        self._engine = RecurringEngine(
            self._storage,
            config,
            sealer if sealer is not None else _Unsealed(),
            clock,
            random if random is not None else SystemRandom(),
        )

    @property
    def config(self) -> RecurringConfig:
        """The namespace configuration this store enforces."""
        return self._config

    @property
    def _occurrences(self) -> dict[str, _Occurrence]:
        # Tests reach in to look at (and tamper with) stored occurrences.
        return self._storage.occurrences

    @property
    def _definitions(self) -> dict[str, _Definition]:
        return self._storage.definitions

    def __repr__(self) -> str:
        return (
            f"InMemoryRecurringStore(namespace={self._config.namespace!r}, "
            f"definitions={len(self._definitions)}, occurrences={len(self._occurrences)})"
        )

    async def __aenter__(self) -> InMemoryRecurringStore:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the store; later calls raise :class:`RecurringStorageError`."""
        self._storage.closed = True

    # --- the contract: the engine's operations ----------------------------------------------

    async def create(self, definition: RecurringDefinition) -> ScheduleInfo:
        """Run :meth:`steeple.engine.RecurringEngine.create` (same results and errors)."""
        return await self._engine.create(definition)

    async def create_many(
        self, definitions: Sequence[RecurringDefinition]
    ) -> list[ScheduleInfo | RecurringConflictError]:
        """Run :meth:`steeple.engine.RecurringEngine.create_many` (same results and errors)."""
        return await self._engine.create_many(definitions)

    async def tick(self, budget: int) -> TickResult:
        """Run :meth:`steeple.engine.RecurringEngine.tick` (same results and errors)."""
        return await self._engine.tick(budget)

    async def claim(self, limit: int) -> list[Lease]:
        """Run :meth:`steeple.engine.RecurringEngine.claim` (same results and errors)."""
        return await self._engine.claim(limit)

    async def relay(self, lease: Lease, broker: MessageBroker) -> BrokerReceipt:
        """Run :meth:`steeple.engine.RecurringEngine.relay` (same results and errors)."""
        return await self._engine.relay(lease, broker)

    async def relay_many(
        self,
        leases: Sequence[Lease],
        broker: MessageBroker,
        *,
        concurrency: int = limits.RELAY_CONCURRENCY,
    ) -> list[RelayOutcome]:
        """Run :meth:`steeple.engine.RecurringEngine.relay_many` (same results and errors)."""
        return await self._engine.relay_many(leases, broker, concurrency=concurrency)

    async def claim_and_relay(
        self, limit: int, broker: MessageBroker, *, concurrency: int = limits.RELAY_CONCURRENCY
    ) -> list[RelayOutcome]:
        """Run :meth:`steeple.engine.RecurringEngine.claim_and_relay` (same results and errors)."""
        return await self._engine.claim_and_relay(limit, broker, concurrency=concurrency)

    async def cancel(self, name: str) -> ScheduleInfo:
        """Run :meth:`steeple.engine.RecurringEngine.cancel` (same results and errors)."""
        return await self._engine.cancel(name)

    async def retry_failed(self, occurrence_id: str) -> OccurrenceInfo:
        """Run :meth:`steeple.engine.RecurringEngine.retry_failed` (same results and errors)."""
        return await self._engine.retry_failed(occurrence_id)

    async def schedules(self, after: str | None = None, limit: int = 100) -> Page[ScheduleInfo]:
        """Run :meth:`steeple.engine.RecurringEngine.schedules` (same results and errors)."""
        return await self._engine.schedules(after, limit)

    async def occurrences(self, after: str | None = None, limit: int = 100) -> Page[OccurrenceInfo]:
        """Run :meth:`steeple.engine.RecurringEngine.occurrences` (same results and errors)."""
        return await self._engine.occurrences(after, limit)

    async def purge_terminal(self, older_than: datetime, limit: int = 100) -> int:
        """Run :meth:`steeple.engine.RecurringEngine.purge_terminal` (same results and errors)."""
        return await self._engine.purge_terminal(older_than, limit)
