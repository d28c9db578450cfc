"""Maintenance: recovers expired leases of dead or stalled workers, materializes recurring jobs.

It also settles waiting tasks whose parents all ended without settling them (ended by a
worker of an earlier release during a rolling upgrade), by ``_sql.settle_stranded``.

Both run every ``maintenance_interval`` and wake the claim loop when they made work due.
Every ``HORIZON_CHECK_INTERVAL`` seconds it also asks whether the queue's tables collect
dead rows that vacuum cannot remove, and who holds the horizon
(:func:`steeple.postgres.horizon.held_horizon`); ``health_reasons()`` says so until they
no longer do.
Recovery's target state per task is core's: ``transition(RUNNING, lease_expiry_event(...))``
(see ``_sql.recover_expired``).
"""

from __future__ import annotations

import time
from typing import Final

from steeple.postgres import horizon
from steeple.postgres.queue import _metrics
from steeple.postgres.queue._aio import wait_event
from steeple.postgres.queue._crashpoints import crash_point
from steeple.postgres.queue._db import DB_ERRORS
from steeple.postgres.queue._driver import describe_db_error
from steeple.postgres.queue._outage import Retry
from steeple.postgres.queue._shared import LOG, WorkerEnv
from steeple.postgres.queue._wakeups import Wakeups

__all__ = ["HORIZON_CHECK_INTERVAL", "STRANDED_BATCH", "Maintainer"]

HORIZON_CHECK_INTERVAL: Final = 30.0
"""Seconds between two looks at the queue's dead rows (statistics views only)."""
STRANDED_BATCH: Final = 1000
"""The most waiting tasks one maintenance pass looks at for parents that all ended."""


class Maintainer:
    """The maintenance loop of one worker."""

    def __init__(self, env: WorkerEnv, wakeups: Wakeups, interval: float) -> None:
        self._env = env
        self._wakeups = wakeups
        self._interval = interval
        # Where the next look at waiting tasks starts (see _settle_stranded).
        self._waiting_after = 0

    async def _settle_stranded(self) -> int:
        """Settle waiting tasks whose parents all ended; return how many it settled.

        A worker of an earlier release (during a rolling upgrade) ends tasks without
        settling their dependents. Each pass looks at up to ``STRANDED_BATCH`` waiting
        tasks after the last one it looked at, from the start again once it reached the end.
        """
        env = self._env
        rows = await env.db.fetch(
            env.sql.settle_stranded, STRANDED_BATCH, self._waiting_after, timeout=env.timeout
        )
        last, looked, settled = rows[0] if rows else (None, 0, 0)
        self._waiting_after = 0 if last is None or looked < STRANDED_BATCH else last
        return int(settled)

    async def maintain_forever(self) -> None:
        """Recover and materialize every interval until the worker closes."""
        from steeple.postgres.queue.jobs import materialize_due

        env = self._env
        pool = env.db
        inst = _metrics.instruments()
        retry = Retry(env.random)
        horizon_due = 0.0
        while True:
            wait = self._interval
            try:
                crash_point("queue.recover.before")
                rows = await pool.fetch(env.sql.recover_expired, 100, timeout=env.timeout)
                crash_point("queue.recover.committed")
                if rows:
                    env.stats.recovered += len(rows)
                    inst.recovered.add(len(rows))
                    self._wakeups.wake.set()
                if await self._settle_stranded():
                    self._wakeups.wake.set()
                # Due-ness is judged by the server's clock (the one claims use), never by
                # this host's: a host whose clock differs must not skip or delay occurrences.
                made = await pool.with_connection(
                    lambda conn: materialize_due(conn, schema=env.schema, limit=100),
                    timeout=env.timeout,
                )
                if made:
                    env.stats.materialized += made
                    self._wakeups.wake.set()
                if time.monotonic() >= horizon_due:
                    held = await pool.with_connection(
                        lambda conn: horizon.held_horizon(
                            conn, [env.schema], dead_rows=horizon.DEAD_ROWS_THRESHOLD
                        ),
                        timeout=env.timeout,
                    )
                    env.status.horizon = None if held is None else held.describe()
                    horizon_due = time.monotonic() + HORIZON_CHECK_INTERVAL
                env.stats.maintenance_rounds += 1
                env.status.succeeded("maintenance")
                env.status.database.succeeded()
                retry.succeeded()
            except DB_ERRORS as exc:
                env.status.failed("maintenance", exc)
                # Never more often than the interval; less often while failures go on.
                wait = max(self._interval, retry.failed())
                if not env.status.database.failed("maintenance", exc):
                    LOG.warning(
                        "maintenance failed (%s); retrying in %.2f s", describe_db_error(exc), wait
                    )
            if await wait_event(env.closing, wait):
                return
