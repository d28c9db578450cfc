"""Two claims in flight: a worker sends its next claim while the last one is out.

A worker whose handlers all run on the event loop keeps up to two claims in flight, each
of at most half its slots, so the round trip of one overlaps the handlers of the other's
tasks. The slots a claim asked for count as taken until its tasks run: the tasks running
and the slots asked for by the claims in flight never exceed the worker's concurrency.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest

from queue_support import QueueFixture, wait_until
from steeple.postgres.queue import JobContext, Scheduler, Task, enqueue_many, run_state
from steeple.postgres.queue import _db as db_module

NOOP: Task[Any] = Task("in-flight-noop")


class _Claims:
    """Watches the worker's claim statements: which are out, what they asked for."""

    def __init__(self) -> None:
        self.out: list[int] = []
        """The slots asked for by each claim sent and not yet answered."""
        self.overlapped = 0
        """Claims sent while another was out."""
        self.hold = False
        self.go = asyncio.Event()
        self.held = 0
        """Slots asked for by the claims held back (while ``hold``)."""
        self.running = 0
        """Handlers started and not ended, plus tasks claimed and not yet started."""
        self.most = 0
        """The most slots ever taken: running (as above) plus asked for by claims out."""

    def wrap(self, monkeypatch: pytest.MonkeyPatch) -> None:
        original = db_module._AsyncpgDb.fetch

        async def fetch(db: Any, sql: str, *args: Any, timeout: float) -> Any:
            if "complete_and_claim(" in sql:
                wants = sum(int(w) for w in args[5])
            elif ".claim($1::text[], $2::text[]" in sql:
                wants = sum(int(w) for w in args[1])
            else:
                return await original(db, sql, *args, timeout=timeout)
            if self.out:
                self.overlapped += 1
            self.out.append(wants)
            self.most = max(self.most, self.running + sum(self.out))
            try:
                if self.hold:
                    self.held += wants
                    await asyncio.wait_for(self.go.wait(), 10)
                rows = await original(db, sql, *args, timeout=timeout)
            finally:
                self.out.remove(wants)
            self.running += sum(1 for row in rows if row[1] is not None)
            return rows

        monkeypatch.setattr(db_module._AsyncpgDb, "fetch", fetch)


@contextlib.asynccontextmanager
async def _running(worker: Scheduler) -> AsyncIterator[None]:
    stop = asyncio.Event()
    run = asyncio.create_task(worker.run_until_shutdown(stop, drain_timeout=10.0))
    try:
        yield
    finally:
        stop.set()
        await asyncio.wait_for(run, 30)


async def test_a_second_claim_goes_out_while_the_first_is_in_flight(
    queue: QueueFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: one claim at a time; the next was sent only after the last one's answer."""
    dsn, schema, conn = queue
    ids = await enqueue_many(conn, NOOP, [{}] * 8, schema=schema)
    claims = _Claims()
    claims.wrap(monkeypatch)
    claims.hold = True  # the first claims wait until the test lets them go

    async def handle(ctx: JobContext, args: Any) -> None:
        claims.running -= 1

    worker = Scheduler(
        dsn, worker_id="w", schema=schema, concurrency=4, batch_size=4, poll_interval=10.0
    )
    worker.register(NOOP, handle)
    async with _running(worker):
        # The first claim is held back: the second goes out meanwhile (not after it).
        await wait_until(lambda: len(claims.out) == 2, timeout=5)
        assert claims.held == 4  # two claims of half the slots each
        claims.hold = False
        claims.go.set()
        await wait_until(lambda: worker.stats.succeeded == 8)
    assert claims.overlapped >= 1
    assert claims.most <= 4
    assert {(await run_state(conn, i, schema=schema)).state.value for i in ids} == {"succeeded"}


@pytest.mark.parametrize("queues", [None, {"a": 4, "b": 4}], ids=["one-queue", "two-queues"])
async def test_running_tasks_and_claims_in_flight_never_exceed_the_concurrency(
    queue: QueueFixture, monkeypatch: pytest.MonkeyPatch, queues: dict[str, int] | None
) -> None:
    """Two running tasks and a claim out for the two free slots: the other lane asks for
    nothing until that claim's tasks run (counting only running tasks, it would ask for
    two more: six slots of four). With two queues of four slots each, no queue's own room
    stops it: only the worker's count of its slots does."""
    dsn, schema, conn = queue
    await enqueue_many(
        conn, NOOP, [{}] * 12, schema=schema, queue="default" if queues is None else "a"
    )
    claims = _Claims()
    claims.wrap(monkeypatch)
    gate = asyncio.Semaphore(0)
    started = 0

    async def handle(ctx: JobContext, args: Any) -> None:
        nonlocal started
        started += 1
        try:
            await gate.acquire()
        finally:
            claims.running -= 1

    worker = Scheduler(
        dsn,
        worker_id="w",
        schema=schema,
        concurrency=4,
        batch_size=4,
        poll_interval=10.0,
        listen=False,
        queues=("default",) if queues is None else queues,
    )
    worker.register(NOOP, handle)
    async with _running(worker):
        await wait_until(lambda: started == 4)
        assert claims.most <= 4
        claims.hold = True
        gate.release()
        gate.release()
        # Two slots free: claims for them go out and are held; nothing more is asked.
        await wait_until(lambda: claims.held >= 2)
        assert claims.most <= 4, claims.most
        assert sum(claims.out) == 2
        claims.hold = False
        claims.go.set()
        for _ in range(12):
            gate.release()
        await wait_until(lambda: worker.stats.succeeded == 12)
    assert claims.most <= 4, claims.most


async def test_a_queues_own_limit_counts_the_claims_in_flight(
    queue: QueueFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Queue a has two slots in a worker of eight: while a claim for both is out, the other
    lane asks a for nothing (counting only a's running tasks, it would ask for two more)."""
    dsn, schema, conn = queue
    await enqueue_many(conn, NOOP, [{}] * 12, schema=schema, queue="a")
    claims = _Claims()
    claims.wrap(monkeypatch)
    claims.hold = True

    async def handle(ctx: JobContext, args: Any) -> None:
        claims.running -= 1

    worker = Scheduler(
        dsn,
        worker_id="w",
        schema=schema,
        concurrency=8,
        batch_size=8,
        queues={"a": 2},
        poll_interval=10.0,
        listen=False,
    )
    worker.register(NOOP, handle)
    async with _running(worker):
        await wait_until(lambda: claims.held >= 2)
        assert claims.out == [2], claims.out
        claims.hold = False
        claims.go.set()
        await wait_until(lambda: worker.stats.succeeded == 12)
    assert claims.most <= 2, claims.most
