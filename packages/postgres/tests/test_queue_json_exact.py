"""What the queue stores as JSON comes back equal, or is refused -- against a real PostgreSQL.

``jsonb`` rewrites numbers (``1e20`` comes back an int, ``1e300`` as 301 digits, ``-0.0`` as
``0.0``) and spaces its text out. The queue's one JSON check writes floats the way the
database keeps them, refuses what cannot come back equal, and measures the stored text;
a completion batch the database refuses anyway is split so one bad outcome fails alone.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import json
import logging
import math
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from datetime import UTC, datetime
from typing import Any, TypeVar

import asyncpg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import queue_support
from queue_support import QueueFixture
from steeple.postgres.queue import (
    ArgsEncodingError,
    Health,
    JobContext,
    Scheduler,
    Task,
    enqueue,
    enqueue_many,
    jobs,
    run_state,
)
from steeple.postgres.queue._driver import is_data_error
from steeple.postgres.queue._execution import MAX_RESULT_BYTES, encode_result
from steeple.postgres.queue._json import storable_json
from steeple.postgres.queue.errors import ResultEncodingError
from steeple.testing import FakeClock

T = TypeVar("T")
wait_until = functools.partial(queue_support.wait_until, timeout=30.0)


def same(a: Any, b: Any) -> bool:
    """Equal in value AND type, floats by sign too (``==`` says 1 == 1.0 and 0.0 == -0.0)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return bool(a == b)


def encode(value: Any, limit: int = 1 << 20) -> str:
    return storable_json(value, ArgsEncodingError, "the value", limit, "JSON values")


@contextlib.contextmanager
def int_digits(limit: int) -> Iterator[None]:
    before = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(limit)
    try:
        yield
    finally:
        sys.set_int_max_str_digits(before)


async def stored(conn: asyncpg.Connection, text: str) -> tuple[str, int]:
    """What ``jsonb`` keeps of ``text``: its text form and that text's size in bytes."""
    row = await conn.fetchrow(
        "SELECT j::text, octet_length(j::text) FROM (SELECT $1::jsonb) s(j)", text
    )
    assert row is not None
    return row[0], row[1]


# --- the encoder, edge values, through a real jsonb column -----------------------------------

EDGE_VALUES: list[Any] = [
    1e16,
    -1e16,
    1e15,
    9999999999999998.0,
    1e20,
    1.5e20,
    1e300,
    -1e300,
    1.7976931348623157e308,
    5e-324,
    -5e-324,
    2.2250738585072014e-308,
    1e-5,
    1e-4,
    9.999999999999999e-05,
    0.1,
    123.0,
    0.0,
    2.0**63,
    2.0**64,
    2**63 - 1,
    2**63,
    -(2**63) - 1,
    2**64,
    10**300,
    -(10**4000),
    True,
    False,
    None,
    "",
    "1e+300 inside a string stays a string",
    '\x01\x7f\n\t"\\/ é € 😀 \u2028',
    [],
    {},
    {"big": 1e20, "huge": 1e300, "tiny": 5e-324, "n": [1e16, [2**64, {"x": 1e-7}]]},
    {"b": 1, "a": 2, "aa": [0.5, -0.25]},
    (1e20, 2),  # a tuple is a JSON array: it comes back a list
]


@pytest.mark.parametrize("value", EDGE_VALUES, ids=repr)
async def test_edge_values_come_back_equal_from_jsonb_and_are_measured_as_stored(
    queue: QueueFixture, value: Any
) -> None:
    _dsn, _schema, conn = queue
    text = encode(value)
    back_text, size = await stored(conn, text)
    expected = list(value) if isinstance(value, tuple) else value
    assert same(json.loads(back_text), expected), (text, back_text)
    # The size checked is the size of what the database holds (its spacing, its digits).
    assert size == len(text.encode("utf-8"))
    # The text sent is already the database's form: storing it again changes nothing.
    assert (await stored(conn, back_text))[0] == back_text


def test_floats_are_written_as_numeric_keeps_them() -> None:
    assert encode(1e20) == "100000000000000000000.0"
    assert encode(1e16) == "10000000000000000.0"
    assert encode(1e300) == "1" + "0" * 300 + ".0"
    assert encode(5e-324) == "0." + "0" * 323 + "5"
    assert encode(1e-7) == "0.0000001"
    assert encode(2.0**64) == "18446744073709552000.0"  # the shortest digits
    assert encode([1.5, 123.0, 0.0001]) == "[1.5, 123.0, 0.0001]"
    assert encode({"a": [1, 2], "b": None}) == '{"a": [1, 2], "b": null}'


@pytest.mark.parametrize(
    ("value", "words"),
    [
        (-0.0, "holds -0.0"),
        ({"x": [1, {"y": -0.0}]}, "holds -0.0"),
        ({1: "a"}, "object key of type int"),
        ({1: "a", "1": "b"}, "object key of type int"),  # would collide as "1"
        ({"x": {None: 1}}, "object key of type NoneType"),
        ({True: 1}, "object key of type bool"),
        ({1.5: 1}, "object key of type float"),
    ],
    ids=repr,
)
def test_values_that_would_not_come_back_equal_are_refused(value: Any, words: str) -> None:
    with pytest.raises(ArgsEncodingError, match="cannot be stored exactly as JSON") as caught:
        encode(value)
    assert words in str(caught.value)


def test_the_size_limit_counts_the_digits_the_database_writes() -> None:
    # About 7 KB as Python writes it; 303 bytes a number (and ", " between) once stored.
    poison = [1e300] * 1000
    assert len(json.dumps(poison, separators=(",", ":"))) == 7001
    with pytest.raises(ResultEncodingError, match="305000 bytes of JSON as stored"):
        encode_result("t", poison)
    # Measured as stored: n numbers take "[" + n items joined by ", " + "]".
    item = "1" + "0" * 300 + ".0"
    n = MAX_RESULT_BYTES // (len(item) + 2)
    fits = encode_result("t", [1e300] * n)
    assert fits is not None
    assert len(fits) == n * (len(item) + 2) <= MAX_RESULT_BYTES
    with pytest.raises(ResultEncodingError, match="over the 65536-byte limit"):
        encode_result("t", [1e300] * (n + 1))
    text = encode_result("t", "y" * (MAX_RESULT_BYTES - 2))
    assert text is not None
    assert len(text) == MAX_RESULT_BYTES
    with pytest.raises(ResultEncodingError, match="65537 bytes"):
        encode_result("t", "y" * (MAX_RESULT_BYTES - 1))


async def test_ints_are_exact_up_to_what_numeric_holds_and_refused_beyond(
    queue: QueueFixture,
) -> None:
    _dsn, _schema, conn = queue
    # numeric keeps 131072 digits before the point: the largest such int comes back exact.
    largest = 10**131072 - 1
    with int_digits(0):  # Python itself refuses to write ints over 4300 digits by default
        text = encode([largest, -largest])
        back_text, size = await stored(conn, text)
        assert json.loads(back_text) == [largest, -largest]
        assert size == len(text)
        with pytest.raises(ArgsEncodingError, match="more than 131072 digits"):
            encode({"n": 10**131072})
        with pytest.raises(ArgsEncodingError, match="more than 131072 digits"):
            encode([-(10**131072)])
        with pytest.raises(asyncpg.PostgresError, match="overflows numeric"):
            await conn.fetchval("SELECT $1::jsonb", str(10**131072))
    with pytest.raises(ArgsEncodingError, match="cannot be stored as JSON"):
        encode(10**4300)  # beyond Python's own limit on int -> str


def test_progress_and_trace_contexts_use_the_same_check() -> None:
    from steeple.postgres.queue._tracing import _stored_carrier

    assert _stored_carrier({}) is None
    assert _stored_carrier({"traceparent": "00-ab-cd-01"}) == '{"traceparent": "00-ab-cd-01"}'
    assert _stored_carrier({"k": "x\x00"}) is None  # jsonb refuses a NUL: dropped, not sent
    assert _stored_carrier({"k": "x" * 5000}) is None


# --- enqueue paths: one check for args everywhere ------------------------------------------


async def test_every_enqueue_path_refuses_what_would_not_come_back_equal(
    queue: QueueFixture,
) -> None:
    _dsn, schema, conn = queue
    task: Task[Any] = Task("exact")
    bad: list[Any] = [{"x": -0.0}, {1: 2}]
    for args in bad:
        with pytest.raises(ArgsEncodingError, match="cannot be stored exactly"):
            await enqueue(conn, task, args, schema=schema)
        with pytest.raises(ArgsEncodingError, match="cannot be stored exactly"):
            await enqueue_many(conn, task, [{"ok": 1}, args], schema=schema)
        with pytest.raises(ArgsEncodingError, match="cannot be stored exactly"):
            await jobs.create(conn, "j", task, "* * * * *", args, schema=schema)
    assert await conn.fetchval(f'SELECT count(*) FROM "{schema}".tasks') == 0
    assert await conn.fetchval(f'SELECT count(*) FROM "{schema}".jobs') == 0
    # Args far bigger as stored than as Python writes them are measured as stored.
    with pytest.raises(ArgsEncodingError, match="as stored, over the 1048576-byte limit"):
        await enqueue(conn, task, [1e300] * 4000, schema=schema)


async def test_a_jobs_args_keep_their_numbers_on_every_occurrence(queue: QueueFixture) -> None:
    dsn, schema, conn = queue
    task: Task[Any] = Task("exact-job")
    args = {"big": 1e20, "huge": 1e300, "tiny": 5e-324, "int": 2**64, "f": 2.0**64}
    clock = FakeClock(datetime(2026, 3, 4, 5, 6, 7, tzinfo=UTC))  # in the real past
    await jobs.create(conn, "exact", task, "*/10 * * * *", args, schema=schema, clock=clock)
    clock.set(datetime(2026, 3, 4, 5, 10, tzinfo=UTC))
    assert await jobs.materialize_due(conn, schema=schema, clock=clock) == 1
    received: list[Any] = []

    async def handle(ctx: JobContext, got: Any) -> None:
        received.append(got)

    worker = Scheduler(dsn, worker_id="exact-w", schema=schema, poll_interval=0.05)
    worker.register(task, handle)
    async with running(worker):
        await wait_until(lambda: len(received) >= 1)
    assert same(received[0], args)


# --- through a real Scheduler -------------------------------------------------------------


@contextlib.asynccontextmanager
async def running(worker: Scheduler) -> AsyncIterator[Scheduler]:
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run_until_shutdown(stop, drain_timeout=10.0))
    try:
        await wait_until(lambda: worker.health() is not Health.STARTING or task.done())
        if task.done():
            task.result()
        yield worker
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


async def _one_batch(
    queue: QueueFixture,
    poison: Any,
    caplog: pytest.LogCaptureFixture,
    count: int = 11,
    poisoned: frozenset[int] = frozenset({10}),
) -> tuple[list[int], list[int], Scheduler]:
    """Run ``count`` tasks whose handlers all return at once (one completion batch): those
    numbered in ``poisoned`` return ``poison``, the others a good result. Return the good
    ids, the poisoned ids and the worker."""
    dsn, schema, conn = queue
    task: Task[Any] = Task("batch", max_attempts=3)
    ids = [(await enqueue(conn, task, i, schema=schema)).id for i in range(count)]
    release = asyncio.Event()
    started: set[int] = set()

    async def handle(ctx: JobContext, i: int) -> Any:
        started.add(i)
        await release.wait()
        return poison if i in poisoned else {"i": i, "x": 1e20}

    worker = Scheduler(
        dsn,
        worker_id="batch-w",
        schema=schema,
        poll_interval=0.05,
        maintenance_interval=0.05,
        concurrency=count,
    )
    worker.register(task, handle)
    caplog.set_level(logging.INFO, logger="steeple")
    async with running(worker):
        await wait_until(lambda: len(started) == count)
        release.set()  # every handler returns in the same turn of the loop: one batch
        await wait_until(lambda: worker.stats.succeeded + worker.stats.failed >= count)
        await wait_until(lambda: worker.health() is Health.HEALTHY)
        assert (worker.stats.succeeded, worker.stats.failed) == (
            count - len(poisoned),
            len(poisoned),
        )
    good = [task_id for i, task_id in enumerate(ids) if i not in poisoned]
    return good, [task_id for i, task_id in enumerate(ids) if i in poisoned], worker


async def _check_outcomes(
    conn: asyncpg.Connection, schema: str, good: list[int], bad: list[int]
) -> None:
    for task_id in good:
        run = await run_state(conn, task_id, schema=schema)
        assert (run.state.value, run.attempts) == ("succeeded", 1)
        assert isinstance(run.result, dict)
        assert same(run.result, {"i": run.result["i"], "x": 1e20})
    for task_id in bad:
        run = await run_state(conn, task_id, schema=schema)
        assert (run.state.value, run.attempts, run.result) == ("failed", 1, None)
        assert run.last_error is not None
        assert run.last_error.startswith("ResultEncodingError: the result of task 'batch'")
        assert len(run.history) == 1
        assert run.history[0].outcome == "failed"
        assert run.history[0].error_type == "steeple.postgres.queue.errors.ResultEncodingError"


async def test_a_result_the_database_expands_fails_its_task_alone(
    queue: QueueFixture, caplog: pytest.LogCaptureFixture
) -> None:
    _dsn, schema, conn = queue
    good, bad, _worker = await _one_batch(queue, [1e300] * 1000, caplog)
    await _check_outcomes(conn, schema, good, bad)
    run = await run_state(conn, bad[0], schema=schema)
    assert run.last_error is not None
    assert "over the 65536-byte limit" in run.last_error


async def test_a_batch_the_database_refuses_is_split_and_the_good_outcomes_land(
    queue: QueueFixture, caplog: pytest.LogCaptureFixture
) -> None:
    _dsn, schema, conn = queue
    # A result the library cannot foresee the database refusing (here a CHECK an operator
    # added): the write of the whole batch fails for one value.
    await conn.execute(
        f'ALTER TABLE "{schema}".tasks ADD CONSTRAINT no_poison'
        " CHECK (result IS NULL OR result <> '\"poison\"'::jsonb)"
    )
    good, bad, worker = await _one_batch(queue, "poison", caplog)
    await _check_outcomes(conn, schema, good, bad)
    run = await run_state(conn, bad[0], schema=schema)
    assert run.last_error is not None
    assert "refused by the database (PostgreSQL failed (SQLSTATE 23514" in run.last_error
    assert "poison" not in run.last_error.replace("task 'batch'", "")  # no payload
    assert any("refused a batch of 11 completions" in r.getMessage() for r in caplog.records)
    assert worker.stats.rejected_completions == 0


async def test_several_refused_outcomes_in_a_large_batch_each_fail_alone(
    queue: QueueFixture, caplog: pytest.LogCaptureFixture
) -> None:
    _dsn, schema, conn = queue
    await conn.execute(
        f'ALTER TABLE "{schema}".tasks ADD CONSTRAINT no_poison'
        " CHECK (result IS NULL OR result <> '\"poison\"'::jsonb)"
    )
    poisoned = frozenset({0, 17, 18, 63})  # the first, two neighbours, the last
    good, bad, worker = await _one_batch(queue, "poison", caplog, 64, poisoned)
    await _check_outcomes(conn, schema, good, bad)
    assert any("refused a batch of 64 completions" in r.getMessage() for r in caplog.records)
    assert worker.stats.rejected_completions == 0


class _Failed(Exception):
    def __init__(self, sqlstate: str | None) -> None:
        super().__init__("driver text that may quote values")
        self.sqlstate = sqlstate


@pytest.mark.parametrize(
    ("sqlstate", "data"),
    [
        ("23514", True),  # check_violation
        ("22003", True),  # numeric_value_out_of_range
        ("22P02", True),  # invalid_text_representation
        ("54000", True),  # program_limit_exceeded
        ("08006", False),  # connection_failure: the batch is retried as it is
        ("57P01", False),  # admin_shutdown
        ("57014", False),  # query_canceled (statement_timeout)
        ("53100", False),  # disk_full
        ("25006", False),  # read_only_sql_transaction
        ("40001", False),  # serialization_failure
        (None, False),
    ],
)
def test_only_errors_about_the_data_split_a_batch(sqlstate: str | None, data: bool) -> None:
    assert is_data_error(_Failed(sqlstate)) is data
    assert is_data_error(OSError("reset")) is False


# --- the round-trip property ----------------------------------------------------------------

NASTY_FLOATS = st.sampled_from(
    [1e16, 1e20, 1e300, -1e300, 5e-324, 1.7976931348623157e308, 1e-7, 123.0, 0.0, -0.0, 2.0**63]
)
NASTY_INTS = st.sampled_from([2**63 - 1, 2**63, -(2**63) - 1, 2**64, 10**300, -(10**4000)])
LEAVES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    NASTY_INTS,
    st.floats(allow_nan=False, allow_infinity=False),
    NASTY_FLOATS,
    st.text(max_size=12),
    st.sampled_from(["\x00", "a\ud800", "1e+300", "-0.0"]),
)
JSON_VALUES = st.recursive(
    LEAVES,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.text(max_size=6), inner, max_size=4),
        st.dictionaries(st.integers(-2, 2), inner, min_size=1, max_size=2),  # refused
    ),
    max_leaves=12,
)


class OnLoop:
    """Run coroutines on the test's event loop from hypothesis' worker thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    def __call__(self, make: Callable[[], Awaitable[T]]) -> T:
        async def run() -> T:
            return await make()

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout=60)


async def test_args_and_results_come_back_equal_or_are_refused(queue: QueueFixture) -> None:
    dsn, schema, conn = queue
    task: Task[Any] = Task("echo")
    received: dict[int, Any] = {}

    async def echo(ctx: JobContext, args: Any) -> Any:
        received[ctx.task_id] = args
        return args

    worker = Scheduler(
        dsn, worker_id="echo-w", schema=schema, poll_interval=0.05, maintenance_interval=0.05
    )
    worker.register(task, echo)
    on_loop = OnLoop(asyncio.get_running_loop())

    async def finished(task_id: int) -> Any:
        async def done() -> bool:
            run = await run_state(conn, task_id, schema=schema)
            return run.state.value in ("succeeded", "failed")

        await wait_until(done)
        return await run_state(conn, task_id, schema=schema)

    @settings(
        max_examples=120,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(values=st.lists(JSON_VALUES, min_size=1, max_size=4), many=st.booleans())
    def check(values: list[Any], many: bool) -> None:
        accepted: list[tuple[int, Any]] = []
        if many:  # one statement for all: refused as a whole if one value is
            with contextlib.suppress(ArgsEncodingError):
                ids = on_loop(lambda: enqueue_many(conn, task, values, schema=schema))
                accepted = list(zip(ids, values, strict=True))
        else:
            for value in values:
                try:
                    done = on_loop(lambda v=value: enqueue(conn, task, v, schema=schema))  # type: ignore[misc]
                except ArgsEncodingError:
                    continue  # refused with the typed error: nothing stored (checked below)
                accepted.append((done.id, value))
        stored_count = on_loop(
            lambda: conn.fetchval(
                f'SELECT count(*) FROM "{schema}".tasks WHERE id <> ALL($1::bigint[])',
                [*received, *(i for i, _ in accepted)],
            )
        )
        assert stored_count == 0, "a refused enqueue stored something"
        tally["stored"] += len(accepted)
        tally["refused"] += len(values) - len(accepted)
        for task_id, value in accepted:
            run = on_loop(lambda t=task_id: finished(t))  # type: ignore[misc]
            assert same(received[task_id], value), (value, received[task_id])
            if run.state.value == "succeeded":
                assert same(run.result, value), (value, run.result)
            else:  # the result may be refused (64 KiB), never silently changed
                assert run.last_error is not None
                assert run.last_error.startswith("ResultEncodingError")

    tally: collections.Counter[str] = collections.Counter()
    async with running(worker):
        await asyncio.to_thread(check)
        assert worker.health() is Health.HEALTHY
    # The property was exercised both ways: values that went through, values refused.
    assert tally["stored"] >= 50, tally
    assert tally["refused"] >= 10, tally
