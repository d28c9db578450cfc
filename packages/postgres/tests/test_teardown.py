"""steeple.postgres.teardown.drop_schema: the deliberate removal of a store or a queue."""

from __future__ import annotations

from collections.abc import Callable

import asyncpg
import pytest

from steeple.core.errors import ConfigurationError
from steeple.postgres.queue import install
from steeple.postgres.teardown import drop_schema

pytestmark = pytest.mark.postgres


async def test_drop_schema_removes_everything_once(
    pg_dsn: str, pg_name: Callable[[str], str]
) -> None:
    plain = pg_name("td")
    odd = pg_name('td "odd"; name')
    conn = await asyncpg.connect(pg_dsn)
    try:
        await install(conn, schema=plain)
        await conn.execute(f'CREATE SCHEMA "{odd.replace(chr(34), chr(34) * 2)}"')
        for name in (plain, odd):
            assert await drop_schema(conn, name) is True
            assert await drop_schema(conn, name) is False  # gone: nothing to drop
            assert not await conn.fetchval(
                "SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)", name
            )
        for bad in ("", "a\x00b", "x" * 64, "a\udc80"):
            with pytest.raises(ConfigurationError):
                await drop_schema(conn, bad)
    finally:
        for name in (plain, odd):
            await conn.execute(
                f'DROP SCHEMA IF EXISTS "{name.replace(chr(34), chr(34) * 2)}" CASCADE'
            )
        await conn.close()
