"""Scheduler.health() tells the truth about claims (issue 10, item 4) and start-up (13.9).

It used to be healthy whenever any statement had succeeded lately: a worker whose every
claim failed still said healthy as long as its lease renewals went through, and refused
claims did not count at all. It also said healthy before LISTEN was in place and before
any claim had run; tests hid that with sleeps. Now it is starting until both are done.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import asyncpg
import pytest

import queue_support
import steeple.postgres.queue._worker as worker_module
from steeple.postgres.queue import (
    EnqueueOptions,
    Health,
    JobContext,
    Scheduler,
    Task,
    enqueue,
    run_state,
)
from steeple.postgres.queue._db import open_db

LONG: Task[Any] = Task("health.long")
SHORT: Task[Any] = Task("health.short")
# The worker's claim (with positions).
CLAIM = (
    "claim(text[], integer[], text[], text, double precision, integer[], timestamptz[], bigint[])"
)

wait_until = functools.partial(queue_support.wait_until, timeout=20.0)


@contextlib.asynccontextmanager
async def running(worker: Scheduler) -> AsyncIterator[Scheduler]:
    stop = asyncio.Event()
    run = asyncio.create_task(worker.run_until_shutdown(stop, drain_timeout=10))
    try:
        await wait_until(lambda: worker.health() is not Health.STARTING or run.done())
        if run.done():
            run.result()
        yield worker
    finally:
        stop.set()
        await asyncio.wait_for(run, 30)


async def _lease(conn: asyncpg.Connection, schema: str, task_id: int) -> Any:
    return (await run_state(conn, task_id, schema=schema)).lease_expires_at


async def test_failing_claims_degrade_health_even_while_renewals_succeed(
    queue: queue_support.QueueFixture,
) -> None:
    dsn, schema, conn = queue
    release = asyncio.Event()
    started = asyncio.Event()

    async def long(ctx: JobContext, args: Any) -> None:
        started.set()
        await release.wait()

    async def short(ctx: JobContext, args: Any) -> None:
        return None

    # Renewals every ~0.33 s, claims every 1 s: renewals keep succeeding in between.
    worker = Scheduler(
        dsn, worker_id="health", schema=schema, poll_interval=1.0, maintenance_interval=0.5,
        query_timeout=2,
    )  # fmt: skip
    worker.register(LONG, long)
    worker.register(SHORT, short)
    held = await enqueue(
        conn, LONG, {}, EnqueueOptions(lease_duration=timedelta(seconds=1)), schema=schema
    )
    async with running(worker):
        await asyncio.wait_for(started.wait(), 20)
        await wait_until(lambda: worker.health() is Health.HEALTHY)

        # Every claim now fails (the claim function is gone); nothing else does.
        await conn.execute(f'ALTER FUNCTION "{schema}".{CLAIM} RENAME TO claim_gone')
        await wait_until(lambda: worker.health() is Health.DEGRADED)
        for _ in range(5):
            # Right after each successful renewal of the running task's lease...
            before = await _lease(conn, schema, held.id)
            await wait_until(functools.partial(_lease_moved, conn, schema, held.id, before))
            # ...claims still fail, so the worker is still degraded.
            assert worker.health() is Health.DEGRADED
        assert worker.stats.failed_claims >= 1

        await conn.execute(f'ALTER FUNCTION "{schema}".claim_gone RENAME TO claim')
        fresh = await enqueue(conn, SHORT, {}, schema=schema)
        await wait_until(
            lambda: _state(conn, schema, fresh.id, "succeeded"),
        )
        await wait_until(lambda: worker.health() is Health.HEALTHY)
        release.set()
        await wait_until(lambda: _state(conn, schema, held.id, "succeeded"))
        assert worker.health() is Health.HEALTHY


async def _lease_moved(conn: asyncpg.Connection, schema: str, task_id: int, before: Any) -> bool:
    return bool(await _lease(conn, schema, task_id) != before)


async def _state(conn: asyncpg.Connection, schema: str, task_id: int, state: str) -> bool:
    return (await run_state(conn, task_id, schema=schema)).state.value == state


class _Gated:
    """Wraps the worker's pool: LISTEN and the claims wait for their gates to open."""

    def __init__(self, inner: Any, claim_sql: str, *, fail_listen: bool = False) -> None:
        self.inner = inner
        self.claim_sql = claim_sql
        self.fail_listen = fail_listen
        self.listen_gate = asyncio.Event()
        self.claim_gate = asyncio.Event()
        self.claim_waiting = asyncio.Event()
        self.listening = asyncio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def fetch(self, sql: str, *args: Any, timeout: float) -> list[tuple[Any, ...]]:
        if sql == self.claim_sql and not self.claim_gate.is_set():
            self.claim_waiting.set()
            await self.claim_gate.wait()
        return list(await self.inner.fetch(sql, *args, timeout=timeout))

    async def listen(self, channel: str, on_notify: Any, name: str, stop: Any, **kw: Any) -> None:
        if self.fail_listen:
            raise ConnectionError("LISTEN refused (test)")
        await self.listen_gate.wait()

        def noted(payload: str) -> None:
            # The first call ("") comes right after LISTEN is in place.
            self.listening.set()
            on_notify(payload)

        await self.inner.listen(channel, noted, name, stop, **kw)


def _open_all(gates: list[_Gated]) -> None:
    # A test that failed with a gate closed must still stop its worker.
    for gate in gates:
        gate.listen_gate.set()
        gate.claim_gate.set()


def _gate(monkeypatch: pytest.MonkeyPatch, worker: Scheduler, **kw: Any) -> list[_Gated]:
    made: list[_Gated] = []

    def gated_open_db(pool: Any) -> Any:
        made.append(_Gated(open_db(pool), worker._sql.claim_timed, **kw))
        return made[-1]

    monkeypatch.setattr(worker_module, "open_db", gated_open_db)
    return made


async def test_starting_until_listen_is_in_place(
    queue: queue_support.QueueFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    dsn, schema, conn = queue
    ran: list[str] = []

    async def short(ctx: JobContext, args: Any) -> None:
        ran.append(args)

    # A 30 s poll: only a NOTIFY can wake the worker within the waits below.
    worker = Scheduler(dsn, worker_id="gated", schema=schema, poll_interval=30)
    worker.register(SHORT, short)
    gates = _gate(monkeypatch, worker)
    await enqueue(conn, SHORT, "early", schema=schema)
    stop = asyncio.Event()
    run = asyncio.create_task(worker.run_until_shutdown(stop, drain_timeout=10))
    try:
        await wait_until(lambda: gates)
        gates[0].claim_gate.set()
        # The first claim round ran (it took the early task), but nobody LISTENs yet.
        await wait_until(lambda: ran == ["early"])
        assert worker.health() is Health.STARTING
        gates[0].listen_gate.set()
        await wait_until(lambda: worker.health() is Health.HEALTHY)
        assert gates[0].listening.is_set()
        # Healthy means a NOTIFY now wakes the worker (its next poll is 30 s away).
        await enqueue(conn, SHORT, "notified", schema=schema)
        await wait_until(lambda: "notified" in ran, timeout=10)
    finally:
        _open_all(gates)
        stop.set()
        await asyncio.wait_for(run, 30)
    assert worker.health() is Health.STOPPED


async def test_starting_until_the_first_claim_round_finishes(
    queue: queue_support.QueueFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    dsn, schema, _conn = queue
    worker = Scheduler(dsn, worker_id="gated", schema=schema, poll_interval=0.1)
    worker.register(SHORT, lambda ctx, args: asyncio.sleep(0))
    gates = _gate(monkeypatch, worker)
    stop = asyncio.Event()
    run = asyncio.create_task(worker.run_until_shutdown(stop, drain_timeout=10))
    try:
        await wait_until(lambda: gates)
        gates[0].listen_gate.set()
        await asyncio.wait_for(gates[0].listening.wait(), 20)
        await asyncio.wait_for(gates[0].claim_waiting.wait(), 20)
        # Listening, but the first claim has not answered: not healthy yet.
        assert worker.health() is Health.STARTING
        assert worker.stats.claimed == 0
        gates[0].claim_gate.set()
        await wait_until(lambda: worker.health() is Health.HEALTHY)
    finally:
        _open_all(gates)
        stop.set()
        await asyncio.wait_for(run, 30)


async def test_a_listener_that_cannot_listen_means_degraded_polling(
    queue: queue_support.QueueFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    dsn, schema, conn = queue
    ran: list[str] = []

    async def short(ctx: JobContext, args: Any) -> None:
        ran.append(args)

    worker = Scheduler(dsn, worker_id="deaf", schema=schema, poll_interval=0.1)
    worker.register(SHORT, short)
    gates = _gate(monkeypatch, worker, fail_listen=True)
    stop = asyncio.Event()
    run = asyncio.create_task(worker.run_until_shutdown(stop, drain_timeout=10))
    try:
        await wait_until(lambda: gates)
        gates[0].claim_gate.set()
        # Polling is decided once LISTEN failed: degraded, not starting forever.
        await wait_until(lambda: worker.health() is not Health.STARTING)
        assert worker.health() is Health.DEGRADED
        await enqueue(conn, SHORT, "polled", schema=schema)
        await wait_until(lambda: ran == ["polled"])
        assert worker.health() is Health.DEGRADED
    finally:
        _open_all(gates)
        stop.set()
        await asyncio.wait_for(run, 30)


async def test_completions_that_keep_failing_degrade_health_while_claims_succeed(
    queue: queue_support.QueueFixture,
) -> None:
    """A lock held on the finished task's row: its completion (and renewal) time out.

    Claims touch other rows and keep succeeding; they used to mark the database healthy
    again after each failed completion, so health said healthy while nothing landed.
    """
    dsn, schema, conn = queue
    release = asyncio.Event()
    started = asyncio.Event()

    async def long(ctx: JobContext, args: Any) -> None:
        started.set()
        await release.wait()

    worker = Scheduler(
        dsn, worker_id="unwritten", schema=schema, poll_interval=0.2, query_timeout=1
    )
    worker.register(LONG, long)
    # A long lease: the lock must fail writes, not lapse the lease.
    held = await enqueue(
        conn, LONG, {}, EnqueueOptions(lease_duration=timedelta(seconds=60)), schema=schema
    )
    locker = await asyncpg.connect(dsn)
    try:
        async with running(worker):
            await asyncio.wait_for(started.wait(), 20)
            await wait_until(lambda: worker.health() is Health.HEALTHY)
            assert worker.health_reasons() == ()
            lock = locker.transaction()
            await lock.start()
            await locker.execute(
                f'SELECT 1 FROM "{schema}".tasks WHERE id = $1 FOR UPDATE', held.id
            )
            release.set()  # the handler returns; its completion waits on the lock
            await wait_until(lambda: any("completions" in r for r in worker.health_reasons()))
            assert worker.health() is Health.DEGRADED
            for _ in range(3):
                # Right after each successful claim round, still degraded.
                rounds = worker.stats.claim_rounds
                await wait_until(lambda: worker.stats.claim_rounds > rounds)  # noqa: B023
                assert worker.health() is Health.DEGRADED
                reasons = worker.health_reasons()
                assert any(
                    r.startswith("completions failing: the database did not answer in time")
                    for r in reasons
                ), reasons
            assert await _state(conn, schema, held.id, "running")
            await lock.rollback()
            await wait_until(lambda: _state(conn, schema, held.id, "succeeded"))
            await wait_until(lambda: worker.health() is Health.HEALTHY)
            assert worker.health_reasons() == ()
    finally:
        await locker.close()


async def test_renewals_that_keep_failing_degrade_health_until_one_succeeds(
    queue: queue_support.QueueFixture,
) -> None:
    """A lock held on a running task's row: its lease renewals time out, health names them.

    Renewals every second (a 3 s lease); claims touch other rows and keep succeeding.
    """
    dsn, schema, conn = queue
    release = asyncio.Event()
    started = asyncio.Event()

    async def long(ctx: JobContext, args: Any) -> None:
        started.set()
        await release.wait()

    worker = Scheduler(
        dsn, worker_id="unrenewed", schema=schema, poll_interval=0.2, query_timeout=1
    )
    worker.register(LONG, long)
    held = await enqueue(
        conn, LONG, {}, EnqueueOptions(lease_duration=timedelta(seconds=3)), schema=schema
    )
    locker = await asyncpg.connect(dsn)
    try:
        async with running(worker):
            await asyncio.wait_for(started.wait(), 20)
            await wait_until(lambda: worker.health() is Health.HEALTHY)
            lock = locker.transaction()
            await lock.start()
            await locker.execute(
                f'SELECT 1 FROM "{schema}".tasks WHERE id = $1 FOR UPDATE', held.id
            )
            await wait_until(lambda: any("renewals" in r for r in worker.health_reasons()))
            rounds = worker.stats.claim_rounds
            await wait_until(lambda: worker.stats.claim_rounds > rounds)
            assert worker.health() is Health.DEGRADED
            assert any(
                r.startswith("renewals failing: the database did not answer in time")
                for r in worker.health_reasons()
            ), worker.health_reasons()
            # Released: the next renewal succeeds (or, had the lease lapsed meanwhile,
            # nothing is left to renew); either way no renewal is failing any more.
            await lock.rollback()
            await wait_until(lambda: worker.health() is Health.HEALTHY)
            assert worker.health_reasons() == ()
            release.set()
    finally:
        release.set()
        await locker.close()
