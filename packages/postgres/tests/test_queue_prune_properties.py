"""prune_terminal against a model: random tasks of every age and state, random batches.

Each example puts tasks in a real database (pending, running or ended, each created and,
if ended, finished some whole minutes ago), then prunes with a random age and batch limit
until a batch comes back short. Every batch must remove exactly the oldest-finished of the
ended tasks older than the age, no more than the limit; the last leaves every live task and
every younger ended one, each with its attempt history. The age is whole minutes plus 30 s,
so no finish time lies near the cutoff while the server's clock runs on.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import asyncpg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from queue_support import QueueFixture
from steeple.postgres.queue import Task, enqueue_many, prune_terminal

pytestmark = pytest.mark.postgres

PLAIN: Task[Any] = Task("plain")
ENDED = ("succeeded", "failed", "cancelled")

# (state, minutes ago it was created, minutes it ran before it ended); ends are distinct
# so "oldest finished first" names one set.
TASKS = st.lists(
    st.tuples(
        st.sampled_from(("pending", "running", *ENDED)),
        st.integers(0, 300),
        st.integers(0, 60),
    ),
    min_size=1,
    max_size=12,
    unique_by=lambda t: t[1] - min(t[1], t[2]) if t[0] in ENDED else object(),
)


async def _picture(
    conn: asyncpg.Connection, schema: str, tasks: list[tuple[str, int, int]]
) -> list[int]:
    s = f'"{schema}"'
    await conn.execute(f"DELETE FROM {s}.attempts; DELETE FROM {s}.tasks")
    ids = await enqueue_many(conn, PLAIN, [0] * len(tasks), schema=schema)
    async with conn.transaction():
        for task_id, (state, created, ran) in zip(ids, tasks, strict=True):
            ended = state in ENDED
            await conn.execute(
                f"UPDATE {s}.tasks SET state = $2, created_at = now() - make_interval(mins => $3),"
                " finished_at = CASE WHEN $5 THEN now() - make_interval(mins => $3 - $4) END,"
                " lease_token = CASE WHEN $2 = 'running' THEN gen_random_uuid() END,"
                " lease_expires_at = CASE WHEN $2 = 'running' THEN now() + interval '1 hour' END,"
                " attempts = CASE WHEN $2 = 'pending' THEN 0 ELSE 1 END WHERE id = $1",
                task_id,
                state,
                created,
                min(ran, created),
                ended,
            )
            if state != "pending":
                await conn.execute(
                    f"INSERT INTO {s}.attempts (task_id, attempt, outcome) VALUES ($1, 1, $2)",
                    task_id,
                    "failed" if state in ("running", "cancelled") else state,
                )
    return ids


async def _prune_and_compare(
    conn: asyncpg.Connection, schema: str, tasks: list[tuple[str, int, int]], age: int, limit: int
) -> None:
    s = f'"{schema}"'
    ids = await _picture(conn, schema, tasks)
    # minutes since each ended task finished; eligible: ended more than age minutes + 30 s ago
    ended_ago = {
        i: created - min(ran, created)
        for i, (state, created, ran) in zip(ids, tasks, strict=True)
        if state in ENDED
    }
    eligible = sorted((i for i, ago in ended_ago.items() if ago > age), key=lambda i: -ended_ago[i])
    left = set(ids)
    while True:
        removed = await prune_terminal(
            conn, timedelta(minutes=age, seconds=30), limit, schema=schema
        )
        expected, eligible = eligible[:limit], eligible[limit:]
        assert removed == len(expected)
        now_left = {r[0] for r in await conn.fetch(f"SELECT id FROM {s}.tasks")}
        assert left - now_left == set(expected)  # the oldest-finished, at most the limit
        left = now_left
        if removed < limit:
            break
    assert not eligible
    kept = {i for i, (state, _c, _r) in zip(ids, tasks, strict=True) if state not in ENDED}
    kept |= {i for i, ago in ended_ago.items() if ago <= age}
    assert left == kept
    history = {r[0] for r in await conn.fetch(f"SELECT task_id FROM {s}.attempts")}
    assert history == {
        i for i, t in zip(ids, tasks, strict=True) if i in kept and t[0] != "pending"
    }


async def test_prune_removes_the_oldest_ended_tasks_past_the_age_in_batches_of_the_limit(
    queue: QueueFixture,
) -> None:
    dsn, schema, _conn = queue

    @settings(
        max_examples=60,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(tasks=TASKS, age=st.integers(0, 240), limit=st.integers(1, 5))
    def check(tasks: list[tuple[str, int, int]], age: int, limit: int) -> None:
        async def one() -> None:
            conn = await asyncpg.connect(dsn)
            try:
                await _prune_and_compare(conn, schema, tasks, age, limit)
            finally:
                await conn.close()

        asyncio.run(one())

    await asyncio.to_thread(check)
