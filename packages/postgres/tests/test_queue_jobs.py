"""Recurring jobs: declarations, pause/resume/reschedule, run_once after downtime, snapshots."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import pytest

from queue_support import QueueFixture, wait_until
from steeple.core.backoff import Backoff
from steeple.core.errors import InvalidCronExpression
from steeple.postgres.queue import (
    EnqueueOptions,
    JobContext,
    JobExistsError,
    JobNotFoundError,
    QueueConfigurationError,
    Scheduler,
    Task,
    jobs,
    run_state,
)
from steeple.testing import FakeClock

REPORT: Task[Any] = Task("report")
# An odd start, in the real past so materialized tasks are due at once in database time.
START = datetime(2026, 3, 4, 5, 6, 7, 890_000, tzinfo=UTC)


async def _tasks(conn: asyncpg.Connection, schema: str) -> list[asyncpg.Record]:
    return await conn.fetch(
        f"SELECT id, args::text AS args, scheduled_for, run_at, priority, max_attempts, "
        f'lease_duration, job_id FROM "{schema}".tasks ORDER BY scheduled_for'
    )


async def test_create_get_and_duplicate_names(queue: QueueFixture) -> None:
    _dsn, schema, conn = queue
    clock = FakeClock(START)
    info = await jobs.create(
        conn, "hourly", REPORT, "0 * * * *", {"kind": "h"}, schema=schema, clock=clock
    )
    assert info.name == "hourly"
    assert info.cron == "0 * * * *"
    assert not info.paused
    assert info.cursor_at == START
    assert info.next_run_at == datetime(2026, 3, 4, 6, 0, tzinfo=UTC)
    assert await jobs.get(conn, "hourly", schema=schema) == info
    with pytest.raises(JobExistsError):
        await jobs.create(conn, "hourly", REPORT, "0 * * * *", {}, schema=schema, clock=clock)
    with pytest.raises(JobNotFoundError):
        await jobs.get(conn, "nope", schema=schema)
    assert "kind" not in repr(info)


async def test_bad_definitions_are_refused_and_nothing_is_stored(queue: QueueFixture) -> None:
    _dsn, schema, conn = queue
    clock = FakeClock(START)
    with pytest.raises(InvalidCronExpression):
        await jobs.create(conn, "bad", REPORT, "*/0 * * * *", {}, schema=schema, clock=clock)
    with pytest.raises(QueueConfigurationError, match="never fires"):
        await jobs.create(conn, "feb30", REPORT, "0 0 30 2 *", {}, schema=schema, clock=clock)
    with pytest.raises(QueueConfigurationError):
        await jobs.create(conn, "", REPORT, "* * * * *", {}, schema=schema, clock=clock)
    with pytest.raises(QueueConfigurationError):
        await jobs.create(
            conn, "d", REPORT, "* * * * *", {}, EnqueueOptions(dedup_key="k"), schema=schema
        )
    assert await conn.fetchval(f'SELECT count(*) FROM "{schema}".jobs') == 0


async def test_ensure_job_is_idempotent_and_applies_changes(queue: QueueFixture) -> None:
    _dsn, schema, conn = queue
    clock = FakeClock(START)
    first = await jobs.ensure_job(
        conn, "j", REPORT, "*/5 * * * *", {"v": 1}, schema=schema, clock=clock
    )
    clock.advance(timedelta(minutes=1))
    same = await jobs.ensure_job(
        conn, "j", REPORT, "*/5 * * * *", {"v": 1}, schema=schema, clock=clock
    )
    assert same == first  # nothing changed, not even updated_at or the cursor
    changed_args = await jobs.ensure(
        conn, "j", REPORT, "*/5 * * * *", {"v": 2}, EnqueueOptions(priority=3),
        schema=schema, clock=clock,
    )  # fmt: skip
    assert changed_args.priority == 3
    assert changed_args.cursor_at == first.cursor_at  # same cron: cursor kept
    assert changed_args.updated_at > first.updated_at
    changed_cron = await jobs.ensure_job(
        conn, "j", REPORT, "0 * * * *", {"v": 2}, schema=schema, clock=clock
    )
    assert changed_cron.cursor_at == clock.now()
    assert changed_cron.next_run_at == datetime(2026, 3, 4, 6, 0, tzinfo=UTC)
    await jobs.pause(conn, "j", schema=schema)
    still_paused = await jobs.ensure_job(
        conn, "j", REPORT, "0 * * * *", {"v": 2}, schema=schema, clock=clock
    )
    assert still_paused.paused


async def test_downtime_materializes_once_then_the_next_future_time(queue: QueueFixture) -> None:
    _dsn, schema, conn = queue
    clock = FakeClock(START)  # 05:06:07.89
    await jobs.create(
        conn, "every-10", REPORT, "*/10 * * * *", {"n": 1}, schema=schema, clock=clock
    )
    assert await jobs.materialize_due(conn, schema=schema, clock=clock) == 0
    clock.set(datetime(2026, 3, 4, 5, 10, tzinfo=UTC))
    assert await jobs.materialize_due(conn, schema=schema, clock=clock) == 1
    assert await jobs.materialize_due(conn, schema=schema, clock=clock) == 0  # same instant
    # three hours of downtime: one task for the missed cursor, then the next future time
    clock.set(datetime(2026, 3, 4, 8, 13, tzinfo=UTC))
    assert await jobs.materialize_due(conn, schema=schema, clock=clock) == 1
    assert await jobs.materialize_due(conn, schema=schema, clock=clock) == 0
    info = await jobs.get(conn, "every-10", schema=schema)
    assert info.next_run_at == datetime(2026, 3, 4, 8, 20, tzinfo=UTC)
    clock.set(datetime(2026, 3, 4, 8, 20, tzinfo=UTC))
    assert await jobs.materialize_due(conn, schema=schema, clock=clock) == 1
    rows = await _tasks(conn, schema)
    assert [r["scheduled_for"] for r in rows] == [
        datetime(2026, 3, 4, 5, 10, tzinfo=UTC),
        datetime(2026, 3, 4, 5, 20, tzinfo=UTC),  # the missed cursor, once
        datetime(2026, 3, 4, 8, 20, tzinfo=UTC),
    ]
    assert all(r["run_at"] == r["scheduled_for"] for r in rows)


async def test_pause_resume_and_reschedule(queue: QueueFixture) -> None:
    _dsn, schema, conn = queue
    clock = FakeClock(START)
    await jobs.create(conn, "p", REPORT, "*/10 * * * *", {}, schema=schema, clock=clock)
    paused = await jobs.pause(conn, "p", schema=schema)
    assert paused.paused
    assert (await jobs.pause(conn, "p", schema=schema)).updated_at == paused.updated_at
    clock.set(datetime(2026, 3, 4, 6, 1, tzinfo=UTC))
    assert await jobs.materialize_due(conn, schema=schema, clock=clock) == 0
    resumed = await jobs.resume(conn, "p", schema=schema, clock=clock)
    assert not resumed.paused
    # occurrences due while paused are not owed: the next is the first after resuming
    assert resumed.next_run_at == datetime(2026, 3, 4, 6, 10, tzinfo=UTC)
    assert await jobs.resume(conn, "p", schema=schema, clock=clock) == resumed  # idempotent
    assert await jobs.materialize_due(conn, schema=schema, clock=clock) == 0
    clock.set(datetime(2026, 3, 4, 6, 10, tzinfo=UTC))
    assert await jobs.materialize_due(conn, schema=schema, clock=clock) == 1
    moved = await jobs.reschedule(conn, "p", "0 12 * * *", schema=schema, clock=clock)
    assert moved.cron == "0 12 * * *"
    assert moved.next_run_at == datetime(2026, 3, 4, 12, 0, tzinfo=UTC)
    clock.set(datetime(2026, 3, 4, 11, 0, tzinfo=UTC))
    assert await jobs.materialize_due(conn, schema=schema, clock=clock) == 0
    clock.set(datetime(2026, 3, 4, 12, 0, tzinfo=UTC))
    assert await jobs.materialize_due(conn, schema=schema, clock=clock) == 1
    with pytest.raises(InvalidCronExpression):
        await jobs.reschedule(conn, "p", "61 * * * *", schema=schema, clock=clock)
    with pytest.raises(JobNotFoundError):
        await jobs.reschedule(conn, "missing", "* * * * *", schema=schema, clock=clock)
    with pytest.raises(JobNotFoundError):
        await jobs.pause(conn, "missing", schema=schema)
    with pytest.raises(JobNotFoundError):
        await jobs.resume(conn, "missing", schema=schema)


async def test_materialized_work_is_an_immutable_snapshot(queue: QueueFixture) -> None:
    _dsn, schema, conn = queue
    clock = FakeClock(START)
    options = EnqueueOptions(
        priority=4,
        max_attempts=2,
        lease_duration=timedelta(seconds=7),
        backoff=Backoff(initial=timedelta(seconds=3), maximum=timedelta(seconds=30)),
    )
    await jobs.create(
        conn, "snap", REPORT, "*/10 * * * *", {"v": "old"}, options, schema=schema, clock=clock
    )
    clock.set(datetime(2026, 3, 4, 5, 10, tzinfo=UTC))
    assert await jobs.materialize_due(conn, schema=schema, clock=clock) == 1
    await jobs.ensure_job(
        conn, "snap", REPORT, "*/10 * * * *", {"v": "new"}, schema=schema, clock=clock
    )
    await jobs.delete(conn, "snap", schema=schema)
    with pytest.raises(JobNotFoundError):
        await jobs.delete(conn, "snap", schema=schema)
    (row,) = await _tasks(conn, schema)
    assert REPORT.decode(row["args"]) == {"v": "old"}
    assert (row["priority"], row["max_attempts"], row["lease_duration"]) == (
        4,
        2,
        timedelta(seconds=7),
    )
    backoff = await conn.fetchrow(
        f'SELECT backoff_initial_us, backoff_maximum_us FROM "{schema}".tasks WHERE id = $1',
        row["id"],
    )
    assert backoff is not None
    assert tuple(backoff) == (3_000_000, 30_000_000)
    assert (await run_state(conn, row["id"], schema=schema)).state.value == "pending"


async def test_concurrent_materializers_never_duplicate_an_occurrence(queue: QueueFixture) -> None:
    dsn, schema, conn = queue
    clock = FakeClock(START)
    for i in range(20):
        await jobs.create(
            conn, f"j{i}", REPORT, "*/10 * * * *", {"i": i}, schema=schema, clock=clock
        )
    clock.set(datetime(2026, 3, 4, 5, 10, tzinfo=UTC))
    conns = [await asyncpg.connect(dsn) for _ in range(6)]
    try:
        for _ in range(3):
            made = await asyncio.gather(
                *(jobs.materialize_due(c, schema=schema, clock=clock, limit=5) for c in conns)
            )
            assert all(m <= 5 for m in made)
    finally:
        for c in conns:
            await c.close()
    rows = await conn.fetch(
        f'SELECT job_id, scheduled_for, count(*) FROM "{schema}".tasks GROUP BY 1, 2'
    )
    assert len(rows) == 20
    assert all(r[2] == 1 for r in rows)
    # a cursor rolled back to an old value still cannot materialize the same occurrence twice
    await conn.execute(f'UPDATE "{schema}".jobs SET cursor_at = $1, next_run_at = $2', START,
                       datetime(2026, 3, 4, 5, 10, tzinfo=UTC))  # fmt: skip
    assert await jobs.materialize_due(conn, schema=schema, clock=clock) == 0
    assert await conn.fetchval(f'SELECT count(*) FROM "{schema}".tasks') == 20


async def test_the_worker_runs_recurring_jobs_end_to_end(queue: QueueFixture) -> None:
    dsn, schema, conn = queue
    real_now = datetime.now(UTC)
    # Yearly, so that no new occurrence can fall due while the test runs (an hourly job
    # would gain one whenever the real clock crosses the hour).
    clock = FakeClock(real_now - timedelta(days=800))
    await jobs.ensure_job(conn, "e2e", REPORT, "0 0 1 1 *", {"x": 1}, schema=schema, clock=clock)
    clock.set(real_now)  # two years of downtime: exactly one catch-up task (run_once)
    seen: list[tuple[Any, datetime | None]] = []
    worker = Scheduler(
        dsn, worker_id="w", schema=schema, poll_interval=0.1, maintenance_interval=0.1, clock=clock
    )

    async def handler(ctx: JobContext, args: Any) -> None:
        seen.append((args, ctx.scheduled_for))

    worker.register(REPORT, handler)
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run_until_shutdown(stop))
    try:
        await wait_until(lambda: bool(seen))
        # ...and nothing more, however many maintenance passes follow.
        rounds = worker.stats.maintenance_rounds
        await wait_until(lambda: worker.stats.maintenance_rounds >= rounds + 3)
    finally:
        stop.set()
        await task
    assert len(seen) == 1
    args, due = seen[0]
    assert args == {"x": 1}
    assert due is not None
    assert (due.month, due.day, due.hour, due.minute) == (1, 1, 0, 0)
    assert due <= real_now
    assert worker.stats.materialized == 1
