"""The recurring-store conformance suite: a hypothesis state machine any store can run.

:class:`RecurringStoreConformance` drives the store under test through random sequences
of the contract's operations (create, replayed and conflicting create, tick, claim, relay
through a :class:`~steeple.testing.MemoryBroker` with injected faults, batched relays
with ``relay_many`` and ``claim_and_relay``, cancel, retry_failed, purge, clock moves
forward and small/large regressions) beside an
independent model made of plain dicts. The model shares no code with any store: it has
its own calendar arithmetic (the suite only uses ``*/n``-minute calendars), its own
planning, lease and backoff rules. After every step it checks that

- no occurrence is lost or duplicated: the store lists exactly the model's occurrences,
  each ``(definition, due time)`` is materialized at most once, ever;
- every published occurrence reached the broker, and the broker holds one copy per key;
- an occurrence's idempotency key is the same on every attempt, and differs between
  occurrences;
- a fenced-out or expired lease never publishes or records anything: a lease that lapsed
  and was taken over is refused at the relay's check (nothing sent, no attempt counted),
  and a lease taken over while its publication is in flight records nothing of it;
- quotas hold, and listing pages (1-100 items, exclusive cursors) agree with the model.

A store opts in with a few lines::

    async def make_store(config: RecurringConfig, clock: Clock) -> RecurringStore:
        return InMemoryRecurringStore(config, clock)

    def test_conformance() -> None:
        run_recurring_conformance(make_store)

The factory is awaited inside an :class:`asyncio.Runner` the machine owns, once per
example, with a fresh namespace each time; ``close`` (the store's ``close()`` by default)
runs at the end of each example in the same runner.

Contract details the suite pins down (the reference store behaves so): ticks and claims
take the oldest due times first (due time, then definition name); purges take the oldest
last update first (then due time, then name); every call except
``schedules`` adopts and records the shared time; ``claim``, ``occurrences``,
``purge_terminal``, ``cancel`` and ``retry_failed`` classify window-expired work first,
and an expired occurrence's last update (what purge cutoffs compare) is its window end;
an occurrence whose lease lapsed stays ``leased`` until reclaimed; ``attempts`` counts
publication attempts and ``retry_failed`` resets it to zero; cancelling twice is not an
error; relay failures back off by ``RELAY_BACKOFF`` (1 s doubling to 5 min, no jitter);
``relay_many`` returns one outcome per lease in the order given, publishes each live lease
once (a repeated lease once, stale ones never), and starts the publications in the
batch's order (the queued broker faults apply in that order); ``claim_and_relay``
returns one outcome per occurrence claimed, oldest due first.
"""

from __future__ import annotations

import asyncio
import itertools
import os
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
from datetime import UTC, datetime, timedelta
from typing import Any, ClassVar, TypeVar

import attrs
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from steeple.core.config import RecurringConfig, RecurringDefinition
from steeple.core.errors import (
    RecurringCapacityError,
    RecurringClockError,
    RecurringConflictError,
    RecurringInvalidStateError,
    RecurringNotFoundError,
    RelayAcknowledgementError,
    RelayBrokerError,
    RelayBrokerTimeoutError,
    RelayLeaseLostError,
)
from steeple.core.messages import ScheduledMessage
from steeple.core.policies import MissedRunPolicy
from steeple.core.ports import Clock, RecurringStore
from steeple.core.records import Lease, OccurrenceInfo, RelayOutcome, ScheduleInfo
from steeple.engine.memory_broker import BrokerFault, MemoryBroker
from steeple.testing.clock import FakeClock

__all__ = [
    "DEFAULT_SETTINGS",
    "MakeStore",
    "RecurringStoreConformance",
    "recurring_conformance_machine",
    "run_recurring_conformance",
]

MakeStore = Callable[[RecurringConfig, Clock], Awaitable[RecurringStore]]
"""Builds the store under test for one example (awaited inside the machine's runner)."""
CloseStore = Callable[[RecurringStore], Awaitable[None]]

T = TypeVar("T")

START = datetime(2031, 5, 17, 3, 14, 15, 926000, tzinfo=UTC)
"""An odd epoch: hidden wall-clock reads produce visibly wrong instants."""
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
NAMES = ("alpha", "beta", "gamma", "delta")
CALENDARS = {"* * * * *": 1, "*/5 * * * *": 5, "*/15 * * * *": 15, "0 * * * *": 60}
"""Cron expressions the suite uses, with their period in minutes (the model's calendar)."""
PAYLOADS = (b"", b"x", b"hello, occurrence")
TOPIC, MESSAGE_TYPE = "steeple.conformance", "reminder.requested"
MAX_RELAY_ATTEMPTS = 10
BACKOFF_INITIAL, BACKOFF_MAX = timedelta(seconds=1), timedelta(minutes=5)
CLOCK_TOLERANCE = timedelta(seconds=5)
OCC_PAGE, SCHEDULE_PAGE = 7, 3
LIVE = frozenset({"pending", "leased", "retry_wait", "dead"})
TERMINAL = frozenset({"published", "dead", "expired", "cancelled"})
_namespaces = itertools.count(1)

DEFAULT_SETTINGS = settings(
    max_examples=60,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
"""What :func:`run_recurring_conformance` uses unless told otherwise."""


# --- the model ------------------------------------------------------------------------------


def _next_due(period_minutes: int, after: datetime) -> datetime:
    """Return the first multiple of the period (counted from the epoch) after ``after``."""
    period = timedelta(minutes=period_minutes)
    return EPOCH + ((after - EPOCH) // period + 1) * period


def _backoff(attempts: int) -> timedelta:
    delay = BACKOFF_INITIAL
    for _ in range(attempts - 1):
        if delay >= BACKOFF_MAX:
            break
        delay *= 2
    return min(delay, BACKOFF_MAX)


@attrs.define
class _Schedule:
    name: str
    cron: str
    period: int
    policy: MissedRunPolicy
    first_after: datetime
    payload: bytes
    headers: dict[str, str]
    created_at: datetime
    cursor: datetime
    cancelled_at: datetime | None = None

    def identity(self) -> tuple[Any, ...]:
        return (self.cron, self.policy, self.first_after, self.payload, self.headers)

    def message(self) -> ScheduledMessage:
        return ScheduledMessage(TOPIC, MESSAGE_TYPE, self.payload, self.headers)


@attrs.define
class _Occurrence:
    occurrence_id: str
    name: str
    due_at: datetime
    window_ends_at: datetime
    created_at: datetime
    updated_at: datetime
    state: str = "pending"
    attempts: int = 0
    next_attempt_at: datetime | None = None
    lease: Lease | None = None
    key: str | None = None


@attrs.frozen
class _Outcome:
    value: Any = None
    error: BaseException | None = None


# --- the machine ----------------------------------------------------------------------------


class RecurringStoreConformance(RuleBasedStateMachine):
    """The store under test beside an independent model; build with a factory.

    Use :func:`recurring_conformance_machine` (or :func:`run_recurring_conformance`) to
    bind a store factory; this base class has none.
    """

    make_store: ClassVar[MakeStore | None] = None
    close_store: ClassVar[CloseStore | None] = None

    def __init__(self) -> None:
        super().__init__()
        self.runner = asyncio.Runner()
        self.store: RecurringStore | None = None
        self.clock = FakeClock(START)
        self.broker = MemoryBroker()
        self.config: RecurringConfig | None = None
        self.recorded: datetime | None = None
        self.schedules: dict[str, _Schedule] = {}
        self.occurrences: dict[str, _Occurrence] = {}
        self.materialized: set[tuple[str, datetime]] = set()
        self.key_owner: dict[str, str] = {}
        self.accepted: set[str] = set()
        self.faults: deque[BrokerFault] = deque()
        self.leases: list[Lease] = []

    # --- plumbing ------------------------------------------------------------------------------

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.runner.run(coro)

    def _try(self, coro: Coroutine[Any, Any, Any]) -> _Outcome:
        try:
            return _Outcome(value=self._run(coro))
        except Exception as exc:  # the rule asserts on the exact error
            return _Outcome(error=exc)

    @property
    def _store(self) -> RecurringStore:
        assert self.store is not None
        return self.store

    @property
    def _config(self) -> RecurringConfig:
        assert self.config is not None
        return self.config

    def _now(self) -> datetime:
        """Return the model's shared time for the next store call; classify expired work."""
        local = self.clock.now()
        now = local if self.recorded is None else max(local, self.recorded)
        self.recorded = now
        for occ in self.occurrences.values():
            if occ.state in LIVE and occ.window_ends_at <= now:
                self._move(occ, "expired", occ.window_ends_at)
        return now

    def _ordered_ids(self) -> list[str]:
        """Occurrence ids by (due, definition): independent of the store's random ids."""
        return sorted(self.occurrences, key=lambda i: self._order(self.occurrences[i]))

    @staticmethod
    def _order(occ: _Occurrence) -> tuple[datetime, str]:
        return (occ.due_at, occ.name)

    @staticmethod
    def _move(occ: _Occurrence, state: str, now: datetime) -> None:
        occ.state = state
        occ.updated_at = now
        if state != "leased":
            occ.lease = None
        if state != "retry_wait":
            occ.next_attempt_at = None

    def _list_occurrences(self) -> dict[str, OccurrenceInfo]:
        self._now()
        found: dict[str, OccurrenceInfo] = {}
        cursor: str | None = None
        previous: tuple[datetime, str] | None = None
        for _ in range(len(self.occurrences) + 3):
            page = self._run(self._store.occurrences(after=cursor, limit=OCC_PAGE))
            assert len(page.items) <= OCC_PAGE, "a page holds more items than its limit"
            for info in page.items:
                position = (info.due_at, info.occurrence_id)
                assert previous is None or position > previous, (
                    "occurrences are not listed in (due_at, occurrence_id) order"
                )
                previous = position
                assert info.occurrence_id not in found, "an occurrence was listed twice"
                found[info.occurrence_id] = info
            if page.next_cursor is None:
                return found
            assert page.items, "an empty page carried a next cursor"
            cursor = page.next_cursor
        raise AssertionError("occurrence pages never ended")

    def _list_schedules(self) -> dict[str, ScheduleInfo]:
        found: dict[str, ScheduleInfo] = {}
        cursor: str | None = None
        for _ in range(len(self.schedules) + 3):
            page = self._run(self._store.schedules(after=cursor, limit=SCHEDULE_PAGE))
            assert len(page.items) <= SCHEDULE_PAGE, "a page holds more items than its limit"
            for info in page.items:
                assert info.name not in found, "a schedule was listed twice"
                assert not found or info.name > max(found), "schedules are not in name order"
                found[info.name] = info
            if page.next_cursor is None:
                return found
            cursor = page.next_cursor
        raise AssertionError("schedule pages never ended")

    def _check_schedule(self, info: ScheduleInfo, model: _Schedule) -> None:
        assert info.name == model.name
        assert info.created_at == model.created_at, "created_at is not the original"
        assert info.cron == model.cron
        assert info.policy is model.policy
        assert info.first_after == model.first_after
        assert (info.topic, info.message_type) == (TOPIC, MESSAGE_TYPE)
        if model.cancelled_at is not None:
            assert info.state == "cancelled", f"{model.name} should be cancelled"
            assert info.cancelled_at == model.cancelled_at
            assert info.next_due_at is None
        else:
            assert info.state == "active", f"{model.name} is {info.state}, not active"
            assert info.cancelled_at is None
            assert info.next_due_at == _next_due(model.period, model.cursor), (
                f"{model.name}: next due {info.next_due_at} != model's "
                f"{_next_due(model.period, model.cursor)}"
            )

    # --- setup and teardown -----------------------------------------------------------------

    @initialize(
        lease_s=st.sampled_from([5, 30, 60]),
        window=st.sampled_from(["two-leases", "10min", "1day"]),
        max_definitions=st.integers(1, 4),
        max_occurrences=st.sampled_from([3, 8, 25]),
        first_cron=st.sampled_from(["* * * * *", "*/5 * * * *"]),
        first_offset_s=st.sampled_from([600, 3 * 3600]),
    )
    def setup(
        self,
        lease_s: int,
        window: str,
        max_definitions: int,
        max_occurrences: int,
        first_cron: str,
        first_offset_s: int,
    ) -> None:
        """Build the configuration and the store under test, with one definition in it."""
        lease = timedelta(seconds=lease_s)
        delivery = {
            "two-leases": 2 * lease,
            "10min": timedelta(minutes=10),
            "1day": timedelta(days=1),
        }[window]
        self.config = RecurringConfig(
            f"conformance-{next(_namespaces)}-{os.urandom(4).hex()}",
            max_definitions,
            max_occurrences,
            delivery_window=delivery,
            lease_duration=lease,
        )
        factory = type(self).make_store
        if factory is None:
            raise TypeError("bind a store factory with recurring_conformance_machine()")
        self.store = self._run(_awaitable(factory(self.config, self.clock)))
        # One catching-up definition with a backlog, so that early steps have work to do.
        self._create(
            NAMES[0], first_cron, MissedRunPolicy.CATCH_UP, first_offset_s, PAYLOADS[2], {}
        )

    def teardown(self) -> None:
        """Close the store and the runner."""
        try:
            if self.store is not None:
                closer = type(self).close_store
                self._run(_awaitable(closer(self.store) if closer else self.store.close()))
        finally:
            self.runner.close()

    # --- definitions ----------------------------------------------------------------------------

    def _definition(self, model: _Schedule, payload: bytes | None = None) -> RecurringDefinition:
        return RecurringDefinition(
            model.name,
            model.cron,
            model.first_after,
            model.policy,
            ScheduledMessage(
                TOPIC, MESSAGE_TYPE, model.payload if payload is None else payload, model.headers
            ),
        )

    @rule(
        name=st.sampled_from(NAMES),
        cron=st.sampled_from(sorted(CALENDARS)),
        policy=st.sampled_from([MissedRunPolicy.CATCH_UP, MissedRunPolicy.COALESCE]),
        offset_s=st.sampled_from([0, 59, 600, 3 * 3600]),
        payload=st.sampled_from(PAYLOADS),
        headers=st.sampled_from([{}, {"x-tenant": "t1"}]),
    )
    def create(
        self,
        name: str,
        cron: str,
        policy: MissedRunPolicy,
        offset_s: int,
        payload: bytes,
        headers: dict[str, str],
    ) -> None:
        """Create a definition: new, identical replay, conflict or over quota."""
        self._create(name, cron, policy, offset_s, payload, headers)

    def _create(
        self,
        name: str,
        cron: str,
        policy: MissedRunPolicy,
        offset_s: int,
        payload: bytes,
        headers: dict[str, str],
    ) -> None:
        now = self._now()
        candidate = _Schedule(
            name=name,
            cron=cron,
            period=CALENDARS[cron],
            policy=policy,
            first_after=self.clock.now() - timedelta(seconds=offset_s),
            payload=payload,
            headers=headers,
            created_at=now,
            cursor=self.clock.now() - timedelta(seconds=offset_s),
        )
        outcome = self._try(self._store.create(self._definition(candidate)))
        existing = self.schedules.get(name)
        if existing is not None:
            if existing.identity() == candidate.identity():
                assert outcome.error is None, f"identical replay failed: {outcome.error!r}"
                self._check_schedule(outcome.value, existing)
            else:
                assert isinstance(outcome.error, RecurringConflictError), (
                    f"conflicting reuse of {name!r} gave {outcome.error!r}"
                )
            return
        if len(self.schedules) >= self._config.max_definitions:
            assert isinstance(outcome.error, RecurringCapacityError), (
                f"definition quota not enforced: {outcome.error!r}"
            )
            return
        assert outcome.error is None, f"create failed: {outcome.error!r}"
        self.schedules[name] = candidate
        self._check_schedule(outcome.value, candidate)

    @precondition(lambda self: bool(self.schedules))
    @rule(index=st.integers(0, 99))
    def replay_create(self, index: int) -> None:
        """Replay an existing definition exactly: the original metadata comes back."""
        model = sorted(self.schedules.values(), key=lambda s: s.name)[index % len(self.schedules)]
        self._now()
        outcome = self._try(self._store.create(self._definition(model)))
        assert outcome.error is None, f"identical replay failed: {outcome.error!r}"
        self._check_schedule(outcome.value, model)

    @precondition(lambda self: bool(self.schedules))
    @rule(index=st.integers(0, 99))
    def conflicting_create(self, index: int) -> None:
        """Reuse an existing name with different content: a conflict, nothing changes."""
        model = sorted(self.schedules.values(), key=lambda s: s.name)[index % len(self.schedules)]
        self._now()
        outcome = self._try(self._store.create(self._definition(model, model.payload + b"!")))
        assert isinstance(outcome.error, RecurringConflictError), (
            f"conflicting reuse gave {outcome.error!r}"
        )

    @rule(index=st.integers(0, 99))
    def cancel(self, index: int) -> None:
        """Cancel a definition (or an unknown name): permanent, occurrences cancelled."""
        names = [*sorted(self.schedules), "nobody"]
        name = names[index % len(names)]
        now = self._now()
        outcome = self._try(self._store.cancel(name))
        model = self.schedules.get(name)
        if model is None:
            assert isinstance(outcome.error, RecurringNotFoundError), (
                f"cancelling an unknown name gave {outcome.error!r}"
            )
            return
        assert outcome.error is None, f"cancel failed: {outcome.error!r}"
        if model.cancelled_at is None:
            model.cancelled_at = now
        for occ in self.occurrences.values():
            if occ.name == name and occ.state in LIVE:
                self._move(occ, "cancelled", now)
        self._check_schedule(outcome.value, model)

    # --- ticks and claims -----------------------------------------------------------------------

    @rule(budget=st.one_of(st.integers(1, 12), st.just(100)))
    def tick(self, budget: int) -> None:
        """Materialize due occurrences: oldest first, budgeted, all or nothing."""
        self._tick(budget)

    @rule(budget=st.integers(1, 12), limit=st.integers(1, 6))
    def worker_cycle(self, budget: int, limit: int) -> None:
        """Act as a whole worker loop iteration: tick, claim, relay every new lease."""
        self._tick(budget)
        self._claim_and_relay(limit)

    def _tick(self, budget: int) -> None:
        now = self._now()
        candidates: list[tuple[datetime, str]] = []
        for model in self.schedules.values():
            if model.cancelled_at is not None:
                continue
            due = _next_due(model.period, model.cursor)
            if model.policy is MissedRunPolicy.CATCH_UP:
                taken = 0
                while due <= now and taken < budget:
                    candidates.append((due, model.name))
                    due = _next_due(model.period, due)
                    taken += 1
            elif due <= now:
                candidates.append((due, model.name))
        chosen = sorted(candidates)[:budget]
        outcome = self._try(self._store.tick(budget))
        if len(self.occurrences) + len(chosen) > self._config.max_occurrences:
            assert isinstance(outcome.error, RecurringCapacityError), (
                f"occurrence quota not enforced: {outcome.error!r}"
            )
            return
        assert outcome.error is None, f"tick failed: {outcome.error!r}"
        result = outcome.value
        assert result.materialized == len(chosen), (
            f"tick materialized {result.materialized}, the model expects {len(chosen)}"
        )
        new_ids = set(result.occurrence_ids)
        assert len(new_ids) == len(chosen) == len(result.occurrence_ids)
        assert not new_ids & set(self.occurrences), "a new occurrence reused an existing id"
        listed = self._list_occurrences()
        pairs = {(listed[i].due_at, listed[i].definition_name): i for i in new_ids}
        assert set(pairs) == set(chosen), (
            "the tick materialized other due times than the oldest outstanding ones"
        )
        # In (due, name) order, so the model never depends on the store's random ids.
        for (due, name), occurrence_id in sorted(pairs.items()):
            assert (name, due) not in self.materialized, f"{name} at {due} materialized twice"
            self.materialized.add((name, due))
            self.occurrences[occurrence_id] = _Occurrence(
                occurrence_id=occurrence_id,
                name=name,
                due_at=due,
                window_ends_at=now + self._config.delivery_window,
                created_at=now,
                updated_at=now,
            )
        for name in {name for _, name in chosen}:
            model = self.schedules[name]
            if model.policy is MissedRunPolicy.CATCH_UP:
                model.cursor = max(due for due, n in chosen if n == name)
            else:
                model.cursor = now

    @rule(limit=st.integers(1, 6))
    def claim(self, limit: int) -> None:
        """Lease publishable occurrences with fresh capabilities, fencing old holders."""
        self._claim_and_check(limit)

    @rule(limit=st.integers(1, 4))
    def claim_and_relay(self, limit: int) -> None:
        """Act as a relay worker: claim, then relay every new lease at once."""
        self._claim_and_relay(limit)

    def _claim_and_relay(self, limit: int) -> None:
        before = len(self.leases)
        self._claim_and_check(limit)
        fresh = len(self.leases) - before
        for position in range(fresh):
            self._relay(self.leases[len(self.leases) - fresh + position])

    def _ready(self, now: datetime) -> list[str]:
        """Return the publishable occurrences at ``now``, oldest (due, then name) first."""
        return [
            o.occurrence_id
            for o in sorted(self.occurrences.values(), key=self._order)
            if o.state == "pending"
            or (
                o.state == "retry_wait"
                and o.next_attempt_at is not None
                and o.next_attempt_at <= now
            )
            or (o.state == "leased" and o.lease is not None and o.lease.expires_at <= now)
        ]

    def _claim_and_check(self, limit: int) -> None:
        now = self._now()
        ready = self._ready(now)
        outcome = self._try(self._store.claim(limit))
        assert outcome.error is None, f"claim failed: {outcome.error!r}"
        self._check_claimed(outcome.value, ready, limit, now)

    def _check_claimed(
        self, leases: list[Lease], ready: list[str], limit: int, now: datetime
    ) -> None:
        """Check the leases one claim at ``now`` returned (``ready``: the model's list)."""
        assert len(leases) == min(limit, len(ready)), (
            f"claim returned {len(leases)} leases; {len(ready)} occurrences were ready, "
            f"limit {limit}"
        )
        ids = [lease.occurrence_id for lease in leases]
        assert len(set(ids)) == len(ids), "one claim leased an occurrence twice"
        assert set(ids) == set(ready[:limit]), (
            "claim did not lease the oldest publishable occurrences (due time, then name)"
        )
        # Model order, whatever order the store returned them in.
        for lease in sorted(leases, key=lambda x: self._order(self.occurrences[x.occurrence_id])):
            occ = self.occurrences[lease.occurrence_id]
            expected = min(now + self._config.lease_duration, occ.window_ends_at)
            assert lease.expires_at == expected, (
                f"lease expires {lease.expires_at}, expected {expected} "
                "(shared time + lease, shortened to the window)"
            )
            if occ.lease is not None:
                assert lease.revision > occ.lease.revision, "a reclaim did not bump the revision"
                assert lease.capability != occ.lease.capability, "a reclaim reused a capability"
            self._move(occ, "leased", now)
            occ.lease = lease
            self.leases.append(lease)
        del self.leases[:-24]

    # --- relays and broker faults ---------------------------------------------------------------

    @precondition(lambda self: len(self.faults) < 3)
    @rule(faults=st.lists(st.sampled_from(list(BrokerFault)), min_size=1, max_size=3))
    def inject_broker_faults(self, faults: list[BrokerFault]) -> None:
        """Make the broker's next publishes fail, time out or lose their acknowledgement."""
        self.broker.inject(*faults)
        self.faults.extend(faults)

    @precondition(lambda self: any(o.state == "leased" for o in self.occurrences.values()))
    @rule(limit=st.integers(1, 6))
    def stall_past_lease(self, limit: int) -> None:
        """Stall a worker past its leases: others reclaim, the stalled worker is fenced."""
        held = {
            o.occurrence_id: o.lease
            for o in self.occurrences.values()
            if o.state == "leased" and o.lease is not None
        }
        latest = max(lease.expires_at for lease in held.values())
        if latest > self.clock.now():
            self.clock.set(latest)
        self._claim_and_check(limit)
        for occurrence_id, lease in held.items():
            occ = self.occurrences.get(occurrence_id)
            if occ is not None and occ.lease is not None and occ.lease != lease:
                self._relay(lease)  # the fenced worker wakes up: refused, nothing recorded

    @precondition(lambda self: any(o.state == "retry_wait" for o in self.occurrences.values()))
    @rule(limit=st.integers(1, 6))
    def wait_for_backoff_and_retry(self, limit: int) -> None:
        """Wait until the first retry is due, then claim and relay again (same key)."""
        due = min(
            o.next_attempt_at
            for o in self.occurrences.values()
            if o.state == "retry_wait" and o.next_attempt_at is not None
        )
        if due > self.clock.now():
            self.clock.set(due)
        self._claim_and_relay(limit)

    def _stale_leases(self) -> list[Lease]:
        stale = []
        for lease in self.leases:
            occ = self.occurrences.get(lease.occurrence_id)
            if occ is None or occ.lease != lease:
                stale.append(lease)
        return stale

    @precondition(lambda self: bool(self._stale_leases()))
    @rule(index=st.integers(0, 99))
    def relay_stale_lease(self, index: int) -> None:
        """Relay a lease that was fenced, spent or whose occurrence moved on: refused."""
        stale = self._stale_leases()
        self._relay(stale[index % len(stale)])

    @precondition(lambda self: bool(self.leases))
    @rule(index=st.integers(0, 99))
    def relay(self, index: int) -> None:
        """Relay a lease (live or stale) through the broker and check what was recorded."""
        self._relay(self.leases[-1 - index % len(self.leases)])

    def _relay(self, lease: Lease) -> None:
        now = self._now()
        occ = self.occurrences.get(lease.occurrence_id)
        holder = self._holds(occ, lease, now)
        attempts_before = self.broker.attempts
        outcome = self._try(self._store.relay(lease, self.broker))
        if not holder or occ is None:
            assert isinstance(outcome.error, RelayLeaseLostError), (
                f"a stale or expired lease was not refused: {outcome.error!r}"
            )
            assert self.broker.attempts == attempts_before, "a stale lease reached the broker"
            return
        assert self.broker.attempts == attempts_before + 1, "relay did not publish exactly once"
        self._relayed(occ, self.broker.keys_attempted[-1], outcome, now)

    @staticmethod
    def _holds(occ: _Occurrence | None, lease: Lease, now: datetime) -> bool:
        """Whether ``lease`` is the live lease of ``occ`` at ``now`` (the model's fencing)."""
        return (
            occ is not None
            and occ.state == "leased"
            and occ.lease == lease
            and now < lease.expires_at
        )

    def _takeover_candidates(self) -> list[_Occurrence]:
        """Occurrences whose live lease lapses before their window ends (reclaimable then)."""
        now = self.recorded if self.recorded is not None else self.clock.now()
        now = max(now, self.clock.now())
        return [
            o
            for o in sorted(self.occurrences.values(), key=self._order)
            if o.state == "leased"
            and o.lease is not None
            and now < o.lease.expires_at < o.window_ends_at
        ]

    @rule(
        budget=st.integers(1, 12),
        limit=st.integers(1, 4),
        index=st.integers(0, 99),
        new_holder_relays=st.booleans(),
    )
    def relay_after_takeover(
        self, budget: int, limit: int, index: int, new_holder_relays: bool
    ) -> None:
        """Let a lease lapse and another worker take it over; then the old holder relays.

        A worker ticks (``budget``, within the quota) and claims (up to ``limit``); one of
        the live leases lapses and a newer claim takes its occurrence, which is leased
        again and live, but not to the old holder. The old holder's relay must be refused
        at its check: nothing reaches the broker, no attempt is counted. Then (if
        ``new_holder_relays``) the new holder publishes.
        """
        room = self._config.max_occurrences - len(self.occurrences)
        self._tick(max(1, min(budget, room)))  # within the quota, so the tick adds work
        self._claim_and_check(limit)
        candidates = self._takeover_candidates()
        if not candidates:
            return
        occ = candidates[index % len(candidates)]
        old = occ.lease
        assert old is not None
        self.clock.set(old.expires_at)
        ready = self._ready(self._now())
        self._claim_and_check(ready.index(occ.occurrence_id) + 1)
        assert occ.lease is not None
        assert occ.lease != old, "the newer claim did not take over"
        self._relay(old)
        if new_holder_relays:
            self._relay(occ.lease)

    @rule(limit=st.integers(1, 4), index=st.integers(0, 99))
    def taken_over_while_publishing(self, limit: int, index: int) -> None:
        """Take a lease over while its publication is in flight: the stale holder records nothing.

        A worker claims (up to ``limit``) and relays one of the live leases; the broker
        call is held until the lease has expired and another worker has claimed
        the occurrence; then it answers (as the queued broker fault says). The stale
        holder's check counted the attempt, but its outcome, accepted or failed, records
        nothing: the occurrence stays leased to the new holder, which publishes it later
        under the same idempotency key.
        """
        self._claim_and_check(limit)
        candidates = self._takeover_candidates()
        if not candidates:
            return
        occ = candidates[index % len(candidates)]
        lease = occ.lease
        assert lease is not None
        claimed: list[tuple[list[Lease], list[str], int, datetime]] = []
        machine = self

        class _HeldBroker:
            async def publish(
                self, message: ScheduledMessage, *, idempotency_key: str, timeout: float
            ) -> Any:
                assert lease is not None
                machine.clock.set(lease.expires_at)
                later = machine._now()
                ready = machine._ready(later)
                limit = ready.index(occ.occurrence_id) + 1
                leases = await machine._store.claim(limit)
                claimed.append((leases, ready, limit, later))
                return await machine.broker.publish(
                    message, idempotency_key=idempotency_key, timeout=timeout
                )

        attempts_before = self.broker.attempts
        outcome = self._try(self._store.relay(lease, _HeldBroker()))
        assert self.broker.attempts == attempts_before + 1, "relay did not publish exactly once"
        assert len(claimed) == 1, "the publication never started"
        self._check_claimed(*claimed[0])
        assert occ.lease != lease, "the newer claim did not take over"
        key = self.broker.keys_attempted[-1]
        if occ.key is None:
            assert key not in self.key_owner, "two occurrences share an idempotency key"
            occ.key = key
            self.key_owner[key] = occ.occurrence_id
        assert key == occ.key, "the idempotency key changed between attempts"
        occ.attempts += 1  # counted by the stale holder's check
        fault = self.faults.popleft() if self.faults else None
        if fault in (None, BrokerFault.TIMEOUT_AFTER_ACCEPT, BrokerFault.LOSE_ACK):
            self.accepted.add(key)
        if fault is None:
            assert isinstance(outcome.error, RelayLeaseLostError), (
                f"a publication whose lease was taken over meanwhile gave {outcome!r}"
            )
        else:
            assert outcome.error is not None, "a failed publication was reported as a success"

    @precondition(lambda self: bool(self.leases))
    @rule(indexes=st.lists(st.integers(0, 99), min_size=1, max_size=6))
    def relay_batch(self, indexes: list[int]) -> None:
        """Relay a batch of leases at once (live, stale, repeated): one outcome each, in order.

        The live leases publish in the batch's order (so the queued broker faults apply in
        that order); a repeated lease publishes once; stale ones are refused and record
        nothing.
        """
        batch = [self.leases[-1 - i % len(self.leases)] for i in indexes]
        now = self._now()
        attempts_before = self.broker.attempts
        outcome = self._try(self._store.relay_many(batch, self.broker))
        assert outcome.error is None, f"relay_many failed: {outcome.error!r}"
        results: list[RelayOutcome] = outcome.value
        assert [r.occurrence_id for r in results] == [lease.occurrence_id for lease in batch], (
            "relay_many's outcomes are not one per lease, in order"
        )
        live: list[tuple[_Occurrence, RelayOutcome]] = []
        taken: set[str] = set()
        for lease, result in zip(batch, results, strict=True):
            occ = self.occurrences.get(lease.occurrence_id)
            if occ is None or lease.occurrence_id in taken or not self._holds(occ, lease, now):
                assert isinstance(result.error, RelayLeaseLostError), (
                    f"a stale, expired or repeated lease was not refused: {result!r}"
                )
                continue
            taken.add(lease.occurrence_id)
            live.append((occ, result))
        assert self.broker.attempts == attempts_before + len(live), (
            "relay_many did not publish each live lease exactly once"
        )
        keys = self.broker.keys_attempted[attempts_before:]
        for (occ, result), key in zip(live, keys, strict=True):
            self._relayed(occ, key, _Outcome(value=result.receipt, error=result.error), now)

    @rule(limit=st.integers(1, 6))
    def claim_and_relay_at_once(self, limit: int) -> None:
        """Claim and relay in one call: the oldest publishable occurrences, each published."""
        now = self._now()
        ready = self._ready(now)[:limit]
        attempts_before = self.broker.attempts
        outcome = self._try(self._store.claim_and_relay(limit, self.broker))
        assert outcome.error is None, f"claim_and_relay failed: {outcome.error!r}"
        results: list[RelayOutcome] = outcome.value
        assert [r.occurrence_id for r in results] == ready, (
            "claim_and_relay did not take the oldest publishable occurrences in order"
        )
        assert self.broker.attempts == attempts_before + len(ready), (
            "claim_and_relay did not publish each claimed occurrence exactly once"
        )
        keys = self.broker.keys_attempted[attempts_before:]
        for result, key in zip(results, keys, strict=True):
            occ = self.occurrences[result.occurrence_id]
            self._move(occ, "leased", now)
            self._relayed(occ, key, _Outcome(value=result.receipt, error=result.error), now)

    def _relayed(self, occ: _Occurrence, key: str, outcome: _Outcome, now: datetime) -> None:
        """Check what one publication by the lease's holder came to; update the model."""
        if occ.key is None:
            assert key not in self.key_owner, "two occurrences share an idempotency key"
            occ.key = key
            self.key_owner[key] = occ.occurrence_id
        assert key == occ.key, "the idempotency key changed between attempts"
        occ.attempts += 1
        fault = self.faults.popleft() if self.faults else None
        if fault in (None, BrokerFault.TIMEOUT_AFTER_ACCEPT, BrokerFault.LOSE_ACK):
            was_accepted = key in self.accepted
            self.accepted.add(key)
            stored = [m for m, k in self.broker.published if k == key]
            assert stored == [self.schedules[occ.name].message()], (
                "the broker holds a different message than the definition's"
            )
        if fault is None:
            assert outcome.error is None, f"relay failed: {outcome.error!r}"
            assert outcome.value.idempotency_key == key
            assert outcome.value.duplicate == was_accepted, "receipt duplicate flag is wrong"
            self._move(occ, "published", now)
            return
        if fault is BrokerFault.LOSE_ACK:
            assert isinstance(outcome.error, RelayAcknowledgementError), (
                f"a lost acknowledgement gave {outcome.error!r}"
            )
            assert outcome.error.receipt.idempotency_key == key
            permanent = False
        elif fault in (BrokerFault.TIMEOUT, BrokerFault.TIMEOUT_AFTER_ACCEPT):
            assert isinstance(outcome.error, RelayBrokerTimeoutError), (
                f"a broker timeout gave {outcome.error!r}"
            )
            permanent = False
        else:
            permanent = fault is BrokerFault.REJECTED
            assert isinstance(outcome.error, RelayBrokerError), (
                f"a broker failure gave {outcome.error!r}"
            )
            assert not isinstance(outcome.error, RelayBrokerTimeoutError)
            assert outcome.error.permanent == permanent
        retry_at = now + _backoff(occ.attempts)
        if permanent or occ.attempts >= MAX_RELAY_ATTEMPTS or retry_at >= occ.window_ends_at:
            self._move(occ, "dead", now)
        else:
            self._move(occ, "retry_wait", now)
            occ.next_attempt_at = retry_at

    # --- operator actions -----------------------------------------------------------------------

    @precondition(lambda self: any(o.state == "dead" for o in self.occurrences.values()))
    @rule(index=st.integers(0, 59))
    def retry_dead_letter(self, index: int) -> None:
        """Retry a dead occurrence: pending again with a fresh attempt budget."""
        self.retry_failed(index)

    @rule(index=st.integers(0, 99))
    def retry_failed(self, index: int) -> None:
        """Retry an occurrence: only dead ones come back, with a fresh attempt budget."""
        now = self._now()
        dead = [i for i in self._ordered_ids() if self.occurrences[i].state == "dead"]
        ids = dead if dead and index < 60 else self._ordered_ids()
        if index % 10 == 9 or not ids:
            outcome = self._try(self._store.retry_failed("0" * 32))
            assert isinstance(outcome.error, RecurringNotFoundError), (
                f"retrying an unknown occurrence gave {outcome.error!r}"
            )
            return
        occ = self.occurrences[ids[index % len(ids)]]
        outcome = self._try(self._store.retry_failed(occ.occurrence_id))
        if occ.state != "dead":
            assert isinstance(outcome.error, RecurringInvalidStateError), (
                f"retrying a {occ.state} occurrence gave {outcome.error!r}"
            )
            return
        assert outcome.error is None, f"retry_failed failed: {outcome.error!r}"
        self._move(occ, "pending", now)
        occ.attempts = 0
        assert outcome.value.state.value == "pending"
        assert outcome.value.attempts == 0

    @rule(
        age=st.sampled_from(
            [timedelta(seconds=-1), timedelta(0), timedelta(minutes=1), timedelta(hours=1)]
        ),
        limit=st.integers(1, 5),
    )
    def purge(self, age: timedelta, limit: int) -> None:
        """Purge terminal occurrences last updated before a cutoff, at most ``limit``."""
        now = self._now()
        cutoff = now - age
        eligible = [
            o.occurrence_id
            for o in sorted(
                self.occurrences.values(), key=lambda o: (o.updated_at, *self._order(o))
            )
            if o.state in TERMINAL and o.updated_at < cutoff
        ]
        outcome = self._try(self._store.purge_terminal(cutoff, limit))
        assert outcome.error is None, f"purge_terminal failed: {outcome.error!r}"
        assert outcome.value == min(limit, len(eligible)), (
            f"purged {outcome.value}; {len(eligible)} were eligible, limit {limit}"
        )
        listed = self._list_occurrences()
        removed = set(self.occurrences) - set(listed)
        assert removed == set(eligible[:limit]), (
            "purge did not remove the oldest eligible occurrences (last update, due, name)"
        )
        assert len(removed) == outcome.value
        for occurrence_id in removed:
            del self.occurrences[occurrence_id]

    # --- time -------------------------------------------------------------------------------------

    @rule(
        delta=st.sampled_from(
            [
                timedelta(seconds=1),
                timedelta(seconds=4),
                timedelta(seconds=29),
                timedelta(seconds=61),
                timedelta(minutes=5),
                timedelta(minutes=17),
                timedelta(hours=1),
                timedelta(days=1, seconds=1),
            ]
        )
    )
    def advance_clock(self, delta: timedelta) -> None:
        """Let time pass."""
        self.clock.advance(delta)

    @rule(back_ms=st.one_of(st.integers(1, 5_000), st.integers(5_001, 600_000)))
    def regress_clock(self, back_ms: int) -> None:
        """Move the clock back: up to 5 s is adopted, more is a clock error."""
        if back_ms <= CLOCK_TOLERANCE // timedelta(milliseconds=1):
            self._regress_within_tolerance(back_ms)
        else:
            self._regress_beyond_tolerance(back_ms - 5_000)

    def _regress_within_tolerance(self, back_ms: int) -> None:
        """Move the clock back by less than 5 s: the store adopts its recorded time."""
        self._list_occurrences()  # records the current time in both store and model
        assert self.recorded is not None
        target = self.recorded - timedelta(milliseconds=back_ms)
        if target < self.clock.now():
            self.clock.set(target)
        # A claim with the clock trailing: no clock error, leases judged by recorded time.
        self._claim_and_check(1)

    def _regress_beyond_tolerance(self, extra_ms: int) -> None:
        """Move the clock back by more than 5 s: operations fail with a clock error."""
        self._list_occurrences()
        assert self.recorded is not None
        before = self.clock.now()
        self.clock.set(self.recorded - CLOCK_TOLERANCE - timedelta(milliseconds=extra_ms))
        try:
            calls: list[Callable[[], Coroutine[Any, Any, Any]]] = [
                lambda: self._store.tick(1),
                lambda: self._store.claim(1),
            ]
            for call in calls:
                outcome = self._try(call())
                assert isinstance(outcome.error, RecurringClockError), (
                    f"a clock trailing by more than 5 s was accepted: {outcome.error!r}"
                )
        finally:
            self.clock.set(before)

    # --- invariants ---------------------------------------------------------------------------

    @invariant()
    def store_agrees_with_model(self) -> None:
        """Check listings, quotas, the broker and idempotency keys against the model."""
        if self.store is None:
            return
        listed = self._list_occurrences()
        assert set(listed) == set(self.occurrences), (
            f"occurrences lost {sorted(set(self.occurrences) - set(listed))} or unexpected "
            f"{sorted(set(listed) - set(self.occurrences))}"
        )
        for occurrence_id, info in listed.items():
            occ = self.occurrences[occurrence_id]
            assert (info.definition_name, info.due_at) == (occ.name, occ.due_at)
            assert info.state.value == occ.state, (
                f"occurrence {occurrence_id} is {info.state.value}; the model says {occ.state}"
            )
            assert info.attempts == occ.attempts, (
                f"occurrence {occurrence_id} has {info.attempts} attempts; model {occ.attempts}"
            )
            assert info.window_ends_at == occ.window_ends_at
            assert info.created_at == occ.created_at
            if occ.state == "retry_wait":
                assert info.next_attempt_at == occ.next_attempt_at, (
                    f"next attempt {info.next_attempt_at} != model {occ.next_attempt_at}"
                )
        assert len(listed) <= self._config.max_occurrences, "the occurrence quota was exceeded"
        schedules = self._list_schedules()
        assert set(schedules) == set(self.schedules)
        assert len(schedules) <= self._config.max_definitions, "the definition quota was exceeded"
        for name, schedule in schedules.items():
            self._check_schedule(schedule, self.schedules[name])
        keys = self.broker.keys()
        assert len(keys) == len(set(keys)), "the broker holds two copies under one key"
        assert set(keys) == self.accepted, "the broker holds messages the model did not expect"
        for key in keys:
            assert key in self.key_owner, "the broker holds a key no occurrence owns"
        for occ in self.occurrences.values():
            if occ.state == "published":
                assert occ.key in self.accepted, "a published occurrence never reached the broker"


async def _await(value: Awaitable[T]) -> T:
    return await value


def _awaitable(value: Awaitable[T]) -> Coroutine[Any, Any, T]:
    return _await(value)


def recurring_conformance_machine(
    make_store: MakeStore, *, close: CloseStore | None = None
) -> type[RecurringStoreConformance]:
    """Return a :class:`RecurringStoreConformance` subclass bound to a store factory.

    Args:
        make_store: ``async (config, clock) -> store``; called once per example, inside
            the machine's event loop, with a fresh namespace.
        close: ``async (store) -> None`` run at the end of each example; the store's
            ``close()`` by default.
    """
    return type(
        "BoundRecurringStoreConformance",
        (RecurringStoreConformance,),
        {
            "make_store": staticmethod(make_store),
            "close_store": staticmethod(close) if close else None,
        },
    )


def run_recurring_conformance(
    make_store: MakeStore,
    *,
    settings: settings | None = None,
    close: CloseStore | None = None,
) -> None:
    """Run the recurring-store conformance state machine against a store factory.

    Call it from a synchronous test (the machine owns its event loop).

    Args:
        make_store: ``async (config, clock) -> store``; called once per example.
        settings: hypothesis settings; :data:`DEFAULT_SETTINGS` by default.
        close: ``async (store) -> None`` run after each example (``store.close()``).

    Raises:
        AssertionError: the store broke the contract (hypothesis shows the shortest
            sequence of steps that does).
    """
    machine = recurring_conformance_machine(make_store, close=close)
    run_state_machine_as_test(machine, settings=settings or DEFAULT_SETTINGS)
