"""Completions: writing each attempt's outcome, fenced by its lease token.

Successes are buffered and written by one flusher in batches (one statement for up to
``_FLUSH_BATCH``), or, while the claim loop waits for a held limit's slots, by its next
claim (``carry``); a batch whose reply was lost is retried, and a task found already
completed by that lost write is confirmed, not reported as fenced. A batch the database
refuses for the values it carries (a result it cannot store) is split in halves until the
refused outcomes are alone: the others are written, and each refused one fails its own task
with a :class:`ResultEncodingError`, so one bad value never holds back the rest. Failures
(retry or fail for good) are written one by one; work handed back (at shutdown, or a task
the worker could not start) is released. A write that fails (a killed connection, an
outage) is retried with backoff on another connection, sooner when a lease would lapse
first: a killed backend costs no re-run.
"""

from __future__ import annotations

import asyncio
import collections
import time
from datetime import timedelta
from typing import Final

from steeple.core.tasks import TaskEvent, TaskState, transition
from steeple.postgres._arrays import array_literal, text_array
from steeple.postgres.queue import _metrics
from steeple.postgres.queue._crashpoints import crash_point
from steeple.postgres.queue._db import DB_ERRORS
from steeple.postgres.queue._driver import describe_db_error, is_data_error
from steeple.postgres.queue._failures import Failure, describe
from steeple.postgres.queue._inflight import Claimed
from steeple.postgres.queue._outage import Retry
from steeple.postgres.queue._shared import LOG, WorkerEnv
from steeple.postgres.queue._wakeups import Wakeups
from steeple.postgres.queue.errors import ResultEncodingError

__all__ = ["Completions", "success_columns"]

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
        self.carrier = False
        """Set while the claim loop will carry the buffered successes with its next claim
        (it waits for a limit's slots, which they free): the flusher leaves them to it."""
        self.buffered = asyncio.Event()
        """Set when a success is buffered while :attr:`carrier` is set."""

    def succeeded(self, claimed: Claimed, result: str | None = None) -> None:
        """Buffer the success of ``claimed`` (and its result's JSON text) for the flusher."""
        claimed.result = result
        self._buffer.append(claimed)
        if self.carrier:
            self.buffered.set()
        else:
            self._flush_wake.set()

    def carry(self, on: bool) -> None:
        """Let the claim loop carry the buffered successes (``on``), or give them back.

        Not while one of them is unsure: the flusher confirms those.
        """
        self.carrier = on and not any(c.unsure for c in self._buffer)
        if self.carrier and self._buffer:
            self.buffered.set()  # what the flusher has not taken yet goes with the claim
            return
        self.buffered.clear()
        if not self.carrier and self._buffer:
            self._flush_wake.set()

    def take_carried(self) -> list[Claimed]:
        """Take a batch of buffered successes for the claim loop to write with its claim.

        None while one of them is unsure (its earlier write may have committed): the
        flusher, which confirms those, writes them.
        """
        buffer = self._buffer
        if any(c.unsure for c in buffer):
            return []
        batch = buffer[:_FLUSH_BATCH]
        del buffer[:_FLUSH_BATCH]
        return batch

    async def carried(self, batch: list[Claimed], done: set[int]) -> None:
        """Account for ``batch``, written with a claim: ``done`` the ids that succeeded."""
        self._env.status.succeeded("completions")
        await self._account(batch, done, [])

    def carry_failed(self, batch: list[Claimed], exc: BaseException) -> None:
        """Give ``batch`` back to the flusher: the claim that carried it failed with ``exc``."""
        if not is_data_error(exc):
            # The reply was lost: the write may have committed (the retry confirms it).
            for claimed in batch:
                claimed.unsure = True
        self._buffer[:0] = batch
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
        ctx = claimed.ctx
        progress = None if keep_stored_progress else ctx.progress_text
        inst = _metrics.instruments()
        attributes = _metrics.task_attributes(ctx.task_name, ctx.queue)
        retry = Retry(env.random)
        while True:
            try:
                rows = await self._write_failure(claimed, failure, retry_after, progress)
                break
            except DB_ERRORS as exc2:
                env.status.failed("completions", exc2)
                delay = retry.failed()
                # Retried (on another connection: the failed one was discarded) while the
                # lease, renewed meanwhile, has time left; a write the database refuses for
                # its values would fail again. Past that the lease lapses and the task is
                # recovered and run again.
                hopeless = is_data_error(exc2) or (
                    time.monotonic() + delay >= claimed.expires_at or env.closing.is_set()
                )
                if not env.status.database.failed("completions", exc2) or hopeless:
                    LOG.warning(
                        "could not record the failure of task %s (%s)%s",
                        ctx.task_id,
                        describe_db_error(exc2),
                        "; its lease will lapse" if hopeless else f"; retrying in {delay:.2f} s",
                    )
                if hopeless:
                    return
                claimed.unsure = True
                await asyncio.sleep(delay)
        if not rows and claimed.unsure and await self._failure_recorded(claimed, retry_after):
            rows = [(ctx.task_id,)]  # the earlier, ambiguous write had committed
        env.status.database.succeeded()
        outcome = _AFTER_RETRY if retry_after is not None else _AFTER_FAILURE
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

    async def _write_failure(
        self,
        claimed: Claimed,
        failure: Failure,
        retry_after: timedelta | None,
        progress: str | None,
    ) -> list[tuple[object, ...]]:
        """Write one failed attempt (retry later, or fail for good); return the rows."""
        env = self._env
        ctx = claimed.ctx
        if retry_after is not None:
            crash_point("queue.retry.before")
            rows = await env.db.fetch(
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
            return rows
        return await env.db.fetch(
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

    async def _failure_recorded(self, claimed: Claimed, retry_after: timedelta | None) -> bool:
        """Tell whether an earlier, ambiguous write of this attempt's failure committed.

        Its own history row says so: this attempt of this claim, by this worker, with that
        outcome (a lapsed lease records another one).
        """
        env = self._env
        ctx = claimed.ctx
        try:
            rows = await env.db.fetch(
                env.sql.failure_recorded,
                ctx.task_id,
                ctx.attempt,
                claimed.started_at,
                env.worker_id,
                retry_after is not None,
                timeout=env.timeout,
            )
        except DB_ERRORS as exc:
            LOG.warning(
                "could not confirm the failure of task %s (%s)", ctx.task_id, describe_db_error(exc)
            )
            return False
        if rows:
            LOG.info("task %s: an earlier failure write had committed", ctx.task_id)
        return bool(rows)

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
        buffer = self._buffer
        retry = Retry(env.random)
        while True:
            await self._flush_wake.wait()
            self._flush_wake.clear()
            while buffer and not self.carrier:
                batch = buffer[:_FLUSH_BATCH]
                del buffer[:_FLUSH_BATCH]
                refused: list[tuple[Claimed, BaseException]] = []
                try:
                    done = await self._write(batch, refused)
                except DB_ERRORS as exc:
                    env.status.failed("completions", exc)
                    # Part of a split batch may have committed: the retry confirms it.
                    for claimed in batch:
                        claimed.unsure = True
                    buffer[:0] = batch
                    delay = _before_lapse(retry.failed(), batch)
                    if not env.status.database.failed("completions", exc):
                        LOG.warning(
                            "could not record %d completions (%s); retrying in %.2f s",
                            len(batch),
                            describe_db_error(exc),
                            delay,
                        )
                    if env.closing.is_set():
                        # Shutting down: the leases expire and the tasks are rerun elsewhere.
                        buffer.clear()
                        return
                    # The failed connection was discarded: the retry runs on another one.
                    await asyncio.sleep(delay)
                    continue
                retry.succeeded()
                env.status.database.succeeded()
                env.status.succeeded("completions")
                env.inflight.outcome_written.set()
                await self._account(batch, done, refused)
            if env.closing.is_set() and not buffer:
                return

    async def _account(
        self, batch: list[Claimed], done: set[int], refused: list[tuple[Claimed, BaseException]]
    ) -> None:
        """Count ``batch``'s written successes (``done``), confirm or fence the others."""
        stats = self._env.stats
        bad = {c.ctx.task_id for c, _ in refused}
        missed = [c for c in batch if c.ctx.task_id not in done]
        confirmed = await self._confirm_completed(
            [c for c in missed if c.unsure and c.ctx.task_id not in bad]
        )
        # A fresh list when some were missed (the confirmed ones join it), else the batch.
        succeeded = [c for c in batch if c.ctx.task_id in done] if missed else batch
        for claimed in missed:
            if claimed.ctx.task_id in confirmed:
                stats.confirmed_completions += 1
                succeeded.append(claimed)
            elif claimed.ctx.task_id not in bad:
                self.fenced(claimed)
        stats.succeeded += len(succeeded)
        inst = _metrics.recording()
        if inst is not None:  # counted per task name and queue: a batch mixes them
            per_name = collections.Counter((c.ctx.task_name, c.ctx.queue) for c in succeeded)
            for (name, queue), count in per_name.items():
                inst.succeeded.add(count, _metrics.task_attributes(name, queue))
        for claimed, why in refused:
            await self._refused(claimed, why)

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
            ids, tokens, results, progress = success_columns(batch)
            rows = await env.db.fetch(
                env.sql.complete, ids, tokens, env.worker_id, results, progress,
                timeout=env.timeout,
            )  # fmt: skip
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


def success_columns(
    batch: list[Claimed],
) -> tuple[str, str, list[str | None] | None, list[str | None] | None]:
    """Return ``batch``'s successes as the statements take them.

    Ids and tokens (array literals), results and latest progress (JSON text, or ``None``).
    """
    return (
        array_literal([c.ctx.task_id for c in batch]),
        array_literal([c.token for c in batch]),
        _or_null([c.result for c in batch]),
        _or_null([c.ctx.progress_text for c in batch]),
    )


def _or_null(values: list[str | None]) -> list[str | None] | None:
    """``values``, or ``None`` (an SQL NULL array) when every one of them is ``None``."""
    return values if any(v is not None for v in values) else None


def _before_lapse(delay: float, batch: list[Claimed]) -> float:
    """``delay``, shortened so a retry comes while the soonest lease still has time left.

    A finished handler's lease is no longer renewed: its outcome must be written before
    the lease lapses, or the task is recovered and run again.
    """
    left = min(c.expires_at for c in batch) - time.monotonic()
    return min(delay, left / 2) if left > 0 else delay
