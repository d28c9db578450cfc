"""steeple through a real PgBouncer in transaction mode (``pool_mode = transaction``).

Each test starts its own PgBouncer (tests/pgbouncer_support.py: a private port, config and
auth file in a temporary directory) in front of the test server, and stops it afterwards,
even on failure. Behind it, each transaction of a client connection may run on another
server session: nothing steeple does may rely on session state.

- An application enqueues through the pooler with asyncpg (``statement_cache_size=0``) and
  with psycopg, sync and async, at its default ``prepare_threshold``: steeple's statements
  are never prepared by name, so a client whose next transaction lands on another server
  session still works.
- The worker runs through the pooler with ``pooler="transaction"``: LISTEN on a direct
  ``listen_dsn`` (tasks are woken by NOTIFY, not by the long poll), or polling with one
  log line saying so; without the setting it refuses to start with a configuration error
  naming it; a caller's asyncpg pool with a statement cache is refused.
- The pooler is killed (SIGKILL) and started again mid-run: the worker recovers without
  help, every task succeeds exactly once (no second succeeded attempt: the lease fencing
  holds), and work enqueued after the restart is done.
- The recurring store ticks, claims and relays through the pooler; without the setting
  its connect is refused with an error naming it.
- The admin CLI enqueues, lists and initializes through the pooler, and the dashboard's
  queue backend reads and pauses through it.
- The work-queue broker publishes through the pooler with ``pooler="transaction"``
  (``synchronous_commit`` set in each publication's transaction, seen by a trigger),
  deduplicates, and gets over a pooler restart; without the setting it refuses with a
  configuration error naming it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator, Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import pytest

import queue_support
from pgbouncer_support import BINARY, PgBouncer, running_pgbouncer
from steeple.postgres.queue import (
    EnqueueOptions,
    Health,
    JobContext,
    QueueConfigurationError,
    Scheduler,
    Task,
    enqueue,
    enqueue_sync,
)

pytestmark = [pytest.mark.postgres]

WORK: Task[Any] = Task("pooled.work")
QUEUE_LOG = "steeple.postgres.queue"


@pytest.fixture
def bouncer(pg_dsn: str) -> Iterator[PgBouncer]:
    if not os.access(BINARY, os.X_OK):
        if os.environ.get("CI", "").lower() in {"1", "true", "yes"}:
            pytest.fail("pgbouncer is not installed, and under CI=true that is a failure")
        pytest.skip("pgbouncer is not installed")
    with running_pgbouncer(pg_dsn) as running:
        yield running


@pytest.fixture
async def queue(pg_schema: tuple[str, str]) -> AsyncIterator[tuple[str, str]]:
    dsn, schema = pg_schema
    async with queue_support.installed_queue(dsn, schema, connect_timeout=10):
        yield dsn, schema


@contextlib.asynccontextmanager
async def running(worker: Scheduler) -> AsyncIterator[asyncio.Event]:
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run_until_shutdown(stop, drain_timeout=10))
    try:
        yield stop
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


async def test_an_application_enqueues_through_the_pooler(
    queue: tuple[str, str], bouncer: PgBouncer
) -> None:
    """asyncpg and psycopg (sync and async) clients enqueue while their transactions move
    between server sessions; psycopg keeps its default prepare_threshold (5)."""
    import psycopg

    dsn, schema = queue
    pooled = bouncer.dsn()
    pool = await asyncpg.create_pool(pooled, min_size=1, max_size=4, statement_cache_size=0)
    psy = await psycopg.AsyncConnection.connect(pooled, autocommit=True)
    sync: psycopg.Connection[Any] = await asyncio.to_thread(
        lambda: psycopg.connect(pooled, autocommit=True)
    )
    holders: list[Any] = []
    try:
        ids: list[int] = []
        for i in range(8):  # past psycopg's prepare_threshold on one server session
            ids.append((await enqueue(psy, WORK, {"n": i}, schema=schema)).id)
            ids.append(
                (await asyncio.to_thread(enqueue_sync, sync, WORK, {"n": i}, schema=schema)).id
            )
        # Each holder keeps a transaction (so a server session) of its own, the most
        # recently used ones first: the clients' next transactions run on other sessions.
        for _ in range(3):
            holder = await psycopg.AsyncConnection.connect(pooled)
            holders.append(holder)
            await holder.execute("SELECT 1")
        for i in range(8, 12):
            ids.append((await enqueue(psy, WORK, {"n": i}, schema=schema)).id)
            ids.append(
                (await asyncio.to_thread(enqueue_sync, sync, WORK, {"n": i}, schema=schema)).id
            )

        async def one(i: int) -> int:
            async with pool.acquire() as conn, conn.transaction():
                return (await enqueue(conn, WORK, {"n": i}, schema=schema)).id

        ids += await asyncio.gather(*(one(i) for i in range(20)))
    finally:
        for holder in holders:
            await holder.close()
        await psy.close()
        await asyncio.to_thread(sync.close)
        await pool.close()
    direct = await asyncpg.connect(dsn)
    try:
        stored = await direct.fetchval(f'SELECT count(*) FROM "{schema}".tasks')
    finally:
        await direct.close()
    assert len(set(ids)) == len(ids) == stored == 44


async def test_the_worker_listens_on_the_direct_dsn(
    queue: tuple[str, str], bouncer: PgBouncer
) -> None:
    """Tasks enqueued through the pooler wake the worker by NOTIFY (the poll is 10 min)."""
    dsn, schema = queue
    done: list[int] = []

    async def handler(ctx: JobContext, args: dict[str, int]) -> None:
        done.append(args["n"])

    worker = Scheduler(
        bouncer.dsn(),
        worker_id="pooled-listen",
        schema=schema,
        pooler="transaction",
        listen_dsn=dsn,
        poll_interval=600,
        maintenance_interval=600,
    )
    worker.register(WORK, handler)
    async with running(worker):
        await queue_support.wait_until(lambda: worker.health() is Health.HEALTHY)
        conn = await asyncpg.connect(bouncer.dsn(), statement_cache_size=0)
        try:
            for n in range(5):
                await enqueue(conn, WORK, {"n": n}, schema=schema)
        finally:
            await conn.close()
        await queue_support.wait_until(lambda: len(done) == 5, timeout=30)
        assert worker.health() is Health.HEALTHY, worker.health_reasons()
    assert sorted(done) == list(range(5))


async def test_without_listen_dsn_the_worker_polls_and_says_so(
    queue: tuple[str, str], bouncer: PgBouncer, caplog: pytest.LogCaptureFixture
) -> None:
    dsn, schema = queue
    done: list[int] = []

    async def handler(ctx: JobContext, args: dict[str, int]) -> None:
        done.append(args["n"])

    worker = Scheduler(
        bouncer.dsn(), worker_id="pooled-poll", schema=schema, pooler="transaction",
        poll_interval=0.2,
    )  # fmt: skip
    worker.register(WORK, handler)
    caplog.set_level(logging.INFO, logger=QUEUE_LOG)
    async with running(worker):
        conn = await asyncpg.connect(dsn)
        try:
            for n in range(3):
                await enqueue(conn, WORK, {"n": n}, schema=schema)
        finally:
            await conn.close()
        await queue_support.wait_until(lambda: len(done) == 3, timeout=30)
        assert worker.health() is Health.HEALTHY, worker.health_reasons()
    said = [r.getMessage() for r in caplog.records if "wake-ups are by polling" in r.getMessage()]
    assert len(said) == 1, said
    assert "every 0.2 s" in said[0]
    assert "listen_dsn" in said[0]


async def test_an_undeclared_pooler_is_refused_naming_the_setting(
    queue: tuple[str, str], bouncer: PgBouncer
) -> None:
    _, schema = queue
    worker = Scheduler(bouncer.dsn(), worker_id="undeclared", schema=schema)

    async def handler(ctx: JobContext, args: Any) -> None:
        del ctx, args

    worker.register(WORK, handler)
    with pytest.raises(QueueConfigurationError, match=r"Scheduler\(\.\.\., pooler='transaction'\)"):
        await worker.run_until_shutdown(asyncio.Event())


# PgBouncer refuses the first startup parameter it does not know; each caller names what
# its user changes: a keyword argument in code, the options of the command line.
_REFUSED = (
    "the server refused the session setting '{}' at connect, as a connection pooler in "
    "transaction mode (PgBouncer) does"
)
_WAKEUPS = ", and give {} a direct connection to PostgreSQL for LISTEN/NOTIFY wake-ups"
_CLI_POOLER = (
    'give --pooler transaction (or STEEPLE_POOLER=transaction, or pooler = "transaction" '
    "in steeple.toml)"
)
_CLI_LISTEN = "--listen-dsn (or STEEPLE_LISTEN_DSN, or listen_dsn in steeple.toml)"


async def test_each_caller_words_an_undeclared_pooler_in_its_own_terms(
    queue: tuple[str, str], pg_name: Any, bouncer: PgBouncer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker, the recurring store and the work-queue broker built in code name their
    own keyword argument (listen_dsn only for the worker, the one that LISTENs); the
    command line names --pooler and STEEPLE_POOLER (and --listen-dsn for steeple worker).
    """
    import base64

    from typer.testing import CliRunner

    from steeple.admin._backend import Target, classify
    from steeple.admin.cli import app
    from steeple.admin.settings import ExitCode, NamespaceSettings
    from steeple.admin.worker import WorkerApp, run_worker
    from steeple.brokers.queue import WorkQueueBroker
    from steeple.core import RecurringConfig, RecurringConfigurationError
    from steeple.core.clock import SystemClock
    from steeple.core.errors import BrokerConfigurationError
    from steeple.keyring import Keyring, StorageKey
    from steeple.postgres import PostgresRecurringStore

    for name in list(os.environ):
        if name.startswith("STEEPLE_") and name != "STEEPLE_TEST_DSN":
            monkeypatch.delenv(name, raising=False)
    _, schema = queue
    store_schema = pg_name("pgbsay")
    keys = "k1:" + base64.b64encode(bytes(32)).decode()

    async def handler(ctx: JobContext, args: Any) -> None:
        del ctx, args

    worker = Scheduler(bouncer.dsn(), worker_id="says", schema=schema)
    worker.register(WORK, handler)
    with pytest.raises(QueueConfigurationError) as refused_worker:
        await worker.run_until_shutdown(asyncio.Event())
    refused = _REFUSED.format("tcp_keepalives_idle")
    assert str(refused_worker.value) == (
        refused + ": create it as Scheduler(..., pooler='transaction') or "
        "App.scheduler(..., pooler='transaction')" + _WAKEUPS.format("listen_dsn")
    )

    keyring = Keyring(StorageKey("k1", bytes(32)))
    with pytest.raises(RecurringConfigurationError) as refused_store:
        await PostgresRecurringStore.connect(
            bouncer.dsn(),
            RecurringConfig("says", 10, 100),
            keyring,
            SystemClock(),
            schema=store_schema,
        )
    assert str(refused_store.value) == (
        "connect: " + _REFUSED.format("statement_timeout") + ": open it "
        "with PostgresRecurringStore.connect(..., pooler='transaction') (or "
        "initialize(..., pooler='transaction'))"
    )

    async with WorkQueueBroker(bouncer.dsn(), schema=schema) as broker:
        with pytest.raises(BrokerConfigurationError) as refused_broker:
            await broker.install()
    assert str(refused_broker.value) == (
        "work queue: "
        + _REFUSED.format("synchronous_commit")
        + ": create it as WorkQueueBroker(..., pooler='transaction')"
    )

    # The command line: steeple initialize (the recurring store), steeple worker.
    init = await asyncio.to_thread(
        CliRunner().invoke,
        app,
        ["initialize", "--dsn", bouncer.dsn(), "--schema", store_schema],
        env={"STEEPLE_KEYS": keys},
        catch_exceptions=False,
    )
    assert init.exit_code == ExitCode.CONFIG, init.output
    said = init.stderr.splitlines()
    assert said[0] == "steeple: error: " + _REFUSED.format("statement_timeout"), said
    assert said[1:] == ["  what to do: " + _CLI_POOLER], said
    target = Target(
        bouncer.dsn(), store_schema, NamespaceSettings("says"), queue_schema_override=schema
    )
    run = run_worker(WorkerApp(tasks=[(WORK, handler)], worker_id="says-cli"), target)
    with pytest.raises(BaseException) as refused_cli:  # noqa: PT011 (as steeple worker sees it)
        await asyncio.wait_for(run, 60)
    told = classify(refused_cli.value, target)
    assert told.code == ExitCode.CONFIG
    assert str(told) == refused
    assert told.hint == _CLI_POOLER + _WAKEUPS.format(_CLI_LISTEN)


async def test_a_listener_behind_an_undeclared_pooler_is_detected(
    queue: tuple[str, str], bouncer: PgBouncer, caplog: pytest.LogCaptureFixture
) -> None:
    """A caller's pool through the pooler, not declared: LISTEN is accepted but hears
    nothing. The listener's own NOTIFY never comes back: the worker says so, naming the
    settings, and polls (health degraded, naming the listener)."""
    dsn, schema = queue
    done: list[int] = []

    async def handler(ctx: JobContext, args: dict[str, int]) -> None:
        done.append(args["n"])

    pool = await asyncpg.create_pool(bouncer.dsn(), min_size=0, max_size=4, statement_cache_size=0)
    caplog.set_level(logging.INFO, logger=QUEUE_LOG)
    try:
        worker = Scheduler(pool, worker_id="undeclared-listen", schema=schema, poll_interval=0.2)
        worker.register(WORK, handler)
        async with running(worker):
            await queue_support.wait_until(
                lambda: any("did not reach it" in r.getMessage() for r in caplog.records),
                timeout=30,
            )
            assert worker.health() is Health.DEGRADED
            assert any("listener" in reason for reason in worker.health_reasons())
            conn = await asyncpg.connect(dsn)
            try:
                await enqueue(conn, WORK, {"n": 1}, schema=schema)
            finally:
                await conn.close()
            await queue_support.wait_until(lambda: done == [1], timeout=30)
    finally:
        await pool.close()
    said = next(r.getMessage() for r in caplog.records if "did not reach it" in r.getMessage())
    assert "pooler='transaction'" in said
    assert "listen_dsn" in said


async def test_a_caller_pool_with_a_statement_cache_is_refused(bouncer: PgBouncer) -> None:
    pool = await asyncpg.create_pool(bouncer.dsn(), min_size=0, max_size=4)
    try:
        with pytest.raises(QueueConfigurationError, match="statement_cache_size=0"):
            Scheduler(pool, worker_id="cached", pooler="transaction")
        with pytest.raises(QueueConfigurationError, match="pooler must be None"):
            Scheduler(pool, worker_id="cached", pooler="session")  # type: ignore[arg-type]
    finally:
        await pool.close()


async def test_the_workers_survive_pooler_restarts(
    queue: tuple[str, str], bouncer: PgBouncer
) -> None:
    """SIGKILL the pooler mid-run and start it again: nothing lost, nothing run twice.

    Two workers, one LISTENing on the direct DSN and one polling. Each round waits for
    progress, kills the pooler, waits until both workers report it (degraded), starts it
    again and enqueues more. ``STEEPLE_PGBOUNCER_RESTARTS`` rounds (1 here; ``nox -s
    pgbouncer`` runs 10). A claim the server committed while the pooler died never
    reached its worker: those tasks wait for their lease (30 s) to lapse and run then,
    once; so a round may take that long.
    """
    dsn, schema = queue
    rounds = int(os.environ.get("STEEPLE_PGBOUNCER_RESTARTS", "1"))
    started: list[int] = []

    async def handler(ctx: JobContext, args: dict[str, int]) -> None:
        started.append(args["n"])
        await asyncio.sleep(0.05)

    common: dict[str, Any] = {
        "schema": schema,
        "pooler": "transaction",
        "concurrency": 4,
        "poll_interval": 0.5,
        "query_timeout": 5,
    }
    workers = [
        Scheduler(bouncer.dsn(), worker_id="pooled-restart-listen", listen_dsn=dsn, **common),
        Scheduler(bouncer.dsn(), worker_id="pooled-restart-poll", **common),
    ]
    for worker in workers:
        worker.register(WORK, handler)
    options = EnqueueOptions(lease_duration=timedelta(seconds=30))
    direct = await asyncpg.connect(dsn)
    ids: list[int] = []

    def reached(goal: int) -> Callable[[], bool]:
        return lambda: len(started) >= goal

    async def more(count: int) -> None:
        first = len(ids)
        for n in range(first, first + count):
            ids.append((await enqueue(direct, WORK, {"n": n}, options, schema=schema)).id)

    try:
        await more(40)
        async with running(workers[0]), running(workers[1]):
            for _ in range(rounds):
                await queue_support.wait_until(reached(len(started) + 8), timeout=30)
                await asyncio.to_thread(bouncer.kill)
                await queue_support.wait_until(
                    lambda: all(w.health() is Health.DEGRADED for w in workers), timeout=30
                )
                await asyncio.to_thread(bouncer.start)
                await more(20)
            await queue_support.finished_once(dsn, schema, ids, timeout=60 + 10 * rounds)
            await queue_support.wait_until(
                lambda: all(w.health() is Health.HEALTHY for w in workers)
            )
        # No lease lapsed (30 s): no handler ran twice, whatever the restarts cut off.
        assert sorted(started) == list(range(len(ids)))
    finally:
        await direct.close()


async def test_the_recurring_store_ticks_and_relays_through_the_pooler(
    pg_dsn: str, pg_name: Any, bouncer: PgBouncer
) -> None:
    from steeple.core import (
        MissedRunPolicy,
        RecurringConfig,
        RecurringConfigurationError,
        RecurringDefinition,
        ScheduledMessage,
    )
    from steeple.keyring import Keyring, StorageKey
    from steeple.postgres import PostgresRecurringStore
    from steeple.testing import FakeClock, MemoryBroker

    schema = pg_name("pgb")
    clock = FakeClock(datetime(2026, 1, 1, tzinfo=UTC))
    keyring = Keyring(StorageKey("k1", bytes(range(32))))
    config = RecurringConfig("pooled", 10, 100)
    try:
        deployed = await PostgresRecurringStore.initialize(
            pg_dsn, config, keyring, clock, schema=schema
        )
        await deployed.close()
        with pytest.raises(RecurringConfigurationError, match=r"pooler='transaction'"):
            await PostgresRecurringStore.connect(
                bouncer.dsn(), config, keyring, clock, schema=schema
            )
        store = await PostgresRecurringStore.connect(
            bouncer.dsn(), config, keyring, clock, schema=schema, pooler="transaction"
        )
        try:
            await store.create(
                RecurringDefinition(
                    "every-minute",
                    "* * * * *",
                    clock.now(),
                    MissedRunPolicy.CATCH_UP,
                    ScheduledMessage("t", "m", b"payload"),
                )
            )
            clock.advance(timedelta(minutes=3))
            await store.tick(10)
            broker = MemoryBroker()
            leases = await store.claim(10)
            assert len(leases) == 3
            for lease in leases:
                await store.relay(lease, broker)
            assert len(broker.published) == 3
        finally:
            await store.close()
    finally:
        conn = await asyncpg.connect(pg_dsn)
        try:
            await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        finally:
            await conn.close()


async def test_the_admin_cli_works_through_the_pooler(
    queue: tuple[str, str], pg_name: Any, bouncer: PgBouncer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Enqueue, list and the recurring store's commands, with --pooler transaction."""
    import base64
    import json

    from typer.testing import CliRunner

    from steeple.admin.cli import app
    from steeple.admin.settings import ExitCode

    for name in list(os.environ):
        if name.startswith("STEEPLE_") and name != "STEEPLE_TEST_DSN":
            monkeypatch.delenv(name, raising=False)
    dsn, schema = queue
    store_schema = pg_name("pgbcli")
    env = {"STEEPLE_KEYS": "k1:" + base64.b64encode(bytes(32)).decode()}
    where = ["--dsn", bouncer.dsn(), "--pooler", "transaction"]

    def invoke(args: list[str]) -> Any:
        return CliRunner().invoke(app, args, env=env, catch_exceptions=False)

    try:
        for n in range(3):
            put = await asyncio.to_thread(
                invoke,
                [
                    "enqueue",
                    "pooled.work",
                    *where,
                    "--queue-schema",
                    schema,
                    "--args",
                    f'{{"n": {n}}}',
                ],
            )
            assert put.exit_code == 0, put.output
        listed = await asyncio.to_thread(
            invoke, ["tasks", *where, "--queue-schema", schema, "--json"]
        )
        assert listed.exit_code == 0, listed.output
        assert len(json.loads(listed.stdout)["items"]) == 3
        init = await asyncio.to_thread(invoke, ["initialize", *where, "--schema", store_schema])
        assert init.exit_code == 0, init.output
        schedules = await asyncio.to_thread(
            invoke, ["schedules", *where, "--schema", store_schema, "--json"]
        )
        assert schedules.exit_code == 0, schedules.output
        # The dashboard's queue backend, as `steeple admin serve --pooler transaction` opens it.
        from steeple.admin.queue_admin import PostgresTaskAdmin

        async with PostgresTaskAdmin.open(
            bouncer.dsn(), schema=schema, pooler="transaction"
        ) as board:
            for _ in range(3):  # each read may land on another server session
                overview = await board.overview()
                assert overview.counts["pending"] == 3
                page = await board.tasks(limit=2)
                assert len(page.items) == 2
                assert page.next_cursor is not None
            paused = await board.pause_queue("default", True)
            assert paused.paused
        wrong = await asyncio.to_thread(
            invoke,
            ["tasks", "--dsn", bouncer.dsn(), "--pooler", "session", "--queue-schema", schema],
        )
        assert wrong.exit_code == ExitCode.CONFIG, wrong.output
    finally:
        conn = await asyncpg.connect(dsn)
        try:
            await conn.execute(f'DROP SCHEMA IF EXISTS "{store_schema}" CASCADE')
        finally:
            await conn.close()


async def test_steeple_worker_relays_and_runs_tasks_through_the_pooler(
    queue: tuple[str, str], pg_name: Any, bouncer: PgBouncer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What `steeple worker --pooler transaction --listen-dsn DIRECT` runs: the relay
    ticks and publishes, the task worker runs tasks, both through the pooler."""
    import base64

    from steeple.admin._backend import Target
    from steeple.admin.settings import NamespaceSettings
    from steeple.admin.worker import WorkerApp, run_worker
    from steeple.core import MissedRunPolicy, RecurringDefinition, ScheduledMessage
    from steeple.core.clock import SystemClock
    from steeple.postgres import PostgresRecurringStore
    from steeple.testing import MemoryBroker

    dsn, schema = queue
    store_schema = pg_name("pgbw")
    monkeypatch.setenv("STEEPLE_KEYS", "k1:" + base64.b64encode(bytes(32)).decode())
    target = Target(
        bouncer.dsn(),
        store_schema,
        NamespaceSettings("pooled"),
        queue_schema_override=schema,
        pooler="transaction",
        listen_dsn=dsn,
    )
    done: list[int] = []

    async def handler(ctx: JobContext, args: dict[str, int]) -> None:
        done.append(args["n"])

    broker = MemoryBroker()
    try:
        store = await PostgresRecurringStore.initialize(
            dsn, target.settings.config(), target.keyring(), SystemClock(), schema=store_schema
        )
        try:
            await store.create(
                RecurringDefinition(
                    "minutely",
                    "* * * * *",
                    datetime.now(UTC) - timedelta(minutes=3),
                    MissedRunPolicy.CATCH_UP,
                    ScheduledMessage("t", "m", b"x"),
                )
            )
        finally:
            await store.close()
        conn = await asyncpg.connect(dsn)
        try:
            for n in range(3):
                await enqueue(conn, WORK, {"n": n}, schema=schema)
        finally:
            await conn.close()
        stop = asyncio.Event()
        lines: list[str] = []
        app = WorkerApp(broker=broker, tasks=[(WORK, handler)], worker_id="cli-pooled")
        work = asyncio.create_task(run_worker(app, target, stop=stop, log=lines.append))
        try:
            await queue_support.wait_until(
                lambda: (len(done) == 3 and len(broker.published) >= 3) or work.done(), timeout=60
            )
        finally:
            stop.set()
            await asyncio.wait_for(work, 60)
        assert sorted(done) == [0, 1, 2]
        assert len(broker.published) >= 3, lines
    finally:
        conn = await asyncpg.connect(dsn)
        try:
            await conn.execute(f'DROP SCHEMA IF EXISTS "{store_schema}" CASCADE')
        finally:
            await conn.close()


# Notes, for every ledger row the work-queue broker commits (a duplicate's transaction
# is rolled back, its note with it), where synchronous_commit came from: 'session' is a
# set_config(..., true) in the transaction, 'client' the startup packet, anything else
# the server session's own default.
_NOTE_SYNCHRONOUS_COMMIT = """
CREATE TABLE {s}.seen (setting text, source text);
CREATE FUNCTION {s}.note() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO {s}.seen SELECT setting, source FROM pg_settings
     WHERE name = 'synchronous_commit';
    RETURN NEW;
END $$;
CREATE TRIGGER note BEFORE INSERT ON {s}.broker_dedup
    FOR EACH ROW EXECUTE FUNCTION {s}.note();
"""


async def test_the_work_queue_broker_publishes_through_the_pooler(
    queue: tuple[str, str], bouncer: PgBouncer
) -> None:
    """With pooler="transaction" the work-queue broker publishes through the pooler from
    more client connections than it has server sessions, sets synchronous_commit in each
    publication's own transaction, deduplicates a republished key, and gets over a pooler
    restart; without it, it refuses with a configuration error naming the setting."""
    from steeple.brokers.queue import WorkQueueBroker
    from steeple.core.errors import BrokerConfigurationError, ConfigurationError
    from steeple.core.messages import ScheduledMessage

    dsn, schema = queue
    with pytest.raises(ConfigurationError, match="pooler must be None"):
        WorkQueueBroker(dsn, schema=schema, pooler="session")  # type: ignore[arg-type]
    async with WorkQueueBroker(bouncer.dsn(), schema=schema) as undeclared:
        with pytest.raises(BrokerConfigurationError, match=r"pooler='transaction'"):
            await undeclared.install()
    direct = await asyncpg.connect(dsn)
    try:
        async with WorkQueueBroker(
            bouncer.dsn(), schema=schema, pooler="transaction", max_connections=12
        ) as broker:
            await broker.install()
            await direct.execute(_NOTE_SYNCHRONOUS_COMMIT.format(s=f'"{schema}"'))

            async def publish(n: int) -> bool:
                sent = ScheduledMessage("t", "pooled.relayed", str(n).encode())
                receipt = await broker.publish(sent, idempotency_key=f"k{n}", timeout=20)
                return receipt.duplicate

            # Twice the pooler's server sessions at once, then every key again.
            assert await asyncio.gather(*(publish(n) for n in range(12))) == [False] * 12
            assert await asyncio.gather(*(publish(n) for n in range(12))) == [True] * 12
            bouncer.kill()
            bouncer.start()
            assert (
                await asyncio.gather(*(publish(n) for n in range(10, 16)))
                == [True] * 2 + [False] * 4
            )
        seen = await direct.fetch(f'SELECT setting, source FROM "{schema}".seen')
        tasks = await direct.fetchval(
            f'SELECT count(*) FROM "{schema}".tasks t JOIN "{schema}".broker_dedup d'
            " ON d.task_id = t.id WHERE t.task_name = 'pooled.relayed'"
        )
    finally:
        await direct.close()
    assert {(row["setting"], row["source"]) for row in seen} == {("on", "session")}
    assert len(seen) == 16
    assert tasks == 16
