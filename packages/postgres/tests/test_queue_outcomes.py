"""What a run leaves on its task: failures with type and traceback, retry policies,
results and progress -- against a real PostgreSQL, through run_state."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import threading
import urllib.parse
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import asyncpg
import pytest

import queue_support
from queue_support import QueueFixture
from steeple.core.backoff import Backoff
from steeple.postgres.queue import (
    EnqueueOptions,
    Health,
    JobContext,
    JobError,
    Progress,
    QueueConfigurationError,
    QueueTypeError,
    RetryPolicy,
    Scheduler,
    Task,
    enqueue,
    run_state,
)
from steeple.postgres.queue._failures import MAX_TRACEBACK_BYTES, bounded_utf8

wait_until = functools.partial(queue_support.wait_until, timeout=15.0)
NOT_RETRIED = (
    "not retried (plain exceptions are terminal: raise JobError.retry(...) or give the task "
    "a RetryPolicy to retry them)"
)
FAST = RetryPolicy(
    max_attempts=3, base_delay=timedelta(milliseconds=1), max_delay=timedelta(milliseconds=5)
)


@contextlib.asynccontextmanager
async def running(worker: Scheduler, drain_timeout: float = 10.0) -> AsyncIterator[Scheduler]:
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run_until_shutdown(stop, drain_timeout=drain_timeout))
    try:
        await wait_until(lambda: worker.health() is not Health.STARTING or task.done())
        if task.done():
            task.result()
        yield worker
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


def worker_for(dsn: str, schema: str, **kw: Any) -> Scheduler:
    kw.setdefault("poll_interval", 0.05)
    kw.setdefault("maintenance_interval", 0.05)
    return Scheduler(dsn, worker_id="out-w", schema=schema, **kw)


class PaymentDeclinedError(Exception):
    pass


def _charge(amount: int) -> None:
    raise PaymentDeclinedError(f"card declined for {amount}")


# --- failures -------------------------------------------------------------------------------


async def test_a_failure_records_type_message_and_traceback_and_logs_them(
    queue: QueueFixture, caplog: pytest.LogCaptureFixture
) -> None:
    dsn, schema, conn = queue
    task: Task[Any] = Task("charge")

    async def handle(ctx: JobContext, args: Any) -> None:
        try:
            _charge(args["amount"])
        except PaymentDeclinedError as exc:
            raise RuntimeError("charging failed") from exc

    done = await enqueue(conn, task, {"amount": 12, "card": "4111-secret"}, schema=schema)
    worker = worker_for(dsn, schema)
    worker.register(task, handle)
    with caplog.at_level(logging.WARNING, logger="steeple.postgres.queue"):
        async with running(worker):
            await wait_until(lambda: worker.stats.failed == 1)
    run = await run_state(conn, done.id, schema=schema)
    assert run.state.value == "failed"
    assert run.last_error == f"{NOT_RETRIED}: RuntimeError: charging failed"
    (attempt,) = run.history
    assert (attempt.attempt, attempt.outcome, attempt.worker_id) == (1, "failed", "out-w")
    assert attempt.error == f"{NOT_RETRIED}: RuntimeError: charging failed"
    assert attempt.error_type == "RuntimeError"  # builtins are not module-qualified
    assert attempt.traceback is not None
    # The chain is kept: the cause's type (module-qualified in the traceback), its frame.
    assert "PaymentDeclinedError: card declined for 12" in attempt.traceback
    assert "in _charge" in attempt.traceback
    assert attempt.traceback.rstrip().endswith("RuntimeError: charging failed")
    assert "4111-secret" not in attempt.traceback  # the args are never recorded
    (record,) = [r for r in caplog.records if "charge" in r.getMessage()]
    assert record.levelno == logging.ERROR
    message = record.getMessage()
    for part in (str(done.id), "charge", "attempt 1,", str(run.run_id), "failed: not retried"):
        assert part in message
    assert "1/5" not in message  # no promise of retries that never come
    # The traceback rides as text (the recorded, scrubbed one), never the live exception.
    assert record.exc_info is None
    assert record.exc_text is not None
    assert record.exc_text.endswith("RuntimeError: charging failed")
    assert "PaymentDeclinedError: card declined for 12" in caplog.text
    assert getattr(record, "task_id", None) == done.id
    assert getattr(record, "run_id", None) == str(run.run_id)
    assert "4111-secret" not in caplog.text


async def test_plain_exceptions_are_terminal_by_default(queue: QueueFixture) -> None:
    dsn, schema, conn = queue
    task: Task[Any] = Task("terminal")
    calls: list[int] = []

    async def handle(ctx: JobContext, args: Any) -> None:
        calls.append(ctx.attempt)
        raise ValueError("no retry without a policy")

    done = await enqueue(conn, task, None, schema=schema)
    worker = worker_for(dsn, schema)
    worker.register(task, handle)
    async with running(worker):
        await wait_until(lambda: worker.stats.failed == 1)
    run = await run_state(conn, done.id, schema=schema)
    assert (run.state.value, run.attempts, run.max_attempts, calls) == ("failed", 1, 5, [1])


async def test_a_retry_policy_retries_plain_exceptions_with_its_backoff(
    queue: QueueFixture,
) -> None:
    dsn, schema, conn = queue
    task: Task[Any] = Task("flaky", retry=FAST)
    calls: list[int] = []

    def handle(ctx: JobContext, args: Any) -> str:  # a sync handler: the same rules
        calls.append(ctx.attempt)
        if ctx.attempt < 3:
            raise ConnectionError(f"attempt {ctx.attempt} timed out")
        return "third time"

    done = await enqueue(conn, task, None, schema=schema)
    row = await conn.fetchrow(
        f'SELECT max_attempts, backoff_initial_us, backoff_maximum_us FROM "{schema}".tasks '
        "WHERE id = $1",
        done.id,
    )
    assert row is not None
    assert tuple(row) == (3, 1000, 5000)  # the policy was snapshotted at enqueue
    worker = worker_for(dsn, schema)
    worker.register(task, handle)
    async with running(worker):
        await wait_until(lambda: worker.stats.succeeded == 1)
    run = await run_state(conn, done.id, schema=schema)
    assert (run.state.value, run.attempts, calls) == ("succeeded", 3, [1, 2, 3])
    assert run.result == "third time"
    assert [(a.attempt, a.outcome, a.error_type) for a in run.history] == [
        (1, "retried", "ConnectionError"),
        (2, "retried", "ConnectionError"),
        (3, "succeeded", None),
    ]
    assert run.history[0].error == "ConnectionError: attempt 1 timed out"
    assert run.history[0].traceback is not None
    assert "in handle" in run.history[0].traceback


async def test_a_retry_policy_gives_up_after_its_attempts_and_msg_stays_terminal(
    queue: QueueFixture,
) -> None:
    dsn, schema, conn = queue
    task: Task[Any] = Task("doomed", retry=FAST)

    async def handle(ctx: JobContext, args: Any) -> None:
        if args == "msg":
            raise JobError.msg("the account is closed")
        raise KeyError("always")

    doomed = await enqueue(conn, task, "plain", schema=schema)
    closed = await enqueue(conn, task, "msg", schema=schema)
    # An enqueue's own options win over the policy's.
    once = await enqueue(conn, task, "plain", EnqueueOptions(max_attempts=1), schema=schema)
    worker = worker_for(dsn, schema)
    worker.register(task, handle)
    async with running(worker):
        await wait_until(lambda: worker.stats.failed == 3)
    run = await run_state(conn, doomed.id, schema=schema)
    assert (run.state.value, run.attempts) == ("failed", 3)
    assert run.last_error == "attempts exhausted (3/3): KeyError: 'always'"
    assert [a.outcome for a in run.history] == ["retried", "retried", "failed"]
    run = await run_state(conn, closed.id, schema=schema)
    assert (run.state.value, run.attempts) == ("failed", 1)
    assert run.last_error == "JobError: the account is closed"
    assert run.history[0].error_type == "steeple.postgres.queue.errors.JobError"
    run = await run_state(conn, once.id, schema=schema)
    assert (run.state.value, run.attempts, run.max_attempts) == ("failed", 1, 1)


async def test_run_state_returns_the_latest_attempts_only_as_asked(queue: QueueFixture) -> None:
    dsn, schema, conn = queue
    task: Task[Any] = Task("many", retry=FAST)

    async def handle(ctx: JobContext, args: Any) -> None:
        raise OSError(f"attempt {ctx.attempt}")

    done = await enqueue(conn, task, None, schema=schema)
    worker = worker_for(dsn, schema)
    worker.register(task, handle)
    async with running(worker):
        await wait_until(lambda: worker.stats.failed == 1)
    run = await run_state(conn, done.id, schema=schema, history=2)
    assert [a.attempt for a in run.history] == [2, 3]
    assert (await run_state(conn, done.id, schema=schema, history=0)).history == ()
    for bad in (-1, 1001, 2**70):
        with pytest.raises(QueueConfigurationError, match="history"):
            await run_state(conn, done.id, schema=schema, history=bad)
    wrong: Any
    for wrong in (1.5, "2", None, True):
        with pytest.raises(QueueTypeError, match="history"):
            await run_state(conn, done.id, schema=schema, history=wrong)


class _Hostile(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no message for you")


async def test_huge_and_hostile_failures_are_bounded_and_storable(queue: QueueFixture) -> None:
    dsn, schema, conn = queue
    task: Task[Any] = Task("hostile")

    def recurse(n: int) -> None:
        if n == 0:
            raise ValueError("deep \x00 nul \ud800 surrogate é" + "€" * 20_000)
        recurse(n - 1)

    async def handle(ctx: JobContext, args: Any) -> None:
        if args == "deep":
            recurse(400)  # a traceback far over 16 KiB
        raise _Hostile()

    deep = await enqueue(conn, task, "deep", schema=schema)
    unprintable = await enqueue(conn, task, "str", schema=schema)
    worker = worker_for(dsn, schema)
    worker.register(task, handle)
    async with running(worker):
        await wait_until(lambda: worker.stats.failed == 2)
    run = await run_state(conn, deep.id, schema=schema)
    tb = run.history[0].traceback
    assert tb is not None
    assert len(tb.encode("utf-8")) <= MAX_TRACEBACK_BYTES
    assert "bytes of the traceback elided" in tb
    assert tb.startswith("Traceback (most recent call last):")
    assert "\\x00" in tb
    assert "\\ud800" in tb
    assert run.last_error is not None
    assert len(run.last_error) <= 2010
    run = await run_state(conn, unprintable.id, schema=schema)
    assert run.last_error == f"{NOT_RETRIED}: _Hostile: <the exception's message could not be read>"
    assert run.history[0].error_type is not None
    assert run.history[0].error_type.endswith("test_queue_outcomes._Hostile")


@pytest.mark.parametrize("limit", [60, 100, 1000, 16384])
@pytest.mark.parametrize(
    "text", ["a" * 50_000, "é" * 30_000, "€𝄞" * 10_000, "x" * 10 + "𝄞" * 9_000, "short"]
)
def test_bounded_utf8_cuts_at_character_boundaries(text: str, limit: int) -> None:
    out = bounded_utf8(text, limit)
    data = out.encode("utf-8")  # decodes: no cut inside a character
    assert len(data) <= max(limit, len(text.encode("utf-8")) if out == text else limit)
    if len(text.encode("utf-8")) <= limit:
        assert out == text
    else:
        assert "elided" in out
        assert text.endswith(out.rsplit("...\n", 1)[-1])


# --- retry policy validation ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"max_attempts": 0}, QueueConfigurationError),
        ({"max_attempts": 10_001}, QueueConfigurationError),
        ({"max_attempts": 2**64}, QueueConfigurationError),
        ({"max_attempts": True}, QueueTypeError),
        ({"max_attempts": 2.0}, QueueTypeError),
        ({"base_delay": timedelta(0)}, QueueConfigurationError),
        ({"base_delay": timedelta(seconds=-1)}, QueueConfigurationError),
        ({"base_delay": 1.0}, QueueTypeError),
        ({"max_delay": timedelta(days=367)}, QueueConfigurationError),
        (
            {"base_delay": timedelta(seconds=10), "max_delay": timedelta(seconds=1)},
            QueueConfigurationError,
        ),
        ({"factor": 0}, QueueConfigurationError),
        ({"factor": 1.5}, QueueTypeError),
        ({"jitter": math.nan}, QueueConfigurationError),
        ({"jitter": math.inf}, QueueConfigurationError),
        ({"jitter": -0.1}, QueueConfigurationError),
        ({"jitter": 1.1}, QueueConfigurationError),
        ({"jitter": "0.5"}, QueueTypeError),
        ({"jitter": None}, QueueTypeError),
    ],
)
def test_retry_policy_refuses_bad_values(kwargs: dict[str, Any], error: type[Exception]) -> None:
    with pytest.raises(error, match="RetryPolicy"):
        RetryPolicy(**kwargs)


def test_retry_policy_becomes_the_snapshot_unless_options_say_otherwise() -> None:
    policy = RetryPolicy(
        max_attempts=7, base_delay=timedelta(seconds=2), max_delay=timedelta(seconds=30),
        factor=3, jitter=0.5,
    )  # fmt: skip
    assert policy.backoff == Backoff(timedelta(seconds=2), timedelta(seconds=30), 3, 0.5)
    assert EnqueueOptions().snapshot(Task("t", retry=policy))[1:] == (
        7,
        timedelta(seconds=60),
        2_000_000,
        30_000_000,
        3,
        0.5,
    )
    assert EnqueueOptions().snapshot()[1] == 5
    assert EnqueueOptions(max_attempts=2).snapshot(Task("t", retry=policy))[1] == 2
    assert EnqueueOptions().snapshot(Task("t", max_attempts=9))[1] == 9
    assert EnqueueOptions().snapshot(Task("t", max_attempts=7, retry=policy))[1] == 7
    with pytest.raises(QueueConfigurationError, match="give it once"):
        Task("t", max_attempts=3, retry=policy)
    with pytest.raises(QueueConfigurationError, match="max_attempts"):
        Task("t", max_attempts=0)
    with pytest.raises(QueueTypeError, match="max_attempts"):
        Task("t", max_attempts="3")  # type: ignore[arg-type]
    with pytest.raises(QueueTypeError, match="retry must be a RetryPolicy"):
        Task("t", retry=3)  # type: ignore[arg-type]


# --- results --------------------------------------------------------------------------------


async def test_a_returned_json_value_is_stored_and_returned(queue: QueueFixture) -> None:
    dsn, schema, conn = queue
    task: Task[Any] = Task("compute")
    values: list[Any] = [
        {"total": 42, "items": [1, 2.5, "é", None, True]},
        [],
        0,
        "",
        "€" * 100,
        2**100,
        None,
    ]

    async def handle(ctx: JobContext, args: Any) -> Any:
        return values[args]

    ids = [(await enqueue(conn, task, i, schema=schema)).id for i in range(len(values))]
    worker = worker_for(dsn, schema)
    worker.register(task, handle)
    async with running(worker):
        await wait_until(lambda: worker.stats.succeeded == len(values))
    for task_id, value in zip(ids, values, strict=True):
        run = await run_state(conn, task_id, schema=schema)
        assert run.state.value == "succeeded"
        assert run.result == value
    stored = await conn.fetchval(f'SELECT result FROM "{schema}".tasks WHERE id = $1', ids[-1])
    assert stored is None  # None is no result (SQL NULL), not JSON null


class _Opaque:
    pass


async def test_a_result_that_cannot_be_stored_fails_the_task_clearly(queue: QueueFixture) -> None:
    dsn, schema, conn = queue
    task: Task[Any] = Task("bad-result", retry=FAST)  # even with a policy: never retried
    cyclic: list[Any] = []
    cyclic.append(cyclic)
    deep: Any = []
    for _ in range(100_000):
        deep = [deep]
    cases: list[tuple[Any, str]] = [
        ({1, 2}, "cannot be stored as JSON"),
        (_Opaque(), "cannot be stored as JSON"),
        (math.nan, "cannot be stored as JSON"),
        ({"x": math.inf}, "cannot be stored as JSON"),
        (cyclic, "cannot be stored as JSON"),
        (deep, "nests too deeply"),
        ("a\x00b", "NUL"),
        ("\ud800", "lone surrogate"),
        ("x" * (64 * 1024), "over the 65536-byte limit"),
        ({(1, 2): 3}, "cannot be stored as JSON"),
    ]

    async def handle(ctx: JobContext, args: Any) -> Any:
        return cases[args][0]

    ids = [(await enqueue(conn, task, i, schema=schema)).id for i in range(len(cases))]
    worker = worker_for(dsn, schema)
    worker.register(task, handle)
    async with running(worker):
        await wait_until(lambda: worker.stats.failed == len(cases))
    for task_id, (_, words) in zip(ids, cases, strict=True):
        run = await run_state(conn, task_id, schema=schema)
        assert (run.state.value, run.attempts, run.result) == ("failed", 1, None)
        assert run.last_error is not None
        assert run.last_error.startswith("ResultEncodingError: the result of task 'bad-result'")
        assert words in run.last_error
        assert run.history[0].error_type == "steeple.postgres.queue.errors.ResultEncodingError"


async def test_a_result_at_the_limit_is_stored(queue: QueueFixture) -> None:
    dsn, schema, conn = queue
    task: Task[Any] = Task("big-result")
    # json.dumps adds the two quotes: exactly 65536 bytes.
    value = "y" * (64 * 1024 - 2)

    async def handle(ctx: JobContext, args: Any) -> Any:
        return value

    done = await enqueue(conn, task, None, schema=schema)
    worker = worker_for(dsn, schema)
    worker.register(task, handle)
    async with running(worker):
        await wait_until(lambda: worker.stats.succeeded == 1)
    assert (await run_state(conn, done.id, schema=schema)).result == value


# --- progress -------------------------------------------------------------------------------


async def test_progress_is_written_while_running_and_kept_after(queue: QueueFixture) -> None:
    dsn, schema, conn = queue
    task: Task[Any] = Task("progressing")
    step = threading.Event()
    reported = threading.Event()

    def handle(ctx: JobContext, args: Any) -> str:  # from a thread
        for i in range(1, 101):
            ctx.report_progress(i / 200, f"row {i}")
        reported.set()
        step.wait(30)
        ctx.report_progress(1, "done")
        return "ok"

    done = await enqueue(conn, task, None, schema=schema)
    worker = worker_for(dsn, schema)
    worker.register(task, handle)
    async with running(worker):
        await wait_until(reported.is_set)

        async def halfway() -> bool:
            run = await run_state(conn, done.id, schema=schema)
            return run.progress == Progress(0.5, "row 100")

        await wait_until(halfway)  # while it runs: the latest of many reports
        assert (await run_state(conn, done.id, schema=schema)).state.value == "running"
        step.set()
        await wait_until(lambda: worker.stats.succeeded == 1)
    run = await run_state(conn, done.id, schema=schema)
    assert (run.state.value, run.progress, run.result) == ("succeeded", Progress(1.0, "done"), "ok")


async def test_the_last_progress_is_written_with_the_outcome(queue: QueueFixture) -> None:
    dsn, schema, conn = queue
    task: Task[Any] = Task("quick")

    async def handle(ctx: JobContext, args: Any) -> None:
        ctx.report_progress(0.25)
        if args:
            raise RuntimeError("stopped at a quarter")
        ctx.report_progress(0.75)

    ok = await enqueue(conn, task, False, schema=schema)
    failed = await enqueue(conn, task, True, schema=schema)
    worker = worker_for(dsn, schema)
    worker.register(task, handle)
    async with running(worker):
        await wait_until(lambda: worker.stats.succeeded == 1 and worker.stats.failed == 1)
    assert (await run_state(conn, ok.id, schema=schema)).progress == Progress(0.75)
    assert (await run_state(conn, failed.id, schema=schema)).progress == Progress(0.25)


async def test_report_progress_refuses_hostile_values_and_stores_nothing(
    queue: QueueFixture,
) -> None:
    dsn, schema, conn = queue
    task: Task[Any] = Task("bad-progress")
    errors: list[tuple[str, type[Exception]]] = []
    cases: list[tuple[Any, Any]] = [
        (math.nan, None), (math.inf, None), (-0.01, None), (1.0001, None), (2**2000, None),
        ("0.5", None), (None, None), (True, None), ([0.5], None),
        (0.5, ""), (0.5, "x" * 201), (0.5, "a\x00b"), (0.5, "\ud800"), (0.5, "line\nbreak"),
        (0.5, 42), (0.5, b"bytes"),
    ]  # fmt: skip

    async def handle(ctx: JobContext, args: Any) -> None:
        for fraction, message in cases:
            try:
                ctx.report_progress(fraction, message)
            except (QueueConfigurationError, QueueTypeError) as exc:
                errors.append((str(exc), type(exc)))
        ctx.report_progress(0, "x" * 200)  # the limits themselves are fine
        ctx.report_progress(1)

    done = await enqueue(conn, task, None, schema=schema)
    worker = worker_for(dsn, schema)
    worker.register(task, handle)
    async with running(worker):
        await wait_until(lambda: worker.stats.succeeded == 1)
    assert len(errors) == len(cases)
    assert all("progress" in text for text, _ in errors)
    assert (await run_state(conn, done.id, schema=schema)).progress == Progress(1.0)


async def test_outcomes_through_a_psycopg_pool_and_connection(queue: QueueFixture) -> None:
    """The same writes and reads on psycopg: result and progress arrays with NULLs, failures."""
    import psycopg
    import psycopg_pool

    dsn, schema, conn = queue
    task: Task[Any] = Task("psy", retry=FAST)

    def handle(ctx: JobContext, args: Any) -> Any:
        if args == "progress-only":
            ctx.report_progress(0.5)
            return None
        if args == "fail":
            raise ValueError("psycopg failure")
        return {"echo": args}

    ids = [
        (await enqueue(conn, task, a, schema=schema)).id
        for a in ("progress-only", "fail", "value", "value2")
    ]
    pool = psycopg_pool.AsyncConnectionPool(dsn, min_size=3, max_size=4, open=False)
    await pool.open()
    try:
        worker = Scheduler(pool, worker_id="psy-w", schema=schema, poll_interval=0.05)
        worker.register(task, handle)
        async with running(worker):
            await wait_until(lambda: worker.stats.succeeded == 3 and worker.stats.failed == 1)
    finally:
        await pool.close()
    async with await psycopg.AsyncConnection.connect(dsn) as pconn:
        runs = [await run_state(pconn, i, schema=schema) for i in ids]
    assert [(r.state.value, r.result, r.progress) for r in runs] == [
        ("succeeded", None, Progress(0.5)),
        ("failed", None, None),
        ("succeeded", {"echo": "value"}, None),
        ("succeeded", {"echo": "value2"}, None),
    ]
    assert [a.error_type for a in runs[1].history] == ["ValueError"] * 3
    assert runs[1].history[0].started_at is not None


async def test_job_error_msg_with_hostile_messages_is_recorded(
    queue: QueueFixture, caplog: pytest.LogCaptureFixture
) -> None:
    """A JobError is logged without a traceback (a verdict, not a crash); the history has it."""
    dsn, schema, conn = queue
    task: Task[Any] = Task("msg", retry=FAST)
    messages: list[Any] = ["nul \x00", "\ud800", "é" * 5000, "", 42, None]

    async def handle(ctx: JobContext, args: Any) -> None:
        raise JobError.msg(messages[args])

    ids = [(await enqueue(conn, task, i, schema=schema)).id for i in range(len(messages))]
    worker = worker_for(dsn, schema)
    worker.register(task, handle)
    with caplog.at_level(logging.WARNING, logger="steeple.postgres.queue"):
        async with running(worker):
            await wait_until(lambda: worker.stats.failed == len(messages))
    logged = [r for r in caplog.records if "(msg) attempt" in r.getMessage()]
    assert len(logged) == len(messages)
    assert all(r.exc_info is None for r in logged)
    assert "Traceback" not in caplog.text
    for task_id in ids:
        run = await run_state(conn, task_id, schema=schema)
        assert (run.state.value, run.attempts) == ("failed", 1)  # msg is terminal
        assert run.last_error is not None
        assert run.last_error.startswith("JobError: ")
        assert len(run.last_error) <= 2000
        assert run.history[0].traceback is not None
        assert "Traceback (most recent call last)" in run.history[0].traceback


async def test_undecodable_args_stay_terminal_under_a_retry_policy(queue: QueueFixture) -> None:
    import dataclasses

    @dataclasses.dataclass
    class Shape:
        side: int

    dsn, schema, conn = queue
    producer: Task[Any] = Task("shape")  # an older producer: plain JSON of another shape
    done = await enqueue(conn, producer, {"radius": 3}, schema=schema)
    consumer: Task[Any] = Task("shape", Shape, retry=FAST)
    calls: list[Any] = []

    async def handle(ctx: JobContext, args: Shape) -> None:
        calls.append(args)

    worker = worker_for(dsn, schema)
    worker.register(consumer, handle)
    async with running(worker):
        await wait_until(lambda: worker.stats.failed == 1)
    run = await run_state(conn, done.id, schema=schema)
    assert (run.state.value, run.attempts, calls) == ("failed", 1, [])
    assert run.last_error is not None
    assert run.last_error.startswith("ArgsEncodingError: stored args of task 'shape'")
    assert run.history[0].error_type == "steeple.postgres.queue.errors.ArgsEncodingError"


# --- the worker's own secrets ----------------------------------------------------------------


def _with_password(dsn: str, form: str, password: str) -> str:
    """``dsn`` (a URL without a password) carrying ``password`` in the given libpq form."""
    parts = urllib.parse.urlsplit(dsn)
    host, port = parts.hostname or "127.0.0.1", parts.port or 5432
    user, db = parts.username or "postgres", parts.path.lstrip("/")
    if form == "userinfo":
        return f"postgresql://{user}:{password}@{host}:{port}/{db}"
    if form == "query":
        return f"postgresql://{user}@{host}:{port}/{db}?password={password}"
    return f"host={host} port={port} dbname={db} user={user} password={password}"


@pytest.mark.parametrize("form", ["userinfo", "query", "keyvalue", "asyncpg_kwarg"])
async def test_a_failure_quoting_the_worker_dsn_stores_and_logs_no_password(
    queue: QueueFixture, caplog: pytest.LogCaptureFixture, form: str
) -> None:
    """A handler whose exception quotes the worker's own DSN (a driver error, a log line it
    re-raises) leaves the password in neither the error, the traceback nor the log."""
    import psycopg_pool

    dsn, schema, conn = queue
    password = f"Pw-{form}-93127"
    pool: Any = None
    if form == "keyvalue":
        secret_dsn = _with_password(dsn, form, password)
        pool = psycopg_pool.AsyncConnectionPool(secret_dsn, min_size=3, max_size=4, open=False)
        await pool.open()
        source: Any = pool
    elif form == "asyncpg_kwarg":
        secret_dsn = f"{dsn} password={password}"  # how a message might show both
        pool = await asyncpg.create_pool(dsn, password=password, min_size=3, max_size=4)
        source = pool
    else:
        secret_dsn = _with_password(dsn, form, password)
        source = secret_dsn
    task: Task[Any] = Task("leaky", retry=FAST)

    async def handle(ctx: JobContext, args: Any) -> None:
        try:
            raise ConnectionError(f"could not connect: password={password!r}")
        except ConnectionError as exc:
            if ctx.attempt == 1:
                raise JobError.retry(f"retrying {secret_dsn}") from exc
            raise RuntimeError(f"gave up on {secret_dsn}") from exc

    done = await enqueue(conn, task, None, schema=schema)
    worker = Scheduler(
        source, worker_id="out-w", schema=schema, poll_interval=0.05, maintenance_interval=0.05
    )
    worker.register(task, handle)
    try:
        with caplog.at_level(logging.WARNING, logger="steeple.postgres.queue"):
            async with running(worker):
                await wait_until(lambda: worker.stats.failed == 1)
    finally:
        if pool is not None:
            await pool.close()
    run = await run_state(conn, done.id, schema=schema)
    assert (run.state.value, len(run.history)) == ("failed", 3)
    stored = [run.last_error] + [a.error for a in run.history]
    stored += [a.traceback for a in run.history]
    for text in stored:
        assert text is not None
        assert password not in text
        assert "***" in text
    assert run.history[-1].traceback is not None
    assert "in handle" in run.history[-1].traceback  # the rest of the traceback is kept
    assert password not in caplog.text
    assert [r.levelno for r in caplog.records if "leaky" in r.getMessage()] == [
        logging.WARNING,
        logging.WARNING,
        logging.ERROR,
    ]
    (rows,) = await conn.fetch(
        f'SELECT count(*) FROM "{schema}".attempts WHERE error LIKE $1 OR traceback LIKE $1',
        f"%{password}%",
    )
    assert rows[0] == 0


async def test_a_terminal_failure_says_it_is_not_retried_and_expected_retries_log_one_line(
    queue: QueueFixture, caplog: pytest.LogCaptureFixture
) -> None:
    """A plain exception without a retry policy fails at once: nothing says ``1/5``.

    Its log line, its recorded error and ``run_state`` say it was not retried and how to
    have it retried; a retry that is expected logs one line without a traceback; a
    handler's own verdict (``JobError.permanent``) is not retried either, and says so.
    """
    dsn, schema, conn = queue
    plain: Task[Any] = Task("resize")
    flaky: Task[Any] = Task("fetch", retry=FAST)
    judged: Task[Any] = Task("judge")

    async def resize(ctx: JobContext, args: Any) -> None:
        raise ValueError("no such image")

    def fetch(ctx: JobContext, args: Any) -> str:
        if ctx.attempt < 3:
            raise ConnectionError(f"attempt {ctx.attempt} timed out")
        raise KeyError("gone")

    async def judge(ctx: JobContext, args: Any) -> None:
        raise JobError.permanent("the account is closed")

    resized = await enqueue(conn, plain, None, schema=schema)
    fetched = await enqueue(conn, flaky, None, schema=schema)
    closed = await enqueue(conn, judged, None, schema=schema)
    worker = worker_for(dsn, schema)
    worker.register(plain, resize)
    worker.register(flaky, fetch)
    worker.register(judged, judge)
    with caplog.at_level(logging.WARNING, logger="steeple.postgres.queue"):
        async with running(worker):
            await wait_until(lambda: worker.stats.failed == 3)

    run = await run_state(conn, resized.id, schema=schema)
    assert (run.state.value, run.attempts, run.max_attempts) == ("failed", 1, 5)
    assert run.attempts_shown == "1, not retried"
    assert run.last_error == f"{NOT_RETRIED}: ValueError: no such image"
    run = await run_state(conn, fetched.id, schema=schema)
    assert run.attempts_shown == "3/3, attempts exhausted"
    assert run.last_error == "attempts exhausted (3/3): KeyError: 'gone'"
    run = await run_state(conn, closed.id, schema=schema)
    assert run.attempts_shown == "1, not retried"
    assert run.last_error == "JobError: the account is closed"

    def logged(name: str) -> list[logging.LogRecord]:
        return [r for r in caplog.records if f"({name}) attempt" in r.getMessage()]

    (record,) = logged("resize")
    assert record.levelno == logging.ERROR
    message = record.getMessage()
    assert f"task {resized.id} (resize) attempt 1, run " in message
    assert f"failed: {NOT_RETRIED}: ValueError: no such image" in message
    assert "1/5" not in message
    # An unexpected crash keeps its traceback (the recorded, scrubbed text).
    assert record.exc_text is not None
    assert "ValueError: no such image" in record.exc_text
    retries = logged("fetch")[:2]
    assert [r.levelno for r in retries] == [logging.WARNING, logging.WARNING]
    assert all(r.exc_text is None for r in retries)  # expected: one line, no traceback
    assert "attempt 1/3" in retries[0].getMessage()
    assert "retries in" in retries[0].getMessage()
    (exhausted,) = logged("fetch")[2:]
    assert "attempt 3, run" in exhausted.getMessage()
    assert "failed: attempts exhausted (3/3): KeyError: 'gone'" in exhausted.getMessage()
    assert exhausted.exc_text is not None
    (verdict,) = logged("judge")
    assert "attempt 1, run" in verdict.getMessage()
    assert "failed, not retried: JobError: the account is closed" in verdict.getMessage()
    assert verdict.exc_text is None
