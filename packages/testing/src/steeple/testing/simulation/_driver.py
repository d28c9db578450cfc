"""The simulator: drives a real recurring store on a fake clock, jumping from event to event.

Nothing here decides what the store does. The store (the in-memory reference store, or
any :class:`~steeple.core.ports.RecurringStore`) materializes, leases, backs off, expires
and dead-letters; the simulator only decides *when to call it*, the way the worker loops
would: a ticker on a grid of ``Ticking.interval``, relay workers polling every
``RelayCapacity.poll_interval``.

A relay worker does what ``steeple worker``'s relay loop does: one batched
``claim_and_relay(claim_limit, broker, concurrency=...)`` per round, its publications
running ``concurrency`` at a time, each taking ``1 / rate`` seconds (the broker
model times them and judges each at its start; an occurrence counts as published when
its acknowledgement arrives). A full batch is followed at once by the next round, a short
one waits for new work. The store sees the whole round at the instant it started: the
claim, the check, the publications' lease judgments and the recording of the outcomes
(the simulation does not interleave other calls inside a round), while the worker stays
busy until the last publication ends.

Time advances by events, never by sleeping or stepping second by second. A poll that
provably finds nothing is skipped, and only such a poll:

- the ticker wakes at the first grid instant at or after the earliest instant any
  definition can next be due (a lower bound from the calendar: waking early only costs an
  empty tick); a tick that fills its budget ticks again at once;
- an idle worker wakes when something may have become claimable: a tick materialized, a
  retry falls due (after a failed relay the occurrences are listed before the next poll
  instant, so the store itself says when), a lease lapses unrelayed;
- a worker does not claim at the instant another worker's claim came back short (it took
  everything claimable then);
- workers acting at the same instant act in index order, never in the order their events
  were scheduled, so skipped polls cannot reorder them;
- skipping a poll changes nothing but the store's recorded time, which matters only to a
  clock regression: a call is made at the last grid instant before each step back, and
  the ticker and idle workers poll at the first grid instant after it (where a step
  beyond the tolerance starts their backoff).

A test runs busy scenarios both ways (jumping, and polling at every grid instant) and
requires the same outcome for every occurrence.

The simulated operator lists occurrences every sample interval and after every few dozen
publications, counts the finished ones (lateness needs each due instant, which only the
listing gives) and purges them at once, so quota hits come from live backlog only.
"""

from __future__ import annotations

import asyncio
import heapq
from collections.abc import Awaitable, Callable, Iterable
from datetime import datetime, timedelta
from typing import Final

from steeple.core.calendar import shared_calendar
from steeple.core.config import RecurringConfig, RecurringDefinition
from steeple.core.errors import (
    RecurringCapacityError,
    RecurringClockError,
    RecurringRelayError,
    RelayAcknowledgementError,
    RelayLeaseLostError,
)
from steeple.core.occurrences import OccurrenceState
from steeple.core.ports import Clock, RandomSource, RecurringStore
from steeple.core.records import OccurrenceInfo, RelayOutcome
from steeple.testing.simulation._broker import SimulatedBroker
from steeple.testing.simulation._result import (
    DefinitionResult,
    Hits,
    OccurrenceOutcome,
    Series,
    SimulationResult,
    Tally,
)
from steeple.testing.simulation._scenario import Scenario, ScenarioError
from steeple.testing.simulation._timeline import (
    EPOCH,
    MICROSECOND,
    align_up,
    from_us,
    span_us,
    to_us,
)

__all__ = ["Progress", "StoreFactory", "drive"]

Progress = Callable[[datetime, float], "bool | None"]
"""Told the simulated time and the share of the range done; returning False stops the run."""

StoreFactory = Callable[[RecurringConfig, Clock, RandomSource], Awaitable[RecurringStore]]
"""Builds the store under simulation from the namespace, the fake clock and the seeded random."""

_S = OccurrenceState
_TERMINAL: Final = {
    _S.PUBLISHED: "published",
    _S.DEAD: "dead",
    _S.EXPIRED: "expired",
    _S.CANCELLED: "cancelled",
}
_TERMINAL_VALUES: Final = frozenset(state.value for state in _TERMINAL)
"""The terminal states' values: a str hashes in C, an enum member in Python."""
_PUBLISHED: Final = _S.PUBLISHED
_RETRY_WAIT: Final = _S.RETRY_WAIT.value

# Event kinds, in the order they run when they fall on the same instant.
# A sample runs before the ticker and the workers: it sees what was left at the end of
# the interval, not the work falling due at that very instant.
_HOST_UP, _HOST_DOWN, _REGRESSION, _CHANGE, _SYNC, _SAMPLE, _TICK, _SCAN, _WORKER, _END = range(10)

_MAX_BACKOFF: Final = span_us(timedelta(seconds=30))
_HARVEST_EVERY: Final = 80
"""Publications between two operator listings: keeps the listing to about one page."""
_PAGE: Final = 100
_NEVER: Final = 2**62
_YIELD_EVERY: Final = 256
"""Events between two turns of the event loop (the simulation itself never waits)."""


class _Clock:
    """The simulation's fake clock: a :class:`~steeple.core.ports.Clock` the driver sets.

    The driver only ever sets it to aware UTC instants it computed, so unlike
    :class:`~steeple.testing.FakeClock` it checks nothing (it is read on every call).
    """

    __slots__ = ("instant",)
    simulated = True

    def __init__(self, instant: datetime) -> None:
        self.instant = instant

    def now(self) -> datetime:
        """Return the instant the driver set."""
        return self.instant


class SimulationError(RuntimeError):
    """The store did something the simulator cannot account for (a bug, never an input)."""


class _Worker:
    __slots__ = (
        "index",
        "not_before",
        "parked",
        "short_at",
        "token",
        "waits",
        "wake_at",
    )

    def __init__(self, index: int) -> None:
        self.index = index
        self.token = 0
        self.parked = True
        self.not_before = 0
        self.short_at: int | None = None
        self.waits = 0
        self.wake_at = _NEVER


class _Definition:
    """One definition's running counts, with its policy's series (counted into per item)."""

    __slots__ = (
        "active",
        "definition",
        "expression",
        "late",
        "made",
        "policy",
        "published",
        "tally",
    )

    def __init__(self, definition: RecurringDefinition, driver: _Driver) -> None:
        self.definition = definition
        self.expression = definition.cron.expression
        self.policy = policy = definition.policy.value
        self.active = True
        self.tally = Tally()
        self.made = driver.bucket_materialized[policy]
        self.published = driver.bucket_published[policy]
        self.late = driver.bucket_late[policy]


class _Driver:
    """One run. Private: :func:`drive` builds it and returns its result."""

    def __init__(
        self,
        scenario: Scenario,
        seed: int,
        store: RecurringStore,
        clock: _Clock,
        broker: SimulatedBroker,
        *,
        trace: bool,
        exhaustive: bool = False,
        progress: Progress | None = None,
    ) -> None:
        self.scenario = scenario
        self.progress = progress
        self.stopped_at: int | None = None
        self.exhaustive = exhaustive
        """Poll at every grid instant instead of jumping (tests compare the two)."""
        self.seed = seed
        self.store = store
        self.clock = clock
        self.broker = broker
        self.trace: list[OccurrenceOutcome] | None = [] if trace else None
        self.origin = to_us(scenario.start)
        self.end = to_us(scenario.end)
        self.t = self.origin
        self.offset = 0
        self.shared = 0
        """The highest clock reading any store call saw: the store's recorded time."""
        self.clock_set_to = -1
        self.tick_step = span_us(scenario.ticking.interval)
        self.budget = scenario.ticking.budget
        relay = scenario.relay
        self.poll_step = span_us(relay.poll_interval)
        self.claim_limit = relay.claim_limit
        self.concurrency = relay.concurrency
        broker.concurrency = relay.concurrency
        broker.latency_us = 0 if relay.rate is None else max(1, round(1_000_000 / relay.rate))
        self._init_state(scenario)

    def _init_state(self, scenario: Scenario) -> None:
        """Set up the run's bookkeeping: events, hints, workers and the sampled series."""
        relay = scenario.relay
        self.lease_us = span_us(scenario.config.lease_duration)
        self.sample_step = span_us(scenario.samples_every)
        self.sample_span = timedelta(microseconds=self.sample_step)
        self.start = from_us(self.origin)
        self.buckets = -(-(self.end - self.origin) // self.sample_step)
        self.heap: list[tuple[int, int, int, int, int]] = []
        self.seq = 0
        self.hits: dict[str, int] = dict.fromkeys(Hits.__annotations__, 0)
        self.definitions: list[_Definition] = []
        self.by_name: dict[str, int] = {}
        self.records: dict[str, _Definition] = {}
        """Each definition's record by name (what ``by_name`` indexes, looked up once)."""
        self.due_hints: list[tuple[int, int, datetime]] = []
        """(when, definition index, the calendar's instant): the earliest each can be due."""
        self.claim_hints: list[int] = []
        self.tick_token = 0
        self.tick_at = _NEVER
        self.tick_failures = 0
        self.tick_blocked = False
        self.down = 0
        self.deferred: list[int] = []
        self.workers = [_Worker(i) for i in range(relay.workers)]
        self.published_at: dict[str, int] = {}
        self.since_harvest = 0
        self.retry_unknown = False
        """A relay failed: some retry's next attempt is known only to the store."""
        self.scan_pending = False
        self.drained: int | None = None
        """The instant of a short claim: it took everything claimable then (see ``work``)."""
        self.materialized = 0
        policies = sorted(
            {d.policy.value for d in scenario.definitions}
            | {d.policy.value for c in scenario.changes for d in c.create}
        )
        self.policies = policies
        self.series_keys = [*policies, "all"]
        self.backlog: dict[str, list[int]] = {k: [] for k in self.series_keys}
        self.last_backlog: dict[str, int] = dict.fromkeys(self.series_keys, 0)
        # Per policy only: the series of all policies together is their sum (their worst
        # lateness), made once in ``result``.
        self.bucket_published: dict[str, list[int]] = {k: [0] * self.buckets for k in policies}
        self.bucket_late: dict[str, list[int | None]] = {k: [None] * self.buckets for k in policies}
        self.bucket_materialized: dict[str, list[int]] = {k: [0] * self.buckets for k in policies}

    # --- events ----------------------------------------------------------------------------

    def push(self, at: int, kind: int, arg: int = 0) -> None:
        self.seq += 1
        # Same instant: by kind, then workers by index (never by when the event was pushed,
        # so that the order does not depend on which polls were skipped).
        heapq.heappush(self.heap, (at, kind, arg, self.seq, self.token_of(kind, arg)))

    def token_of(self, kind: int, arg: int) -> int:
        if kind == _TICK:
            return self.tick_token
        if kind == _WORKER:
            return self.workers[arg].token
        return 0

    def schedule_tick(self, at: int) -> None:
        self.tick_token += 1
        self.tick_at = at
        if at < self.end:
            self.push(at, _TICK)

    def schedule_worker(self, worker: _Worker, at: int) -> None:
        worker.token += 1
        worker.wake_at = at
        if at < self.end:
            self.push(at, _WORKER, worker.index)

    def regressed(self, by: timedelta) -> None:
        """Step the host clock back: the next polls (ticker and idle workers) see it."""
        self.offset += span_us(by)
        self.drained = None
        if self.down:
            return
        # A poller calls at the next grid instant whatever is due; if the step is beyond
        # the tolerance that call fails and its backoff starts there, so it must be made.
        if not self.tick_blocked and not self.tick_failures:
            at = align_up(self.t, self.origin, self.tick_step)
            if at < self.tick_at:
                self.schedule_tick(at)
        for worker in self.workers:
            if worker.parked and not worker.waits:
                at = max(self.t, worker.not_before)
                if worker.short_at is not None:
                    at = max(at, worker.short_at + 1)
                at = align_up(at, self.origin, self.poll_step)
                if at < worker.wake_at:
                    self.schedule_worker(worker, at)

    async def run(self) -> SimulationResult:
        await self._start()
        events = 0
        while self.heap:
            events += 1
            if not events % _YIELD_EVERY:
                # Let the event loop run: it drops the timers of finished publication
                # deadlines (cancelled, never due), which otherwise pile up in its heap.
                await asyncio.sleep(0)
                if self.progress is not None and not self.report():
                    await self.stop()
                    break
            at, kind, arg, _, token = heapq.heappop(self.heap)
            if at >= self.end and kind != _END:
                continue  # the range is half-open: only the final count runs at its end
            self.t = at
            if await self._handle(at, kind, arg, token):
                break
        return self.result()

    async def _start(self) -> None:
        """Create the first definitions and push every scheduled event of the scenario."""
        scenario = self.scenario
        self.set_clock()
        for definition in scenario.definitions:
            await self.create(definition)
        for outage in scenario.host_outages:
            start, end = to_us(outage.start), to_us(outage.end)
            if start < self.end and end > self.origin:
                self.push(max(start, self.origin), _HOST_DOWN)
                self.push(end, _HOST_UP)
        for index, regression in enumerate(scenario.clock_regressions):
            at = to_us(regression.at)
            self.push(at, _REGRESSION, index)
            # The worker loops call the store at every grid instant; the last such call
            # before the step sets the recorded time the stepped clock is judged against.
            self.push(align_up(at, self.origin, self.tick_step) - self.tick_step, _SYNC)
        for index, change in enumerate(scenario.changes):
            self.push(to_us(change.at), _CHANGE, index)
        if self.origin + self.sample_step < self.end:
            self.push(self.origin + self.sample_step, _SAMPLE)
        self.push(self.end, _END)
        self.reschedule_ticker(self.origin)
        for worker in self.workers:
            self.wake(worker)

    async def _handle(self, at: int, kind: int, arg: int, token: int) -> bool:
        """Run one popped event; return whether the run is over."""
        if kind == _WORKER:
            # The two commonest events, handled here (a coroutine fewer each).
            worker = self.workers[arg]
            if token == worker.token and not self.down:
                worker.parked = False
                worker.wake_at = _NEVER
                await self.work(worker)
        elif kind == _TICK:
            if token == self.tick_token and not self.down:
                self.tick_at = _NEVER
                await self.tick()
        else:
            return await self._handle_other(at, kind, arg)
        return False

    async def _handle_other(self, at: int, kind: int, arg: int) -> bool:
        """Run one popped event that is neither a worker's nor the ticker's."""
        if kind == _SCAN:
            await self._on_scan()
        elif kind == _SAMPLE:
            await self._on_sample(at)
        elif kind == _HOST_DOWN:
            self.host_down()
        elif kind == _HOST_UP:
            await self.host_up()
        elif kind == _REGRESSION:
            self.regressed(self.scenario.clock_regressions[arg].by)
        elif kind == _SYNC:
            await self._on_sync(at)
        elif kind == _CHANGE:
            await self._on_change(arg)
        elif kind == _END:
            await self.finish()
            return True
        return False

    async def _on_scan(self) -> None:
        self.scan_pending = False
        if self.retry_unknown and not self.down:
            await self.harvest()

    async def _on_sample(self, at: int) -> None:
        await self.sample()
        following = at + self.sample_step
        if following < self.end:
            self.push(following, _SAMPLE)

    async def _on_sync(self, at: int) -> None:
        if not self.down and at >= self.origin:
            await self.sync()

    async def _on_change(self, index: int) -> None:
        if self.down:
            self.deferred.append(index)
        else:
            await self.change(index)

    def report(self) -> bool:
        """Tell the progress callback where the run is; False: stop here."""
        assert self.progress is not None
        done = (self.t - self.origin) / (self.end - self.origin)
        try:
            return self.progress(from_us(self.t), min(max(done, 0.0), 1.0)) is not False
        except KeyboardInterrupt:
            # Ctrl-C while reporting: stop between two events, where the state is whole.
            return False

    async def stop(self) -> None:
        """End the run early, between two events: the result covers ``[start, now]``."""
        self.stopped_at = self.t
        self.end = self.t + 1
        self.buckets = -(-(self.end - self.origin) // self.sample_step)
        for per in (self.bucket_published, self.bucket_materialized, self.bucket_late):
            for key in per:
                del per[key][self.buckets :]
        # One backlog sample per bucket: the final listing makes the last one.
        for key in self.series_keys:
            series = self.backlog[key]
            del series[self.buckets - 1 :]
            while len(series) < self.buckets - 1:
                series.append(self.last_backlog[key])
        await self.finish()

    # --- the store, through the fake clock -----------------------------------------------------

    def set_clock(self) -> int:
        reading = self.t - self.offset
        if reading != self.clock_set_to:
            self.clock.instant = from_us(reading)
            self.clock_set_to = reading
        self.hits["store_calls"] += 1
        return reading

    def reached(self, reading: int) -> None:
        """Note that a call got past the store's clock check (it recorded its time)."""
        if reading > self.shared:
            self.shared = reading

    def to_true(self, store_us: int) -> int:
        """Return when (in true time) the store will judge ``store_us`` to have come."""
        if store_us <= self.shared:
            return self.t
        return store_us + self.offset

    def backoff(self, failures: int, step: int) -> int:
        return self.t + min(step << min(failures - 1, 30), max(_MAX_BACKOFF, step))

    async def create(self, definition: RecurringDefinition) -> None:
        reading = self.set_clock()
        await self.store.create(definition)
        self.reached(reading)
        index = len(self.definitions)
        record = _Definition(definition, self)
        self.definitions.append(record)
        self.by_name[definition.name] = index
        self.records[definition.name] = record
        first = shared_calendar(record.expression).next_after(definition.first_after)
        if first is not None:
            heapq.heappush(self.due_hints, (to_us(first), index, first))

    async def change(self, index: int) -> None:
        change = self.scenario.changes[index]
        for name in change.cancel:
            reading = self.set_clock()
            try:
                await self.store.cancel(name)
            except RecurringClockError:
                self.hits["clock_errors"] += 1
                continue
            self.reached(reading)
            self.definitions[self.by_name[name]].active = False
        for definition in change.create:
            await self.create(definition)
        self.reschedule_ticker(self.t)

    async def sync(self) -> None:
        reading = self.set_clock()
        try:
            await self.store.schedules(limit=1)
        except RecurringClockError:
            self.hits["clock_errors"] += 1
            return
        self.reached(reading)

    # --- the ticker --------------------------------------------------------------------------

    def next_tick(self, earliest: int) -> int | None:
        if self.exhaustive:
            return align_up(earliest, self.origin, self.tick_step)
        hints = self.due_hints
        while hints and not self.definitions[hints[0][1]].active:
            heapq.heappop(hints)
        if not hints:
            return None
        due = self.to_true(hints[0][0])
        return align_up(max(due, earliest), self.origin, self.tick_step)

    def reschedule_ticker(self, earliest: int) -> None:
        if self.tick_blocked or self.down:
            return
        at = self.next_tick(earliest)
        if at is not None:
            self.schedule_tick(at)

    async def tick(self) -> None:
        reading = self.set_clock()
        try:
            result = await self.store.tick(self.budget)
        except RecurringCapacityError:
            self.reached(reading)
            self.hits["capacity_errors"] += 1
            # Only a purge makes room: the ticker retries after the next one.
            self.tick_blocked = True
            self.tick_token += 1
            self.tick_at = _NEVER
            return
        except RecurringClockError:
            self.hits["clock_errors"] += 1
            self.tick_failures += 1
            at = self.backoff(self.tick_failures, self.tick_step)
            self.schedule_tick(align_up(at, self.origin, self.tick_step))
            return
        self.reached(reading)
        self.tick_failures = 0
        self.hits["ticks"] += 1
        for name in result.exhausted:
            self.definitions[self.by_name[name]].active = False
        materialized = result.materialized
        if materialized:
            self.materialized += materialized
            self.hint(self.shared)
        if materialized >= self.budget:
            self.hits["saturated_ticks"] += 1
            self.schedule_tick(self.t)
            return
        hints = self.due_hints
        if hints and hints[0][0] <= reading:
            now = from_us(reading)
            # Definitions often share a calendar: one search per expression.
            found: dict[str, tuple[int, datetime] | None] = {}
            while hints and hints[0][0] <= reading:
                _, index, due = heapq.heappop(hints)
                record = self.definitions[index]
                if not record.active:
                    continue
                expression = record.expression
                if expression in found:
                    entry = found[expression]
                else:
                    cron = shared_calendar(expression)
                    # The fire time after the one that came, from the calendar the engine
                    # uses (which answered its tick already): the first after now unless
                    # the ticker missed fire times (an outage).
                    instant = cron.next_after(due)
                    if instant is not None and instant <= now:
                        instant = cron.next_after(now)
                    entry = found[expression] = (
                        None if instant is None else (to_us(instant), instant)
                    )
                if entry is not None:
                    heapq.heappush(hints, (entry[0], index, entry[1]))
        self.reschedule_ticker(self.t + self.tick_step)

    # --- relay workers -------------------------------------------------------------------------

    def hint(self, store_us: int) -> None:
        """Something may become claimable at ``store_us`` (store time): wake parked workers."""
        self.drained = None
        heapq.heappush(self.claim_hints, store_us)
        for worker in self.workers:
            if worker.parked:
                self.wake(worker)

    def wake(self, worker: _Worker) -> None:
        hints = self.claim_hints
        if self.exhaustive:
            at = max(self.t, worker.not_before)
        elif not hints:
            worker.token += 1
            worker.wake_at = _NEVER
            return
        else:
            at = max(self.to_true(hints[0]), worker.not_before)
        if worker.short_at is not None:
            at = max(at, worker.short_at + 1)
        self.schedule_worker(worker, align_up(at, self.origin, self.poll_step))

    def retry_scheduled(self) -> None:
        """Note a failed relay: list occurrences before the next poll to learn its retry time.

        A polling worker would find the retry at the first poll at or after it; listing at
        the next poll instant (before the workers act) is early enough, and one listing
        serves every failure until then.
        """
        self.retry_unknown = True
        if not self.scan_pending:
            self.scan_pending = True
            self.push(align_up(self.t + 1, self.origin, self.poll_step), _SCAN)

    async def park(self, worker: _Worker) -> None:
        if self.since_harvest >= _HARVEST_EVERY:
            await self.harvest()
        worker.parked = True
        self.wake(worker)

    async def work(self, worker: _Worker) -> None:
        store = self.store
        broker = self.broker
        limit = self.claim_limit
        while True:
            if self.drained == self.t:
                # Another worker's claim at this very instant came back short: it took
                # everything claimable, and nothing became claimable since (that would
                # have been hinted). This claim would find nothing.
                worker.short_at = worker.not_before = self.t
                await self.park(worker)
                return
            # One round of the worker's relay loop: claim a batch and relay it, the
            # publications running concurrently (the broker model times each of them).
            reading = self.set_clock()
            broker.begin(self.t)
            try:
                outcomes = await store.claim_and_relay(limit, broker, concurrency=self.concurrency)
            except RecurringClockError:
                self.hits["clock_errors"] += 1
                worker.waits += 1
                at = self.backoff(worker.waits, self.poll_step)
                self.schedule_worker(worker, align_up(at, self.origin, self.poll_step))
                return
            self.reached(reading)
            worker.waits = 0
            self.hits["claims"] += 1
            if len(outcomes) < limit:
                worker.short_at = self.drained = self.t
                hints = self.claim_hints
                while hints and hints[0] <= self.shared:
                    heapq.heappop(hints)
            else:
                worker.short_at = None
            if not outcomes:
                worker.not_before = self.t
                await self.park(worker)
                return
            self.relayed(outcomes, reading)
            following = broker.batch_end()
            if len(outcomes) < limit:
                worker.not_before = following
                await self.park(worker)
                return
            heap = self.heap
            if following >= self.end:
                return
            if heap and (
                heap[0][0] < following or (heap[0][0] == following and heap[0][1] <= _WORKER)
            ):
                self.schedule_worker(worker, following)
                return
            self.t = following

    def relayed(self, outcomes: list[RelayOutcome], reading: int) -> None:
        """Account for a batch's outcomes (the store recorded them already)."""
        hits = self.hits
        hits["relays"] += len(outcomes)
        broker = self.broker
        accepted_at = broker.accepted_at
        for outcome in outcomes:
            error = outcome.error
            if error is None:
                receipt = outcome.receipt
                assert receipt is not None
                key = receipt.idempotency_key
                self.published_at[outcome.occurrence_id] = accepted_at.get(key, self.t)
                self.since_harvest += 1
                if receipt.duplicate:
                    hits["duplicates"] += 1
                broker.settle(key)
            elif isinstance(error, RelayLeaseLostError):
                # Claimable again once the lease lapses, at the latest a lease after the claim.
                hits["leases_lost"] += 1
                self.hint(reading + self.lease_us)
            elif isinstance(error, RelayAcknowledgementError):
                hits["acknowledgements_lost"] += 1
                self.retry_scheduled()
            elif isinstance(error, RecurringRelayError):
                hits["broker_failures"] += 1
                self.retry_scheduled()
            else:
                raise SimulationError(
                    f"relaying occurrence {outcome.occurrence_id} failed on "
                    f"{type(error).__name__}, which a batch recorded at its claim cannot raise"
                ) from error

    # --- host outages ----------------------------------------------------------------------------

    def host_down(self) -> None:
        self.down += 1
        if self.down > 1:
            return
        self.tick_token += 1
        self.tick_at = _NEVER
        for worker in self.workers:
            worker.token += 1
            worker.parked = False

    async def host_up(self) -> None:
        self.down -= 1
        if self.down:
            return
        self.drained = None
        for index in self.deferred:
            await self.change(index)
        self.deferred.clear()
        if self.retry_unknown:
            self.retry_scheduled()
        # A restarted ticker ticks at once, restarted workers claim at once.
        self.tick_failures = 0
        self.schedule_tick(align_up(self.t, self.origin, self.tick_step))
        for worker in self.workers:
            worker.short_at = None
            worker.not_before = self.t
            worker.waits = 0
            self.schedule_worker(worker, align_up(self.t, self.origin, self.poll_step))

    # --- the operator: listing, counting, purging ---------------------------------------------

    async def listing(self) -> list[OccurrenceInfo] | None:
        items: list[OccurrenceInfo] = []
        after: str | None = None
        while True:
            reading = self.set_clock()
            try:
                page = await self.store.occurrences(after=after, limit=_PAGE)
            except RecurringClockError:
                self.hits["clock_errors"] += 1
                return None
            self.reached(reading)
            items.extend(page.items)
            if page.next_cursor is None:
                return items
            after = page.next_cursor

    async def harvest(self, *, final: bool = False) -> list[OccurrenceInfo] | None:
        """List every occurrence, count the finished ones and purge them.

        ``final``: count every occurrence and purge nothing. Returns the live occurrences
        (``None``: the listing failed on a clock error).
        """
        items = await self.listing()
        if items is None:
            return None
        self.since_harvest = 0
        self.retry_unknown = False
        terminal = _TERMINAL_VALUES
        finished: list[OccurrenceInfo] = []
        live: list[OccurrenceInfo] = []
        for info in items:
            value = info.state._value_
            if value in terminal:
                finished.append(info)
                continue
            live.append(info)
            if value == _RETRY_WAIT and not final and info.next_attempt_at is not None:
                self.hint(to_us(info.next_attempt_at))
        self.count(finished)
        if final:
            self.count(live)
        elif finished:
            await self.purge(len(finished))
        return live

    async def purge(self, expected: int) -> None:
        # Everything finished has its last update at or before the store's current time.
        cutoff = from_us(self.shared + 1000)
        purged = 0
        while True:
            reading = self.set_clock()
            removed = await self.store.purge_terminal(cutoff, _PAGE)
            self.reached(reading)
            purged += removed
            if removed < _PAGE:
                break
        if purged != expected:
            raise SimulationError(
                f"the store purged {purged} finished occurrences, {expected} were counted"
            )
        if self.tick_blocked:
            self.tick_blocked = False
            self.reschedule_ticker(self.t)

    def count(self, infos: list[OccurrenceInfo]) -> None:
        """Add listed occurrences to their definitions' tallies and their policies' series."""
        records = self.records
        published_at_of = self.published_at
        trace = self.trace
        start = self.start
        origin = self.origin
        sample_step = self.sample_step
        sample_span = self.sample_span
        last = self.buckets - 1
        made_at: dict[datetime, int] = {}
        due_us: dict[datetime, int] = {}
        bucket_of: dict[int, int] = {}
        for info in infos:
            record = records[info.definition_name]
            tally = record.tally
            tally.attempts += info.attempts
            # A tick's occurrences share their creation instant: one division per tick.
            made = made_at.get(info.created_at)
            if made is None:
                made = made_at[info.created_at] = min(
                    max((info.created_at - start) // sample_span, 0), last
                )
            record.made[made] += 1
            state = info.state
            published_at: int | None = None
            if state is _PUBLISHED:
                published_at = published_at_of.pop(info.occurrence_id, None)
                if published_at is None:
                    raise SimulationError(
                        f"occurrence {info.occurrence_id} is published but no relay recorded it"
                    )
                # Definitions sharing a calendar share their due instants.
                due = due_us.get(info.due_at)
                if due is None:
                    due = due_us[info.due_at] = (info.due_at - EPOCH) // MICROSECOND
                lateness = published_at - due
                tally.published += 1
                tally.lateness.append(lateness)
                # A wave of a batch's publications shares its acknowledgement instant.
                bucket = bucket_of.get(published_at)
                if bucket is None:
                    bucket = bucket_of[published_at] = min(
                        (published_at - origin) // sample_step, last
                    )
                record.published[bucket] += 1
                late = record.late
                worst = late[bucket]
                if worst is None or lateness > worst:
                    late[bucket] = lateness
            elif state is _S.DEAD:
                tally.dead += 1
            elif state is _S.EXPIRED:
                tally.expired += 1
            elif state is _S.CANCELLED:
                tally.cancelled += 1
            else:
                tally.live += 1
            if trace is not None:
                trace.append(
                    OccurrenceOutcome(
                        definition_name=info.definition_name,
                        due_at=info.due_at,
                        state=state,
                        attempts=info.attempts,
                        materialized_at=info.created_at,
                        published_at=None if published_at is None else from_us(published_at),
                    )
                )

    def note_backlog(self, live: list[OccurrenceInfo] | None) -> None:
        """Sample the backlog: ``live`` occurrences by policy (``None``: the last sample holds)."""
        if live is not None:
            counts = dict.fromkeys(self.series_keys, 0)
            records = self.records
            for info in live:
                counts[records[info.definition_name].policy] += 1
            counts["all"] = len(live)
            self.last_backlog = counts
        for key in self.series_keys:
            self.backlog[key].append(self.last_backlog[key])

    async def sample(self) -> None:
        # While the host is down nothing can change the store: the last backlog holds.
        self.note_backlog(None if self.down else await self.harvest())

    async def finish(self) -> None:
        live = await self.harvest(final=True)
        if live is None:
            # The host clock still trails the store's recorded time by more than the
            # tolerance at the end (a step back shortly before it): the operator's listing
            # failed, as it would. The final tally is no operator action: it reads the
            # store as of its recorded time, which changes nothing stored.
            self.offset = self.t - self.shared
            live = await self.harvest(final=True)
        if live is None:
            raise SimulationError("the final listing failed on a clock error")
        self.note_backlog(live)

    # --- the result ------------------------------------------------------------------------------

    def result(self) -> SimulationResult:
        policies: dict[str, Tally] = {}
        overall = Tally()
        for record in self.definitions:
            tally = record.tally
            tally.materialized = (
                tally.published + tally.dead + tally.expired + tally.cancelled + tally.live
            )
            policies.setdefault(record.policy, Tally()).add(tally)
            overall.add(tally)
        if overall.materialized != self.materialized:
            raise SimulationError(
                f"ticks materialized {self.materialized} occurrences but the listings "
                f"counted {overall.materialized}"
            )
        definitions = tuple(
            DefinitionResult(
                name=r.definition.name,
                cron=r.definition.cron.expression,
                policy=r.definition.policy,
                stats=r.tally.freeze(),
            )
            for r in self.definitions
        )
        times = tuple(
            from_us(min(self.origin + (k + 1) * self.sample_step, self.end))
            for k in range(self.buckets)
        )
        late = {**self.bucket_late, "all": _worst(self.bucket_late.values(), self.buckets)}
        series = Series(
            times=times,
            backlog={k: tuple(v) for k, v in self.backlog.items()},
            materialized=_with_sum(self.bucket_materialized, self.buckets),
            published=_with_sum(self.bucket_published, self.buckets),
            max_lateness={
                k: tuple(None if us is None else us / 1_000_000 for us in v)
                for k, v in late.items()
            },
        )
        outcomes = None
        if self.trace is not None:
            outcomes = tuple(sorted(self.trace, key=lambda o: (o.definition_name, o.due_at)))
        return SimulationResult(
            scenario=self.scenario,
            seed=self.seed,
            definitions=definitions,
            policies={k: policies[k].freeze() for k in sorted(policies)},
            overall=overall.freeze(),
            series=series,
            hits=Hits(**self.hits),
            occurrences=outcomes,
            stopped_at=None if self.stopped_at is None else from_us(self.stopped_at),
        )


def _with_sum(per_policy: dict[str, list[int]], buckets: int) -> dict[str, tuple[int, ...]]:
    """Return the series by policy and, under ``"all"``, their sum bucket by bucket."""
    total = tuple(map(sum, zip(*per_policy.values(), strict=True))) or (0,) * buckets
    return {**{k: tuple(v) for k, v in per_policy.items()}, "all": total}


def _worst(series: Iterable[list[int | None]], buckets: int) -> list[int | None]:
    """Return the worst lateness of ``series`` bucket by bucket (``None``: none published)."""
    worst: list[int | None] = [None] * buckets
    for one in series:
        for index, us in enumerate(one):
            if us is not None:
                current = worst[index]
                if current is None or us > current:
                    worst[index] = us
    return worst


async def drive(
    scenario: Scenario,
    seed: int,
    store_factory: StoreFactory,
    *,
    inner_broker: object | None = None,
    trace: bool = False,
    exhaustive: bool = False,
    progress: Progress | None = None,
) -> SimulationResult:
    """Run ``scenario`` against the store ``store_factory`` builds; see :func:`simulate`."""
    from steeple.core.ports import MessageBroker
    from steeple.testing.entropy import DeterministicRandom

    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ScenarioError(f"seed must be an int, not {type(seed).__name__}")
    if not isinstance(scenario, Scenario):
        raise ScenarioError(f"scenario must be a Scenario, not {type(scenario).__name__}")
    if inner_broker is not None and not isinstance(inner_broker, MessageBroker):
        raise ScenarioError("broker must implement steeple.core.ports.MessageBroker")
    clock = _Clock(scenario.start)
    store = await store_factory(scenario.config, clock, DeterministicRandom(seed))
    broker = SimulatedBroker(scenario.broker, seed, inner_broker)
    try:
        driver = _Driver(
            scenario,
            seed,
            store,
            clock,
            broker,
            trace=trace,
            exhaustive=exhaustive,
            progress=progress,
        )
        result = await driver.run()
    finally:
        await store.close()
    # One backlog sample per bucket, or the series would mislead.
    if len(result.series.times) != len(next(iter(result.series.backlog.values()))):
        raise SimulationError("backlog samples and buckets do not line up")
    return result
