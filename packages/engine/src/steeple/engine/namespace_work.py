"""One unit of work on a namespace, as every engine operation runs it.

:class:`NamespaceWork` runs a body in one transaction of the storage port
(:meth:`RecurringStorage.transaction`), which holds the namespace's control row. Inside it
the clock is read only after the lock was granted (time spent queued behind other
instances is never judged as earlier), judged against the database server's clock read
with the lock (:func:`~steeple.engine.opening.judge_clock`), the shared time is adopted through
:func:`steeple.core.leases.adopt_time`, the configuration binding is checked (and re-sealed
after a key rotation), and the shared time re-read just before the commit is recorded.
It also seals and opens content, classifies window-expired work and grants leases: what
both halves of the engine (:class:`~steeple.engine.RecurringEngine` and its relay steps,
:mod:`steeple.engine.relay_steps`) do the same way.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime
from typing import TypeVar

import attrs

from steeple.core import limits
from steeple.core.config import RecurringConfig, RecurringDefinition
from steeple.core.entropy import SystemRandom
from steeple.core.errors import (
    KeyringError,
    RecurringConfigurationError,
    recurring_keyring_error,
)
from steeple.core.leases import CLAIM_RULE, adopt_time, grant_leases
from steeple.core.occurrences import OccurrenceEvent, Step, states_for, step
from steeple.core.ports import Clock, RandomSource, Sealer
from steeple.core.records import Lease, ScheduleInfo, trusted_lease, validate_occurrence_id
from steeple.engine import codec
from steeple.engine.binding import seal_binding, verify_binding
from steeple.engine.crashpoints import crash_point
from steeple.engine.opening import judge_clock, recurring_errors
from steeple.engine.ports import (
    DefinitionRow,
    OccurrenceChange,
    RecurringRepository,
    RecurringStorage,
    apply_step,
)

__all__ = [
    "PURPOSE_DEFINITION",
    "PURPOSE_OCCURRENCE",
    "NamespaceWork",
    "Tx",
    "check_batch",
    "is_occurrence_id",
]

T = TypeVar("T")

PURPOSE_DEFINITION = "definition"
"""The sealing purpose of definitions (identity: the definition's name)."""
PURPOSE_OCCURRENCE = "occurrence"
"""The sealing purpose of occurrence content (identity: the occurrence id)."""

_E = OccurrenceEvent


def check_batch(items: object, kind: type, operation: str, noun: str, needs: str) -> None:
    """Refuse a batch that is not a sequence of at most 100 ``kind`` (``noun``, ``needs``).

    Raises:
        RecurringConfigurationError: saying what ``operation`` needs.
    """
    if not isinstance(items, Sequence):
        raise RecurringConfigurationError(f"{operation} needs a sequence of {noun}")
    if len(items) > limits.MAX_BATCH:
        raise RecurringConfigurationError(
            f"{operation} takes at most {limits.MAX_BATCH} {noun}; got {len(items)}"
        )
    if not all(isinstance(item, kind) for item in items):
        raise RecurringConfigurationError(f"{operation} needs {needs}")


def is_occurrence_id(value: object) -> bool:
    """Whether ``value`` has an occurrence id's shape (core's rule, shared with the admin app)."""
    try:
        validate_occurrence_id(value)
    except RecurringConfigurationError:
        return False
    return True


@attrs.define
class Tx:
    """One locked transaction as the engine sees it.

    The repository, the adopted time and the counter changes to record.
    """

    repo: RecurringRepository
    now: datetime
    definition_count: int
    occurrence_count: int
    definition_delta: int = 0
    occurrence_delta: int = 0


@attrs.define(repr=False)
class NamespaceWork:
    """The parts of one namespace's engine and the unit every operation runs in.

    Attributes:
        storage: the adapter's storage port.
        config: the namespace's configuration.
        sealer: seals and opens definitions, content and the binding.
        clock: where time comes from.
        random: capabilities, generations and jitter.
    """

    storage: RecurringStorage
    config: RecurringConfig
    sealer: Sealer
    clock: Clock
    random: RandomSource = attrs.field(factory=SystemRandom)
    _verified_binding: bytes | None = attrs.field(default=None, init=False)

    def __repr__(self) -> str:
        return f"NamespaceWork(namespace={self.config.namespace!r})"

    async def run(
        self, what: str, body: Callable[[Tx], Awaitable[T]], *, points: str | None = None
    ) -> tuple[T, datetime]:
        """Run ``body`` in one locked transaction; return its result and the recorded time.

        ``points`` names the crash points of the transaction's steps (``<points>.begin``,
        ``.written`` and ``.committed``; see :mod:`steeple.engine.crashpoints`).
        """

        async def work(repo: RecurringRepository) -> tuple[T, datetime]:
            state = repo.namespace
            # The clock is read only now, after the lock was granted, and judged against
            # the server's clock read with the lock (a host ahead of it is refused before
            # it can move the shared time).
            server = state.server_clock
            now = adopt_time(state.recorded_time, judge_clock(self.clock, server))
            if state.binding is not None:
                if state.binding != self._verified_binding:
                    # The same sealed bytes, opened with the same keyring for the same
                    # configuration, verify the same way: opened once per distinct value.
                    verify_binding(self.sealer, self.config, state.binding)
                    self._verified_binding = bytes(state.binding)
                if state.binding_key_id != self.sealer.primary_key_id:
                    # First operation after a rotation: re-seal under the current primary
                    # so the initial key is no longer needed for the binding.
                    binding = self.seal_with(
                        lambda: seal_binding(self.sealer, self.config), "the binding"
                    )
                    await repo.reseal_binding(binding, self.sealer.primary_key_id)
            tx = Tx(repo, now, state.definition_count, state.occurrence_count)
            result = await body(tx)
            # Re-checked around the commit: the recorded time includes the time spent in
            # this transaction, never moves backwards, and is judged again (a clock that
            # stepped ahead during the transaction records nothing).
            recorded = adopt_time(now, judge_clock(self.clock, server))
            await repo.record_namespace(recorded, tx.definition_delta, tx.occurrence_delta)
            if points is not None:
                crash_point(points + ".written")
            return result, recorded

        with recurring_errors(what):
            if points is None:
                return await self.storage.transaction(what, work)
            crash_point(points + ".begin")
            done = await self.storage.transaction(what, work)
            crash_point(points + ".committed")
            return done

    def seal_with(self, seal: Callable[[], bytes], record: str) -> bytes:
        """Run ``seal``; a keyring's refusal becomes a recurring error naming ``record``."""
        try:
            return seal()
        except KeyringError as exc:
            raise recurring_keyring_error(exc, record) from exc

    def seal(self, plaintext: bytes, purpose: str, identity: str) -> bytes:
        """Seal ``plaintext`` for ``purpose`` and ``identity`` (a definition's or occurrence's)."""
        try:
            return self.sealer.seal(
                plaintext, namespace=self.config.namespace, purpose=purpose, identity=identity
            )
        except KeyringError as exc:
            raise recurring_keyring_error(exc, _record(purpose, identity)) from exc

    def seal_occurrence(self, plaintext: bytes, occurrence_id: str) -> bytes:
        """Seal an occurrence's content (:meth:`seal`)."""
        return self.seal(plaintext, PURPOSE_OCCURRENCE, occurrence_id)

    def open(self, sealed: bytes, purpose: str, identity: str) -> bytes:
        """Open what :meth:`seal` sealed for ``purpose`` and ``identity``."""
        try:
            return self.sealer.open(
                bytes(sealed), namespace=self.config.namespace, purpose=purpose, identity=identity
            )
        except KeyringError as exc:
            raise recurring_keyring_error(exc, _record(purpose, identity)) from exc

    def open_occurrence(self, sealed: bytes, occurrence_id: str) -> bytes:
        """Open an occurrence's content (:meth:`open`)."""
        return self.open(sealed, PURPOSE_OCCURRENCE, occurrence_id)

    def open_document(self, sealed: bytes, name: str) -> bytes:
        """Open definition ``name``'s sealed document (:meth:`open`)."""
        return self.open(sealed, PURPOSE_DEFINITION, name)

    def open_definition(self, row: DefinitionRow) -> RecurringDefinition:
        """Open a stored definition."""
        return codec.decode_definition(self.open_document(row.sealed, row.name))

    def schedule_info(self, row: DefinitionRow) -> ScheduleInfo:
        """Return a stored definition's metadata (its message opened)."""
        return codec.schedule_info(row, self.open_definition(row).message)

    async def classify_expired(self, tx: Tx) -> None:
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

    async def grant(
        self, tx: Tx, limit: int, *, attempted: bool = False
    ) -> tuple[list[Lease], list[OccurrenceChange]]:
        """Claim's reads and decisions: the leases to grant and their changes (unwritten).

        ``attempted``: each change also counts the relay attempt (a claim that relays
        what it leases writes each occurrence once).
        """
        await self.classify_expired(tx)
        now = tx.now
        rows = await tx.repo.claimable(CLAIM_RULE, now, limit)
        grants = grant_leases(
            now, self.config.lease_duration, [row.window_ends_at for row in rows], self.random
        )
        granted: list[Lease] = []
        changes: list[OccurrenceChange] = []
        # The claim's row of the table, per state (by value: a str hashes in C, an enum
        # member in Python).
        claims: dict[str, Step] = {}
        for row, grant in zip(rows, grants, strict=True):
            if grant is None:
                continue
            claim = claims.get(row.state._value_)
            if claim is None:
                claim = claims[row.state._value_] = step(row.state, _E.CLAIM)
            revision = row.lease_revision + 1
            changes.append(
                apply_step(
                    row,
                    claim,
                    now,
                    attempted=attempted,
                    lease_expires_at=grant.expires_at,
                    lease_revision=revision,
                    lease_digest=grant.digest,
                )
            )
            granted.append(
                trusted_lease(row.occurrence_id, grant.expires_at, revision, grant.capability)
            )
        return granted, changes

    # --- relay ---------------------------------------------------------------------------


def _record(purpose: str, identity: str) -> str:
    # Built only when the keyring refuses: a tick and a relay seal and open once per
    # occurrence.
    if purpose == PURPOSE_DEFINITION:
        return f"definition {identity!r}"
    return f"occurrence {identity}"
