"""What every room of the worker shares: its settings and database, status flags, counters.

The rooms (claiming, execution, completions, renewal, wake-ups, maintenance) each hold the
one :class:`WorkerEnv` of their :class:`~steeple.postgres.queue.Scheduler`; they set the
flags of its :class:`WorkerStatus`, from which ``Scheduler.health()`` is computed.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from typing import Final

import attrs

from steeple.core.ports import Clock, RandomSource
from steeple.core.remote_clock import RemoteClockEstimate
from steeple.postgres.queue._db import WorkerDb
from steeple.postgres.queue._driver import describe_db_error
from steeple.postgres.queue._inflight import InFlight
from steeple.postgres.queue._outage import DatabaseReporter
from steeple.postgres.queue._sql import QueueSql
from steeple.postgres.queue.errors import QueueError

__all__ = ["LOG", "Health", "WorkerEnv", "WorkerStats", "WorkerStatus"]

LOG: Final = logging.getLogger("steeple.postgres.queue")


class Health(enum.Enum):
    """What :meth:`Scheduler.health` reports."""

    STARTING = "starting"
    """Not yet claiming (schema check, first connection, first claim round, the wake-up
    listener not yet listening)."""
    HEALTHY = "healthy"
    """Claiming, with the database and the wake-up listener working."""
    DEGRADED = "degraded"
    """Running, but the database is unreachable, claims, completions, lease renewals or
    maintenance keep failing (or claims are being refused), the listener is down
    (polling), or the queue's tables collect dead rows that vacuum cannot remove (a held
    vacuum horizon); ``health_reasons()`` names the cause."""
    STOPPED = "stopped"
    """``run_until_shutdown`` returned (or never ran and was closed)."""


@attrs.define
class WorkerStats:
    """Counts since the worker started (also exported as OpenTelemetry metrics)."""

    claimed: int = 0
    succeeded: int = 0
    retried: int = 0
    failed: int = 0
    released: int = 0
    """Tasks handed back (pending again, attempt refunded): at shutdown, or not started."""
    recovered: int = 0
    rejected_completions: int = 0
    confirmed_completions: int = 0
    lease_lost: int = 0
    materialized: int = 0
    maintenance_rounds: int = 0
    """Maintenance passes (lease recovery and recurring materialization) that completed."""
    claim_rounds: int = 0
    """Claim queries answered (with or without tasks): each applied the queues' settings."""
    failed_claims: int = 0
    """Claim rounds that failed (database error or timeout)."""
    refused_claims: int = 0
    """Claim rounds the server refused as arriving after the worker had given up on them
    (its clock moved, or the network held the request): each re-anchors the worker's
    estimate of the server's clock from the answer."""
    idle_waits: int = 0
    """Times the claim loop waited for a wake-up or the poll interval because every queue
    it asked answered with less than it asked for (a queue that answered short while
    another may have more is not waited for: its slots go to the others at once)."""
    not_started: int = 0
    """Claimed tasks handed back unstarted: a plain ``def`` handler for which no thread of
    this worker freed up within a quarter of the task's lease, or the worker stopped first."""
    loop_stalls: int = 0
    """Times the event loop stalled past ``loop_lag_threshold`` while the worker ran (a
    handler, or other code on its loop, blocked it); each is logged naming the culprit."""


class _Phase(enum.Enum):
    NEW = "new"
    RUNNING = "running"
    STOPPED = "stopped"


class WorkerStatus:
    """The flags behind ``health()``; each room sets the ones it knows about."""

    def __init__(self, *, listen: bool) -> None:
        self.phase = _Phase.NEW
        self.failing: dict[str, str] = {}
        """What keeps failing (claims, completions, renewals, maintenance) and why: each
        entry stays until that same activity succeeds again (another one succeeding says
        nothing about it: claims can work while every completion times out on a lock)."""
        self.claims_ok = True
        """Whether the latest claim round succeeded."""
        self.claimed_once = False
        """A claim round has finished (succeeded, failed or refused)."""
        self.listener_ok = not listen
        """The wake-up listener is LISTENing (always true without one)."""
        self.listener_settled = not listen
        """LISTEN is in place, or its first attempt failed and the worker polls."""
        self.database = DatabaseReporter()
        """Counts and reports the attempts that could not reach the database."""
        self.horizon: str | None = None
        """The held vacuum horizon the maintenance loop last saw (``HeldHorizon.describe``),
        or None while the queue's tables hold fewer dead rows than the threshold."""

    def failed(self, activity: str, exc: BaseException) -> None:
        """Record that ``activity`` failed with ``exc`` (degraded until it succeeds)."""
        self.failing[activity] = f"{activity} failing: {describe_db_error(exc)}"

    def succeeded(self, activity: str) -> None:
        """Record that ``activity`` succeeded (its failure, if any, is over)."""
        self.failing.pop(activity, None)

    def reasons(self) -> tuple[str, ...]:
        """Say why the worker is not healthy (empty when it is, or is starting/stopped)."""
        if self.phase is not _Phase.RUNNING or not self.claimed_once:
            return ()
        outage = self.database.reason()
        reasons = [outage] if outage is not None else []
        reasons += self.failing.values()
        if not self.claims_ok and "claims" not in self.failing:
            reasons.append(
                "claims refused: the server answered after the worker's give-up time (its "
                "clock moved, or the network delays requests)"
            )
        if self.listener_settled and not self.listener_ok:
            reasons.append("wake-up listener down: polling until it reconnects")
        if self.horizon is not None:
            reasons.append(self.horizon)
        return tuple(reasons)

    def started(self) -> None:
        """Record that the worker is set up and its loops are starting."""
        self.phase = _Phase.RUNNING

    def stopped(self) -> None:
        """Record that ``run_until_shutdown`` is returning."""
        self.phase = _Phase.STOPPED

    def health(self) -> Health:
        """Return the health the flags amount to."""
        if self.phase is _Phase.STOPPED:
            return Health.STOPPED
        if self.phase is _Phase.NEW or not (self.claimed_once and self.listener_settled):
            return Health.STARTING
        if (
            self.claims_ok
            and not self.failing
            and self.listener_ok
            and self.database.reason() is None
            and self.horizon is None
        ):
            return Health.HEALTHY
        return Health.DEGRADED


@attrs.define(eq=False)
class WorkerEnv:
    """One worker's settings, database and shared state, as its rooms see them."""

    worker_id: str
    schema: str
    sql: QueueSql
    poll: float
    """Seconds between polls when no wake-up comes."""
    timeout: float
    """Seconds any one worker query may take."""
    clock: Clock
    random: RandomSource
    status: WorkerStatus
    stats: WorkerStats
    inflight: InFlight = attrs.field(factory=InFlight)
    closing: asyncio.Event = attrs.field(factory=asyncio.Event)
    """Set when the worker stops its background loops (after the drain)."""
    # The server's clock, re-anchored on every answer that carries it (the start-up check,
    # each claim): give-up times and wake-ups are computed on it from this host's monotonic
    # clock, so neither wall clock's steps can void them for long.
    server_clock: RemoteClockEstimate = attrs.field(factory=RemoteClockEstimate)
    db_or_none: WorkerDb | None = None
    secrets: tuple[str, ...] = ()
    """The worker's own connection secrets, masked in every failure it records or logs."""

    @property
    def db(self) -> WorkerDb:
        """The worker's pool.

        Raises:
            QueueError: the worker is not running.
        """
        if self.db_or_none is None:
            raise QueueError("the worker is not running")
        return self.db_or_none
