"""The public face every recurring store shares, written once.

:class:`EngineStore` holds the operations of a recurring store (``create``, ``tick``,
``claim``, ``relay`` and the rest), what each promises and raises, and the async context
manager; each forwards to the store's :class:`~steeple.engine.RecurringEngine`. With the
open sequence of :mod:`steeple.engine.opening`, it is everything stores have in common. A
store subclasses it and adds only its storage port (a
:class:`~steeple.engine.ports.RecurringStorage` and, to open a namespace, a
:class:`~steeple.engine.ports.NamespaceOpening`) and how it opens and closes::

    class MyStore(EngineStore):
        def __init__(self, storage, config, keyring, clock):
            self._engine = RecurringEngine(storage, config, keyring, clock)

        async def close(self) -> None: ...

Errors: every operation raises only :class:`~steeple.core.errors.RecurringError` subtypes
(relays also :class:`~steeple.core.errors.RecurringRelayError` ones). Where one says "the
storage failed", each store raises its own typed subclasses of
:class:`~steeple.core.errors.RecurringStorageError` (a driver's failure, a full disk, a
deadline: :class:`~steeple.core.errors.RecurringDeadlineError`).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Self

from steeple.core import limits
from steeple.core.config import RecurringConfig, RecurringDefinition
from steeple.core.errors import RecurringConflictError
from steeple.core.messages import BrokerReceipt
from steeple.core.ports import MessageBroker
from steeple.core.records import (
    Lease,
    OccurrenceInfo,
    Page,
    RelayOutcome,
    ScheduleInfo,
    TickResult,
)
from steeple.engine.engine import RecurringEngine

__all__ = ["EngineStore"]


class EngineStore:
    """A recurring store: the engine's operations on one namespace, over a storage port.

    The base of the PostgreSQL, SQLite and in-memory stores, and of any you compose: a
    subclass sets ``_engine`` (a :class:`~steeple.engine.RecurringEngine` over its
    storage) when it is built and implements :meth:`close`. Usable as an async context
    manager (leaving it closes the store).
    """

    __slots__ = ()

    _engine: RecurringEngine

    @property
    def config(self) -> RecurringConfig:
        """The namespace's configuration."""
        return self._engine.config

    @property
    def namespace(self) -> str:
        """The namespace this store serves."""
        return self._engine.config.namespace

    async def close(self) -> None:
        """Close the store (its own connections, not other stores'); later calls fail.

        Idempotent. Each store says what it releases.
        """
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # --- the operations (the engine's) ---------------------------------------------------

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
            RecurringClockError: the clock trails the recorded time by more than 5 s, or is
                ahead of the database server's clock by more than 5 s (PostgreSQL).
        """
        return await self._engine.create(definition)

    async def create_many(
        self, definitions: Sequence[RecurringDefinition]
    ) -> list[ScheduleInfo | RecurringConflictError]:
        """Create up to 100 definitions in one transaction; each judged as ``create``.

        Each definition is created, replays an identical stored one (or an identical
        earlier entry of the same batch), or conflicts with a different one of its name;
        a conflict is that entry's result and does not stop the others. The quota holds
        for the batch as a whole: if the new definitions do not all fit, none is created.

        Returns:
            One result per definition, in the order given: its metadata (the original
            metadata on a replay), or the :class:`RecurringConflictError` a single
            ``create`` raises.

        Raises:
            RecurringConfigurationError: ``definitions`` is not a sequence of at most 100
                RecurringDefinitions.
            RecurringCapacityError: the new definitions of the batch would exceed
                ``max_definitions``; nothing was created.
            RecurringKeyringError: a stored definition cannot be opened (e.g. its key is
                missing: also an ``UnknownKeyIdError`` naming the key id).
            RecurringStorageError: the storage failed.
            RecurringDeadlineError: a storage deadline passed.
            RecurringClockError: the clock trails the recorded time by more than 5 s, or is
                ahead of the database server's clock by more than 5 s (PostgreSQL).
        """
        return await self._engine.create_many(definitions)

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
            RecurringClockError: the clock trails the recorded time by more than 5 s, or is
                ahead of the database server's clock by more than 5 s (PostgreSQL).
        """
        return await self._engine.cancel(name)

    async def schedules(self, after: str | None = None, limit: int = 100) -> Page[ScheduleInfo]:
        """List definitions' metadata by name, after the exclusive cursor ``after``.

        Raises:
            RecurringConfigurationError: ``limit`` outside 1..100, or a cursor that is not
                a name this store returned.
            RecurringKeyringError: a listed definition cannot be opened for its metadata.
            RecurringStorageError: the storage failed.
            RecurringDeadlineError: a storage deadline passed.
            RecurringClockError: the clock trails the recorded time by more than 5 s, or is
                ahead of the database server's clock by more than 5 s (PostgreSQL).
        """
        return await self._engine.schedules(after, limit)

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
            RecurringClockError: the clock trails the recorded time by more than 5 s, or is
                ahead of the database server's clock by more than 5 s (PostgreSQL).
        """
        return await self._engine.tick(budget)

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
            RecurringClockError: the clock trails the recorded time by more than 5 s, or is
                ahead of the database server's clock by more than 5 s (PostgreSQL).
        """
        return await self._engine.claim(limit)

    async def relay(self, lease: Lease, broker: MessageBroker) -> BrokerReceipt:
        """Publish a leased occurrence and record the outcome.

        A batch of one: ``relay_many`` with ``[lease]``, its outcome's error raised.
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
        return await self._engine.relay(lease, broker)

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
            error a single ``relay`` of that lease raises (an uncertain
            acknowledgement carries the receipt, its ``__cause__`` the storage error when
            recording failed).

        Raises:
            RecurringConfigurationError: ``leases`` is not a sequence of at most 100
                Leases, ``broker`` has no ``publish``, or ``concurrency`` is outside
                1..100.
            RecurringStorageError, RecurringDeadlineError, RecurringClockError: the check
                (step 1) failed: nothing was published.
        """
        return await self._engine.relay_many(leases, broker, concurrency=concurrency)

    async def claim_and_relay(
        self,
        limit: int,
        broker: MessageBroker,
        *,
        concurrency: int = limits.RELAY_CONCURRENCY,
    ) -> list[RelayOutcome]:
        """Claim up to ``limit`` occurrences and relay them: ``claim``, then ``relay_many``.

        The claim and the relay's check are one transaction (the check of a lease granted
        in the same transaction, under the same lock, at the same time); the publications
        and the recording are ``relay_many``'s. One transaction fewer per batch, the
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
        return await self._engine.claim_and_relay(limit, broker, concurrency=concurrency)

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
            RecurringClockError: the clock trails the recorded time by more than 5 s, or is
                ahead of the database server's clock by more than 5 s (PostgreSQL).
        """
        return await self._engine.retry_failed(occurrence_id)

    async def occurrences(self, after: str | None = None, limit: int = 100) -> Page[OccurrenceInfo]:
        """List occurrences' metadata by (due time, id), after the exclusive cursor ``after``.

        Expired work is classified (and its content erased) first. No payloads, no lease
        credentials.

        Raises:
            RecurringConfigurationError: ``limit`` outside 1..100, or a cursor this store
                did not return.
            RecurringStorageError: the storage failed.
            RecurringDeadlineError: a storage deadline passed.
            RecurringClockError: the clock trails the recorded time by more than 5 s, or is
                ahead of the database server's clock by more than 5 s (PostgreSQL).
        """
        return await self._engine.occurrences(after, limit)

    async def purge_terminal(self, older_than: datetime, limit: int = 100) -> int:
        """Remove at most ``limit`` (1-100) terminal occurrences finished before ``older_than``.

        Expired work is classified first. The earliest finished go first (a tie: the
        earliest due first). Returns how many were removed.

        Raises:
            RecurringConfigurationError: ``limit`` outside 1..100, or a cutoff that is not
                a timezone-aware datetime.
            RecurringStorageError: the storage failed.
            RecurringDeadlineError: a storage deadline passed.
            RecurringClockError: the clock trails the recorded time by more than 5 s, or is
                ahead of the database server's clock by more than 5 s (PostgreSQL).
        """
        return await self._engine.purge_terminal(older_than, limit)
