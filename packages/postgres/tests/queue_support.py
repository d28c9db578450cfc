"""Plain helpers shared by the queue tests (their pytest fixtures live in ``conftest.py``).

The cross-package fault tests in the top-level ``tests/`` import this module too.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import asyncpg

from steeple.postgres.queue import install

QueueFixture = tuple[str, str, asyncpg.Connection]
"""The ``queue`` fixture: ``(dsn, schema, conn)``, the queue installed in ``schema``."""

# asyncpg.connect's own default connect timeout.
_CONNECT_TIMEOUT = 60.0


@contextlib.asynccontextmanager
async def installed_queue(
    dsn: str, schema: str, *, connect_timeout: float = _CONNECT_TIMEOUT
) -> AsyncIterator[asyncpg.Connection]:
    """A direct connection to ``dsn`` with the queue installed in ``schema``, closed after."""
    conn = await asyncpg.connect(dsn, timeout=connect_timeout)
    await install(conn, schema=schema)
    try:
        yield conn
    finally:
        await conn.close()


async def wait_until(
    predicate: Callable[[], Any], timeout: float = 30.0, interval: float = 0.02
) -> None:
    """Poll ``predicate`` (awaiting what it returns when awaitable) until it is truthy.

    Raises:
        AssertionError: ``timeout`` seconds passed first.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if isinstance(value, Awaitable):
            value = await value
        if value:
            return
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(interval)
