"""The worker's cluster check runs once per connection, through both drivers.

A new connection is checked with one query (the node's system identifier and timeline);
every later use of the same connection costs nothing. A node whose identity the worker's
watch refuses is refused with ``QueueClusterError`` (a ``ConnectionError``), logged, and
the connection is not marked as admitted. An application's pools and connections get the
same check through a ``ClusterGuard`` (asyncpg ``init``, psycopg_pool ``configure``, or
called once on a connection).
"""

from __future__ import annotations

import logging
from typing import Any

import asyncpg
import psycopg
import psycopg_pool
import pytest

from queue_support import QueueFixture
from steeple.core.cluster import ClusterIdentity
from steeple.core.errors import ClusterIdentityError
from steeple.postgres._durability import IDENTITY_QUERY, cluster_identity
from steeple.postgres.queue import (
    ClusterGuard,
    QueueClusterError,
    QueueUnavailableError,
    Task,
    UnsupportedConnectionError,
    _driver,
    enqueue,
)
from steeple.postgres.queue._db import open_db

pytestmark = pytest.mark.postgres
WORK: Task[Any] = Task("work")


class Counting:
    """Counts the identity queries that reach the driver."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        real = _driver.fetch

        async def fetch(conn: Any, sql: str, *args: Any) -> list[tuple[Any, ...]]:
            if sql == IDENTITY_QUERY:
                self.calls += 1
            rows: list[tuple[Any, ...]] = await real(conn, sql, *args)
            return rows

        monkeypatch.setattr(_driver, "fetch", fetch)


async def _identity(dsn: str) -> ClusterIdentity:
    conn = await asyncpg.connect(dsn)
    try:
        row = await conn.fetchrow(IDENTITY_QUERY)
    finally:
        await conn.close()
    assert row is not None
    return cluster_identity(tuple(row))


async def _pools(dsn: str, driver: str) -> Any:
    if driver == "asyncpg":
        return await asyncpg.create_pool(dsn, min_size=1, max_size=1)
    pool = psycopg_pool.AsyncConnectionPool(dsn, min_size=1, max_size=1, open=False)
    await pool.open(wait=True)
    return pool


@pytest.mark.parametrize("driver", ["asyncpg", "psycopg"])
async def test_identity_is_read_once_per_connection(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch, driver: str
) -> None:
    counting = Counting(monkeypatch)
    pool = await _pools(pg_dsn, driver)
    try:
        db = open_db(pool)
        assert db is not None
        for _ in range(5):
            assert await db.fetch("SELECT 1", timeout=5) == [(1,)]

            async def read(conn: Any) -> Any:
                return await _driver.fetch(conn, "SELECT 2")

            assert await db.with_connection(read, timeout=5) == [(2,)]
        assert counting.calls == 1  # one pooled connection: read once, not per statement
        expected = await _identity(pg_dsn)
        assert db._gate.guard.known == expected  # type: ignore[attr-defined]
    finally:
        await pool.close()


@pytest.mark.parametrize("driver", ["asyncpg", "psycopg"])
async def test_a_node_on_an_older_timeline_is_refused_and_logged(
    pg_dsn: str, driver: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    here = await _identity(pg_dsn)
    pool = await _pools(pg_dsn, driver)
    try:
        db = open_db(pool)
        assert db is not None
        # As if this worker had already followed a promotion to a newer timeline.
        db._gate.guard._watch.observe(  # type: ignore[attr-defined]
            ClusterIdentity(here.system_identifier, here.timeline + 1)
        )
        with pytest.raises(QueueClusterError, match="stale node") as refused:
            await db.fetch("SELECT 1", timeout=5)
        assert isinstance(refused.value, QueueUnavailableError)
        assert isinstance(refused.value, ClusterIdentityError)
        assert isinstance(refused.value, ConnectionError)
        assert refused.value.seen == (here.system_identifier, here.timeline)
        assert any("stale node" in r.getMessage() for r in caplog.records)
        with pytest.raises(QueueClusterError):  # refused again: never admitted
            await db.with_connection(_never, timeout=5)
    finally:
        await pool.close()


async def test_another_cluster_is_refused(pg_dsn: str) -> None:
    here = await _identity(pg_dsn)
    pool = await _pools(pg_dsn, "asyncpg")
    try:
        db = open_db(pool)
        assert db is not None
        db._gate.guard._watch.observe(  # type: ignore[attr-defined]
            ClusterIdentity(here.system_identifier + 1, here.timeline)
        )
        with pytest.raises(QueueClusterError, match="another PostgreSQL cluster"):
            await db.fetch("SELECT 1", timeout=5)
    finally:
        await pool.close()


async def _never(conn: Any) -> None:
    raise AssertionError("ran on a refused connection")


# --- the same check on the connections an application enqueues on ---------------------------


def _stale(guard: ClusterGuard, here: ClusterIdentity) -> None:
    """Make ``guard`` remember a promotion of this cluster to the next timeline."""
    guard._watch.observe(ClusterIdentity(here.system_identifier, here.timeline + 1))


def _status(conn: psycopg.AsyncConnection[Any]) -> psycopg.pq.TransactionStatus:
    return conn.info.transaction_status


async def _count_tasks(conn: Any, schema: str) -> int:
    count: int = await conn.fetchval(f"SELECT count(*) FROM {schema}.tasks")
    return count


async def test_a_guarded_asyncpg_pool_reads_each_connection_once_and_enqueues(
    queue: QueueFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    dsn, schema, conn = queue
    counting = Counting(monkeypatch)
    assert ClusterGuard().known is None
    guard = ClusterGuard()
    async with asyncpg.create_pool(dsn, min_size=1, max_size=1, init=guard.check) as pool:
        for i in range(5):
            await enqueue(pool, WORK, i, schema=schema)
    assert counting.calls == 1  # when the pool opened its connection, not per enqueue
    assert guard.known == await _identity(dsn)
    assert await _count_tasks(conn, schema) == 5


async def test_a_guarded_asyncpg_pool_refuses_a_stale_node_and_enqueues_nothing(
    queue: QueueFixture, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    dsn, schema, conn = queue
    guard = ClusterGuard()
    _stale(guard, await _identity(dsn))
    async with asyncpg.create_pool(dsn, min_size=0, max_size=1, init=guard.check) as pool:
        with pytest.raises(QueueClusterError, match="stale node") as refused:
            await enqueue(pool, WORK, 1, schema=schema)
        assert isinstance(refused.value, ConnectionError)
    assert any(
        "stale node" in r.getMessage() and r.name == "steeple.postgres.queue"
        for r in caplog.records
    )
    assert await _count_tasks(conn, schema) == 0


async def test_a_guarded_psycopg_pool_and_connection_are_left_idle(queue: QueueFixture) -> None:
    dsn, schema, conn = queue
    guard = ClusterGuard()
    # A configure callback that left a transaction open would make the pool drop the
    # connection: the pool would never open.
    pool = psycopg_pool.AsyncConnectionPool(
        dsn, min_size=1, max_size=1, open=False, configure=guard.check
    )
    await pool.open(wait=True, timeout=30)
    try:
        async with pool.connection() as pooled:
            await enqueue(pooled, WORK, 1, schema=schema)
    finally:
        await pool.close()
    async with await psycopg.AsyncConnection.connect(dsn) as own:
        await guard.check(own)
        assert _status(own) == psycopg.pq.TransactionStatus.IDLE
        await own.execute("SELECT 1")  # the caller's transaction: left open
        await guard.check(own)
        assert _status(own) == psycopg.pq.TransactionStatus.INTRANS
        await enqueue(own, WORK, 2, schema=schema)
        await own.commit()
    assert await _count_tasks(conn, schema) == 2


async def test_a_guarded_psycopg_connection_on_a_stale_node_is_refused(
    queue: QueueFixture,
) -> None:
    dsn, _, _ = queue
    guard = ClusterGuard()
    _stale(guard, await _identity(dsn))
    async with await psycopg.AsyncConnection.connect(dsn) as own:
        with pytest.raises(QueueClusterError, match="stale node"):
            await guard.check(own)
        assert _status(own) == psycopg.pq.TransactionStatus.IDLE


async def test_a_guard_refuses_another_cluster(pg_dsn: str) -> None:
    here = await _identity(pg_dsn)
    guard = ClusterGuard()
    guard._watch.observe(ClusterIdentity(here.system_identifier + 1, here.timeline))
    conn = await asyncpg.connect(pg_dsn)
    try:
        with pytest.raises(QueueClusterError, match="another PostgreSQL cluster"):
            await guard.check(conn)
    finally:
        await conn.close()


@pytest.mark.parametrize(
    "conn", [42, None, True, "postgresql://app:s3cret-pw@db/app", b"\x00", object()]
)
async def test_a_guard_given_no_connection_refuses_it_typed_without_echoing_it(
    conn: object,
) -> None:
    guard = ClusterGuard()
    with pytest.raises(UnsupportedConnectionError) as refused:
        await guard.check(conn)
    assert "s3cret" not in str(refused.value)
    assert guard.known is None  # nothing was learned
