"""RELIABILITY row 10: a real streaming standby and a real read-only primary.

Each test builds its own private clusters (``pg_clusters``): a primary and a streaming
replica made with ``pg_basebackup -R``. The recurring store (initialize, connect, and a
store already connected whose address comes back as a standby) and the work queue
(``install``, the ``enqueue`` functions, the worker) refuse the standby with their typed
errors, saying it is a standby or read-only, and store nothing. After ``pg_ctl promote``
the same objects work again once they reconnect, with everything committed before the
failover there; a multi-host DSN with ``target_session_attrs=read-write`` finds the writer
by itself.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import psycopg
import pytest

from pg_cluster import Cluster, Clusters, execute, fetchval, poll
from queue_support import finished_once
from steeple.core import (
    MissedRunPolicy,
    RecurringConfig,
    RecurringDefinition,
    RecurringStorageError,
    ScheduledMessage,
)
from steeple.keyring import Keyring, StorageKey
from steeple.postgres import PostgresRecurringStore
from steeple.postgres.queue import (
    Health,
    JobContext,
    Scheduler,
    Task,
    UnfitDatabaseError,
    enqueue,
    enqueue_many,
    enqueue_sync,
    install,
)
from steeple.testing import FakeClock

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

START = datetime(2031, 3, 4, 5, 0, 0, tzinfo=UTC)
KEYRING = Keyring(StorageKey("k1", b"\x0a" * 32))
CONFIG = RecurringConfig("standby", max_definitions=10, max_occurrences=1000)
QUEUE = "q"
WORK: Task[Any] = Task("work")


def minutely(name: str = "minutely") -> RecurringDefinition:
    return RecurringDefinition(
        name,
        "* * * * *",
        START - timedelta(minutes=30),
        MissedRunPolicy.CATCH_UP,
        ScheduledMessage("t", "m", b"payload"),
    )


async def streaming(primary: Cluster, replica: Cluster) -> None:
    """Wait until ``replica`` streams from ``primary`` and has replayed all it wrote."""

    async def caught_up() -> bool:
        conn = await asyncpg.connect(primary.dsn(), timeout=10)
        try:
            row = await conn.fetchrow(
                "SELECT state, replay_lsn >= pg_current_wal_lsn() AS replayed"
                " FROM pg_stat_replication WHERE application_name = $1",
                replica.name,
            )
        finally:
            await conn.close()
        return row is not None and row["state"] == "streaming" and bool(row["replayed"])

    await poll(f"{replica.name} to stream from {primary.name}", caught_up)
    assert await fetchval(replica.dsn(), "SELECT pg_is_in_recovery()") is True


async def occurrence_rows(dsn: str) -> tuple[int, int]:
    """(rows, distinct (definition, due) pairs) of the store's occurrences."""
    conn = await asyncpg.connect(dsn, timeout=10)
    try:
        row = await conn.fetchrow(
            "SELECT count(*) AS n, count(DISTINCT (definition_name, due_at)) AS d"
            " FROM steeple.recurring_occurrences"
        )
    finally:
        await conn.close()
    assert row is not None
    return row["n"], row["d"]


class Worker:
    """A queue worker running in the background, recording the tasks it ran."""

    def __init__(self, dsn: str) -> None:
        self.ran: list[int] = []
        self.scheduler = Scheduler(
            dsn,
            worker_id="survivor",
            schema=QUEUE,
            poll_interval=0.1,
            maintenance_interval=0.2,
            query_timeout=3.0,
        )
        self.scheduler.register(WORK, self._handle)
        self._stop = asyncio.Event()
        self._run: asyncio.Task[None] | None = None

    async def _handle(self, ctx: JobContext, args: Any) -> None:
        self.ran.append(ctx.task_id)

    def start(self) -> None:
        self._run = asyncio.create_task(self.scheduler.run_until_shutdown(self._stop))

    async def stop(self) -> None:
        self._stop.set()
        if self._run is not None:
            await asyncio.wait_for(self._run, 30)


@pytest.fixture
async def worker_factory() -> AsyncIterator[Any]:
    started: list[Worker] = []

    def make(dsn: str) -> Worker:
        worker = Worker(dsn)
        started.append(worker)
        worker.start()
        return worker

    try:
        yield make
    finally:
        for worker in started:
            await worker.stop()


async def deploy(dsn: str, clock: FakeClock) -> PostgresRecurringStore:
    """Initialize the recurring store and install the queue on the primary at ``dsn``."""
    store = await PostgresRecurringStore.initialize(dsn, CONFIG, KEYRING, clock)
    conn = await asyncpg.connect(dsn)
    try:
        await install(conn, schema=QUEUE)
    finally:
        await conn.close()
    return store


@pytest.mark.timeout(120)
async def test_standby_refused_then_promoted_node_works_after_reconnecting(
    pg_clusters: Clusters, worker_factory: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The address the store and the worker use comes back as a standby, then is promoted.

    Like a virtual IP moved to the replica before its promotion: every new connection
    finds a standby (refused, typed, nothing written), and after ``pg_ctl promote`` the
    same store object and the same running worker carry on with nothing lost.
    """
    clock = FakeClock(START)
    primary = pg_clusters.new("primary")
    address = primary.dsn()
    store = await deploy(address, clock)
    try:
        await store.create(minutely())
        assert (await store.tick(10)).materialized == 10
        worker = worker_factory(address)
        conn = await asyncpg.connect(address)
        try:
            before = await enqueue_many(conn, WORK, list(range(20)), schema=QUEUE)
        finally:
            await conn.close()
        await poll("the worker to run the first tasks", lambda: _ran_all(worker, before))

        replica = pg_clusters.replica(primary, "replica")
        await streaming(primary, replica)

        # --- the standby, at its own address: everything refuses it -----------------------
        standby = replica.dsn()
        with pytest.raises(RecurringStorageError, match="standby"):
            await PostgresRecurringStore.initialize(standby, CONFIG, KEYRING, clock)
        with pytest.raises(RecurringStorageError, match="standby"):
            await PostgresRecurringStore.connect(standby, CONFIG, KEYRING, clock)
        await refused_by_queue(standby)

        # --- failover: the primary stops, the address now leads to the standby -------------
        await asyncio.to_thread(primary.stop, "fast")
        await asyncio.to_thread(replica.stop, "fast")
        # The primary is gone: nothing to stream from (and not from itself at its new port).
        with (replica.data / "postgresql.auto.conf").open("a") as conf:
            conf.write("primary_conninfo = ''\n")
        await asyncio.to_thread(replica.start, primary.port)
        assert await fetchval(address, "SELECT pg_is_in_recovery()") is True

        # The connected store's next connections find a standby: refused, typed.
        with pytest.raises(RecurringStorageError, match="standby"):
            await until_refused(lambda: store.tick(10))
        with pytest.raises(RecurringStorageError, match="standby"):
            await store.schedules()
        await refused_by_queue(address)
        # The running worker's claims are refused (read-only): degraded, nothing runs.
        await poll(
            "the worker's claim to be refused as read-only",
            lambda: _logged(caplog, "session is read-only (SQLSTATE 25006"),
        )
        assert worker.scheduler.health() is Health.DEGRADED

        # --- promotion: the same store and worker carry on ---------------------------------
        await asyncio.to_thread(replica.promote)
        assert await fetchval(address, "SELECT pg_is_in_recovery()") is False
        assert (await store.tick(100)).materialized == 20  # 04:31..05:00, 30 in all
        rows, distinct = await occurrence_rows(address)
        assert rows == distinct == 30  # each due instant once: nothing lost, nothing twice
        assert [s.name for s in (await store.schedules()).items] == ["minutely"]

        conn = await asyncpg.connect(address)
        try:
            after = await enqueue_many(conn, WORK, list(range(20)), schema=QUEUE)
        finally:
            await conn.close()
        await poll(
            "the worker to run the tasks enqueued after the failover",
            lambda: _ran_all(worker, before + after),
        )
        await poll("the worker to report healthy", lambda: _healthy(worker))
        await finished_once(address, QUEUE, before + after)
    finally:
        await store.close()


@pytest.mark.timeout(120)
async def test_multi_host_dsn_finds_the_writer_before_and_after_failover(
    pg_clusters: Clusters, worker_factory: Any
) -> None:
    """``host=standby,primary target_session_attrs=read-write``: asyncpg skips the standby.

    The store and the worker are given both hosts, standby first; they write to the
    primary. The primary dies and the standby is promoted: their new connections go to the
    promoted node by themselves.
    """
    clock = FakeClock(START)
    primary = pg_clusters.new("primary")
    store = await deploy(primary.dsn(), clock)
    await store.close()
    replica = pg_clusters.replica(primary, "replica")
    await streaming(primary, replica)
    both = (
        f"postgresql://postgres@127.0.0.1:{replica.port},127.0.0.1:{primary.port}/postgres"
        "?target_session_attrs=read-write"
    )
    store = await PostgresRecurringStore.connect(both, CONFIG, KEYRING, clock)
    try:
        await store.create(minutely())
        assert (await store.tick(10)).materialized == 10
        worker = worker_factory(both)
        conn = await asyncpg.connect(both)
        try:
            assert await conn.fetchval("SELECT pg_is_in_recovery()") is False
            before = await enqueue_many(conn, WORK, list(range(10)), schema=QUEUE)
        finally:
            await conn.close()
        await poll("the worker to run the first tasks", lambda: _ran_all(worker, before))
        await streaming(primary, replica)

        await asyncio.to_thread(primary.stop, "fast")
        await asyncio.to_thread(replica.promote)

        assert (await until_ok(lambda: store.tick(100))).materialized == 20
        rows, distinct = await occurrence_rows(replica.dsn())
        assert rows == distinct == 30
        conn = await asyncpg.connect(both)
        try:
            after = await enqueue_many(conn, WORK, list(range(10)), schema=QUEUE)
        finally:
            await conn.close()
        await poll(
            "the worker to run the tasks enqueued after the failover",
            lambda: _ran_all(worker, before + after),
        )
        await finished_once(replica.dsn(), QUEUE, before + after)
    finally:
        await store.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("scope", ["database", "role"])
async def test_read_only_primary_refused(pg_clusters: Clusters, scope: str) -> None:
    """``default_transaction_read_only=on`` for the database or the role: refused, typed."""
    clock = FakeClock(START)
    primary = pg_clusters.new("primary")
    dsn = primary.dsn()
    store = await deploy(dsn, clock)
    await store.close()
    target = "DATABASE postgres" if scope == "database" else "ROLE postgres"
    await execute(dsn, f"ALTER {target} SET default_transaction_read_only = on")
    assert await fetchval(dsn, "SHOW default_transaction_read_only") == "on"

    with pytest.raises(RecurringStorageError, match="read-only"):
        await PostgresRecurringStore.initialize(dsn, CONFIG, KEYRING, clock)
    with pytest.raises(RecurringStorageError, match="read-only"):
        await PostgresRecurringStore.connect(dsn, CONFIG, KEYRING, clock)
    worker = Scheduler(dsn, worker_id="w", schema=QUEUE)
    worker.register(WORK, _noop)
    with pytest.raises(UnfitDatabaseError, match="read-only") as refused:
        await asyncio.wait_for(worker.run_until_shutdown(asyncio.Event()), 30)
    assert refused.value.setting == "default_transaction_read_only"
    conn = await asyncpg.connect(dsn)
    try:
        with pytest.raises(UnfitDatabaseError, match="read-only") as refused:
            await install(conn, schema="another")
        assert refused.value.setting == "default_transaction_read_only"
        with pytest.raises(UnfitDatabaseError, match="read-only") as refused:
            await enqueue(conn, WORK, 1, schema=QUEUE)
        assert refused.value.setting == "read_only"
    finally:
        await conn.close()

    # A writable session (the administrator's) resets it; everything works again.
    writable = primary.dsn(query="default_transaction_read_only=off")  # a server setting
    await execute(writable, f"ALTER {target} RESET default_transaction_read_only")
    store = await PostgresRecurringStore.connect(dsn, CONFIG, KEYRING, clock)
    try:
        await store.create(minutely())
        assert (await store.tick(5)).materialized == 5
    finally:
        await store.close()
    conn = await asyncpg.connect(dsn)
    try:
        assert (await enqueue(conn, WORK, 1, schema=QUEUE)).deduplicated is False
        assert await conn.fetchval(f"SELECT count(*) FROM {QUEUE}.tasks") == 1
        assert await conn.fetchval("SELECT to_regnamespace('another')") is None
    finally:
        await conn.close()


@pytest.mark.timeout(120)
async def test_server_turned_read_only_under_a_connected_store(pg_clusters: Clusters) -> None:
    """``ALTER SYSTEM SET default_transaction_read_only`` + reload reaches open sessions.

    The store's pooled connections were checked when opened; the server-wide setting
    changes them afterwards. The refused write is still typed and says read-only, nothing
    is stored, and the store works again once the setting is reset.
    """
    clock = FakeClock(START)
    primary = pg_clusters.new("primary")
    dsn = primary.dsn()
    store = await deploy(dsn, clock)
    try:
        await store.create(minutely())
        assert (await store.tick(5)).materialized == 5
        conn = await asyncpg.connect(dsn)
        try:
            await conn.execute("ALTER SYSTEM SET default_transaction_read_only = on")
            await conn.execute("SELECT pg_reload_conf()")
            await poll(
                "the reload to reach sessions",
                lambda: _setting(dsn, "default_transaction_read_only", "on"),
            )
            with pytest.raises(RecurringStorageError, match="read-only"):
                await store.tick(5)
            assert await occurrence_rows(dsn) == (5, 5)
            with pytest.raises(UnfitDatabaseError, match="read-only"):
                await enqueue(conn, WORK, 1, schema=QUEUE)
            await conn.execute("SET default_transaction_read_only = off")
            await conn.execute("ALTER SYSTEM RESET default_transaction_read_only")
            await conn.execute("SELECT pg_reload_conf()")
            await poll(
                "the reload to reach sessions",
                lambda: _setting(dsn, "default_transaction_read_only", "off"),
            )
        finally:
            await conn.close()
        assert (await until_ok(lambda: store.tick(5))).materialized == 5
        assert await occurrence_rows(dsn) == (10, 10)
    finally:
        await store.close()


# --- helpers ---------------------------------------------------------------------------------


async def refused_by_queue(dsn: str) -> None:
    """install, enqueue (three drivers' ways) and the worker refuse a standby at ``dsn``."""
    conn = await asyncpg.connect(dsn)
    try:
        with pytest.raises(UnfitDatabaseError, match="standby") as refused:
            await install(conn, schema=QUEUE)
        assert refused.value.setting == "pg_is_in_recovery"
        for attempt in (
            lambda: enqueue(conn, WORK, 1, schema=QUEUE),
            lambda: enqueue_many(conn, WORK, [1, 2], schema=QUEUE),
        ):
            with pytest.raises(UnfitDatabaseError, match="standby") as refused:
                await attempt()
            assert refused.value.setting == "read_only"
            assert isinstance(refused.value.__cause__, asyncpg.ReadOnlySQLTransactionError)
    finally:
        await conn.close()
    with psycopg.connect(dsn) as sync_conn:
        with pytest.raises(UnfitDatabaseError, match="read-only"):
            enqueue_sync(sync_conn, WORK, 1, schema=QUEUE)
        sync_conn.rollback()
    worker = Scheduler(dsn, worker_id="w", schema=QUEUE)
    worker.register(WORK, _noop)
    with pytest.raises(UnfitDatabaseError, match="standby") as refused:
        await asyncio.wait_for(worker.run_until_shutdown(asyncio.Event()), 30)
    assert refused.value.setting == "pg_is_in_recovery"


async def _noop(ctx: JobContext, args: Any) -> None:
    del ctx, args


async def until_ok(call: Any, attempts: int = 100) -> Any:
    """Retry a store call over a failover: its failures are typed storage errors."""
    last: Exception | None = None
    for _ in range(attempts):
        try:
            return await call()
        except RecurringStorageError as exc:
            last = exc
            await asyncio.sleep(0.1)
    raise AssertionError(f"the store never recovered: {last!r}")


async def until_refused(call: Any, attempts: int = 100) -> Any:
    """Call until the failure is the standby refusal (dead pooled links fail first)."""
    last: Exception | None = None
    for _ in range(attempts):
        try:
            return await call()
        except RecurringStorageError as exc:
            if "standby" in str(exc):
                raise
            last = exc
            await asyncio.sleep(0.05)
    raise AssertionError(f"never refused as a standby: {last!r}")


async def _ran_all(worker: Worker, ids: list[int]) -> bool:
    return set(ids) <= set(worker.ran)


async def _healthy(worker: Worker) -> bool:
    return worker.scheduler.health() is Health.HEALTHY


async def _logged(caplog: pytest.LogCaptureFixture, text: str) -> bool:
    return any(text in r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)


async def _setting(dsn: str, name: str, value: str) -> bool:
    return bool(await fetchval(dsn, f"SHOW {name}") == value)
