"""Progress: writes what handlers report with ``ctx.report_progress``, batched and fenced.

``report_progress`` only records the latest value on the context (from the event loop or
a handler's thread) and wakes this room, which writes every changed value of the running
attempts in one statement, guarded by each lease token, at most every
``_MIN_INTERVAL`` seconds. A handler reporting in a tight loop costs one write per
interval; the latest value is also written with the attempt's outcome.
"""

from __future__ import annotations

import asyncio
from typing import Final

from steeple.postgres._arrays import text_array
from steeple.postgres.queue._aio import wait_event
from steeple.postgres.queue._db import DB_ERRORS
from steeple.postgres.queue._inflight import Claimed
from steeple.postgres.queue._shared import LOG, WorkerEnv

__all__ = ["ProgressWriter"]

_MIN_INTERVAL: Final = 0.1


class ProgressWriter:
    """The progress loop of one worker."""

    def __init__(self, env: WorkerEnv) -> None:
        self._env = env
        self._wake = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        # Bound once: attaching it to each claimed context allocates nothing.
        self._notifier = self._notify

    def attach(self, claimed: Claimed) -> None:
        """Let ``claimed``'s context wake this room when its handler reports progress."""
        claimed.ctx._on_progress = self._notifier

    def stop(self) -> None:
        """Let the loop return (``env.closing`` is set)."""
        self._wake.set()

    def _notify(self) -> None:
        # Called from the event loop or from a sync handler's thread.
        try:
            self._loop.call_soon_threadsafe(self._wake.set)
        except RuntimeError:  # the loop is closed: the worker is gone, nothing to write
            return

    async def write_forever(self) -> None:
        """Write reported progress until the worker closes."""
        env = self._env
        while not env.closing.is_set():
            await wait_event(self._wake, 3600.0)
            if env.closing.is_set():
                return
            self._wake.clear()
            await self._write()
            # At most one write per interval, however often handlers report.
            if await wait_event(env.closing, _MIN_INTERVAL):
                return

    async def _write(self) -> None:
        env = self._env
        changed: list[tuple[Claimed, int, str]] = []
        for claimed in list(env.inflight.running.values()):
            latest = claimed.ctx._progress
            if latest is not None and latest[0] > claimed.progress_written and not claimed.lost:
                changed.append((claimed, latest[0], latest[1]))
        if not changed:
            return
        try:
            await env.db.fetch(
                env.sql.progress,
                text_array(c.ctx.task_id for c, _, _ in changed),
                text_array(c.token for c, _, _ in changed),
                [text for _, _, text in changed],
                timeout=env.timeout,
            )
        except DB_ERRORS as exc:
            # Not lost: the next report, or the attempt's outcome, writes the latest value.
            LOG.warning("could not record the progress of %d tasks: %s", len(changed), exc)
            return
        for claimed, seq, _ in changed:
            claimed.progress_written = max(claimed.progress_written, seq)
