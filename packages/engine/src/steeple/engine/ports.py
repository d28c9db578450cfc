"""The persistence port of the recurring engine: what a storage adapter implements.

Two protocols. :class:`RecurringStorage` runs one transaction on one namespace: it opens
the transaction, locks the namespace's control row (every operation of a namespace is
serialized through it), hands the engine a :class:`RecurringRepository` and commits when
the engine's work returns (rolls back when it raises). The repository reads and writes
rows, set-based, and decides nothing: every value it writes (states, instants, erasures,
capability digests, counters) was computed by the engine; every selection it makes is
spelled out here, parameterized by values from :mod:`steeple.core` (the claim rule, the
states a step applies to).

Rows are plain frozen values. Instants are aware UTC datetimes, kept to the microsecond.
Content is the sealed bytes the engine produced (an adapter never opens it).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime
from typing import Any, Final, Protocol, TypeVar

import attrs

from steeple.core._frozen import new, writable
from steeple.core.leases import ClaimRule
from steeple.core.occurrences import OccurrenceState, Step
from steeple.core.policies import MissedRunPolicy

__all__ = [
    "DefinitionRow",
    "DefinitionUpdate",
    "NamespaceOpening",
    "NamespaceState",
    "OccurrenceChange",
    "OccurrenceRow",
    "RecurringRepository",
    "RecurringStorage",
    "RepositoryWork",
    "ServerClockReading",
    "StoredNamespace",
    "apply_step",
    "pending_row",
]

T = TypeVar("T")


@attrs.frozen
class ServerClockReading:
    """The database server's clock, read by the statement that opened a unit of work.

    Attributes:
        at: the server's reading (PostgreSQL's ``clock_timestamp()``), aware UTC.
        sent: ``time.monotonic()`` on this host when the statement that read it was sent;
            the engine measures the round trip from it to its own clock reading.
    """

    at: datetime
    sent: float


@attrs.frozen(repr=False)
class NamespaceState:
    """The namespace's control row, as read under its lock.

    Attributes:
        recorded_time: the last shared time recorded (``None`` before the first call).
        definition_count: definitions stored (cancelled ones included).
        occurrence_count: occurrences stored (terminal ones until purged).
        binding: the sealed configuration binding, or ``None`` for an adapter that
            persists no configuration (in memory).
        binding_key_id: the key id the binding is sealed under (``None`` with no binding).
        server_clock: the database server's clock, read with the lock (``None`` for a
            store that has no server clock: SQLite, in memory).
    """

    recorded_time: datetime | None
    definition_count: int
    occurrence_count: int
    binding: bytes | None = None
    binding_key_id: str | None = None
    server_clock: ServerClockReading | None = None

    def __repr__(self) -> str:
        return (
            f"NamespaceState(recorded_time={self.recorded_time!r}, "
            f"definitions={self.definition_count}, occurrences={self.occurrence_count})"
        )


@attrs.frozen(repr=False, weakref_slot=False)
class DefinitionRow:
    """A stored recurring definition: sealed content plus plaintext scheduling metadata.

    Only the name, calendar, policy, ``first_after``, state and instants are plaintext;
    the topic, message type, headers and payload are inside ``sealed``.

    Attributes:
        name: the definition's name (unique in the namespace).
        sealed: the sealed definition document.
        key_id: the key id ``sealed`` is sealed under.
        cron: the calendar's expression, as given.
        policy: the missed-run policy.
        first_after: the exclusive start.
        state: a :class:`~steeple.core.records.ScheduleState` value.
        cursor: the exclusive tick cursor (``first_after`` before the first tick).
        next_due_at: the next due time; ``None`` once cancelled or exhausted.
        created_at: when it was created.
        cancelled_at: when it was cancelled, if it was.
    """

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

    def __repr__(self) -> str:
        return f"DefinitionRow(name={self.name!r}, state={self.state!r}, cron={self.cron!r})"


@attrs.frozen(weakref_slot=False)
class DefinitionUpdate:
    """New values of a definition's mutable columns (tick advancement, cancellation)."""

    name: str
    state: str
    cursor: datetime
    next_due_at: datetime | None
    cancelled_at: datetime | None

    @classmethod
    def built(
        cls,
        name: str,
        state: str,
        cursor: datetime,
        next_due_at: datetime | None,
        cancelled_at: datetime | None,
    ) -> DefinitionUpdate:
        """Return ``DefinitionUpdate(name, state, cursor, next_due_at, cancelled_at)``.

        Filled in as a plain object, then made a DefinitionUpdate (``steeple.core._frozen``):
        a tick writes one per definition.
        """
        update: Any = new(_WRITABLE_UPDATE)
        update.name = name
        update.state = state
        update.cursor = cursor
        update.next_due_at = next_due_at
        update.cancelled_at = cancelled_at
        update.__class__ = DefinitionUpdate
        return update  # type: ignore[no-any-return]  # a DefinitionUpdate, every field set

    def applied_to(self, row: DefinitionRow) -> DefinitionRow:
        """Return ``row`` with this update's columns (filled in as :meth:`built` is)."""
        built: Any = new(_WRITABLE_DEFINITION)
        built.name = row.name
        built.sealed = row.sealed
        built.key_id = row.key_id
        built.cron = row.cron
        built.policy = row.policy
        built.first_after = row.first_after
        built.state = self.state
        built.cursor = self.cursor
        built.next_due_at = self.next_due_at
        built.created_at = row.created_at
        built.cancelled_at = self.cancelled_at
        built.__class__ = DefinitionRow
        return built  # type: ignore[no-any-return]  # a DefinitionRow, every field set


_WRITABLE_DEFINITION: Final = writable(DefinitionRow)
_WRITABLE_UPDATE: Final = writable(DefinitionUpdate)


@attrs.frozen(repr=False, weakref_slot=False)
class OccurrenceRow:
    """A stored occurrence.

    Attributes:
        occurrence_id: 32 lowercase hex characters (its random generation).
        definition_name: the definition it was materialized from.
        due_at: its scheduled instant.
        state: where it is in the lifecycle.
        attempts: publication attempts made (reset by an operator retry).
        window_ends_at: the end of its delivery window.
        created_at: when it was materialized.
        updated_at: its last change (what purge cutoffs compare, with ``finished_at``).
        finished_at: when it became terminal; ``None`` while it is not.
        next_attempt_at: when a ``retry_wait`` occurrence may be claimed again.
        last_error: the type name of the last publication failure.
        lease_expires_at: when the current lease expires (only while ``leased``).
        lease_revision: bumped by every claim (fencing).
        lease_digest: SHA-256 of the current lease capability; ``None`` once spent.
        content: the sealed message; ``None`` once erased. Reads other than
            :meth:`RecurringRepository.occurrences` may leave it ``None`` (not loaded).
        key_id: the key id ``content`` is sealed under (``None`` once erased).
    """

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

    def __repr__(self) -> str:
        return (
            f"OccurrenceRow(occurrence_id={self.occurrence_id!r}, "
            f"definition_name={self.definition_name!r}, state={self.state.value!r})"
        )


@attrs.frozen(repr=False, weakref_slot=False)
class OccurrenceChange:
    """New values of one occurrence's mutable columns.

    Every field is written as given, except the content: it is erased (with its key id)
    when ``erase_content`` is true and left untouched otherwise.
    """

    occurrence_id: str
    state: OccurrenceState
    attempts: int
    next_attempt_at: datetime | None
    last_error: str | None
    lease_expires_at: datetime | None
    lease_revision: int
    lease_digest: bytes | None
    updated_at: datetime
    finished_at: datetime | None
    erase_content: bool = False

    def __repr__(self) -> str:
        return f"OccurrenceChange(occurrence_id={self.occurrence_id!r}, state={self.state.value!r})"

    @classmethod
    def of(cls, row: OccurrenceRow, **values: Any) -> OccurrenceChange:
        """Return a change that keeps ``row`` as it is except for ``values``."""
        columns: dict[str, Any] = {
            "occurrence_id": row.occurrence_id,
            "state": row.state,
            "attempts": row.attempts,
            "next_attempt_at": row.next_attempt_at,
            "last_error": row.last_error,
            "lease_expires_at": row.lease_expires_at,
            "lease_revision": row.lease_revision,
            "lease_digest": row.lease_digest,
            "updated_at": row.updated_at,
            "finished_at": row.finished_at,
        }
        # One construction (not a copy evolved): this runs for every write of every relay.
        return cls(**(columns | values if values else columns))

    def applied_to(self, row: OccurrenceRow) -> OccurrenceRow:
        """Return ``row`` as it is after this change."""
        erased = self.erase_content
        # Filled in as a plain object, then made an OccurrenceRow (steeple.core._frozen):
        # this runs for every write of every relay.
        built: Any = new(_WRITABLE_ROW)
        built.occurrence_id = row.occurrence_id
        built.definition_name = row.definition_name
        built.due_at = row.due_at
        built.state = self.state
        built.attempts = self.attempts
        built.window_ends_at = row.window_ends_at
        built.created_at = row.created_at
        built.updated_at = self.updated_at
        built.finished_at = self.finished_at
        built.next_attempt_at = self.next_attempt_at
        built.last_error = self.last_error
        built.lease_expires_at = self.lease_expires_at
        built.lease_revision = self.lease_revision
        built.lease_digest = self.lease_digest
        built.content = None if erased else row.content
        built.key_id = None if erased else row.key_id
        built.__class__ = OccurrenceRow
        return built  # type: ignore[no-any-return]  # an OccurrenceRow, every field set


_WRITABLE_ROW: Final = writable(OccurrenceRow)


def pending_row(
    occurrence_id: str,
    definition_name: str,
    due_at: datetime,
    window_ends_at: datetime,
    now: datetime,
    content: bytes,
    key_id: str,
) -> OccurrenceRow:
    """Return the row of an occurrence a tick materializes at ``now``, unchecked.

    For the engine only: every value is one the tick checked or built; the row is the
    one ``OccurrenceRow(...)`` builds from them (a test requires both to be equal).
    """
    # Filled in as a plain object, then made an OccurrenceRow (steeple.core._frozen):
    # a tick builds one per occurrence.
    built: Any = new(_WRITABLE_ROW)
    built.occurrence_id = occurrence_id
    built.definition_name = definition_name
    built.due_at = due_at
    built.state = _PENDING
    built.attempts = 0
    built.window_ends_at = window_ends_at
    built.created_at = now
    built.updated_at = now
    built.finished_at = None
    built.next_attempt_at = None
    built.last_error = None
    built.lease_expires_at = None
    built.lease_revision = 0
    built.lease_digest = None
    built.content = content
    built.key_id = key_id
    built.__class__ = OccurrenceRow
    return built  # type: ignore[no-any-return]  # an OccurrenceRow, every field set


_PENDING: Final = OccurrenceState.PENDING
_WRITABLE_CHANGE: Final = writable(OccurrenceChange)
_CHANGE_FIELDS: Final = tuple(field.name for field in attrs.fields(OccurrenceChange))
"""The columns a change sets (OccurrenceChange's fields, in order)."""


def apply_step(
    row: OccurrenceRow, step: Step, at: datetime, *, attempted: bool = False, **values: Any
) -> OccurrenceChange:
    """Return the change that moves ``row`` by one row of the lifecycle table at ``at``.

    The one place where a step's effects become column values: every adapter writes
    what this returns.

    The step's effects are applied (content and lease erased, ``finished_at`` stamped or
    cleared, attempts reset, error cleared, lease expiry and next attempt cleared outside
    ``leased`` / ``retry_wait``); ``attempted`` also counts a relay attempt (a claim
    that relays what it leased counts it in the same write); ``values`` then set what
    the engine decided besides (a new lease, the next attempt, the error).

    Raises:
        ValueError: the step removes the row (purging deletes instead).
        TypeError: a value names no column of :class:`OccurrenceChange`.
    """
    target = step.target
    if not isinstance(target, OccurrenceState):
        raise ValueError("a purge removes the row; it is not a change")
    effects = step.effects
    stamp = at if effects.stamps else row.updated_at
    # Filled in as a plain object, then made an OccurrenceChange (steeple.core._frozen):
    # this runs for every write of every relay.
    change: Any = new(_WRITABLE_CHANGE)
    change.occurrence_id = row.occurrence_id
    change.state = target
    change.attempts = (0 if effects.reopens else row.attempts) + attempted
    change.next_attempt_at = None if step.clears_next_attempt else row.next_attempt_at
    change.last_error = None if effects.clears_error else row.last_error
    change.lease_expires_at = None if step.ends_lease else row.lease_expires_at
    change.lease_revision = row.lease_revision
    change.lease_digest = None if effects.erase_lease else row.lease_digest
    change.updated_at = stamp
    if effects.finishes:
        change.finished_at = stamp
    else:
        change.finished_at = None if effects.reopens else row.finished_at
    change.erase_content = effects.erase_content
    for name, value in values.items():
        if name not in _CHANGE_FIELDS:
            raise TypeError(f"an occurrence change has no column {name!r}")
        setattr(change, name, value)
    change.__class__ = OccurrenceChange
    return change  # type: ignore[no-any-return]  # an OccurrenceChange, every field set


class RecurringRepository(Protocol):
    """The rows of one namespace, inside one transaction that holds its control row.

    Every method reads or writes rows of this namespace only and decides nothing.
    Ordering is part of each read's contract (stores must agree on it).
    """

    @property
    def namespace(self) -> NamespaceState:
        """The control row as read when the transaction locked it."""
        ...

    async def record_namespace(
        self, recorded_time: datetime, definition_delta: int, occurrence_delta: int
    ) -> None:
        """Write the shared time and add the deltas to the counters.

        The engine's last call in each transaction. An adapter that counts rows on read
        may ignore the deltas.
        """
        ...

    async def reseal_binding(self, binding: bytes, key_id: str) -> None:
        """Replace the sealed configuration binding (after a key rotation)."""
        ...

    # --- definitions ---------------------------------------------------------------------

    async def definition(self, name: str) -> DefinitionRow | None:
        """Return the definition named ``name``, or ``None``."""
        ...

    async def definitions(self, after: str | None, limit: int) -> Sequence[DefinitionRow]:
        """Return at most ``limit`` definitions named after ``after``, by name."""
        ...

    async def due_definitions(self, due_by: datetime, limit: int) -> Sequence[DefinitionRow]:
        """Return at most ``limit`` definitions due by ``due_by``.

        Due: ``next_due_at`` at or before ``due_by``; ordered by ``(next_due_at, name)``.
        """
        ...

    async def definitions_named(self, names: Sequence[str]) -> Sequence[DefinitionRow]:
        """Return the definitions with these names that exist (any order)."""
        ...

    async def insert_definitions(self, rows: Sequence[DefinitionRow]) -> None:
        """Store new definitions (their names are not stored yet, and distinct)."""
        ...

    async def update_definitions(self, updates: Sequence[DefinitionUpdate]) -> None:
        """Write each update's columns onto the definition of that name."""
        ...

    # --- occurrences ---------------------------------------------------------------------

    async def occurrences(self, ids: Sequence[str]) -> Sequence[OccurrenceRow]:
        """Return the occurrences with these ids that exist, content included (any order)."""
        ...

    async def occurrence_page(
        self, after: tuple[datetime, str] | None, limit: int
    ) -> Sequence[OccurrenceRow]:
        """Return at most ``limit`` occurrences after the position ``(due_at, id)``.

        Ordered by ``(due_at, occurrence_id)``; content need not be loaded.
        """
        ...

    async def claimable(
        self, rule: ClaimRule, now: datetime, limit: int
    ) -> Sequence[OccurrenceRow]:
        """Return at most ``limit`` occurrences that ``rule.admits`` at ``now``.

        Admitted: the window has not ended, and the state is one of ``rule.ready``, or of
        ``rule.after_next_attempt`` with ``next_attempt_at <= now``, or of
        ``rule.after_lease_expiry`` with ``lease_expires_at <= now``. Ordered by
        ``(due_at, definition_name, occurrence_id)``; content need not be loaded.
        """
        ...

    async def insert_occurrences(self, rows: Sequence[OccurrenceRow]) -> None:
        """Store new occurrences (their ids and ``(definition_name, due_at)`` are new)."""
        ...

    async def update_occurrences(self, changes: Sequence[OccurrenceChange]) -> None:
        """Write each change onto the occurrence with its id (see :class:`OccurrenceChange`)."""
        ...

    async def window_ended(
        self, states: frozenset[OccurrenceState], ended_by: datetime
    ) -> Sequence[OccurrenceRow]:
        """Return the occurrences in ``states`` whose window ended by ``ended_by``.

        Ended: ``window_ends_at`` at or before ``ended_by``; any order; content need not
        be loaded.
        """
        ...

    async def occurrences_of(
        self, definition_name: str, states: frozenset[OccurrenceState]
    ) -> Sequence[OccurrenceRow]:
        """Return the occurrences of ``definition_name`` in ``states``.

        Any order; content need not be loaded.
        """
        ...

    async def delete_occurrences(
        self, states: frozenset[OccurrenceState], finished_before: datetime, limit: int
    ) -> int:
        """Delete at most ``limit`` finished occurrences; return how many.

        Those in ``states`` with ``finished_at`` before ``finished_before``, oldest
        ``(finished_at, due_at, definition_name, occurrence_id)`` first.
        """
        ...


RepositoryWork = Callable[[RecurringRepository], Awaitable[T]]
"""What one transaction runs: the engine's work over the repository, returning its result."""


class RecurringStorage(Protocol):
    """Runs the engine's work in one transaction on one namespace."""

    async def transaction(self, operation: str, work: RepositoryWork[T]) -> T:
        """Run ``work`` in one transaction that holds the namespace's control row.

        Open a transaction, lock the control row, await ``work(repository)`` and commit;
        roll back if it raises.

        ``operation`` names the call in error messages. The adapter maps its driver's
        failures to :class:`~steeple.core.errors.RecurringStorageError` (deadlines to
        :class:`~steeple.core.errors.RecurringDeadlineError`), lets the engine's own
        errors through unchanged, and may retry ``work`` only if it was never called.

        Raises:
            RecurringNotFoundError: the namespace does not exist.
            RecurringStorageError: the storage failed or is closed; nothing was committed
                (or, for a failed COMMIT, the outcome is unknown).
        """
        ...


@attrs.frozen(repr=False)
class StoredNamespace:
    """What opening a namespace reads of it: its configuration binding and shared time.

    Attributes:
        binding: the sealed configuration binding.
        recorded_time: the last shared time recorded (``None`` before the first call).
    """

    binding: bytes
    recorded_time: datetime | None

    def __repr__(self) -> str:
        return f"StoredNamespace(recorded_time={self.recorded_time!r})"


class NamespaceOpening(Protocol):
    """What the open sequence reads and writes in a store, inside one unit of the store's.

    A store's ``initialize`` and ``connect`` first do what is their own (create or migrate
    the schema, check durability, files, privileges), then hand one of these to
    :func:`~steeple.engine.opening.install_namespace` or
    :func:`~steeple.engine.opening.open_namespace`, which decide the rest. A capability of
    a store that opening may use (reading the database server's clock, say) is a method
    here, and its rule a step of that sequence.
    """

    @property
    def schema(self) -> str:
        """Where the store keeps its tables, as errors name it (a schema, a file's path)."""
        ...

    @property
    def schema_version(self) -> int:
        """The schema version this store's code reads and writes."""
        ...

    async def stored_version(self) -> object:
        """Return the schema version the store holds (``None`` when none is recorded)."""
        ...

    async def namespace(self) -> StoredNamespace | None:
        """Return the namespace's binding and shared time, or ``None`` if it does not exist."""
        ...

    async def insert_namespace(self, binding: bytes, key_id: str, now: datetime) -> None:
        """Create the namespace with its sealed binding, ``now`` as its shared time."""
        ...

    async def server_clock(self) -> ServerClockReading | None:
        """Read the database server's clock, or return ``None`` for a store without one.

        A store whose database runs on this host or in this process (SQLite, in memory)
        has no clock but the host's, and returns ``None``: its host's clock goes unjudged.
        """
        ...
