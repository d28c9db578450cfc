"""Handlers that misbehave inside a real ``steeple worker`` process.

A handler raising ``SystemExit`` or ``KeyboardInterrupt`` fails its task alone: the process
goes on running the other tasks, and a real SIGINT still stops it gracefully. A plain
``def`` handler stuck forever in its thread and an async handler that swallows
cancellation cannot keep the process alive: the hard stop (a second signal, or the drain
deadline) hands their tasks back and the process exits. A handler that ignores even
being closed is handed back too, and the command ends the process shortly after.
"""

from __future__ import annotations

import functools
import signal
from datetime import timedelta
from pathlib import Path

import asyncpg
import pytest

import queue_support
from steeple.postgres import queue as q
from worker_fault_support import World, world

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

wait_until = functools.partial(queue_support.wait_until, interval=0.05, timeout=60)

APP = """
import asyncio, os, sys, threading
from pathlib import Path

from steeple.admin import WorkerApp
from steeple.postgres.queue import Task

HOME = Path(__file__).parent


def started(ctx):
    (HOME / f"started-{ctx.task_id}").touch()


def stuck(ctx, args):
    started(ctx)
    threading.Event().wait()  # forever, ignoring ctx.lease_lost


async def stubborn(ctx, args):
    started(ctx)
    while True:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            pass  # swallowed: the handler refuses to stop


async def hopeless(ctx, args):
    started(ctx)
    while True:
        try:
            await asyncio.Event().wait()
        except BaseException:
            pass  # ignores its cancellation, and being closed too


def sync_exit(ctx, args):
    sys.exit(3)


async def async_interrupt(ctx, args):
    await asyncio.sleep(0)
    raise KeyboardInterrupt


async def fine(ctx, args):
    return args


def make():
    return WorkerApp(
        tasks=[
            (Task("stuck"), stuck),
            (Task("stubborn"), stubborn),
            (Task("hopeless"), hopeless),
            (Task("sync_exit"), sync_exit),
            (Task("async_interrupt"), async_interrupt),
            (Task("fine"), fine),
        ],
        worker_id=os.environ["FAULT_WORKER"],
        drain_timeout=float(os.environ.get("FAULT_DRAIN", "60")),
    )
"""


async def _enqueue(w: World, names: list[str]) -> list[int]:
    conn = await asyncpg.connect(w.dsn, timeout=10)
    try:
        options = q.EnqueueOptions(lease_duration=timedelta(seconds=3))
        return [
            (await q.enqueue(conn, q.Task(name), {}, options, schema=w.schema)).id for name in names
        ]
    finally:
        await conn.close()


async def _attempts(w: World) -> dict[int, tuple[str, str | None, str | None]]:
    """Task id -> (outcome, error type, traceback) of its latest recorded attempt."""
    rows = await w.fetch(
        "SELECT DISTINCT ON (task_id) task_id, outcome, error_type, traceback "
        "FROM {s}.attempts ORDER BY task_id, id DESC"
    )
    return {r[0]: (r[1], r[2], r[3]) for r in rows}


async def test_a_handlers_exit_or_interrupt_fails_its_task_and_sigint_still_stops_the_worker(
    pg_schema: tuple[str, str], tmp_path: Path
) -> None:
    """Before: the first such handler ended the process, its tasks left running."""
    dsn, schema = pg_schema
    async with world(dsn, schema, tmp_path, lease=timedelta(seconds=10), occurrences=0) as w:
        (tmp_path / "misbehaving.py").write_text(APP)
        worker = await w.spawn("survivor", app="misbehaving:make")
        exits = await _enqueue(w, ["sync_exit", "async_interrupt"])
        fines = await _enqueue(w, ["fine"] * 4)

        async def settled() -> bool:
            tasks = await w.tasks()
            return {tasks[i][0] for i in exits} == {"failed"} and {tasks[i][0] for i in fines} == {
                "succeeded"
            }

        await wait_until(settled)
        attempts = await _attempts(w)
        assert attempts[exits[0]][:2] == ("failed", "SystemExit")
        assert attempts[exits[1]][:2] == ("failed", "KeyboardInterrupt")
        assert "in sync_exit" in (attempts[exits[0]][2] or "")
        assert "in async_interrupt" in (attempts[exits[1]][2] or "")
        # Still claiming: a task enqueued after the failures runs in the same process.
        (later,) = await _enqueue(w, ["fine"])

        async def later_done() -> bool:
            return (await w.tasks())[later][0] == "succeeded"

        await wait_until(later_done)
        assert worker.proc.returncode is None
        # A real Ctrl-C still stops the process gracefully.
        worker.signal(signal.SIGINT)
        await worker.wait_for_line("SIGINT received, stopping gracefully")
        assert await worker.exited() == 0, worker.stderr
        assert "tasks: 5 succeeded, 0 retried, 2 failed, 0 handed back" in worker.stderr
        assert "steeple worker: stopped" in worker.stderr


@pytest.mark.parametrize("how", ["second-signal", "deadline"])
async def test_a_stuck_thread_and_a_cancellation_swallowing_handler_do_not_keep_the_process_alive(
    pg_schema: tuple[str, str], tmp_path: Path, how: str
) -> None:
    """Before: after the hard stop the process never exited (the stuck thread was joined
    at exit; the worker waited for the async handler forever)."""
    dsn, schema = pg_schema
    async with world(dsn, schema, tmp_path, lease=timedelta(seconds=10), occurrences=0) as w:
        (tmp_path / "misbehaving.py").write_text(APP)
        drain = "60" if how == "second-signal" else "1"
        worker = await w.spawn("stopped", app="misbehaving:make", FAULT_DRAIN=drain)
        ids = await _enqueue(w, ["stuck", "stubborn"])
        await wait_until(lambda: all((tmp_path / f"started-{i}").exists() for i in ids))
        worker.signal(signal.SIGTERM)
        await worker.wait_for_line("SIGTERM received, stopping gracefully")
        if how == "second-signal":
            worker.signal(signal.SIGTERM)
            await worker.wait_for_line("SIGTERM received again, stopping hard")
        else:
            await worker.wait_for_line("the 1 s drain deadline passed; stopping hard")
        # Within the drain deadline plus the handlers' grace and the releases' writes.
        assert await worker.exited(timeout=30) == 0, worker.stderr
        assert "1 handler(s) ignored the hard stop" in worker.stderr
        assert "2 handed back" in worker.stderr
        assert "steeple worker: stopped" in worker.stderr
        # Handed back: pending again with the attempt refunded, another worker may run them.
        tasks = await w.tasks()
        assert {tasks[i][:2] for i in ids} == {("pending", 0)}
        assert {a[2] for a in await w.attempts()} == {"released"}


async def test_a_handler_that_ignores_even_being_closed_is_handed_back_and_the_process_ended(
    pg_schema: tuple[str, str], tmp_path: Path
) -> None:
    """Before: the process never exited, and the task stayed running until its lease lapsed."""
    dsn, schema = pg_schema
    async with world(dsn, schema, tmp_path, lease=timedelta(seconds=10), occurrences=0) as w:
        (tmp_path / "misbehaving.py").write_text(APP)
        worker = await w.spawn("stopped", app="misbehaving:make", FAULT_DRAIN="1")
        (task_id,) = await _enqueue(w, ["hopeless"])
        await wait_until(lambda: (tmp_path / f"started-{task_id}").exists())
        worker.signal(signal.SIGTERM)
        await worker.wait_for_line("the 1 s drain deadline passed; stopping hard")
        await worker.wait_for_line("could not be closed")
        # Ended by the command, after the task was handed back.
        assert await worker.exited(timeout=60) == 1, worker.stderr
        assert "s after the hard stop" in worker.stderr
        assert "ending the process" in worker.stderr
        assert (await w.tasks())[task_id][:2] == ("pending", 0)
        assert {a[2] for a in await w.attempts()} == {"released"}
