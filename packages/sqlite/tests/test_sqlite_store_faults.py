"""Faults a file store must survive, with real processes on real files.

- kill -9 of a process ticking, claiming and relaying (to a SQLite journal) at random
  points, fifteen times over: the file passes ``PRAGMA integrity_check``, every call the
  process saw return is still there, no tick is half stored (counters and cursors match
  the rows), and in the end every due occurrence exists once and was published once;
- another process holding the write lock: typed deadline errors within the deadline,
  nothing stored, and the store works once the lock is released; a publication whose
  outcome cannot be recorded returns the broker's receipt in RelayAcknowledgementError;
- the awaiting coroutine cancelled inside the transaction (at each clock read) and at
  many delays: no transaction is left open, the data stay consistent, the next call works;
- two processes with five stores each ticking one file: every due instant once.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import random
import sqlite3
import sys
import threading
import time
from collections.abc import Callable, Coroutine
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from sqlite_support import (
    CONFIG,
    KEYRING,
    MINUTE_US,
    START,
    consistent,
    definition,
    integrity,
    query,
)
from steeple.brokers.sqlite import SqliteJournalBroker
from steeple.core.errors import (
    RecurringDeadlineError,
    RecurringError,
    RelayAcknowledgementError,
)
from steeple.core.idempotency import PUBLISH_PURPOSE, idempotency_key
from steeple.core.messages import BrokerReceipt, ScheduledMessage
from steeple.sqlite import SqliteRecurringStore
from steeple.testing import FakeClock, MemoryBroker

pytestmark = pytest.mark.slow

WORKER = str(Path(__file__).parent / "sqlite_worker.py")
SPEED = 60.0  # one wall-clock second is one minute: a lease (60 s) lapses in a second
DEADLINE = 10.0
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
MINUTE = timedelta(minutes=1)


async def start(*args: object) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        WORKER,
        *map(str, args),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )


async def acknowledgements(proc: asyncio.subprocess.Process, into: list[dict[str, Any]]) -> None:
    """Collect the JSON lines a worker prints until its stdout closes."""
    assert proc.stdout is not None
    while line := await proc.stdout.readline():
        with contextlib.suppress(json.JSONDecodeError):  # the last line, cut by a kill
            into.append(json.loads(line))


def journal_keys(path: Path) -> set[str]:
    return {k for (k,) in query(path, "SELECT idempotency_key FROM steeple_journal")}


def key_of(occurrence_id: str, definition_name: str, due_us: int) -> str:
    return idempotency_key(
        purpose=PUBLISH_PURPOSE,
        namespace=CONFIG.namespace,
        definition_name=definition_name,
        due_at=EPOCH + timedelta(microseconds=due_us),
        generation=bytes.fromhex(occurrence_id),
    )


def stored(path: Path) -> dict[str, tuple[str, str, int]]:
    """Occurrence id -> (state, definition, due in microseconds)."""
    return {
        i: (s, d, due)
        for i, s, d, due in query(
            path, "SELECT id, state, definition_name, due_at FROM recurring_occurrences"
        )
    }


# --- kill -9 -----------------------------------------------------------------------------


@pytest.mark.timeout(600)
async def test_kill_9_at_random_points_loses_nothing_committed(tmp_path: Path) -> None:
    path, journal = tmp_path / "store.db", tmp_path / "journal.db"
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    t0 = time.time()
    ticked: set[str] = set()
    published: set[str] = set()
    in_flight: set[str] = set()  # found accepted by the broker but not yet recorded
    for round_ in range(15):
        proc = await start("loop", path, journal, t0, SPEED)
        assert proc.stdout is not None
        async with asyncio.timeout(60):
            ready = await proc.stdout.readline()
        assert ready, (round_, await proc.stderr.read() if proc.stderr else b"")
        lines: list[dict[str, Any]] = []
        reader = asyncio.create_task(acknowledgements(proc, lines))
        # The kill lands at a random point of the loop (the point of the test, not a wait).
        await asyncio.sleep(rng.uniform(0.0, 0.4))
        proc.kill()
        await proc.wait()
        await reader
        for line in lines:
            ticked.update(line.get("ticked", ()))
            if "published" in line:
                published.add(line["published"])

        assert integrity(path) == "ok", seed
        assert integrity(journal) == "ok", seed
        consistent(path)  # no half-stored tick: counters and cursors match the rows
        rows = stored(path)
        assert ticked <= set(rows), seed  # every tick the process saw commit is there
        keys = journal_keys(journal)
        for occurrence_id, (state, name, due) in rows.items():
            key = key_of(occurrence_id, name, due)
            if state == "published":
                assert key in keys, seed  # recorded published only after the broker had it
            elif key in keys:
                in_flight.add(occurrence_id)  # killed between the broker's receipt and the record
        assert all(rows[i][0] == "published" for i in published), seed

    # Recovery: a store in this process takes over at a fixed instant past every lease.
    clock = FakeClock(START + timedelta(seconds=(time.time() - t0) * SPEED) + 2 * MINUTE)
    broker = SqliteJournalBroker(journal, KEYRING, namespace="faults", clock=clock)
    await broker.start()
    async with await SqliteRecurringStore.connect(path, CONFIG, KEYRING, clock) as store:
        while (await store.tick(100)).materialized:
            pass
        while leases := await store.claim(100):
            for lease in leases:
                await store.relay(lease, broker)
    await broker.close()
    total = consistent(path)
    rows = stored(path)
    assert {state for state, _, _ in rows.values()} == {"published"}
    # Every due time up to the clock exists: each cursor is its last due minute.
    last_minute = (clock.now() - EPOCH) // MINUTE * MINUTE_US
    assert query(path, "SELECT DISTINCT cursor_at FROM recurring_definitions") == [(last_minute,)]
    # Published once: one journal row per occurrence, under its own key.
    assert journal_keys(journal) == {key_of(i, n, d) for i, (_, n, d) in rows.items()}
    assert query(journal, "SELECT count(*) FROM steeple_journal") == [(total,)]
    print(
        f"seed {seed}: {total} occurrences; acknowledged before the kills: {len(ticked)} "
        f"ticked, {len(published)} published; {len(in_flight)} found accepted by the broker "
        "but unrecorded after a kill (republished once, deduplicated)"
    )


# --- another process holding the write lock ------------------------------------------------


class Holder:
    """The ``hold`` worker: another process that takes and releases the file's write lock."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    @classmethod
    async def start(cls, path: Path) -> Holder:
        return cls(await start("hold", path))

    async def _say(self, command: str, answer: bytes) -> None:
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        self.proc.stdin.write(f"{command}\n".encode())
        await self.proc.stdin.drain()
        async with asyncio.timeout(30):
            assert (await self.proc.stdout.readline()).strip() == answer

    async def hold(self) -> None:
        await self._say("hold", b"held")

    async def release(self) -> None:
        await self._say("release", b"released")

    async def stop(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        async with asyncio.timeout(30):
            await self.proc.wait()


@pytest.mark.timeout(120)
async def test_a_write_lock_held_by_another_process_is_a_deadline_error(tmp_path: Path) -> None:
    path = tmp_path / "store.db"
    async with await SqliteRecurringStore.initialize(
        path, CONFIG, KEYRING, FakeClock(START)
    ) as store:
        await store.create(definition("before"))
        holder = await Holder.start(path)
        try:
            await holder.hold()
            began = time.monotonic()
            results = await asyncio.gather(
                store.create(definition("blocked")),
                store.tick(100),
                store.claim(10),
                store.schedules(),
                return_exceptions=True,
            )
            waited = time.monotonic() - began
            for result in results:
                assert isinstance(result, RecurringDeadlineError), result
            # The first waited for the lock; the others, queued behind it, for the first.
            assert "another connection or process holds it" in str(results[0])
            assert waited < DEADLINE + 2  # each call's own deadline, not one after another
            await holder.release()
        finally:
            await holder.stop()
        assert query(path, "SELECT name FROM recurring_definitions") == [("before",)]
        assert query(path, "SELECT count(*) FROM recurring_occurrences") == [(0,)]
        await store.create(definition("blocked"))
        assert (await store.tick(100)).materialized == 20
    consistent(path)


@pytest.mark.timeout(120)
async def test_a_publication_that_cannot_be_recorded_returns_its_receipt(tmp_path: Path) -> None:
    """Seed 000: broker acceptance followed by an uncertain acknowledgement keeps the receipt."""
    path = tmp_path / "store.db"
    clock = FakeClock(START)
    holder = await Holder.start(path)

    class LockingBroker(MemoryBroker):
        """Accepts, then another process takes the write lock before the relay records."""

        lock_next = True

        async def publish(
            self, message: ScheduledMessage, *, idempotency_key: str, timeout: float
        ) -> BrokerReceipt:
            receipt = await super().publish(
                message, idempotency_key=idempotency_key, timeout=timeout
            )
            if self.lock_next:
                self.lock_next = False
                await holder.hold()
            return receipt

    broker = LockingBroker()
    try:
        async with await SqliteRecurringStore.initialize(path, CONFIG, KEYRING, clock) as store:
            await store.create(definition("a", minutes_back=1))
            await store.tick(100)
            [lease] = await store.claim(1)
            with pytest.raises(RelayAcknowledgementError) as caught:
                await store.relay(lease, broker)
            [(_, key)] = broker.published
            assert caught.value.receipt.idempotency_key == key
            assert not caught.value.receipt.duplicate
            assert isinstance(caught.value.__cause__, RecurringDeadlineError)
            await holder.release()
            # Still leased; once the lease lapses the occurrence is republished under the
            # same key, which the broker deduplicates.
            assert [o.state.value for o in (await store.occurrences()).items] == ["leased"]
            clock.advance(CONFIG.lease_duration + timedelta(seconds=1))
            [again] = await store.claim(1)
            receipt = await store.relay(again, broker)
            assert receipt.duplicate
            assert receipt.idempotency_key == key
            assert [o.state.value for o in (await store.occurrences()).items] == ["published"]
    finally:
        await holder.stop()
    assert len(broker.published) == 1


# --- cancellation of the awaiting coroutine ------------------------------------------------


class GateClock:
    """A fake clock whose ``stop_at``-th reading on the store's thread waits for ``go``.

    The engine reads the clock inside each transaction (after the lock, and before the
    commit): stopping there holds the store's thread in the middle of a transaction.
    """

    def __init__(self) -> None:
        self.clock = FakeClock(START)
        self.readings = 0
        self.stop_at: int | None = None
        self.go = threading.Event()
        self._reached: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def arm(self, stop_at: int) -> asyncio.Event:
        """Stop the ``stop_at``-th reading from now; the event is set when it is reached."""
        self.readings, self.stop_at = 0, stop_at
        self.go.clear()
        self._loop = asyncio.get_running_loop()
        self._reached = asyncio.Event()
        return self._reached

    def now(self) -> datetime:
        if threading.current_thread().name.startswith("steeple-sqlite"):
            reading, self.readings = self.readings, self.readings + 1
            if reading == self.stop_at and self._loop is not None and self._reached:
                self._loop.call_soon_threadsafe(self._reached.set)
                self.go.wait(30)
        return self.clock.now()


Operation = Callable[[SqliteRecurringStore, FakeClock], Coroutine[Any, Any, object]]


async def _tick(store: SqliteRecurringStore, clock: FakeClock) -> object:
    clock.advance(MINUTE)
    return await store.tick(100)


async def _create(store: SqliteRecurringStore, clock: FakeClock) -> object:
    return await store.create(definition(f"new-{time.monotonic_ns()}", minutes_back=2))


async def _claim(store: SqliteRecurringStore, clock: FakeClock) -> object:
    return await store.claim(5)


async def _cancel(store: SqliteRecurringStore, clock: FakeClock) -> object:
    page = await store.schedules()
    active = [s.name for s in page.items if s.state == "active"]
    return await store.cancel(active[0]) if active else None


OPERATIONS: dict[str, Operation] = {
    "tick": _tick,
    "create": _create,
    "claim": _claim,
    "cancel": _cancel,
}


SINGLE_TRANSACTION = frozenset({"tick", "create", "claim"})


def snapshot(path: Path) -> list[Any]:
    """Every row of every table, in a fixed order."""
    return [
        query(path, f"SELECT * FROM {table} ORDER BY 1, 2")
        for table in ("recurring_namespaces", "recurring_definitions", "recurring_occurrences")
    ]


async def no_open_transaction(store: SqliteRecurringStore, path: Path) -> None:
    """After the store's thread finished what was queued: no transaction open anywhere."""
    storage = store._storage
    open_ = await storage.run("probe", lambda call: storage.connection(call).in_transaction)
    assert not open_
    other = sqlite3.connect(path, isolation_level=None, timeout=0)
    try:
        other.execute("BEGIN IMMEDIATE")  # the write lock is free at once
        other.execute("ROLLBACK")
    finally:
        other.close()


async def relay_one(store: SqliteRecurringStore, clock: FakeClock, broker: MemoryBroker) -> object:
    leases = await store.claim(1)
    if not leases:
        clock.advance(MINUTE)
        await store.tick(100)
        leases = await store.claim(1)
    if not leases:
        # Earlier (uncancelled) cancel operations may have cancelled every definition.
        return None
    return await store.relay(leases[0], broker)


@pytest.mark.timeout(300)
async def test_cancelled_inside_the_transaction_leaves_nothing_open(tmp_path: Path) -> None:
    path = tmp_path / "store.db"
    gate = GateClock()
    broker = MemoryBroker()
    stopped = 0
    async with await SqliteRecurringStore.initialize(path, CONFIG, KEYRING, gate) as store:
        for i in range(3):
            await store.create(definition(f"d{i}"))
        operations: dict[str, Callable[[], Coroutine[Any, Any, object]]] = {
            name: functools.partial(op, store, gate.clock) for name, op in OPERATIONS.items()
        }
        operations["relay"] = functools.partial(relay_one, store, gate.clock, broker)
        for name, operation in operations.items():
            for stop_at in range(6):
                before = snapshot(path)
                event = gate.arm(stop_at)
                task = asyncio.create_task(operation())
                waiter = asyncio.create_task(event.wait())
                await asyncio.wait([task, waiter], return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
                reached = event.is_set()
                if reached:
                    stopped += 1
                    # The thread is inside a transaction, holding the lock; the awaiting
                    # coroutine ends at once (it does not wait for the thread).
                    task.cancel()
                    with pytest.raises(asyncio.CancelledError):
                        await task
                gate.go.set()
                with contextlib.suppress(asyncio.CancelledError, RecurringError):
                    await task
                gate.stop_at = None
                await no_open_transaction(store, path)
                consistent(path)
                if reached and name in SINGLE_TRANSACTION:
                    assert snapshot(path) == before, (name, stop_at)  # rolled back whole
        await store.tick(100)  # and the store goes on
    assert stopped >= 15  # every operation stopped at least at its transaction's two reads


@pytest.mark.timeout(300)
async def test_cancelled_at_many_delays_leaves_nothing_open(tmp_path: Path) -> None:
    path = tmp_path / "store.db"
    clock = FakeClock(START)
    broker = MemoryBroker()
    async with await SqliteRecurringStore.initialize(path, CONFIG, KEYRING, clock) as store:
        for i in range(3):
            await store.create(definition(f"d{i}"))
        operations: dict[str, Callable[[], Coroutine[Any, Any, object]]] = {
            name: functools.partial(op, store, clock) for name, op in OPERATIONS.items()
        }
        operations["relay"] = functools.partial(relay_one, store, clock, broker)
        cancelled = 0
        for operation in operations.values():
            for delay in (0, 1e-4, 3e-4, 1e-3, 2e-3, 4e-3, 8e-3, 16e-3):
                task = asyncio.create_task(operation())
                await asyncio.sleep(delay)  # the point of cancellation, not a wait for state
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    cancelled += 1
                except RecurringError:
                    pass
                await no_open_transaction(store, path)
                consistent(path)
        assert cancelled > 0
        assert (await store.tick(100)).materialized >= 0
    assert integrity(path) == "ok"


# --- two processes, ten stores, one file -----------------------------------------------------


TICKING = 3.0
"""How long (at least) the two processes tick the file at once, in wall-clock seconds."""


async def _tell(procs: list[asyncio.subprocess.Process], line: bytes) -> None:
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write(line)
        await proc.stdin.drain()


async def _ticks(
    proc: asyncio.subprocess.Process, into: list[dict[str, Any]], ticked: asyncio.Event
) -> None:
    """Collect a tickers process's JSON lines until its stdout closes; set ``ticked`` at
    its first tick that stored something."""
    assert proc.stdout is not None
    while line := await proc.stdout.readline():
        into.append(json.loads(line))
        if "ticked" in into[-1]:
            ticked.set()


async def _stderr(proc: asyncio.subprocess.Process) -> str:
    assert proc.stderr is not None
    return (await proc.stderr.read()).decode(errors="replace")


@pytest.mark.timeout(180)
async def test_ten_tickers_in_two_processes_materialize_each_due_instant_once(
    tmp_path: Path,
) -> None:
    path = tmp_path / "store.db"
    async with await SqliteRecurringStore.initialize(
        path, CONFIG, KEYRING, FakeClock(START)
    ) as store:
        for i in range(10):
            await store.create(definition(f"d{i}", minutes_back=30))
    t0 = time.time()
    procs = [await start("tickers", path, t0, SPEED, 5) for _ in range(2)]
    outputs: list[list[dict[str, Any]]] = [[], []]
    try:
        async with asyncio.timeout(120):
            for proc in procs:  # both open their stores before either ticks
                assert proc.stdout is not None
                ready = await proc.stdout.readline()
                assert json.loads(ready or b"null") == {"ready": 1}, ready
            ticked = [asyncio.Event() for _ in procs]
            readers = [
                asyncio.create_task(_ticks(proc, into, event))
                for proc, into, event in zip(procs, outputs, ticked, strict=True)
            ]
            errs = [asyncio.create_task(_stderr(proc)) for proc in procs]
            await _tell(procs, b"go\n")
            # Both tick at once for TICKING seconds (the workload's length), and on until
            # each has ticked something: which one takes the SQLite lock first at each new
            # minute is up to the OS, and a loaded machine may favour one for seconds.
            await asyncio.sleep(TICKING)
            for event in ticked:
                await event.wait()
            await _tell(procs, b"stop\n")
            for proc, reader, err in zip(procs, readers, errs, strict=True):
                await reader
                assert await proc.wait() == 0, await err
    finally:
        for proc in procs:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    reported: list[list[str]] = []
    for lines in outputs:
        assert lines[-1] == {"errors": []}, lines[-1]
        ticks = [line["ticked"] for line in lines[:-1]]
        assert ticks, "a process never ticked anything"
        reported.extend(ticks)
    ids = [i for tick in reported for i in tick]
    assert len(ids) == len(set(ids))  # no occurrence reported by two ticks
    total = consistent(path)  # no (definition, due) twice, no gap, counters exact
    assert set(ids) == set(stored(path))
    assert total == len(ids) >= 300
    assert integrity(path) == "ok"
