"""The tasks this worker holds: one :class:`Claimed` per running attempt, in :class:`InFlight`.

Claiming adds them, handler execution removes them when the handler ends, renewal extends
their leases, completions write their outcomes, the drain waits for them.
"""

from __future__ import annotations

import asyncio
import collections
import uuid
from datetime import datetime
from typing import TYPE_CHECKING

import attrs

from steeple.core.backoff import Backoff

if TYPE_CHECKING:
    from steeple.postgres.queue._execution import JobContext

__all__ = ["Claimed", "InFlight"]


@attrs.define(eq=False)
class Claimed:
    """One claimed attempt: its context, lease token and lease timing."""

    ctx: JobContext
    token: uuid.UUID = attrs.field(repr=False)
    args_text: str = attrs.field(repr=False)
    lease: float
    backoff: Backoff
    # Local monotonic times, counted from when the claim was SENT (the server started the
    # lease later than that, never earlier): no wall clock is involved.
    renew_at: float
    expires_at: float
    # When this claim started (server time): with the attempt number it identifies the
    # claim after completion cleared the token (see Completions.confirm_completed).
    started_at: datetime
    lost: bool = False
    # A completion write for it failed with an unknown outcome (it may have committed).
    unsure: bool = False
    # The handler's result as JSON text, once it succeeded (None: it returned None).
    result: str | None = attrs.field(default=None, repr=False)
    # The sequence number of the latest progress written for it (see _progress.py).
    progress_written: int = 0


class InFlight:
    """The attempts running in this worker, by task id, and their asyncio tasks."""

    def __init__(self) -> None:
        self.running: dict[int, Claimed] = {}
        self.tasks: dict[int, asyncio.Task[None]] = {}
        self.idle = asyncio.Event()
        """Set while nothing runs."""
        self.slot_freed = asyncio.Event()
        """Set when a handler ends (the claim loop clears it before waiting)."""
        self.per_queue: collections.Counter[str] = collections.Counter()
        """How many attempts run per named queue."""

    def __len__(self) -> int:
        return len(self.running)

    def add(self, claimed: Claimed) -> None:
        """Count ``claimed`` as running."""
        self.running[claimed.ctx.task_id] = claimed
        self.per_queue[claimed.ctx.queue] += 1
        self.idle.clear()

    def remove(self, task_id: int) -> None:
        """Forget the attempt of ``task_id`` (its handler ended)."""
        claimed = self.running.pop(task_id, None)
        if claimed is not None:
            self.per_queue[claimed.ctx.queue] -= 1
        self.tasks.pop(task_id, None)
        self.slot_freed.set()
        if not self.running:
            self.idle.set()
