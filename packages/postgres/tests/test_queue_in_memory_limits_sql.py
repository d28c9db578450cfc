"""The in-memory queue's claim takes what the PostgreSQL claim takes under pauses and limits.

Pauses and concurrency limits are judged by the claim function in SQL; the in-memory
queue follows it in Python. The same work, settings and claims, run on both, must take the
same tasks round after round (finishing some in between).
"""

from __future__ import annotations

from typing import Any

import pytest

from queue_support import QueueFixture
from steeple.postgres._arrays import text_array
from steeple.postgres.queue import (
    App,
    EnqueueOptions,
    Task,
    enqueue,
    limit_queue,
    limit_task,
    pause_queue,
    resume_queue,
)
from steeple.postgres.queue._sql import queue_sql
from steeple.postgres.queue.testing import InMemoryQueue

pytestmark = pytest.mark.postgres

NAMES = ["a", "b", "c"]
# (name, priority) of each task, in enqueue order.
WORK = [("a", 0), ("b", 1), ("c", 0), ("a", 2), ("b", 0), ("c", 1), ("a", 0), ("b", 2), ("c", 0)]
SETTINGS: list[dict[str, Any]] = [
    {"queue": 3, "tasks": {}},
    {"queue": None, "tasks": {"a": 1, "b": 2}},
    {"queue": 4, "tasks": {"a": 1}},
    {"queue": 2, "tasks": {"c": 1}, "pause_first": True},
]


@pytest.mark.parametrize("settings", SETTINGS)
async def test_claims_match_the_sql_claim(queue: QueueFixture, settings: dict[str, Any]) -> None:
    _dsn, schema, conn = queue
    sql = queue_sql(schema)
    memory = InMemoryQueue(App(schema=schema))
    db_ids: list[int] = []
    memory_ids: list[int] = []
    for name, priority in WORK:
        options = EnqueueOptions(priority=priority)
        db_ids.append((await enqueue(conn, Task(name), {}, options, schema=schema)).id)
        memory_ids.append((await enqueue(memory, Task(name), {}, options, schema=schema)).id)

    if settings["queue"] is not None:
        await limit_queue(conn, "default", max_running=settings["queue"], schema=schema)
        memory.limit_queue("default", max_running=settings["queue"])
    for name, most in settings["tasks"].items():
        await limit_task(conn, name, max_running=most, schema=schema)
        memory.limit_task(name, max_running=most)
    if settings.get("pause_first"):
        await pause_queue(conn, "default", schema=schema)
        memory.pause_queue("default")

    for round_number in range(6):
        rows = await conn.fetch(sql.claim, NAMES, 3, "w", 4e9)
        db_claimed = {db_ids.index(r["id"]): r["lease_token"] for r in rows}
        claims = memory.claim(3, queues=["default"], names=NAMES)
        memory_claimed = {memory_ids.index(c.task_id): c.token for c in claims}
        assert sorted(db_claimed) == sorted(memory_claimed), f"round {round_number}"
        if round_number == 0 and settings.get("pause_first"):
            assert db_claimed == {}
            await resume_queue(conn, "default", schema=schema)
            memory.resume_queue("default")
        # Finish the earliest-enqueued running task on both sides, then claim again.
        for index in sorted(db_claimed)[:1]:
            token = db_claimed[index]
            await conn.fetch(
                sql.complete, text_array([db_ids[index]]), text_array([token]), "w", [None], [None]
            )
            assert memory.complete(memory_ids[index], memory_claimed[index])
