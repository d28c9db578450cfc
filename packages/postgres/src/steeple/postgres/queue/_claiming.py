"""Claiming: the claim loop, batch claims, and the estimate of the server's clock.

Each round takes up to ``batch_size`` due tasks in one call of the schema's claim function
(``UPDATE ... FROM (SELECT ... FOR NO KEY UPDATE SKIP LOCKED)``, a fresh random lease token
per task) and starts a handler for each, never more than ``concurrency`` at once, nor more
than a queue's own limit in this worker, nor more plain ``def`` handlers than the worker
has threads: a worker claims only what it can start.

A worker whose handlers all run on the event loop keeps up to two claims in flight (two
lanes of rounds), each of at most half its slots (rounded up): one claim's round trip
overlaps the handlers of the other's tasks. The slots a claim asked for count as taken
(in all and per queue) until its tasks run, so the tasks running and the claims in flight
never ask for more than ``concurrency`` or a queue's own limit. Only the first lane polls
and waits for wake-ups; the second claims while claims come back full and otherwise waits
for one that does, so an idle worker polls no more than with one lane. A worker with a
plain ``def`` handler keeps one claim in flight (what a claim takes is known only from its
answer, and each sync task it takes needs a thread).

Each queue's claim walks its claim order from the last task this worker took there (a
position), not from the front, which skips the entries of what it already claimed (a held
vacuum horizon keeps them in the claim index); it walks from the front at least every poll
interval and right after a walk from the position found nothing, so work placed before
the position waits at most a poll interval (the rule: ``steeple.core.claims.ClaimWalk``).

Slots follow demand. The free slots are shared evenly among the queues with room, starting
from a different queue each round so none starves the others; a queue that answered with
less than it was asked for (empty, paused, or held by a limit) is drained: the next rounds
give its slots to the others, at once, without waiting for a poll, until a wake-up (a NOTIFY,
a due-time timer), an outcome written while a limit held work back, or a poll interval says
it may have work again. The loop sleeps only when every queue it asked answered short.

The claim function applies what is stored for all workers (paused queues, global
concurrency and rate limits) and says when a limit held work back: the loop then also
retries as soon as this worker writes an outcome (that freed a global slot); slots freed by
other workers are seen at the next poll or wake-up. While it waits for that, the successes
its handlers report go with its next claim (``complete_and_claim``: written first, in the
claim's transaction, so the claim counts the slots they freed): a round is one call.

Every claim carries a give-up time on the server's clock (estimated from this host's
monotonic clock, re-anchored by every answer): a claim the server runs later than that
takes nothing.

A claimed task whose handler is a plain ``def`` waits for one of the worker's threads at
most a quarter of its lease (before its first renewal would be due); if none frees up by
then, or the worker stops first, it is handed back (pending, attempt refunded) for other
workers, instead of keeping a lease this worker cannot use.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import time
from collections import Counter
from collections.abc import Callable, Collection, Coroutine, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Final

from steeple.core.backoff import Backoff
from steeple.core.claims import ClaimPosition, ClaimWalk
from steeple.postgres._arrays import text_array
from steeple.postgres.queue import _metrics, _tracing
from steeple.postgres.queue._aio import wait_any, wait_either
from steeple.postgres.queue._completions import Completions, success_columns
from steeple.postgres.queue._crashpoints import crash_point
from steeple.postgres.queue._db import DB_ERRORS
from steeple.postgres.queue._driver import describe_db_error, is_data_error
from steeple.postgres.queue._execution import Executor, JobContext
from steeple.postgres.queue._inflight import Claimed
from steeple.postgres.queue._outage import Retry
from steeple.postgres.queue._shared import LOG, WorkerEnv
from steeple.postgres.queue._wakeups import Wakeups

if TYPE_CHECKING:
    from opentelemetry.trace import Tracer

__all__ = ["Claimer"]


@functools.lru_cache(maxsize=256)
def _backoff(initial_us: int, maximum_us: int, factor: int, jitter: float) -> Backoff:
    # Most tasks share a handful of policies: build (and validate) each once.
    return Backoff(
        initial=timedelta(microseconds=initial_us),
        maximum=timedelta(microseconds=maximum_us),
        factor=factor,
        jitter=jitter,
    )


class _ThreadGate:
    """The worker's threads as the claim loop hands them out: one per started sync handler.

    Waiters are served first come, first served; a freed thread passes straight to the
    oldest waiter.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self.busy = 0
        """Threads handed out (to handlers running, or about to run, in them)."""
        self.held = 0
        """Sync attempts in this worker: given a thread, or waiting for one."""
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    def _prune(self) -> None:
        while self._waiters and self._waiters[0].done():
            self._waiters.popleft()

    async def take(self, timeout: float, stopping: asyncio.Future[Any]) -> bool:
        """Take a thread, waiting at most ``timeout`` s; return False if none freed up.

        Also False when ``stopping`` finishes first.
        """
        self._prune()
        if self.busy < self.size and not self._waiters:
            self.busy += 1
            return True
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await asyncio.wait(
                {waiter, stopping}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
            )
        except BaseException:
            # Cancelled while waiting: a thread passed to it meanwhile goes to the next one.
            if waiter.done() and not waiter.cancelled():
                self.give_back()
            waiter.cancel()
            raise
        if waiter.done():
            return True
        waiter.cancel()
        return False

    def give_back(self) -> None:
        """Free a thread taken with :meth:`take` (the oldest waiter gets it)."""
        self._prune()
        if self._waiters:
            self._waiters.popleft().set_result(None)
        else:
            self.busy -= 1


def _share_out(left: int, names: Sequence[str], room: dict[str, int], shares: Counter[str]) -> int:
    """Share ``left`` slots evenly among ``names`` within their ``room``; return what is left.

    The first names get the remainder of an uneven split; what a name has no room for goes
    to the others. ``room`` and ``shares`` are updated.
    """
    open_ = [name for name in names if room[name] > 0]
    while left > 0 and open_:
        each = max(1, left // len(open_))
        for name in open_:
            take = min(each, room[name], left)
            shares[name] += take
            room[name] -= take
            left -= take
            if not left:
                break
        open_ = [name for name in open_ if room[name] > 0]
    return left


_FRONT: Final = ClaimWalk()


def _positions(
    starts: Sequence[ClaimPosition | None],
) -> tuple[list[str | None], list[str | None], list[str | None]]:
    """Spell each queue's position as the claim's three text arrays (NULL: the front)."""
    return (
        text_array(None if p is None else p.priority for p in starts),
        text_array(None if p is None else p.run_at for p in starts),
        text_array(None if p is None else p.id for p in starts),
    )


async def _complete_and_claim(
    env: WorkerEnv, carried: list[Claimed], *claim: object
) -> list[tuple[Any, ...]]:
    """Write ``carried``'s successes, then claim (``claim``: claim_timed's arguments)."""
    return await env.db.fetch(
        env.sql.complete_and_claim, *success_columns(carried), *claim, timeout=env.timeout
    )


@dataclasses.dataclass(slots=True)
class _Loop:
    """What one run of the claim loop keeps from round to round."""

    handlers: asyncio.TaskGroup
    stop_waiter: asyncio.Future[Any]
    """Done once the worker is told to stop: every wait of the loop ends on it."""
    retry: Retry
    turn: int = 0
    """Which queue's share comes first this round (see ``Claimer._wants``)."""
    held_before: bool = False
    """Whether a limit held the last claim back."""
    names_before: list[str] | None = None
    """The task names the last claim asked for."""
    extra: bool = False
    """A lane beside the first: it claims only while claims fill up (see ``Claimer._round``)."""


class Claimer:
    """The claim loop of one worker."""

    def __init__(
        self,
        env: WorkerEnv,
        names: Sequence[str],
        *,
        queues: Sequence[tuple[str, int]],
        concurrency: int,
        batch: int,
        wakeups: Wakeups,
        executor: Executor,
        completions: Completions,
        sync_names: Collection[str] = (),
        threads: int = 1,
    ) -> None:
        self._env = env
        self._names = list(names)
        self._sync = frozenset(sync_names).intersection(self._names)
        # The names whose handlers run on the event loop: what the worker claims while
        # every thread is taken.
        self._async_names = [name for name in self._names if name not in self._sync]
        self._queues = list(queues)
        self._concurrency = concurrency
        self._batch = batch
        self._gate = _ThreadGate(threads)
        capacity = concurrency if self._async_names else min(concurrency, threads)
        self._min_claim = max(1, min(batch, capacity) // 4)
        # Claims in flight at once: two, each of at most half the slots, so one claim's
        # round trip overlaps the handlers of the other's tasks; one while a handler needs
        # a thread (what a claim takes cannot be told before it answers, and every sync
        # task it takes needs a thread).
        self._lanes = 1 if self._sync or concurrency < 2 else 2
        # Rounded up, so the lanes' claims can fill every slot between them (an odd
        # concurrency would otherwise leave one slot unasked until a handler ends, as
        # fewer than a quarter of a batch free waits for one); ``free`` counts the other
        # lane's claim, so together they never ask for more than ``concurrency``.
        self._lane_batch = min(batch, -(-concurrency // self._lanes))
        # Slots asked for by the claims in flight (in all and per queue): not free, though
        # their tasks are not yet in ``env.inflight``.
        self._reserved = 0
        self._reserved_per_queue: Counter[str] = collections.Counter()
        # Set when a claim took all it asked for: more may be due, the extra lane claims.
        self._filled = asyncio.Event()
        self._wakeups = wakeups
        self._executor = executor
        self._completions = completions
        # Queues that answered with less than asked for -> when (monotonic): their slots go
        # to the other queues until a wake-up, an outcome written under a held limit, or a
        # poll interval says they may have due work again.
        self._drained: dict[str, float] = {}
        # Where each queue's next claim walks its claim order from (steeple.core.claims).
        self._walks: dict[str, ClaimWalk] = {}

    def _capacity(self) -> tuple[int, list[str]]:
        """Return the slots free for new claims and the task names to claim for them."""
        free = self._concurrency - len(self._env.inflight) - self._reserved
        if not self._sync:
            return free, self._names
        free_threads = self._gate.size - self._gate.held
        if not self._async_names:  # every handler needs a thread
            return min(free, free_threads), self._names
        if free_threads <= 0:  # only what starts now: the handlers on the event loop
            return free, self._async_names
        return free, self._names

    def _wants(self, free: int, turn: int) -> tuple[list[str], list[int]]:
        """Share ``min(free, batch)`` slots out among the queues with room, from ``turn``.

        Evenly among the queues that may have due work first (the queue at ``turn`` and
        those after it get the remainder), what they have no room for to the others; what
        is still left goes to the drained queues, so an idle worker asks every queue.
        """
        per_queue = self._env.inflight.per_queue
        reserved = self._reserved_per_queue
        count = len(self._queues)
        order = [self._queues[(turn + i) % count][0] for i in range(count)]
        room = {name: limit - per_queue[name] - reserved[name] for name, limit in self._queues}
        drained = self._drained
        shares: Counter[str] = collections.Counter()
        left = min(free, self._lane_batch)
        left = _share_out(left, [n for n in order if n not in drained], room, shares)
        _share_out(left, [n for n in order if n in drained], room, shares)
        queues = [name for name in order if shares[name] > 0]
        return queues, [shares[name] for name in queues]

    def _more_may_be_due(self) -> bool:
        """Whether a queue with room in this worker has not answered short since last asked."""
        per_queue = self._env.inflight.per_queue
        reserved = self._reserved_per_queue
        return any(
            limit > per_queue[name] + reserved[name] and name not in self._drained
            for name, limit in self._queues
        )

    async def claim_until(self, stop: asyncio.Event, handlers: asyncio.TaskGroup) -> None:
        """Claim and start handlers in ``handlers`` until ``stop`` is set."""
        stop_waiter = asyncio.ensure_future(stop.wait())
        loops = [
            _Loop(handlers, stop_waiter, Retry(self._env.random), turn=i, extra=i > 0)
            for i in range(self._lanes)
        ]
        try:
            if len(loops) == 1:
                await self._lane(stop, loops[0])
            else:
                async with asyncio.TaskGroup() as lanes:
                    for loop in loops:
                        lanes.create_task(self._lane(stop, loop))
        finally:
            self._completions.carry(False)
            stop_waiter.cancel()

    async def _lane(self, stop: asyncio.Event, loop: _Loop) -> None:
        """Run rounds until ``stop`` is set: one claim in flight at a time in this lane."""
        while not stop.is_set():
            await self._round(loop)

    def _reserve(self, queues: Sequence[str], wants: Sequence[int], sign: int) -> None:
        """Count (``sign`` 1) or stop counting (-1) a claim's ``wants`` as taken slots."""
        reserved = self._reserved_per_queue
        for name, want in zip(queues, wants, strict=True):
            reserved[name] += sign * want
            self._reserved += sign * want

    async def _round(self, loop: _Loop) -> None:
        """One round of the claim loop: claim what fits, start it, wait if nothing more is due."""
        env = self._env
        inflight = env.inflight
        completions = self._completions
        free, names = self._capacity()
        # Claim in worthwhile batches: while a quarter of a batch is not yet free
        # and handlers are running, wait for more slots instead of claiming crumbs.
        if free <= 0 or (inflight.running and free < self._min_claim):
            await self._wait_for_a_slot(loop)
            return
        self._undrain(loop, names)
        loop.names_before = names
        queues, wants = self._wants(free, loop.turn)
        loop.turn += 1
        if not wants:  # every queue is at its own limit in this worker
            await self._wait_for_a_slot(loop)
            return
        self._wakeups.wake.clear()
        inflight.outcome_written.clear()
        wanted = sum(wants)
        sent = time.monotonic()
        starts = [self._walks.get(q, _FRONT).start(sent, env.poll) for q in queues]
        # The give-up time, on the server's clock: what it surely reads when this
        # worker stops waiting (see steeple.core.remote_clock). A claim the server
        # runs later than that takes nothing, instead of leasing tasks to nobody.
        give_up = env.server_clock.at_least(sent + env.timeout)
        # Under a held limit the buffered successes free the slots this claim may
        # take: written in its transaction, before it (one call, not two).
        carried = completions.take_carried() if completions.carrier else []
        completions.carry(False)
        # The slots asked for stay taken until the tasks claimed are in env.inflight (the
        # other lane's claim may not ask for them meanwhile).
        self._reserve(queues, wants, 1)
        try:
            answer = await self._send(loop, carried, (queues, wants, names, give_up), starts)
            if answer is None:
                return
            server_now, rows, held = await self._read(loop, answer, carried)
            if not rows and server_now >= give_up:
                await self._refused(loop)
                return
            self._claimed(queues, wants, starts, rows, sent, held=held is not None)
            loop.held_before = held is not None
            await self._start_all(loop, rows, sent)
        finally:
            self._reserve(queues, wants, -1)
            if self._lanes > 1:
                # What the claim did not take is free again: a lane waiting for a slot
                # may claim it.
                inflight.slot_freed.set()
        if len(rows) >= wanted:
            self._filled.set()
        if len(rows) >= wanted or self._more_may_be_due():
            # Let handlers and the flusher run before the next claim, which gives
            # the slots of the queues that answered short to the others.
            await asyncio.sleep(0)
            return
        if loop.extra:
            # Only the first lane polls and waits for wake-ups: the extra one comes back
            # when a claim fills up again (so an idle worker polls no more than before).
            await self._wait_filled(loop)
            return
        await self._wait_idle(loop, held=held is not None)

    async def _wait_filled(self, loop: _Loop) -> None:
        """Wait until a claim takes all it asked for (or the worker stops)."""
        self._filled.clear()
        await wait_either(self._filled, loop.stop_waiter, None)

    async def _wait_for_a_slot(self, loop: _Loop) -> None:
        """Wait until one of this worker's handlers ends (or the worker stops)."""
        self._completions.carry(False)
        inflight = self._env.inflight
        inflight.slot_freed.clear()
        await wait_either(inflight.slot_freed, loop.stop_waiter, None)

    def _undrain(self, loop: _Loop, names: list[str]) -> None:
        """Give the drained queues their slots back when they may have work again."""
        drained = self._drained
        if (
            self._wakeups.wake.is_set()
            or names is not loop.names_before
            or (
                loop.held_before
                and (
                    self._env.inflight.outcome_written.is_set()
                    or self._completions.buffered.is_set()
                )
            )
        ):
            # Work may have come (a NOTIFY, a timer), a limit may have freed a
            # slot, or other names are asked for: every queue may have work again.
            drained.clear()
        else:
            expired = time.monotonic() - self._env.poll
            for name in [n for n, since in drained.items() if since <= expired]:
                del drained[name]

    async def _send(
        self,
        loop: _Loop,
        carried: list[Claimed],
        asked: tuple[list[str], list[int], list[str], float],
        starts: Sequence[ClaimPosition | None],
    ) -> list[tuple[Any, ...]] | None:
        """Send a claim, with the ``carried`` successes; None if it failed (and was handled).

        ``asked``: the queues, how many of each, the task names and the give-up time.
        """
        env = self._env
        queues, wants, names, give_up = asked
        try:
            crash_point("queue.claim.before")
            claim = (queues, text_array(wants), names, env.worker_id, give_up)
            return await (
                _complete_and_claim(env, carried, *claim, *_positions(starts))
                if carried
                else env.db.fetch(
                    env.sql.claim_timed, *claim, *_positions(starts), timeout=env.timeout
                )
            )
        except DB_ERRORS as exc:
            await self._claim_failed(loop, carried, exc)
            return None

    async def _claim_failed(self, loop: _Loop, carried: list[Claimed], exc: BaseException) -> None:
        """Report a failed claim and back off, unless a carried success is what failed."""
        if carried:
            self._completions.carry_failed(carried, exc)
            if is_data_error(exc):
                # A success the database refuses to store, not the claim: the
                # flusher finds it; the claim is sent again at once, alone.
                return
        status = self._env.status
        status.claims_ok = False
        status.failed("claims", exc)
        status.claimed_once = True
        self._env.stats.failed_claims += 1
        delay = loop.retry.failed()
        if not status.database.failed("claims", exc):
            LOG.warning("claim failed (%s); retrying in %.2f s", describe_db_error(exc), delay)
        if loop.extra:
            # The first lane retries (and reports the outage); this one comes back once
            # a claim fills up again.
            await self._wait_filled(loop)
            return
        # Backing off: only a stop cuts the wait short (wake-ups would not help).
        await wait_any((), loop.stop_waiter, delay)

    async def _read(
        self, loop: _Loop, answer: list[tuple[Any, ...]], carried: list[Claimed]
    ) -> tuple[float, list[Any], tuple[Any, ...] | None]:
        """Take in a claim's answer: the server's time, the claimed rows, the held row."""
        env = self._env
        completions = self._completions
        loop.retry.succeeded()
        env.status.database.succeeded()
        crash_point("queue.claim.committed")
        if carried:
            # One row's last column: the ids that succeeded.
            done = next(row[19] for row in answer if row[19] is not None)
            await completions.carried(carried, set(done))
        env.stats.claim_rounds += 1
        server_now = float(answer[0][0])
        env.server_clock.observe(server_now, time.monotonic())
        rows = [row[1:19] for row in answer if row[1] is not None]
        # A row of id NULL and held true: a global limit held work back; its run_at
        # (when set) is when a rate window frees a start.
        held = next((row for row in answer if row[1] is None and row[17]), None)
        if held is not None and held[13] is not None:
            self._wakeups.wake_at(held[13].timestamp() - server_now)
        return server_now, rows, held

    async def _refused(self, loop: _Loop) -> None:
        """Count a claim the server refused as too late; wait a poll if it happens again."""
        # Refused as too late: the server's clock moved under the estimate, or
        # the request sat in the network. The answer re-anchored the estimate:
        # try again at once, then at the poll interval while it keeps happening.
        env = self._env
        status = env.status
        env.stats.refused_claims += 1
        refused_before = not status.claims_ok
        status.claims_ok = False
        status.claimed_once = True
        LOG.warning(
            "the server refused a claim as arriving after its give-up time "
            "(its clock moved, or the network delayed the request)"
        )
        if refused_before:
            await wait_either(self._wakeups.wake, loop.stop_waiter, env.poll)

    def _claimed(
        self,
        queues: Sequence[str],
        wants: Sequence[int],
        starts: Sequence[ClaimPosition | None],
        rows: Sequence[Any],
        sent: float,
        *,
        held: bool,
    ) -> None:
        """Record a claim that took ``rows``: status, where next to walk, which queues drained."""
        status = self._env.status
        drained = self._drained
        status.claims_ok = True
        status.succeeded("claims")
        status.claimed_once = True
        # Slots follow demand: a queue that answered short is drained (row[15]: the
        # queue of a claimed task), one that filled its share may have more.
        got = collections.Counter(row[15] for row in rows)
        walks = self._walks_after(queues, starts, rows, sent, held=held)
        for name, want in zip(queues, wants, strict=True):
            # A walk from a position that found nothing is no answer: the next
            # claim walks the queue from the front at once.
            if got[name] < want and not walks[name].owed:
                drained[name] = sent
            else:
                drained.pop(name, None)

    async def _start_all(self, loop: _Loop, rows: Sequence[Any], sent: float) -> None:
        """Start a handler for each claimed row."""
        env = self._env
        # Tracing (only while a tracer provider is configured) reads the enqueuers'
        # trace contexts of the batch with one more query; none otherwise. The
        # leases already run and are renewed only once the handlers start, so the
        # read gets a quarter of the shortest lease at most (row[7]: the lease).
        tracer = _tracing.tracer() if rows else None
        inst = _metrics.recording() if rows else None
        contexts = (
            await _tracing.trace_contexts(
                env.db,
                env.sql,
                [row[0] for row in rows],
                min(env.timeout, min(row[7].total_seconds() for row in rows) / 4),
            )
            if tracer is not None
            else None
        )
        for row in rows:
            self._start(row, sent, loop.handlers, inst, tracer, contexts, loop.stop_waiter)

    async def _wait_idle(self, loop: _Loop, *, held: bool) -> None:
        """Wait for what may bring work: a wake-up, a freed slot or limit, or a poll interval."""
        env = self._env
        inflight = env.inflight
        completions = self._completions
        env.stats.idle_waits += 1
        events = [self._wakeups.wake]
        if held:
            # A global limit frees up when an outcome of this worker is written
            # (perhaps while the claim ran: the event was cleared before it), or
            # when a success is buffered: the next claim writes it first.
            events.append(inflight.outcome_written)
            completions.carry(True)
            events.append(completions.buffered)
        if len(self._drained) < len(self._queues):
            # A queue at its own limit in this worker filled its share: it may have
            # more, to claim as soon as one of its handlers ends.
            inflight.slot_freed.clear()
            events.append(inflight.slot_freed)
        await wait_any(tuple(events), loop.stop_waiter, env.poll)
        if completions.buffered.is_set():
            # Let the other handlers that are ready finish: their successes go too.
            await asyncio.sleep(0)

    def _walks_after(
        self,
        queues: Sequence[str],
        starts: Sequence[ClaimPosition | None],
        rows: Sequence[Any],
        at: float,
        *,
        held: bool,
    ) -> dict[str, ClaimWalk]:
        """Record where each queue's next claim walks from, after a claim took ``rows``.

        ``held``: a limit held the claim back.
        """
        # Only the last task taken from each queue in claim order counts (ClaimWalk.after
        # keeps the greatest position): one position per queue, not one per task.
        last: dict[str, tuple[int, Any, int]] = {}
        for row in rows:  # row[15]: queue, row[17]: priority, row[12]: run_at
            key = (-row[17], row[12], row[0])  # ClaimPosition.key
            seen = last.get(row[15])
            if seen is None or key > seen:
                last[row[15]] = key
        for name, start in zip(queues, starts, strict=True):
            walk = self._walks.get(name, _FRONT)
            got = last.get(name)
            taken = [] if got is None else [ClaimPosition(-got[0], got[1], got[2])]
            self._walks[name] = walk.after(start, taken, at, held=held)
        return self._walks

    def _start(
        self,
        row: Any,
        now: float,
        handlers: asyncio.TaskGroup,
        inst: _metrics.QueueInstruments | None,
        tracer: Tracer | None,
        contexts: dict[int, str] | None,
        stopping: asyncio.Future[Any],
    ) -> None:
        (task_id, name, args_text, attempt, max_attempts, run_id, token, lease,
         b_init, b_max, b_factor, b_jitter, run_at, started_at, scheduled_for, queue,
         _held, _priority) = row  # fmt: skip
        env = self._env
        lease_s = lease.total_seconds()
        claimed = Claimed(
            ctx=JobContext(
                task_id=task_id,
                task_name=name,
                run_id=run_id,
                attempt=attempt,
                max_attempts=max_attempts,
                worker_id=env.worker_id,
                scheduled_for=scheduled_for,
                queue=queue,
            ),
            token=token,
            args_text=args_text,
            lease=lease_s,
            backoff=_backoff(b_init, b_max, b_factor, b_jitter),
            renew_at=now + lease_s / 3,
            expires_at=now + lease_s,
            started_at=started_at,
        )
        if inst is not None:
            attributes = _metrics.task_attributes(name, queue)
            inst.claimed.add(1, attributes)
            inst.pickup_latency.record(max((started_at - run_at).total_seconds(), 0.0), attributes)
        env.stats.claimed += 1
        env.inflight.add(claimed)
        execute = self._executor.execute
        if name in self._sync or tracer is not None:

            def run() -> Coroutine[Any, Any, None]:
                execution = execute(claimed, inst)
                if tracer is not None and contexts is not None:
                    return _tracing.traced_run(
                        tracer, claimed.ctx, contexts.get(task_id), execution
                    )
                return execution

            if name in self._sync:
                self._gate.held += 1
                # A quarter of the lease: handed back before its first renewal is due (at
                # a third).
                attempt_run = self._on_a_thread(claimed, now + lease_s / 4, stopping, run)
            else:
                attempt_run = run()
        else:
            # The common case, without a closure: an async handler, not traced.
            attempt_run = execute(claimed, inst)
        # Named for the loop-lag monitor, which reports the task that blocks the loop.
        env.inflight.tasks[task_id] = handlers.create_task(
            attempt_run, name=f"steeple task {name!r} #{task_id} attempt {attempt}"
        )

    async def _on_a_thread(
        self,
        claimed: Claimed,
        start_by: float,
        stopping: asyncio.Future[Any],
        run: Callable[[], Coroutine[Any, Any, None]],
    ) -> None:
        """Run a sync handler once a thread is free, else hand the task back.

        Handed back when no thread frees up by ``start_by`` (monotonic), or ``stopping``
        finishes first (the worker stops).
        """
        gate = self._gate
        try:
            try:
                started = await gate.take(max(0.0, start_by - time.monotonic()), stopping)
            except asyncio.CancelledError:
                # A hard stop while it waited: handed back with the others at shutdown.
                self._completions.hand_back(claimed)
                self._env.inflight.remove(claimed.ctx.task_id)
                raise
            if started:
                try:
                    await run()
                finally:
                    gate.give_back()
                return
            try:
                await self._hand_back(claimed, stopping=stopping.done())
            finally:
                self._env.inflight.remove(claimed.ctx.task_id)
        finally:
            gate.held -= 1

    async def _hand_back(self, claimed: Claimed, *, stopping: bool) -> None:
        """Release a task this worker could not start: pending again, attempt refunded."""
        ctx = claimed.ctx
        LOG.info(
            "task %s (%s): not started, %s; handed back for other workers",
            ctx.task_id,
            ctx.task_name,
            "the worker is stopping"
            if stopping
            else f"no thread of this worker freed up within {claimed.lease / 4:g} s",
        )
        try:
            await self._completions.release_now(claimed)
        except asyncio.CancelledError:
            # A hard stop cut the release short: tried again with the others at shutdown.
            self._completions.hand_back(claimed)
            raise
        finally:
            self._env.stats.not_started += 1
