"""The in-memory queue runs an App's tasks with the worker's own rules, without a database."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from datetime import timedelta
from typing import Any

import attrs
import pytest

from steeple.core.tasks import TaskState
from steeple.postgres.queue import (
    App,
    ArgsEncodingError,
    EnqueueOptions,
    JobContext,
    JobError,
    QueueConfigurationError,
    QueueError,
    QueueTypeError,
    RetryPolicy,
    Task,
    TaskNotFoundError,
    UnsupportedConnectionError,
    cancel,
    enqueue,
    enqueue_many,
    enqueue_many_sync,
    enqueue_sync,
    list_queues,
    pause_queue,
    run_state,
)
from steeple.postgres.queue.testing import InMemoryQueue


async def test_a_retried_task_waits_behind_work_already_waiting() -> None:
    memory = InMemoryQueue(App())
    task: Task[Any] = Task("m")
    first, second, third = [(await enqueue(memory, task, {"i": i})).id for i in range(3)]
    (claimed,) = memory.claim(1)
    assert claimed.task_id == first
    assert memory.retry(first, claimed.token, timedelta(0))
    assert [c.task_id for c in memory.claim(3)] == [second, third, first]


async def test_every_enqueue_function_takes_it_where_a_connection_goes() -> None:
    app = App(schema="shop")
    declared = app.task(name="t")(_noop)
    memory = InMemoryQueue(app)
    await declared.enqueue(memory, {"a": 1})
    declared.enqueue_sync(memory, {"a": 2})
    await declared.enqueue_many(memory, [{"a": 3}, {"a": 4}])
    declared.enqueue_many_sync(memory, [{"a": 5}])
    enqueue_sync(memory, declared, {"a": 6}, schema="shop")
    await enqueue_many(memory, declared.task, [{"a": 7}], schema="shop")
    enqueue_many_sync(memory, declared, [], schema="shop")
    assert [t.args["a"] for t in memory.enqueued()] == [1, 2, 3, 4, 5, 6, 7]
    with pytest.raises(QueueConfigurationError, match="schema 'shop'"):
        await enqueue(memory, declared, {"a": 8})  # the default schema: not this queue's


async def test_run_state_and_cancel_take_it_where_a_connection_goes() -> None:
    app = App()

    @app.task(name="t")
    async def fails(ctx: JobContext, args: Any) -> None:
        raise JobError.retry("again", delay=timedelta(0))

    memory = InMemoryQueue(app)
    kept = await fails.enqueue(memory, {})
    dropped = await fails.enqueue(memory, {})
    assert await cancel(memory, dropped.id) is TaskState.CANCELLED
    await memory.run_until_idle()
    run = await run_state(memory, kept.id, history=2)
    assert (run.state, run.attempts, len(run.history)) == (TaskState.FAILED, 5, 2)
    assert run.history[-1].attempt == 5
    assert (await run_state(memory, kept.id, history=0)).history == ()
    assert (await run_state(memory, dropped.id)).state is TaskState.CANCELLED
    with pytest.raises(TaskNotFoundError):
        await run_state(memory, 99)


async def test_operations_it_does_not_model_refuse_it_plainly() -> None:
    memory = InMemoryQueue(App())
    with pytest.raises(UnsupportedConnectionError):
        await pause_queue(memory, "q")  # memory.pause_queue is the in-memory one
    with pytest.raises(UnsupportedConnectionError):
        await list_queues(memory)


async def test_options_are_snapshotted_as_on_a_database() -> None:
    app = App()
    declared = app.task(name="t", queue="q", retry=RetryPolicy(max_attempts=7))(_noop)
    memory = InMemoryQueue(app)
    await declared.enqueue(memory, {}, priority=5, delay=timedelta(minutes=1))
    await declared.enqueue(memory, {}, options=EnqueueOptions.at(memory.clock.now()))
    later, now = memory.enqueued()
    assert (later.priority, later.queue, later.run_at) == (
        5,
        "q",
        memory.clock.now() + timedelta(minutes=1),
    )
    assert now.priority == 0
    assert memory.run_state(later.id).max_attempts == 7
    with pytest.raises(ArgsEncodingError):
        await declared.enqueue(memory, {"x": -0.0})  # the database has no negative zero


@attrs.frozen
class Invoice:
    number: int
    lines: list[str]


async def test_args_types_come_back_as_instances() -> None:
    app = App()
    seen: list[Invoice] = []

    @app.task(name="invoice", args_type=Invoice)
    async def invoice(ctx: JobContext, args: Invoice) -> None:
        seen.append(args)

    memory = InMemoryQueue(app)
    await invoice.enqueue(memory, Invoice(1, ["tea"]))
    assert [t.args for t in memory.enqueued(invoice)] == [Invoice(1, ["tea"])]
    with pytest.raises(ArgsEncodingError):
        await invoice.enqueue(memory, {"number": 1})  # not an Invoice
    await memory.run_until_idle()
    assert seen == [Invoice(1, ["tea"])]


async def test_failures_are_judged_as_the_worker_judges_them() -> None:
    app = App()

    @app.task(name="permanent")
    async def permanent(ctx: JobContext, args: Any) -> None:
        raise JobError.permanent("card declined")

    @app.task(name="unexpected")
    def unexpected(ctx: JobContext, args: Any) -> None:
        raise KeyError("no retry policy: fails for good")

    @app.task(name="asks", max_attempts=2)
    async def asks(ctx: JobContext, args: Any) -> None:
        raise JobError.retry("later", delay=timedelta(hours=2))

    @app.task(name="bad-result")
    async def bad_result(ctx: JobContext, args: Any) -> object:
        return {1, 2}  # a set is not JSON

    memory = InMemoryQueue(app)
    ids = {f.name: (await f.enqueue(memory, {})).id for f in app.tasks}
    start = memory.clock.now()
    assert await memory.run_until_idle() == 4
    states = {name: memory.run_state(i) for name, i in ids.items()}
    assert states["permanent"].state is TaskState.FAILED
    assert states["permanent"].last_error == "JobError: card declined"
    assert states["unexpected"].state is TaskState.FAILED
    assert states["unexpected"].history[0].error_type == "KeyError"
    assert states["bad-result"].state is TaskState.FAILED
    assert str(states["bad-result"].history[0].error_type).endswith("ResultEncodingError")
    assert states["asks"].state is TaskState.PENDING
    assert states["asks"].run_at == start + timedelta(hours=2)  # its own delay, not backoff

    assert await memory.run_until_idle(advance_time=True) == 1
    exhausted = memory.run_state(ids["asks"])
    assert exhausted.state is TaskState.FAILED
    assert exhausted.last_error == "attempts exhausted (2/2): JobError: later"


async def test_backoff_grows_from_the_retry_policy() -> None:
    app = App()
    policy = RetryPolicy(max_attempts=4, base_delay=timedelta(seconds=3), factor=3)

    @app.task(name="flaky", retry=policy)
    async def flaky(ctx: JobContext, args: Any) -> None:
        raise RuntimeError("down")

    memory = InMemoryQueue(app)
    task = await flaky.enqueue(memory, {})
    waits = []
    for _ in range(3):
        await memory.run_until_idle()
        (waiting,) = memory.enqueued()
        waits.append(waiting.run_at - memory.clock.now())
        memory.clock.set(waiting.run_at)
    await memory.run_until_idle()
    assert waits == [timedelta(seconds=3), timedelta(seconds=9), timedelta(seconds=27)]
    run = memory.run_state(task.id)
    assert (run.state, run.attempts) == (TaskState.FAILED, 4)
    assert [a.outcome for a in run.history] == ["retried"] * 3 + ["failed"]


def _concurrency_probe(app: App, name: str, queue: str = "default") -> list[int]:
    """Declare a task whose handlers record how many of them run at once."""
    running = [0]
    peaks: list[int] = []

    async def probe(ctx: JobContext, args: Any) -> None:
        running[0] += 1
        peaks.append(running[0])
        for _ in range(5):  # yield to the other handlers of the round
            await asyncio.sleep(0)
        running[0] -= 1

    app.task(name=name, queue=queue)(probe)
    return peaks


async def test_concurrency_limits_are_honoured() -> None:
    app = App()
    free = _concurrency_probe(app, "free", "wide")
    narrow = _concurrency_probe(app, "narrow", "slim")
    single = _concurrency_probe(app, "single", "wide")
    memory = InMemoryQueue(app)
    for f in app.tasks:
        await f.enqueue_many(memory, [{}] * 4)
    memory.limit_queue("slim", max_running=1)
    memory.limit_task("single", max_running=2)
    assert await memory.run_until_idle(concurrency=8) == 12
    assert max(free) > 1
    assert max(narrow) == 1
    assert max(single) == 2
    assert memory.tasks(TaskState.SUCCEEDED) == memory.tasks()


async def test_a_queue_rate_limit_holds_the_third_start_until_the_window_frees_one() -> None:
    app = App()
    declared = app.task(name="t", queue="api")(_noop)
    memory = InMemoryQueue(app)
    info = memory.limit_queue("api", rate_limit=2, per=10)
    assert (info.rate_limit, info.rate_period) == (2, timedelta(seconds=10))
    first, second, third = [(await declared.enqueue(memory, {"i": i})).id for i in range(3)]
    start = memory.clock.now()
    assert [c.task_id for c in memory.claim(1)] == [first]
    assert memory.rate_frees_at is None  # one of two starts used: nothing held back
    memory.clock.advance(timedelta(seconds=4))
    assert [c.task_id for c in memory.claim(3)] == [second]
    # The window is full: held until the oldest start (at 0 s) is a full period old.
    assert memory.rate_frees_at == start + timedelta(seconds=10)
    memory.clock.advance(timedelta(seconds=6) - timedelta(microseconds=1))
    assert memory.claim(3) == []
    assert memory.rate_frees_at == start + timedelta(seconds=10)
    # A start exactly a period old no longer counts (the window's far boundary is out).
    memory.clock.advance(timedelta(microseconds=1))
    assert [c.task_id for c in memory.claim(3)] == [third]
    assert memory.rate_frees_at == start + timedelta(seconds=14)  # the 4 s start leaves next


async def test_advance_time_jumps_to_when_a_task_rate_window_frees_a_start() -> None:
    app = App()
    started: list[timedelta] = []
    memory = InMemoryQueue(app)
    origin = memory.clock.now()

    @app.task(name="call")
    async def call(ctx: JobContext, args: Any) -> None:
        started.append(memory.clock.now() - origin)

    assert memory.limit_task("call", rate_limit=2, per=timedelta(seconds=10)).rate_limit == 2
    await call.enqueue_many(memory, [{}] * 5)
    assert await memory.run_until_idle() == 2  # the clock stays: the third waits
    assert started == [timedelta(0)] * 2
    assert len(memory.enqueued(call)) == 3
    assert await memory.run_until_idle(advance_time=True) == 3
    seconds = timedelta(seconds=1)
    assert started == [timedelta(0)] * 2 + [10 * seconds] * 2 + [20 * seconds]
    # Removing the rate limit forgets the starts; the limits are checked as the database's.
    memory.limit_task("call")
    await call.enqueue(memory, {})
    assert await memory.run_until_idle() == 1
    with pytest.raises(QueueConfigurationError):
        memory.limit_task("call", rate_limit=2)  # no per
    with pytest.raises(QueueConfigurationError):
        memory.limit_queue("default", rate_limit=0, per=1)
    with pytest.raises(QueueTypeError):
        memory.limit_queue("default", rate_limit=2, per="10s")  # type: ignore[arg-type]


async def test_pause_holds_a_queue_and_only_the_apps_queues_are_served() -> None:
    app = App()
    declared = app.task(name="t", queue="mail")(_noop)
    memory = InMemoryQueue(app)
    await declared.enqueue(memory, {})
    await declared.enqueue(memory, {}, queue="elsewhere")  # no worker of the app serves it
    assert memory.pause_queue("mail").pending == 1
    assert await memory.run_until_idle() == 0
    memory.resume_queue("mail")
    assert await memory.run_until_idle() == 1
    assert [t.queue for t in memory.enqueued()] == ["elsewhere"]
    assert await memory.run_until_idle(queues=["elsewhere"]) == 1
    with pytest.raises(QueueTypeError):
        await memory.run_until_idle(queues="elsewhere")  # a str is not a list of queues


async def test_a_task_the_app_does_not_declare_waits() -> None:
    memory = InMemoryQueue(App())
    await enqueue(memory, Task("someone-elses"), {"x": 1})
    assert await memory.run_until_idle(advance_time=True) == 0
    assert [t.args for t in memory.enqueued("someone-elses")] == [{"x": 1}]


async def test_a_delayed_task_runs_once_its_time_comes() -> None:
    app = App()
    declared = app.task(name="t")(_noop)
    memory = InMemoryQueue(app)
    task = await declared.enqueue(memory, {}, delay=timedelta(days=1))
    assert await memory.run_until_idle() == 0
    memory.clock.advance(timedelta(days=1))
    assert await memory.run_until_idle() == 1
    assert memory.run_state(task.id).state is TaskState.SUCCEEDED


async def test_a_cancelled_running_task_is_fenced_and_told() -> None:
    app = App()
    told: list[bool] = []
    memory: InMemoryQueue

    @app.task(name="t")
    async def cancelled_midway(ctx: JobContext, args: Any) -> str:
        assert memory.cancel(ctx.task_id) is TaskState.CANCELLED
        told.append(ctx.cancelled.is_set() and ctx.lease_lost.is_set())
        return "not recorded"

    memory = InMemoryQueue(app)
    task = await cancelled_midway.enqueue(memory, {})
    await memory.run_until_idle()
    run = memory.run_state(task.id)
    assert (run.state, run.result, told) == (TaskState.CANCELLED, None, [True])


async def test_sync_handlers_run_in_a_thread_and_report_progress() -> None:
    app = App()
    threads: list[bool] = []

    @app.task(name="t")
    def work(ctx: JobContext, args: Any) -> int:
        threads.append(threading.current_thread() is threading.main_thread())
        ctx.report_progress(0.5, "half")
        return 1

    memory = InMemoryQueue(app)
    task = await work.enqueue(memory, {})
    await memory.run_until_idle()
    run = memory.run_state(task.id)
    assert threads == [False]
    assert run.result == 1
    assert run.progress is not None
    assert (run.progress.fraction, run.progress.message) == (0.5, "half")


async def test_lease_expiry_is_recovered_as_the_database_recovers_it() -> None:
    memory = InMemoryQueue(App())
    task = await enqueue(memory, Task("m"), {}, EnqueueOptions(max_attempts=2))
    for expected in (TaskState.PENDING, TaskState.FAILED):
        (claimed,) = memory.claim(1)
        memory.expire_lease(claimed.task_id)
        assert memory.recover_expired() == [(task.id, expected)]
        assert not memory.complete(claimed.task_id, claimed.token)  # fenced out
    assert [a.outcome for a in memory.run_state(task.id).history] == ["lease_expired"] * 2


async def test_work_that_never_ends_is_reported() -> None:
    app = App()
    memory: InMemoryQueue

    @app.task(name="again")
    async def again(ctx: JobContext, args: Any) -> None:
        await again.enqueue(memory, {})

    memory = InMemoryQueue(app)
    await again.enqueue(memory, {})
    with pytest.raises(QueueError, match="not idle after 50 attempts"):
        await memory.run_until_idle(max_attempts_run=50)


async def test_pruning_and_unknown_ids() -> None:
    app = App()
    declared = app.task(name="t")(_noop)
    memory = InMemoryQueue(app)
    task = await declared.enqueue(memory, {})
    await memory.run_until_idle()
    assert memory.prune(timedelta(minutes=1)) == 0
    memory.clock.advance(timedelta(minutes=1))
    assert memory.prune(timedelta(minutes=1)) == 1
    with pytest.raises(TaskNotFoundError):
        memory.run_state(task.id)


def test_it_imports_neither_steeple_testing_nor_opens_a_connection() -> None:
    code = (
        "import sys; import steeple.postgres.queue.testing; "
        "print(sorted(m for m in sys.modules if m.startswith('steeple.testing')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]"


async def _noop(ctx: JobContext, args: Any) -> None:
    return None
