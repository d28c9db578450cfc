"""Completions: writing each attempt's outcome, fenced by its lease token.

Successes are buffered and written by one flusher in batches (one statement for up to
``_FLUSH_BATCH``); a batch whose reply was lost is retried, and a task found already
completed by that lost write is confirmed, not reported as fenced. A batch the database
refuses for the values it carries (a result it cannot store) is split in halves until the
refused outcomes are alone: the others are written, and each refused one fails its own task
with a :class:`ResultEncodingError`, so one bad value never holds back the rest. Failures
(retry or fail for good) are written one by one; work handed back (at shutdown, or a task
the worker could not start) is released.
"""

from __future__ import annotations

import asyncio
import collections
from datetime import timedelta
from typing import Final

from steeple.core.tasks import TaskEvent, TaskState, transition
from steeple.engine.crashpoints import crash_point
from steeple.postgres._arrays import text_array
from steeple.postgres.queue import _metrics
from steeple.postgres.queue._db import DB_ERRORS
from steeple.postgres.queue._driver import describe_db_error, is_data_error
from steeple.postgres.queue._failures import Failure, describe
from steeple.postgres.queue._inflight import Claimed
from steeple.postgres.queue._shared import LOG, WorkerEnv
from steeple.postgres.queue._wakeups import Wakeups
from steeple.postgres.queue.errors import ResultEncodingError

__all__ = ["Completions"]

_FLUSH_BATCH: Final = 1000

_AFTER_RETRY: Final = transition(TaskState.RUNNING, TaskEvent.FAIL_RETRYABLE)
_AFTER_FAILURE: Final = transition(TaskState.RUNNING, TaskEvent.FAIL_PERMANENT)


class Completions:
    """The outcome writer: batched successes, failures, releases, and fencing."""

    def __init__(self, env: WorkerEnv, wakeups: Wakeups) -> None:
        self._env = env
        self._wakeups = wakeups
        self._buffer: list[Claimed] = []
        self._to_release: list[Claimed] = []
        self._flush_wake = asyncio.Event()

    def succeeded(self, claimed: Claimed, result: str | None = None) -> None:
        """Buffer the success of ``claimed`` (and its result's JSON text) for the flusher."""
        claimed.result = result
        self._buffer.append(claimed)
        self._flush_wake.set()

    def hand_back(self, claimed: Claimed) -> None:
        """Release ``claimed`` at shutdown (its handler was cancelled by the drain)."""
        self._to_release.append(claimed)

    def stop(self) -> None:
        """Let the flusher write what is buffered and return (``env.closing`` is set)."""
        self._flush_wake.set()

    async def failed(
        self,
        claimed: Claimed,
        failure: Failure,
        retry_after: timedelta | None,
        *,
        keep_stored_progress: bool = False,
    ) -> None:
        """Record a failed attempt: run again after ``retry_after``, or fail for good.

        ``keep_stored_progress``: leave the task's stored progress as it is (do not write
        the latest reported), for an outcome the database refused to store.
        """
        env = self._env
        pool = env.db
        ctx = claimed.ctx
        progress = None if keep_stored_progress else ctx.progress_text
        inst = _metrics.instruments()
        attributes = _metrics.task_attributes(ctx.task_name, ctx.queue)
        try:
            if retry_after is not None:
                crash_point("queue.retry.before")
                rows = await pool.fetch(
                    env.sql.retry,
                    ctx.task_id,
                    claimed.token,
                    retry_after,
                    failure.summary,
                    env.worker_id,
                    failure.error_type,
                    failure.traceback,
                    progress,
                    timeout=env.timeout,
                )
                crash_point("queue.retry.committed")
                outcome = _AFTER_RETRY
            else:
                rows = await pool.fetch(
                    env.sql.fail,
                    ctx.task_id,
                    claimed.token,
                    failure.summary,
                    env.worker_id,
                    failure.error_type,
                    failure.traceback,
                    progress,
                    timeout=env.timeout,
                )
                outcome = _AFTER_FAILURE
        except DB_ERRORS as exc2:
            # Nothing recorded: the lease expires and the task is recovered and rerun.
            env.status.failed("completions", exc2)
            LOG.warning("could not record the failure of task %s: %s", ctx.task_id, exc2)
            return
        env.status.succeeded("completions")
        env.inflight.outcome_written.set()
        if not rows:
            self.fenced(claimed)
        elif outcome is TaskState.PENDING:
            if retry_after is not None:
                self._wakeups.wake_at(retry_after.total_seconds())
            env.stats.retried += 1
            inst.retried.add(1, attributes)
        else:
            env.stats.failed += 1
            inst.failed.add(1, attributes)

    def fenced(self, claimed: Claimed) -> None:
        """Count an outcome the database rejected: the lease was lost or the task cancelled."""
        self._env.stats.rejected_completions += 1
        _metrics.instruments().lease_lost.add(
            1, _metrics.task_attributes(claimed.ctx.task_name, claimed.ctx.queue)
        )
        claimed.ctx.lease_lost.set()
        LOG.info(
            "task %s: the outcome of attempt %s was rejected (lease lost or cancelled)",
            claimed.ctx.task_id,
            claimed.ctx.attempt,
        )

    async def flush_forever(self) -> None:
        """Write buffered successes in batches until the worker closes and the buffer is empty."""
        env = self._env
        stats = env.stats
        inst = _metrics.instruments()
        buffer = self._buffer
        while True:
            await self._flush_wake.wait()
            self._flush_wake.clear()
            while buffer:
                batch = buffer[:_FLUSH_BATCH]
                del buffer[:_FLUSH_BATCH]
                refused: list[tuple[Claimed, BaseException]] = []
                try:
                    done = await self._write(batch, refused)
                except DB_ERRORS as exc:
                    env.status.failed("completions", exc)
                    LOG.warning("could not record %d completions: %r", len(batch), exc)
                    # Part of a split batch may have committed: the retry confirms it.
                    for claimed in batch:
                        claimed.unsure = True
                    buffer[:0] = batch
                    if env.closing.is_set():
                        # Shutting down: the leases expire and the tasks are rerun elsewhere.
                        buffer.clear()
                        return
                    await asyncio.sleep(min(env.poll, 1.0))
                    continue
                env.status.succeeded("completions")
                env.inflight.outcome_written.set()
                bad = {c.ctx.task_id for c, _ in refused}
                missed = [c for c in batch if c.ctx.task_id not in done]
                confirmed = await self._confirm_completed(
                    [c for c in missed if c.unsure and c.ctx.task_id not in bad]
                )
                # Counted per task name and queue: a batch mixes everything that finished.
                per_name: collections.Counter[tuple[str, str]] = collections.Counter()
                for claimed in batch:
                    if claimed.ctx.task_id in done:
                        stats.succeeded += 1
                        per_name[claimed.ctx.task_name, claimed.ctx.queue] += 1
                    elif claimed.ctx.task_id in confirmed:
                        stats.succeeded += 1
                        stats.confirmed_completions += 1
                        per_name[claimed.ctx.task_name, claimed.ctx.queue] += 1
                    elif claimed.ctx.task_id not in bad:
                        self.fenced(claimed)
                for (name, queue), count in per_name.items():
                    inst.succeeded.add(count, _metrics.task_attributes(name, queue))
                for claimed, why in refused:
                    await self._refused(claimed, why)
            if env.closing.is_set() and not buffer:
                return

    async def _write(
        self, batch: list[Claimed], refused: list[tuple[Claimed, BaseException]]
    ) -> set[int]:
        """Write ``batch``'s successes; return the ids written (their tokens matched).

        A batch refused for its data is split in halves, down to single outcomes, which
        are added to ``refused`` with the database's error; the rest are written. Each
        statement commits on its own, so a later failure leaves earlier halves written
        (the caller's retry confirms them).

        Raises:
            DB_ERRORS: any other database failure (lost connection, timeout, refusal).
        """
        env = self._env
        try:
            crash_point("queue.complete.before")
            rows = await env.db.fetch(
                env.sql.complete,
                text_array(c.ctx.task_id for c in batch),
                text_array(c.token for c in batch),
                env.worker_id,
                [c.result for c in batch],
                [c.ctx.progress_text for c in batch],
                timeout=env.timeout,
            )
            crash_point("queue.complete.committed")
            return {r[0] for r in rows}
        except DB_ERRORS as exc:
            if not is_data_error(exc):
                raise
            if len(batch) == 1:
                refused.append((batch[0], exc))
                return set()
            LOG.warning(
                "the database refused a batch of %d completions (%s); writing it in halves "
                "to find the outcomes it refuses",
                len(batch),
                describe_db_error(exc),
            )
        half = len(batch) // 2
        done = await self._write(batch[:half], refused)
        return done | await self._write(batch[half:], refused)

    async def _refused(self, claimed: Claimed, exc: BaseException) -> None:
        """Fail the task whose success the database refused to store, for good.

        Running it again would return the same; its last stored progress is kept.
        """
        ctx = claimed.ctx
        error = ResultEncodingError(
            f"the result of task {ctx.task_name!r} was refused by the database "
            f"({describe_db_error(exc)})"
        )
        LOG.error(
            "task %s (%s) attempt %s, run %s, failed, not retried: %s",
            ctx.task_id,
            ctx.task_name,
            ctx.attempt,
            ctx.run_id,
            error,
            extra={
                "task_id": ctx.task_id,
                "task_name": ctx.task_name,
                "attempt": ctx.attempt,
                "run_id": str(ctx.run_id),
            },
        )
        await self.failed(claimed, describe(error), None, keep_stored_progress=True)

    async def _confirm_completed(self, unsure: list[Claimed]) -> set[int]:
        """Return the ids among ``unsure`` whose earlier completion write did commit.

        A completion retried after an ambiguous failure (the connection cut after COMMIT was
        sent) finds its token already cleared -- by itself. It is told apart from a fenced
        one by the claim's identity: still succeeded, with this attempt number and this
        claim's start time (any later claim changes both), so it is not a rejection.
        """
        if not unsure:
            return set()
        env = self._env
        try:
            rows = await env.db.fetch(
                env.sql.completed_by,
                text_array(c.ctx.task_id for c in unsure),
                text_array(c.ctx.attempt for c in unsure),
                text_array(c.started_at for c in unsure),
                env.worker_id,
                timeout=env.timeout,
            )
        except DB_ERRORS as exc:
            # Still unknown: report them as rejected (the handler may not assume success).
            LOG.warning("could not confirm %d completions: %s", len(unsure), exc)
            return set()
        confirmed = {r[0] for r in rows}
        for task_id in sorted(confirmed):
            LOG.info("task %s: an earlier completion write had committed", task_id)
        return confirmed

    async def release_now(self, claimed: Claimed) -> bool:
        """Hand ``claimed`` back at once (pending, attempt refunded); return whether it was.

        Listening workers are woken to take it. A release that fails or finds the lease
        gone changes nothing: the lease lapses and the task is recovered.
        """
        env = self._env
        try:
            rows = await env.db.fetch(
                env.sql.release,
                claimed.ctx.task_id,
                claimed.token,
                env.worker_id,
                timeout=env.timeout,
            )
        except DB_ERRORS as exc:
            # The lease will expire and maintenance elsewhere recovers the task.
            LOG.warning("could not release task %s: %s", claimed.ctx.task_id, exc)
            return False
        if not rows:
            return False
        env.stats.released += 1
        env.inflight.outcome_written.set()  # a global limit's slot is free again
        return True

    async def release_unfinished(self) -> None:
        """Hand back the tasks whose handlers the drain cancelled (pending, attempt refunded)."""
        for claimed in self._to_release:
            await self.release_now(claimed)
        self._to_release.clear()
