"""Operator counts over a backlog: never a pass over all tasks, and labelled when bounded.

A queue holding more than ``COUNT_CAP`` pending tasks is reported as holding at least that
many (``pending_capped``) by the listing and by pause, resume and limits; the counts per
state say "at least" before the table has statistics and "about" the estimate after.
"""

from __future__ import annotations

import asyncpg

from steeple.core.tasks import TaskState
from steeple.postgres.queue import (
    install,
    limit_queue,
    list_queues,
    pause_queue,
    resume_queue,
)
from steeple.postgres.queue.admin import COUNT_CAP, BoundedCount, count_by_state_bounded

_INSERT = """INSERT INTO {s}.tasks (task_name, args, max_attempts, lease_duration,
    backoff_initial_us, backoff_maximum_us, backoff_factor, backoff_jitter, queue)
SELECT 'counted', '{{}}'::jsonb, 3, interval '30 s', 1000, 1000, 2, 0, $2
FROM generate_series(1, $1) AS i"""


async def test_counts_stop_at_the_cap_and_say_so(pg_schema: tuple[str, str]) -> None:
    dsn, schema = pg_schema
    s = f'"{schema}"'
    conn = await asyncpg.connect(dsn)
    try:
        await install(conn, schema=schema)
        await conn.execute(f"ALTER TABLE {s}.tasks SET (autovacuum_enabled = false)")
        await conn.execute(_INSERT.format(s=s), COUNT_CAP + 50, "big")
        await conn.execute(_INSERT.format(s=s), 7, "small")
        listed = {q.name: q for q in await list_queues(conn, schema=schema)}
        assert (listed["big"].pending, listed["big"].pending_capped) == (COUNT_CAP, True)
        assert (listed["small"].pending, listed["small"].pending_capped) == (7, False)
        assert listed["big"].due_since is not None
        for change in (
            pause_queue(conn, "big", schema=schema),
            resume_queue(conn, "big", schema=schema),
            limit_queue(conn, "big", max_running=5, schema=schema),
        ):
            info = await change
            assert (info.pending, info.pending_capped) == (COUNT_CAP, True)
        counts = await count_by_state_bounded(conn, schema=schema)
        assert counts[TaskState.PENDING] == BoundedCount(COUNT_CAP, "at_least")
        assert counts[TaskState.RUNNING] == BoundedCount(0)
        assert counts[TaskState.SUCCEEDED] == BoundedCount(0)
        await conn.execute(f"ANALYZE {s}.tasks")
        counts = await count_by_state_bounded(conn, schema=schema)
        assert counts[TaskState.PENDING].bound == "about"
        assert counts[TaskState.PENDING].n >= COUNT_CAP
    finally:
        await conn.close()
