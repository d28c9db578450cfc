"""The pending tasks' page over a backlog: an index walk that stops after the page.

Operators open the pending list when a backlog has built up; its first page (oldest or
newest first) must read a bounded number of buffers however many tasks are pending, and
however many finished tasks lie before and after them in id order, on a bulk-loaded table
the planner has no statistics for.
"""

from __future__ import annotations

import json
from typing import Any

import asyncpg
import pytest

from steeple.postgres.queue import _driver, install
from steeple.postgres.queue.admin import list_tasks

_INSERT = """INSERT INTO {s}.tasks (task_name, args, max_attempts, lease_duration,
    backoff_initial_us, backoff_maximum_us, backoff_factor, backoff_jitter, queue, state,
    attempts, finished_at)
SELECT 'listed', jsonb_build_object('i', i), 3, interval '30 s', 1000, 1000, 2, 0, 'q', $2,
       $3, CASE WHEN $2 = 'pending' THEN NULL ELSE now() END
FROM generate_series(1, $1) AS i"""
_EACH = 40_000
# One page of 50 reads a few hundred buffers at most; the old plan read every pending task
# (or every finished task before them) and sorted: over 1,400 buffers here (115 now).
_MOST_BUFFERS = 400


async def _buffers(conn: asyncpg.Connection, sql: str, args: tuple[Any, ...]) -> int:
    plan = json.loads(await conn.fetchval(f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {sql}", *args))
    top = plan[0]["Plan"]
    return int(top["Shared Hit Blocks"]) + int(top["Shared Read Blocks"])


@pytest.mark.parametrize("newest_first", [False, True])
@pytest.mark.parametrize("filtered", [False, True])
async def test_pending_page_reads_a_bounded_number_of_buffers(
    pg_schema: tuple[str, str], monkeypatch: pytest.MonkeyPatch, newest_first: bool, filtered: bool
) -> None:
    dsn, schema = pg_schema
    s = f'"{schema}"'
    conn = await asyncpg.connect(dsn)
    try:
        await install(conn, schema=schema)
        await conn.execute(f"ALTER TABLE {s}.tasks SET (autovacuum_enabled = false)")
        await conn.execute(_INSERT.format(s=s), _EACH, "succeeded", 1)
        await conn.execute(_INSERT.format(s=s), _EACH, "pending", 0)
        await conn.execute(_INSERT.format(s=s), _EACH, "succeeded", 1)
        seen: list[tuple[str, tuple[Any, ...]]] = []
        fetch = _driver.fetch

        async def recorded(c: Any, sql: str, *args: Any) -> list[tuple[Any, ...]]:
            seen.append((sql, args))
            return await fetch(c, sql, *args)

        monkeypatch.setattr(_driver, "fetch", recorded)
        # Filters every task matches, which the planner guesses to be rare.
        where: dict[str, Any] = {"task_name": "listed", "queue": "q"} if filtered else {}
        page = await list_tasks(
            conn, schema=schema, state="pending", limit=50, newest_first=newest_first, **where
        )
        first = _EACH + 1 if not newest_first else 2 * _EACH
        step = -1 if newest_first else 1
        assert [t.id for t in page.items] == list(range(first, first + 50 * step, step))
        assert page.next_cursor == str(first + 49 * step)
        sql, args = seen[-1]  # the page's statement (after the schema's version check)
        following = await list_tasks(
            conn,
            schema=schema,
            state="pending",
            limit=50,
            newest_first=newest_first,
            after=page.next_cursor,
            **where,
        )
        assert following.items[0].id == first + 50 * step
        monkeypatch.undo()
        assert await _buffers(conn, sql, args) < _MOST_BUFFERS
    finally:
        await conn.close()
