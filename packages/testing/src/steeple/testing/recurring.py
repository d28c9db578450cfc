"""The in-memory reference recurring store: the whole seed-000 contract without a database.

It is the oracle other stores are compared with, so it is written straight from the
contract and core's pure rules (policies, leases, the occurrence table), sharing no code
with any adapter. Everything a database adds (durability, SQL deadlines, privileges,
several processes) is out of scope; everything else behaves as the PostgreSQL store must:

- ``create``: immutable definitions; an identical replay returns the original metadata,
  a conflicting reuse raises; cancelled names stay reserved and count against the quota.
- ``tick``: per-definition planning by :func:`steeple.core.policies.plan_tick`, merged
  oldest first across definitions (due time, then name), all-or-nothing on capacity.
- ``claim``: pending, due ``retry_wait`` and expired ``leased`` occurrences, oldest first
  (due time, then definition name), each with a fresh random capability and the next
  revision.
- ``relay``: lease check (constant-time capability comparison), publication under the
  occurrence's stable idempotency key within ``min(remaining lease, 10 s)``, then the
  outcome recorded only if the lease still holds.
- ``cancel`` / ``retry_failed`` / ``schedules`` / ``occurrences`` / ``purge_terminal``.

Time: each call reads the injected clock once through :func:`steeple.core.leases.adopt_time`
against the time this store recorded last (every call, listings included, records it), so
shared time never runs backwards and a clock that trails by more than five seconds raises
:class:`~steeple.core.errors.RecurringClockError`. Every call that judges occurrences by
time (``claim``, ``occurrences``, ``purge_terminal``, ``cancel``, ``retry_failed``) first
classifies window-expired work as expired and erases its content; an expired
occurrence's last update (what ``purge_terminal`` compares) is its window's end.
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Iterable
from datetime import UTC, datetime
from types import TracebackType
from typing import Final

import attrs

from steeple.core import limits
from steeple.core.config import RecurringConfig, RecurringDefinition
from steeple.core.entropy import SystemRandom
from steeple.core.errors import (
    BrokerError,
    BrokerTimeoutError,
    RecurringCapacityError,
    RecurringConfigurationError,
    RecurringConflictError,
    RecurringInvalidStateError,
    RecurringNotFoundError,
    RecurringStorageError,
    RelayAcknowledgementError,
    RelayBrokerError,
    RelayBrokerTimeoutError,
    RelayLeaseLostError,
)
from steeple.core.idempotency import PUBLISH_PURPOSE, idempotency_key
from steeple.core.leases import (
    adopt_time,
    after_publish_failure,
    capability_matches,
    is_live,
    lease_expiry,
    new_capability,
    new_generation,
    occurrence_id_for,
    window_end,
)
from steeple.core.messages import BrokerReceipt, ScheduledMessage
from steeple.core.occurrences import (
    PURGED,
    TERMINAL_STATES,
    OccurrenceEvent,
    OccurrenceState,
    transition,
)
from steeple.core.policies import TickPlan, plan_tick, validate_budget
from steeple.core.ports import Clock, MessageBroker, RandomSource, Sealer
from steeple.core.records import (
    Lease,
    OccurrenceInfo,
    Page,
    ScheduleInfo,
    ScheduleState,
    TickResult,
    occurrence_cursor,
    parse_occurrence_cursor,
)

__all__ = ["InMemoryRecurringStore"]

_S = OccurrenceState
_E = OccurrenceEvent

_LIVE_STATES: Final = frozenset({_S.PENDING, _S.LEASED, _S.RETRY_WAIT, _S.DEAD})
"""States that hold content and that window expiry or cancellation still moves."""

DEFINITION_PURPOSE: Final = "definition"
OCCURRENCE_PURPOSE: Final = "occurrence"


# --- content encoding (only used when a sealer is given) ---------------------------------


def _encode_message(message: ScheduledMessage) -> bytes:
    return json.dumps(
        {
            "topic": message.topic,
            "message_type": message.message_type,
            "payload": base64.b64encode(message.payload).decode("ascii"),
            "headers": dict(message.headers),
        },
        sort_keys=True,
        separators=(",", ":"),
    ).encode()


def _decode_message(raw: bytes) -> ScheduledMessage:
    data = json.loads(raw)
    return ScheduledMessage(
        topic=data["topic"],
        message_type=data["message_type"],
        payload=base64.b64decode(data["payload"]),
        headers=data["headers"],
    )


# --- records --------------------------------------------------------------------------------


@attrs.define(repr=False)
class _Definition:
    definition: RecurringDefinition
    created_at: datetime
    cursor: datetime | None
    """Exclusive: the last materialized due instant (``first_after`` at first); ``None``
    once the calendar is exhausted."""
    sealed: bytes | None = None
    cancelled_at: datetime | None = None

    @property
    def name(self) -> str:
        return self.definition.name

    @property
    def active(self) -> bool:
        return self.cancelled_at is None and self.cursor is not None


@attrs.define(repr=False)
class _Occurrence:
    occurrence_id: str
    generation: bytes
    definition_name: str
    due_at: datetime
    window_ends_at: datetime
    created_at: datetime
    updated_at: datetime
    content: ScheduledMessage | bytes | None
    """The frozen message (sealed bytes when a sealer is configured); ``None`` once erased."""
    state: OccurrenceState = _S.PENDING
    attempts: int = 0
    next_attempt_at: datetime | None = None
    last_error: str | None = None
    revision: int = 0
    capability: bytes | None = None
    lease_expires_at: datetime | None = None

    def move(self, event: OccurrenceEvent, now: datetime) -> None:
        """Apply one lifecycle event through the core table (raises if illegal)."""
        following = transition(self.state, event)
        assert following is not PURGED, "purging removes the row instead"
        self.state = following
        self.updated_at = now
        if following is not _S.LEASED:
            self.lease_expires_at = None
        if following is not _S.RETRY_WAIT:
            self.next_attempt_at = None
        if following in (_S.PUBLISHED, _S.EXPIRED, _S.CANCELLED):
            # Publication, cancellation and expiry erase the content immediately.
            self.content = None

    def info(self) -> OccurrenceInfo:
        return OccurrenceInfo(
            occurrence_id=self.occurrence_id,
            definition_name=self.definition_name,
            due_at=self.due_at,
            state=self.state,
            attempts=self.attempts,
            window_ends_at=self.window_ends_at,
            created_at=self.created_at,
            next_attempt_at=self.next_attempt_at,
            last_error=self.last_error,
        )


def _aware(value: object, what: str) -> datetime:
    if not isinstance(value, datetime):
        raise TypeError(f"{what} must be a datetime, not {type(value).__name__}")
    if value.tzinfo is None or value.utcoffset() is None:
        raise ValueError(f"{what} must be timezone-aware (UTC); got naive {value.isoformat()}")
    return value.astimezone(UTC)


@attrs.define(init=False, repr=False)
class InMemoryRecurringStore:
    """The reference :class:`steeple.core.ports.RecurringStore`, held in memory.

    Args:
        config: the namespace's configuration (quotas, delivery window, lease).
        clock: where time comes from (a :class:`~steeple.testing.FakeClock` in tests).
        random: capabilities and generations; the OS's randomness by default.
        sealer: if given, definition and occurrence content is kept sealed under the
            ``"definition"`` / ``"occurrence"`` purposes, as the PostgreSQL store does.
    """

    _config: RecurringConfig
    _clock: Clock
    _random: RandomSource
    _sealer: Sealer | None
    _definitions: dict[str, _Definition]
    _occurrences: dict[str, _Occurrence]
    _recorded: datetime | None
    _closed: bool

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
        self._random = random if random is not None else SystemRandom()
        self._sealer = sealer
        self._definitions = {}
        self._occurrences = {}
        self._recorded = None
        self._closed = False

    @property
    def config(self) -> RecurringConfig:
        """The namespace configuration this store enforces."""
        return self._config

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
        self._closed = True

    # --- time and shared helpers ------------------------------------------------------------

    def _now(self) -> datetime:
        if self._closed:
            raise RecurringStorageError("the store is closed")
        shared = adopt_time(self._recorded, self._clock.now())
        self._recorded = shared
        return shared

    def _classify(self, now: datetime, occurrences: Iterable[_Occurrence] | None = None) -> None:
        for occ in list(self._occurrences.values()) if occurrences is None else occurrences:
            if occ.state in _LIVE_STATES and occ.window_ends_at <= now:
                # It expired at its window's end, however late this store noticed: purge
                # cutoffs then judge it the same whenever classification ran.
                occ.move(_E.WINDOW_EXPIRED, occ.window_ends_at)

    def _seal(
        self, message: ScheduledMessage, purpose: str, identity: str
    ) -> ScheduledMessage | bytes:
        if self._sealer is None:
            return message
        return self._sealer.seal(
            _encode_message(message),
            namespace=self._config.namespace,
            purpose=purpose,
            identity=identity,
        )

    def _open(
        self, content: ScheduledMessage | bytes, purpose: str, identity: str
    ) -> ScheduledMessage:
        if isinstance(content, ScheduledMessage):
            return content
        if self._sealer is None:
            raise RecurringStorageError("sealed content but no sealer configured")
        raw = self._sealer.open(
            content, namespace=self._config.namespace, purpose=purpose, identity=identity
        )
        return _decode_message(raw)

    def _definition_message(self, record: _Definition) -> ScheduledMessage:
        if record.sealed is None:
            return record.definition.message
        return self._open(record.sealed, DEFINITION_PURPOSE, record.name)

    def _schedule_info(self, record: _Definition) -> ScheduleInfo:
        definition = record.definition
        if record.cancelled_at is not None:
            state, next_due = ScheduleState.CANCELLED, None
        elif record.cursor is None:
            state, next_due = ScheduleState.EXHAUSTED, None
        else:
            state, next_due = ScheduleState.ACTIVE, definition.cron.next_after(record.cursor)
        return ScheduleInfo(
            name=definition.name,
            cron=definition.cron.expression,
            policy=definition.policy,
            first_after=definition.first_after,
            topic=definition.message.topic,
            message_type=definition.message.message_type,
            state=state,
            next_due_at=next_due,
            created_at=record.created_at,
            cancelled_at=record.cancelled_at,
        )

    # --- the contract ---------------------------------------------------------------------------

    async def create(self, definition: RecurringDefinition) -> ScheduleInfo:
        """Create an immutable definition, or replay an identical earlier creation.

        Returns:
            The definition's metadata; a replay returns the original ``created_at``.

        Raises:
            RecurringConfigurationError: ``definition`` is not a RecurringDefinition.
            RecurringConflictError: the name exists (even cancelled) with a different
                definition.
            RecurringCapacityError: the namespace already holds ``max_definitions``
                definitions (cancelled ones count).
            RecurringClockError: the clock trails the recorded time by more than 5 s.
            RecurringStorageError: the store is closed.
        """
        if not isinstance(definition, RecurringDefinition):
            raise RecurringConfigurationError("create() takes a RecurringDefinition")
        now = self._now()
        existing = self._definitions.get(definition.name)
        if existing is not None:
            stored = attrs.evolve(existing.definition, message=self._definition_message(existing))
            if stored != definition:
                raise RecurringConflictError(
                    f"definition {definition.name!r} already exists with different content; "
                    "definitions are immutable: cancel it and create a new name"
                )
            return self._schedule_info(existing)
        if len(self._definitions) >= self._config.max_definitions:
            raise RecurringCapacityError(
                f"namespace {self._config.namespace!r} holds {len(self._definitions)} "
                f"definitions, its quota (cancelled definitions keep their names reserved)"
            )
        sealed = None
        if self._sealer is not None:
            sealed_value = self._seal(definition.message, DEFINITION_PURPOSE, definition.name)
            assert isinstance(sealed_value, bytes)
            sealed = sealed_value
        record = _Definition(
            definition=definition, created_at=now, cursor=definition.first_after, sealed=sealed
        )
        self._definitions[definition.name] = record
        return self._schedule_info(record)

    async def tick(self, budget: int) -> TickResult:
        """Materialize due occurrences, oldest first across definitions, all or nothing.

        Args:
            budget: the most occurrences to materialize (1-100).

        Raises:
            RecurringConfigurationError: ``budget`` outside 1..100.
            RecurringCapacityError: the occurrences would exceed ``max_occurrences``;
                nothing was materialized and no cursor moved.
            RecurringClockError: the clock trails the recorded time by more than 5 s.
            RecurringStorageError: the store is closed.
        """
        validate_budget(budget)
        now = self._now()
        candidates: list[tuple[datetime, str]] = []
        plans: dict[str, TickPlan] = {}
        for record in self._definitions.values():
            if not record.active:
                continue
            assert record.cursor is not None
            definition = record.definition
            plan = plan_tick(definition.policy, definition.cron, record.cursor, now, budget)
            plans[record.name] = plan
            candidates.extend((due, record.name) for due in plan.due)
        candidates.sort()
        chosen = candidates[:budget]
        if len(self._occurrences) + len(chosen) > self._config.max_occurrences:
            raise RecurringCapacityError(
                f"materializing {len(chosen)} occurrences would exceed the quota of "
                f"{self._config.max_occurrences} (holding {len(self._occurrences)}); "
                "reduce the budget or purge terminal occurrences, then tick again"
            )
        # Plan everything first, then apply: a failure above leaves nothing half done.
        new: list[_Occurrence] = []
        taken: dict[str, list[datetime]] = {}
        for due, name in chosen:
            taken.setdefault(name, []).append(due)
            generation = new_generation(self._random)
            while occurrence_id_for(generation) in self._occurrences or any(
                o.generation == generation for o in new
            ):
                generation = new_generation(self._random)
            occurrence_id = occurrence_id_for(generation)
            record = self._definitions[name]
            new.append(
                _Occurrence(
                    occurrence_id=occurrence_id,
                    generation=generation,
                    definition_name=name,
                    due_at=due,
                    window_ends_at=window_end(now, self._config.delivery_window),
                    created_at=now,
                    updated_at=now,
                    content=self._seal(
                        self._definition_message(record), OCCURRENCE_PURPOSE, occurrence_id
                    ),
                )
            )
        exhausted: list[str] = []
        for name, dues in taken.items():
            record = self._definitions[name]
            plan = plans[name]
            # A catch-up tick cut short by the shared budget resumes after its last taken
            # due time; otherwise the plan's own cursor stands (coalesce: now).
            cursor = plan.cursor if len(dues) == len(plan.due) else dues[-1]
            if cursor is not None and record.definition.cron.next_after(cursor) is None:
                cursor = None
            record.cursor = cursor
            if cursor is None:
                exhausted.append(name)
        for occ in new:
            self._occurrences[occ.occurrence_id] = occ
        return TickResult(
            materialized=len(new),
            occurrence_ids=tuple(o.occurrence_id for o in new),
            exhausted=tuple(exhausted),
        )

    async def claim(self, limit: int) -> list[Lease]:
        """Lease up to ``limit`` publishable occurrences, fencing earlier holders.

        Oldest due time first, then definition name.

        Publishable: pending, ``retry_wait`` whose next attempt is due, and ``leased``
        whose lease expired. Window-expired occurrences are classified as expired first.

        Raises:
            RecurringConfigurationError: ``limit`` outside 1..100.
            RecurringClockError: the clock trails the recorded time by more than 5 s.
            RecurringStorageError: the store is closed.
        """
        validate_budget(limit, "limit")
        now = self._now()
        self._classify(now)
        ready = sorted(
            (
                occ
                for occ in self._occurrences.values()
                if occ.state is _S.PENDING
                or (
                    occ.state is _S.RETRY_WAIT
                    and occ.next_attempt_at is not None
                    and occ.next_attempt_at <= now
                )
                or (
                    occ.state is _S.LEASED
                    and occ.lease_expires_at is not None
                    and not is_live(occ.lease_expires_at, now)
                )
            ),
            # Oldest due first; (due, definition) identifies an occurrence, so the order is
            # total and the same in every store.
            key=lambda o: (o.due_at, o.definition_name),
        )
        leases: list[Lease] = []
        for occ in ready:
            if len(leases) >= limit:
                break
            expires = lease_expiry(now, self._config.lease_duration, occ.window_ends_at)
            if expires is None:
                # Already over when granted: never handed out; it expires normally.
                occ.move(_E.WINDOW_EXPIRED, occ.window_ends_at)
                continue
            occ.move(_E.CLAIM, now)
            occ.revision += 1
            occ.capability = new_capability(self._random)
            occ.lease_expires_at = expires
            leases.append(Lease(occ.occurrence_id, expires, occ.revision, occ.capability))
        return leases

    def _holds(self, occ: _Occurrence | None, lease: Lease) -> bool:
        """Whether ``lease`` is the occurrence's current lease (not fenced by a newer one)."""
        if occ is None or occ.capability is None or occ.revision != lease.revision:
            return False
        presented = lease.capability if isinstance(lease.capability, bytes) else b""
        return capability_matches(occ.capability, presented)

    def _record_failure(self, occ: _Occurrence, now: datetime, permanent: bool, error: str) -> None:
        decision = after_publish_failure(
            occ.attempts, now, occ.window_ends_at, permanent, draw=self._random.random()
        )
        event = (
            _E.PUBLISH_FAILED_FINAL if decision.state is _S.DEAD else _E.PUBLISH_FAILED_RETRYABLE
        )
        occ.move(event, now)
        occ.next_attempt_at = decision.next_attempt_at
        occ.last_error = error
        occ.capability = None

    async def relay(self, lease: Lease, broker: MessageBroker) -> BrokerReceipt:
        """Publish the leased occurrence and record the outcome.

        The lease is checked immediately before publication; the message and idempotency
        key are identical on every attempt; publication gets ``min(remaining lease, 10 s)``.
        An outcome is recorded only while the lease is still the occurrence's current one.

        Returns:
            The broker's receipt (``duplicate=True`` when the broker already had the key).
            A cancellation that raced an in-flight publication keeps the occurrence
            cancelled and still returns the receipt.

        Raises:
            RelayLeaseLostError: the lease expired, was fenced by a newer claim, or its
                occurrence moved on (published, cancelled, expired, purged), before or
                during publication.
            RelayAcknowledgementError: the broker accepted but the acknowledgement was
                lost; recorded as a retryable failure (the retry is deduplicated by the
                same key); ``.receipt`` is the broker's.
            RelayBrokerTimeoutError: the broker timed out (it may have accepted).
            RelayBrokerError: the broker failed (or raised something other than a
                ``BrokerError``, treated as retryable); ``.permanent`` tells whether the
                occurrence is now dead.
            RecurringClockError: the clock trails the recorded time by more than 5 s.
            RecurringStorageError: the store is closed, or sealed content cannot be opened.
        """
        now = self._now()
        occ = self._occurrences.get(lease.occurrence_id)
        if (
            occ is None
            or occ.state is not _S.LEASED
            or not self._holds(occ, lease)
            or occ.lease_expires_at is None
            or not is_live(occ.lease_expires_at, now)
        ):
            raise RelayLeaseLostError(
                f"lease on occurrence {lease.occurrence_id!r} is no longer held "
                "(expired, fenced by a newer claim, or the occurrence moved on)"
            )
        assert occ.content is not None
        message = self._open(occ.content, OCCURRENCE_PURPOSE, occ.occurrence_id)
        key = idempotency_key(
            purpose=PUBLISH_PURPOSE,
            namespace=self._config.namespace,
            definition_name=occ.definition_name,
            due_at=occ.due_at,
            generation=occ.generation,
        )
        remaining = occ.lease_expires_at - now
        timeout = min(remaining, limits.PUBLISH_DEADLINE).total_seconds()
        occ.attempts += 1
        try:
            async with asyncio.timeout(timeout):
                receipt = await broker.publish(message, idempotency_key=key, timeout=timeout)
        except RelayAcknowledgementError as exc:
            self._after_failure(lease, permanent=False, error="acknowledgement lost")
            raise exc from None
        except BrokerError as exc:
            timed_out = isinstance(exc, BrokerTimeoutError)
            self._after_failure(lease, permanent=exc.permanent, error=type(exc).__name__)
            if timed_out:
                raise RelayBrokerTimeoutError(
                    f"broker timed out publishing occurrence {lease.occurrence_id!r}"
                ) from exc
            raise RelayBrokerError(
                f"broker failed publishing occurrence {lease.occurrence_id!r}: "
                f"{type(exc).__name__}",
                permanent=exc.permanent,
            ) from exc
        except TimeoutError as exc:
            # The broker ignored its own deadline: treated as a broker timeout.
            self._after_failure(lease, permanent=False, error="TimeoutError")
            raise RelayBrokerTimeoutError(f"broker did not answer within {timeout:.3f} s") from exc
        except Exception as exc:
            # An adapter that let a driver error escape: retryable, and translated here so
            # that nothing but relay errors crosses this boundary.
            self._after_failure(lease, permanent=False, error=type(exc).__name__)
            raise RelayBrokerError(
                f"broker failed publishing occurrence {lease.occurrence_id!r}: {type(exc).__name__}"
            ) from exc
        current = self._occurrences.get(lease.occurrence_id)
        if current is not None and self._holds(current, lease):
            at = self._now()
            if current.state is _S.LEASED:
                current.move(_E.PUBLISHED, at)
                current.capability = None
                return receipt
            if current.state is _S.CANCELLED:
                # Cancelled after the final check: an in-flight publication cannot be
                # recalled; keep it cancelled and report what the broker said.
                return receipt
        raise RelayLeaseLostError(
            f"occurrence {lease.occurrence_id!r} was published, but its lease was fenced "
            "while publishing; the new holder's republication is deduplicated by the key"
        )

    def _after_failure(self, lease: Lease, *, permanent: bool, error: str) -> None:
        occ = self._occurrences.get(lease.occurrence_id)
        # A stale (fenced) holder records nothing: it cannot retry or bury the new
        # holder's occurrence.
        if occ is not None and occ.state is _S.LEASED and self._holds(occ, lease):
            self._record_failure(occ, self._now(), permanent, error)

    async def cancel(self, name: str) -> ScheduleInfo:
        """Cancel a definition permanently; its name stays reserved (and counted).

        Its pending, ``retry_wait``, leased and dead occurrences become cancelled and
        their content is erased. Cancelling again returns the same metadata.

        Raises:
            RecurringNotFoundError: no definition has that name.
            RecurringClockError: the clock trails the recorded time by more than 5 s.
            RecurringStorageError: the store is closed.
        """
        now = self._now()
        record = self._definitions.get(name)
        if record is None:
            raise RecurringNotFoundError(f"no definition named {name!r}")
        self._classify(now)
        if record.cancelled_at is None:
            record.cancelled_at = now
        for occ in self._occurrences.values():
            if occ.definition_name == name and occ.state in _LIVE_STATES:
                occ.move(_E.CANCEL, now)
        return self._schedule_info(record)

    async def retry_failed(self, occurrence_id: str) -> OccurrenceInfo:
        """Give a dead occurrence a fresh operator attempt budget inside its window.

        Raises:
            RecurringNotFoundError: no such occurrence (never existed or purged).
            RecurringInvalidStateError: it is not dead (published, cancelled, expired,
                or still being worked on).
            RecurringClockError: the clock trails the recorded time by more than 5 s.
            RecurringStorageError: the store is closed.
        """
        now = self._now()
        occ = self._occurrences.get(occurrence_id)
        if occ is None:
            raise RecurringNotFoundError(f"no occurrence {occurrence_id!r}")
        self._classify(now, [occ])
        if occ.state is not _S.DEAD:
            raise RecurringInvalidStateError(
                f"occurrence {occurrence_id!r} is {occ.state.value}; only dead occurrences "
                "can be retried"
            )
        occ.move(_E.OPERATOR_RETRY, now)
        occ.attempts = 0
        occ.capability = None
        return occ.info()

    async def schedules(self, after: str | None = None, limit: int = 100) -> Page[ScheduleInfo]:
        """List definitions' metadata by name, after the exclusive cursor.

        Raises:
            RecurringConfigurationError: ``limit`` outside 1..100, or a non-str cursor.
            RecurringClockError: the clock trails the recorded time by more than 5 s.
            RecurringStorageError: the store is closed.
        """
        validate_budget(limit, "limit")
        if after is not None and not isinstance(after, str):
            raise RecurringConfigurationError("the schedules cursor must be a str")
        self._now()
        names = sorted(n for n in self._definitions if after is None or n > after)
        page = names[:limit]
        items = [self._schedule_info(self._definitions[n]) for n in page]
        return Page(items=items, next_cursor=page[-1] if len(names) > limit else None)

    async def occurrences(self, after: str | None = None, limit: int = 100) -> Page[OccurrenceInfo]:
        """List occurrences' metadata by (due time, id), after the exclusive cursor.

        Window-expired occurrences are classified (and their content erased) first.

        Raises:
            RecurringConfigurationError: ``limit`` outside 1..100, or a cursor this store
                did not produce.
            RecurringClockError: the clock trails the recorded time by more than 5 s.
            RecurringStorageError: the store is closed.
        """
        validate_budget(limit, "limit")
        if after is not None and not isinstance(after, str):
            raise RecurringConfigurationError("the occurrences cursor must be a str")
        position = parse_occurrence_cursor(after) if after is not None else None
        now = self._now()
        self._classify(now)
        ordered = sorted(
            (
                o
                for o in self._occurrences.values()
                if position is None or (o.due_at, o.occurrence_id) > position
            ),
            key=lambda o: (o.due_at, o.occurrence_id),
        )
        page = ordered[:limit]
        cursor = (
            occurrence_cursor(page[-1].due_at, page[-1].occurrence_id)
            if len(ordered) > limit
            else None
        )
        return Page(items=[o.info() for o in page], next_cursor=cursor)

    async def purge_terminal(self, older_than: datetime, limit: int = 100) -> int:
        """Remove up to ``limit`` terminal occurrences last updated before ``older_than``.

        Terminal: published, dead, expired, cancelled; oldest update first, then due time,
        then definition name.

        Returns:
            How many occurrences were removed.

        Raises:
            RecurringConfigurationError: ``limit`` outside 1..100.
            ValueError: ``older_than`` is naive.
            TypeError: ``older_than`` is not a datetime.
            RecurringClockError: the clock trails the recorded time by more than 5 s.
            RecurringStorageError: the store is closed.
        """
        validate_budget(limit, "limit")
        cutoff = _aware(older_than, "older_than")
        now = self._now()
        self._classify(now)
        doomed = sorted(
            (
                o
                for o in self._occurrences.values()
                if o.state in TERMINAL_STATES and o.updated_at < cutoff
            ),
            key=lambda o: (o.updated_at, o.due_at, o.definition_name),
        )[:limit]
        for occ in doomed:
            assert transition(occ.state, _E.PURGE) is PURGED
            del self._occurrences[occ.occurrence_id]
        return len(doomed)
