"""Plain helpers shared by the queue tests (their pytest fixtures live in ``conftest.py``).

The cross-package fault tests in the top-level ``tests/`` import this module too.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import datetime
from pathlib import Path
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


class PinnedClock:
    """A connection whose server clock reads an instant the test sets, to the microsecond.

    The queue's statements judge leases and rate windows on ``clock_timestamp()``, the
    server's live clock, so no test on the real clock can put a lease expiry or a start
    exactly on the boundary. Here the schema gets a function ``clock_timestamp()`` that
    reads a one-row table, and this connection's ``search_path`` puts the schema before
    ``pg_catalog``: every unqualified ``clock_timestamp()`` the queue's SQL (and its claim
    function) calls on this connection reads the pinned instant. Everything lives in the
    test's schema and goes with it.
    """

    def __init__(self, conn: asyncpg.Connection, schema: str) -> None:
        self.conn = conn
        self.schema = schema

    async def set(self, at: datetime) -> None:
        """From now on, ``clock_timestamp()`` on this connection reads ``at``."""
        await self.conn.execute(f'UPDATE "{self.schema}".pinned_clock SET at = $1', at)


@contextlib.asynccontextmanager
async def pinned_clock(dsn: str, schema: str, at: datetime) -> AsyncIterator[PinnedClock]:
    """A fresh connection to the queue in ``schema`` whose server clock reads ``at``."""
    conn = await asyncpg.connect(dsn, timeout=_CONNECT_TIMEOUT)
    try:
        await conn.execute(
            f"""CREATE TABLE "{schema}".pinned_clock (at timestamptz NOT NULL);
            CREATE FUNCTION "{schema}".clock_timestamp() RETURNS timestamptz
                LANGUAGE sql VOLATILE AS $$ SELECT at FROM "{schema}".pinned_clock $$;"""
        )
        await conn.execute(f'INSERT INTO "{schema}".pinned_clock (at) VALUES ($1)', at)
        await conn.execute(f'SET search_path = "{schema}", pg_catalog')
        assert await conn.fetchval("SELECT clock_timestamp()") == at, "the clock is not pinned"
        yield PinnedClock(conn, schema)
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


async def task_outcomes(dsn: str, schema: str) -> dict[int, int]:
    """Every task id of the queue in ``schema`` -> how many of its attempts succeeded."""
    conn = await asyncpg.connect(dsn, timeout=10)
    try:
        rows = await conn.fetch(
            f"SELECT t.id, count(a.*) FILTER (WHERE a.outcome = 'succeeded') AS ok"
            f' FROM "{schema}".tasks t LEFT JOIN "{schema}".attempts a ON a.task_id = t.id'
            " GROUP BY t.id"
        )
    finally:
        await conn.close()
    return {r["id"]: r["ok"] for r in rows}


async def finished_once(dsn: str, schema: str, ids: list[int], timeout: float = 60.0) -> None:
    """Wait until every task of ``ids`` (and no other) has succeeded, then check that each
    succeeded exactly once (the completion writes of a worker may lag its handlers).

    Raises:
        AssertionError: a task missing, unknown, not finished in time, or finished twice.
    """

    async def all_finished() -> bool:
        outcomes = await task_outcomes(dsn, schema)
        return set(outcomes) == set(ids) and all(n >= 1 for n in outcomes.values())

    await wait_until(all_finished, timeout=timeout, interval=0.1)
    outcomes = await task_outcomes(dsn, schema)
    assert set(outcomes.values()) == {1}, outcomes


async def check_total_queue(conn: asyncpg.Connection, schema: str) -> dict[str, int]:
    """The queue checker (in the manner of Jepsen's total-queue checker), once the work is
    done, over the tasks, their attempt history and an ``executions`` log the handlers
    wrote (``task_id, run_id, attempt, worker_id``, one row per execution):

    - every task reached ``succeeded``, and its history holds exactly one success;
    - every task executed at least once, always under the task's own ``run_id``;
    - no (task, attempt) executed twice: a claim is never handed to two workers;
    - the success was recorded by the worker that executed that very attempt, the last
      one (nothing fenced out finalized anything);
    - no queue connection is left ``idle in transaction``.

    Returns the number of tasks and of executions.
    """
    s = f'"{schema}"'
    rows = await conn.fetch(f"SELECT state, count(*) FROM {s}.tasks GROUP BY state")
    states = {row["state"]: row["count"] for row in rows}
    total = sum(states.values())
    assert states == {"succeeded": total}, states

    successes = await conn.fetch(
        f"SELECT task_id, count(*) AS n FROM {s}.attempts WHERE outcome = 'succeeded' "
        "GROUP BY task_id"
    )
    assert len(successes) == total, (len(successes), total)
    assert all(r["n"] == 1 for r in successes), "a task succeeded more than once"

    never_ran = await conn.fetchval(
        f"SELECT count(*) FROM {s}.tasks t WHERE NOT EXISTS "
        f"(SELECT 1 FROM {s}.executions e WHERE e.task_id = t.id)"
    )
    assert never_ran == 0, f"{never_ran} tasks succeeded without executing"

    foreign = await conn.fetchval(
        f"SELECT count(*) FROM {s}.executions e JOIN {s}.tasks t ON t.id = e.task_id "
        "WHERE e.run_id <> t.run_id"
    )
    assert foreign == 0, "an attempt ran under another run_id"

    doubled = await conn.fetch(
        f"SELECT task_id, attempt, count(*) FROM {s}.executions "
        "GROUP BY task_id, attempt HAVING count(*) > 1"
    )
    assert doubled == [], f"attempts executed twice: {doubled[:5]}"

    # The success belongs to the last attempt, recorded by the worker that executed it.
    wrong_finisher = await conn.fetchval(
        f"""SELECT count(*) FROM {s}.tasks t
        JOIN {s}.attempts a ON a.task_id = t.id AND a.outcome = 'succeeded'
        WHERE a.attempt <> t.attempts OR NOT EXISTS (
            SELECT 1 FROM {s}.executions e
            WHERE e.task_id = t.id AND e.attempt = a.attempt AND e.worker_id = a.worker_id)"""
    )
    assert wrong_finisher == 0, "a success was recorded by a fenced or foreign attempt"

    # Killed workers' sessions end with their sockets; nothing may sit in a transaction.
    idle_in_tx = await conn.fetchval(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
        "AND state LIKE 'idle in transaction%' "
        "AND (application_name LIKE 'steeple-queue%' OR query LIKE $1)",
        f"%{s}%",
    )
    assert idle_in_tx == 0, "a queue session was left idle in transaction"
    return {
        "tasks": total,
        "executions": int(await conn.fetchval(f"SELECT count(*) FROM {s}.executions")),
    }


@contextlib.asynccontextmanager
async def worker_processes(
    script: Path, count: int, dsn: str, schema: str, queues: str
) -> AsyncIterator[list[asyncio.subprocess.Process]]:
    """Run ``count`` copies of the worker ``script`` (args: DSN, schema, worker id, queues).

    Each must print ``ready`` once it claims; all get SIGTERM at the end (SIGKILL after 30 s).
    """
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            str(script),
            dsn,
            schema,
            f"w{i}",
            queues,
            stdout=asyncio.subprocess.PIPE,
        )
        for i in range(count)
    ]
    try:
        for proc in procs:
            assert proc.stdout is not None
            line = await asyncio.wait_for(proc.stdout.readline(), 60)
            assert line.strip() == b"ready", line
        yield procs
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                await asyncio.wait_for(proc.wait(), 30)
            except TimeoutError:
                proc.kill()
                await proc.wait()


async def all_succeeded(conn: asyncpg.Connection, schema: str, total: int) -> bool:
    """Whether ``total`` tasks of the schema have succeeded."""
    done = await conn.fetchval(f"SELECT count(*) FROM \"{schema}\".tasks WHERE state = 'succeeded'")
    return bool(done == total)


def most_at_once(intervals: list[tuple[datetime, datetime]]) -> int:
    """The largest number of intervals open at one instant (an end before a start on ties)."""
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    most = now = 0
    for _, step in events:
        now += step
        most = max(most, now)
    return most
