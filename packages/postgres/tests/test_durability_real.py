"""RELIABILITY row 22: durability settings provoked for real, for the recurring store and
the work queue alike.

- ``synchronous_commit`` at each level (off, local, remote_write, remote_apply, on) set on
  the server (``ALTER SYSTEM`` + reload), the database, the role and the session, on a
  private cluster: ``off`` is refused by both, every other level is accepted and works (on
  one node each of them flushes the local WAL before COMMIT returns; see the operations
  guide's durability checks, docs/operations.md).
- ``fsync=off`` and ``full_page_writes=off`` on the server (reload): refused by both.
- Unlogged tables: each table of each product (with the tables that must go unlogged with
  it), refused naming the table.
- TEMP tables: every statement names its tables schema-qualified, so a TEMP table of the
  same name cannot shadow one (shown on the caller's connection and on a caller's pool);
  the only way to make them temporary is the schema ``pg_temp``, which is refused before
  connecting. A standby is refused too (tests/test_fault_standby.py).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import pytest

from pg_cluster import Cluster, Clusters, execute, fetchval, poll
from queue_support import wait_until
from steeple.core import (
    MissedRunPolicy,
    RecurringConfig,
    RecurringConfigurationError,
    RecurringDeadlineError,
    RecurringDefinition,
    RecurringStorageError,
    ScheduledMessage,
)
from steeple.keyring import Keyring, StorageKey
from steeple.postgres import PostgresRecurringStore
from steeple.postgres._durability import check_schema_name, write_refusal
from steeple.postgres.queue import (
    JobContext,
    QueueConfigurationError,
    Scheduler,
    Task,
    UnfitDatabaseError,
    enqueue,
    enqueue_many,
    install,
)
from steeple.testing import FakeClock

pytestmark = pytest.mark.postgres

START = datetime(2031, 3, 4, 5, 0, 0, tzinfo=UTC)
KEYRING = Keyring(StorageKey("k1", b"\x0b" * 32))
CONFIG = RecurringConfig("durability", max_definitions=100, max_occurrences=1000)
QUEUE = "q"
WORK: Task[Any] = Task("work")
LEVELS = ["off", "local", "remote_write", "remote_apply", "on"]
SCOPES = ["server", "database", "role", "session"]
RECURRING_TABLES = (
    "recurring_schema_version",
    "recurring_namespaces",
    "recurring_definitions",
    "recurring_occurrences",
)
QUEUE_TABLES = ("schema_migrations", "tasks", "attempts", "jobs")


def definition(name: str) -> RecurringDefinition:
    return RecurringDefinition(
        name,
        "* * * * *",
        START - timedelta(minutes=5),
        MissedRunPolicy.CATCH_UP,
        ScheduledMessage("t", "m", b"payload"),
    )


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """One private cluster for the module (its settings are changed and reset per test)."""
    clusters = Clusters()
    try:
        yield clusters.new("durability")
    finally:
        clusters.cleanup()


@pytest.fixture
async def deployed(cluster: Cluster) -> Cluster:
    """The cluster with the recurring store initialized and the queue installed."""
    store = await PostgresRecurringStore.initialize(
        cluster.dsn(), CONFIG, KEYRING, FakeClock(START)
    )
    await store.close()
    conn = await asyncpg.connect(cluster.dsn())
    try:
        await install(conn, schema=QUEUE)
    finally:
        await conn.close()
    return cluster


async def _shows(dsn: str, name: str, value: str) -> bool:
    return bool(await fetchval(dsn, f"SHOW {name}") == value)


@contextlib.asynccontextmanager
async def server_setting(cluster: Cluster, name: str, value: str) -> AsyncIterator[None]:
    """``ALTER SYSTEM SET name = 'value'`` and reload; reset (and reload) afterwards."""
    dsn = cluster.dsn()
    default = await fetchval(dsn, f"SHOW {name}")
    await execute(dsn, f"ALTER SYSTEM SET {name} = '{value}'", "SELECT pg_reload_conf()")
    try:
        await poll(f"{name}={value} after the reload", lambda: _shows(dsn, name, value))
        yield
    finally:
        await execute(dsn, f"ALTER SYSTEM RESET {name}", "SELECT pg_reload_conf()")
        await poll(f"{name} reset after the reload", lambda: _shows(dsn, name, default))


@contextlib.asynccontextmanager
async def synchronous_commit(cluster: Cluster, scope: str, level: str) -> AsyncIterator[str]:
    """Set ``synchronous_commit`` at ``scope``; yield the DSN whose sessions get it."""
    dsn = cluster.dsn()
    if scope == "server":
        async with server_setting(cluster, "synchronous_commit", level):
            yield dsn
        return
    if scope == "session":
        yield cluster.dsn(query=f"synchronous_commit={level}")  # a server setting of asyncpg
        return
    target = "DATABASE postgres" if scope == "database" else "ROLE postgres"
    await execute(dsn, f"ALTER {target} SET synchronous_commit = {level}")
    try:
        yield dsn
    finally:
        await execute(dsn, f"ALTER {target} RESET synchronous_commit")


async def runs_a_task(dsn: str) -> None:
    """A worker on ``dsn`` starts, runs one task enqueued now, and stops."""
    ran = asyncio.Event()
    worker = Scheduler(dsn, worker_id="w", schema=QUEUE, poll_interval=0.1, listen=False)

    async def handler(ctx: JobContext, args: Any) -> None:
        ran.set()

    worker.register(WORK, handler)
    stop = asyncio.Event()
    run = asyncio.create_task(worker.run_until_shutdown(stop))
    try:
        conn = await asyncpg.connect(dsn)
        try:
            await enqueue(conn, WORK, 1, schema=QUEUE)
        finally:
            await conn.close()
        await asyncio.wait_for(ran.wait(), 30)
    finally:
        stop.set()
        await asyncio.wait_for(run, 30)


async def worker_refused(dsn: str) -> UnfitDatabaseError:
    worker = Scheduler(dsn, worker_id="w", schema=QUEUE, listen=False)
    worker.register(WORK, _noop)
    with pytest.raises(UnfitDatabaseError) as refused:
        await asyncio.wait_for(worker.run_until_shutdown(asyncio.Event()), 30)
    return refused.value


async def _noop(ctx: JobContext, args: Any) -> None:
    del ctx, args


# --- synchronous_commit, fsync, full_page_writes ------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("scope", SCOPES)
async def test_synchronous_commit_levels(deployed: Cluster, scope: str, level: str) -> None:
    clock = FakeClock(START)
    async with synchronous_commit(deployed, scope, level) as dsn:
        assert await fetchval(dsn, "SHOW synchronous_commit") == level  # provoked for real
        if level == "off":
            with pytest.raises(RecurringStorageError, match="synchronous_commit"):
                await PostgresRecurringStore.initialize(dsn, CONFIG, KEYRING, clock)
            with pytest.raises(RecurringStorageError, match="synchronous_commit"):
                await PostgresRecurringStore.connect(dsn, CONFIG, KEYRING, clock)
            assert (await worker_refused(dsn)).setting == "synchronous_commit"
            return
        store = await PostgresRecurringStore.initialize(dsn, CONFIG, KEYRING, clock)
        try:
            created = await store.create(definition(f"{scope}-{level}"))
            assert created.name == f"{scope}-{level}"
        finally:
            await store.close()
        await runs_a_task(dsn)


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("setting", ["fsync", "full_page_writes"])
async def test_server_durability_settings_refused(deployed: Cluster, setting: str) -> None:
    """Both products refuse a server reloaded with ``fsync`` or ``full_page_writes`` off."""
    dsn = deployed.dsn()
    clock = FakeClock(START)
    async with server_setting(deployed, setting, "off"):
        with pytest.raises(RecurringStorageError, match=setting):
            await PostgresRecurringStore.connect(dsn, CONFIG, KEYRING, clock)
        with pytest.raises(RecurringStorageError, match=setting):
            await PostgresRecurringStore.initialize(dsn, CONFIG, KEYRING, clock)
        refused = await worker_refused(dsn)
        assert refused.setting == setting
        assert f"{setting}=off" in str(refused)
    store = await PostgresRecurringStore.connect(dsn, CONFIG, KEYRING, clock)
    await store.close()
    await runs_a_task(dsn)


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_an_absent_synchronous_standby_holds_the_commit(deployed: Cluster) -> None:
    """``synchronous_standby_names`` names a standby that is not connected.

    Every steeple transaction commits with ``synchronous_commit = on`` (raised locally even
    when the role says ``local``), so its COMMIT waits for that standby, and neither
    ``statement_timeout`` nor the client going away ends the wait: the call deadline
    (10 s) fires, typed, while the transaction stays invisible, holding the namespace's
    control row, until the standby comes or the setting goes. Then it completes, once.
    """
    dsn = deployed.dsn()
    clock = FakeClock(START)
    store = await PostgresRecurringStore.connect(dsn, CONFIG, KEYRING, clock)
    count = "SELECT count(*) FROM steeple.recurring_occurrences"
    distinct = "SELECT count(DISTINCT (definition_name, due_at)) FROM steeple.recurring_occurrences"
    waiting = "SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'SyncRep'"
    try:
        await store.create(definition("held"))  # 5 due at START (and any left by other tests)
        before = await fetchval(dsn, count)
        async with server_setting(deployed, "synchronous_standby_names", "absent"):
            with pytest.raises(RecurringDeadlineError):
                await store.tick(100)
            assert await fetchval(dsn, waiting) == 1  # abandoned by the store, still waiting
            assert await fetchval(dsn, count) == before  # not visible: nothing acknowledged
        await poll("the held commit to complete", lambda: _counts(dsn, waiting, 0))
        held = await fetchval(dsn, count)
        assert held >= before + 5
        assert (await store.tick(100)).materialized == 0  # done once, not repeated
        assert await fetchval(dsn, count) == await fetchval(dsn, distinct) == held
    finally:
        await store.close()


async def _counts(dsn: str, query: str, expected: int) -> bool:
    return bool(await fetchval(dsn, query) == expected)


async def test_enqueue_commits_synchronously_on_a_session_that_does_not(
    queue: tuple[str, str, asyncpg.Connection],
) -> None:
    """A caller's session with synchronous_commit=off: the enqueueing transaction is not."""
    _dsn, schema, conn = queue
    await conn.execute("SET synchronous_commit = off")
    async with conn.transaction():
        await enqueue(conn, WORK, 1, schema=schema)
        assert await conn.fetchval("SHOW synchronous_commit") == "on"
    assert await conn.fetchval("SHOW synchronous_commit") == "off"  # local to it
    async with conn.transaction():
        await enqueue_many(conn, WORK, [1, 2], schema=schema)
        assert await conn.fetchval("SHOW synchronous_commit") == "on"


# --- unlogged tables --------------------------------------------------------------------


async def _referencing(conn: asyncpg.Connection, qualified: str) -> list[str]:
    rows = await conn.fetch(
        "SELECT k.conrelid::regclass::text AS t FROM pg_catalog.pg_constraint k"
        " WHERE k.contype = 'f' AND k.confrelid = $1::regclass AND k.conrelid <> k.confrelid",
        qualified,
    )
    return [r["t"] for r in rows]


@contextlib.asynccontextmanager
async def unlogged(conn: asyncpg.Connection, schema: str, table: str) -> AsyncIterator[None]:
    """Make ``table`` unlogged (and first every table whose foreign keys need that too)."""
    qualified = f'"{schema}".{table}'
    referencing = await _referencing(conn, qualified)
    for other in referencing:
        await conn.execute(f"ALTER TABLE {other} SET UNLOGGED")
    await conn.execute(f"ALTER TABLE {qualified} SET UNLOGGED")
    try:
        yield
    finally:
        await conn.execute(f"ALTER TABLE {qualified} SET LOGGED")
        for other in referencing:
            await conn.execute(f"ALTER TABLE {other} SET LOGGED")


@pytest.mark.parametrize("table", RECURRING_TABLES)
async def test_each_unlogged_recurring_table_refused(
    pg_schema: tuple[str, str], table: str
) -> None:
    dsn, schema = pg_schema
    clock = FakeClock(START)
    store = await PostgresRecurringStore.initialize(dsn, CONFIG, KEYRING, clock, schema=schema)
    await store.close()
    conn = await asyncpg.connect(dsn)
    try:
        async with unlogged(conn, schema, table):
            with pytest.raises(RecurringStorageError, match="is unlogged"):
                await PostgresRecurringStore.connect(dsn, CONFIG, KEYRING, clock, schema=schema)
            with pytest.raises(RecurringStorageError, match="is unlogged"):
                await PostgresRecurringStore.initialize(dsn, CONFIG, KEYRING, clock, schema=schema)
    finally:
        await conn.close()
    store = await PostgresRecurringStore.connect(dsn, CONFIG, KEYRING, clock, schema=schema)
    await store.close()


@pytest.mark.parametrize("table", QUEUE_TABLES)
async def test_each_unlogged_queue_table_refused(
    queue: tuple[str, str, asyncpg.Connection], table: str
) -> None:
    dsn, schema, conn = queue
    async with unlogged(conn, schema, table):
        worker = Scheduler(dsn, worker_id="w", schema=schema, listen=False)
        worker.register(WORK, _noop)
        with pytest.raises(UnfitDatabaseError, match="is unlogged") as refused:
            await asyncio.wait_for(worker.run_until_shutdown(asyncio.Event()), 30)
        assert refused.value.setting == "relpersistence"


# --- the shared judgements (no server) ---------------------------------------------------


class _Answered(Exception):
    def __init__(self, sqlstate: object) -> None:
        super().__init__("server said no")
        self.sqlstate = sqlstate


@pytest.mark.parametrize(
    ("sqlstate", "setting", "words"),
    [
        ("25006", "read_only", "read-only"),
        ("53100", "disk_full", "disk full"),
        ("53300", "insufficient_resources", "too many connections"),
        ("53200", "insufficient_resources", "lacks resources"),
        ("40001", None, None),
        (None, None, None),
        (25006, None, None),
    ],
)
def test_write_refusals_are_named_by_sqlstate(
    sqlstate: object, setting: str | None, words: str | None
) -> None:
    refusal = write_refusal(_Answered(sqlstate))
    if setting is None:
        assert refusal is None
        return
    assert refusal is not None
    assert words is not None
    assert refusal[0] == setting
    assert words in refusal[1]
    assert "nothing was stored" in refusal[1]


@pytest.mark.parametrize("schema", ["steeple", "PG_upper", "pgx", "_pg_temp", "information"])
def test_unreserved_schema_names_pass(schema: str) -> None:
    check_schema_name(schema)  # PostgreSQL reserves the case-sensitive prefix "pg_" only


# --- temporary tables ---------------------------------------------------------------------


@pytest.mark.parametrize("schema", ["pg_temp", "pg_temp_3", "pg_catalog", "information_schema"])
async def test_reserved_schemas_refused_before_connecting(schema: str) -> None:
    """``pg_temp`` would make every table temporary; the others are the system's."""
    dsn = "postgresql://nobody@127.0.0.1:1/none"  # never reached: refused before connecting
    clock = FakeClock(START)
    for open_store in (PostgresRecurringStore.initialize, PostgresRecurringStore.connect):
        with pytest.raises(RecurringConfigurationError, match="reserved"):
            await open_store(dsn, CONFIG, KEYRING, clock, schema=schema)
    with pytest.raises(QueueConfigurationError, match="reserved"):
        Scheduler(dsn, worker_id="w", schema=schema)
    with pytest.raises(QueueConfigurationError, match="reserved"):
        await install(object(), schema=schema)
    with pytest.raises(QueueConfigurationError, match="reserved"):
        await enqueue(object(), WORK, 1, schema=schema)


async def _shadow(conn: Any, schema: str) -> None:
    """TEMP tables named like the queue's, first on the search path."""
    for table in QUEUE_TABLES:
        await conn.execute(
            f'CREATE TEMP TABLE {table} (LIKE "{schema}".{table} INCLUDING DEFAULTS)'
        )
    await conn.execute(f'SET search_path = pg_temp, "{schema}", public')


async def _temp_rows(conn: Any) -> int:
    total = 0
    for table in QUEUE_TABLES:
        total += await conn.fetchval(f"SELECT count(*) FROM pg_temp.{table}")
    return int(total)


async def test_temp_tables_cannot_shadow_the_queue(
    queue: tuple[str, str, asyncpg.Connection],
) -> None:
    """A caller's session and a caller's pool full of same-named TEMP tables change nothing."""
    dsn, schema, conn = queue
    await _shadow(conn, schema)
    task = await enqueue(conn, WORK, 1, schema=schema)
    many = await enqueue_many(conn, WORK, [2, 3], schema=schema)
    assert await _temp_rows(conn) == 0
    shadowed_pool = await asyncpg.create_pool(
        dsn, min_size=3, max_size=4, init=lambda c: _shadow(c, schema)
    )
    ran: list[int] = []
    try:
        worker = Scheduler(shadowed_pool, worker_id="w", schema=schema, poll_interval=0.1)

        async def handler(ctx: JobContext, args: Any) -> None:
            ran.append(ctx.task_id)

        worker.register(WORK, handler)
        stop = asyncio.Event()
        run = asyncio.create_task(worker.run_until_shutdown(stop))
        try:
            await wait_until(lambda: len(ran) == 3)
            await wait_until(
                lambda: conn.fetchval(
                    f"SELECT count(*) = 3 FROM \"{schema}\".tasks WHERE state = 'succeeded'"
                )
            )
        finally:
            stop.set()
            await asyncio.wait_for(run, 30)
        async with shadowed_pool.acquire() as pooled:
            assert await _temp_rows(pooled) == 0
    finally:
        await shadowed_pool.close()
    assert sorted(ran) == sorted([task.id, *many])
    assert await _temp_rows(conn) == 0


async def test_a_tampered_install_cannot_make_the_tables_temporary(
    queue: tuple[str, str, asyncpg.Connection],
) -> None:
    """A TEMP table always lives in the session's pg_temp_N schema, never in a named one, so
    the relpersistence check can only meet 't' through the (refused) schema pg_temp."""
    _dsn, schema, conn = queue
    with pytest.raises(asyncpg.InvalidTableDefinitionError, match="temporary"):
        await conn.execute(f'CREATE TEMP TABLE "{schema}".tasks_copy (a int)')
    persistence = await conn.fetch(
        "SELECT DISTINCT c.relpersistence::text AS p FROM pg_class c"
        " JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = $1",
        schema,
    )
    assert [r["p"] for r in persistence] == ["p"]
