"""Producing work with each driver, in the caller's transaction, against a real PostgreSQL."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import attrs
import psycopg
import pytest

from queue_support import QueueFixture
from steeple.core.backoff import Backoff
from steeple.postgres.queue import (
    ArgsEncodingError,
    EnqueueOptions,
    QueueConfigurationError,
    Task,
    UnsupportedConnectionError,
    enqueue,
    enqueue_many,
    enqueue_many_sync,
    enqueue_sync,
    run_state,
)
from steeple.postgres.queue._enqueue import random_run_ids


@attrs.frozen
class Email:
    user_id: int
    subject: str


@dataclasses.dataclass(frozen=True)
class Report:
    name: str
    pages: int = 1


SEND = Task("send-email", Email)
REPORT = Task("report", Report)
PLAIN: Task[Any] = Task("plain")


async def _count(conn: asyncpg.Connection, schema: str) -> int:
    return int(await conn.fetchval(f'SELECT count(*) FROM "{schema}".tasks'))


async def test_asyncpg_enqueue_commits_and_rolls_back_with_the_transaction(
    queue: QueueFixture,
) -> None:
    dsn, schema, check = queue
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(f'CREATE TABLE "{schema}".app (v int)')
        async with conn.transaction():
            await conn.execute(f'INSERT INTO "{schema}".app VALUES (1)')
            committed = await enqueue(conn, SEND, Email(1, "hi"), schema=schema)
        tx = conn.transaction()
        await tx.start()
        await conn.execute(f'INSERT INTO "{schema}".app VALUES (2)')
        await enqueue(conn, SEND, Email(2, "no"), schema=schema)
        await tx.rollback()  # the application failed
        assert await _count(check, schema) == 1
        assert await check.fetchval(f'SELECT array_agg(v) FROM "{schema}".app') == [1]
        state = await run_state(check, committed.id, schema=schema)
        assert state.state.value == "pending"
        assert state.task_name == "send-email"
        args = await check.fetchval(
            f'SELECT args FROM "{schema}".tasks WHERE id = $1', committed.id
        )
        assert SEND.decode(args) == Email(1, "hi")
    finally:
        await conn.close()


async def test_psycopg_async_enqueue_commits_and_rolls_back(queue: QueueFixture) -> None:
    dsn, schema, check = queue
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        await conn.execute(f'CREATE TABLE "{schema}".app (v int)')
        await conn.commit()
        await conn.execute(f'INSERT INTO "{schema}".app VALUES (1)')
        done = await enqueue(conn, REPORT, Report("q1", 3), schema=schema)
        await conn.commit()
        await conn.execute(f'INSERT INTO "{schema}".app VALUES (2)')
        await enqueue(conn, REPORT, Report("q2"), schema=schema)
        await enqueue_many(conn, REPORT, [Report("a"), Report("b")], schema=schema)
        await conn.rollback()
    assert await _count(check, schema) == 1
    assert await check.fetchval(f'SELECT array_agg(v) FROM "{schema}".app') == [1]
    args = await check.fetchval(f'SELECT args FROM "{schema}".tasks WHERE id = $1', done.id)
    assert REPORT.decode(args) == Report("q1", 3)


async def test_psycopg_sync_enqueue_commits_and_rolls_back(queue: QueueFixture) -> None:
    dsn, schema, check = queue

    def produce() -> int:
        with psycopg.connect(dsn) as conn:
            conn.execute(f'CREATE TABLE "{schema}".app (v int)')
            conn.commit()
            conn.execute(f'INSERT INTO "{schema}".app VALUES (1)')
            kept = enqueue_sync(conn, PLAIN, {"k": [1, 2]}, schema=schema)
            many = enqueue_many_sync(conn, PLAIN, [1, 2, 3], schema=schema)
            assert len(many) == 3
            conn.commit()
            conn.execute(f'INSERT INTO "{schema}".app VALUES (2)')
            enqueue_sync(conn, PLAIN, {"k": "lost"}, schema=schema)
            enqueue_many_sync(conn, PLAIN, [4, 5], schema=schema)
            conn.rollback()
            return kept.id

    kept_id = await asyncio.to_thread(produce)
    assert await _count(check, schema) == 4
    assert await check.fetchval(f'SELECT array_agg(v) FROM "{schema}".app') == [1]
    args = await check.fetchval(f'SELECT args FROM "{schema}".tasks WHERE id = $1', kept_id)
    assert PLAIN.decode(args) == {"k": [1, 2]}


async def test_sync_and_async_functions_refuse_the_other_kind(queue: QueueFixture) -> None:
    dsn, schema, conn = queue
    with pytest.raises(UnsupportedConnectionError):
        await enqueue(object(), PLAIN, 1, schema=schema)
    with pytest.raises(UnsupportedConnectionError):
        enqueue_sync(conn, PLAIN, 1, schema=schema)
    with psycopg.connect(dsn) as sync_conn, pytest.raises(UnsupportedConnectionError):
        await enqueue(sync_conn, PLAIN, 1, schema=schema)
    assert await _count(conn, schema) == 0


async def test_options_are_snapshotted_onto_the_task(queue: QueueFixture) -> None:
    _dsn, schema, conn = queue
    when = datetime.now(UTC) + timedelta(hours=1)
    options = EnqueueOptions.at(
        when,
        priority=7,
        lease_duration=timedelta(seconds=5),
        max_attempts=9,
        backoff=Backoff(initial=timedelta(seconds=2), maximum=timedelta(seconds=40), factor=3),
    )
    done = await enqueue(conn, PLAIN, "x", options, schema=schema)
    row = await conn.fetchrow(f'SELECT * FROM "{schema}".tasks WHERE id = $1', done.id)
    assert row is not None
    assert row["run_at"] == when
    assert row["priority"] == 7
    assert row["lease_duration"] == timedelta(seconds=5)
    assert row["max_attempts"] == 9
    assert (row["backoff_initial_us"], row["backoff_maximum_us"], row["backoff_factor"]) == (
        2_000_000,
        40_000_000,
        3,
    )
    assert row["state"] == "pending"
    assert row["attempts"] == 0
    assert row["run_id"] is not None


async def test_dedup_returns_the_live_task_and_allows_a_new_one_after_it_ends(
    queue: QueueFixture,
) -> None:
    _dsn, schema, conn = queue
    options = EnqueueOptions.immediate(dedup_key="user-1")
    first = await enqueue(conn, PLAIN, 1, options, schema=schema)
    second = await enqueue(conn, PLAIN, 2, options, schema=schema)
    assert not first.deduplicated
    assert second.deduplicated
    assert second.id == first.id
    # another task name with the same key is independent
    other = await enqueue(conn, REPORT, Report("r"), options, schema=schema)
    assert not other.deduplicated
    assert other.id != first.id
    # once the first is terminal, the key is free again
    await conn.execute(
        f"UPDATE \"{schema}\".tasks SET state = 'succeeded', finished_at = now() WHERE id = $1",
        first.id,
    )
    third = await enqueue(conn, PLAIN, 3, options, schema=schema)
    assert not third.deduplicated
    assert third.id != first.id
    # a duplicate now names the live holder of the key, never the finished task before it
    fourth = await enqueue(conn, PLAIN, 4, options, schema=schema)
    assert fourth.deduplicated
    assert fourth.id == third.id
    assert await _count(conn, schema) == 3


async def test_concurrent_duplicate_enqueues_create_one_task(queue: QueueFixture) -> None:
    dsn, schema, check = queue
    conns = [await asyncpg.connect(dsn) for _ in range(5)]
    try:
        options = EnqueueOptions.immediate(dedup_key="same")
        results = await asyncio.gather(
            *(enqueue(c, PLAIN, 1, options, schema=schema) for c in conns)
        )
        assert len({r.id for r in results}) == 1
        assert sum(not r.deduplicated for r in results) == 1
        assert await _count(check, schema) == 1
    finally:
        for c in conns:
            await c.close()


async def test_enqueue_many_is_one_statement_in_order_and_atomic(queue: QueueFixture) -> None:
    _dsn, schema, conn = queue
    ids = await enqueue_many(conn, PLAIN, [{"n": i} for i in range(500)], schema=schema)
    assert len(ids) == 500
    assert ids == sorted(ids)
    rows = await conn.fetch(f'SELECT id, args FROM "{schema}".tasks ORDER BY id')
    assert [PLAIN.decode(r["args"])["n"] for r in rows] == list(range(500))
    assert [r["id"] for r in rows] == ids
    assert await enqueue_many(conn, PLAIN, [], schema=schema) == []
    # one bad args value: nothing inserted
    with pytest.raises(ArgsEncodingError):
        await enqueue_many(conn, PLAIN, [1, math.nan], schema=schema)
    with pytest.raises(QueueConfigurationError):
        await enqueue_many(conn, PLAIN, [1], EnqueueOptions(dedup_key="k"), schema=schema)
    assert await _count(conn, schema) == 500


async def test_enqueue_many_stores_each_args_as_enqueue_would(queue: QueueFixture) -> None:
    """A batch is checked and sent as one JSON array; what each task stores is unchanged.

    Whether the batch passes as one value or each args is checked alone (here: two args
    under the size limit of one args, together over it), every task holds its own args.
    """
    _dsn, schema, conn = queue
    big = "x" * 600_000  # under the 1 MiB limit of one args; two of them are over it
    for batch in (
        [{"s": "é\n\"'"}, [1, 2.5, None, True], 1e20, "text", {"f": 1e-7}],
        [{"s": big}, {"s": big}, {"f": 1e20}, [0.1]],
    ):
        ids = await enqueue_many(conn, PLAIN, batch, schema=schema)
        stored = await conn.fetch(
            f'SELECT args::text FROM "{schema}".tasks WHERE id = ANY($1::bigint[]) ORDER BY id',
            ids,
        )
        assert [PLAIN.decode(r[0]) for r in stored] == batch
        singles = [(await enqueue(conn, PLAIN, args, schema=schema)).id for args in batch]
        alone = await conn.fetch(
            f'SELECT args::text FROM "{schema}".tasks WHERE id = ANY($1::bigint[]) ORDER BY id',
            singles,
        )
        assert [r[0] for r in alone] == [r[0] for r in stored]


# Every column a task's options or args decide (not its id, run id or creation instant).
_DECIDED = (
    "task_name, args::text, state, priority, run_at, attempts, max_attempts, lease_duration, "
    "backoff_initial_us, backoff_maximum_us, backoff_factor, backoff_jitter, dedup_key, "
    "job_id, scheduled_for, lease_token, lease_expires_at, worker_id, started_at, "
    "finished_at, last_error, trace_context, queue, result, progress, waiting_on, "
    "workflow_id, on_parent_failure, limit_key"
)


def _version_4(run_id: uuid.UUID) -> bool:
    return run_id.version == 4 and run_id.variant == uuid.RFC_4122


async def test_enqueue_many_rows_equal_enqueue_rows_each_with_its_own_run_id(
    queue: QueueFixture,
) -> None:
    """A batch's rows hold what ``enqueue`` stores for the same args and options, by every
    driver; each task gets its own random version-4 run id (the idempotency key of its
    side effects), never one shared with another task."""
    dsn, schema, conn = queue
    options = EnqueueOptions(
        priority=3,
        run_at=datetime(2031, 5, 6, 7, 8, 9, tzinfo=UTC),
        max_attempts=7,
        lease_duration=timedelta(seconds=45),
        backoff=Backoff(timedelta(seconds=2), timedelta(seconds=90), factor=3, jitter=0.25),
        queue="bulk",
        limit_key="tenant-9",
    )
    batch = [{"n": i, "s": "é"} for i in range(300)]
    ids = await enqueue_many(conn, PLAIN, batch, options, schema=schema)
    with psycopg.connect(dsn, autocommit=True) as sync_conn:
        ids += enqueue_many_sync(sync_conn, PLAIN, batch, options, schema=schema)
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as async_conn:
        ids += await enqueue_many(async_conn, PLAIN, batch, options, schema=schema)
    single = [(await enqueue(conn, PLAIN, args, options, schema=schema)).id for args in batch]
    query = f'SELECT {_DECIDED} FROM "{schema}".tasks WHERE id = ANY($1::bigint[]) ORDER BY id'
    alone = [tuple(r) for r in await conn.fetch(query, single)]
    for start in range(0, len(ids), len(batch)):
        rows = await conn.fetch(query, ids[start : start + len(batch)])
        assert [tuple(r) for r in rows] == alone
    run_ids = [r[0] for r in await conn.fetch(f'SELECT run_id FROM "{schema}".tasks')]
    assert len(run_ids) == 4 * len(batch)
    assert len(set(run_ids)) == len(run_ids)
    assert all(_version_4(r) for r in run_ids)


def test_a_batchs_run_ids_are_random_version_4_uuids() -> None:
    for count in (0, 1, 2, 1000):
        raw = random_run_ids(count)
        assert len(raw) == 16 * count
        ids = [uuid.UUID(bytes=raw[i : i + 16]) for i in range(0, len(raw), 16)]
        assert all(_version_4(r) for r in ids)
        assert len(set(ids)) == count
    assert random_run_ids(4) != random_run_ids(4)


async def test_enqueue_sends_a_notification_on_commit_only(queue: QueueFixture) -> None:
    dsn, schema, conn = queue
    listener = await asyncpg.connect(dsn)
    got: asyncio.Queue[str] = asyncio.Queue()
    try:
        from steeple.postgres.queue._schema import notify_channel

        await listener.add_listener(notify_channel(schema), lambda *a: got.put_nowait(a[3]))
        tx = conn.transaction()
        await tx.start()
        await enqueue(conn, PLAIN, 1, schema=schema)
        await asyncio.sleep(0.2)
        assert got.empty()
        await tx.rollback()
        await asyncio.sleep(0.2)
        assert got.empty()
        await enqueue(conn, PLAIN, 2, schema=schema)
        assert await asyncio.wait_for(got.get(), 5) == ""  # due now
        due = datetime.now(UTC) + timedelta(minutes=5)
        await enqueue(conn, PLAIN, 3, EnqueueOptions.at(due), schema=schema)
        assert float(await asyncio.wait_for(got.get(), 5)) == pytest.approx(due.timestamp())
        await enqueue_many(conn, PLAIN, [4, 5], EnqueueOptions.at(due), schema=schema)
        assert float(await asyncio.wait_for(got.get(), 5)) == pytest.approx(due.timestamp())
        await asyncio.sleep(0.2)
        assert got.empty()  # one notification per statement
    finally:
        await listener.close()


@pytest.mark.parametrize(
    ("task", "args"),
    [
        (SEND, Report("wrong type")),
        (SEND, {"user_id": 1, "subject": "dict is not Email"}),
        (PLAIN, {"when": datetime.now(UTC)}),
        (PLAIN, {"x": math.inf}),
        (PLAIN, {1, 2}),
        (PLAIN, "nul\x00byte"),
        (PLAIN, "x" * (1024 * 1024 + 1)),
        (Task("dates", Email), Email(1, datetime.now(UTC))),  # type: ignore[arg-type]
    ],
)
async def test_unencodable_args_are_refused_and_nothing_is_stored(
    queue: QueueFixture, task: Task[Any], args: object
) -> None:
    _dsn, schema, conn = queue
    with pytest.raises(ArgsEncodingError) as err:
        await enqueue(conn, task, args, schema=schema)
    assert isinstance(err.value, ValueError)
    assert await _count(conn, schema) == 0


def test_decoding_errors_are_typed() -> None:
    with pytest.raises(ArgsEncodingError, match="not JSON"):
        PLAIN.decode("{nope")
    with pytest.raises(ArgsEncodingError, match="not an object"):
        SEND.decode("[1]")
    with pytest.raises(ArgsEncodingError, match="do not fit"):
        SEND.decode('{"user_id": 1}')
    with pytest.raises(ArgsEncodingError, match="do not fit"):
        REPORT.decode('{"name": "x", "extra": 1}')
    assert SEND.decode(SEND.encode(Email(3, "é"))) == Email(3, "é")
    assert REPORT.decode(REPORT.encode(Report("r", 2))) == Report("r", 2)


def test_task_and_option_validation() -> None:
    with pytest.raises(QueueConfigurationError):
        Task("")
    with pytest.raises(QueueConfigurationError):
        Task("x" * 201)
    with pytest.raises(QueueConfigurationError):
        Task("bad\nname")
    with pytest.raises(QueueConfigurationError):
        Task("x", int)
    with pytest.raises(QueueConfigurationError, match="timezone-aware"):
        EnqueueOptions.at(datetime(2030, 1, 1))
    with pytest.raises(QueueConfigurationError):
        EnqueueOptions.at(None)  # type: ignore[arg-type]
    with pytest.raises(QueueConfigurationError):
        EnqueueOptions(priority=2**40)
    with pytest.raises(QueueConfigurationError):
        EnqueueOptions(priority=True)
    with pytest.raises(QueueConfigurationError):
        EnqueueOptions(lease_duration=timedelta(0))
    with pytest.raises(QueueConfigurationError):
        EnqueueOptions(max_attempts=0)
    with pytest.raises(QueueConfigurationError):
        EnqueueOptions(backoff="fast")  # type: ignore[arg-type]
    with pytest.raises(QueueConfigurationError):
        EnqueueOptions(dedup_key="")
    options = EnqueueOptions.immediate(priority=3)
    assert options.run_at is None
    assert options.priority == 3
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        options.priority = 4  # type: ignore[misc]


async def test_invalid_schema_is_refused_before_any_sql(queue: QueueFixture) -> None:
    _dsn, _schema, conn = queue
    with pytest.raises(QueueConfigurationError):
        await enqueue(conn, PLAIN, 1, schema="bad-schema")


async def test_due_times_are_set_on_the_servers_clock(queue: QueueFixture) -> None:
    """Immediate work is due exactly when created (run_at = created_at: the claim keeps it
    due across a step back of the server's clock); after(delay) counts from that instant;
    at(when) is the instant given."""
    _dsn, schema, conn = queue
    task: Task[Any] = Task("timed")
    when = datetime(2031, 5, 6, 7, 8, 9, tzinfo=UTC)
    delay = timedelta(minutes=7, microseconds=3)
    ids = [
        (await enqueue(conn, task, {}, schema=schema)).id,
        (await enqueue(conn, task, {}, EnqueueOptions.after(delay), schema=schema)).id,
        (await enqueue(conn, task, {}, EnqueueOptions.at(when), schema=schema)).id,
        *await enqueue_many(conn, task, [1, 2], EnqueueOptions.after(delay), schema=schema),
        *await enqueue_many(conn, task, [3], schema=schema),
    ]
    rows = {
        r["id"]: r["run_at"] - r["created_at"]
        for r in await conn.fetch(f'SELECT id, run_at, created_at FROM "{schema}".tasks')
    }
    assert [rows[i] for i in ids[:2]] == [timedelta(0), delay]
    assert [rows[i] for i in ids[3:]] == [delay, delay, timedelta(0)]
    assert (await run_state(conn, ids[2], schema=schema)).run_at == when
    with pytest.raises(QueueConfigurationError, match="not both"):
        EnqueueOptions(run_at=when, delay=delay)
