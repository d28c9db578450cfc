"""Wake-ups of the claim loop: LISTEN/NOTIFY on a dedicated connection, and timers.

A NOTIFY for work due now wakes the claim loop at once; one for later work (its payload is
the due time on the server's clock) arms a timer counted on this host's monotonic clock.
Retries arm timers too. When the listener dies the worker polls every ``poll_interval``
and LISTENs again, backing off while it keeps failing.

Once LISTEN is in place the listener sends itself one notification through the pool (a
payload only it recognises; other workers take it for a wake-up). If it does not come back
within ``ECHO_WAIT`` seconds, LISTEN is not working -- the listener's connection leads
through a transaction pooler, where the LISTENing server session serves other clients --
and the worker says so, naming the settings, polls, and tries again later.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import Final

from steeple.postgres.pooler import POOLER_HINT
from steeple.postgres.queue._aio import wait_event
from steeple.postgres.queue._db import DB_ERRORS
from steeple.postgres.queue._driver import describe_db_error
from steeple.postgres.queue._outage import Retry
from steeple.postgres.queue._shared import LOG, WorkerEnv

__all__ = ["Wakeups"]

_LISTEN_ERRORS: Final[tuple[type[BaseException], ...]] = (*DB_ERRORS, ConnectionError)
_MAX_TIMERS: Final = 1000

ECHO_WAIT: Final = 5.0
"""Seconds the listener waits for its own notification before it concludes LISTEN fails."""


class Wakeups:
    """The claim loop's wake-up event, the timers that set it, and the listener."""

    def __init__(self, env: WorkerEnv) -> None:
        self._env = env
        self.wake = asyncio.Event()
        """Set when due work may be waiting; the claim loop clears it before each claim."""
        self._timers: dict[int, asyncio.TimerHandle] = {}
        self._retry = Retry(env.random)
        self._echo = ""  # the payload of the listener's own notification, once sent
        self._heard = asyncio.Event()
        self._listening_now = asyncio.Event()

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
        if self._echo and payload == self._echo:
            self._heard.set()
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
        self._listening_now.set()
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
            # This LISTEN's end: the worker closing, or its own notification not heard.
            until = asyncio.Event()
            self._heard = asyncio.Event()
            self._listening_now = asyncio.Event()
            self._echo = "echo " + secrets.token_hex(8)
            helpers = [
                asyncio.ensure_future(_set_when(env.closing, until)),
                asyncio.ensure_future(self._confirm(until)),
            ]
            try:
                await db.listen(
                    env.sql.channel,
                    self.on_notify,
                    f"steeple-listener {env.worker_id}",
                    until,
                    on_listening=self._listening,
                )
                delay = self._retry.failed()  # ended without an error: not LISTENing either
                if not env.closing.is_set():
                    LOG.warning(
                        "%s: the wake-up listener's own NOTIFY did not reach it within %g s "
                        "of LISTEN: its connection may lead through a connection pooler in "
                        "transaction mode, where LISTEN does not work; %s, and give "
                        "listen_dsn (CLI: --listen-dsn) a direct connection to PostgreSQL. "
                        "Polling, LISTENing again in %.2f s",
                        env.worker_id,
                        ECHO_WAIT,
                        POOLER_HINT,
                        delay,
                    )
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
                for helper in helpers:
                    helper.cancel()
                # Down, or never up: either way the worker polls (health says degraded).
                status.listener_ok = False
                status.listener_settled = True
            if env.closing.is_set():
                return
            await wait_event(env.closing, delay)

    async def _confirm(self, until: asyncio.Event) -> None:
        """Once LISTEN is in place, NOTIFY the listener; end the LISTEN if it never hears it."""
        env = self._env
        await self._listening_now.wait()
        try:
            await env.db.fetch(
                "SELECT pg_notify($1, $2)", env.sql.channel, self._echo, timeout=env.timeout
            )
        except DB_ERRORS:
            return  # the database is failing: the loops report that, not the listener
        if not await wait_event(self._heard, ECHO_WAIT):
            until.set()


async def _set_when(first: asyncio.Event, then: asyncio.Event) -> None:
    await first.wait()
    then.set()
