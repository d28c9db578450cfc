"""Looking at the server from the side (a direct connection) while faults are injected.

Every query is limited to the backends a test names (by pid), so tests never see or end
the sessions of other tests running on the same shared server.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable

import asyncpg

__all__ = [
    "idle_in_transaction",
    "locks_held",
    "sessions",
    "terminate",
    "wait_for_clean",
]


async def _fetch(dsn: str, query: str, *args: object) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(dsn, timeout=10)
    try:
        return list(await conn.fetch(query, *args))
    finally:
        await conn.close()


async def sessions(dsn: str, pids: Iterable[int]) -> dict[int, str]:
    """``pid -> state`` of those backends that still exist."""
    rows = await _fetch(
        dsn,
        "SELECT pid, coalesce(state, '') AS state FROM pg_stat_activity WHERE pid = ANY($1)",
        list(pids),
    )
    return {r["pid"]: r["state"] for r in rows}


async def idle_in_transaction(dsn: str, pids: Iterable[int]) -> list[int]:
    """Pids among ``pids`` whose session sits idle inside a transaction."""
    return sorted(
        pid
        for pid, state in (await sessions(dsn, pids)).items()
        if state.startswith("idle in transaction")
    )


async def locks_held(dsn: str, pids: Iterable[int]) -> list[tuple[int, str, str]]:
    """``(pid, locktype, relation)`` of every granted lock of ``pids``, except own vxids."""
    rows = await _fetch(
        dsn,
        "SELECT pid, locktype, coalesce(relation::regclass::text, '') AS rel FROM pg_locks"
        " WHERE pid = ANY($1) AND granted AND locktype <> 'virtualxid'",
        list(pids),
    )
    return [(r["pid"], r["locktype"], r["rel"]) for r in rows]


async def terminate(dsn: str, pids: Iterable[int]) -> int:
    """``pg_terminate_backend`` each of ``pids``; return how many were ended."""
    rows = await _fetch(
        dsn,
        "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) AS n"
        " FROM pg_stat_activity WHERE pid = ANY($1) AND pid <> pg_backend_pid()",
        list(pids),
    )
    return int(rows[0]["n"])


async def wait_for_clean(dsn: str, pids: Iterable[int], timeout: float = 3.0) -> None:
    """Wait until none of ``pids`` holds a lock or idles in a transaction.

    Raises:
        AssertionError: still unclean after ``timeout`` seconds (with what was found).
    """
    wanted = list(pids)
    deadline = time.monotonic() + timeout
    while True:
        locks = await locks_held(dsn, wanted)
        idle = await idle_in_transaction(dsn, wanted)
        if not locks and not idle:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"still held after {timeout} s: locks={locks} idle={idle}")
        await asyncio.sleep(0.05)
