"""Per-key limits in one database: a task's ``limit_key``, a scope's per-key running limit
and per-key start rate, no head-of-line blocking, what the listings show, hostile input."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from queue_support import QueueFixture
from steeple.postgres._arrays import text_array
from steeple.postgres.queue import (
    EnqueueOptions,
    QueueConfigurationError,
    QueueTypeError,
    Task,
    enqueue,
    enqueue_many,
    limit_queue,
    limit_task,
    list_queues,
    run_state,
)
from steeple.postgres.queue._sql import queue_sql
from steeple.postgres.queue.admin import list_task_limits

pytestmark = pytest.mark.postgres

JOB: Task[Any] = Task("keyed-job")
OTHER: Task[Any] = Task("keyed-other")


async def _claim(
    conn: asyncpg.Connection, schema: str, want: int, queue: str = "default"
) -> tuple[list[asyncpg.Record], asyncpg.Record | None]:
    """One claim of up to ``want`` tasks of ``queue``: the tasks it took, its held row."""
    give_up = await conn.fetchval("SELECT extract(epoch FROM clock_timestamp()) + 60")
    rows = await conn.fetch(
        queue_sql(schema).claim_timed,
        [queue],
        text_array([want]),
        [JOB.name, OTHER.name],
        "w",
        give_up,
        [None],
        [None],
        [None],
    )
    return [r for r in rows if r["id"] is not None], next(
        (r for r in rows if r["id"] is None), None
    )


async def _keyed(
    conn: asyncpg.Connection, schema: str, keys: Sequence[str | None], task: Task[Any] = JOB
) -> list[int]:
    ids = []
    for key in keys:
        done = await enqueue(conn, task, {}, EnqueueOptions(limit_key=key), schema=schema)
        ids.append(done.id)
    return ids


async def _succeed(conn: asyncpg.Connection, schema: str, ids: list[int]) -> None:
    await conn.execute(
        f"UPDATE \"{schema}\".tasks SET state = 'succeeded', lease_token = NULL,"
        " finished_at = clock_timestamp() WHERE id = ANY($1::bigint[])",
        ids,
    )


async def test_a_full_key_is_skipped_and_the_claim_takes_other_keys_behind_it(
    queue: QueueFixture,
) -> None:
    _dsn, schema, conn = queue
    info = await limit_queue(conn, "default", max_running_per_key=1, schema=schema)
    assert info.max_running_per_key == 1
    # Key A's three tasks come first in claim order; B and an unkeyed task behind them.
    a1, a2, a3, b1, b2, free = await _keyed(conn, schema, ["A", "A", "A", "B", "B", None])
    taken, held = await _claim(conn, schema, 10)
    assert {r["id"] for r in taken} == {a1, b1, free}
    assert held is not None
    assert held["held"] is True
    assert held["run_at"] is None  # no rate limit: no instant to wake at
    # A and B both run one: a second claim takes nothing, and says a limit held it.
    taken, held = await _claim(conn, schema, 10)
    assert taken == []
    assert held is not None
    # A's task ends: the next of A (and only it) starts; B still runs its first.
    await _succeed(conn, schema, [a1])
    taken, _held = await _claim(conn, schema, 10)
    assert [r["id"] for r in taken] == [a2]
    assert (await run_state(conn, a3, schema=schema)).state.value == "pending"
    assert (await run_state(conn, b2, schema=schema)).state.value == "pending"


async def test_one_claim_counts_what_it_already_took_of_a_key(queue: QueueFixture) -> None:
    _dsn, schema, conn = queue
    await limit_queue(conn, "default", max_running_per_key=2, schema=schema)
    ids = await _keyed(conn, schema, ["A"] * 5 + ["B"] * 3)
    taken, _held = await _claim(conn, schema, 10)
    assert [r["id"] for r in taken] == [*ids[:2], *ids[5:7]]


async def test_a_key_rate_allows_its_starts_per_period_and_says_when_it_frees(
    queue: QueueFixture,
) -> None:
    _dsn, schema, conn = queue
    per = timedelta(minutes=1)
    await limit_queue(conn, "default", rate_limit_per_key=2, per_key=per, schema=schema)
    ids = await _keyed(conn, schema, ["A"] * 4 + ["B"])
    taken, held = await _claim(conn, schema, 10)
    assert [r["id"] for r in taken] == [ids[0], ids[1], ids[4]]
    assert held is not None
    assert held["run_at"] == taken[0]["started_at"] + per
    # Finished or not, starts stay in the window: A starts nothing more this period.
    await _succeed(conn, schema, [r["id"] for r in taken])
    taken, held = await _claim(conn, schema, 10)
    assert taken == []
    assert held is not None
    # Without the per-key rate, A's window is gone and its tasks start.
    await limit_queue(conn, "default", schema=schema)
    assert await conn.fetchval(f'SELECT count(*) FROM "{schema}".key_starts') == 0
    assert await conn.fetchval(f'SELECT count(*) FROM "{schema}".settings') == 0
    taken, held = await _claim(conn, schema, 10)
    assert [r["id"] for r in taken] == ids[2:4]
    assert held is None


async def test_a_task_names_key_limit_counts_its_key_in_every_queue(queue: QueueFixture) -> None:
    _dsn, schema, conn = queue
    limits = await limit_task(conn, JOB.name, max_running_per_key=1, schema=schema)
    assert limits.max_running_per_key == 1
    first = await enqueue(conn, JOB, {}, EnqueueOptions(queue="q1", limit_key="A"), schema=schema)
    await enqueue(conn, JOB, {}, EnqueueOptions(queue="q2", limit_key="A"), schema=schema)
    other = await enqueue(conn, OTHER, {}, EnqueueOptions(queue="q2", limit_key="A"), schema=schema)
    taken, _held = await _claim(conn, schema, 5, "q1")
    assert [r["id"] for r in taken] == [first.id]
    # Key A of JOB runs in q1: q2's JOB of key A waits; another name's key A does not.
    taken, held = await _claim(conn, schema, 5, "q2")
    assert [r["id"] for r in taken] == [other.id]
    assert held is not None


async def test_enqueue_many_carries_the_key(queue: QueueFixture) -> None:
    _dsn, schema, conn = queue
    await limit_queue(conn, "default", max_running_per_key=1, schema=schema)
    ids = await enqueue_many(conn, JOB, [{}] * 3, EnqueueOptions(limit_key="A"), schema=schema)
    keys = await conn.fetch(f'SELECT limit_key FROM "{schema}".tasks ORDER BY id')
    assert [r["limit_key"] for r in keys] == ["A"] * 3
    taken, _held = await _claim(conn, schema, 5)
    assert [r["id"] for r in taken] == ids[:1]


async def test_the_listings_show_the_per_key_settings(queue: QueueFixture) -> None:
    _dsn, schema, conn = queue
    await limit_queue(
        conn,
        "imports",
        max_running=10,
        max_running_per_key=1,
        rate_limit_per_key=10,
        per_key=1.0,
        schema=schema,
    )
    await limit_task(
        conn, JOB.name, rate_limit_per_key=3, per_key=timedelta(minutes=1), schema=schema
    )
    (info,) = await list_queues(conn, schema=schema)
    assert (info.name, info.max_running, info.max_running_per_key) == ("imports", 10, 1)
    assert (info.rate_limit_per_key, info.rate_period_per_key) == (10, timedelta(seconds=1))
    (named,) = await list_task_limits(conn, schema=schema)
    assert (named.rate_limit_per_key, named.rate_period_per_key) == (3, timedelta(minutes=1))
    assert named.max_running_per_key is None


# Every way a limit key can be wrong: (value, error type, what the message names).
HOSTILE_KEYS: list[tuple[object, type[Exception], str]] = [
    ("", QueueConfigurationError, "limit_key must be a str of 1..200"),
    ("k" * 201, QueueConfigurationError, "limit_key must be a str of 1..200"),
    ("k" * 1_000_000, QueueConfigurationError, "limit_key must be a str of 1..200"),
    ("a\x00b", QueueConfigurationError, "limit_key must not contain a control character"),
    ("a\ud800b", QueueConfigurationError, "limit_key must not contain a lone surrogate"),
    (42, QueueTypeError, "limit_key must be a str"),
    (b"customer", QueueTypeError, "limit_key must be a str"),
]


@pytest.mark.parametrize(("key", "error", "words"), HOSTILE_KEYS)
async def test_hostile_limit_keys_are_refused_and_nothing_is_stored(
    queue: QueueFixture, key: object, error: type[Exception], words: str
) -> None:
    _dsn, schema, conn = queue
    with pytest.raises(error, match=words):
        EnqueueOptions(limit_key=key)  # type: ignore[arg-type]
    with pytest.raises(error, match=words):
        EnqueueOptions.immediate(limit_key=key)
    assert await conn.fetchval(f'SELECT count(*) FROM "{schema}".tasks') == 0


@pytest.mark.parametrize(
    ("kw", "error", "words"),
    [
        ({"max_running_per_key": 0}, QueueConfigurationError, "max_running_per_key"),
        ({"max_running_per_key": -1}, QueueConfigurationError, "max_running_per_key"),
        ({"max_running_per_key": 2**63}, QueueConfigurationError, "max_running_per_key"),
        ({"max_running_per_key": 1.5}, QueueTypeError, "max_running_per_key"),
        ({"max_running_per_key": True}, QueueTypeError, "max_running_per_key"),
        ({"rate_limit_per_key": 5}, QueueConfigurationError, "rate_limit_per_key and per_key"),
        ({"per_key": 1.0}, QueueConfigurationError, "rate_limit_per_key and per_key"),
        ({"rate_limit_per_key": 0, "per_key": 1}, QueueConfigurationError, "rate_limit_per_key"),
        ({"rate_limit_per_key": 10_001, "per_key": 1}, QueueConfigurationError, "rate_limit"),
        ({"rate_limit_per_key": 5, "per_key": float("nan")}, QueueConfigurationError, "per_key"),
        ({"rate_limit_per_key": 5, "per_key": float("inf")}, QueueConfigurationError, "per_key"),
        ({"rate_limit_per_key": 5, "per_key": -1}, QueueConfigurationError, "per_key"),
        (
            {"rate_limit_per_key": 5, "per_key": timedelta(days=2)},
            QueueConfigurationError,
            "per_key",
        ),
        ({"rate_limit_per_key": 5, "per_key": "1s"}, QueueTypeError, "per_key"),
    ],
)
async def test_bad_per_key_limits_are_refused_and_nothing_is_stored(
    queue: QueueFixture, kw: dict[str, Any], error: type[Exception], words: str
) -> None:
    _dsn, schema, conn = queue
    with pytest.raises(error, match=words):
        await limit_queue(conn, "q", schema=schema, **kw)
    with pytest.raises(error, match=words):
        await limit_task(conn, "t", schema=schema, **kw)
    assert await conn.fetchval(f'SELECT count(*) FROM "{schema}".settings') == 0


async def test_the_database_refuses_a_key_no_library_would_write(queue: QueueFixture) -> None:
    _dsn, schema, conn = queue
    await _keyed(conn, schema, ["A"])
    with pytest.raises(asyncpg.CheckViolationError):
        await conn.execute(f"UPDATE \"{schema}\".tasks SET limit_key = ''")
    with pytest.raises(asyncpg.CheckViolationError):
        await conn.execute(f'UPDATE "{schema}".tasks SET limit_key = repeat($1, 201)', "k")


RECIPE = Path(__file__).parent / "recipes" / "key_limits.py"


async def test_the_documented_example_runs_and_holds_each_key(queue: QueueFixture) -> None:
    _dsn, schema, conn = queue
    docs = (Path(__file__).parents[3] / "docs" / "queue" / "handlers.md").read_text()
    assert '--8<-- "packages/postgres/tests/recipes/key_limits.py"' in docs
    spec = importlib.util.spec_from_file_location("key_limits_recipe", RECIPE)
    assert spec is not None
    assert spec.loader is not None
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    await recipe.set_up(conn, schema=schema)
    for customer in ("customer-1", "customer-1", "customer-2"):
        await recipe.enqueue_work(conn, customer, schema=schema)
    shown = {q.name: q for q in await list_queues(conn, schema=schema)}
    assert shown["imports"].max_running_per_key == 1
    assert shown["mail"].rate_period_per_key == timedelta(seconds=1)
    give_up = await conn.fetchval("SELECT extract(epoch FROM clock_timestamp()) + 60")
    rows = await conn.fetch(
        queue_sql(schema).claim_timed,
        ["imports", "mail"],
        text_array([10, 10]),
        ["import-file", "send-email"],
        "w",
        give_up,
        [None, None],
        [None, None],
        [None, None],
    )
    started = sorted((r["queue"], r["id"]) for r in rows if r["id"] is not None)
    # One import per customer (customer-1's second waits), every email (rate not reached).
    assert [q for q, _ in started] == ["imports", "imports", "mail", "mail", "mail"]
