"""The work queue under connection pressure (RELIABILITY rows 6 and 7).

- A role whose ``CONNECTION LIMIT`` is below what the worker's pool would open: the
  worker still finishes every task, once each, and its health and log say that the
  server refuses connections (SQLSTATE 53300) and what to change.
- Handlers that hold every connection of the pool the worker was given (an application
  sharing its pool with the worker): the leases of the running tasks are still renewed
  (on the worker's reserved connection, reopened when it dies), nothing is taken over by
  another worker, nothing runs twice.
- A network slower than usual but faster than the lease (every packet delayed, both
  ways): renewals keep the lease alive; a second worker watching for expired leases never
  takes the task over.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Callable
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest

import queue_support
from faultproxy import running_proxy
from pg_cluster import Clusters
from steeple.postgres.queue import EnqueueOptions, JobContext, Scheduler, Task, enqueue, install

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

GRANTS = Path(__file__).resolve().parent.parent / "docs" / "snippets" / "queue-runtime-grants.sql"
WORK: Task[Any] = Task("pressure")
wait_until = functools.partial(queue_support.wait_until, interval=0.05, timeout=90)


def _with_user(dsn: str, user: str) -> str:
    parts = urlsplit(dsn)
    return urlunsplit(parts._replace(netloc=f"{user}@{parts.netloc.rpartition('@')[2]}"))


async def _attempts(dsn: str, schema: str) -> list[tuple[int, int, str, str]]:
    conn = await asyncpg.connect(dsn, timeout=10)
    try:
        rows = await conn.fetch(
            f'SELECT task_id, attempt, outcome, worker_id FROM "{schema}".attempts ORDER BY id'
        )
    finally:
        await conn.close()
    return [(r[0], r[1], r[2], r[3]) for r in rows]


# --- a connection limit below the pool (row 7) -------------------------------------------------


@pytest.fixture
async def limited_role(
    pg_dsn: str, pg_schema: tuple[str, str], pg_name: Callable[[str], str]
) -> AsyncIterator[tuple[str, str]]:
    """The queue installed, and a role with the documented runtime grants and
    ``CONNECTION LIMIT 2``: the worker needs three at once (listener, claims, completions)
    and its pool allows eight. Yields (the role's DSN, the schema); the role is dropped."""
    dsn, schema = pg_schema
    role = pg_name("steeple_qcl")
    admin = await asyncpg.connect(dsn, timeout=10)
    try:
        await install(admin, schema=schema)
        await admin.execute(f'CREATE ROLE "{role}" LOGIN CONNECTION LIMIT 2')
        grants = GRANTS.read_text(encoding="utf-8")
        await admin.execute(
            grants.replace("{schema}", f'"{schema}"').replace("{role}", f'"{role}"')
        )
        yield _with_user(dsn, role), schema
    finally:
        await admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = $1", role
        )
        await admin.execute(f'DROP OWNED BY "{role}"; DROP ROLE "{role}"')
        await admin.close()


async def test_a_connection_limit_below_the_pool_slows_the_worker_and_says_why(
    limited_role: tuple[str, str], pg_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    dsn, schema = limited_role
    conn = await asyncpg.connect(dsn, timeout=10)
    try:
        ids = [
            (await enqueue(conn, WORK, {"n": n}, EnqueueOptions.immediate(), schema=schema)).id
            for n in range(12)
        ]
    finally:
        await conn.close()  # the worker gets both connections the role may open

    async def handler(ctx: JobContext, args: Any) -> None:
        await asyncio.sleep(0.05)  # several handlers at once: completions want connections

    worker = Scheduler(
        dsn, worker_id="limited", schema=schema, concurrency=6,
        poll_interval=0.1, maintenance_interval=0.1,
    )  # fmt: skip
    worker.register(WORK, handler)
    reasons: list[str] = []
    stop = asyncio.Event()
    caplog.set_level(logging.WARNING, logger="steeple")
    run = asyncio.create_task(worker.run_until_shutdown(stop, drain_timeout=30))

    async def finished_and_seen() -> bool:
        if run.done():
            run.result()  # the worker must not crash (or exit) on refused connections
        reasons.extend(worker.health_reasons())
        outcomes = await queue_support.task_outcomes(pg_dsn, schema)
        return all(outcomes.get(i) for i in ids)

    try:
        await wait_until(finished_and_seen)
    finally:
        stop.set()
        await asyncio.wait_for(run, 60)
    await queue_support.finished_once(pg_dsn, schema, ids)
    said = reasons + [r.getMessage() for r in caplog.records]
    limit = [line for line in said if "53300" in line and "too many connections" in line]
    assert limit, said
    # It names what to change, not only what happened.
    assert any("CONNECTION LIMIT" in line or "max_connections" in line for line in limit), limit
    assert worker.stats.succeeded == len(ids)


# --- renewals while handlers hold every pooled connection --------------------------------------


@pytest.mark.parametrize("driver", ["asyncpg", "psycopg"])
async def test_renewals_go_on_while_handlers_hold_every_pooled_connection(
    pg_schema: tuple[str, str], driver: str
) -> None:
    dsn, schema = pg_schema
    lease = timedelta(seconds=1)
    async with queue_support.installed_queue(dsn, schema) as conn:
        ids = [
            (await enqueue(conn, WORK, {"n": n}, EnqueueOptions(lease_duration=lease),
                           schema=schema)).id
            for n in range(3)
        ]  # fmt: skip
    # The application's pool, shared with the worker: the listener keeps one connection
    # (asyncpg: of the pool; psycopg: its own), and the three handlers each borrow one for
    # three leases and more: none is left.
    release = asyncio.Event()
    holding: list[JobContext] = []
    pool: Any
    if driver == "asyncpg":
        pool = await asyncpg.create_pool(dsn, min_size=0, max_size=4)
        borrow = pool.acquire
    else:
        import psycopg_pool

        pool = psycopg_pool.AsyncConnectionPool(dsn, min_size=0, max_size=3, open=False)
        await pool.open()
        borrow = pool.connection

    async def handler(ctx: JobContext, args: Any) -> None:
        async with borrow() as conn:
            await conn.execute("SELECT 1")
            holding.append(ctx)
            await release.wait()

    shared = Scheduler(
        pool, worker_id="shared", schema=schema, concurrency=3,
        poll_interval=0.1, maintenance_interval=0.1,
    )  # fmt: skip
    shared.register(WORK, handler)
    # A second worker that takes over any lease that lapses (it runs the handler too).
    thief_ran: list[JobContext] = []

    async def thief_handler(ctx: JobContext, args: Any) -> None:
        thief_ran.append(ctx)

    thief = Scheduler(
        dsn, worker_id="thief", schema=schema, poll_interval=0.05, maintenance_interval=0.05
    )
    thief.register(WORK, thief_handler)
    stop = asyncio.Event()
    runs = [asyncio.create_task(shared.run_until_shutdown(stop, drain_timeout=30))]
    observer = await asyncpg.connect(dsn, timeout=10)
    try:
        await wait_until(lambda: len(holding) == 3)
        # Started once the shared worker holds all three: it claims only lapsed leases.
        runs.append(asyncio.create_task(thief.run_until_shutdown(stop, drain_timeout=30)))
        first = await observer.fetchval(
            f"SELECT max(lease_expires_at) FROM \"{schema}\".tasks WHERE state = 'running'"
        )

        async def renewed_past_three_leases() -> bool:
            for run in runs:
                if run.done():
                    run.result()
            latest = await observer.fetchval(
                f'SELECT min(lease_expires_at) FROM "{schema}".tasks '
                "WHERE state = 'running' AND worker_id = 'shared'"
            )
            return latest is not None and latest > first + 3 * lease

        # Three leases' worth of renewals take three seconds; twenty are plenty.
        await queue_support.wait_until(renewed_past_three_leases, timeout=20, interval=0.05)
        # The connection those renewals ran on dies (its backend is ended): the next
        # renewal opens another one, and the leases go on.
        ended = await observer.fetchval(
            "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE pid <> pg_backend_pid() AND query LIKE $1",
            f"%{schema}%.tasks t%SET lease_expires_at = clock_timestamp()%",
        )
        assert ended == 1
        first = await observer.fetchval(
            f"SELECT max(lease_expires_at) FROM \"{schema}\".tasks WHERE state = 'running'"
        )
        await queue_support.wait_until(renewed_past_three_leases, timeout=20, interval=0.05)
        assert not any(ctx.lease_lost.is_set() for ctx in holding)
        release.set()
        await queue_support.finished_once(dsn, schema, ids)
    finally:
        release.set()
        stop.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.gather(*runs), 60)
        await observer.close()
        await pool.close()
    assert thief_ran == []
    assert shared.stats.lease_lost == 0
    assert {(a[1], a[2], a[3]) for a in await _attempts(dsn, schema)} == {
        (1, "succeeded", "shared")
    }


# --- a network slower than usual, faster than the lease (row 6) --------------------------------


async def test_renewals_keep_the_lease_alive_over_a_network_slower_than_usual(
    pg_clusters: Clusters,
) -> None:
    dsn = pg_clusters.new("slowish").dsn()
    schema = "steeple_slowish"
    lease = timedelta(seconds=4)
    delay = 0.3  # one way, every packet: a round trip is 0.6 s, under a sixth of the lease
    conn = await asyncpg.connect(dsn, timeout=10)
    try:
        await install(conn, schema=schema)
        task_id = (
            await enqueue(conn, WORK, {}, EnqueueOptions(lease_duration=lease), schema=schema)
        ).id
    finally:
        await conn.close()
    async with running_proxy(dsn) as proxy:
        running: list[JobContext] = []
        release = asyncio.Event()

        async def slow_handler(ctx: JobContext, args: Any) -> None:
            running.append(ctx)
            await release.wait()

        thief_ran: list[JobContext] = []

        async def thief_handler(ctx: JobContext, args: Any) -> None:
            thief_ran.append(ctx)

        slow = Scheduler(
            proxy.dsn(), worker_id="slow", schema=schema, concurrency=1,
            poll_interval=0.1, maintenance_interval=0.5,
        )  # fmt: skip
        slow.register(WORK, slow_handler)
        thief = Scheduler(
            dsn, worker_id="thief", schema=schema, poll_interval=0.05, maintenance_interval=0.05
        )
        thief.register(WORK, thief_handler)
        stop = asyncio.Event()
        runs = [asyncio.create_task(slow.run_until_shutdown(stop, drain_timeout=30))]
        observer = await asyncpg.connect(dsn, timeout=10)
        try:
            await wait_until(lambda: running)
            proxy.delay(delay)
            runs.append(asyncio.create_task(thief.run_until_shutdown(stop, drain_timeout=30)))
            first = await observer.fetchval(
                f'SELECT lease_expires_at FROM "{schema}".tasks WHERE id = $1', task_id
            )

            async def renewed_past_four_leases() -> bool:
                for run in runs:
                    if run.done():
                        run.result()
                row = await observer.fetchrow(
                    f'SELECT state, lease_expires_at FROM "{schema}".tasks WHERE id = $1',
                    task_id,
                )
                assert row is not None
                state, expires = row["state"], row["lease_expires_at"]
                assert state == "running", state  # never recovered, never taken over
                return bool(expires > first + 4 * lease)

            await wait_until(renewed_past_four_leases)
            assert not running[0].lease_lost.is_set()
            release.set()
            await queue_support.finished_once(dsn, schema, [task_id])
        finally:
            release.set()
            stop.set()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.gather(*runs), 60)
            await observer.close()
            proxy.pass_through()
    assert thief_ran == []
    assert slow.stats.lease_lost == 0
    assert await _attempts(dsn, schema) == [(task_id, 1, "succeeded", "slow")]
