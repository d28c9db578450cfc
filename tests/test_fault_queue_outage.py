"""The work queue's worker through a database outage and a storm of killed backends.

- Outage: the worker connects through a :class:`FaultProxy` that acts as a stopped server
  (every connection attempt is reset at once and counted). The worker's loops back off
  (the proxy counts the attempts), the log says it once, then once per reporting interval,
  then once when the database is back (the test counts the records), and ``health()`` is
  degraded meanwhile, naming the outage.
- Storm: a separate session calls ``pg_terminate_backend`` twice a second on every backend
  of one worker (found by the application name the worker gives its sessions) while it
  claims, renews leases and records outcomes. No connection is used after it broke (no
  ``InternalClientError``), every task succeeds exactly once or is run again only after a
  lease lapsed (the attempt history says so), no finished handler's outcome is lost to a
  lapse, and the worker gets through the work queued after the storm.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import random
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import asyncpg
import pytest

import faultprobe
import queue_support
import steeple.postgres.queue._outage as outage_module
from faultproxy import FaultProxy
from steeple.postgres.queue import (
    EnqueueOptions,
    Health,
    JobContext,
    JobError,
    Scheduler,
    Task,
    enqueue,
    enqueue_many,
)

pytestmark = [pytest.mark.postgres]

WORK: Task[Any] = Task("outage.work")
QUEUE_LOG = "steeple.postgres.queue"

wait_until = functools.partial(queue_support.wait_until, timeout=30.0)


@pytest.fixture
async def queue(pg_schema: tuple[str, str]) -> AsyncIterator[tuple[str, str, asyncpg.Connection]]:
    dsn, schema = pg_schema
    async with queue_support.installed_queue(dsn, schema, connect_timeout=10) as conn:
        yield dsn, schema, conn


@contextlib.asynccontextmanager
async def running(worker: Scheduler) -> AsyncIterator[asyncio.Task[None]]:
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run_until_shutdown(stop, drain_timeout=10))
    try:
        await wait_until(lambda: worker.health() is not Health.STARTING or task.done())
        if task.done():
            task.result()
        yield task
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


def _messages(records: list[logging.LogRecord], since: int = 0) -> list[str]:
    return [r.getMessage() for r in records[since:] if r.name == QUEUE_LOG]


async def test_an_unreachable_database_is_retried_with_backoff_and_reported_once(
    queue: tuple[str, str, asyncpg.Connection],
    fault_proxy: FaultProxy,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _dsn, schema, conn = queue
    ran: list[Any] = []

    async def handler(ctx: JobContext, args: Any) -> None:
        ran.append(args)

    # One summary a second, so a few seconds of outage show several.
    monkeypatch.setattr(outage_module, "REPORT_EVERY", 1.0)
    caplog.set_level(logging.INFO)
    # The settings of the report: a 50 ms poll and maintenance interval used to mean a
    # retry every 50 ms by each loop.
    worker = Scheduler(
        fault_proxy.dsn(),
        worker_id="outage",
        schema=schema,
        poll_interval=0.05,
        maintenance_interval=0.05,
        query_timeout=2,
    )
    worker.register(WORK, handler)
    async with running(worker) as task:
        await wait_until(lambda: worker.health() is Health.HEALTHY)
        await enqueue(conn, WORK, "before", schema=schema)
        await wait_until(lambda: worker.stats.succeeded == 1)

        logged = len(caplog.records)
        fault_proxy.refuse()
        await wait_until(lambda: worker.health() is Health.DEGRADED, timeout=10)
        await wait_until(lambda: any("unreachable" in r for r in worker.health_reasons()))
        # The outage lasts a while (its length is what the loops back off over; nothing
        # is asserted about time itself).
        await asyncio.sleep(4.0)
        attempts = fault_proxy.refused
        during = _messages(caplog.records, logged)
        assert worker.health() is Health.DEGRADED
        (reason,) = [r for r in worker.health_reasons() if "unreachable" in r]
        assert "failed attempts" in reason, reason

        fault_proxy.pass_through()
        await enqueue(conn, WORK, "after", schema=schema)
        await wait_until(lambda: "after" in ran)
        await wait_until(lambda: worker.health() is Health.HEALTHY)
        assert not task.done()
    after = _messages(caplog.records, logged)

    began = [m for m in during if m.startswith("database connection failed (")]
    summaries = [m for m in during if m.startswith("database unreachable for ")]
    back = [m for m in after if m.startswith("database reachable again after ")]
    print(
        f"outage of ~4 s: {attempts} connection attempts, {len(during)} log lines "
        f"({len(summaries)} summaries): {during}"
    )
    # One line when it began, one per second of the outage, one when it ended; nothing
    # else (no line per failed claim, listener attempt or maintenance round).
    assert len(began) == 1, during
    assert 1 <= len(summaries) <= 6, during
    assert len(back) == 1, after
    assert len(during) == len(began) + len(summaries), during
    # Each loop (claims, listener, maintenance) retries at most ~8 times in 4 s with
    # backoff; retrying every 50 ms, they made hundreds of attempts.
    assert 3 <= attempts <= 40, attempts
    # No driver traceback and nothing logged at ERROR: an outage is not a crash.
    assert not [r for r in caplog.records[logged:] if r.levelno >= logging.ERROR], [
        (r.name, r.getMessage()) for r in caplog.records[logged:] if r.levelno >= logging.ERROR
    ]
    assert not [r for r in caplog.records[logged:] if r.exc_info], "a traceback was logged"
    assert ran == ["before", "after"]


_QUICK, _SLOW, _RETRY = "quick", "slow", "retry"


def _kind(n: int) -> str:
    if n % 20 == 0:
        return _SLOW  # outlives a third of its lease: renewed during the storm
    if n % 20 == 7:
        return _RETRY  # fails once: its failure outcome is written during the storm
    return _QUICK


@pytest.mark.slow
async def test_a_terminate_storm_reuses_no_broken_connection_and_loses_no_outcome(
    queue: tuple[str, str, asyncpg.Connection], caplog: pytest.LogCaptureFixture
) -> None:
    dsn, schema, conn = queue
    caplog.set_level(logging.WARNING)
    worker_id = f"storm-{uuid.uuid4().hex[:12]}"
    names = [f"steeple-queue {worker_id}", f"steeple-listener {worker_id}"]
    rng = random.Random(7)
    started: list[tuple[int, int]] = []
    finished: list[tuple[int, int]] = []
    kinds: dict[int, str] = {}

    async def handler(ctx: JobContext, args: Any) -> None:
        started.append((ctx.task_id, ctx.attempt))
        kind = kinds[ctx.task_id] = args["kind"]
        await asyncio.sleep(1.2 if kind == _SLOW else rng.random() * 0.02)
        finished.append((ctx.task_id, ctx.attempt))
        if kind == _RETRY and ctx.attempt == 1:
            raise JobError.retry("once more", delay=timedelta(milliseconds=10))

    worker = Scheduler(
        dsn,
        worker_id=worker_id,
        schema=schema,
        poll_interval=0.1,
        maintenance_interval=0.2,
        concurrency=8,
        query_timeout=5,
    )
    worker.register(WORK, handler)
    options = EnqueueOptions(lease_duration=timedelta(seconds=3))
    ids: list[int] = []
    counter = 0

    async def produce(count: int) -> None:
        nonlocal counter
        batch = [{"n": counter + i, "kind": _kind(counter + i)} for i in range(count)]
        counter += count
        ids.extend(await enqueue_many(conn, WORK, batch, options, schema=schema))

    killer = await asyncpg.connect(dsn, timeout=10)
    kills = 0
    storm_seconds = 6.0
    try:
        async with running(worker) as task:
            await wait_until(lambda: worker.health() is Health.HEALTHY)
            await produce(50)
            await wait_until(lambda: len(finished) >= 10)
            storm_end = time.monotonic() + storm_seconds
            while time.monotonic() < storm_end:
                # Twice a second: every backend of this worker (pool and listener) ends,
                # while new work keeps arriving.
                kills += await killer.fetchval(
                    "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid))"
                    " FROM pg_stat_activity WHERE application_name = ANY($1::text[])"
                    " AND pid <> pg_backend_pid()",
                    names,
                )
                await produce(25)
                await asyncio.sleep(0.5)
            ended = time.monotonic()
            at_end = worker.stats.succeeded
            await produce(200)
            await queue_support.finished_once(dsn, schema, ids, timeout=90)
            recovered_in = time.monotonic() - ended
            assert not task.done()
            await wait_until(lambda: worker.health() is Health.HEALTHY)
    finally:
        await killer.close()

    history = await conn.fetch(
        f'SELECT task_id, attempt, outcome FROM "{schema}".attempts ORDER BY id'
    )
    outcomes: dict[tuple[int, int], str] = {}
    per_task: dict[int, list[str]] = {}
    for row in history:
        outcomes[row["task_id"], row["attempt"]] = row["outcome"]
        per_task.setdefault(row["task_id"], []).append(row["outcome"])
    lapsed = sum(o.count("lease_expired") for o in per_task.values())
    print(
        f"storm: {kills} backends ended in {storm_seconds:g} s; {len(ids)} tasks; "
        f"{at_end} done by the storm's end; the rest ({len(ids) - at_end}) done "
        f"{recovered_in:.2f} s after it; {lapsed} claims whose answer was lost re-ran "
        f"after their lease; stats={worker.stats}"
    )
    assert kills >= 10

    # The checker: each task succeeded exactly once, last; any earlier attempt either
    # failed on purpose (retried) or lapsed (a claim whose answer the kill took).
    assert set(per_task) == set(ids)
    for task_id, seq in per_task.items():
        assert seq[-1] == "succeeded", (task_id, seq)
        assert seq.count("succeeded") == 1, (task_id, seq)
        assert set(seq[:-1]) <= {"retried", "lease_expired"}, (task_id, seq)
    # A handler that finished had its outcome recorded: none ran again for a lost write.
    for task_id, attempt in finished:
        assert outcomes.get((task_id, attempt)) in {"succeeded", "retried"}, (
            task_id,
            attempt,
            per_task[task_id],
        )
    # A lapsed attempt never started its handler: its claim's answer was lost to a kill
    # (renewals, retried on fresh connections, kept every running lease).
    lapsed_started = [
        (task_id, attempt)
        for (task_id, attempt), outcome in outcomes.items()
        if outcome == "lease_expired" and (task_id, attempt) in set(started)
    ]
    assert lapsed_started == []
    # Each handler ran once (twice for those that fail on purpose the first time).
    runs = Counter(task_id for task_id, _ in finished)
    assert {t: n for t, n in runs.items() if n != (2 if kinds[t] == _RETRY else 1)} == {}
    assert worker.stats.rejected_completions == 0, worker.stats

    # No connection was used after it broke, nor by two operations at once.
    text = "\n".join(
        r.getMessage() + (logging.Formatter().formatException(r.exc_info) if r.exc_info else "")
        for r in caplog.records
    )
    assert "InternalClientError" not in text
    assert "another operation" not in text


async def test_a_failure_outcome_cut_on_its_way_is_written_again_before_the_lease_lapses(
    queue: tuple[str, str, asyncpg.Connection], fault_proxy: FaultProxy
) -> None:
    """The connection carrying a failed attempt's outcome dies before the server sees it:
    the worker writes it again on another connection, and the task is retried as it asked,
    not recovered (and run again) after its lease lapses."""
    dsn, schema, conn = queue
    runs: list[int] = []

    async def handler(ctx: JobContext, args: Any) -> None:
        runs.append(ctx.attempt)
        if ctx.attempt == 1:
            raise JobError.retry("once more", delay=timedelta(milliseconds=10))

    worker = Scheduler(
        fault_proxy.dsn(),
        worker_id="cut-failure",
        schema=schema,
        poll_interval=0.1,
        maintenance_interval=0.2,
    )
    worker.register(WORK, handler)
    # The retry statement's text travels in its Parse message.
    trigger = b"run_at = clock_timestamp() + $3::interval"
    assert trigger.decode() in worker._sql.retry
    fault_proxy.cut_before(trigger)
    task = await enqueue(
        conn, WORK, "x", EnqueueOptions(lease_duration=timedelta(seconds=2)), schema=schema
    )
    async with running(worker):
        await wait_until(lambda: fault_proxy.cuts == 1)
        await queue_support.finished_once(dsn, schema, [task.id], timeout=30)
    history = await conn.fetch(
        f'SELECT attempt, outcome FROM "{schema}".attempts WHERE task_id = $1 ORDER BY id',
        task.id,
    )
    assert [(r["attempt"], r["outcome"]) for r in history] == [(1, "retried"), (2, "succeeded")]
    assert runs == [1, 2]
    assert (worker.stats.retried, worker.stats.recovered) == (1, 0)


async def test_a_connection_ended_while_idle_in_the_pool_is_not_used(
    queue: tuple[str, str, asyncpg.Connection], fault_proxy: FaultProxy
) -> None:
    """A pooled connection whose backend was terminated, its FATAL message received and
    its close still on the way, looks open: the statement goes to another connection."""
    from steeple.postgres.queue._db import open_db

    dsn, _schema, _conn = queue
    pool = await asyncpg.create_pool(fault_proxy.dsn(), min_size=1, max_size=2)
    try:
        db = open_db(pool)
        assert db is not None
        assert await db.fetch("SELECT 1", timeout=5) == [(1,)]
        fault_proxy.delay_close(30)
        (pid,) = fault_proxy.live_backend_pids
        assert await faultprobe.terminate(dsn, [pid]) == 1
        # The backend is gone once the server no longer lists it; its FATAL message went
        # through the proxy at once, its close (FIN) is held back.
        await wait_until(lambda: _gone(dsn, pid))
        await wait_until(lambda: fault_proxy.eofs_held >= 1)
        for _ in range(3):
            assert await db.fetch("SELECT 1", timeout=5) == [(1,)]
    finally:
        fault_proxy.delay_close(0)
        await pool.close()


async def _gone(dsn: str, pid: int) -> bool:
    return pid not in await faultprobe.sessions(dsn, [pid])
