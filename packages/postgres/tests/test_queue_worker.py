"""The worker in-process against a real PostgreSQL: running, retries, leases, cancel, drain."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import pytest

import queue_support
from queue_support import QueueFixture
from steeple.core.backoff import Backoff
from steeple.postgres.queue import (
    EnqueueOptions,
    Health,
    JobContext,
    JobError,
    LeaseLostError,
    QueueConfigurationError,
    QueueError,
    QueueTypeError,
    Scheduler,
    Task,
    UnknownTaskError,
    cancel,
    enqueue,
    enqueue_many,
    run_state,
)

PLAIN: Task[Any] = Task("plain")
OTHER: Task[Any] = Task("other")


@contextlib.asynccontextmanager
async def running(worker: Scheduler, drain_timeout: float = 10.0) -> AsyncIterator[Scheduler]:
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run_until_shutdown(stop, drain_timeout=drain_timeout))
    try:
        await wait_until(lambda: worker.health() is not Health.STARTING or task.done())
        if task.done():
            task.result()
        yield worker
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


wait_until = functools.partial(queue_support.wait_until, timeout=15.0)


def worker_for(dsn: str, schema: str, **kw: Any) -> Scheduler:
    kw.setdefault("poll_interval", 0.1)
    kw.setdefault("maintenance_interval", 0.1)
    return Scheduler(dsn, worker_id=kw.pop("worker_id", "w1"), schema=schema, **kw)


async def _state(conn: asyncpg.Connection, schema: str, task_id: int) -> str:
    return (await run_state(conn, task_id, schema=schema)).state.value


async def test_runs_a_task_with_a_full_context_and_reports_health(queue: QueueFixture) -> None:
    dsn, schema, conn = queue
    seen: list[JobContext] = []
    done = await enqueue(conn, PLAIN, {"x": 1}, schema=schema)
    worker = worker_for(dsn, schema)

    async def handler(ctx: JobContext, args: Any) -> None:
        assert args == {"x": 1}
        seen.append(ctx)

    worker.register(PLAIN, handler)
    assert worker.health() is Health.STARTING
    async with running(worker):
        await wait_until(lambda: seen)
        await wait_until(lambda: worker.stats.succeeded == 1)
        assert worker.health() is Health.HEALTHY
    assert worker.health() is Health.STOPPED
    row = await conn.fetchrow(f'SELECT * FROM "{schema}".tasks WHERE id = $1', done.id)
    assert row is not None
    assert row["state"] == "succeeded"
    assert row["attempts"] == 1
    assert row["lease_token"] is None
    assert row["worker_id"] == "w1"
    ctx = seen[0]
    assert (ctx.task_id, ctx.task_name, ctx.attempt, ctx.worker_id) == (done.id, "plain", 1, "w1")
    assert ctx.run_id == row["run_id"]
    assert not ctx.lease_lost.is_set()
    history = await conn.fetch(f'SELECT * FROM "{schema}".attempts WHERE task_id = $1', done.id)
    assert [(h["attempt"], h["outcome"], h["worker_id"]) for h in history] == [
        (1, "succeeded", "w1")
    ]


async def test_delayed_work_is_not_run_early(queue: QueueFixture) -> None:
    dsn, schema, conn = queue
    ran_at: list[datetime] = []
    due = datetime.now(UTC) + timedelta(seconds=1.5)
    done = await enqueue(conn, PLAIN, 1, EnqueueOptions.at(due), schema=schema)
    worker = worker_for(dsn, schema)

    # The handler and the watch below share one connection: one statement at a time.
    one_at_a_time = asyncio.Lock()

    async def handler(ctx: JobContext, args: Any) -> None:
        async with one_at_a_time:
            ran_at.append(await conn.fetchval("SELECT clock_timestamp()"))

    worker.register(PLAIN, handler)
    async with running(worker):
        # Watched while the server's clock is before ``due`` (the clock and the state in
        # one statement): however slowly this machine runs, nothing starts early.
        while True:
            ran_before = list(ran_at)
            async with one_at_a_time:
                row = await conn.fetchrow(
                    f'SELECT clock_timestamp(), state FROM "{schema}".tasks WHERE id = $1',
                    done.id,
                )
            assert row is not None
            now, state = row
            if now >= due:
                break
            assert (ran_before, state) == ([], "pending")
            await asyncio.sleep(0.05)
        await wait_until(lambda: ran_at)
    started = await conn.fetchval(
        f'SELECT started_at FROM "{schema}".attempts WHERE task_id = $1', done.id
    )
    assert started >= due
    assert ran_at[0] >= due


async def test_delayed_work_wakes_a_listening_worker_on_time_without_polling(
    queue: QueueFixture,
) -> None:
    dsn, schema, conn = queue
    ran_at: list[datetime] = []
    worker = worker_for(dsn, schema, poll_interval=30)

    async def handler(ctx: JobContext, args: Any) -> None:
        ran_at.append(await conn.fetchval("SELECT clock_timestamp()"))

    worker.register(PLAIN, handler)
    async with running(worker):
        # Healthy means LISTEN is in place: the NOTIFY below cannot be missed.
        await wait_until(lambda: worker.health() is Health.HEALTHY)
        due = datetime.now(UTC) + timedelta(seconds=1)
        await enqueue(conn, PLAIN, 1, EnqueueOptions.at(due), schema=schema)
        await wait_until(lambda: ran_at, timeout=5)
    assert due <= ran_at[0] < due + timedelta(milliseconds=700)


async def test_priority_order_then_fifo(queue: QueueFixture) -> None:
    dsn, schema, conn = queue
    order: list[str] = []
    for label, priority in [("a0", 0), ("b5", 5), ("c-1", -1), ("d10", 10), ("e5", 5), ("f0", 0)]:
        await enqueue(conn, PLAIN, label, EnqueueOptions(priority=priority), schema=schema)
    worker = worker_for(dsn, schema, concurrency=1)

    async def handler(ctx: JobContext, args: Any) -> None:
        order.append(args)

    worker.register(PLAIN, handler)
    async with running(worker):
        await wait_until(lambda: len(order) == 6)
    assert order == ["d10", "b5", "e5", "a0", "f0", "c-1"]


async def test_retries_follow_the_snapshotted_backoff_until_max_attempts(
    queue: QueueFixture,
) -> None:
    dsn, schema, conn = queue
    times: list[float] = []
    run_ids: set[Any] = set()
    options = EnqueueOptions(
        max_attempts=3,
        backoff=Backoff(initial=timedelta(milliseconds=300), maximum=timedelta(seconds=5)),
    )
    done = await enqueue(conn, PLAIN, 1, options, schema=schema)
    worker = worker_for(dsn, schema, poll_interval=30)  # retries wake on local timers

    async def handler(ctx: JobContext, args: Any) -> None:
        times.append(time.monotonic())
        run_ids.add(ctx.run_id)
        assert ctx.attempt == len(times)
        raise JobError.retry(f"flaky {ctx.attempt}")

    worker.register(PLAIN, handler)
    async with running(worker):
        await wait_until(lambda: worker.stats.failed == 1)
    assert len(times) == 3
    assert len(run_ids) == 1
    assert times[1] - times[0] >= 0.28  # 300 ms
    assert times[2] - times[1] >= 0.58  # 600 ms (factor 2)
    row = await run_state(conn, done.id, schema=schema)
    assert row.state.value == "failed"
    assert row.attempts == 3
    assert row.last_error is not None
    assert "attempts exhausted (3/3)" in row.last_error
    outcomes = await conn.fetch(
        f'SELECT attempt, outcome FROM "{schema}".attempts WHERE task_id = $1 ORDER BY attempt',
        done.id,
    )
    assert [(r[0], r[1]) for r in outcomes] == [(1, "retried"), (2, "retried"), (3, "failed")]
    assert worker.stats.retried == 2


async def test_retry_with_explicit_delay_then_success_keeps_the_run_id(queue: QueueFixture) -> None:
    dsn, schema, conn = queue
    seen: list[tuple[int, Any, float]] = []
    done = await enqueue(conn, PLAIN, 1, schema=schema)
    worker = worker_for(dsn, schema, poll_interval=30)

    async def handler(ctx: JobContext, args: Any) -> None:
        seen.append((ctx.attempt, ctx.run_id, time.monotonic()))
        if ctx.attempt == 1:
            raise JobError.retry("later", delay=timedelta(milliseconds=500))

    worker.register(PLAIN, handler)
    async with running(worker):
        await wait_until(lambda: worker.stats.succeeded == 1)
    assert [s[0] for s in seen] == [1, 2]
    assert seen[0][1] == seen[1][1]
    assert seen[1][2] - seen[0][2] >= 0.45
    assert await _state(conn, schema, done.id) == "succeeded"


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (JobError.permanent("bad input"), "JobError: bad input"),
        (
            ValueError("boom"),
            "not retried (plain exceptions are terminal: raise JobError.retry(...) or give "
            "the task a RetryPolicy to retry them): ValueError: boom",
        ),
    ],
)
async def test_permanent_errors_and_other_exceptions_are_terminal(
    queue: QueueFixture, error: Exception, expected: str
) -> None:
    dsn, schema, conn = queue
    calls = 0
    done = await enqueue(conn, PLAIN, 1, EnqueueOptions(max_attempts=5), schema=schema)
    worker = worker_for(dsn, schema)

    async def handler(ctx: JobContext, args: Any) -> None:
        nonlocal calls
        calls += 1
        raise error

    worker.register(PLAIN, handler)
    async with running(worker):
        await wait_until(lambda: worker.stats.failed == 1)
    row = await run_state(conn, done.id, schema=schema)
    assert (row.state.value, row.attempts, calls) == ("failed", 1, 1)
    assert row.last_error == expected


async def test_undecodable_stored_args_fail_the_task(queue: QueueFixture) -> None:
    dsn, schema, conn = queue
    import attrs

    from steeple.postgres.queue.tasks import Task as TaskDef

    @attrs.frozen
    class Args:
        n: int

    typed = TaskDef("typed", Args)
    done = await enqueue(conn, Task("typed"), {"m": 1}, schema=schema)  # a producer's mistake
    worker = worker_for(dsn, schema)

    async def handler(ctx: JobContext, args: Args) -> None:
        raise AssertionError("must not run")

    worker.register(typed, handler)
    async with running(worker):
        await wait_until(lambda: worker.stats.failed == 1)
    row = await run_state(conn, done.id, schema=schema)
    assert row.state.value == "failed"
    assert row.last_error is not None
    assert row.last_error.startswith("ArgsEncodingError")


async def test_long_handler_keeps_its_lease_by_renewal(queue: QueueFixture) -> None:
    dsn, schema, conn = queue
    runs: list[int] = []
    lease_lost: list[bool] = []
    done = await enqueue(
        conn, PLAIN, 1, EnqueueOptions(lease_duration=timedelta(milliseconds=600)), schema=schema
    )
    first = worker_for(dsn, schema, worker_id="w1")
    second = worker_for(dsn, schema, worker_id="w2")

    async def handler(ctx: JobContext, args: Any) -> None:
        runs.append(ctx.attempt)
        await asyncio.sleep(2.5)  # four leases long
        lease_lost.append(ctx.lease_lost.is_set())

    first.register(PLAIN, handler)
    second.register(PLAIN, handler)
    async with running(first), running(second):
        await wait_until(lambda: first.stats.succeeded + second.stats.succeeded == 1)
    assert runs == [1]
    assert lease_lost == [False]
    assert first.stats.recovered + second.stats.recovered == 0
    row = await run_state(conn, done.id, schema=schema)
    assert row.state.value == "succeeded"
    assert row.attempts == 1


async def test_cancel_pending_work_never_runs(queue: QueueFixture) -> None:
    dsn, schema, conn = queue
    ran: list[Any] = []
    doomed = await enqueue(conn, PLAIN, "doomed", schema=schema)
    kept = await enqueue(conn, PLAIN, "kept", schema=schema)
    assert (await cancel(conn, doomed.id, schema=schema)).value == "cancelled"
    assert (await cancel(conn, doomed.id, schema=schema)).value == "cancelled"  # idempotent
    worker = worker_for(dsn, schema)

    async def handler(ctx: JobContext, args: Any) -> None:
        ran.append(args)

    worker.register(PLAIN, handler)
    async with running(worker):
        await wait_until(lambda: worker.stats.succeeded == 1)
        await asyncio.sleep(0.3)
    assert ran == ["kept"]
    assert await _state(conn, schema, kept.id) == "succeeded"
    row = await run_state(conn, doomed.id, schema=schema)
    assert row.state.value == "cancelled"
    assert row.finished_at is not None
    # a terminal task is left as it is
    assert (await cancel(conn, kept.id, schema=schema)).value == "succeeded"


async def test_cancel_running_work_fences_the_worker_and_signals_the_handler(
    queue: QueueFixture,
) -> None:
    dsn, schema, conn = queue
    started = asyncio.Event()
    signalled: list[tuple[bool, bool]] = []
    done = await enqueue(
        conn, PLAIN, 1, EnqueueOptions(lease_duration=timedelta(milliseconds=600)), schema=schema
    )
    worker = worker_for(dsn, schema)

    async def handler(ctx: JobContext, args: Any) -> None:
        started.set()
        ctx.check_lease()  # still ours
        await asyncio.wait_for(ctx.cancelled.wait(), 10)
        signalled.append((ctx.cancelled.is_set(), ctx.lease_lost.is_set()))
        with pytest.raises(LeaseLostError, match="cancelled"):
            ctx.check_lease()
        # returning normally: the completion must be rejected

    worker.register(PLAIN, handler)
    async with running(worker):
        await asyncio.wait_for(started.wait(), 10)
        assert (await cancel(conn, done.id, schema=schema)).value == "cancelled"
        await wait_until(lambda: worker.stats.rejected_completions == 1)
    assert signalled == [(True, True)]
    row = await run_state(conn, done.id, schema=schema)
    assert row.state.value == "cancelled"
    outcomes = await conn.fetch(
        f'SELECT outcome FROM "{schema}".attempts WHERE task_id = $1', done.id
    )
    assert outcomes == []  # the fenced completion recorded nothing


async def test_graceful_drain_finishes_running_work(queue: QueueFixture) -> None:
    dsn, schema, conn = queue
    started = asyncio.Event()
    done = await enqueue(conn, PLAIN, 1, schema=schema)
    worker = worker_for(dsn, schema)

    async def handler(ctx: JobContext, args: Any) -> None:
        started.set()
        await asyncio.sleep(0.7)

    worker.register(PLAIN, handler)
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run_until_shutdown(stop, drain_timeout=10))
    await asyncio.wait_for(started.wait(), 10)
    stop.set()
    await asyncio.wait_for(task, 15)
    assert await _state(conn, schema, done.id) == "succeeded"


async def test_hard_stop_after_the_drain_deadline_hands_work_back(queue: QueueFixture) -> None:
    dsn, schema, conn = queue
    started = asyncio.Event()
    done = await enqueue(conn, PLAIN, 1, schema=schema)
    worker = worker_for(dsn, schema)

    async def handler(ctx: JobContext, args: Any) -> None:
        started.set()
        await asyncio.sleep(60)

    worker.register(PLAIN, handler)
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run_until_shutdown(stop, drain_timeout=0.3))
    await asyncio.wait_for(started.wait(), 10)
    t0 = time.monotonic()
    stop.set()
    await asyncio.wait_for(task, 15)
    assert time.monotonic() - t0 < 5
    row = await run_state(conn, done.id, schema=schema)
    assert (row.state.value, row.attempts) == ("pending", 0)
    assert worker.stats.released == 1
    outcomes = await conn.fetch(
        f'SELECT outcome FROM "{schema}".attempts WHERE task_id = $1', done.id
    )
    assert [r[0] for r in outcomes] == ["released"]
    # no pooled connection left idle in transaction
    idle = await conn.fetchval(
        "SELECT count(*) FROM pg_stat_activity WHERE state = 'idle in transaction' "
        "AND datname = current_database() AND pid <> pg_backend_pid() AND query LIKE $1",
        f'%"{schema}"%',
    )
    assert idle == 0


@pytest.mark.parametrize("before_stop", [False, True])
async def test_hard_stop_hands_work_back_at_once(queue: QueueFixture, before_stop: bool) -> None:
    """``hard_stop`` (a second SIGTERM in ``steeple worker``) ends a long drain now."""
    dsn, schema, conn = queue
    started = asyncio.Event()
    done = await enqueue(conn, PLAIN, 1, schema=schema)
    worker = worker_for(dsn, schema)

    async def handler(ctx: JobContext, args: Any) -> None:
        started.set()
        await asyncio.sleep(600)

    worker.register(PLAIN, handler)
    stop, hard = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(worker.run_until_shutdown(stop, drain_timeout=600, hard_stop=hard))
    await asyncio.wait_for(started.wait(), 10)
    if not before_stop:
        stop.set()
        await asyncio.sleep(0)
        assert not task.done()  # draining: the handler keeps running
    hard.set()  # a hard stop alone stops claiming too
    await asyncio.wait_for(task, 15)
    row = await run_state(conn, done.id, schema=schema)
    assert (row.state.value, row.attempts) == ("pending", 0)
    assert worker.stats.released == 1
    assert (worker.stats.succeeded, worker.stats.claimed) == (0, 1)


async def test_a_hard_stop_that_is_not_an_event_is_refused(queue: QueueFixture) -> None:
    dsn, schema, _conn = queue
    worker = worker_for(dsn, schema)

    async def handler(ctx: JobContext, args: Any) -> None:
        return None

    worker.register(PLAIN, handler)
    with pytest.raises(QueueTypeError, match=r"hard_stop must be an asyncio\.Event"):
        await worker.run_until_shutdown(asyncio.Event(), hard_stop=True)  # type: ignore[arg-type]


async def test_unregistered_task_names_are_left_alone(queue: QueueFixture) -> None:
    dsn, schema, conn = queue
    other = await enqueue(conn, OTHER, 1, schema=schema)
    mine = await enqueue(conn, PLAIN, 1, schema=schema)
    worker = worker_for(dsn, schema)

    async def handler(ctx: JobContext, args: Any) -> None:
        return None

    worker.register(PLAIN, handler)
    async with running(worker):
        await wait_until(lambda: worker.stats.succeeded == 1)
    assert await _state(conn, schema, mine.id) == "succeeded"
    assert await _state(conn, schema, other.id) == "pending"


async def test_listener_death_falls_back_to_polling_and_relistens(queue: QueueFixture) -> None:
    dsn, schema, conn = queue
    ran: list[Any] = []

    async def handler(ctx: JobContext, args: Any) -> None:
        ran.append(args)

    worker_name = f"listener-{schema}"
    worker = worker_for(dsn, schema, poll_interval=0.3, worker_id=worker_name)
    worker.register(PLAIN, handler)

    async def listener_pids() -> list[int]:
        found = await conn.fetch(
            "SELECT pid FROM pg_stat_activity WHERE application_name = $1",
            f"steeple-listener {worker_name}",
        )
        return [r[0] for r in found]

    async with running(worker):
        await wait_until(lambda: worker.health() is Health.HEALTHY)
        # Healthy is reported before the listener's session has connected and named itself.
        await wait_until(listener_pids)
        pids = await listener_pids()
        assert len(pids) == 1
        for pid in pids:
            await conn.execute("SELECT pg_terminate_backend($1)", pid)
        await wait_until(lambda: worker.health() is Health.DEGRADED, timeout=5)
        # work still gets done by polling while degraded
        await enqueue(conn, PLAIN, "during", schema=schema)
        await wait_until(lambda: "during" in ran)
        # the listener comes back and wake-ups are immediate again
        await wait_until(lambda: worker.health() is Health.HEALTHY, timeout=10)
        t0 = time.monotonic()
        await enqueue(conn, PLAIN, "after", schema=schema)
        await wait_until(lambda: "after" in ran)
        assert time.monotonic() - t0 < 0.25


async def test_polling_alone_works_without_listen(queue: QueueFixture) -> None:
    dsn, schema, conn = queue
    ran: list[Any] = []
    worker = worker_for(dsn, schema, listen=False, poll_interval=0.05)

    async def handler(ctx: JobContext, args: Any) -> None:
        ran.append(args)

    worker.register(PLAIN, handler)
    async with running(worker):
        await enqueue_many(conn, PLAIN, list(range(20)), schema=schema)
        await wait_until(lambda: len(ran) == 20)
        assert worker.health() is Health.HEALTHY
    assert sorted(ran) == list(range(20))


async def test_registration_and_configuration_errors(queue: QueueFixture) -> None:
    dsn, schema, _conn = queue

    async def handler(ctx: JobContext, args: Any) -> None:
        return None

    worker = worker_for(dsn, schema)
    with pytest.raises(UnknownTaskError):
        await worker.run_until_shutdown(asyncio.Event())
    worker = worker_for(dsn, schema)
    worker.register(PLAIN, handler)
    with pytest.raises(UnknownTaskError):
        worker.register(Task("plain"), handler)
    stop = asyncio.Event()
    stop.set()
    await worker.run_until_shutdown(stop)
    with pytest.raises(QueueError):
        await worker.run_until_shutdown(stop)
    with pytest.raises(QueueError):
        worker.register(OTHER, handler)
    bad_options: list[dict[str, Any]] = [
        {"worker_id": ""},
        {"concurrency": 0},
        {"batch_size": 0},
        {"poll_interval": 0},
        {"schema": "Bad"},
    ]
    for bad in bad_options:
        with pytest.raises(QueueConfigurationError):
            Scheduler(dsn, **{"worker_id": "w", **bad})
    with pytest.raises(QueueConfigurationError):
        Scheduler(42, worker_id="w")


async def test_a_lease_taken_over_signals_the_handler_and_rejects_its_outcome(
    queue: QueueFixture,
) -> None:
    dsn, schema, conn = queue
    started = asyncio.Event()
    seen: list[tuple[bool, bool, str]] = []
    done = await enqueue(
        conn, PLAIN, 1, EnqueueOptions(lease_duration=timedelta(milliseconds=600)), schema=schema
    )
    worker = worker_for(dsn, schema)

    async def handler(ctx: JobContext, args: Any) -> None:
        started.set()
        await asyncio.wait_for(ctx.lease_lost.wait(), 10)
        with pytest.raises(LeaseLostError) as err:
            ctx.check_lease()
        seen.append((ctx.lease_lost.is_set(), ctx.cancelled.is_set(), str(err.value)))
        raise JobError.retry("too late to matter")

    worker.register(PLAIN, handler)
    async with running(worker):
        await asyncio.wait_for(started.wait(), 10)
        # another holder takes the task over (as a re-claim after expiry would): new token
        await conn.execute(
            f'UPDATE "{schema}".tasks SET lease_token = gen_random_uuid(), worker_id = $2 '
            "WHERE id = $1",
            done.id,
            "usurper",
        )
        await wait_until(lambda: worker.stats.rejected_completions == 1)
    assert seen == [(True, False, f"task {done.id}, attempt 1: lease lost")]
    row = await run_state(conn, done.id, schema=schema)
    assert (row.state.value, row.worker_id, row.attempts) == ("running", "usurper", 1)
    assert worker.stats.retried == 0


class _Recorder:
    """A counter and histogram recording each call (stands in for OpenTelemetry's)."""

    def __init__(self) -> None:
        self.calls: list[tuple[float, dict[str, str]]] = []

    def add(self, amount: int, attributes: Any = None) -> None:
        self.calls.append((amount, dict(attributes or {})))

    def record(self, amount: float, attributes: Any = None) -> None:
        self.calls.append((amount, dict(attributes or {})))

    def per_task(self) -> dict[str, float]:
        totals: dict[str, float] = {}
        for amount, attributes in self.calls:
            totals[attributes["task"]] = totals.get(attributes["task"], 0) + amount
        return totals


async def test_a_batch_of_completions_is_counted_under_each_tasks_name(
    queue: QueueFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    import steeple.postgres.queue._worker as worker_module
    from steeple.postgres.queue import _metrics
    from steeple.postgres.queue._db import open_db

    dsn, schema, conn = queue
    recorders = {field.name: _Recorder() for field in _metrics.QueueInstruments.__attrs_attrs__}
    recording = _metrics.QueueInstruments(**recorders)
    monkeypatch.setattr(_metrics, "instruments", lambda: recording)
    monkeypatch.setattr(_metrics, "recording", lambda: recording)
    batches: list[list[int]] = []

    class Recording:
        def __init__(self, inner: Any, complete_sql: str) -> None:
            self.inner = inner
            self.complete_sql = complete_sql

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

        async def fetch(self, sql: str, *args: Any, timeout: float) -> list[tuple[Any, ...]]:
            if sql == self.complete_sql:
                # sent as one array literal: '{1,2,3}'
                batches.append([int(i) for i in args[0].strip("{}").split(",")])
            return list(await self.inner.fetch(sql, *args, timeout=timeout))

    worker = worker_for(dsn, schema, concurrency=40)
    monkeypatch.setattr(
        worker_module, "open_db", lambda pool: Recording(open_db(pool), worker._sql.complete)
    )
    names: dict[int, str] = {}
    for n in range(20):
        for task in (PLAIN, OTHER):
            names[(await enqueue(conn, task, n, schema=schema)).id] = task.name

    async def handler(ctx: JobContext, args: Any) -> None:
        return None

    worker.register(PLAIN, handler)
    worker.register(OTHER, handler)
    async with running(worker):
        await wait_until(lambda: worker.stats.succeeded == 40)
    # The test is about mixed batches: at least one held both names.
    assert any(len({names[i] for i in batch}) == 2 for batch in batches), batches
    assert recorders["succeeded"].per_task() == {"plain": 20, "other": 20}
    assert recorders["claimed"].per_task() == {"plain": 20, "other": 20}


async def test_a_handler_that_blocks_the_loop_is_counted_and_named(
    queue: QueueFixture, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The worker's loop-lag monitor: ``stats.loop_stalls``, the histogram, the log line."""
    import threading

    from steeple.postgres.queue import _metrics

    dsn, schema, conn = queue
    recorders = {field.name: _Recorder() for field in _metrics.QueueInstruments.__attrs_attrs__}
    recording = _metrics.QueueInstruments(**recorders)
    monkeypatch.setattr(_metrics, "instruments", lambda: recording)
    monkeypatch.setattr(_metrics, "recording", lambda: recording)
    reported = threading.Event()

    class Watch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            # Only the watchdog's sample of this handler counts: on a loaded machine the
            # loop also stalls by itself, and such a sample names other code.
            message = record.getMessage()
            if "has been blocked" in message and "careless_handler" in message:
                reported.set()

    watch = Watch()
    logging.getLogger("steeple.runtime.looplag").addHandler(watch)
    done = await enqueue(conn, PLAIN, 1, schema=schema)
    worker = worker_for(dsn, schema, loop_lag_threshold=0.05)

    async def careless_handler(ctx: JobContext, args: Any) -> None:
        # Blocks the event loop until the monitor's watchdog has seen it blocked. The
        # watchdog samples once per stall: a stall that began before this handler ran
        # (a starved machine) was sampled naming other code, so this one lets the monitor
        # wake (a new stall begins) and blocks again, for at most 30 s in all.
        for _ in range(30):
            if reported.wait(1.0):
                return
            await asyncio.sleep(0.2)
        raise AssertionError("the watchdog never named this handler")

    worker.register(PLAIN, careless_handler)
    try:
        with caplog.at_level(logging.WARNING, "steeple.runtime.looplag"):
            async with running(worker):
                await wait_until(lambda: worker.stats.succeeded == 1)
                await wait_until(lambda: worker.stats.loop_stalls >= 1)
    finally:
        logging.getLogger("steeple.runtime.looplag").removeHandler(watch)
    assert await _state(conn, schema, done.id) == "succeeded"
    stalled = [r.getMessage() for r in caplog.records if "stalled for" in r.getMessage()]
    assert len(stalled) == worker.stats.loop_stalls
    assert any(
        f"task \"steeple task 'plain' #{done.id} attempt 1\"" in m and "careless_handler" in m
        for m in stalled
    ), stalled
    assert len(recorders["loop_stall"].calls) == worker.stats.loop_stalls
    assert all(lag > 0.05 for lag, _ in recorders["loop_stall"].calls)


@pytest.mark.parametrize("bad", [float("nan"), -1.0, 0.0, 0.001, 7200, "0.5", True])
def test_a_bad_loop_lag_threshold_is_refused(bad: Any) -> None:
    with pytest.raises((QueueConfigurationError, QueueTypeError), match="loop_lag_threshold"):
        Scheduler("postgresql://localhost/db", worker_id="w", loop_lag_threshold=bad)


async def test_loop_lag_detection_can_be_turned_off(queue: QueueFixture) -> None:
    import threading

    dsn, schema, conn = queue
    await enqueue(conn, PLAIN, 1, schema=schema)
    worker = worker_for(dsn, schema, loop_lag_threshold=None)

    async def handler(ctx: JobContext, args: Any) -> None:
        return None

    worker.register(PLAIN, handler)
    async with running(worker):
        await wait_until(lambda: worker.stats.succeeded == 1)
        assert "steeple loop-lag watchdog" not in {t.name for t in threading.enumerate()}


@pytest.mark.parametrize(
    "dsn",
    [
        "postgresql://runtime:s3cret-pw@db.internal:5432/app",
        "postgresql://runtime:s3cret-pw@db.internal/app?sslmode=require",
        "postgresql://runtime:s3cret-pw@127.0.0.1,db.internal/app?sslmode=disable",
    ],
)
def test_a_remote_host_without_verified_tls_is_refused(
    dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # RELIABILITY row 25, as the recurring store refuses it: before any connection is made.
    monkeypatch.delenv("PGSSLMODE", raising=False)
    with pytest.raises(QueueConfigurationError, match="verified TLS") as caught:
        Scheduler(dsn, worker_id="w")
    assert "db.internal" in str(caught.value)
    assert "s3cret-pw" not in str(caught.value)


@pytest.mark.parametrize(
    "dsn",
    [
        "postgresql://runtime@db.internal/app?sslmode=verify-full&sslrootcert=/etc/ca.pem",
        "postgresql://runtime@db.internal/app?sslmode=verify-ca",
        "postgresql://runtime@127.0.0.1/app?sslmode=disable",
        "postgresql://runtime@localhost/app",
        "postgresql://runtime@[::1]/app",
        "postgresql://runtime@/app?host=/run/postgresql",
    ],
)
def test_verified_tls_loopback_and_sockets_are_accepted(
    dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PGSSLMODE", raising=False)
    assert Scheduler(dsn, worker_id="w").worker_id == "w"


def test_pgsslmode_verify_full_satisfies_the_check(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PGSSLMODE", "verify-full")
    assert Scheduler("postgresql://runtime@db.internal/app", worker_id="w").worker_id == "w"
    monkeypatch.setenv("PGSSLMODE", "require")
    with pytest.raises(QueueConfigurationError, match="verified TLS"):
        Scheduler("postgresql://runtime@db.internal/app", worker_id="w")


async def test_a_contexts_events_are_one_pair_whoever_asks_first() -> None:
    """Made on first use: the loop and a handler's threads see the same two events."""
    import threading
    import uuid

    from steeple.postgres.queue import JobContext

    ctx = JobContext(
        task_id=1, task_name="t", run_id=uuid.uuid4(), attempt=1, max_attempts=1, worker_id="w"
    )
    start = threading.Barrier(8)
    seen: list[tuple[asyncio.Event, asyncio.Event]] = []

    def ask() -> None:
        start.wait()
        seen.append((ctx.lease_lost, ctx.cancelled))

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert {id(pair[0]) for pair in seen} == {id(ctx.lease_lost)}
    assert {id(pair[1]) for pair in seen} == {id(ctx.cancelled)}
    assert ctx.lease_lost is not ctx.cancelled
    ctx.cancelled.set()
    ctx.lease_lost.set()
    assert all(lost.is_set() and gone.is_set() for lost, gone in seen)
    await asyncio.wait_for(ctx.lease_lost.wait(), 5)
    given = asyncio.Event()
    kept = JobContext(
        task_id=2,
        task_name="t",
        run_id=uuid.uuid4(),
        attempt=1,
        max_attempts=1,
        worker_id="w",
        lease_lost=given,
    )
    assert kept.lease_lost is given
    assert not kept.cancelled.is_set()
