"""RELIABILITY row 11: a real full disk, for the recurring store, the queue and the journal.

Every case runs on a small tmpfs mounted for the test and filled with a filler file:

- a tablespace on an 8 MB tmpfs holding the recurring store's tables (their TOAST tables
  and indexes too): a tick of 100 large occurrences fails mid-way with a typed storage error
  naming the full disk, nothing of it is stored (rows and cursors unchanged), and once the
  filler is deleted the same store materializes every due occurrence exactly once;
- the same tablespace under the work queue: ``enqueue_many`` of large arguments fails with
  ``UnfitDatabaseError(setting="disk_full")``, nothing partial; 300 running handlers finish
  while the disk is full and their completions are refused, kept and retried by the worker;
  health is degraded naming the full disk, and a job's creation is refused with the same
  typed error; after the space is freed every task enqueued runs and finishes exactly once;
- the WAL directory (``initdb --waldir``) on a tmpfs: PostgreSQL PANICs when it cannot
  write WAL and recovers once space is freed; the store's failure is typed, no tick is
  half stored, and afterwards every due occurrence exists exactly once;
- the SQLite journal's file system full: ``publish`` fails with a typed BrokerError, the
  file passes ``PRAGMA integrity_check``, every receipted publication is kept, and it works
  again after the space is freed.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from pg_cluster import Cluster, Clusters, execute, fetchval, fill, poll
from queue_support import finished_once
from steeple.brokers.sqlite import SqliteJournalBroker
from steeple.core import (
    MissedRunPolicy,
    OccurrenceState,
    RecurringConfig,
    RecurringDefinition,
    RecurringStorageError,
    ScheduledMessage,
)
from steeple.core.errors import BrokerError
from steeple.core.messages import BrokerReceipt
from steeple.keyring import Keyring, StorageKey
from steeple.postgres import PostgresRecurringStore
from steeple.postgres.queue import (
    Health,
    JobContext,
    Scheduler,
    Task,
    UnfitDatabaseError,
    enqueue_many,
    install,
    jobs,
)
from steeple.testing import FakeClock, MemoryBroker

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

START = datetime(2031, 3, 4, 5, 0, 0, tzinfo=UTC)
KEYRING = Keyring(StorageKey("k1", b"\x0c" * 32))
CONFIG = RecurringConfig("full-disk", max_definitions=10, max_occurrences=10_000)
QUEUE = "q"
WORK: Task[Any] = Task("work")
GATED: Task[Any] = Task("gated")
PAYLOAD = 16 * 1024  # the largest payload: sealed, so incompressible


def definition(name: str, due: int) -> RecurringDefinition:
    """A minutely definition with ``due`` occurrences due at START."""
    return RecurringDefinition(
        name,
        "* * * * *",
        START - timedelta(minutes=due),
        MissedRunPolicy.CATCH_UP,
        ScheduledMessage("t", "m", os.urandom(PAYLOAD)),
    )


async def small_tablespace(clusters: Clusters, cluster: Cluster) -> Path:
    """An 8 MB tmpfs tablespace, the default for new objects of the cluster's database."""
    mount = clusters.tmpfs("ts", "8m")
    location = clusters.owned_dir(mount / "pg")
    await execute(
        cluster.dsn(),
        f"CREATE TABLESPACE small LOCATION '{location}'",
        "ALTER DATABASE postgres SET default_tablespace = small",
    )
    return mount


async def relations_in(dsn: str, schema: str) -> dict[str, int]:
    """How many relations of ``schema`` with storage (tables, TOAST tables, indexes) are in
    which tablespace (sequences are always in the database's default)."""
    rows = await _fetch(
        dsn,
        "SELECT coalesce(t.spcname, 'default') AS ts, count(*) AS n FROM pg_class c"
        " LEFT JOIN pg_tablespace t ON t.oid = c.reltablespace"
        " WHERE c.relkind IN ('r', 't', 'i') AND (c.relnamespace = $1::regnamespace"
        " OR c.oid IN (SELECT reltoastrelid FROM pg_class WHERE relnamespace = $1::regnamespace)"
        " OR c.oid IN (SELECT indexrelid FROM pg_index WHERE indrelid IN (SELECT reltoastrelid"
        " FROM pg_class WHERE relnamespace = $1::regnamespace)))"
        " GROUP BY 1",
        schema,
    )
    return {r["ts"]: r["n"] for r in rows}


async def _fetch(dsn: str, query: str, *args: Any) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(dsn, timeout=10)
    try:
        return await conn.fetch(query, *args)
    finally:
        await conn.close()


async def recurring_state(dsn: str) -> tuple[int, int, list[datetime]]:
    """(occurrence rows, distinct due instants, each definition's cursor)."""
    rows = await _fetch(
        dsn,
        "SELECT (SELECT count(*) FROM steeple.recurring_occurrences) AS n,"
        " (SELECT count(DISTINCT (definition_name, due_at)) FROM steeple.recurring_occurrences)"
        " AS d, array(SELECT cursor_at FROM steeple.recurring_definitions ORDER BY name) AS c",
    )
    return rows[0]["n"], rows[0]["d"], list(rows[0]["c"])


async def tick_all(store: PostgresRecurringStore) -> int:
    """Tick until nothing is due; return how many were materialized."""
    total = 0
    while materialized := (await store.tick(100)).materialized:
        total += materialized
    return total


async def relay_all(store: PostgresRecurringStore) -> MemoryBroker:
    broker = MemoryBroker()
    while leases := await store.claim(100):
        for lease in leases:
            await store.relay(lease, broker)
    return broker


@pytest.mark.timeout(120)
async def test_recurring_tablespace_full_mid_tick(pg_clusters: Clusters) -> None:
    cluster = pg_clusters.new("primary")
    dsn = cluster.dsn()
    mount = await small_tablespace(pg_clusters, cluster)
    clock = FakeClock(START)
    store = await PostgresRecurringStore.initialize(dsn, CONFIG, KEYRING, clock)
    try:
        assert set(await relations_in(dsn, "steeple")) == {"small"}
        for name in ("a", "b", "c"):
            await store.create(definition(name, 100))
        assert (await store.tick(100)).materialized == 100
        before = await recurring_state(dsn)
        filler = fill(mount, 256 * 1024)  # a tick of 100 needs about 1.7 MB

        for _ in range(2):  # the store stays usable while the disk is full
            with pytest.raises(RecurringStorageError, match="disk full") as full:
                await store.tick(100)
            assert "SQLSTATE 53100" in str(full.value)
            assert await recurring_state(dsn) == before  # nothing of the tick, cursors kept
        assert [s.name for s in (await store.schedules()).items] == ["a", "b", "c"]

        filler.unlink()
        assert await tick_all(store) == 200
        rows, distinct, _ = await recurring_state(dsn)
        assert rows == distinct == 300  # every due occurrence once
        broker = await relay_all(store)
        keys = [key for _, key in broker.published]
        assert len(keys) == len(set(keys)) == 300
        page = await store.occurrences(limit=100)
        assert {o.state for o in page.items} == {OccurrenceState.PUBLISHED}
    finally:
        await store.close()


class Worker:
    """A queue worker in the background, recording what it ran.

    Tasks named ``gated`` run until :attr:`gate` is set (``running`` counts them).
    """

    def __init__(self, dsn: str) -> None:
        self.ran: list[int] = []
        self.running = 0
        self.gate = asyncio.Event()
        self.scheduler = Scheduler(
            dsn,
            worker_id="w",
            schema=QUEUE,
            poll_interval=0.1,
            maintenance_interval=0.2,
            concurrency=400,
            batch_size=400,
        )
        self.scheduler.register(WORK, self._handle)
        self.scheduler.register(GATED, self._gated)
        self._stop = asyncio.Event()
        self._run = asyncio.create_task(self.scheduler.run_until_shutdown(self._stop))

    async def _handle(self, ctx: JobContext, args: Any) -> None:
        self.ran.append(ctx.task_id)

    async def _gated(self, ctx: JobContext, args: Any) -> None:
        self.running += 1
        await self.gate.wait()
        self.ran.append(ctx.task_id)

    async def all_running(self, n: int) -> bool:
        return self.running == n

    async def ran_all(self, ids: list[int]) -> bool:
        return set(ids) <= set(self.ran)

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.wait_for(self._run, 30)


@pytest.fixture
async def workers() -> AsyncIterator[list[Worker]]:
    started: list[Worker] = []
    try:
        yield started
    finally:
        for worker in started:
            await worker.stop()


def big_args(n: int) -> list[dict[str, str]]:
    return [{"blob": os.urandom(4096).hex()} for _ in range(n)]  # 8 KB of JSON each


@pytest.mark.timeout(120)
async def test_queue_tablespace_full_mid_enqueue_and_mid_completion(
    pg_clusters: Clusters, workers: list[Worker], caplog: pytest.LogCaptureFixture
) -> None:
    cluster = pg_clusters.new("primary")
    dsn = cluster.dsn()
    mount = await small_tablespace(pg_clusters, cluster)
    conn = await asyncpg.connect(dsn)
    try:
        await install(conn, schema=QUEUE)
        assert set(await relations_in(dsn, QUEUE)) == {"small"}
        worker = Worker(dsn)
        workers.append(worker)
        first = await enqueue_many(conn, WORK, big_args(20), schema=QUEUE)
        await poll("the first tasks to run", lambda: worker.ran_all(first))
        gated = await enqueue_many(conn, GATED, list(range(300)), schema=QUEUE)
        await poll("300 handlers to be running", lambda: worker.all_running(300))

        batch = big_args(300)  # about 2.4 MB
        filler = fill(mount, 0)
        for _ in range(2):
            with pytest.raises(UnfitDatabaseError, match="disk full") as full:
                await enqueue_many(conn, WORK, batch, schema=QUEUE)
            assert full.value.setting == "disk_full"
            assert isinstance(full.value.__cause__, asyncpg.DiskFullError)
            assert await conn.fetchval(f"SELECT count(*) FROM {QUEUE}.tasks") == 320
        # 300 completions (new row versions and attempt rows) find no room: kept, retried
        worker.gate.set()
        await poll(
            "the completions to be refused for lack of space",
            lambda: _logged(caplog, "could not record 300 completions"),
        )
        # Claims of nothing still answer; the refused completions alone degrade health,
        # and the reason names the full disk.
        await poll("health to name the full disk", lambda: _degraded_by_full_disk(worker))
        # The admin paths' writes are refused with the same typed error, nothing stored.
        with pytest.raises(UnfitDatabaseError, match="disk full") as job_full:
            await jobs.create(conn, "big", WORK, "0 0 1 1 *", big_args(64), schema=QUEUE)
        assert job_full.value.setting == "disk_full"
        assert isinstance(job_full.value.__cause__, asyncpg.DiskFullError)
        assert await conn.fetchval(f"SELECT count(*) FROM {QUEUE}.jobs") == 0

        filler.unlink()
        second = await enqueue_many(conn, WORK, batch, schema=QUEUE)
        everything = first + gated + second
        await poll("every task to run", lambda: worker.ran_all(everything), timeout=60)
        await poll("a healthy worker", lambda: _healthy(worker))
    finally:
        await conn.close()
    await finished_once(dsn, QUEUE, everything)


async def _logged(caplog: pytest.LogCaptureFixture, text: str) -> bool:
    return any(text in r.getMessage() and "space" in r.getMessage() for r in caplog.records)


async def _degraded_by_full_disk(worker: Worker) -> bool:
    reasons = worker.scheduler.health_reasons()
    return worker.scheduler.health() is Health.DEGRADED and any(
        r.startswith("completions failing: PostgreSQL is out of disk space") for r in reasons
    )


async def _healthy(worker: Worker) -> bool:
    return worker.scheduler.health() is Health.HEALTHY


@pytest.mark.timeout(120)
async def test_wal_full_panics_then_nothing_is_lost(
    pg_clusters: Clusters, workers: list[Worker]
) -> None:
    """pg_wal on a tmpfs that fills mid-tick: PostgreSQL PANICs (by design it cannot go on
    without WAL), the store's error is typed, and after space is freed the server recovers
    and the same store and worker finish with every occurrence and task exactly once."""
    wal = pg_clusters.tmpfs("wal", "24m")
    cluster = pg_clusters.new(
        "primary",
        initdb_args=("--waldir", str(wal / "pg_wal"), "--wal-segsize=1"),
        settings={"min_wal_size": "2MB", "max_wal_size": "8MB"},
    )
    dsn = cluster.dsn()
    clock = FakeClock(START)
    store = await PostgresRecurringStore.initialize(dsn, CONFIG, KEYRING, clock)
    try:
        for name in ("a", "b", "c", "d", "e"):
            await store.create(definition(name, 100))
        conn = await asyncpg.connect(dsn)
        try:
            await install(conn, schema=QUEUE)
            first = await enqueue_many(conn, WORK, list(range(20)), schema=QUEUE)
        finally:
            await conn.close()
        worker = Worker(dsn)
        workers.append(worker)
        await poll("the first tasks to run", lambda: worker.ran_all(first))

        filler = fill(wal, 2 << 20)
        committed = 0
        failure: RecurringStorageError | None = None
        for _ in range(5):  # 500 due, about 8.5 MB of WAL: more than is left
            try:
                committed += (await store.tick(100)).materialized
            except RecurringStorageError as exc:
                failure = exc
                break
        assert failure is not None, "the WAL never filled up"
        assert committed < 500
        log = cluster.log.read_text()
        assert "PANIC" in log
        assert "No space left on device" in log

        filler.unlink()
        await poll("the server to recover", lambda: _accepts(cluster))
        rows, distinct, _ = await recurring_state(dsn)
        # the failed tick is wholly there (its COMMIT was written, its reply lost) or not
        assert rows == distinct
        assert rows in {committed, committed + 100}, failure
        assert rows + await until_ok(lambda: tick_all(store)) == 500
        rows, distinct, _ = await recurring_state(dsn)
        assert rows == distinct == 500

        conn = await asyncpg.connect(dsn)
        try:
            second = await enqueue_many(conn, WORK, list(range(20)), schema=QUEUE)
        finally:
            await conn.close()
        await poll("every task to run", lambda: worker.ran_all(first + second), timeout=60)
    finally:
        await store.close()
    await finished_once(dsn, QUEUE, first + second)


async def _accepts(cluster: Cluster) -> bool:
    if not cluster.running():  # the postmaster gave up: start it again
        await asyncio.to_thread(cluster.start)
    try:
        return bool(await fetchval(cluster.dsn(), "SELECT true"))
    except (OSError, asyncpg.PostgresError):
        return False


async def until_ok(call: Any, attempts: int = 100) -> Any:
    """Retry across the server's recovery: the store's failures are typed storage errors."""
    last: Exception | None = None
    for _ in range(attempts):
        try:
            return await call()
        except RecurringStorageError as exc:
            last = exc
            await asyncio.sleep(0.1)
    raise AssertionError(f"the store never recovered: {last!r}")


# --- the SQLite journal ------------------------------------------------------------------


def integrity(path: Path) -> str:
    conn = sqlite3.connect(path)
    try:
        return str(conn.execute("PRAGMA integrity_check").fetchone()[0])
    finally:
        conn.close()


def journal(path: Path) -> SqliteJournalBroker:
    return SqliteJournalBroker(path, KEYRING, namespace="full-disk")


def message(i: int) -> ScheduledMessage:
    return ScheduledMessage("t", "m", os.urandom(PAYLOAD), {"n": str(i)})


@pytest.mark.timeout(120)
async def test_sqlite_journal_on_a_full_file_system(pg_clusters: Clusters) -> None:
    mount = pg_clusters.tmpfs("journal", "4m")
    path = mount / "journal.db"
    broker = journal(path)
    await broker.start()
    receipts: dict[str, BrokerReceipt] = {}
    try:
        filler = fill(mount, 200 * 1024)
        refused: list[tuple[str, ScheduledMessage]] = []
        errors: list[BrokerError] = []
        for i in range(40):  # 40 x 16 KB: more than is left
            key = f"key-{i:03d}"
            msg = message(i)
            try:
                receipts[key] = await broker.publish(msg, idempotency_key=key, timeout=10)
            except BrokerError as exc:
                errors.append(exc)
                refused.append((key, msg))
        assert receipts  # some fit,
        assert refused  # the rest were refused, each saying why
        assert all("full" in str(exc) for exc in errors), errors
        assert integrity(path) == "ok"
        assert await broker.pending() == len(receipts)

        filler.unlink()
        for key, msg in refused:  # the publisher's retry, same keys
            receipts[key] = await broker.publish(msg, idempotency_key=key, timeout=10)
        assert len(receipts) == 40
        assert integrity(path) == "ok"
    finally:
        await broker.close()

    reopened = journal(path)
    try:
        seen: list[str] = []
        while deliveries := await reopened.fetch(100):
            for delivery in deliveries:
                seen.append(delivery.idempotency_key)
                assert await reopened.acknowledge(delivery.delivery_id)
        assert sorted(seen) == sorted(receipts)  # every receipted publication, once
    finally:
        await reopened.close()
    assert integrity(path) == "ok"
