"""Shared fixtures for steeple's integration tests.

PostgreSQL: ``STEEPLE_TEST_DSN`` names a server to use; without it a private cluster is
started with the ``pgserver`` package, so a fresh machine needs no server. Under CI
(``CI=true``) a missing server or broker is a failure, never a skip.
Each test that asks for ``pg_schema`` gets its own schema, dropped afterwards.
"""

from __future__ import annotations

import os
import socket
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

IN_CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}


def _unavailable(what: str) -> None:
    """Fail under CI, skip elsewhere: a missing service must never pass silently in CI."""
    if IN_CI:
        pytest.fail(f"{what} is not available, and under CI=true that is a failure")
    pytest.skip(f"{what} is not available on this machine")


@pytest.fixture(scope="session")
def pg_dsn() -> Iterator[str]:
    """DSN of a PostgreSQL server for the whole session (shared server or private pgserver)."""
    dsn = os.environ.get("STEEPLE_TEST_DSN")
    if dsn:
        yield dsn
        return
    try:
        import pgserver  # type: ignore[import-untyped]
    except ImportError:
        _unavailable("PostgreSQL (no STEEPLE_TEST_DSN and no pgserver package)")
        return
    root = Path(os.environ.get("STEEPLE_TEST_PGDATA") or tempfile.mkdtemp(prefix="steeple-pg-"))
    server = pgserver.get_server(root, cleanup_mode="delete")
    try:
        yield server.get_uri()
    finally:
        server.cleanup()


@pytest.fixture
async def pg_schema(pg_dsn: str) -> AsyncIterator[tuple[str, str]]:
    """A fresh schema name on the test server, dropped (with everything in it) afterwards."""
    import asyncpg

    schema = f"t_{uuid.uuid4().hex[:12]}"
    try:
        conn = await asyncpg.connect(pg_dsn, timeout=10)
    except (TimeoutError, OSError, asyncpg.PostgresError) as exc:
        _unavailable(f"PostgreSQL at {pg_dsn!r} ({exc})")
        return
    try:
        await conn.execute(f'CREATE SCHEMA "{schema}"')
    finally:
        await conn.close()
    try:
        yield pg_dsn, schema
    finally:
        conn = await asyncpg.connect(pg_dsn, timeout=10)
        try:
            await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        finally:
            await conn.close()


def _reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


def _service(env: str, default: str, host: str, port: int, what: str) -> str:
    url = os.environ.get(env, default)
    if not _reachable(host, port):
        _unavailable(f"{what} at {host}:{port}")
    return url


@pytest.fixture(scope="session")
def nats_url() -> str:
    """URL of the machine's NATS server with JetStream."""
    return _service("STEEPLE_TEST_NATS", "nats://127.0.0.1:4222", "127.0.0.1", 4222, "NATS")


@pytest.fixture(scope="session")
def redis_url() -> str:
    """URL of the machine's Redis server."""
    return _service("STEEPLE_TEST_REDIS", "redis://127.0.0.1:6379/0", "127.0.0.1", 6379, "Redis")


@pytest.fixture(scope="session")
def amqp_url() -> str:
    """URL of the machine's RabbitMQ server."""
    return _service(
        "STEEPLE_TEST_AMQP", "amqp://guest:guest@127.0.0.1:5672/", "127.0.0.1", 5672, "RabbitMQ"
    )


@pytest.fixture
def private_pg() -> Iterator[Any]:
    """A private PostgreSQL cluster (pgserver) that a test may stop, restart or kill."""
    try:
        import pgserver
    except ImportError:
        _unavailable("pgserver (private PostgreSQL clusters)")
        return
    # Not tmp_path: pytest prunes old basetemp folders, which another pytest session on the
    # same machine could do while this cluster still runs in one.
    root = Path(tempfile.mkdtemp(prefix="steeple-private-pg-"))
    server = pgserver.get_server(root / "pgdata", cleanup_mode="delete")
    try:
        yield server
    finally:
        server.cleanup()
