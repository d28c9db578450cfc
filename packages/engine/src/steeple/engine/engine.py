"""The recurring engine: every recurring-publication operation, once, over the persistence port.

Each call is one unit of :class:`~steeple.engine.namespace_work.NamespaceWork`: one
transaction (:meth:`RecurringStorage.transaction`) that holds the namespace's control row,
adopts and records the shared time and checks the configuration binding; inside it the
engine does the operation's reads, decisions (all in :mod:`steeple.core`) and writes.
Calls that hand out time-bounded work (``claim``, ``relay``) judge it once more after the
commit. The relay's three steps (check, publish, record) are
:mod:`steeple.engine.relay_steps`; what every operation promises is documented once, on
:class:`~steeple.engine.EngineStore`, the public face every store shares.
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence
from datetime import datetime
from typing import Final

import attrs

from steeple.core import limits
from steeple.core.calendar import shared_calendar
from steeple.core.config import RecurringConfig, RecurringDefinition, is_definition_name
from steeple.core.entropy import SystemRandom
from steeple.core.errors import (
    InvalidTransitionError,
    RecurringCapacityError,
    RecurringConfigurationError,
    RecurringConflictError,
    RecurringInvalidStateError,
    RecurringNotFoundError,
    shown,
)
from steeple.core.leases import is_live, new_occurrence_ids, window_end
from steeple.core.messages import BrokerReceipt
from steeple.core.occurrences import OccurrenceEvent, states_for, step
from steeple.core.policies import plan_due, validate_budget
from steeple.core.ports import Clock, MessageBroker, RandomSource, Sealer
from steeple.core.records import (
    Lease,
    OccurrenceInfo,
    Page,
    RelayOutcome,
    ScheduleInfo,
    ScheduleState,
    TickResult,
)
from steeple.engine import codec
from steeple.engine.crashpoints import crash_point
from steeple.engine.namespace_work import (
    PURPOSE_DEFINITION,
    PURPOSE_OCCURRENCE,
    NamespaceWork,
    Tx,
    check_batch,
    is_occurrence_id,
)
from steeple.engine.opening import check_parts, read_clock
from steeple.engine.ports import (
    DefinitionRow,
    DefinitionUpdate,
    OccurrenceRow,
    RecurringStorage,
    apply_step,
    pending_row,
)
from steeple.engine.relay_steps import RelaySteps

__all__ = ["PURPOSE_DEFINITION", "PURPOSE_OCCURRENCE", "RecurringEngine"]

_E = OccurrenceEvent
_PURGEABLE = frozenset().union(*states_for(_E.PURGE).values())


_calendar: Final = shared_calendar
"""Parsing is pure and the expressions of a namespace repeat on every tick: one calendar each."""


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


def _random_or_system(random: RandomSource | None) -> RandomSource:
    return SystemRandom() if random is None else random


@attrs.define(repr=False)
class RecurringEngine:
    """Every recurring-publication operation of one namespace, over a :class:`RecurringStorage`.

    A store composes one (:class:`~steeple.engine.EngineStore` forwards its public calls
    here). The engine holds no connection and no state of its own.

    Its arguments, in order (attrs keeps them private, so they are listed here):

    - ``storage``: the adapter (PostgreSQL, SQLite, in memory, yours).
    - ``config``: the namespace's configuration (quotas, delivery window, lease).
    - ``sealer``: seals and opens definitions and content (a
      :class:`steeple.keyring.Keyring`).
    - ``clock``: where time comes from (``SystemClock`` in production).
    - ``random``: capabilities, generations and jitter (the OS's randomness when omitted or
      ``None``).

    Raises:
        RecurringConfigurationError: an argument of the wrong kind.
    """

    _storage: RecurringStorage
    _config: RecurringConfig
    _sealer: Sealer
    _clock: Clock
    _random: RandomSource = attrs.field(default=None, converter=_random_or_system)
    _work: NamespaceWork = attrs.field(init=False)
    _relays: RelaySteps = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        check_parts(self._config, self._sealer, self._clock, sealer_is="sealer")
        if not callable(getattr(self._storage, "transaction", None)):
            raise RecurringConfigurationError("storage must implement RecurringStorage")
        self._work = NamespaceWork(
            self._storage, self._config, self._sealer, self._clock, self._random
        )
        self._relays = RelaySteps(self._work)

    def __repr__(self) -> str:
        return f"RecurringEngine(namespace={self._config.namespace!r})"

    @property
    def config(self) -> RecurringConfig:
        """The namespace's configuration."""
        return self._config

    # --- definitions ---------------------------------------------------------------------

    async def create(self, definition: RecurringDefinition) -> ScheduleInfo:
        """Run ``create`` (documented on :class:`~steeple.engine.EngineStore`)."""
        if not isinstance(definition, RecurringDefinition):
            raise RecurringConfigurationError("create needs a RecurringDefinition")
        [result] = await self.create_many([definition])
        if isinstance(result, RecurringConflictError):
            raise result
        return result

    async def create_many(
        self, definitions: Sequence[RecurringDefinition]
    ) -> list[ScheduleInfo | RecurringConflictError]:
        """Run ``create_many`` (documented on :class:`~steeple.engine.EngineStore`)."""
        check_batch(
            definitions, RecurringDefinition, "create_many", "definitions", "RecurringDefinitions"
        )
        if not definitions:
            return []
        # Encoded outside the transaction: the control row is held for storage work only.
        contents = [codec.encode_message(d.message) for d in definitions]
        documents: dict[str, bytes] = {}  # the first entry of a name is the one created
        for d in definitions:
            documents.setdefault(d.name, codec.encode_definition(d))

        async def body(tx: Tx) -> list[ScheduleInfo | RecurringConflictError]:
            names = list(dict.fromkeys(d.name for d in definitions))
            stored = {
                row.name: (row, self._work.open_definition(row))
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

        return (await self._work.run("create", body))[0]

    def _definition_row(
        self, definition: RecurringDefinition, document: bytes, now: datetime
    ) -> DefinitionRow:
        """Return the row that stores a new ``definition`` (``document``: its encoding)."""
        name = definition.name
        return DefinitionRow(
            name=name,
            sealed=self._work.seal(document, PURPOSE_DEFINITION, name),
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
        """Run ``cancel`` (documented on :class:`~steeple.engine.EngineStore`)."""
        if not isinstance(name, str):
            raise RecurringConfigurationError("a definition name is a str")

        async def body(tx: Tx) -> ScheduleInfo:
            # A name no definition can have is not looked up (nor sent to a database).
            row = await tx.repo.definition(name) if is_definition_name(name) else None
            if row is None:
                raise RecurringNotFoundError(
                    f"no definition named {shown(name)} in namespace {self._config.namespace!r}"
                )
            # Work whose window already ended is expired, not cancelled.
            await self._work.classify_expired(tx)
            info = self._work.schedule_info(row)
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

        return (await self._work.run("cancel", body))[0]

    async def schedules(self, after: str | None = None, limit: int = 100) -> Page[ScheduleInfo]:
        """Run ``schedules`` (documented on :class:`~steeple.engine.EngineStore`)."""
        limit = validate_budget(limit, "limit")
        if after is not None and not is_definition_name(after):
            # Cursors are names this store returned; anything else is refused up front.
            raise RecurringConfigurationError(
                "invalid schedules cursor: pass back a next_cursor this store returned"
            )

        async def body(tx: Tx) -> Page[ScheduleInfo]:
            rows = await tx.repo.definitions(after, limit + 1)
            items = [self._work.schedule_info(r) for r in rows[:limit]]
            more = len(rows) > limit
            return Page(items=items, next_cursor=items[-1].name if more else None)

        return (await self._work.run("schedules", body))[0]

    # --- tick ----------------------------------------------------------------------------

    async def tick(self, budget: int) -> TickResult:
        """Run ``tick`` (documented on :class:`~steeple.engine.EngineStore`)."""
        budget = validate_budget(budget)

        async def body(tx: Tx) -> TickResult:
            now = tx.now
            rows = {r.name: r for r in await tx.repo.due_definitions(now, budget)}
            emitted, advanced, exhausted = plan_due(
                (
                    (r.name, r.policy, _calendar(r.cron), r.cursor, r.next_due_at)
                    for r in rows.values()
                ),
                now,
                budget,
            )
            if tx.occurrence_count + len(emitted) > self._config.max_occurrences:
                raise RecurringCapacityError(
                    f"materializing {len(emitted)} occurrences would exceed the quota of "
                    f"{self._config.max_occurrences} ({tx.occurrence_count} stored); nothing "
                    "was materialized: tick a smaller budget or purge terminal occurrences"
                )
            messages: dict[str, bytes] = {}
            created: list[OccurrenceRow] = []
            window = window_end(now, self._config.delivery_window)
            key_id = self._sealer.primary_key_id
            seal = self._work.seal_occurrence
            next_id = new_occurrence_ids(self._random).__next__
            ids: list[str] = []
            for name, due in emitted:
                message = messages.get(name)
                if message is None:
                    opened = self._work.open_document(rows[name].sealed, name)
                    message = messages[name] = codec.definition_message_plaintext(opened)
                occurrence_id = next_id()
                ids.append(occurrence_id)
                created.append(
                    pending_row(
                        occurrence_id,
                        name,
                        due,
                        window,
                        now,
                        seal(message, occurrence_id),
                        key_id,
                    )
                )
            if created:
                await tx.repo.insert_occurrences(created)
                crash_point("tick.inserted")
            if advanced:
                active, ended = ScheduleState.ACTIVE, ScheduleState.EXHAUSTED
                update = DefinitionUpdate.built  # one per definition that emitted
                await tx.repo.update_definitions(
                    [
                        update(name, active, cursor, following, None)
                        if following is not None
                        else update(name, ended, cursor, None, None)
                        for name, cursor, following in advanced
                    ]
                )
            tx.occurrence_delta = len(created)
            return TickResult(
                materialized=len(created), occurrence_ids=tuple(ids), exhausted=tuple(exhausted)
            )

        return (await self._work.run("tick", body, points="tick"))[0]

    # --- claim ---------------------------------------------------------------------------

    async def claim(self, limit: int) -> list[Lease]:
        """Run ``claim`` (documented on :class:`~steeple.engine.EngineStore`)."""
        limit = validate_budget(limit, "limit")

        async def body(tx: Tx) -> list[Lease]:
            granted, changes = await self._work.grant(tx, limit)
            if changes:
                await tx.repo.update_occurrences(changes)
            return granted

        granted, recorded = await self._work.run("claim", body, points="claim")
        # Judged after the commit: a lease that lapsed while the claim committed is not
        # handed out; its occurrence stays claimable for the next claim.
        after = max(recorded, read_clock(self._clock))
        return [lease for lease in granted if is_live(lease.expires_at, after)]

    # --- relay: its three steps are :class:`~steeple.engine.relay_steps.RelaySteps` ------

    async def relay(self, lease: Lease, broker: MessageBroker) -> BrokerReceipt:
        """Run ``relay`` (documented on :class:`~steeple.engine.EngineStore`)."""
        return await self._relays.relay(lease, broker)

    async def relay_many(
        self,
        leases: Sequence[Lease],
        broker: MessageBroker,
        *,
        concurrency: int = limits.RELAY_CONCURRENCY,
    ) -> list[RelayOutcome]:
        """Run ``relay_many`` (documented on :class:`~steeple.engine.EngineStore`)."""
        return await self._relays.relay_many(leases, broker, concurrency=concurrency)

    async def claim_and_relay(
        self,
        limit: int,
        broker: MessageBroker,
        *,
        concurrency: int = limits.RELAY_CONCURRENCY,
    ) -> list[RelayOutcome]:
        """Run ``claim_and_relay`` (documented on :class:`~steeple.engine.EngineStore`)."""
        return await self._relays.claim_and_relay(limit, broker, concurrency=concurrency)

    # --- operator actions and listings ---------------------------------------------------

    async def retry_failed(self, occurrence_id: str) -> OccurrenceInfo:
        """Run ``retry_failed`` (documented on :class:`~steeple.engine.EngineStore`)."""
        if not isinstance(occurrence_id, str):
            raise RecurringConfigurationError("an occurrence id is a str")

        async def body(tx: Tx) -> OccurrenceInfo:
            await self._work.classify_expired(tx)
            rows = (
                await tx.repo.occurrences([occurrence_id])
                if is_occurrence_id(occurrence_id)
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

        return (await self._work.run("retry_failed", body))[0]

    async def occurrences(self, after: str | None = None, limit: int = 100) -> Page[OccurrenceInfo]:
        """Run ``occurrences`` (documented on :class:`~steeple.engine.EngineStore`)."""
        limit = validate_budget(limit, "limit")
        position = codec.parse_occurrence_cursor(after)

        async def body(tx: Tx) -> Page[OccurrenceInfo]:
            await self._work.classify_expired(tx)
            rows = await tx.repo.occurrence_page(position, limit + 1)
            items = codec.occurrence_infos(rows[:limit])
            cursor = None
            if len(rows) > limit:
                cursor = codec.occurrence_cursor(items[-1].due_at, items[-1].occurrence_id)
            return Page(items=items, next_cursor=cursor)

        return (await self._work.run("occurrences", body))[0]

    async def purge_terminal(self, older_than: datetime, limit: int = 100) -> int:
        """Run ``purge_terminal`` (documented on :class:`~steeple.engine.EngineStore`)."""
        limit = validate_budget(limit, "limit")
        if not isinstance(older_than, datetime) or older_than.utcoffset() is None:
            raise RecurringConfigurationError(
                "older_than must be a timezone-aware datetime (steeple works in UTC)"
            )

        async def body(tx: Tx) -> int:
            await self._work.classify_expired(tx)
            removed = await tx.repo.delete_occurrences(_PURGEABLE, older_than, limit)
            tx.occurrence_delta = -removed
            return removed

        return (await self._work.run("purge_terminal", body))[0]
