"""Claiming: the claim loop, batch claims, and the estimate of the server's clock.

Each round takes up to ``batch_size`` due tasks in one call of the schema's claim function
(``UPDATE ... FROM (SELECT ... FOR NO KEY UPDATE SKIP LOCKED)``, a fresh random lease token
per task) and starts a handler for each, never more than ``concurrency`` at once, nor more
than a queue's own limit in this worker. The free slots are shared out among the queues,
starting from a different queue each round so none starves the others. The claim function
applies what is stored for all workers (paused queues, global concurrency and rate limits)
and says when a limit held work back: the loop then also retries as soon as this worker
writes an outcome (that freed a global slot); slots freed by other workers are seen at the
next poll or wake-up. Every
claim carries a give-up time on the server's clock (estimated from this host's monotonic
clock, re-anchored by every answer): a claim the server runs later than that takes nothing.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Coroutine, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from steeple.core.backoff import Backoff
from steeple.engine.crashpoints import crash_point
from steeple.postgres._arrays import text_array
from steeple.postgres.queue import _metrics, _tracing
from steeple.postgres.queue._aio import wait_any, wait_either
from steeple.postgres.queue._db import DB_ERRORS
from steeple.postgres.queue._driver import describe_db_error
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
    ) -> None:
        self._env = env
        self._names = list(names)
        self._queues = list(queues)
        self._concurrency = concurrency
        self._batch = batch
        self._min_claim = max(1, min(batch, concurrency) // 4)
        self._wakeups = wakeups
        self._executor = executor

    def _wants(self, free: int, turn: int) -> tuple[list[str], list[int]]:
        """Share ``min(free, batch)`` slots out among the queues with room, from ``turn``."""
        per_queue = self._env.inflight.per_queue
        left = min(free, self._batch)
        queues: list[str] = []
        wants: list[int] = []
        count = len(self._queues)
        for i in range(count):
            name, limit = self._queues[(turn + i) % count]
            want = min(left, limit - per_queue[name])
            if want > 0:
                queues.append(name)
                wants.append(want)
                left -= want
        return queues, wants

    async def claim_until(self, stop: asyncio.Event, handlers: asyncio.TaskGroup) -> None:
        """Claim and start handlers in ``handlers`` until ``stop`` is set."""
        env = self._env
        pool = env.db
        status = env.status
        stats = env.stats
        inflight = env.inflight
        server_clock = env.server_clock
        wake = self._wakeups.wake
        names = self._names
        inst = _metrics.instruments()
        stop_waiter = asyncio.ensure_future(stop.wait())
        turn = 0
        retry = Retry(env.random)
        try:
            while not stop.is_set():
                free = self._concurrency - len(inflight)
                # Claim in worthwhile batches: while a quarter of a batch is not yet free
                # and handlers are running, wait for more slots instead of claiming crumbs.
                if free <= 0 or (inflight.running and free < self._min_claim):
                    inflight.slot_freed.clear()
                    await wait_either(inflight.slot_freed, stop_waiter, None)
                    continue
                queues, wants = self._wants(free, turn)
                turn += 1
                if not wants:  # every queue is at its own limit in this worker
                    inflight.slot_freed.clear()
                    await wait_either(inflight.slot_freed, stop_waiter, None)
                    continue
                wake.clear()
                inflight.outcome_written.clear()
                wanted = sum(wants)
                sent = time.monotonic()
                # The give-up time, on the server's clock: what it surely reads when this
                # worker stops waiting (see steeple.core.remote_clock). A claim the server
                # runs later than that takes nothing, instead of leasing tasks to nobody.
                give_up = server_clock.at_least(sent + env.timeout)
                try:
                    crash_point("queue.claim.before")
                    answer = await pool.fetch(
                        env.sql.claim_timed,
                        queues,
                        text_array(wants),
                        names,
                        env.worker_id,
                        give_up,
                        timeout=env.timeout,
                    )
                except DB_ERRORS as exc:
                    status.claims_ok = False
                    status.failed("claims", exc)
                    status.claimed_once = True
                    stats.failed_claims += 1
                    delay = retry.failed()
                    if not status.database.failed("claims", exc):
                        LOG.warning(
                            "claim failed (%s); retrying in %.2f s", describe_db_error(exc), delay
                        )
                    # Backing off: only a stop cuts the wait short (wake-ups would not help).
                    await wait_any((), stop_waiter, delay)
                    continue
                retry.succeeded()
                status.database.succeeded()
                crash_point("queue.claim.committed")
                stats.claim_rounds += 1
                server_now = float(answer[0][0])
                server_clock.observe(server_now, time.monotonic())
                rows = [row[1:] for row in answer if row[1] is not None]
                # A row of id NULL and held true: a global limit held work back; its run_at
                # (when set) is when a rate window frees a start.
                held = next((row for row in answer if row[1] is None and row[-1]), None)
                if held is not None and held[13] is not None:
                    self._wakeups.wake_at(held[13].timestamp() - server_now)
                if not rows and server_now >= give_up:
                    # Refused as too late: the server's clock moved under the estimate, or
                    # the request sat in the network. The answer re-anchored the estimate:
                    # try again at once, then at the poll interval while it keeps happening.
                    stats.refused_claims += 1
                    refused_before = not status.claims_ok
                    status.claims_ok = False
                    status.claimed_once = True
                    LOG.warning(
                        "the server refused a claim as arriving after its give-up time "
                        "(its clock moved, or the network delayed the request)"
                    )
                    if refused_before:
                        await wait_either(wake, stop_waiter, env.poll)
                    continue
                status.claims_ok = True
                status.succeeded("claims")
                status.claimed_once = True
                # Tracing (only while a tracer provider is configured) reads the enqueuers'
                # trace contexts of the batch with one more query; none otherwise. The
                # leases already run and are renewed only once the handlers start, so the
                # read gets a quarter of the shortest lease at most (row[7]: the lease).
                tracer = _tracing.tracer() if rows else None
                contexts = (
                    await _tracing.trace_contexts(
                        pool,
                        env.sql,
                        [row[0] for row in rows],
                        min(env.timeout, min(row[7].total_seconds() for row in rows) / 4),
                    )
                    if tracer is not None
                    else None
                )
                for row in rows:
                    self._start(row, sent, handlers, inst, tracer, contexts)
                if held is not None:
                    # A global limit frees up when an outcome of this worker is written
                    # (perhaps while the claim ran: the event was cleared before it).
                    await wait_any((wake, inflight.outcome_written), stop_waiter, env.poll)
                elif len(rows) < wanted:
                    await wait_either(wake, stop_waiter, env.poll)
                else:
                    # Let handlers and the flusher run before the next claim.
                    await asyncio.sleep(0)
        finally:
            stop_waiter.cancel()

    def _start(
        self,
        row: Any,
        now: float,
        handlers: asyncio.TaskGroup,
        inst: _metrics.QueueInstruments,
        tracer: Tracer | None,
        contexts: dict[int, str] | None,
    ) -> None:
        (task_id, name, args_text, attempt, max_attempts, run_id, token, lease,
         b_init, b_max, b_factor, b_jitter, run_at, started_at, scheduled_for, queue,
         _held) = row  # fmt: skip
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
        attributes = _metrics.task_attributes(name, queue)
        inst.claimed.add(1, attributes)
        inst.pickup_latency.record(max((started_at - run_at).total_seconds(), 0.0), attributes)
        env.stats.claimed += 1
        env.inflight.add(claimed)
        run: Coroutine[Any, Any, None] = self._executor.execute(claimed)
        if tracer is not None and contexts is not None:
            run = _tracing.traced_run(tracer, claimed.ctx, contexts.get(task_id), run)
        # Named for the loop-lag monitor, which reports the task that blocks the loop.
        env.inflight.tasks[task_id] = handlers.create_task(
            run, name=f"steeple task {name!r} #{task_id} attempt {attempt}"
        )
