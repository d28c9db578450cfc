"""Named queues: enqueue into a queue, workers serving some queues, limits in one worker,
pause and resume, the queue of recurring jobs, hostile names, and the upgrade from 0005."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import pytest

from queue_support import QueueFixture, pinned_clock, wait_until
from steeple.postgres.queue import (
    LIBRARY_SCHEMA_VERSION,
    App,
    EnqueueOptions,
    JobContext,
    QueueConfigurationError,
    QueueTypeError,
    Scheduler,
    Task,
    _schema,
    admin,
    enqueue,
    enqueue_many,
    enqueue_many_sync,
    enqueue_sync,
    install,
    jobs,
    limit_queue,
    limit_task,
    list_queues,
    pause_queue,
    resume_queue,
    run_state,
)

JOB: Task[Any] = Task("named-job")

# Every way a queue name can be wrong: (value, error type, what the message names).
HOSTILE_QUEUES: list[tuple[object, type[Exception], str]] = [
    ("", QueueConfigurationError, "1..200"),
    ("x" * 10_240, QueueConfigurationError, "1..200"),
    ("a\x00b", QueueConfigurationError, "control character"),
    ("a\ud800b", QueueConfigurationError, "lone surrogate"),
    ("line\nbreak", QueueConfigurationError, "control character"),
    (42, QueueTypeError, "must be a str"),
    (b"bytes", QueueTypeError, "must be a str"),
    # Names that look like another name, or like none: refused by the library's one name
    # rule (steeple.core.names), as schedule names are.
    ("mail\u200b", QueueConfigurationError, "format character.*U\\+200B at position 4"),
    ("\u202eliame-dnes", QueueConfigurationError, "format character.*U\\+202E"),
    ("\ufeffmail", QueueConfigurationError, "format character.*U\\+FEFF"),
    (" mail", QueueConfigurationError, "start or end with whitespace"),
    ("mail ", QueueConfigurationError, "start or end with whitespace"),
    ("   ", QueueConfigurationError, "empty or blank"),
    ("mail\u2028", QueueConfigurationError, "line separator"),
    ("mail\u2029box", QueueConfigurationError, "paragraph separator"),
    ("\u3164", QueueConfigurationError, "invisible filler"),
]
NAME_RULE_BREAKERS = [value for value, _, _ in HOSTILE_QUEUES[7:]]
"""The values only the name rule refuses (each a str a driver would store)."""


async def _call(call: Callable[[], Any]) -> None:
    made = call()
    if isinstance(made, Awaitable):
        await made


async def _count(conn: asyncpg.Connection, schema: str) -> int:
    return int(await conn.fetchval(f'SELECT count(*) FROM "{schema}".tasks'))


async def _states(conn: asyncpg.Connection, schema: str) -> dict[int, str]:
    rows = await conn.fetch(f'SELECT id, state FROM "{schema}".tasks')
    return {r["id"]: r["state"] for r in rows}


def _worker(dsn: str, schema: str, **kw: Any) -> Scheduler:
    kw.setdefault("poll_interval", 0.05)
    kw.setdefault("maintenance_interval", 0.2)
    return Scheduler(dsn, worker_id=kw.pop("worker_id", "w"), schema=schema, **kw)


async def _running(worker: Scheduler, body: Callable[[], Awaitable[None]]) -> None:
    stop = asyncio.Event()
    run = asyncio.create_task(worker.run_until_shutdown(stop, drain_timeout=5))
    try:
        await wait_until(lambda: worker.stats.claim_rounds > 0 or run.done())
        if run.done():
            run.result()
        await body()
    finally:
        stop.set()
        await run


async def test_enqueue_stores_the_queue_and_run_state_reports_it(queue: QueueFixture) -> None:
    _dsn, schema, conn = queue
    plain = await enqueue(conn, JOB, {}, schema=schema)
    by_option = await enqueue(conn, JOB, {}, EnqueueOptions(queue="mail"), schema=schema)
    by_keyword = await enqueue(
        conn, JOB, {}, EnqueueOptions(queue="mail"), schema=schema, queue="reports"
    )
    many = await enqueue_many(conn, JOB, [{}, {}], schema=schema, queue="bulk")
    assert (await run_state(conn, plain.id, schema=schema)).queue == "default"
    assert (await run_state(conn, by_option.id, schema=schema)).queue == "mail"
    assert (await run_state(conn, by_keyword.id, schema=schema)).queue == "reports"
    assert {(await run_state(conn, i, schema=schema)).queue for i in many} == {"bulk"}
    listed = {
        q.name: (q.pending, q.running, q.paused) for q in await list_queues(conn, schema=schema)
    }
    assert listed == {
        "bulk": (2, 0, False),
        "default": (1, 0, False),
        "mail": (1, 0, False),
        "reports": (1, 0, False),
    }


@pytest.mark.parametrize(("bad", "error", "words"), HOSTILE_QUEUES)
async def test_hostile_queue_names_are_refused_everywhere_and_nothing_is_stored(
    queue: QueueFixture, bad: object, error: type[Exception], words: str
) -> None:
    dsn, schema, conn = queue
    calls: list[Callable[[], Any]] = [
        lambda: EnqueueOptions(queue=bad),  # type: ignore[arg-type]
        lambda: EnqueueOptions.immediate(queue=bad),
        lambda: enqueue(conn, JOB, {}, schema=schema, queue=bad),  # type: ignore[arg-type]
        lambda: enqueue_many(conn, JOB, [{}], schema=schema, queue=bad),  # type: ignore[arg-type]
        lambda: enqueue_sync(conn, JOB, {}, schema=schema, queue=bad),  # type: ignore[arg-type]
        lambda: enqueue_many_sync(conn, JOB, [{}], schema=schema, queue=bad),  # type: ignore[arg-type]
        lambda: jobs.create(conn, "j", JOB, "* * * * *", {}, schema=schema, queue=bad),  # type: ignore[arg-type]
        lambda: pause_queue(conn, bad, schema=schema),  # type: ignore[arg-type]
        lambda: resume_queue(conn, bad, schema=schema),  # type: ignore[arg-type]
        lambda: limit_queue(conn, bad, max_running=1, schema=schema),  # type: ignore[arg-type]
        lambda: limit_task(conn, bad, max_running=1, schema=schema),  # type: ignore[arg-type]
        lambda: Scheduler(dsn, worker_id="w", schema=schema, queues=[bad]),  # type: ignore[list-item]
        lambda: Scheduler(dsn, worker_id="w", schema=schema, queues={bad: 1}),  # type: ignore[dict-item]
        lambda: admin.list_tasks(conn, schema=schema, queue=bad),  # type: ignore[arg-type]
    ]
    for call in calls:
        with pytest.raises(error, match=words):
            await _call(call)
    assert await _count(conn, schema) == 0
    assert await conn.fetchval(f'SELECT count(*) FROM "{schema}".settings') == 0
    assert await conn.fetchval(f'SELECT count(*) FROM "{schema}".jobs') == 0


@pytest.mark.parametrize("bad", NAME_RULE_BREAKERS)
async def test_task_job_and_worker_names_follow_the_one_name_rule(
    queue: QueueFixture, bad: str
) -> None:
    """Task, job and worker names are refused as queue names are; nothing is stored."""
    dsn, schema, conn = queue
    await enqueue(conn, JOB, {}, schema=schema)  # a task a filter could wrongly select
    calls: list[Callable[[], Any]] = [
        lambda: Task(bad),
        lambda: jobs.create(conn, bad, JOB, "* * * * *", {}, schema=schema),
        lambda: jobs.ensure_job(conn, bad, JOB, "* * * * *", {}, schema=schema),
        lambda: jobs.pause(conn, bad, schema=schema),
        lambda: jobs.resume(conn, bad, schema=schema),
        lambda: jobs.delete(conn, bad, schema=schema),
        lambda: jobs.get(conn, bad, schema=schema),
        lambda: limit_task(conn, bad, max_running=1, schema=schema),
        lambda: admin.list_tasks(conn, schema=schema, task_name=bad),
        lambda: admin.list_jobs(conn, schema=schema, after=bad),
        lambda: Scheduler(dsn, worker_id=bad, schema=schema),
    ]
    for call in calls:
        with pytest.raises(QueueConfigurationError) as caught:
            await _call(call)
        assert "\n" not in str(caught.value)
    assert await _count(conn, schema) == 1
    assert await conn.fetchval(f'SELECT count(*) FROM "{schema}".settings') == 0
    assert await conn.fetchval(f'SELECT count(*) FROM "{schema}".jobs') == 0


@pytest.mark.parametrize(
    ("queues", "error", "words"),
    [
        ("default", QueueTypeError, "list of queue names"),
        (None, QueueTypeError, "list of queue names"),
        ([], QueueConfigurationError, "1..100 queues"),
        ([f"q{i}" for i in range(101)], QueueConfigurationError, "1..100 queues"),
        (["a", "a"], QueueConfigurationError, "listed twice"),
        ({"a": 0}, QueueConfigurationError, "concurrency of queue 'a'"),
        ({"a": True}, QueueTypeError, "concurrency of queue 'a'"),
        ({"a": 1.5}, QueueTypeError, "concurrency of queue 'a'"),
        ({"a": 2**70}, QueueConfigurationError, "concurrency of queue 'a'"),
    ],
)
def test_scheduler_refuses_bad_queue_lists(
    queues: object, error: type[Exception], words: str
) -> None:
    with pytest.raises(error, match=words):
        Scheduler("postgresql://u@localhost/db", worker_id="w", queues=queues)  # type: ignore[arg-type]


def test_scheduler_reports_its_queues_capped_by_its_concurrency() -> None:
    worker = Scheduler(
        "postgresql://u@localhost/db", worker_id="w", concurrency=4, queues={"a": 9, "b": 2}
    )
    assert worker.queues == {"a": 4, "b": 2}
    assert Scheduler("postgresql://u@localhost/db", worker_id="w").queues == {"default": 16}


async def test_a_worker_serves_only_its_queues_each_within_its_own_limit(
    queue: QueueFixture,
) -> None:
    dsn, schema, conn = queue
    release = asyncio.Event()
    running: dict[str, int] = {"a": 0, "b": 0}
    most: dict[str, int] = {"a": 0, "b": 0}

    async def handler(ctx: JobContext, args: Any) -> None:
        running[ctx.queue] += 1
        most[ctx.queue] = max(most[ctx.queue], running[ctx.queue])
        try:
            await release.wait()
        finally:
            running[ctx.queue] -= 1

    a = await enqueue_many(conn, JOB, [{}] * 6, schema=schema, queue="a")
    b = await enqueue_many(conn, JOB, [{}] * 6, schema=schema, queue="b")
    elsewhere = await enqueue(conn, JOB, {}, schema=schema, queue="not-served")
    worker = _worker(dsn, schema, concurrency=10, queues={"a": 2, "b": 3})
    worker.register(JOB, handler)

    async def body() -> None:
        await wait_until(lambda: running == {"a": 2, "b": 3})
        # Both queues are at their limits in this worker: it claims nothing more (it waits
        # for a slot of its own) although it has 5 free slots and work is due.
        assert worker.stats.claimed == 5
        release.set()
        await wait_until(lambda: worker.stats.succeeded == 12)

    await _running(worker, body)
    assert most == {"a": 2, "b": 3}
    states = await _states(conn, schema)
    assert {states[i] for i in a + b} == {"succeeded"}
    assert states[elsewhere.id] == "pending"  # a queue nobody serves waits


async def test_pause_holds_new_claims_running_tasks_finish_and_resume_wakes_workers(
    queue: QueueFixture,
) -> None:
    dsn, schema, conn = queue
    release = asyncio.Event()
    started: list[int] = []

    async def handler(ctx: JobContext, args: Any) -> None:
        started.append(ctx.task_id)
        if args.get("hold"):
            await release.wait()

    held = await enqueue(conn, JOB, {"hold": True}, schema=schema, queue="p")
    worker = _worker(dsn, schema, queues=["p", "q"], poll_interval=0.05)
    worker.register(JOB, handler)

    async def body() -> None:
        await wait_until(lambda: started == [held.id])
        paused = await pause_queue(conn, "p", schema=schema)
        assert (paused.paused, paused.running) == (True, 1)
        assert (await pause_queue(conn, "p", schema=schema)).paused  # idempotent
        waiting = await enqueue(conn, JOB, {}, schema=schema, queue="p")
        other = await enqueue(conn, JOB, {}, schema=schema, queue="q")
        # Another queue of the same worker is not paused.
        await wait_until(lambda: other.id in started)
        rounds = worker.stats.claim_rounds
        await wait_until(lambda: worker.stats.claim_rounds >= rounds + 3)
        assert waiting.id not in started
        # The running task finishes while its queue is paused.
        release.set()
        await wait_until(lambda: _state_is(conn, schema, held.id, "succeeded"), timeout=10)
        rounds = worker.stats.claim_rounds
        await wait_until(lambda: worker.stats.claim_rounds >= rounds + 3)
        assert waiting.id not in started
        assert (await run_state(conn, waiting.id, schema=schema)).state.value == "pending"
        resumed = await resume_queue(conn, "p", schema=schema)
        assert resumed.paused is False
        await wait_until(lambda: waiting.id in started)

    await _running(worker, body)
    # Nothing left: the resumed queue's row was deleted (the claim's fast path again).
    assert await conn.fetchval(f'SELECT count(*) FROM "{schema}".settings') == 0


async def _state_is(conn: asyncpg.Connection, schema: str, task_id: int, state: str) -> bool:
    return (await run_state(conn, task_id, schema=schema)).state.value == state


async def test_pause_survives_a_new_worker(queue: QueueFixture) -> None:
    dsn, schema, conn = queue
    await pause_queue(conn, "default", schema=schema)
    task = await enqueue(conn, JOB, {}, schema=schema)
    ran: list[int] = []

    async def handler(ctx: JobContext, args: Any) -> None:
        ran.append(ctx.task_id)

    worker = _worker(dsn, schema)
    worker.register(JOB, handler)

    async def body() -> None:
        await wait_until(lambda: worker.stats.claim_rounds >= 3)
        assert ran == []
        (info,) = await admin.list_queues(conn, schema=schema)
        assert (info.name, info.paused, info.pending) == ("default", True, 1)
        await admin.resume_queue(conn, "default", schema=schema)
        await wait_until(lambda: ran == [task.id])

    await _running(worker, body)


async def test_global_limit_in_one_process_across_two_workers(queue: QueueFixture) -> None:
    dsn, schema, conn = queue
    release = asyncio.Event()
    running = 0
    most = 0

    async def handler(ctx: JobContext, args: Any) -> None:
        nonlocal running, most
        running += 1
        most = max(most, running)
        try:
            await release.wait()
        finally:
            running -= 1

    info = await limit_queue(conn, "default", max_running=3, schema=schema)
    assert (info.max_running, info.rate_limit, info.rate_period) == (3, None, None)
    ids = await enqueue_many(conn, JOB, [{}] * 10, schema=schema)
    one, two = _worker(dsn, schema, worker_id="one"), _worker(dsn, schema, worker_id="two")
    one.register(JOB, handler)
    two.register(JOB, handler)

    async def body() -> None:
        await wait_until(lambda: running == 3)
        rounds = one.stats.claim_rounds + two.stats.claim_rounds
        await wait_until(lambda: one.stats.claim_rounds + two.stats.claim_rounds >= rounds + 4)
        assert running == 3
        assert (await list_queues(conn, schema=schema))[0].running == 3
        release.set()
        await wait_until(lambda: one.stats.succeeded + two.stats.succeeded == 10)

    await _running(two, lambda: _running(one, body))
    assert most == 3
    assert set((await _states(conn, schema)).values()) == {"succeeded"}
    assert {i for i in (await _states(conn, schema))} == set(ids)
    # Removing every limit deletes the row.
    await limit_queue(conn, "default", schema=schema)
    assert await conn.fetchval(f'SELECT count(*) FROM "{schema}".settings') == 0


async def test_a_task_name_limit_spans_queues(queue: QueueFixture) -> None:
    dsn, schema, conn = queue
    release = asyncio.Event()
    names: dict[str, int] = {"named-job": 0, "free": 0}
    free: Task[Any] = Task("free")

    async def handler(ctx: JobContext, args: Any) -> None:
        names[ctx.task_name] += 1
        await release.wait()

    limits = await limit_task(conn, "named-job", max_running=2, schema=schema)
    assert (limits.task_name, limits.max_running) == ("named-job", 2)
    assert await admin.list_task_limits(conn, schema=schema) == [limits]
    await enqueue_many(conn, JOB, [{}] * 3, schema=schema, queue="x")
    await enqueue_many(conn, JOB, [{}] * 3, schema=schema, queue="y")
    await enqueue_many(conn, free, [{}] * 3, schema=schema, queue="y")
    worker = _worker(dsn, schema, queues=["x", "y"], concurrency=20)
    worker.register(JOB, handler)
    worker.register(free, handler)

    async def body() -> None:
        await wait_until(lambda: names == {"named-job": 2, "free": 3})
        rounds = worker.stats.claim_rounds
        await wait_until(lambda: worker.stats.claim_rounds >= rounds + 3)
        assert names == {"named-job": 2, "free": 3}
        release.set()
        await wait_until(lambda: worker.stats.succeeded == 9)

    await _running(worker, body)


@pytest.mark.parametrize(
    ("kw", "error", "words"),
    [
        ({"max_running": 0}, QueueConfigurationError, "max_running"),
        ({"max_running": 2**63}, QueueConfigurationError, "max_running"),
        ({"max_running": "5"}, QueueTypeError, "max_running"),
        ({"rate_limit": 5}, QueueConfigurationError, "together"),
        ({"per": 1.0}, QueueConfigurationError, "together"),
        ({"rate_limit": 0, "per": 1.0}, QueueConfigurationError, "rate_limit"),
        ({"rate_limit": 10_001, "per": 1.0}, QueueConfigurationError, "rate_limit"),
        ({"rate_limit": 5, "per": float("nan")}, QueueConfigurationError, "per"),
        ({"rate_limit": 5, "per": -1}, QueueConfigurationError, "per"),
        ({"rate_limit": 5, "per": timedelta(days=2)}, QueueConfigurationError, "per"),
        ({"rate_limit": 5, "per": "1s"}, QueueTypeError, "per"),
    ],
)
async def test_bad_limits_are_refused_and_nothing_is_stored(
    queue: QueueFixture, kw: dict[str, Any], error: type[Exception], words: str
) -> None:
    _dsn, schema, conn = queue
    with pytest.raises(error, match=words):
        await limit_queue(conn, "q", schema=schema, **kw)
    with pytest.raises(error, match=words):
        await limit_task(conn, "t", schema=schema, **kw)
    assert await conn.fetchval(f'SELECT count(*) FROM "{schema}".settings') == 0


class _Later:
    """A clock reading one minute after ``start``."""

    def __init__(self, start: datetime | None) -> None:
        assert start is not None
        self._at = start + timedelta(minutes=1)

    def now(self) -> datetime:
        return self._at


async def test_recurring_jobs_enqueue_into_their_queue(queue: QueueFixture) -> None:
    _dsn, schema, conn = queue
    made = await jobs.create(
        conn, "every-minute", JOB, "* * * * *", {}, schema=schema, queue="cron"
    )
    assert made.queue == "cron"
    plain = await jobs.create(
        conn, "plain", JOB, "* * * * *", {}, EnqueueOptions(queue="opts"), schema=schema
    )
    assert plain.queue == "opts"
    assert await jobs.materialize_due(conn, schema=schema, clock=_Later(made.next_run_at)) == 2
    queues = {r[0] for r in await conn.fetch(f'SELECT queue FROM "{schema}".tasks')}
    assert queues == {"cron", "opts"}
    again = await jobs.ensure_job(conn, "plain", JOB, "* * * * *", {}, schema=schema, queue="moved")
    assert again.queue == "moved"


async def test_an_app_task_gives_its_queue_to_its_jobs_and_enqueues(queue: QueueFixture) -> None:
    dsn, schema, conn = queue
    app = App(schema=schema)

    @app.task(name="mail-digest", queue="emails")
    async def digest(ctx: JobContext, args: Any) -> None:
        return None

    made = await jobs.create(conn, "digest", digest, "* * * * *", {}, schema=schema)
    assert made.queue == "emails"  # the queue app.scheduler() serves for it
    assert made.task_name == "mail-digest"
    ensured = await jobs.ensure_job(conn, "digest2", digest, "* * * * *", {}, schema=schema)
    assert ensured.queue == "emails"
    # Named elsewhere explicitly, it goes there.
    named = await jobs.create(conn, "d3", digest, "* * * * *", {}, schema=schema, queue="bulk")
    assert named.queue == "bulk"
    opts = EnqueueOptions(queue="opts")
    chosen = await jobs.create(conn, "d4", digest, "* * * * *", {}, opts, schema=schema)
    assert chosen.queue == "opts"
    # The explicit enqueue functions take the decorated function too.
    single = await enqueue(conn, digest, {}, schema=schema)
    assert (await run_state(conn, single.id, schema=schema)).queue == "emails"
    (many,) = await enqueue_many(conn, digest, [{}], schema=schema)
    assert (await run_state(conn, many, schema=schema)).queue == "emails"
    worker = _worker(dsn, schema, queues=["emails"])
    worker.register(digest, digest.handler)
    not_a_task: Any = digest.handler
    with pytest.raises(QueueTypeError, match=r"@app\.task function"):
        await jobs.create(conn, "bad", not_a_task, "* * * * *", {}, schema=schema)


async def test_a_version_5_schema_upgrades_and_its_tasks_join_the_default_queue(
    pg_schema: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    dsn, schema = pg_schema
    conn = await asyncpg.connect(dsn)
    try:
        with monkeypatch.context() as patched:
            patched.setattr(_schema, "_MIGRATIONS", _schema._MIGRATIONS[:3])
            patched.setattr(_schema, "LIBRARY_SCHEMA_VERSION", 5)
            assert await _schema.install(conn, schema=schema) == 5
        assert await _schema.schema_version(conn, schema) == 5
        # Work written by a version-5 library: a pending task and a recurring job.
        pending = await conn.fetchval(
            f"""INSERT INTO "{schema}".tasks (task_name, args, max_attempts, lease_duration,
                backoff_initial_us, backoff_maximum_us, backoff_factor, backoff_jitter)
            VALUES ('named-job', '{{}}', 3, interval '60 s', 1000000, 60000000, 2, 0.1)
            RETURNING id"""
        )
        await conn.execute(
            f"""INSERT INTO "{schema}".jobs (name, task_name, cron, args, priority,
                max_attempts, lease_duration, backoff_initial_us, backoff_maximum_us,
                backoff_factor, backoff_jitter, cursor_at, next_run_at)
            VALUES ('old', 'named-job', '* * * * *', '{{}}', 0, 3, interval '60 s', 1000000,
                    60000000, 2, 0.1, clock_timestamp(), clock_timestamp())"""
        )
        # Migrates to 6, and the versions after it.
        assert await install(conn, schema=schema) == LIBRARY_SCHEMA_VERSION
        assert (await run_state(conn, pending, schema=schema)).queue == "default"
        assert (await jobs.get(conn, "old", schema=schema)).queue == "default"
        sql = __import__("steeple.postgres.queue._sql", fromlist=["queue_sql"]).queue_sql(schema)
        give_up = await conn.fetchval("SELECT extract(epoch FROM clock_timestamp()) + 60")
        (claimed,) = await conn.fetch(sql.claim, ["named-job"], 5, "w", give_up)
        assert claimed["id"] == pending
        # The new constraints hold for new rows.
        with pytest.raises(asyncpg.CheckViolationError):
            await conn.execute(f"UPDATE \"{schema}\".tasks SET queue = ''")
    finally:
        await conn.close()


async def test_a_claim_held_by_a_rate_limit_says_when_the_window_frees_a_start(
    queue: QueueFixture,
) -> None:
    _dsn, schema, conn = queue
    from steeple.postgres._arrays import text_array
    from steeple.postgres.queue._sql import queue_sql

    sql = queue_sql(schema)
    await limit_queue(conn, "default", rate_limit=2, per=timedelta(minutes=1), schema=schema)
    await enqueue_many(conn, JOB, [{}] * 3, schema=schema)
    give_up = await conn.fetchval("SELECT extract(epoch FROM clock_timestamp()) + 60")
    rows = await conn.fetch(
        sql.claim_timed,
        ["default"],
        text_array([5]),
        [JOB.name],
        "w",
        give_up,
        [None],
        [None],
        [None],
    )
    claimed = [r for r in rows if r["id"] is not None]
    (held,) = [r for r in rows if r["id"] is None]
    assert len(claimed) == 2
    assert held["held"] is True
    # Both starts share the claim's instant; the first leaves the window one period later.
    assert {r["started_at"] for r in claimed} == {held["run_at"] - timedelta(minutes=1)}
    # A second claim in the window takes nothing and says the same.
    again = await conn.fetch(
        sql.claim_timed,
        ["default"],
        text_array([5]),
        [JOB.name],
        "w",
        give_up,
        [None],
        [None],
        [None],
    )
    assert [(r["id"], r["held"], r["run_at"]) for r in again] == [(None, True, held["run_at"])]
    # Without the limit, the third task is claimed and nothing is held.
    await limit_queue(conn, "default", schema=schema)
    last = await conn.fetch(
        sql.claim_timed,
        ["default"],
        text_array([5]),
        [JOB.name],
        "w",
        give_up,
        [None],
        [None],
        [None],
    )
    assert [(r["held"], r["queue"]) for r in last] == [(False, "default")]


async def _claim_ids(conn: asyncpg.Connection, schema: str, want: int) -> list[int]:
    """The ids one claim of up to ``want`` tasks of ``JOB`` from the default queue takes."""
    from steeple.postgres._arrays import text_array
    from steeple.postgres.queue._sql import queue_sql

    give_up = await conn.fetchval("SELECT extract(epoch FROM clock_timestamp()) + 60")
    rows = await conn.fetch(
        queue_sql(schema).claim_timed,
        ["default"],
        text_array([want]),
        [JOB.name],
        "w",
        give_up,
        [None],
        [None],
        [None],
    )
    return [int(r["id"]) for r in rows if r["id"] is not None]


async def test_a_task_names_rate_limit_allows_exactly_its_starts_per_period(
    queue: QueueFixture,
) -> None:
    _dsn, schema, conn = queue
    await limit_task(conn, JOB.name, rate_limit=2, per=timedelta(minutes=1), schema=schema)
    tasks = await enqueue_many(conn, JOB, [{}] * 5, schema=schema)
    # One claim asking for more than the limit starts exactly the limit, no more.
    assert await _claim_ids(conn, schema, 5) == tasks[:2]
    # The window is full: a later claim inside the period starts nothing.
    assert await _claim_ids(conn, schema, 5) == []


async def test_the_rate_window_counts_every_start_of_the_period_across_claims(
    queue: QueueFixture,
) -> None:
    _dsn, schema, conn = queue
    await limit_queue(conn, "default", rate_limit=2, per=timedelta(minutes=1), schema=schema)
    tasks = await enqueue_many(conn, JOB, [{}] * 4, schema=schema)
    # Two claims, one start each, fill the window between them.
    assert await _claim_ids(conn, schema, 1) == tasks[:1]
    assert await _claim_ids(conn, schema, 1) == tasks[1:2]
    # A third claim in the same period still sees both earlier starts and takes nothing.
    assert await _claim_ids(conn, schema, 5) == []


@pytest.mark.parametrize("scope", ["queue", "task"])
async def test_a_start_exactly_one_period_old_has_left_the_rate_window(
    queue: QueueFixture, scope: str
) -> None:
    dsn, schema, conn = queue
    per = timedelta(minutes=1)
    if scope == "queue":
        await limit_queue(conn, "default", rate_limit=1, per=per, schema=schema)
    else:
        await limit_task(conn, JOB.name, rate_limit=1, per=per, schema=schema)
    tasks = await enqueue_many(conn, JOB, [{}] * 2, schema=schema)
    now = datetime(2031, 3, 4, 5, 6, 7, 123456, tzinfo=UTC)
    # The window holds one start, made one period before the pinned clock, less 1 µs.
    await conn.execute(
        f'UPDATE "{schema}".settings SET recent_starts = ARRAY[$1::timestamptz]',
        now - per + timedelta(microseconds=1),
    )
    async with pinned_clock(dsn, schema, now) as clock:
        # That start is still inside the period: the window is full.
        assert await _claim_ids(clock.conn, schema, 2) == []
        # Exactly one period old, it has left the window: one more start is allowed.
        await conn.execute(
            f'UPDATE "{schema}".settings SET recent_starts = ARRAY[$1::timestamptz]', now - per
        )
        assert await _claim_ids(clock.conn, schema, 2) == tasks[:1]


@pytest.mark.parametrize("limited", [False, True])
async def test_the_claim_walks_the_index_of_its_queue_and_never_scans_the_table(
    queue: QueueFixture, limited: bool
) -> None:
    dsn, schema, conn = queue
    from steeple.postgres._arrays import text_array
    from steeple.postgres.queue._sql import queue_sql

    sql = queue_sql(schema)
    # A big backlog in another queue, a little work in ours (no ANALYZE: stale statistics).
    await enqueue_many(conn, JOB, [{}] * 5000, schema=schema, queue="big")
    mine = await enqueue_many(conn, JOB, [{}] * 3, schema=schema, queue="small")
    if limited:
        await limit_queue(conn, "small", max_running=2, schema=schema)
    # A fresh session: a backend's counters may still hold its earlier transactions' scans.
    fresh = await asyncpg.connect(dsn)
    try:
        give_up = await fresh.fetchval("SELECT extract(epoch FROM clock_timestamp()) + 60")
        async with fresh.transaction():
            rows = await fresh.fetch(
                sql.claim_timed,
                ["small"],
                text_array([10]),
                [JOB.name],
                "w",
                give_up,
                [None],
                [None],
                [None],
            )
            scans = await fresh.fetchrow(
                "SELECT seq_scan, idx_scan, idx_tup_fetch FROM pg_stat_xact_user_tables "
                "WHERE relid = $1::regclass",
                f'"{schema}".tasks',
            )
    finally:
        await fresh.close()
    assert scans is not None
    claimed = [r["id"] for r in rows if r["id"] is not None]
    assert claimed == mine[: 2 if limited else 3]
    assert scans["seq_scan"] == 0, dict(scans)
    assert scans["idx_scan"] >= 1, dict(scans)
    # The queue leads the index: the walk never reads the 5,000 tasks queued before ours.
    assert scans["idx_tup_fetch"] < 50, dict(scans)


async def _due_long_ago(conn: asyncpg.Connection, schema: str, queue: str) -> int:
    """A task that has been due for ten minutes in ``queue`` (as if nobody served it)."""
    return int(
        await conn.fetchval(
            f"""INSERT INTO "{schema}".tasks (task_name, args, max_attempts, lease_duration,
                backoff_initial_us, backoff_maximum_us, backoff_factor, backoff_jitter, queue,
                run_at, created_at)
            VALUES ('named-job', '{{}}', 3, interval '60 s', 1000000, 60000000, 2, 0.1, $1,
                    clock_timestamp() - interval '10 minutes',
                    clock_timestamp() - interval '10 minutes')
            RETURNING id""",
            queue,
        )
    )


async def test_a_queue_whose_due_work_nobody_claims_is_judged_unserved_until_served(
    queue: QueueFixture,
) -> None:
    dsn, schema, conn = queue
    orphan = await _due_long_ago(conn, schema, "orphan")
    await _due_long_ago(conn, schema, "held")
    await pause_queue(conn, "held", schema=schema)
    await enqueue(conn, JOB, {}, schema=schema, queue="fresh")  # due now: not waiting yet
    listed = {q.name: q for q in await list_queues(conn, schema=schema)}
    assert listed["orphan"].unserved
    assert listed["orphan"].due_since is not None
    assert not listed["held"].unserved  # paused on purpose
    assert not listed["fresh"].unserved
    # With more patience than the orphan has waited, no queue is judged unserved.
    later = await list_queues(conn, schema=schema, unserved_after=timedelta(hours=1))
    assert not any(q.unserved for q in later)
    with pytest.raises(QueueConfigurationError, match="unserved_after"):
        await list_queues(conn, schema=schema, unserved_after=timedelta(0))

    done = asyncio.Event()

    async def handler(ctx: JobContext, args: Any) -> None:
        done.set()

    worker = _worker(dsn, schema, queues=["orphan"])
    worker.register(JOB, handler)

    async def served() -> None:
        await wait_until(lambda: done.is_set())

    await _running(worker, served)
    assert (await run_state(conn, orphan, schema=schema)).state.value == "succeeded"
    listed = {q.name: q for q in await list_queues(conn, schema=schema)}
    assert "orphan" not in listed or not listed["orphan"].unserved
