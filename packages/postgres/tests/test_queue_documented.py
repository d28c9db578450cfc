"""Claims the documentation site makes about the work queue, checked against PostgreSQL.

- docs/queue/concurrency-model.md: the claim uses FOR NO KEY UPDATE SKIP LOCKED because
  FOR UPDATE SKIP LOCKED skips a task that an uncommitted foreign-key insert references.
- docs/operations.md: the runtime grants in docs/snippets/queue-runtime-grants.sql are
  enough to enqueue, run a worker, cancel, prune and manage recurring jobs.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest

from queue_support import wait_until
from steeple.core.backoff import Backoff
from steeple.postgres import queue as pgq
from steeple.postgres.queue import EnqueueOptions, Health, JobContext, JobError, Scheduler, Task
from steeple.testing import FakeClock

pytestmark = pytest.mark.postgres

GRANTS = Path(__file__).resolve().parents[3] / "docs" / "snippets" / "queue-runtime-grants.sql"


def with_user(dsn: str, user: str) -> str:
    parts = urlsplit(dsn)
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{user}@{host}"))


async def test_claim_takes_a_task_referenced_by_an_uncommitted_insert(queue: Any) -> None:
    dsn, schema, conn = queue
    await conn.execute(
        f'CREATE TABLE "{schema}".audit (task_id bigint REFERENCES "{schema}".tasks (id))'
    )
    task = await queue_enqueue(conn, schema)
    other = await asyncpg.connect(dsn)
    try:
        async with other.transaction():
            # An application transaction that references the task and has not committed.
            await other.execute(f'INSERT INTO "{schema}".audit VALUES ($1)', task)
            # PostgreSQL's behaviour the design avoids: FOR UPDATE SKIP LOCKED skips it ...
            skipped = await conn.fetch(
                f"SELECT id FROM \"{schema}\".tasks WHERE state = 'pending' FOR UPDATE SKIP LOCKED"
            )
            assert skipped == []
            # ... while the claim (FOR NO KEY UPDATE SKIP LOCKED) takes it.
            claimed = await conn.fetch(
                f"SELECT id FROM \"{schema}\".claim(ARRAY['default'], ARRAY[10], $1::text[], $2, "
                "extract(epoch FROM clock_timestamp())::double precision + 60)",
                ["documented"],
                "w1",
            )
            assert [r["id"] for r in claimed] == [task]
    finally:
        await other.close()


async def queue_enqueue(conn: asyncpg.Connection, schema: str) -> int:
    enqueued = await pgq.enqueue(conn, Task("documented"), {"n": 1}, schema=schema)
    return enqueued.id


@pytest.fixture
async def runtime_dsn(queue: Any) -> AsyncIterator[str]:
    """A login role holding exactly the documented queue runtime grants."""
    dsn, schema, conn = queue
    role = f"steeple_qrt_{uuid.uuid4().hex[:8]}"
    await conn.execute(f'CREATE ROLE "{role}" LOGIN')
    try:
        grants = GRANTS.read_text(encoding="utf-8")
        await conn.execute(grants.replace("{schema}", f'"{schema}"').replace("{role}", f'"{role}"'))
        yield with_user(dsn, role)
    finally:
        await conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = $1", role
        )
        await conn.execute(f'DROP OWNED BY "{role}"; DROP ROLE "{role}"')


async def test_runtime_role_with_the_documented_grants_runs_the_queue(
    queue: Any, runtime_dsn: str
) -> None:
    _, schema, _ = queue
    task: Task[dict[str, str]] = Task("documented")
    runtime = await asyncpg.connect(runtime_dsn)
    try:
        superuser = await runtime.fetchval(
            "SELECT rolsuper FROM pg_roles WHERE rolname = current_user"
        )
        assert superuser is False
        keyed = EnqueueOptions.immediate(limit_key="customer-1")
        ok = await pgq.enqueue(runtime, task, {"do": "succeed"}, keyed, schema=schema)
        fast = Backoff(initial=timedelta(milliseconds=10), maximum=timedelta(milliseconds=10))
        failing = await pgq.enqueue(
            runtime,
            task,
            {"do": "retry"},
            EnqueueOptions.immediate(max_attempts=2, backoff=fast),
            schema=schema,
        )
        # A short lease: the worker learns of the cancellation at its next renewal (lease / 3).
        held = await pgq.enqueue(
            runtime,
            task,
            {"do": "hold"},
            EnqueueOptions.immediate(lease_duration=timedelta(seconds=1)),
            schema=schema,
        )
        many = await pgq.enqueue_many(runtime, task, [{"do": "succeed"}] * 3, schema=schema)
        # A workflow: enqueued in one statement (ids from the tasks' sequence), released by
        # the completion of its first task, and a task waiting on another by id.
        flow = pgq.Workflow()
        first = flow.add(task, {"do": "succeed"})
        second = flow.add(task, {"do": "succeed"}, after=[first])
        enqueued = await pgq.enqueue_workflow(runtime, flow, schema=schema)
        after = await pgq.enqueue(runtime, task, {"do": "succeed"}, after=[ok], schema=schema)
        flow_ids = [enqueued.id_of(first), enqueued.id_of(second), after.id]
        # Queue settings: the worker's claims then lock and update them (the limited path).
        assert (await pgq.pause_queue(runtime, "other", schema=schema)).paused
        assert not (await pgq.resume_queue(runtime, "other", schema=schema)).paused
        await pgq.limit_queue(
            runtime,
            "default",
            max_running=100,
            max_running_per_key=10,
            rate_limit_per_key=1000,
            per_key=1.0,
            schema=schema,
        )
        await pgq.limit_task(
            runtime, "documented", rate_limit=1000, per=1.0, rate_limit_per_key=100, per_key=1.0,
            schema=schema,
        )  # fmt: skip
        assert [q.name for q in await pgq.list_queues(runtime, schema=schema)] == ["default"]
        started = asyncio.Event()

        async def handle(ctx: JobContext, args: dict[str, str]) -> None:
            if args["do"] == "retry":
                raise JobError.retry("documented failure")
            if args["do"] == "hold":
                started.set()
                await ctx.lease_lost.wait()

        worker = Scheduler(runtime_dsn, worker_id="documented", schema=schema, poll_interval=0.05)
        worker.register(task, handle)
        stop = asyncio.Event()
        running = asyncio.create_task(worker.run_until_shutdown(stop))
        try:
            await asyncio.wait_for(started.wait(), 30)
            # Healthy once its wake-up listener is up too: a handler may start first (the
            # LISTEN connection is opened beside the first claim).
            await wait_until(lambda: worker.health() is Health.HEALTHY)
            assert (await pgq.cancel(runtime, held.id, schema=schema)).value == "cancelled"

            async def settled() -> bool:
                states = [
                    (await pgq.run_state(runtime, i, schema=schema)).state.value
                    for i in (ok.id, failing.id, *many, *flow_ids)
                ]
                return states == ["succeeded", "failed", *["succeeded"] * 6]

            await wait_until(settled)
            await wait_until(lambda: worker.stats.rejected_completions == 1)
        finally:
            stop.set()
            await running
        assert worker.stats.retried == 1
        assert worker.stats.failed == 1

        clock = FakeClock(await runtime.fetchval("SELECT clock_timestamp()"))
        await pgq.jobs.create(runtime, "every-minute", task, "* * * * *", {"do": "x"},
                                schema=schema, clock=clock)  # fmt: skip
        await pgq.jobs.pause(runtime, "every-minute", schema=schema)
        await pgq.jobs.resume(runtime, "every-minute", schema=schema, clock=clock)
        clock.advance(timedelta(minutes=2))
        assert await pgq.jobs.materialize_due(runtime, schema=schema, clock=clock) == 1
        await pgq.jobs.reschedule(runtime, "every-minute", "*/5 * * * *", schema=schema)
        await pgq.jobs.delete(runtime, "every-minute", schema=schema)
        graph = await pgq.workflow_state(runtime, enqueued.workflow_id, schema=schema)
        assert graph.finished
        assert [p.id for p in await pgq.parent_results(runtime, after.id, schema=schema)] == [ok.id]
        assert await pgq.prune_terminal(runtime, timedelta(0), schema=schema) == 9
    finally:
        await runtime.close()
