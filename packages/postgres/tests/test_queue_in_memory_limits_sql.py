"""The in-memory queue's claim takes what the PostgreSQL claim takes under pauses and limits.

Pauses, concurrency limits and rate limits (of queues, task names and limit keys) are
judged by the claim function in SQL; the in-memory queue follows it in Python. The same
work, settings and claims, run on both, must take the same tasks round after round
(finishing some in between), and say alike whether a limit held work back and when a rate
window frees a start.

The SQL claim reads the server's clock, so rate windows here are an hour long: every claim
of a run falls inside the first one's window whatever the timing. Where a window's boundary
lies (a start exactly a period old no longer counts) is checked on the in-memory side alone
in test_queue_in_memory.py.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from queue_support import QueueFixture
from steeple.postgres._arrays import array_literal
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
    {"queue": None, "queue_rate": 4, "tasks": {}},
    {"queue": None, "tasks": {}, "task_rates": {"a": 2, "b": 1}},
    {"queue": 2, "queue_rate": 5, "tasks": {"c": 1}, "task_rates": {"a": 1}},
    {"queue": None, "queue_rate": 3, "tasks": {"b": 1}, "task_rates": {"b": 2}},
    {"queue": None, "queue_rate": 2, "tasks": {}, "pause_first": True},
    # Per-key limits: the tasks carry KEYS.
    {"queue": None, "tasks": {}, "key_running": 1},
    {"queue": 2, "tasks": {"b": 1}, "key_running": 2, "key_rate": 2},
    {"queue": None, "tasks": {}, "task_key_running": {"a": 1, "c": 1}},
    {"queue": None, "tasks": {}, "key_rate": 1, "task_key_running": {"b": 1}},
]
# The limit key of each task of WORK, when a setting limits keys.
KEYS = ["k1", "k2", "k1", "k1", "k1", "k2", None, "k1", "k2"]
# Long enough that every claim of a run is inside the window of the first start.
PER = timedelta(hours=1)


@pytest.mark.parametrize("settings", SETTINGS)
async def test_claims_match_the_sql_claim(queue: QueueFixture, settings: dict[str, Any]) -> None:
    _dsn, schema, conn = queue
    sql = queue_sql(schema)
    memory = InMemoryQueue(App(schema=schema))
    db_ids: list[int] = []
    memory_ids: list[int] = []
    keyed = any(k in settings for k in ("key_running", "key_rate", "task_key_running"))
    for (name, priority), key in zip(WORK, KEYS, strict=True):
        options = EnqueueOptions(priority=priority, limit_key=key if keyed else None)
        db_ids.append((await enqueue(conn, Task(name), {}, options, schema=schema)).id)
        memory_ids.append((await enqueue(memory, Task(name), {}, options, schema=schema)).id)

    rate = settings.get("queue_rate")
    per = None if rate is None else PER
    key_rate = settings.get("key_rate")
    per_key: dict[str, Any] = {
        "max_running_per_key": settings.get("key_running"),
        "rate_limit_per_key": key_rate,
        "per_key": None if key_rate is None else PER,
    }
    if settings["queue"] is not None or rate is not None or keyed:
        running = settings["queue"]
        await limit_queue(
            conn, "default", max_running=running, rate_limit=rate, per=per, schema=schema, **per_key
        )
        memory.limit_queue("default", max_running=running, rate_limit=rate, per=per, **per_key)
    task_rates: dict[str, int] = settings.get("task_rates", {})
    task_keys: dict[str, int] = settings.get("task_key_running", {})
    for name in sorted({*settings["tasks"], *task_rates, *task_keys}):
        most = settings["tasks"].get(name)
        rate = task_rates.get(name)
        per = None if rate is None else PER
        by_key = task_keys.get(name)
        await limit_task(
            conn,
            name,
            max_running=most,
            rate_limit=rate,
            per=per,
            max_running_per_key=by_key,
            schema=schema,
        )
        memory.limit_task(
            name, max_running=most, rate_limit=rate, per=per, max_running_per_key=by_key
        )
    if settings.get("pause_first"):
        await pause_queue(conn, "default", schema=schema)
        memory.pause_queue("default")

    db_starts: set[Any] = set()
    memory_starts: set[Any] = set()
    rounds_held_by_a_window = 0
    for round_number in range(6):
        all_rows = await conn.fetch(
            f"SELECT * FROM {schema}.claim(ARRAY['default'], ARRAY[3], $1::text[], 'w', 4e9)",
            NAMES,
        )
        rows = [r for r in all_rows if r["id"] is not None]
        held_rows = [r for r in all_rows if r["id"] is None]
        db_claimed = {db_ids.index(r["id"]): r["lease_token"] for r in rows}
        db_starts |= {r["started_at"] for r in rows}
        claims = memory.claim(3, queues=["default"], names=NAMES)
        memory_claimed = {memory_ids.index(c.task_id): c.token for c in claims}
        memory_starts |= {memory.run_state(c.task_id).started_at for c in claims}
        assert sorted(db_claimed) == sorted(memory_claimed), f"round {round_number}"
        # A rate limit that held work back says when a start frees: on both sides, a
        # period after a start this run made (the oldest in the window that binds).
        db_frees = held_rows[0]["run_at"] if held_rows else None
        memory_frees = memory.rate_frees_at
        assert (db_frees is None) == (memory_frees is None), f"round {round_number}"
        if db_frees is not None:
            assert db_frees - PER in db_starts
            assert memory_frees is not None
            assert memory_frees - PER in memory_starts
            rounds_held_by_a_window += 1
        # Virtual time moves on a little each round, as the server's clock does.
        memory.clock.advance(timedelta(seconds=1))
        if round_number == 0 and settings.get("pause_first"):
            assert db_claimed == {}
            await resume_queue(conn, "default", schema=schema)
            memory.resume_queue("default")
        # Finish the earliest-enqueued running task on both sides, then claim again.
        for index in sorted(db_claimed)[:1]:
            token = db_claimed[index]
            await conn.fetch(
                sql.complete,
                array_literal([db_ids[index]]),
                array_literal([token]),
                "w",
                [None],
                [None],
            )
            assert memory.complete(memory_ids[index], memory_claimed[index])
    # Every setting with a rate limit runs into it within the six rounds.
    assert (rounds_held_by_a_window > 0) == bool(
        settings.get("queue_rate") or task_rates or key_rate
    )
