"""The claim reads the tasks table through its indexes only, never a scan of every row.

Measured inside the claim's own transaction (``pg_stat_xact_user_tables``), on a table the
planner has no statistics for and that is small enough that a whole-table scan looked
cheaper than one primary-key probe per claimed id: without the claim function's planner
setting, each claim read every task, finished ones and dead row versions included.
"""

from __future__ import annotations

from typing import Any

import asyncpg
import pytest

from steeple.postgres.queue import Task, enqueue_many, install, limit_queue, limit_task
from steeple.postgres.queue._sql import queue_sql

pytestmark = pytest.mark.postgres

NAME = "plan"
BACKLOG = 5000
CLAIM = 200


async def _claim_scans(conn: Any, schema: str) -> tuple[int, int, int]:
    """Claim once; (rows claimed, seq scans, index scans) of ``tasks`` by that claim."""
    # The backend's counts not yet reported (earlier statements' too): read before and
    # after, in one transaction, so nothing is reported in between.
    counts = (
        "SELECT seq_scan, coalesce(idx_scan, 0) FROM pg_stat_xact_user_tables"
        " WHERE relid = $1::regclass"
    )
    table = f'"{schema}".tasks'
    async with conn.transaction():
        seq0, idx0 = await conn.fetchrow(counts, table)
        rows = await conn.fetch(queue_sql(schema).claim, [NAME], CLAIM, "w", 2e9)  # far ahead
        seq1, idx1 = await conn.fetchrow(counts, table)
    return len(rows), seq1 - seq0, idx1 - idx0


@pytest.mark.parametrize("limits", ["none", "queue", "task name"])
async def test_a_claim_reads_tasks_by_index_only(pg_schema: tuple[str, str], limits: str) -> None:
    dsn, schema = pg_schema
    conn = await asyncpg.connect(dsn)
    try:
        await install(conn, schema=schema)
        await enqueue_many(conn, Task(NAME), [{"i": i} for i in range(BACKLOG)], schema=schema)
        # The fast path (no settings row) and both paths that count what runs under a lock.
        if limits == "queue":
            await limit_queue(conn, "default", max_running=10 * CLAIM, schema=schema)
        elif limits == "task name":
            await limit_task(conn, NAME, max_running=10 * CLAIM, schema=schema)
        for _ in range(3):  # claimed tasks stay behind as running row versions
            claimed, seq, idx = await _claim_scans(conn, schema)
            assert claimed == CLAIM
            assert seq == 0, f"the claim scanned the whole tasks table {seq} time(s)"
            assert idx > 0
    finally:
        await conn.close()
