"""The crash-point registry: every registered point is reached, every call names one.

One in-process scenario (the hook armed with :func:`steeple.runtime.crashpoints.arm`) drives
the recurring store both ways (batched relay, and tick/claim/relay_many) and a queue
worker through claims, renewals, completions, a retry and a recurring job; every
registered name must be reached. The environment switches are checked here too.
"""

from __future__ import annotations

import ast
import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from crash_matrix import yearly_cron
from crash_worker import CONFIG, KEY_BYTES, FileBroker
from pg_cluster import poll
from queue_support import installed_queue
from steeple.core import (
    MissedRunPolicy,
    RecurringDefinition,
    ScheduledMessage,
    SystemClock,
)
from steeple.engine.crashpoints import ENGINE_CRASH_POINTS
from steeple.keyring import Keyring, StorageKey
from steeple.postgres import PostgresRecurringStore, RecurringRelay
from steeple.postgres.queue import (
    EnqueueOptions,
    JobContext,
    JobError,
    Scheduler,
    Task,
    enqueue,
    jobs,
)
from steeple.postgres.queue._crashpoints import QUEUE_CRASH_POINTS
from steeple.runtime import crashpoints
from steeple.runtime.crashpoints import (
    CRASH_POINTS,
    arm,
    crash_point,
    disarm,
    register_crash_points,
)
from steeple.testing import FakeClock

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def reached() -> Iterator[set[str]]:
    """The names reached while the test runs (the hook armed in this process)."""
    names: set[str] = set()

    def hook(name: str) -> None:
        assert name in CRASH_POINTS, name
        names.add(name)

    arm(hook)
    try:
        yield names
    finally:
        disarm()


def test_every_literal_crash_point_in_the_sources_is_registered() -> None:
    calls = 0
    for source in sorted((ROOT / "packages").glob("*/src/steeple/**/*.py")):
        for node in ast.walk(ast.parse(source.read_text(), str(source))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "crash_point"
            ):
                calls += 1
                [arg] = node.args
                if isinstance(arg, ast.Constant):
                    assert arg.value in CRASH_POINTS, (source, arg.value)
    assert calls >= 19


def test_an_unarmed_crash_point_does_nothing() -> None:
    assert crashpoints._hook is None  # the test process has no STEEPLE_CRASH_* set
    crash_point("tick.begin")
    crash_point("not even registered")  # unchecked when unarmed: zero cost


def test_each_product_registers_its_own_points() -> None:
    assert dict(CRASH_POINTS) == {**ENGINE_CRASH_POINTS, **QUEUE_CRASH_POINTS}
    assert all(name.startswith("queue.") for name in QUEUE_CRASH_POINTS)
    assert not [name for name in ENGINE_CRASH_POINTS if name.startswith("queue.")]
    register_crash_points({"tick.begin": ENGINE_CRASH_POINTS["tick.begin"]})  # again: a no-op
    with pytest.raises(ValueError, match="already registered"):
        register_crash_points({"tick.begin": "something else"})
    with pytest.raises(TypeError):
        CRASH_POINTS["tick.nope"] = "written past the registry"  # type: ignore[index]


def test_the_queue_and_the_engine_each_load_only_their_own_points() -> None:
    program = (
        "import sys\n"
        "import steeple.postgres.queue._claiming\n"
        "from steeple.runtime.crashpoints import CRASH_POINTS\n"
        "assert 'steeple.engine.crashpoints' not in sys.modules, 'the queue loaded the engine'\n"
        "assert all(name.startswith('queue.') for name in CRASH_POINTS), sorted(CRASH_POINTS)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr


def test_an_armed_target_that_no_product_registered_is_refused_when_reached() -> None:
    hook = crashpoints._from_environment({"STEEPLE_CRASH_AT": "tick.nope"})
    assert hook is not None
    with pytest.raises(ValueError, match=r"unknown crash point 'tick\.nope'"):
        hook("tick.begin")


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"STEEPLE_CRASH_AT": "tick.begin:0"}, "the count must be 1 or more"),
        ({"STEEPLE_CRASH_PAUSE": "tick.begin"}, "STEEPLE_CRASH_PAUSE needs STEEPLE_CRASH_DIR"),
    ],
)
def test_a_misconfigured_crash_point_is_refused(env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        crashpoints._from_environment(env)


def test_a_traced_hook_records_each_name_once_and_refuses_unregistered(tmp_path: Path) -> None:
    trace = tmp_path / "trace"
    hook = crashpoints._from_environment({"STEEPLE_CRASH_TRACE": str(trace)})
    assert hook is not None
    hook("tick.begin")
    hook("tick.begin")
    hook("claim.begin")
    assert trace.read_text().splitlines() == ["tick.begin", "claim.begin"]
    with pytest.raises(AssertionError, match="not registered"):
        hook("tick.later")


def test_the_nth_arrival_kills_the_process(tmp_path: Path) -> None:
    trace = tmp_path / "trace"
    program = (
        "from steeple.engine.crashpoints import crash_point\n"
        "crash_point('tick.begin'); print('first', flush=True)\n"
        "crash_point('tick.begin'); print('second', flush=True)\n"
    )
    env = {**os.environ, "STEEPLE_CRASH_AT": "tick.begin:2", "STEEPLE_CRASH_TRACE": str(trace)}
    done = subprocess.run(
        [sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == -signal.SIGKILL
    assert done.stdout == "first\n"
    assert trace.read_text() == "tick.begin\n"


def test_a_paused_process_waits_for_its_release(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "release")
    program = (
        "from steeple.engine.crashpoints import crash_point\n"
        "crash_point('claim.committed'); print('released', flush=True)\n"
    )
    env = {
        **os.environ,
        "STEEPLE_CRASH_PAUSE": "claim.committed",
        "STEEPLE_CRASH_DIR": str(tmp_path),
    }
    proc = subprocess.Popen(
        [sys.executable, "-c", program], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        # Opening the FIFO for writing blocks until the paused process opens it to read.
        with (tmp_path / "release").open("w") as release:
            assert (tmp_path / "paused").read_text() == "claim.committed"
            assert proc.poll() is None
            release.write("go")
        assert proc.communicate(timeout=60)[0] == "released\n"
        assert proc.returncode == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.postgres
@pytest.mark.timeout(300)
async def test_every_registered_crash_point_is_reached(
    reached: set[str], pg_schema: tuple[str, str], tmp_path: Path
) -> None:
    dsn, schema = pg_schema
    journal = str(tmp_path / "broker.jsonl")
    keyring = Keyring(StorageKey("k1", KEY_BYTES))
    start = datetime.now(UTC).replace(second=0, microsecond=0) - timedelta(minutes=3)
    store = await PostgresRecurringStore.initialize(
        dsn, CONFIG, keyring, SystemClock(), schema=schema
    )
    async with store:
        for name in ("a", "b"):
            await store.create(
                RecurringDefinition(
                    name,
                    "* * * * *",
                    start,
                    MissedRunPolicy.CATCH_UP,
                    ScheduledMessage("t", "m", b"x"),
                )
            )
        broker = FileBroker(journal)
        await store.tick(2)
        await store.relay_many(await store.claim(2), broker)  # stepwise
        await RecurringRelay(store, broker, claim_limit=2).run_once()  # batched

    task: Task[dict[str, Any]] = Task("registry")
    options = EnqueueOptions.immediate(lease_duration=timedelta(milliseconds=600))
    async with installed_queue(dsn, schema) as conn:
        await enqueue(conn, task, {"sleep": 0.5}, options, schema=schema)
        await enqueue(conn, task, {"fail_first": True}, options, schema=schema)
        now = datetime.now(UTC)
        past = FakeClock(now - timedelta(minutes=5))
        cron = yearly_cron(now - timedelta(minutes=3))  # one occurrence owed, the next in a year
        await jobs.create(conn, "job", task, cron, {}, options, schema=schema, clock=past)
        worker = Scheduler(
            dsn, worker_id="registry", schema=schema, poll_interval=0.05, maintenance_interval=0.1
        )

        async def handler(ctx: JobContext, args: Any) -> None:
            await asyncio.sleep(args.get("sleep", 0))
            if args.get("fail_first") and ctx.attempt == 1:
                raise JobError.retry("once", timedelta(0))

        worker.register(task, handler)
        stop = asyncio.Event()
        runner = asyncio.create_task(worker.run_until_shutdown(stop, drain_timeout=5))

        async def all_done() -> bool:
            states = await conn.fetch(f'SELECT state FROM "{schema}".tasks')
            return len(states) == 3 and {r[0] for r in states} == {"succeeded"}

        try:
            await poll("every task to succeed", all_done, timeout=60)
        finally:
            stop.set()
            await runner
    assert set(CRASH_POINTS) - reached == set()
