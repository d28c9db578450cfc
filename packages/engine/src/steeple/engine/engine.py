"""The recurring engine: every recurring-publication operation, once, over the persistence port.

Each call is one transaction (:meth:`RecurringStorage.transaction`) that holds the
namespace's control row. Inside it the engine reads the clock only after the lock was
granted (time spent queued behind other instances is never judged as earlier), adopts
the shared time through :func:`steeple.core.leases.adopt_time`, checks the configuration
binding, does the operation's reads, decisions (all in :mod:`steeple.core`) and writes,
and records the shared time re-read just before the commit. Calls that hand out
time-bounded work (``claim``, ``relay``) judge it once more after the commit.

A relay is three steps: a transaction that re-checks the live lease and counts the
attempt; the publication (the content opened after that commit), outside any
transaction, bounded by the remaining lease and 10 s; a transaction that records the
outcome, fenced by the lease's capability and revision. Whatever the broker raises is classified
(:func:`steeple.core.publication.classify_publication_failure`) and recorded, so no
broker can leave an occurrence leased; when the broker accepted and recording the
outcome fails, the caller gets :class:`RelayAcknowledgementError` carrying the receipt.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
from collections.abc import Awaitable, Callable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import TypeVar

import attrs

from steeple.core import limits
from steeple.core.calendar import CronCalendar
from steeple.core.config import RecurringConfig, RecurringDefinition, is_definition_name
from steeple.core.entropy import SystemRandom
from steeple.core.errors import (
    InvalidTransitionError,
    KeyringError,
    RecurringCapacityError,
    RecurringConfigurationError,
    RecurringConflictError,
    RecurringError,
    RecurringInvalidStateError,
    RecurringKeyringError,
    RecurringNotFoundError,
    RecurringStorageError,
    RelayAcknowledgementError,
    RelayLeaseLostError,
    SteepleError,
    recurring_keyring_error,
    shown,
)
from steeple.core.idempotency import PUBLISH_PURPOSE, idempotency_key
from steeple.core.leases import (
    CLAIM_RULE,
    adopt_time,
    after_publish_failure,
    capability_digest,
    holds_lease,
    is_live,
    lease_expiry,
    new_capability,
    new_generation,
    occurrence_id_for,
    window_end,
)
from steeple.core.messages import BrokerReceipt, ScheduledMessage
from steeple.core.occurrences import OccurrenceEvent, OccurrenceState, states_for, step
from steeple.core.policies import DueDefinition, plan_namespace_tick, validate_budget
from steeple.core.ports import Clock, MessageBroker, RandomSource, Sealer
from steeple.core.publication import (
    FailureKind,
    PublicationFailure,
    classify_publication_failure,
    publication_error,
)
from steeple.core.records import (
    Lease,
    OccurrenceInfo,
    Page,
    RelayOutcome,
    ScheduleInfo,
    ScheduleState,
    TickResult,
    trusted_lease,
    trusted_outcome,
    validate_occurrence_id,
)
from steeple.engine import codec
from steeple.engine.binding import seal_binding, verify_binding
from steeple.engine.crashpoints import crash_point
from steeple.engine.opening import read_clock, recurring_errors
from steeple.engine.ports import (
    DefinitionRow,
    DefinitionUpdate,
    OccurrenceChange,
    OccurrenceRow,
    RecurringRepository,
    RecurringStorage,
    apply_step,
)

__all__ = ["PURPOSE_DEFINITION", "PURPOSE_OCCURRENCE", "RecurringEngine"]

T = TypeVar("T")

PURPOSE_DEFINITION = "definition"
"""The sealing purpose of definitions (identity: the definition's name)."""
PURPOSE_OCCURRENCE = "occurrence"
"""The sealing purpose of occurrence content (identity: the occurrence id)."""

_E = OccurrenceEvent
_PURGEABLE = frozenset().union(*states_for(_E.PURGE).values())


@functools.lru_cache(maxsize=1024)
def _calendar(expression: str) -> CronCalendar:
    # Parsing is pure and the expressions of a namespace repeat on every tick.
    return CronCalendar.parse(expression)


def _is_occurrence_id(value: object) -> bool:
    """Whether ``value`` has an occurrence id's shape (core's rule, shared with the admin app)."""
    try:
        validate_occurrence_id(value)
    except RecurringConfigurationError:
        return False
    return True


def _same_definition(
    stored: RecurringDefinition, definition: RecurringDefinition, content: bytes
) -> bool:
    """Whether ``definition`` replays ``stored`` (``content``: its encoded message).

    The calendar is compared by meaning (``*/1`` is ``*``); the content in constant time.
    """
    return (
        stored.name == definition.name
        and stored.cron == definition.cron
        and stored.first_after == definition.first_after
        and stored.policy is definition.policy
        and hmac.compare_digest(codec.encode_message(stored.message), content)
    )


@attrs.define
class _Tx:
    """One locked transaction as the engine sees it.

    The repository, the adopted time and the counter changes to record.
    """

    repo: RecurringRepository
    now: datetime
    definition_count: int
    occurrence_count: int
    definition_delta: int = 0
    occurrence_delta: int = 0


@attrs.frozen(repr=False)
class _Checked:
    """A lease that passed the relay's check, with its occurrence's sealed content."""

    lease: Lease
    content: bytes | None
    definition_name: str
    due_at: datetime
    expires_at: datetime


@attrs.frozen(repr=False)
class _Prepared:
    """A checked lease, opened: what to publish, under which key, until when."""

    lease: Lease
    message: ScheduledMessage
    key: str
    expires_at: datetime


@attrs.frozen(repr=False)
class _Attempt:
    """Relay step two for one lease: the receipt, the classified failure, or no attempt."""

    receipt: BrokerReceipt | None = None
    failure: PublicationFailure | None = None
    raised: BaseException | None = None
    error: SteepleError | None = None
    """Set when nothing was published (the lease lapsed before the publication started)."""
    unsent: bool = False
    """The lease lapsed while waiting for its turn: nothing was sent, so the attempt the
    check counted is given back (if the lease is still the latest)."""
    unopenable: SteepleError | None = None
    """Set when the content cannot be opened: nothing was published, a dead letter."""


_Error = TypeVar("_Error", bound=BaseException)


def _caused(error: _Error, cause: BaseException) -> _Error:
    """Return ``error`` with ``cause`` as its ``__cause__`` (``raise error from cause``)."""
    error.__cause__ = cause
    error.__suppress_context__ = True
    return error


@attrs.define(repr=False)
class RecurringEngine:
    """Every recurring-publication operation of one namespace, over a :class:`RecurringStorage`.

    A store composes one: ``RecurringEngine(storage, config, sealer, clock)`` and
    forwards the public calls. The engine holds no connection and no state of its own.

    Its arguments, in order (attrs keeps them private, so they are listed here):

    - ``storage``: the adapter (PostgreSQL, SQLite, in memory, yours).
    - ``config``: the namespace's configuration (quotas, delivery window, lease).
    - ``sealer``: seals and opens definitions and content (a
      :class:`steeple.keyring.Keyring`).
    - ``clock``: where time comes from (``SystemClock`` in production).
    - ``random``: capabilities, generations and jitter (the OS's randomness by default).

    Raises:
        RecurringConfigurationError: an argument of the wrong kind.
    """

    _storage: RecurringStorage
    _config: RecurringConfig
    _sealer: Sealer
    _clock: Clock
    _random: RandomSource = attrs.field(factory=SystemRandom)
    _verified_binding: bytes | None = attrs.field(default=None, init=False)

    def __attrs_post_init__(self) -> None:
        if not isinstance(self._config, RecurringConfig):
            raise RecurringConfigurationError("config must be a RecurringConfig")
        if not all(callable(getattr(self._sealer, m, None)) for m in ("seal", "open")):
            raise RecurringConfigurationError("sealer must implement the Sealer protocol")
        if not callable(getattr(self._clock, "now", None)):
            raise RecurringConfigurationError("clock must implement the Clock protocol")
        if not callable(getattr(self._storage, "transaction", None)):
            raise RecurringConfigurationError("storage must implement RecurringStorage")

    def __repr__(self) -> str:
        return f"RecurringEngine(namespace={self._config.namespace!r})"

    @property
    def config(self) -> RecurringConfig:
        """The namespace's configuration."""
        return self._config

    # --- the transaction every call runs in ----------------------------------------------

    async def _run(
        self, what: str, body: Callable[[_Tx], Awaitable[T]], *, points: str | None = None
    ) -> tuple[T, datetime]:
        """Run ``body`` in one locked transaction; return its result and the recorded time.

        ``points`` names the crash points of the transaction's steps (``<points>.begin``,
        ``.written`` and ``.committed``; see :mod:`steeple.engine.crashpoints`).
        """

        async def work(repo: RecurringRepository) -> tuple[T, datetime]:
            state = repo.namespace
            # The clock is read only now, after the lock was granted.
            now = adopt_time(state.recorded_time, read_clock(self._clock))
            if state.binding is not None:
                if state.binding != self._verified_binding:
                    # The same sealed bytes, opened with the same keyring for the same
                    # configuration, verify the same way: opened once per distinct value.
                    verify_binding(self._sealer, self._config, state.binding)
                    self._verified_binding = bytes(state.binding)
                if state.binding_key_id != self._sealer.primary_key_id:
                    # First operation after a rotation: re-seal under the current primary
                    # so the initial key is no longer needed for the binding.
                    binding = self._seal_with(
                        lambda: seal_binding(self._sealer, self._config), "the binding"
                    )
                    await repo.reseal_binding(binding, self._sealer.primary_key_id)
            tx = _Tx(repo, now, state.definition_count, state.occurrence_count)
            result = await body(tx)
            # Re-checked around the commit: the recorded time includes the time spent in
            # this transaction, and never moves backwards.
            recorded = adopt_time(now, read_clock(self._clock))
            await repo.record_namespace(recorded, tx.definition_delta, tx.occurrence_delta)
            if points is not None:
                crash_point(points + ".written")
            return result, recorded

        with recurring_errors(what):
            if points is None:
                return await self._storage.transaction(what, work)
            crash_point(points + ".begin")
            done = await self._storage.transaction(what, work)
            crash_point(points + ".committed")
            return done

    def _seal_with(self, seal: Callable[[], bytes], record: str) -> bytes:
        try:
            return seal()
        except KeyringError as exc:
            raise recurring_keyring_error(exc, record) from exc

    def _seal(self, plaintext: bytes, purpose: str, identity: str, record: str) -> bytes:
        try:
            return self._sealer.seal(
                plaintext, namespace=self._config.namespace, purpose=purpose, identity=identity
            )
        except KeyringError as exc:
            raise recurring_keyring_error(exc, record) from exc

    def _open(self, sealed: bytes, purpose: str, identity: str, record: str) -> bytes:
        try:
            return self._sealer.open(
                bytes(sealed),
                namespace=self._config.namespace,
                purpose=purpose,
                identity=identity,
            )
        except KeyringError as exc:
            raise recurring_keyring_error(exc, record) from exc

    def _open_definition(self, row: DefinitionRow) -> RecurringDefinition:
        return codec.decode_definition(
            self._open(row.sealed, PURPOSE_DEFINITION, row.name, f"definition {row.name!r}")
        )

    def _schedule_info(self, row: DefinitionRow) -> ScheduleInfo:
        return codec.schedule_info(row, self._open_definition(row).message)

    async def _classify_expired(self, tx: _Tx) -> None:
        """Classify work whose delivery window ended as expired (content erased).

        Each is stamped at its own window end: an expired occurrence's last update is the
        instant it expired, however late it is noticed.
        """
        changes = [
            apply_step(row, expiry, row.window_ends_at)
            for expiry, states in states_for(_E.WINDOW_EXPIRED).items()
            for row in await tx.repo.window_ended(states, tx.now)
        ]
        if changes:
            await tx.repo.update_occurrences(changes)

    # --- definitions ---------------------------------------------------------------------

    async def create(self, definition: RecurringDefinition) -> ScheduleInfo:
        """Create an immutable definition, or replay an identical earlier creation.

        A batch of one: :meth:`create_many` with ``[definition]``, a conflict raised.

        Returns:
            The definition's metadata (the original metadata on a replay).

        Raises:
            RecurringConfigurationError: ``definition`` is not a RecurringDefinition.
            RecurringConflictError: the name exists (active or cancelled) with a different
                definition.
            RecurringCapacityError: the namespace holds ``max_definitions`` already.
            RecurringKeyringError: the stored definition cannot be opened (e.g. its key is
                missing: also an ``UnknownKeyIdError`` naming the key id).
            RecurringStorageError: the storage failed.
            RecurringDeadlineError: a storage deadline passed.
            RecurringClockError: the clock trails the recorded time by more than 5 s.
        """
        if not isinstance(definition, RecurringDefinition):
            raise RecurringConfigurationError("create needs a RecurringDefinition")
        [result] = await self.create_many([definition])
        if isinstance(result, RecurringConflictError):
            raise result
        return result

    async def create_many(
        self, definitions: Sequence[RecurringDefinition]
    ) -> list[ScheduleInfo | RecurringConflictError]:
        """Create up to 100 definitions in one transaction; each judged as :meth:`create`.

        Each definition is created, replays an identical stored one (or an identical
        earlier entry of the same batch), or conflicts with a different one of its name;
        a conflict is that entry's result and does not stop the others. The quota holds
        for the batch as a whole: if the new definitions do not all fit, none is created.

        Returns:
            One result per definition, in the order given: its metadata (the original
            metadata on a replay), or the :class:`RecurringConflictError` a single
            :meth:`create` raises.

        Raises:
            RecurringConfigurationError: ``definitions`` is not a sequence of at most 100
                RecurringDefinitions.
            RecurringCapacityError: the new definitions of the batch would exceed
                ``max_definitions``; nothing was created.
            RecurringKeyringError: a stored definition cannot be opened (e.g. its key is
                missing: also an ``UnknownKeyIdError`` naming the key id).
            RecurringStorageError: the storage failed.
            RecurringDeadlineError: a storage deadline passed.
            RecurringClockError: the clock trails the recorded time by more than 5 s.
        """
        if not isinstance(definitions, Sequence):
            raise RecurringConfigurationError("create_many needs a sequence of definitions")
        if len(definitions) > limits.MAX_BATCH:
            raise RecurringConfigurationError(
                f"create_many takes at most {limits.MAX_BATCH} definitions; got {len(definitions)}"
            )
        if not all(isinstance(d, RecurringDefinition) for d in definitions):
            raise RecurringConfigurationError("create_many needs RecurringDefinitions")
        if not definitions:
            return []
        # Encoded outside the transaction: the control row is held for storage work only.
        contents = [codec.encode_message(d.message) for d in definitions]
        documents: dict[str, bytes] = {}  # the first entry of a name is the one created
        for d in definitions:
            documents.setdefault(d.name, codec.encode_definition(d))

        async def body(tx: _Tx) -> list[ScheduleInfo | RecurringConflictError]:
            names = list(dict.fromkeys(d.name for d in definitions))
            stored = {
                row.name: (row, self._open_definition(row))
                for row in await tx.repo.definitions_named(names)
            }
            new: dict[str, RecurringDefinition] = {}
            for definition in definitions:
                if definition.name not in stored:
                    new.setdefault(definition.name, definition)
            if new and tx.definition_count + len(new) > self._config.max_definitions:
                raise RecurringCapacityError(
                    f"namespace {self._config.namespace!r} holds {tx.definition_count} "
                    f"definitions (cancelled ones included); {len(new)} more would exceed "
                    f"its quota of {self._config.max_definitions}; nothing was created"
                )
            created = {
                name: self._definition_row(d, documents[name], tx.now) for name, d in new.items()
            }
            if created:
                await tx.repo.insert_definitions(list(created.values()))
                tx.definition_delta = len(created)
            stored |= {name: (created[name], d) for name, d in new.items()}
            results: list[ScheduleInfo | RecurringConflictError] = []
            for definition, content in zip(definitions, contents, strict=True):
                row, existing = stored[definition.name]
                if _same_definition(existing, definition, content):
                    results.append(codec.schedule_info(row, existing.message))
                else:
                    results.append(
                        RecurringConflictError(
                            f"definition {definition.name!r} already exists with different "
                            "content; definitions are immutable: cancel it and create a new "
                            "name"
                        )
                    )
            return results

        return (await self._run("create", body))[0]

    def _definition_row(
        self, definition: RecurringDefinition, document: bytes, now: datetime
    ) -> DefinitionRow:
        """Return the row that stores a new ``definition`` (``document``: its encoding)."""
        name = definition.name
        return DefinitionRow(
            name=name,
            sealed=self._seal(document, PURPOSE_DEFINITION, name, f"definition {name!r}"),
            key_id=self._sealer.primary_key_id,
            cron=definition.cron.expression,
            policy=definition.policy,
            first_after=definition.first_after,
            state=ScheduleState.ACTIVE,
            cursor=definition.first_after,
            next_due_at=definition.first_due,
            created_at=now,
        )

    async def cancel(self, name: str) -> ScheduleInfo:
        """Cancel a definition permanently; its name stays reserved and counts to the quota.

        Its unfinished occurrences are cancelled and their content erased at once. A
        publication already in flight cannot be recalled. Cancelling twice is a no-op.

        Raises:
            RecurringConfigurationError: ``name`` is not a str.
            RecurringNotFoundError: no definition of that name in this namespace.
            RecurringKeyringError: the definition cannot be opened for its metadata.
            RecurringStorageError: the storage failed.
            RecurringDeadlineError: a storage deadline passed.
            RecurringClockError: the clock trails the recorded time by more than 5 s.
        """
        if not isinstance(name, str):
            raise RecurringConfigurationError("a definition name is a str")

        async def body(tx: _Tx) -> ScheduleInfo:
            # A name no definition can have is not looked up (nor sent to a database).
            row = await tx.repo.definition(name) if is_definition_name(name) else None
            if row is None:
                raise RecurringNotFoundError(
                    f"no definition named {shown(name)} in namespace {self._config.namespace!r}"
                )
            # Work whose window already ended is expired, not cancelled.
            await self._classify_expired(tx)
            info = self._schedule_info(row)
            if row.state == ScheduleState.CANCELLED:
                return info
            update = DefinitionUpdate(name, ScheduleState.CANCELLED, row.cursor, None, tx.now)
            await tx.repo.update_definitions([update])
            changes = [
                apply_step(row, cancellation, tx.now)
                for cancellation, states in states_for(_E.CANCEL).items()
                for row in await tx.repo.occurrences_of(name, states)
            ]
            if changes:
                await tx.repo.update_occurrences(changes)
            return attrs.evolve(
                info, state=update.state, next_due_at=None, cancelled_at=update.cancelled_at
            )

        return (await self._run("cancel", body))[0]

    async def schedules(self, after: str | None = None, limit: int = 100) -> Page[ScheduleInfo]:
        """List definitions' metadata by name, after the exclusive cursor ``after``.

        Raises:
            RecurringConfigurationError: ``limit`` outside 1..100, or a cursor that is not
                a name this store returned.
            RecurringKeyringError: a listed definition cannot be opened for its metadata.
            RecurringStorageError: the storage failed.
            RecurringDeadlineError: a storage deadline passed.
            RecurringClockError: the clock trails the recorded time by more than 5 s.
        """
        limit = validate_budget(limit, "limit")
        if after is not None and not is_definition_name(after):
            # Cursors are names this store returned; anything else is refused up front.
            raise RecurringConfigurationError(
                "invalid schedules cursor: pass back a next_cursor this store returned"
            )

        async def body(tx: _Tx) -> Page[ScheduleInfo]:
            rows = await tx.repo.definitions(after, limit + 1)
            items = [self._schedule_info(r) for r in rows[:limit]]
            more = len(rows) > limit
            return Page(items=items, next_cursor=items[-1].name if more else None)

        return (await self._run("schedules", body))[0]

    # --- tick ----------------------------------------------------------------------------

    async def tick(self, budget: int) -> TickResult:
        """Materialize due occurrences, oldest first across definitions, at most ``budget``.

        Materialization and cursor advancement commit together; when the occurrence
        quota cannot hold the whole batch, nothing is stored.

        Raises:
            RecurringConfigurationError: ``budget`` outside 1..100.
            RecurringCapacityError: the batch would exceed ``max_occurrences``.
            RecurringKeyringError: a due definition cannot be opened (its key is missing or
                it was tampered with).
            RecurringStorageError: the storage failed.
            RecurringDeadlineError: a storage deadline passed.
            RecurringClockError: the clock trails the recorded time by more than 5 s.
        """
        budget = validate_budget(budget)

        async def body(tx: _Tx) -> TickResult:
            rows = {r.name: r for r in await tx.repo.due_definitions(tx.now, budget)}
            plan = plan_namespace_tick(
                (
                    DueDefinition(r.name, r.policy, _calendar(r.cron), r.cursor, r.next_due_at)
                    for r in rows.values()
                ),
                tx.now,
                budget,
            )
            if tx.occurrence_count + len(plan.emitted) > self._config.max_occurrences:
                raise RecurringCapacityError(
                    f"materializing {len(plan.emitted)} occurrences would exceed the quota of "
                    f"{self._config.max_occurrences} ({tx.occurrence_count} stored); nothing "
                    "was materialized: tick a smaller budget or purge terminal occurrences"
                )
            messages: dict[str, bytes] = {}
            created: list[OccurrenceRow] = []
            window = window_end(tx.now, self._config.delivery_window)
            for name, due in plan.emitted:
                if name not in messages:
                    opened = self._open(
                        rows[name].sealed, PURPOSE_DEFINITION, name, f"definition {name!r}"
                    )
                    messages[name] = codec.definition_message_plaintext(opened)
                occurrence_id = occurrence_id_for(new_generation(self._random))
                created.append(
                    OccurrenceRow(
                        occurrence_id=occurrence_id,
                        definition_name=name,
                        due_at=due,
                        state=OccurrenceState.PENDING,
                        attempts=0,
                        window_ends_at=window,
                        created_at=tx.now,
                        updated_at=tx.now,
                        content=self._seal(
                            messages[name],
                            PURPOSE_OCCURRENCE,
                            occurrence_id,
                            f"occurrence {occurrence_id}",
                        ),
                        key_id=self._sealer.primary_key_id,
                    )
                )
            if created:
                await tx.repo.insert_occurrences(created)
                crash_point("tick.inserted")
            if plan.advanced:
                await tx.repo.update_definitions(
                    [
                        DefinitionUpdate(
                            name=a.name,
                            state=ScheduleState.EXHAUSTED if a.exhausted else ScheduleState.ACTIVE,
                            cursor=a.cursor,
                            next_due_at=None if a.exhausted else a.next_due,
                            cancelled_at=None,
                        )
                        for a in plan.advanced
                    ]
                )
            tx.occurrence_delta = len(created)
            return TickResult(
                materialized=len(created),
                occurrence_ids=tuple(o.occurrence_id for o in created),
                exhausted=plan.exhausted,
            )

        return (await self._run("tick", body, points="tick"))[0]

    # --- claim ---------------------------------------------------------------------------

    async def claim(self, limit: int) -> list[Lease]:
        """Lease up to ``limit`` (1-100) publishable occurrences, oldest due first.

        Each lease gets a fresh random capability and the next revision, fencing any
        earlier holder, and ends no later than the delivery window. Expired work is
        classified (and its content erased) first. Leases already expired when the claim
        commits are not returned (they are reclaimed normally) and do not fail the batch.

        Raises:
            RecurringConfigurationError: ``limit`` outside 1..100.
            RecurringStorageError: the storage failed.
            RecurringDeadlineError: a storage deadline passed.
            RecurringClockError: the clock trails the recorded time by more than 5 s.
        """
        limit = validate_budget(limit, "limit")

        async def body(tx: _Tx) -> list[Lease]:
            granted, changes = await self._grant(tx, limit)
            if changes:
                await tx.repo.update_occurrences(changes)
            return granted

        granted, recorded = await self._run("claim", body, points="claim")
        # Judged after the commit: a lease that lapsed while the claim committed is not
        # handed out; its occurrence stays claimable for the next claim.
        after = max(recorded, read_clock(self._clock))
        return [lease for lease in granted if is_live(lease.expires_at, after)]

    async def _grant(self, tx: _Tx, limit: int) -> tuple[list[Lease], list[OccurrenceChange]]:
        """Claim's reads and decisions: the leases to grant and their changes (unwritten)."""
        await self._classify_expired(tx)
        lease_duration = self._config.lease_duration
        granted: list[Lease] = []
        changes: list[OccurrenceChange] = []
        for row in await tx.repo.claimable(CLAIM_RULE, tx.now, limit):
            expires = lease_expiry(tx.now, lease_duration, row.window_ends_at)
            if expires is None:
                continue
            capability = new_capability(self._random)
            revision = row.lease_revision + 1
            changes.append(
                apply_step(
                    row,
                    step(row.state, _E.CLAIM),
                    tx.now,
                    lease_expires_at=expires,
                    lease_revision=revision,
                    lease_digest=capability_digest(capability),
                )
            )
            granted.append(trusted_lease(row.occurrence_id, expires, revision, capability))
        return granted, changes

    # --- relay ---------------------------------------------------------------------------

    async def relay(self, lease: Lease, broker: MessageBroker) -> BrokerReceipt:
        """Publish a leased occurrence and record the outcome.

        A batch of one: :meth:`relay_many` with ``[lease]``, its outcome's error raised.
        Transaction one re-checks the live lease and counts the attempt; after its commit
        the content is opened and the lease judged once more. The broker is called
        outside any transaction, bounded by the remaining lease and 10 s, always with the
        same message and idempotency key. Transaction two records the outcome, fenced by
        the lease's capability and revision. Whatever the broker raises (an
        :class:`Exception`) is classified and recorded: retried with backoff, dead after
        ten attempts, at the window's end, or at once when permanent.

        Returns:
            The broker's receipt. If the definition was cancelled while the message was in
            flight, the occurrence stays cancelled and the receipt is still returned.

        Raises:
            RelayLeaseLostError: the lease expired, was fenced by a newer claim, or the
                occurrence moved on (nothing was published, or a publication by a stale
                holder is not recorded).
            RelayAcknowledgementError: the broker accepted but the outcome is uncertain:
                the broker said so, or recording the outcome failed (its ``__cause__`` is
                the storage error); carries ``.receipt``. The occurrence is republished
                under the same key.
            RelayBrokerTimeoutError: the broker did not answer in time (retried later).
            RelayBrokerError: the broker failed (any exception it raised: ``__cause__``);
                ``permanent`` failures are dead letters.
            RecurringKeyringError: the content cannot be opened (the occurrence is now a
                dead letter).
            RecurringConfigurationError: ``lease`` is not a Lease or ``broker`` has no
                ``publish``.
            RecurringStorageError, RecurringDeadlineError, RecurringClockError: storage
                failed before publication, or while recording a failed one.
        """
        if not isinstance(lease, Lease):
            raise RecurringConfigurationError("relay needs a Lease returned by claim")
        [outcome] = await self.relay_many([lease], broker)
        return outcome.result()

    async def relay_many(
        self,
        leases: Sequence[Lease],
        broker: MessageBroker,
        *,
        concurrency: int = limits.RELAY_CONCURRENCY,
    ) -> list[RelayOutcome]:
        """Publish a batch of leased occurrences and record each outcome.

        Three steps for the whole batch, each lease judged on its own:

        1. one transaction checks every lease (current capability and revision, state
           leased, not expired) and counts the attempt; after its commit the content is
           opened (content that cannot be opened is recorded as a dead letter in step 3);
        2. after the commit, the publications run concurrently (at most ``concurrency``
           at once), outside any transaction; each is judged again when it starts and
           bounded by its remaining lease and 10 s;
        3. one transaction records the outcomes, each fenced by its own capability and
           revision (a fenced lease records nothing).

        A lease that appears twice in a batch is relayed once; its other entries are
        refused (lease lost).

        Returns:
            One :class:`RelayOutcome` per lease, in the order given: the receipt, or the
            error a single :meth:`relay` of that lease raises (an uncertain
            acknowledgement carries the receipt, its ``__cause__`` the storage error when
            recording failed).

        Raises:
            RecurringConfigurationError: ``leases`` is not a sequence of at most 100
                Leases, ``broker`` has no ``publish``, or ``concurrency`` is outside
                1..100.
            RecurringStorageError, RecurringDeadlineError, RecurringClockError: the check
                (step 1) failed: nothing was published.
        """
        if not isinstance(leases, Sequence):
            raise RecurringConfigurationError("relay_many needs a sequence of Leases")
        if len(leases) > limits.MAX_BATCH:
            raise RecurringConfigurationError(
                f"relay_many takes at most {limits.MAX_BATCH} leases; got {len(leases)}"
            )
        if not all(isinstance(lease, Lease) for lease in leases):
            raise RecurringConfigurationError("relay_many needs Leases returned by claim")
        if not callable(getattr(broker, "publish", None)):
            raise RecurringConfigurationError("relay needs a MessageBroker (with publish)")
        concurrency = validate_budget(concurrency, "concurrency")
        if not leases:
            return []
        checked, checked_at = await self._prepare(leases)
        return await self._publish_and_record(leases, checked, checked_at, broker, concurrency)

    async def claim_and_relay(
        self,
        limit: int,
        broker: MessageBroker,
        *,
        concurrency: int = limits.RELAY_CONCURRENCY,
    ) -> list[RelayOutcome]:
        """Claim up to ``limit`` occurrences and relay them: :meth:`claim`, then :meth:`relay_many`.

        The claim and the relay's check are one transaction (the check of a lease granted
        in the same transaction, under the same lock, at the same time); the publications
        and the recording are :meth:`relay_many`'s. One transaction fewer per batch, the
        same rules: every lease is fenced, judged again after the commit and when its
        publication starts, and its outcome recorded under its own capability and revision.

        Returns:
            One :class:`RelayOutcome` per occurrence claimed, oldest due first.

        Raises:
            RecurringConfigurationError: ``limit`` or ``concurrency`` outside 1..100, or
                ``broker`` has no ``publish``.
            RecurringStorageError, RecurringDeadlineError, RecurringClockError: the claim
                failed: nothing was claimed or published.
        """
        limit = validate_budget(limit, "limit")
        if not callable(getattr(broker, "publish", None)):
            raise RecurringConfigurationError("relay needs a MessageBroker (with publish)")
        concurrency = validate_budget(concurrency, "concurrency")

        async def body(tx: _Tx) -> tuple[list[Lease], list[_Checked | SteepleError]]:
            granted, changes = await self._grant(tx, limit)
            if not granted:
                return granted, []
            # The claimed rows with their content (a claimable row need not carry it).
            stored = {
                r.occurrence_id: r
                for r in await tx.repo.occurrences([c.occurrence_id for c in changes])
            }
            # Each lease was granted from its row just now, under this lock: the row holds
            # it, live, by construction, so the check of ``relay_many`` (capability digest,
            # revision, state, expiry) has nothing to find; only the attempt is counted.
            # The grant's change carries it: one write per occurrence.
            checked: list[_Checked | SteepleError] = []
            final: list[OccurrenceChange] = []
            for lease, change in zip(granted, changes, strict=True):
                row = stored[lease.occurrence_id]
                # Built directly (attrs.evolve is several times slower): once per relay.
                final.append(
                    OccurrenceChange(
                        occurrence_id=change.occurrence_id,
                        state=change.state,
                        attempts=change.attempts + 1,
                        next_attempt_at=change.next_attempt_at,
                        last_error=change.last_error,
                        lease_expires_at=change.lease_expires_at,
                        lease_revision=change.lease_revision,
                        lease_digest=change.lease_digest,
                        updated_at=tx.now,
                        finished_at=change.finished_at,
                        erase_content=change.erase_content,
                    )
                )
                checked.append(
                    _Checked(lease, row.content, row.definition_name, row.due_at, lease.expires_at)
                )
            await tx.repo.update_occurrences(final)
            return granted, checked

        (granted, checked), checked_at = await self._run("claim", body, points="claim")
        return await self._publish_and_record(granted, checked, checked_at, broker, concurrency)

    async def _publish_and_record(
        self,
        leases: Sequence[Lease],
        checked: Sequence[_Checked | SteepleError],
        checked_at: datetime,
        broker: MessageBroker,
        concurrency: int,
    ) -> list[RelayOutcome]:
        """Relay steps two and three for checked leases: open, publish concurrently, record.

        The content is opened here, after the check committed: decryption, decoding and
        the idempotency key are not done while the control row is held. Content that
        cannot be opened is recorded as a dead letter in step three (fenced, like every
        outcome) and reported as the keyring (or storage) error.
        """
        outcomes: list[RelayOutcome | None] = [None] * len(leases)
        ready: list[tuple[int, _Prepared]] = []
        unopenable: list[tuple[int, Lease, _Attempt]] = []
        for index, entry in enumerate(checked):
            if not isinstance(entry, _Checked):
                outcomes[index] = trusted_outcome(leases[index].occurrence_id, error=entry)
                continue
            try:
                ready.append((index, self._opened(entry)))
            except (RecurringKeyringError, RecurringStorageError) as exc:
                unopenable.append((index, entry.lease, _Attempt(unopenable=exc)))
        attempts: list[_Attempt] = []
        if len(ready) == 1:
            # A single publication is awaited in place: a task group (a task, a semaphore)
            # would run it the same way, only slower, and single relays are the common case.
            prepared = ready[0][1]
            # Named for the loop-lag monitor as a batch's tasks are (below): the caller's
            # task carries the occurrence while it publishes, then gets its name back.
            task = asyncio.current_task()
            name = task.get_name() if task is not None else ""
            if task is not None:
                task.set_name(f"{name}: publish occurrence {prepared.lease.occurrence_id}")
            try:
                attempts = [await self._publish_now(prepared, broker, checked_at)]
            finally:
                if task is not None:
                    task.set_name(name)
        elif ready:
            limit = asyncio.Semaphore(concurrency)
            async with asyncio.TaskGroup() as group:
                # Named for the loop-lag monitor, which reports the task that blocks.
                # A batch no larger than the concurrency needs no semaphore: all start.
                tasks = [
                    group.create_task(
                        self._publish_now(prepared, broker, checked_at)
                        if len(ready) <= concurrency
                        else self._publish(prepared, broker, checked_at, limit),
                        name=f"steeple relay: publish occurrence {prepared.lease.occurrence_id}",
                    )
                    for _, prepared in ready
                ]
            attempts = [task.result() for task in tasks]
        entries = [(i, p.lease, a) for (i, p), a in zip(ready, attempts, strict=True)]
        entries += unopenable
        if entries:
            recorded = await self._record_outcomes([(lease, a) for _, lease, a in entries])
            for (index, _, _), outcome in zip(entries, recorded, strict=True):
                outcomes[index] = outcome
        return [outcome for outcome in outcomes if outcome is not None]

    def _opened(self, checked: _Checked) -> _Prepared:
        """Open a checked lease's content; derive its idempotency key.

        Raises:
            RecurringKeyringError: the content cannot be opened (missing key, tampering).
            RecurringStorageError: the occurrence has no content.
        """
        lease = checked.lease
        if checked.content is None:
            raise RecurringStorageError(f"occurrence {lease.occurrence_id} has no content")
        opened = self._open(
            checked.content,
            PURPOSE_OCCURRENCE,
            lease.occurrence_id,
            f"occurrence {lease.occurrence_id}",
        )
        key = idempotency_key(
            purpose=PUBLISH_PURPOSE,
            namespace=self._config.namespace,
            definition_name=checked.definition_name,
            due_at=checked.due_at,
            generation=bytes.fromhex(lease.occurrence_id),
        )
        return _Prepared(lease, codec.decode_message(opened), key, checked.expires_at)

    async def _publish(
        self,
        prepared: _Prepared,
        broker: MessageBroker,
        checked_at: datetime,
        limit: asyncio.Semaphore,
    ) -> _Attempt:
        """Relay step two for one lease: publish within what remains of it (and 10 s)."""
        async with limit:
            return await self._publish_now(prepared, broker, checked_at)

    async def _publish_now(
        self, prepared: _Prepared, broker: MessageBroker, checked_at: datetime
    ) -> _Attempt:
        """Publish one checked lease now (its turn came): see :meth:`_publish`."""
        # Judged again when the publication starts (after the check committed, and
        # after waiting for a turn): a lease that lapsed publishes nothing.
        remaining = prepared.expires_at - max(checked_at, read_clock(self._clock))
        if remaining <= timedelta(0):
            return _Attempt(
                error=RelayLeaseLostError(
                    f"the lease on occurrence {prepared.lease.occurrence_id} expired "
                    "while its check committed (or while waiting for its turn to "
                    "publish); nothing was published"
                ),
                unsent=True,
            )
        timeout = min(remaining, limits.PUBLISH_DEADLINE).total_seconds()
        try:
            crash_point("relay.before_publish")
            async with asyncio.timeout(timeout):
                receipt = await broker.publish(
                    prepared.message, idempotency_key=prepared.key, timeout=timeout
                )
            crash_point("relay.after_confirm")
            if not isinstance(receipt, BrokerReceipt):
                raise TypeError(f"publish returned a {type(receipt).__name__}, not a receipt")
        except BaseException as exc:
            failure = classify_publication_failure(exc)
            if failure is None:
                raise  # cancellation and interpreter exit are not publication failures
            return _Attempt(failure=failure, raised=exc)
        return _Attempt(receipt=receipt)

    async def _prepare(
        self, leases: Sequence[Lease]
    ) -> tuple[list[_Checked | SteepleError], datetime]:
        """Relay step one for a batch: check each lease and count the attempt.

        Returns the entries (a checked lease with its sealed content, or the error to
        report) and the recorded time.
        """

        async def body(tx: _Tx) -> list[_Checked | SteepleError]:
            ids = [lease.occurrence_id for lease in leases]
            ids = list(dict.fromkeys(i for i in ids if _is_occurrence_id(i)))
            rows = {r.occurrence_id: r for r in await tx.repo.occurrences(ids)} if ids else {}
            results, changes = self._check(tx, leases, rows)
            if changes:
                await tx.repo.update_occurrences(changes)
            return results

        return await self._run("relay", body, points="relay.check")

    def _check(
        self, tx: _Tx, leases: Sequence[Lease], rows: Mapping[str, OccurrenceRow]
    ) -> tuple[list[_Checked | SteepleError], list[OccurrenceChange]]:
        """Relay step one's decisions: check each lease against its row (content loaded).

        Returns one entry per lease (the checked lease with its sealed content, or the
        error to report) and the changes to write: the attempt counted.
        """
        results: list[_Checked | SteepleError] = []
        changes: list[OccurrenceChange] = []
        taken: set[str] = set()
        for lease in leases:
            row = rows.get(lease.occurrence_id)
            if (
                row is None
                or lease.occurrence_id in taken
                or not holds_lease(
                    row.lease_digest, row.lease_revision, lease.capability, lease.revision
                )
                or row.state is not OccurrenceState.LEASED
                or row.lease_expires_at is None
                or not is_live(row.lease_expires_at, tx.now)
            ):
                results.append(
                    RelayLeaseLostError(
                        f"the lease on occurrence {lease.occurrence_id} is no longer live "
                        "(expired, fenced by a newer claim, the occurrence moved on, or "
                        "it is relayed by an earlier entry of the same batch)"
                    )
                )
                continue
            taken.add(lease.occurrence_id)
            changes.append(OccurrenceChange.of(row, attempts=row.attempts + 1, updated_at=tx.now))
            results.append(
                _Checked(lease, row.content, row.definition_name, row.due_at, row.lease_expires_at)
            )
        return results, changes

    async def _record_outcomes(
        self, attempted: Sequence[tuple[Lease, _Attempt]]
    ) -> list[RelayOutcome]:
        """Relay step three for a batch: record each outcome, fenced by its own lease.

        A publication that never started (its lease lapsed first) records nothing but
        gives back the attempt its check counted, while the lease is still the latest: a
        batch that outlasts its leases (a slow broker, a claim larger than the broker's
        pace) must not spend the occurrences' attempt budget (ten) on nothing sent. If the
        transaction fails, an accepted publication is reported as an uncertain
        acknowledgement carrying its receipt, a lost broker acknowledgement as itself
        (the storage error as its ``__cause__``), any other outcome as the storage error.
        """
        if all(a.error is not None and not a.unsent for _, a in attempted):
            return [self._reported(lease, a, None) for lease, a in attempted]

        async def body(tx: _Tx) -> list[str | SteepleError | None]:
            ids = [lease.occurrence_id for lease, a in attempted if a.error is None or a.unsent]
            rows = {r.occurrence_id: r for r in await tx.repo.occurrences(ids)}
            changes: list[OccurrenceChange] = []
            notes: list[str | SteepleError | None] = []
            for lease, attempt in attempted:
                row = rows.get(lease.occurrence_id)
                if row is not None and not holds_lease(
                    row.lease_digest, row.lease_revision, lease.capability, lease.revision
                ):
                    row = None
                if attempt.error is not None:
                    if attempt.unsent and row is not None and row.state is OccurrenceState.LEASED:
                        changes.append(
                            OccurrenceChange.of(
                                row, attempts=max(row.attempts - 1, 0), updated_at=tx.now
                            )
                        )
                    notes.append(None)
                    continue
                note: str | SteepleError | None
                if attempt.unopenable is not None:
                    note, change = self._unopenable_change(tx, row, attempt.unopenable)
                elif attempt.receipt is not None:
                    note, change = self._published_change(tx, lease, row)
                else:
                    assert attempt.failure is not None
                    note, change = self._failure_change(tx, row, attempt.failure)
                notes.append(note)
                if change is not None:
                    changes.append(change)
            if changes:
                await tx.repo.update_occurrences(changes)
            return notes

        try:
            notes = (await self._run("relay", body, points="relay.record"))[0]
        except RecurringError as stored:
            return [self._reported(lease, a, stored) for lease, a in attempted]
        return [
            self._reported(lease, a, None, note)
            for (lease, a), note in zip(attempted, notes, strict=True)
        ]

    def _unopenable_change(
        self, tx: _Tx, row: OccurrenceRow | None, error: SteepleError
    ) -> tuple[SteepleError, OccurrenceChange | None]:
        """Record content that cannot be opened: a dead letter (fenced, like any outcome)."""
        if row is None:
            return error, None
        try:
            dead = step(row.state, _E.PUBLISH_FAILED_FINAL)
        except InvalidTransitionError:
            return error, None  # cancelled meanwhile: nothing to bury
        cause = error.__cause__ if isinstance(error.__cause__, KeyringError) else error
        change = apply_step(
            row, dead, tx.now, last_error=f"content cannot be opened ({type(cause).__name__})"
        )
        return error, change

    def _published_change(
        self, tx: _Tx, lease: Lease, row: OccurrenceRow | None
    ) -> tuple[SteepleError | None, OccurrenceChange | None]:
        """Record an accepted publication (``row`` is ``None`` when the lease was fenced)."""
        if row is None:
            return RelayLeaseLostError(
                f"occurrence {lease.occurrence_id} was published, but its lease was fenced "
                "by a newer claim while publishing; the broker accepted it under the same "
                "idempotency key and the new holder records the outcome"
            ), None
        try:
            published = step(row.state, _E.PUBLISHED)
        except InvalidTransitionError:
            return RelayLeaseLostError(
                f"occurrence {lease.occurrence_id} is {row.state.value}; this lease cannot "
                "record its publication"
            ), None
        return None, apply_step(row, published, tx.now)

    def _failure_change(
        self, tx: _Tx, row: OccurrenceRow | None, failure: PublicationFailure
    ) -> tuple[str, OccurrenceChange | None]:
        """Record a failed publication; describe what follows."""
        # A stale (fenced) holder records nothing: it can neither retry nor bury the
        # new holder's occurrence. The caller still learns what the broker said.
        if row is None:
            return "nothing recorded: the lease was fenced by a newer claim", None
        try:
            step(row.state, _E.PUBLISH_FAILED_RETRYABLE)
        except InvalidTransitionError:
            return f"nothing recorded: the occurrence was {row.state.value} meanwhile", None
        decision = after_publish_failure(
            max(row.attempts, 1),
            tx.now,
            row.window_ends_at,
            failure.permanent,
            draw=self._random.random(),
        )
        event = (
            _E.PUBLISH_FAILED_RETRYABLE
            if decision.state is OccurrenceState.RETRY_WAIT
            else _E.PUBLISH_FAILED_FINAL
        )
        change = apply_step(
            row,
            step(row.state, event),
            tx.now,
            next_attempt_at=decision.next_attempt_at,
            last_error=failure.error,
        )
        if decision.next_attempt_at is not None:
            return f"retry after {decision.next_attempt_at.isoformat()}", change
        return f"dead letter ({decision.reason})", change

    def _reported(
        self,
        lease: Lease,
        attempt: _Attempt,
        stored: RecurringError | None,
        note: str | SteepleError | None = None,
    ) -> RelayOutcome:
        """Return one lease's outcome, from its attempt and what recording it came to."""
        occurrence_id = lease.occurrence_id
        if attempt.error is not None:
            return trusted_outcome(occurrence_id, error=attempt.error)
        if attempt.unopenable is not None:
            return trusted_outcome(occurrence_id, error=stored or attempt.unopenable)
        if attempt.receipt is not None:
            if stored is not None:
                return trusted_outcome(
                    occurrence_id,
                    error=_caused(
                        RelayAcknowledgementError(
                            attempt.receipt,
                            f"recording the publication of occurrence {occurrence_id} failed "
                            f"({type(stored).__name__}); it will be republished under the "
                            "same idempotency key",
                        ),
                        stored,
                    ),
                )
            if isinstance(note, SteepleError):
                return trusted_outcome(occurrence_id, error=note)
            return trusted_outcome(occurrence_id, receipt=attempt.receipt)
        failure, raised = attempt.failure, attempt.raised
        assert failure is not None
        assert raised is not None
        if stored is not None:
            if failure.kind is FailureKind.ACKNOWLEDGEMENT and isinstance(raised, SteepleError):
                # The broker's own error carries the receipt.
                return trusted_outcome(occurrence_id, error=_caused(raised, stored))
            return trusted_outcome(occurrence_id, error=stored)
        error = publication_error(failure, raised, occurrence_id, str(note))
        return trusted_outcome(
            occurrence_id, error=error if error is raised else _caused(error, raised)
        )

    # --- operator actions and listings ---------------------------------------------------

    async def retry_failed(self, occurrence_id: str) -> OccurrenceInfo:
        """Give a dead occurrence a fresh automatic attempt budget inside its window.

        Success is reported once the reset is committed.

        Raises:
            RecurringConfigurationError: ``occurrence_id`` is not a str.
            RecurringNotFoundError: no such occurrence in this namespace (or purged).
            RecurringInvalidStateError: the occurrence is not dead (published, cancelled,
                expired and live work cannot be revived), or its window has ended.
            RecurringStorageError: the storage failed.
            RecurringDeadlineError: a storage deadline passed.
            RecurringClockError: the clock trails the recorded time by more than 5 s.
        """
        if not isinstance(occurrence_id, str):
            raise RecurringConfigurationError("an occurrence id is a str")

        async def body(tx: _Tx) -> OccurrenceInfo:
            await self._classify_expired(tx)
            rows = (
                await tx.repo.occurrences([occurrence_id])
                if _is_occurrence_id(occurrence_id)
                else []
            )
            if not rows:
                raise RecurringNotFoundError(
                    f"no occurrence {shown(occurrence_id)} in namespace {self._config.namespace!r}"
                )
            [row] = rows
            try:
                revival = step(row.state, _E.OPERATOR_RETRY)
            except InvalidTransitionError:
                raise RecurringInvalidStateError(
                    f"occurrence {occurrence_id} is {row.state.value}; only dead occurrences "
                    "inside their delivery window can be retried"
                ) from None
            change = apply_step(row, revival, tx.now)
            await tx.repo.update_occurrences([change])
            return codec.occurrence_info(change.applied_to(row))

        return (await self._run("retry_failed", body))[0]

    async def occurrences(self, after: str | None = None, limit: int = 100) -> Page[OccurrenceInfo]:
        """List occurrences' metadata by (due time, id), after the exclusive cursor ``after``.

        Expired work is classified (and its content erased) first. No payloads, no lease
        credentials.

        Raises:
            RecurringConfigurationError: ``limit`` outside 1..100, or a cursor this store
                did not return.
            RecurringStorageError: the storage failed.
            RecurringDeadlineError: a storage deadline passed.
            RecurringClockError: the clock trails the recorded time by more than 5 s.
        """
        limit = validate_budget(limit, "limit")
        position = codec.parse_occurrence_cursor(after)

        async def body(tx: _Tx) -> Page[OccurrenceInfo]:
            await self._classify_expired(tx)
            rows = await tx.repo.occurrence_page(position, limit + 1)
            items = [codec.occurrence_info(r) for r in rows[:limit]]
            cursor = None
            if len(rows) > limit:
                cursor = codec.occurrence_cursor(items[-1].due_at, items[-1].occurrence_id)
            return Page(items=items, next_cursor=cursor)

        return (await self._run("occurrences", body))[0]

    async def purge_terminal(self, older_than: datetime, limit: int = 100) -> int:
        """Remove at most ``limit`` (1-100) terminal occurrences finished before ``older_than``.

        Expired work is classified first. Returns how many were removed.

        Raises:
            RecurringConfigurationError: ``limit`` outside 1..100, or a cutoff that is not
                a timezone-aware datetime.
            RecurringStorageError: the storage failed.
            RecurringDeadlineError: a storage deadline passed.
            RecurringClockError: the clock trails the recorded time by more than 5 s.
        """
        limit = validate_budget(limit, "limit")
        if not isinstance(older_than, datetime) or older_than.utcoffset() is None:
            raise RecurringConfigurationError(
                "older_than must be a timezone-aware datetime (steeple works in UTC)"
            )

        async def body(tx: _Tx) -> int:
            await self._classify_expired(tx)
            removed = await tx.repo.delete_occurrences(_PURGEABLE, older_than, limit)
            tx.occurrence_delta = -removed
            return removed

        return (await self._run("purge_terminal", body))[0]
