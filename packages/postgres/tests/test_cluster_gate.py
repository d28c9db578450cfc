"""The worker's cluster check runs once per connection, through both drivers.

A new connection is checked with one query (the node's system identifier and timeline);
every later use of the same connection costs nothing. A node whose identity the worker's
watch refuses is refused with ``QueueClusterError`` (a ``ConnectionError``), logged, and
the connection is not marked as admitted.
"""

from __future__ import annotations

import logging
from typing import Any

import asyncpg
import psycopg_pool
import pytest

from steeple.core.cluster import ClusterIdentity
from steeple.core.errors import ClusterIdentityError
from steeple.postgres._durability import IDENTITY_QUERY, cluster_identity
from steeple.postgres.queue import QueueClusterError, QueueUnavailableError, _driver
from steeple.postgres.queue._db import open_db

pytestmark = pytest.mark.postgres


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
        assert db._gate.watch.known == expected  # type: ignore[attr-defined]
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
        db._gate.watch.observe(  # type: ignore[attr-defined]
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
        db._gate.watch.observe(  # type: ignore[attr-defined]
            ClusterIdentity(here.system_identifier + 1, here.timeline)
        )
        with pytest.raises(QueueClusterError, match="another PostgreSQL cluster"):
            await db.fetch("SELECT 1", timeout=5)
    finally:
        await pool.close()


async def _never(conn: Any) -> None:
    raise AssertionError("ran on a refused connection")
