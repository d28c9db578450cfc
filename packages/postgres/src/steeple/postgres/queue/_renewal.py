"""Lease renewal: extends the leases of running handlers, token-guarded, before they lapse.

A renewal that finds a lease gone (expired and re-claimed, or cancelled) sets the handler's
``ctx.lease_lost`` (and ``ctx.cancelled``); one that cannot reach the database gives up on
each lease once it has expired by this host's monotonic clock. Renewals never wait behind
handlers for a pooled connection: past a short bound they take the worker's reserved one
(``WorkerDb.fetch_reserved``).
"""

from __future__ import annotations

import contextlib
import time

from steeple.core.tasks import TaskState
from steeple.postgres._arrays import text_array
from steeple.postgres.queue._aio import wait_event
from steeple.postgres.queue._crashpoints import crash_point
from steeple.postgres.queue._db import DB_ERRORS
from steeple.postgres.queue._driver import describe_db_error
from steeple.postgres.queue._inflight import Claimed
from steeple.postgres.queue._outage import Retry
from steeple.postgres.queue._shared import LOG, WorkerEnv

__all__ = ["Renewer"]


class Renewer:
    """The renewal loop of one worker."""

    def __init__(self, env: WorkerEnv) -> None:
        self._env = env

    async def renew_forever(self) -> None:
        """Renew due leases until the worker closes."""
        env = self._env
        running = env.inflight.running
        retry = Retry(env.random)
        retry_at = 0.0  # after a failure: no renewal before this (monotonic)
        while not env.closing.is_set():
            leases = [c.lease for c in running.values()]
            tick = min(0.5, max(0.02, min(leases) / 6)) if leases else min(0.5, env.poll)
            if await wait_event(env.closing, tick):
                return
            now = time.monotonic()
            if all(c.lost for c in running.values()):
                # No lease left to renew (finished, or lost after failed renewals): no
                # renewal is failing any more, so health must not stay degraded for it.
                env.status.succeeded("renewals")
                continue
            due = [c for c in running.values() if not c.lost and now >= c.renew_at]
            if due and now >= retry_at:
                retry_at = await self._renew(due, now, retry)

    async def _renew(self, due: list[Claimed], now: float, retry: Retry) -> float:
        """Renew ``due`` in one statement; return when the next renewal may start."""
        env = self._env
        # A renewal slower than half a lease is as good as lost: give up and retry.
        deadline = max(0.1, min(env.timeout, min(c.lease for c in due) / 2))
        try:
            crash_point("queue.renew.before")
            rows = await env.db.fetch_reserved(
                env.sql.renew,
                text_array(c.ctx.task_id for c in due),
                text_array(c.token for c in due),
                timeout=deadline,
            )
            crash_point("queue.renew.committed")
            env.status.succeeded("renewals")
            env.status.database.succeeded()
            retry.succeeded()
        except DB_ERRORS as exc:
            return self._failed(due, retry, exc)
        renewed = {r[0] for r in rows}
        for claimed in due:
            if claimed.ctx.task_id in renewed:
                claimed.renew_at = now + claimed.lease / 3
                claimed.expires_at = now + claimed.lease
        lost = [c for c in due if c.ctx.task_id not in renewed]
        if lost:
            await self._lose_all(lost)
        return 0.0

    def _failed(self, due: list[Claimed], retry: Retry, exc: BaseException) -> float:
        """Give up on the leases that expired; return when to try again."""
        env = self._env
        env.status.failed("renewals", exc)
        failed_at = time.monotonic()
        for claimed in due:
            if failed_at >= claimed.expires_at:
                self._lose(claimed, cancelled=False)
        # Back off, but try again while the soonest lease still has time to spare.
        left = [c.expires_at - failed_at for c in due if not c.lost]
        delay = retry.failed()
        if left:
            delay = min(delay, max(0.0, min(left)) / 2)
        if not env.status.database.failed("lease renewal", exc):
            LOG.warning(
                "lease renewal failed (%s); retrying in %.2f s", describe_db_error(exc), delay
            )
        return failed_at + delay

    async def _lose_all(self, lost: list[Claimed]) -> None:
        """Mark leases the renewal did not find as lost (and cancelled, if they were)."""
        env = self._env
        cancelled: set[int] = set()
        with contextlib.suppress(*DB_ERRORS):
            states = await env.db.fetch(
                env.sql.lost_states,
                text_array(c.ctx.task_id for c in lost),
                timeout=env.timeout,
            )
            cancelled = {r[0] for r in states if r[1] == TaskState.CANCELLED.value}
        for claimed in lost:
            self._lose(claimed, cancelled=claimed.ctx.task_id in cancelled)

    def _lose(self, claimed: Claimed, *, cancelled: bool) -> None:
        claimed.lost = True
        self._env.stats.lease_lost += 1
        if cancelled:
            claimed.ctx.cancelled.set()
        claimed.ctx.lease_lost.set()
