"""Hostile input at every public entry point of the work queue (issue 10, item 5).

Each test drives one entry point with hypothesis-generated values mixing valid ones with
lone surrogates, NUL and control characters, 10 KB strings, NaN/inf/negative/zero numbers,
ints beyond 32 and 64 bits and beyond what ``str()`` converts, deeply nested or cyclic
JSON, naive and extreme datetimes, and wrong types. Only the entry point's documented
errors may come out (the queue's typed errors, which subclass ``ValueError`` /
``TypeError`` / ``LookupError``), never a driver's or the interpreter's; and a call that
raised stored nothing. Calls that succeed are checked and cleaned up.

Hypothesis runs in a worker thread; each example awaits the queue on the test's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta, timezone
from typing import Any, TypeVar

import asyncpg
import attrs
import psycopg
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from steeple.core.backoff import Backoff
from steeple.core.errors import ConfigurationError, InvalidCronExpression
from steeple.postgres.queue import (
    ArgsEncodingError,
    EnqueueOptions,
    JobError,
    JobExistsError,
    JobNotFoundError,
    QueueConfigurationError,
    QueueTypeError,
    Scheduler,
    SchemaVersionMismatchError,
    Task,
    TaskNotFoundError,
    UnknownTaskError,
    UnsupportedConnectionError,
    cancel,
    enqueue,
    enqueue_many,
    enqueue_many_sync,
    enqueue_sync,
    jobs,
    prune_terminal,
    run_state,
)
from steeple.testing import FakeClock

pytestmark = pytest.mark.postgres

T = TypeVar("T")
EXAMPLES = settings(
    max_examples=150,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# --- hostile values ---------------------------------------------------------------------------


DSN = "postgresql://nobody@127.0.0.1:1/none"  # never connected to: the checks come first


def _deep(depth: int, leaf: Any = 0) -> Any:
    value: Any = leaf
    for _ in range(depth):
        value = [value]
    return value


def _cyclic() -> Any:
    loop: list[Any] = []
    loop.append(loop)
    return loop


class _Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no message for you")


# Ints whose str() raises ValueError (more than 4300 digits). Drawn through builds():
# hypothesis validates sampled_from() elements by repr(), which such an int refuses.
HUGE_INTS = st.builds(pow, st.just(10), st.sampled_from([4301, 5000]))
WRONG_TYPES = st.sampled_from(
    [None, b"bytes", bytearray(b"x"), object(), [], {}, set(), 1j, Ellipsis, print]
)
ANY_TEXT = st.text(st.characters(exclude_categories=()), max_size=40)  # surrogates too
TEXTS = st.one_of(
    st.sampled_from(
        ["", " ", "\x00", "a\x00b", "\ud800", "x\udfffy", "\n", "\x7f", "x" * 201, "x" * 10_000]
    ),
    ANY_TEXT,
    st.text(min_size=1, max_size=20),  # mostly valid names
)
NAMES = st.one_of(TEXTS, WRONG_TYPES, st.integers())
INTS = st.one_of(
    st.sampled_from(
        [0, -1, 1, 2**31 - 1, 2**31, -(2**31), 2**63 - 1, 2**63, -(2**63) - 1, 2**64, True]
    ),
    HUGE_INTS,
    st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
    WRONG_TYPES,
)
SECONDS = st.one_of(
    st.sampled_from([math.nan, math.inf, -math.inf, 0, 0.0, -0.0, -1, 1e-9, 1e300, True]),
    HUGE_INTS,
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(),
    st.timedeltas(),
    st.sampled_from([timedelta.max, timedelta.min, timedelta(0), timedelta(microseconds=-1)]),
    WRONG_TYPES,
    st.text(max_size=3),
)
TIMEDELTAS = st.one_of(
    st.timedeltas(),
    st.sampled_from([timedelta.max, timedelta.min, timedelta(0), timedelta(days=400)]),
    SECONDS,
)
OFFSETS = st.sampled_from(
    [UTC, timezone(timedelta(hours=14)), timezone(-timedelta(hours=23, minutes=59))]
)
DATETIMES = st.one_of(
    st.datetimes(),  # naive
    st.datetimes(timezones=OFFSETS),
    st.sampled_from(
        [
            datetime.min.replace(tzinfo=timezone(timedelta(hours=14))),
            datetime.max.replace(tzinfo=timezone(-timedelta(hours=23))),
            datetime.min.replace(tzinfo=UTC),
            datetime.max.replace(tzinfo=UTC),
        ]
    ),
    WRONG_TYPES,
    st.text(max_size=5),
)
JSON_LEAVES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.sampled_from([2**63, -(2**63) - 1, 10**300]),
    HUGE_INTS,
    st.floats(allow_nan=True, allow_infinity=True),
    ANY_TEXT,
)
ARGS = st.one_of(
    st.recursive(
        JSON_LEAVES,
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(ANY_TEXT, inner, max_size=4),
        max_leaves=12,
    ),
    st.sampled_from([_deep(900), _deep(2000), _deep(50_000), {"x": _deep(3000)}]),
    st.builds(_cyclic),
    st.dictionaries(st.integers() | st.tuples(st.integers()), st.integers(), min_size=1),
    WRONG_TYPES,
    st.just("x" * (1024 * 1024 + 1)),
)


@attrs.frozen
class AttrsArgs:
    value: Any


@dataclasses.dataclass(frozen=True)
class DataArgs:
    value: Any


VALID_TASKS = st.one_of(
    st.builds(Task, st.text(min_size=1, max_size=30).filter(lambda s: s.isprintable())),
    st.just(Task("hostile.attrs", AttrsArgs)),
    st.just(Task("hostile.data", DataArgs)),
)
TASKS = st.one_of(
    VALID_TASKS,
    VALID_TASKS,
    VALID_TASKS,
    st.just(Task("hostile.attrs", AttrsArgs)),
    st.just(Task("hostile.data", DataArgs)),
    WRONG_TYPES,
    st.text(max_size=5),
)
TYPED_ARGS = st.one_of(ARGS, ARGS.map(AttrsArgs), ARGS.map(DataArgs))
BACKOFFS = st.one_of(
    st.just(Backoff()),
    st.builds(
        Backoff,
        initial=st.timedeltas(min_value=timedelta(microseconds=1), max_value=timedelta(days=1)),
        maximum=st.sampled_from(
            [timedelta(days=1), timedelta(days=366), timedelta(days=367), timedelta.max]
        ),
        # Core's Backoff refuses factors beyond the queue's 32-bit column at construction
        # (test_backoff_factor_beyond_the_factor_column_is_refused_before_any_enqueue).
        factor=st.sampled_from([1, 2, 2**31 - 1]),
    ),
    WRONG_TYPES,
)
OPTION_VALUES = st.fixed_dictionaries(
    {},
    optional={
        "run_at": DATETIMES,
        "delay": TIMEDELTAS,
        "priority": INTS,
        "lease_duration": TIMEDELTAS,
        "max_attempts": INTS,
        "backoff": BACKOFFS,
        "dedup_key": NAMES,
    },
)
SCHEMAS = st.one_of(st.sampled_from(["Bad-Schema", "", "a" * 64, "x\x00", "\ud800"]), WRONG_TYPES)

QUEUE_ERRORS = (QueueConfigurationError, ArgsEncodingError)


def make_options(values: dict[str, Any]) -> EnqueueOptions:
    return EnqueueOptions(**values)


OPTIONS = st.one_of(st.none(), OPTION_VALUES.map(lambda v: v), WRONG_TYPES)


def build_options(raw: Any) -> Any:
    """Options as a caller would pass them: None, EnqueueOptions, or something else."""
    if isinstance(raw, dict):
        return EnqueueOptions(**raw)  # may raise a documented error
    return raw


# --- plumbing ---------------------------------------------------------------------------------


def outcome(call: Callable[[], T], allowed: tuple[type[BaseException], ...]) -> T | None:
    """Run ``call``; return its value, or None after a documented error; fail on any other."""
    try:
        value = call()
    except allowed as exc:
        _event(f"refused: {type(exc).__name__}")
        return None
    except BaseException as exc:
        raise AssertionError(f"undocumented {type(exc).__name__}: {exc!r}"[:2000]) from exc
    _event("accepted")
    return value


def _event(what: str) -> None:
    # Shown by --hypothesis-show-statistics: how many examples each outcome got.
    with contextlib.suppress(Exception):
        event(what)


class OnLoop:
    """Run coroutines on the test's event loop from hypothesis' worker thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    def __call__(self, make: Callable[[], Awaitable[T]]) -> T:
        async def run() -> T:
            return await make()

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout=60)


async def hypothesize(test: Callable[[], None]) -> None:
    await asyncio.to_thread(test)


async def counts(conn: asyncpg.Connection, schema: str) -> tuple[int, int, int]:
    row = await conn.fetchrow(
        f'SELECT (SELECT count(*) FROM "{schema}".tasks), (SELECT count(*) FROM "{schema}".jobs),'
        f' (SELECT count(*) FROM "{schema}".attempts)'
    )
    assert row is not None
    return int(row[0]), int(row[1]), int(row[2])


async def clear(conn: asyncpg.Connection, schema: str) -> None:
    await conn.execute(
        f'TRUNCATE "{schema}".tasks, "{schema}".jobs, "{schema}".attempts, '
        f'"{schema}".task_dependencies'
    )


# --- values: Task, EnqueueOptions, JobError ---------------------------------------------------


@EXAMPLES
@given(name=NAMES, args_type=st.one_of(st.none(), st.just(AttrsArgs), WRONG_TYPES, st.just(int)))
def test_task_definitions(name: Any, args_type: Any) -> None:
    task = outcome(lambda: Task(name, args_type), (QueueConfigurationError,))
    if task is not None:
        assert task.name == name


@EXAMPLES
@given(values=OPTION_VALUES)
def test_enqueue_options(values: dict[str, Any]) -> None:
    options = outcome(lambda: EnqueueOptions(**values), (QueueConfigurationError,))
    if options is not None:
        assert options.run_at is None or options.run_at.tzinfo is UTC
        # What a valid options object holds always fits its columns.
        priority, attempts, _lease, b_init, b_max, factor, _jitter = options.snapshot()
        assert -(2**31) <= priority < 2**31
        assert 1 <= attempts < 2**31
        assert 1 <= factor < 2**31
        assert 0 < b_init <= b_max < 2**63


@EXAMPLES
@given(
    when=DATETIMES,
    delay=TIMEDELTAS,
    extra=st.dictionaries(
        st.sampled_from(["priority", "run_at", "delay", "bogus", "dedup_key"]), INTS, max_size=2
    ),
)
def test_enqueue_option_constructors(when: Any, delay: Any, extra: dict[str, Any]) -> None:
    allowed = (QueueConfigurationError,)
    outcome(lambda: EnqueueOptions.at(when, **extra), allowed)
    outcome(lambda: EnqueueOptions.after(delay, **extra), allowed)
    outcome(lambda: EnqueueOptions.immediate(**extra), allowed)


@EXAMPLES
@given(message=st.one_of(TEXTS, WRONG_TYPES), delay=st.one_of(st.none(), TIMEDELTAS))
def test_job_errors(message: Any, delay: Any) -> None:
    outcome(lambda: JobError.retry(message, delay), (QueueConfigurationError,))
    outcome(lambda: JobError.permanent(message), ())


@EXAMPLES
@given(task=TASKS, args=TYPED_ARGS)
def test_encoding_args(task: Any, args: Any) -> None:
    if isinstance(task, Task):
        text = outcome(lambda: task.encode(args), (ArgsEncodingError,))
        if text is not None:
            text.encode("utf-8")  # storable
            assert "\x00" not in text


# --- enqueue on each driver ---------------------------------------------------------------------


@pytest.fixture
async def psycopg_conns(queue: Any) -> Any:
    dsn, _schema, _conn = queue
    async_conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
    sync_conn: psycopg.Connection[Any] = await asyncio.to_thread(
        lambda: psycopg.Connection.connect(dsn, autocommit=True)
    )
    try:
        yield async_conn, sync_conn
    finally:
        await async_conn.close()
        await asyncio.to_thread(sync_conn.close)


ENQUEUE_ERRORS = (*QUEUE_ERRORS, UnsupportedConnectionError)


async def test_enqueue_with_every_driver(queue: Any, psycopg_conns: Any) -> None:
    _dsn, schema, conn = queue
    async_pg, sync_pg = psycopg_conns
    on_loop = OnLoop(asyncio.get_running_loop())

    @EXAMPLES
    @given(
        driver=st.sampled_from(["asyncpg", "psycopg", "psycopg_sync", "bogus"]),
        task=TASKS,
        args=TYPED_ARGS,
        raw_options=OPTIONS,
        schema_choice=st.one_of(st.just(schema), st.just(schema), SCHEMAS),
    )
    def check(driver: str, task: Any, args: Any, raw_options: Any, schema_choice: Any) -> None:
        options = outcome(lambda: build_options(raw_options), (QueueConfigurationError,))
        if options is None and raw_options is not None:
            return  # the options themselves were refused, with a documented error
        if driver == "psycopg_sync":
            done = outcome(
                lambda: enqueue_sync(sync_pg, task, args, options, schema=schema_choice),
                ENQUEUE_ERRORS,
            )
        else:
            target = {"asyncpg": conn, "psycopg": async_pg, "bogus": object()}[driver]
            done = outcome(
                lambda: on_loop(lambda: enqueue(target, task, args, options, schema=schema_choice)),
                ENQUEUE_ERRORS,
            )
        stored = on_loop(lambda: counts(conn, schema))
        if done is None:
            assert stored == (0, 0, 0), "a refused enqueue stored something"
        else:
            assert stored[0] == 1
            on_loop(lambda: clear(conn, schema))

    await hypothesize(check)


async def test_enqueue_many_with_every_driver(queue: Any, psycopg_conns: Any) -> None:
    _dsn, schema, conn = queue
    async_pg, sync_pg = psycopg_conns
    on_loop = OnLoop(asyncio.get_running_loop())

    @EXAMPLES
    @given(
        driver=st.sampled_from(["asyncpg", "psycopg", "psycopg_sync"]),
        task=TASKS,
        args_list=st.one_of(st.lists(TYPED_ARGS, max_size=4), TEXTS, WRONG_TYPES),
        raw_options=OPTIONS,
    )
    def check(driver: str, task: Any, args_list: Any, raw_options: Any) -> None:
        options = outcome(lambda: build_options(raw_options), (QueueConfigurationError,))
        if options is None and raw_options is not None:
            return
        if driver == "psycopg_sync":
            ids = outcome(
                lambda: enqueue_many_sync(sync_pg, task, args_list, options, schema=schema),
                ENQUEUE_ERRORS,
            )
        else:
            target = conn if driver == "asyncpg" else async_pg
            ids = outcome(
                lambda: on_loop(
                    lambda: enqueue_many(target, task, args_list, options, schema=schema)
                ),
                ENQUEUE_ERRORS,
            )
        stored = on_loop(lambda: counts(conn, schema))
        if ids is None:
            assert stored == (0, 0, 0), "a refused enqueue_many stored something"
        else:
            assert stored[0] == len(ids) == len(args_list)
            on_loop(lambda: clear(conn, schema))

    await hypothesize(check)


# --- recurring jobs ---------------------------------------------------------------------------

CRONS = st.one_of(
    st.sampled_from(["* * * * *", "0 0 30 2 *", "*/0 * * * *", "\ud800 * * * *", "* * * * *\x00"]),
    TEXTS,
    WRONG_TYPES,
)


class BadClock:
    def __init__(self, value: Any) -> None:
        self.value = value

    def now(self) -> Any:
        return self.value


CLOCKS = st.one_of(
    st.none(),
    DATETIMES.map(BadClock),
    WRONG_TYPES,
)
JOB_ERRORS = (*QUEUE_ERRORS, InvalidCronExpression, JobExistsError, JobNotFoundError)


async def test_job_declarations(queue: Any) -> None:
    _dsn, schema, conn = queue
    on_loop = OnLoop(asyncio.get_running_loop())

    @EXAMPLES
    @given(
        ensure=st.booleans(),
        name=NAMES,
        task=TASKS,
        cron=CRONS,
        args=TYPED_ARGS,
        raw_options=OPTIONS,
        clock=CLOCKS,
    )
    def check(
        ensure: bool, name: Any, task: Any, cron: Any, args: Any, raw_options: Any, clock: Any
    ) -> None:
        options = outcome(lambda: build_options(raw_options), (QueueConfigurationError,))
        if options is None and raw_options is not None:
            return
        declare = jobs.ensure_job if ensure else jobs.create
        info = outcome(
            lambda: on_loop(
                lambda: declare(conn, name, task, cron, args, options, schema=schema, clock=clock)
            ),
            JOB_ERRORS,
        )
        stored = on_loop(lambda: counts(conn, schema))
        if info is None:
            assert stored == (0, 0, 0), "a refused job declaration stored something"
        else:
            assert stored == (0, 1, 0)
            on_loop(lambda: clear(conn, schema))

    await hypothesize(check)


async def test_job_operations(queue: Any) -> None:
    _dsn, schema, conn = queue
    on_loop = OnLoop(asyncio.get_running_loop())
    await jobs.create(conn, "existing", Task("t"), "0 0 * * *", {}, schema=schema)
    before = await conn.fetchrow(f'SELECT * FROM "{schema}".jobs')

    @EXAMPLES
    @given(
        operation=st.sampled_from(["get", "pause", "resume", "reschedule", "delete"]),
        name=NAMES,
        cron=CRONS,
        clock=CLOCKS,
        schema_choice=st.one_of(st.just(schema), st.just(schema), SCHEMAS),
    )
    def check(operation: str, name: Any, cron: Any, clock: Any, schema_choice: Any) -> None:
        def call() -> Awaitable[Any]:
            if operation == "get":
                return jobs.get(conn, name, schema=schema_choice)
            if operation == "pause":
                return jobs.pause(conn, name, schema=schema_choice)
            if operation == "resume":
                return jobs.resume(conn, name, schema=schema_choice, clock=clock)
            if operation == "reschedule":
                return jobs.reschedule(conn, name, cron, schema=schema_choice, clock=clock)
            return jobs.delete(conn, name, schema=schema_choice)

        outcome(lambda: on_loop(call), JOB_ERRORS)
        # No hostile name can reach the one existing job; nothing else exists.
        after = on_loop(lambda: conn.fetch(f'SELECT * FROM "{schema}".jobs'))
        assert [dict(r) for r in after] == [dict(before)]
        assert on_loop(lambda: counts(conn, schema))[0] == 0

    await hypothesize(check)


async def test_materialize_due(queue: Any) -> None:
    _dsn, schema, conn = queue
    on_loop = OnLoop(asyncio.get_running_loop())

    @EXAMPLES
    @given(
        limit=st.one_of(st.integers(min_value=1, max_value=10_000), INTS),
        clock=st.one_of(st.none(), st.builds(FakeClock, st.just(datetime.now(UTC))), CLOCKS),
    )
    def check(limit: Any, clock: Any) -> None:
        made = outcome(
            lambda: on_loop(
                lambda: jobs.materialize_due(conn, schema=schema, clock=clock, limit=limit)
            ),
            QUEUE_ERRORS,
        )
        assert made in (None, 0)
        assert on_loop(lambda: counts(conn, schema)) == (0, 0, 0)

    await hypothesize(check)


# --- task operations --------------------------------------------------------------------------


async def test_run_state_cancel_and_prune(queue: Any) -> None:
    _dsn, schema, conn = queue
    on_loop = OnLoop(asyncio.get_running_loop())
    kept = await enqueue(conn, Task("kept"), {}, schema=schema)

    @EXAMPLES
    @given(
        task_id=st.one_of(st.integers(min_value=-(2**63), max_value=2**63 - 1), INTS),
        older_than=st.one_of(st.timedeltas(timedelta(0), timedelta(days=1000)), TIMEDELTAS),
        limit=st.one_of(st.integers(min_value=1, max_value=10_000), INTS),
        schema_choice=st.one_of(st.just(schema), st.just(schema), SCHEMAS),
    )
    def check(task_id: Any, older_than: Any, limit: Any, schema_choice: Any) -> None:
        if task_id == kept.id:
            task_id = -task_id
        errors = (QueueConfigurationError, TaskNotFoundError)
        outcome(lambda: on_loop(lambda: run_state(conn, task_id, schema=schema_choice)), errors)
        outcome(lambda: on_loop(lambda: cancel(conn, task_id, schema=schema_choice)), errors)
        pruned = outcome(
            lambda: on_loop(lambda: prune_terminal(conn, older_than, limit, schema=schema_choice)),
            (QueueConfigurationError,),
        )
        assert pruned in (None, 0)
        state = on_loop(lambda: run_state(conn, kept.id, schema=schema))
        assert state.state.value == "pending"
        assert on_loop(lambda: counts(conn, schema)) == (1, 0, 0)

    await hypothesize(check)


# --- the worker's options -----------------------------------------------------------------------


SCHEDULER_OPTIONS: dict[str, st.SearchStrategy[Any]] = {
    "worker_id": NAMES,
    "poll_interval": SECONDS,
    "maintenance_interval": SECONDS,
    "query_timeout": SECONDS,
    "loop_lag_threshold": st.one_of(st.none(), SECONDS),
    "concurrency": INTS,
    "batch_size": st.one_of(st.none(), INTS),
    "listen": st.one_of(st.booleans(), WRONG_TYPES, st.just("no")),
    "require_durable": st.one_of(st.booleans(), st.just(0)),
    "clock": st.one_of(st.none(), WRONG_TYPES, st.builds(FakeClock, st.just(datetime.now(UTC)))),
    "random": st.one_of(st.none(), WRONG_TYPES),
    "schema": st.one_of(st.just("steeple_queue"), SCHEMAS),
    "pool_or_dsn": st.one_of(
        st.just("postgresql://nobody@127.0.0.1:1/none"),
        st.sampled_from(["", "\x00", "\ud800"]),
        WRONG_TYPES,
    ),
}


@EXAMPLES
@given(data=st.data(), names=st.sets(st.sampled_from(sorted(SCHEDULER_OPTIONS)), max_size=3))
def test_scheduler_options(data: st.DataObject, names: set[str]) -> None:
    """One to three options hostile at a time, the others valid."""
    options: dict[str, Any] = {"worker_id": "w", "pool_or_dsn": DSN}
    for name in sorted(names):
        options[name] = data.draw(SCHEDULER_OPTIONS[name], label=name)
    source = options.pop("pool_or_dsn")
    worker = outcome(lambda: Scheduler(source, **options), (QueueConfigurationError,))
    if worker is not None:
        assert worker.worker_id == options["worker_id"]


async def test_register_and_run_until_shutdown(pg_schema: tuple[str, str]) -> None:
    dsn, schema = pg_schema  # no queue installed: a valid run stops at the schema check
    on_loop = OnLoop(asyncio.get_running_loop())

    async def handler(ctx: Any, args: Any) -> None:
        return None

    @EXAMPLES
    @given(
        task=st.one_of(VALID_TASKS, TASKS),
        handler_choice=st.one_of(st.just(handler), st.just(handler), WRONG_TYPES),
        stop=st.one_of(st.just("event"), WRONG_TYPES),
        drain=SECONDS,
        hard_stop=st.one_of(st.none(), st.just("event"), WRONG_TYPES),
    )
    def check(task: Any, handler_choice: Any, stop: Any, drain: Any, hard_stop: Any) -> None:
        worker = Scheduler(dsn, worker_id="hostile", schema=schema, query_timeout=10)

        def register() -> bool:
            worker.register(task, handler_choice)
            return True

        registered = outcome(register, (QueueConfigurationError, UnknownTaskError))
        if registered is None:
            return

        async def run() -> None:
            event = asyncio.Event() if stop == "event" else stop
            if isinstance(event, asyncio.Event):
                event.set()
            hard = asyncio.Event() if hard_stop == "event" else hard_stop
            await worker.run_until_shutdown(event, drain_timeout=drain, hard_stop=hard)

        outcome(lambda: on_loop(run), (QueueConfigurationError, SchemaVersionMismatchError))

    await hypothesize(check)


async def test_failures_whose_messages_cannot_be_stored_are_still_recorded(queue: Any) -> None:
    """A handler's exception text with NUL or lone surrogates (or none at all) is recorded."""
    dsn, schema, conn = queue
    hostile: Task[Any] = Task("hostile.failure")
    messages = ["nul \x00 inside", "lone \ud800 surrogate", "x" * 10_000]
    ids = [(await enqueue(conn, hostile, {"i": i}, schema=schema)).id for i in range(4)]

    async def fail(ctx: Any, args: Any) -> None:
        i = args["i"]
        if i == len(messages):
            raise _Unprintable()
        raise ValueError(messages[i])

    worker = Scheduler(dsn, worker_id="hostile", schema=schema, poll_interval=0.1)
    worker.register(hostile, fail)
    stop = asyncio.Event()
    run = asyncio.create_task(worker.run_until_shutdown(stop))
    try:
        for task_id in ids:
            for _ in range(600):
                state = await run_state(conn, task_id, schema=schema)
                if state.state.value == "failed" or run.done():
                    break
                await asyncio.sleep(0.05)
            assert state.state.value == "failed", state
            assert state.last_error is not None
            assert state.last_error.startswith("not retried (plain exceptions are terminal")
            assert ": ValueError: " in state.last_error or ": _Unprintable: " in state.last_error
    finally:
        stop.set()
        await asyncio.wait_for(run, 30)
    assert worker.stats.failed == 4


# --- the cases the review named, one by one ----------------------------------------------------


NAMED_ENQUEUE_CASES = [
    ("lone surrogate in a value", {"k": "\ud800"}, None, ArgsEncodingError),
    ("lone surrogate in a key", {"\udfff": 1}, None, ArgsEncodingError),
    ("NaN", {"x": math.nan}, None, ArgsEncodingError),
    ("infinity", [math.inf], None, ArgsEncodingError),
    ("deep nesting", _deep(5000), None, ArgsEncodingError),
    ("an int str() refuses", {"n": 10**5000}, None, ArgsEncodingError),
    ("a cycle", _cyclic(), None, ArgsEncodingError),
    ("surrogate dedup key", {}, {"dedup_key": "\ud800"}, QueueConfigurationError),
    ("NUL dedup key", {}, {"dedup_key": "a\x00"}, QueueConfigurationError),
    ("priority beyond 32 bits", {}, {"priority": 2**31}, QueueConfigurationError),
    ("attempts beyond 64 bits", {}, {"max_attempts": 2**64}, QueueConfigurationError),
    ("endless lease", {}, {"lease_duration": timedelta.max}, QueueConfigurationError),
    ("naive run_at", {}, {"run_at": datetime(2030, 1, 1)}, QueueConfigurationError),
    ("negative delay", {}, {"delay": timedelta(seconds=-1)}, QueueConfigurationError),
    (
        "backoff beyond bigint microseconds",
        {},
        {"backoff": Backoff(maximum=timedelta.max)},
        QueueConfigurationError,
    ),
    ("options of the wrong type", {}, "immediately", QueueTypeError),
]


def test_backoff_factor_beyond_the_factor_column_is_refused_before_any_enqueue() -> None:
    # The queue stores the factor in a 32-bit column; core's Backoff refuses more at once.
    with pytest.raises(ConfigurationError):
        Backoff(factor=2**40)


@pytest.mark.parametrize(
    ("args", "options", "error"),
    [case[1:] for case in NAMED_ENQUEUE_CASES],
    ids=[case[0] for case in NAMED_ENQUEUE_CASES],
)
async def test_named_enqueue_cases(queue: Any, args: Any, options: Any, error: type) -> None:
    _dsn, schema, conn = queue

    async def attempt() -> None:
        built = EnqueueOptions(**options) if isinstance(options, dict) else options
        await enqueue(conn, Task("named"), args, built, schema=schema)

    with pytest.raises(error):
        await attempt()
    assert await counts(conn, schema) == (0, 0, 0)


@pytest.mark.parametrize(
    "call",
    [
        lambda: Task("\ud800"),
        lambda: Task("a\x00b"),
        lambda: Scheduler(DSN, worker_id="w", query_timeout=math.nan),
        lambda: Scheduler(DSN, worker_id="w", poll_interval=math.inf),
        lambda: Scheduler(DSN, worker_id="w", poll_interval=-1),
        lambda: Scheduler(DSN, worker_id="w", poll_interval=0),
        lambda: Scheduler(DSN, worker_id="w", maintenance_interval=math.nan),
        lambda: Scheduler(DSN, worker_id="\ud800"),
        lambda: Scheduler(DSN, worker_id="w", listen="no"),  # type: ignore[arg-type]
        lambda: EnqueueOptions.at(datetime(2030, 1, 1)),
        lambda: EnqueueOptions.at("tomorrow"),  # type: ignore[arg-type]
        lambda: EnqueueOptions.after(timedelta.max),
        lambda: JobError.retry("later", delay=timedelta.max),
    ],
    ids=[
        "surrogate task name", "NUL task name", "NaN query_timeout", "infinite poll_interval",
        "negative poll_interval", "zero poll_interval", "NaN maintenance_interval",
        "surrogate worker_id", "string for a bool", "naive at()", "string at()",
        "endless after()", "endless retry delay",
    ],
)  # fmt: skip
def test_named_value_cases(call: Callable[[], Any]) -> None:
    with pytest.raises(QueueConfigurationError):
        call()


async def test_named_operation_cases(queue: Any) -> None:
    _dsn, schema, conn = queue
    with pytest.raises(QueueConfigurationError):
        await run_state(conn, 2**63, schema=schema)
    with pytest.raises(QueueConfigurationError):
        await cancel(conn, -(2**63) - 1, schema=schema)
    with pytest.raises(QueueTypeError):
        await run_state(conn, "1", schema=schema)  # type: ignore[arg-type]
    with pytest.raises(QueueConfigurationError):
        await prune_terminal(conn, timedelta.max, schema=schema)
    with pytest.raises(QueueConfigurationError):
        await prune_terminal(conn, timedelta(0), 2**63, schema=schema)
    with pytest.raises(QueueConfigurationError):
        await jobs.pause(conn, "\ud800", schema=schema)
    with pytest.raises(QueueConfigurationError):
        await jobs.delete(conn, "a\x00", schema=schema)
    with pytest.raises(ArgsEncodingError):
        await jobs.create(conn, "j", Task("t"), "* * * * *", {"x": math.nan}, schema=schema)
    worker = Scheduler(DSN, worker_id="w")
    worker.register(Task("t"), lambda ctx, args: asyncio.sleep(0))
    with pytest.raises(QueueConfigurationError):
        await worker.run_until_shutdown(asyncio.Event(), drain_timeout=math.nan)
    assert await counts(conn, schema) == (0, 0, 0)
