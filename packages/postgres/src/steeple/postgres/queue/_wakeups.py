"""Wake-ups of the claim loop: LISTEN/NOTIFY on a dedicated connection, and timers.

A NOTIFY for work due now wakes the claim loop at once; one for later work (its payload is
the due time on the server's clock) arms a timer counted on this host's monotonic clock.
Retries arm timers too. When the listener dies the worker polls every ``poll_interval``
and LISTENs again, backing off while it keeps failing.
"""

from __future__ import annotations

import asyncio
import time
from typing import Final

from steeple.postgres.queue._aio import wait_event
from steeple.postgres.queue._db import DB_ERRORS
from steeple.postgres.queue._driver import describe_db_error
from steeple.postgres.queue._outage import Retry
from steeple.postgres.queue._shared import LOG, WorkerEnv

__all__ = ["Wakeups"]

_LISTEN_ERRORS: Final[tuple[type[BaseException], ...]] = (*DB_ERRORS, ConnectionError)
_MAX_TIMERS: Final = 1000


class Wakeups:
    """The claim loop's wake-up event, the timers that set it, and the listener."""

    def __init__(self, env: WorkerEnv) -> None:
        self._env = env
        self.wake = asyncio.Event()
        """Set when due work may be waiting; the claim loop clears it before each claim."""
        self._timers: dict[int, asyncio.TimerHandle] = {}
        self._retry = Retry(env.random)

    def wake_at(self, delay: float) -> None:
        """Wake the claim loop after ``delay`` seconds (a delayed task or a retry comes due)."""
        if delay <= 0:
            self.wake.set()
            return
        loop = asyncio.get_running_loop()
        # One timer per 10 ms slot, a bounded number: beyond that, polling covers it.
        slot = round((loop.time() + delay) * 100)
        if slot in self._timers or len(self._timers) >= _MAX_TIMERS:
            return

        def fire() -> None:
            self._timers.pop(slot, None)
            self.wake.set()

        # A few ms late rather than early: the database's clock decides what is due.
        self._timers[slot] = loop.call_at(slot / 100 + 0.005, fire)

    def cancel_timers(self) -> None:
        """Cancel every armed timer (at shutdown)."""
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()

    def on_notify(self, payload: str) -> None:
        """Turn one NOTIFY payload ("" or a due time in epoch seconds) into a wake-up."""
        if not payload:
            self.wake.set()
            return
        try:
            due = float(payload)
            # The payload is the due time on the server's clock: count down to it on this
            # host's monotonic clock, never by comparing it with this host's wall clock.
            delay = self._env.server_clock.until(due, time.monotonic())
        except ValueError:
            self.wake.set()
            return
        self.wake_at(delay)

    def _listening(self) -> None:
        status = self._env.status
        status.listener_ok = True
        status.listener_settled = True
        self._retry.succeeded()
        status.database.succeeded()

    async def listen_forever(self) -> None:
        """LISTEN until the worker closes, LISTENing again (with backoff) after each loss."""
        env = self._env
        db = env.db
        status = env.status
        while not env.closing.is_set():
            try:
                await db.listen(
                    env.sql.channel,
                    self.on_notify,
                    f"steeple-listener {env.worker_id}",
                    env.closing,
                    on_listening=self._listening,
                )
                delay = self._retry.failed()  # ended without an error: not LISTENing either
            except _LISTEN_ERRORS as exc:
                # LISTENing resets the schedule: a listener lost after a while comes back
                # at once, one that cannot connect backs off.
                delay = self._retry.failed()
                if not status.database.failed("wake-up listener", exc):
                    LOG.warning(
                        "wake-up listener lost (%s); polling, LISTENing again in %.2f s",
                        describe_db_error(exc),
                        delay,
                    )
            finally:
                # Down, or never up: either way the worker polls (health says degraded).
                status.listener_ok = False
                status.listener_settled = True
            if env.closing.is_set():
                return
            await wait_event(env.closing, delay)
