"""The relay's three steps: check the leases, publish, record the outcomes.

A relay is three steps: a transaction that re-checks the live lease and counts the
attempt; the publication (the content opened after that commit), outside any
transaction, bounded by the remaining lease and 10 s; a transaction that records the
outcome, fenced by the lease's capability and revision. Whatever the broker raises is
classified (:func:`steeple.core.publication.classify_publication_failure`) and recorded,
so no broker can leave an occurrence leased; when the broker accepted and recording the
outcome fails, the caller gets :class:`RelayAcknowledgementError` carrying the receipt.

:class:`RelaySteps` holds them for :class:`~steeple.engine.RecurringEngine`; the loop
that calls them round after round is :mod:`steeple.engine.relay_loop`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from typing import TypeVar

import attrs

from steeple.core import limits
from steeple.core.errors import (
    InvalidTransitionError,
    KeyringError,
    RecurringConfigurationError,
    RecurringError,
    RecurringKeyringError,
    RecurringStorageError,
    RelayAcknowledgementError,
    RelayLeaseLostError,
    SteepleError,
)
from steeple.core.idempotency import PUBLISH_PURPOSE, trusted_idempotency_key
from steeple.core.leases import after_publish_failure, holds_granted_lease, holds_lease, is_live
from steeple.core.messages import BrokerReceipt, ScheduledMessage
from steeple.core.occurrences import OccurrenceEvent, OccurrenceState, step
from steeple.core.policies import validate_budget
from steeple.core.ports import MessageBroker
from steeple.core.publication import (
    FailureKind,
    PublicationFailure,
    classify_publication_failure,
    publication_error,
)
from steeple.core.records import Lease, RelayOutcome, trusted_outcome
from steeple.engine import codec
from steeple.engine.crashpoints import crash_point
from steeple.engine.namespace_work import (
    NamespaceWork,
    Tx,
    check_batch,
    is_occurrence_id,
)
from steeple.engine.opening import read_clock
from steeple.engine.ports import OccurrenceChange, OccurrenceRow, apply_step

__all__ = ["RelaySteps"]

_E = OccurrenceEvent
_NO_TIME = timedelta(0)

# The relay's own records of one publication (_Checked, _Attempt) are built once per
# publication: slotted, but not frozen (a frozen attrs class sets each field through
# object.__setattr__, three times slower).


@attrs.define(repr=False)
class _Checked:
    """A lease that passed the relay's check, with its occurrence's sealed content.

    Opened (:meth:`RelaySteps._opened`), the same record also holds what to publish and
    under which key: one record per publication, not two.
    """

    lease: Lease
    content: bytes | None
    definition_name: str
    due_at: datetime
    expires_at: datetime
    granted_digest: bytes | None = attrs.field(default=None, kw_only=True)
    """The digest of the lease's capability when this relay granted it (its fence is then
    checked without hashing the capability again)."""
    message: ScheduledMessage = attrs.field(init=False)
    """What to publish (set once the content is opened)."""
    key: str = attrs.field(init=False)
    """The publication's idempotency key (set once the content is opened)."""


@attrs.define(repr=False)
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


def _publishes_in_place(broker: object) -> bool:
    """Whether ``broker`` says its ``publish`` never waits (``publishes_in_place``).

    Read once, before anything is claimed: a broker that cannot answer publishes the
    usual way, each publication a task under its deadline.
    """
    try:
        return getattr(broker, "publishes_in_place", False) is True
    except Exception:  # any broker may fail in any way: then not in place
        return False


@attrs.define(repr=False)
class RelaySteps:
    """The relay half of a namespace's engine: ``relay``, ``relay_many``, ``claim_and_relay``.

    Built by :class:`~steeple.engine.RecurringEngine` over its :class:`NamespaceWork`.
    """

    _work: NamespaceWork

    def __repr__(self) -> str:
        return f"RelaySteps(namespace={self._work.config.namespace!r})"

    async def relay(self, lease: Lease, broker: MessageBroker) -> BrokerReceipt:
        """Run ``relay`` (documented on :class:`~steeple.engine.EngineStore`)."""
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
        """Run ``relay_many`` (documented on :class:`~steeple.engine.EngineStore`)."""
        check_batch(leases, Lease, "relay_many", "leases", "Leases returned by claim")
        if not callable(getattr(broker, "publish", None)):
            raise RecurringConfigurationError("relay needs a MessageBroker (with publish)")
        concurrency = validate_budget(concurrency, "concurrency")
        in_place = _publishes_in_place(broker)
        if not leases:
            return []
        checked, checked_at = await self._prepare(leases)
        return await self._publish_and_record(
            leases, checked, checked_at, broker, concurrency, in_place=in_place
        )

    async def claim_and_relay(
        self,
        limit: int,
        broker: MessageBroker,
        *,
        concurrency: int = limits.RELAY_CONCURRENCY,
    ) -> list[RelayOutcome]:
        """Run ``claim_and_relay`` (documented on :class:`~steeple.engine.EngineStore`)."""
        limit = validate_budget(limit, "limit")
        if not callable(getattr(broker, "publish", None)):
            raise RecurringConfigurationError("relay needs a MessageBroker (with publish)")
        concurrency = validate_budget(concurrency, "concurrency")
        in_place = _publishes_in_place(broker)

        async def body(tx: Tx) -> tuple[list[Lease], list[_Checked | SteepleError]]:
            # Each lease is granted from its row just now, under this lock: the row holds
            # it, live, by construction, so the check of ``relay_many`` (capability digest,
            # revision, state, expiry) has nothing to find; only the attempt is counted,
            # by the grant's own change: one write per occurrence.
            granted, changes = await self._work.grant(tx, limit, attempted=True)
            if not granted:
                return granted, []
            # The claimed rows with their content (a claimable row need not carry it).
            stored = {
                r.occurrence_id: r
                for r in await tx.repo.occurrences([c.occurrence_id for c in changes])
            }
            await tx.repo.update_occurrences(changes)
            checked: list[_Checked | SteepleError] = []
            for lease, change in zip(granted, changes, strict=True):
                row = stored[lease.occurrence_id]
                checked.append(
                    _Checked(
                        lease,
                        row.content,
                        row.definition_name,
                        row.due_at,
                        lease.expires_at,
                        granted_digest=change.lease_digest,
                    )
                )
            return granted, checked

        (granted, checked), checked_at = await self._work.run("claim", body, points="claim")
        return await self._publish_and_record(
            granted, checked, checked_at, broker, concurrency, in_place=in_place
        )

    async def _publish_and_record(
        self,
        leases: Sequence[Lease],
        checked: Sequence[_Checked | SteepleError],
        checked_at: datetime,
        broker: MessageBroker,
        concurrency: int,
        *,
        in_place: bool,
    ) -> list[RelayOutcome]:
        """Relay steps two and three for checked leases: open, publish concurrently, record.

        The content is opened here, after the check committed: decryption, decoding and
        the idempotency key are not done while the control row is held. Content that
        cannot be opened is recorded as a dead letter in step three (fenced, like every
        outcome) and reported as the keyring (or storage) error.
        """
        outcomes: list[RelayOutcome | None] = [None] * len(leases)
        ready: list[tuple[int, _Checked]] = []
        unopenable: list[tuple[int, Lease, _Attempt, bytes | None]] = []
        for index, entry in enumerate(checked):
            if not isinstance(entry, _Checked):
                outcomes[index] = trusted_outcome(leases[index].occurrence_id, error=entry)
                continue
            try:
                ready.append((index, self._opened(entry)))
            except (RecurringKeyringError, RecurringStorageError) as exc:
                unopenable.append(
                    (index, entry.lease, _Attempt(unopenable=exc), entry.granted_digest)
                )
        attempts: list[_Attempt] = []
        if ready and in_place:
            # A broker that never waits (a model of one, in a simulation) publishes each
            # in turn, in the order the tasks below would start and run to their end:
            # no tasks, no semaphore, and no deadline, which nothing could reach.
            attempts = [
                await self._publish_now(prepared, broker, checked_at, in_place=True)
                for _, prepared in ready
            ]
        elif len(ready) == 1:
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
        attempted = [
            (p.lease, a, p.granted_digest) for (_, p), a in zip(ready, attempts, strict=True)
        ]
        if len(attempted) == len(leases):
            # Every lease was checked and opened (the usual batch): the outcomes recorded
            # are the batch's, in its order.
            return await self._record_outcomes(attempted)
        attempted += [(lease, a, d) for _, lease, a, d in unopenable]
        if attempted:
            recorded = await self._record_outcomes(attempted)
            indexes = [i for i, _ in ready] + [i for i, *_ in unopenable]
            for index, outcome in zip(indexes, recorded, strict=True):
                outcomes[index] = outcome
        return [outcome for outcome in outcomes if outcome is not None]

    def _opened(self, checked: _Checked) -> _Checked:
        """Open a checked lease's content; derive its idempotency key (set on ``checked``).

        Raises:
            RecurringKeyringError: the content cannot be opened (missing key, tampering).
            RecurringStorageError: the occurrence has no content.
        """
        lease = checked.lease
        if checked.content is None:
            raise RecurringStorageError(f"occurrence {lease.occurrence_id} has no content")
        opened = self._work.open_occurrence(checked.content, lease.occurrence_id)
        # The row's own values, checked when stored: the key is derived without checks.
        key = trusted_idempotency_key(
            purpose=PUBLISH_PURPOSE,
            namespace=self._work.config.namespace,
            definition_name=checked.definition_name,
            due_at=checked.due_at,
            generation=bytes.fromhex(lease.occurrence_id),
        )
        checked.message = codec.decode_message(opened)
        checked.key = key
        return checked

    async def _publish(
        self,
        prepared: _Checked,
        broker: MessageBroker,
        checked_at: datetime,
        limit: asyncio.Semaphore,
    ) -> _Attempt:
        """Relay step two for one lease: publish within what remains of it (and 10 s)."""
        async with limit:
            return await self._publish_now(prepared, broker, checked_at)

    async def _publish_now(
        self,
        prepared: _Checked,
        broker: MessageBroker,
        checked_at: datetime,
        *,
        in_place: bool = False,
    ) -> _Attempt:
        """Publish one checked lease now (its turn came): see :meth:`_publish`.

        ``in_place``: the broker publishes without ever waiting, so no deadline is set.
        """
        # Judged again when the publication starts (after the check committed, and
        # after waiting for a turn): a lease that lapsed publishes nothing.
        remaining = prepared.expires_at - max(checked_at, read_clock(self._work.clock))
        if remaining <= _NO_TIME:
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
            if in_place:
                receipt = await broker.publish(
                    prepared.message, idempotency_key=prepared.key, timeout=timeout
                )
            else:
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

        async def body(tx: Tx) -> list[_Checked | SteepleError]:
            ids = [lease.occurrence_id for lease in leases]
            ids = list(dict.fromkeys(i for i in ids if is_occurrence_id(i)))
            rows = {r.occurrence_id: r for r in await tx.repo.occurrences(ids)} if ids else {}
            results, changes = self._check(tx, leases, rows)
            if changes:
                await tx.repo.update_occurrences(changes)
            return results

        return await self._work.run("relay", body, points="relay.check")

    def _check(
        self, tx: Tx, leases: Sequence[Lease], rows: Mapping[str, OccurrenceRow]
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
        self, attempted: Sequence[tuple[Lease, _Attempt, bytes | None]]
    ) -> list[RelayOutcome]:
        """Relay step three for a batch: record each outcome, fenced by its own lease.

        A publication that never started (its lease lapsed first) records nothing but
        gives back the attempt its check counted, while the lease is still the latest: a
        batch that outlasts its leases (a slow broker, a claim larger than the broker's
        pace) must not spend the occurrences' attempt budget (ten) on nothing sent. If the
        transaction fails, an accepted publication is reported as an uncertain
        acknowledgement carrying its receipt, a lost broker acknowledgement as itself
        (the storage error as its ``__cause__``), any other outcome as the storage error.
        Each entry carries its capability's digest when this relay granted the lease.
        """
        if all(a.error is not None and not a.unsent for _, a, _ in attempted):
            return [self._reported(lease, a, None) for lease, a, _ in attempted]

        async def body(tx: Tx) -> list[str | SteepleError | None]:
            ids = [lease.occurrence_id for lease, a, _ in attempted if a.error is None or a.unsent]
            rows = {r.occurrence_id: r for r in await tx.repo.occurrences(ids)}
            changes: list[OccurrenceChange] = []
            notes: list[str | SteepleError | None] = []
            for lease, attempt, granted_digest in attempted:
                row = rows.get(lease.occurrence_id)
                if row is not None and not (
                    holds_lease(
                        row.lease_digest, row.lease_revision, lease.capability, lease.revision
                    )
                    if granted_digest is None
                    else holds_granted_lease(
                        row.lease_digest, row.lease_revision, granted_digest, lease.revision
                    )
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
            notes = (await self._work.run("relay", body, points="relay.record"))[0]
        except RecurringError as stored:
            return [self._reported(lease, a, stored) for lease, a, _ in attempted]
        return [
            self._reported(lease, a, None, note)
            for (lease, a, _), note in zip(attempted, notes, strict=True)
        ]

    def _unopenable_change(
        self, tx: Tx, row: OccurrenceRow | None, error: SteepleError
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
        self, tx: Tx, lease: Lease, row: OccurrenceRow | None
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
        self, tx: Tx, row: OccurrenceRow | None, failure: PublicationFailure
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
            draw=self._work.random.random(),
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
