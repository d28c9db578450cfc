"""The work queue's worker when its connections die (RELIABILITY.md rows 3 and 8).

The worker connects through a :class:`FaultProxy`, so the test ends exactly its
backends (``pg_terminate_backend``) or resets its sockets; producers and checks use the
direct DSN.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections import Counter
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import asyncpg
import pytest

import faultprobe
import queue_support
from faultproxy import FaultProxy
from steeple.postgres.queue import (
    EnqueueOptions,
    Health,
    JobContext,
    Scheduler,
    Task,
    enqueue,
    enqueue_many,
    run_state,
)

pytestmark = [pytest.mark.postgres]

WORK: Task[Any] = Task("fault.work")


@pytest.fixture
async def queue(pg_schema: tuple[str, str]) -> AsyncIterator[tuple[str, str, asyncpg.Connection]]:
    dsn, schema = pg_schema
    async with queue_support.installed_queue(dsn, schema, connect_timeout=10) as conn:
        yield dsn, schema, conn


wait_until = functools.partial(queue_support.wait_until, timeout=15.0)


async def listener_pids(dsn: str, proxy: FaultProxy, worker_id: str) -> list[int]:
    conn = await asyncpg.connect(dsn, timeout=10)
    try:
        rows = await conn.fetch(
            "SELECT pid FROM pg_stat_activity WHERE pid = ANY($1) AND application_name = $2",
            list(proxy.live_backend_pids),
            f"steeple-listener {worker_id}",
        )
    finally:
        await conn.close()
    return [r[0] for r in rows]


async def run_worker(worker: Scheduler, stop: asyncio.Event) -> asyncio.Task[None]:
    task = asyncio.create_task(worker.run_until_shutdown(stop, drain_timeout=10))
    await wait_until(lambda: worker.health() is not Health.STARTING or task.done())
    if task.done():
        task.result()
    return task


@pytest.mark.parametrize("fault", ["terminate", "reset"])
async def test_worker_recovers_and_each_task_completes_once(
    queue: tuple[str, str, asyncpg.Connection], fault_proxy: FaultProxy, fault: str
) -> None:
    dsn, schema, conn = queue
    executions: list[tuple[int, int]] = []
    victim_started = asyncio.Event()
    killed = asyncio.Event()

    async def kill() -> int:
        if fault == "terminate":
            return await faultprobe.terminate(dsn, fault_proxy.live_backend_pids)
        ended = fault_proxy.open_connections
        fault_proxy.reset()
        return ended

    async def handler(ctx: JobContext, args: Any) -> None:
        executions.append((ctx.task_id, ctx.attempt))
        if args == "victim":
            victim_started.set()
            await asyncio.wait_for(killed.wait(), 10)
            # outlive the 1 s lease a few times over: renewals must go on over new
            # connections, or the task would be recovered and run twice
            await asyncio.sleep(2.0)
            assert not ctx.lease_lost.is_set()
            # and once more (whatever is open by now) between the handler's end and the
            # write of its completion
            await kill()

    worker = Scheduler(
        fault_proxy.dsn(),
        worker_id=f"fault-{fault}",
        schema=schema,
        poll_interval=0.1,
        maintenance_interval=0.2,
        concurrency=4,
    )
    worker.register(WORK, handler)
    victim = await enqueue(
        conn, WORK, "victim", EnqueueOptions(lease_duration=timedelta(seconds=1)), schema=schema
    )
    stop = asyncio.Event()
    running = await run_worker(worker, stop)
    try:
        async with asyncio.timeout(30):
            await asyncio.wait_for(victim_started.wait(), 10)
            # mid-run: the pool's connections and the listener all die at once
            assert await kill() >= 2
            killed.set()
            others = await enqueue_many(conn, WORK, list(range(10)), schema=schema)
            ids = [victim.id, *others]

            async def all_done() -> bool:
                states = [(await run_state(conn, i, schema=schema)).state.value for i in ids]
                return all(s == "succeeded" for s in states)

            try:
                await wait_until(all_done, timeout=20)
            except AssertionError:
                runs = [await run_state(conn, i, schema=schema) for i in ids]
                raise AssertionError(
                    f"not all succeeded: {[(r.id, r.state.value, r.attempts) for r in runs]} "
                    f"stats={worker.stats} executions={executions} health={worker.health()}"
                ) from None
    finally:
        stop.set()
        await asyncio.wait_for(running, 20)
    # exactly once: one execution, one attempt and one success recorded per task
    per_task = Counter(task_id for task_id, _ in executions)
    assert set(per_task) == set(ids)
    assert set(per_task.values()) == {1}, per_task
    rows = await conn.fetch(
        f'SELECT task_id, outcome FROM "{schema}".attempts WHERE task_id = ANY($1)', ids
    )
    assert sorted(r["task_id"] for r in rows if r["outcome"] == "succeeded") == sorted(ids)
    assert all(r["outcome"] == "succeeded" for r in rows), [dict(r) for r in rows]
    for task_id in ids:
        run = await run_state(conn, task_id, schema=schema)
        assert (run.state.value, run.attempts) == ("succeeded", 1)
    assert worker.stats.succeeded == len(ids)
    assert worker.stats.rejected_completions == 0
    await faultprobe.wait_for_clean(dsn, fault_proxy.backend_pids)


async def test_worker_survives_connections_that_die_slowly(
    queue: tuple[str, str, asyncpg.Connection], fault_proxy: FaultProxy
) -> None:
    """Terminated backends whose close arrives after their FATAL message: the idle worker
    meets connections that are dead but still look open, and must carry on."""
    dsn, schema, conn = queue
    ran: list[Any] = []

    async def handler(ctx: JobContext, args: Any) -> None:
        ran.append(args)

    worker = Scheduler(
        fault_proxy.dsn(),
        worker_id="fault-slow-close",
        schema=schema,
        poll_interval=0.05,
        maintenance_interval=0.1,
    )
    worker.register(WORK, handler)
    stop = asyncio.Event()
    running = await run_worker(worker, stop)
    try:
        await enqueue(conn, WORK, "before", schema=schema)
        await wait_until(lambda: "before" in ran)
        fault_proxy.delay_close(0.5)
        assert await faultprobe.terminate(dsn, fault_proxy.live_backend_pids) >= 2
        await asyncio.sleep(1.0)  # polls and maintenance run into the dying connections
        assert not running.done(), running.exception()
        fault_proxy.delay_close(0)
        await enqueue(conn, WORK, "after", schema=schema)
        await wait_until(lambda: "after" in ran or running.done(), timeout=10)
        assert not running.done(), running.exception()
    finally:
        stop.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(running, 20)
    assert ran == ["before", "after"]
    await faultprobe.wait_for_clean(dsn, fault_proxy.backend_pids)


async def test_killed_listener_falls_back_to_polling_then_relistens(
    queue: tuple[str, str, asyncpg.Connection], fault_proxy: FaultProxy
) -> None:
    dsn, schema, conn = queue
    ran: dict[str, float] = {}

    async def handler(ctx: JobContext, args: Any) -> None:
        ran[args] = time.monotonic()

    worker_id = f"fault-listener-{schema}"
    # a long poll interval tells a NOTIFY wake-up (immediate) from a poll (up to 1.5 s)
    worker = Scheduler(
        fault_proxy.dsn(),
        worker_id=worker_id,
        schema=schema,
        poll_interval=1.5,
        maintenance_interval=5.0,
    )
    worker.register(WORK, handler)
    stop = asyncio.Event()
    running = await run_worker(worker, stop)
    try:
        async with asyncio.timeout(40):
            # Healthy: the first claim round is done and LISTEN is in place.
            await wait_until(lambda: worker.health() is Health.HEALTHY)
            sent = time.monotonic()
            await enqueue(conn, WORK, "listening", schema=schema)
            await wait_until(lambda: "listening" in ran)
            assert ran["listening"] - sent < 0.5  # woken by NOTIFY
            pids = await listener_pids(dsn, fault_proxy, worker_id)
            assert len(pids) == 1
            assert await faultprobe.terminate(dsn, pids) == 1
            await wait_until(lambda: worker.health() is Health.DEGRADED, timeout=5)
            # while the listener is down, polling still finds new work
            await enqueue(conn, WORK, "polled", schema=schema)
            await wait_until(lambda: "polled" in ran, timeout=5)
            # the worker listens again, and wake-ups are immediate again
            await wait_until(lambda: worker.health() is Health.HEALTHY, timeout=10)
            assert len(await listener_pids(dsn, fault_proxy, worker_id)) == 1
            sent = time.monotonic()
            await enqueue(conn, WORK, "relistened", schema=schema)
            await wait_until(lambda: "relistened" in ran, timeout=5)
            assert ran["relistened"] - sent < 0.5
    finally:
        stop.set()
        await asyncio.wait_for(running, 20)
    assert sorted(ran) == ["listening", "polled", "relistened"]
    await faultprobe.wait_for_clean(dsn, fault_proxy.backend_pids)


async def test_blackholed_worker_degrades_stops_in_time_and_loses_nothing(
    queue: tuple[str, str, asyncpg.Connection], fault_proxy: FaultProxy
) -> None:
    dsn, schema, conn = queue
    ran: list[Any] = []

    async def handler(ctx: JobContext, args: Any) -> None:
        ran.append(args)

    query_timeout, drain = 1.5, 0.5
    first = Scheduler(
        fault_proxy.dsn(),
        worker_id="fault-blackhole-1",
        schema=schema,
        poll_interval=0.2,
        maintenance_interval=0.5,
        query_timeout=query_timeout,
    )
    first.register(WORK, handler)
    stop = asyncio.Event()
    running = await run_worker(first, stop)
    try:
        await enqueue(conn, WORK, "before", schema=schema)
        await wait_until(lambda: first.stats.succeeded == 1)  # run and recorded
        fault_proxy.blackhole()
        # A claim sent into the blackhole is delivered when the network returns, after its
        # worker gave up: the task then waits out a lease nobody holds (1 s here).
        during = await enqueue(
            conn,
            WORK,
            "during",
            EnqueueOptions(lease_duration=timedelta(seconds=1)),
            schema=schema,
        )
        # the worker notices: its queries hit their deadline
        await wait_until(lambda: first.health() is Health.DEGRADED, timeout=3 * query_timeout)
        # and it stops within its deadlines while the network is still gone
        started = time.monotonic()
        stop.set()
        done, _ = await asyncio.wait({running}, timeout=4 * query_timeout + drain + 2)
        assert done, f"run_until_shutdown hung on a blackholed network ({first.stats})"
        running.result()
        assert time.monotonic() - started <= 4 * query_timeout + drain + 2
    finally:
        fault_proxy.pass_through()
        stop.set()
        await asyncio.wait_for(running, 20)
    # nothing the first worker held is left behind once the network returns
    await faultprobe.wait_for_clean(dsn, fault_proxy.backend_pids)
    second = Scheduler(
        fault_proxy.dsn(),
        worker_id="fault-blackhole-2",
        schema=schema,
        poll_interval=0.2,
        maintenance_interval=0.5,
        query_timeout=query_timeout,
    )
    second.register(WORK, handler)
    stop = asyncio.Event()
    running = await run_worker(second, stop)
    try:
        await wait_until(lambda: second.stats.succeeded == 1, timeout=10)
    finally:
        stop.set()
        await asyncio.wait_for(running, 20)
    assert sorted(ran) == ["before", "during"]
    run = await run_state(conn, during.id, schema=schema)
    assert run.state.value == "succeeded"
    outcomes = await conn.fetch(
        f'SELECT outcome FROM "{schema}".attempts WHERE task_id = $1 ORDER BY id', during.id
    )
    # at most one lapsed claim by the worker that gave up, then one success
    assert [r["outcome"] for r in outcomes] in (["succeeded"], ["lease_expired", "succeeded"])


async def test_lost_answer_to_a_completion_still_completes_once(
    queue: tuple[str, str, asyncpg.Connection], fault_proxy: FaultProxy
) -> None:
    """The completion commits but its answer is lost: the worker retries it, is told the
    task is no longer its own, and the task stays succeeded, run once."""
    dsn, schema, conn = queue
    executions: list[int] = []

    async def handler(ctx: JobContext, args: Any) -> None:
        executions.append(ctx.task_id)

    # the completion statement's text travels in its first Parse on a connection
    fault_proxy.cut_reply_after(b".complete_tasks($1::text::bigint[]")
    worker = Scheduler(
        fault_proxy.dsn(),
        worker_id="fault-lost-answer",
        schema=schema,
        poll_interval=0.1,
        maintenance_interval=0.2,
    )
    worker.register(WORK, handler)
    task = await enqueue(conn, WORK, "once", schema=schema)
    stop = asyncio.Event()
    running = await run_worker(worker, stop)
    try:
        await wait_until(lambda: fault_proxy.replies_cut == 1, timeout=10)
        # the retried completion is answered; give maintenance a few rounds too
        await wait_until(
            lambda: worker.stats.succeeded + worker.stats.rejected_completions >= 1, timeout=10
        )
        await asyncio.sleep(0.5)
    finally:
        stop.set()
        await asyncio.wait_for(running, 20)
    assert executions == [task.id]
    # the retried completion either records it or finds it recorded by the lost one
    assert worker.stats.succeeded + worker.stats.rejected_completions == 1
    run = await run_state(conn, task.id, schema=schema)
    assert (run.state.value, run.attempts) == ("succeeded", 1)
    outcomes = await conn.fetch(
        f'SELECT outcome FROM "{schema}".attempts WHERE task_id = $1', task.id
    )
    assert [r["outcome"] for r in outcomes] == ["succeeded"]
    await faultprobe.wait_for_clean(dsn, fault_proxy.backend_pids)
