"""A claim that reaches the server at or after its sender's give-up time takes nothing.

Random due work, with or without a queue limit (a claim without one takes the function's
short path), and a give-up time drawn around the server's clock, which is pinned
(queue_support.PinnedClock) so "at" and "one microsecond before" are exact: the claim must
start what it asks for exactly when its give-up time is still ahead, and otherwise leave
every task pending with no attempt spent and no start in a rate window.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import queue_support
from queue_support import QueueFixture
from steeple.postgres.queue import Task, enqueue_many
from steeple.postgres.queue._sql import queue_sql

pytestmark = pytest.mark.postgres

LATE: Task[Any] = Task("late")
SERVER_NOW = datetime(2030, 1, 1, tzinfo=UTC)  # after every task's run_at: all are due
# The queue's settings: none (the short path), a running limit, or a rate limit.
LIMITS = st.sampled_from([None, (10, None), (None, 10)])
# The give-up time, in microseconds after the server's clock: at it, just around it, far.
GIVE_UP = st.integers(-2, 2) | st.integers(-(10**7), 10**7)


async def test_a_claim_takes_work_only_before_its_senders_give_up_time(
    queue: QueueFixture,
) -> None:
    dsn, schema, conn = queue
    s = f'"{schema}"'
    sql = queue_sql(schema)
    loop = asyncio.get_running_loop()
    async with queue_support.pinned_clock(dsn, schema, SERVER_NOW) as clock:

        async def one(due: int, want: int, limits: tuple[Any, ...] | None, give_up: int) -> None:
            await conn.execute(
                f"DELETE FROM {s}.attempts; DELETE FROM {s}.tasks; DELETE FROM {s}.settings"
            )
            if limits is not None:
                await conn.execute(
                    f"INSERT INTO {s}.settings (scope, name, max_running, rate_limit, rate_period)"
                    " VALUES ('queue', 'default', $1, $2, $3)",
                    limits[0],
                    limits[1],
                    None if limits[1] is None else timedelta(hours=1),
                )
            await enqueue_many(conn, LATE, [0] * due, schema=schema)
            deadline = SERVER_NOW.timestamp() + give_up / 1_000_000
            rows = await clock.conn.fetch(sql.claim, ["late"], want, "w", deadline)
            expected = min(due, want) if give_up > 0 else 0
            assert len(rows) == expected
            states = await conn.fetch(f"SELECT state, attempts FROM {s}.tasks")
            assert sorted((r[0], r[1]) for r in states) == sorted(
                [("running", 1)] * expected + [("pending", 0)] * (due - expected)
            )
            starts = await conn.fetchval(
                f"SELECT coalesce(sum(cardinality(recent_starts)), 0) FROM {s}.settings"
                " WHERE rate_limit IS NOT NULL"
            )
            assert starts == (expected if limits is not None and limits[1] else 0)

        @settings(
            max_examples=60,
            deadline=None,
            database=None,
            suppress_health_check=[HealthCheck.too_slow],
        )
        @given(due=st.integers(0, 3), want=st.integers(1, 3), limits=LIMITS, give_up=GIVE_UP)
        def check(due: int, want: int, limits: tuple[Any, ...] | None, give_up: int) -> None:
            asyncio.run_coroutine_threadsafe(one(due, want, limits, give_up), loop).result()

        await asyncio.to_thread(check)
