"""Failover to a promoted streaming standby, with a multi-host DSN, under load.

Each test builds its own private clusters (``pg_clusters``): a primary and a streaming
standby made with ``pg_basebackup -R``; promotion is ``pg_ctl promote``, nothing else. A
queue worker (given the libpq ``key=value`` form of a two-host DSN), a relay loop on the
recurring store (the URL form) and an application enqueueing through psycopg (the
``key=value`` form, each connection checked by a ``ClusterGuard``) all use
``target_session_attrs=read-write`` and find the writer themselves.

- Synchronous standby: the standby is promoted while tasks run and occurrences are
  relayed, the old primary is stopped, and everything reconnects to the new primary. The
  old primary is then started again as a stale node (its own timeline, still writable, and
  the first host of the DSN): every new connection the worker, the store and the
  application open reaches it and is refused, typed and logged, and nothing is enqueued
  or finalized there. Once it is stopped
  again the work goes on. The checker: every acknowledged enqueue and every acknowledged
  completion and publication is on the new primary; each task succeeded exactly once;
  each occurrence was published under one idempotency key.
- Asynchronous standby: what the primary acknowledged after the standby stopped
  receiving is lost with the primary. Those completions are run again on the new primary
  (new attempts of the same tasks) and those publications are republished under the same
  idempotency keys.

``STEEPLE_FAILOVER_SECONDS`` lengthens each load phase of the synchronous test (the
``failover`` nox session runs it for longer).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections import Counter
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import psycopg
import pytest

from pg_cluster import Cluster, Clusters, execute, fetchval, poll
from queue_support import task_outcomes
from steeple.core import (
    MissedRunPolicy,
    RecurringConfig,
    RecurringDefinition,
    RecurringError,
    ScheduledMessage,
)
from steeple.core.errors import RecurringClusterError, RecurringRelayError
from steeple.keyring import Keyring, StorageKey
from steeple.postgres import PostgresRecurringStore
from steeple.postgres.queue import (
    ClusterGuard,
    EnqueueOptions,
    JobContext,
    QueueClusterError,
    QueueError,
    Scheduler,
    Task,
    enqueue,
    install,
)
from steeple.testing import FakeClock, MemoryBroker

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

START = datetime(2031, 3, 4, 5, 0, 0, tzinfo=UTC)
KEYRING = Keyring(StorageKey("k1", b"\x0b" * 32))
CONFIG = RecurringConfig("failover", max_definitions=10, max_occurrences=100_000)
QUEUE = "q"
WORK: Task[Any] = Task("work")
# Short leases: a task whose completion died with the old primary runs again soon.
OPTIONS = EnqueueOptions.immediate(lease_duration=timedelta(seconds=2))
PHASE = float(os.environ.get("STEEPLE_FAILOVER_SECONDS", "2"))
STALE_LINE = "stale node left behind by a failover"


def minutely() -> RecurringDefinition:
    return RecurringDefinition(
        "minutely",
        "* * * * *",
        START - timedelta(minutes=5),
        MissedRunPolicy.CATCH_UP,
        ScheduledMessage("t", "m", b"payload"),
    )


def urls(first: Cluster, second: Cluster) -> tuple[str, str]:
    """The two-host DSN in libpq's key=value form and as a URL (``first`` listed first)."""
    key_value = (
        f"host=127.0.0.1,127.0.0.1 port={first.port},{second.port} user=postgres"
        " dbname=postgres target_session_attrs=read-write"
    )
    url = (
        f"postgresql://postgres@127.0.0.1:{first.port},127.0.0.1:{second.port}/postgres"
        "?target_session_attrs=read-write"
    )
    return key_value, url


async def streaming(primary: Cluster, replica: Cluster) -> None:
    """Wait until ``replica`` streams from ``primary`` and has replayed all it wrote."""

    async def caught_up() -> bool:
        row = await _fetchrow(
            primary.dsn(),
            "SELECT state, replay_lsn >= pg_current_wal_lsn() AS replayed"
            " FROM pg_stat_replication WHERE application_name = $1",
            replica.name,
        )
        return row is not None and row["state"] == "streaming" and bool(row["replayed"])

    await poll(f"{replica.name} to stream from {primary.name}", caught_up)


async def _fetchrow(dsn: str, query: str, *args: Any) -> Any:
    conn = await asyncpg.connect(dsn, timeout=10)
    try:
        return await conn.fetchrow(query, *args)
    finally:
        await conn.close()


async def deploy(dsn: str, clock: FakeClock) -> None:
    """Initialize the recurring namespace (one minutely definition) and the queue."""
    store = await PostgresRecurringStore.initialize(dsn, CONFIG, KEYRING, clock)
    try:
        await store.create(minutely())
    finally:
        await store.close()
    conn = await asyncpg.connect(dsn)
    try:
        await install(conn, schema=QUEUE)
    finally:
        await conn.close()


class Worker:
    """A queue worker in the background; records every handler run (task id, attempt)."""

    def __init__(self, dsn: str) -> None:
        self.runs: list[tuple[int, int]] = []
        self.scheduler = Scheduler(
            dsn,
            worker_id="failover",
            schema=QUEUE,
            poll_interval=0.05,
            maintenance_interval=0.2,
            query_timeout=3.0,
            concurrency=4,
        )
        self.scheduler.register(WORK, self._handle)
        self._stop = asyncio.Event()
        self._run: asyncio.Task[None] | None = None

    async def _handle(self, ctx: JobContext, args: Any) -> None:
        self.runs.append((ctx.task_id, ctx.attempt))
        await asyncio.sleep(0.005)  # a few ms of work: tasks are running at the failover

    def ran(self) -> Counter[int]:
        return Counter(task_id for task_id, _ in self.runs)

    def start(self) -> None:
        self._run = asyncio.create_task(self.scheduler.run_until_shutdown(self._stop))

    async def stop(self) -> None:
        self._stop.set()
        if self._run is not None:
            await asyncio.wait_for(self._run, 60)


class Enqueuer:
    """An application enqueueing one task at a time through psycopg, reconnecting on error.

    Each connection it opens is checked once by its ``ClusterGuard``, as the failover
    guide tells applications to. ``acknowledged`` holds the ids of the enqueues that
    returned (committed); ``refused`` counts the connections the guard refused.
    """

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.acknowledged: list[int] = []
        self.failures = 0
        self.refused = 0
        self.guard = ClusterGuard()
        self.running = asyncio.Event()
        self.running.set()
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def _loop(self) -> None:
        conn: psycopg.AsyncConnection[Any] | None = None
        try:
            while not self._stop.is_set():
                await self.running.wait()
                try:
                    if conn is None or conn.closed:
                        conn = await psycopg.AsyncConnection.connect(
                            self.dsn, autocommit=True, application_name="steeple-app"
                        )
                        await self.guard.check(conn)
                    done = await enqueue(conn, WORK, len(self.acknowledged), OPTIONS, schema=QUEUE)
                    self.acknowledged.append(done.id)
                except (QueueError, psycopg.Error, OSError) as exc:
                    self.failures += 1
                    self.refused += isinstance(exc, QueueClusterError)
                    if conn is not None:
                        await conn.close()
                        conn = None
                    await asyncio.sleep(0.05)
                    continue
                await asyncio.sleep(0.01)
        finally:
            if conn is not None:
                await conn.close()

    async def stop(self) -> None:
        self._stop.set()
        self.running.set()
        if self._task is not None:
            await asyncio.wait_for(self._task, 30)


class Relay:
    """Ticks, claims and relays on the recurring store in a loop, on a fake clock.

    Each round moves the clock 20 s, so an occurrence falls due every three rounds and a
    lease (60 s) that was never recorded lapses after a few. ``acknowledged`` holds the
    occurrences whose relay returned (the outcome was committed).
    """

    def __init__(self, store: PostgresRecurringStore, clock: FakeClock) -> None:
        self.store = store
        self.clock = clock
        self.broker = MemoryBroker()
        self.acknowledged: set[str] = set()
        self.errors: Counter[str] = Counter()
        self.running = asyncio.Event()
        self.running.set()
        self._idle = asyncio.Event()
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def round(self) -> int:
        """One tick, claim and relay of everything claimed; returns how many were claimed."""
        self.clock.advance(timedelta(seconds=20))
        await self.store.tick(100)
        leases = await self.store.claim(100)
        for lease in leases:
            await self.store.relay(lease, self.broker)
            self.acknowledged.add(lease.occurrence_id)
        return len(leases)

    async def _loop(self) -> None:
        while not self._stop.is_set():
            if not self.running.is_set():
                self._idle.set()
                await self.running.wait()
                self._idle.clear()
            try:
                await self.round()
            except (RecurringError, RecurringRelayError) as exc:
                self.errors[type(exc).__name__] += 1
                await asyncio.sleep(0.05)

    async def pause(self) -> None:
        """Stop after the current round (so no call is in flight)."""
        self.running.clear()
        await asyncio.wait_for(self._idle.wait(), 60)

    async def stop(self) -> None:
        self._stop.set()
        self.running.set()
        if self._task is not None:
            await asyncio.wait_for(self._task, 60)


@pytest.fixture
async def running() -> AsyncIterator[list[Any]]:
    """Everything started in a test, stopped (and closed) afterwards, even on failure."""
    started: list[Any] = []
    try:
        yield started
    finally:
        for thing in reversed(started):
            with contextlib.suppress(Exception):
                if isinstance(thing, PostgresRecurringStore):
                    await thing.close()
                else:
                    await thing.stop()


async def terminate_steeple_sessions(dsn: str) -> None:
    """End every steeple session on a node (a network blip would do the same)."""
    await execute(
        dsn,
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
        " WHERE application_name LIKE 'steeple%' AND pid <> pg_backend_pid()",
    )


async def node_outcomes(dsn: str) -> tuple[dict[int, int], dict[str, str]]:
    """(task id -> succeeded attempts, occurrence id -> state) on one node."""
    tasks = await task_outcomes(dsn, QUEUE)
    conn = await asyncpg.connect(dsn, timeout=10)
    try:
        rows = await conn.fetch("SELECT id, state FROM steeple.recurring_occurrences")
    finally:
        await conn.close()
    return tasks, {r["id"]: r["state"] for r in rows}


async def drain(worker: Worker, relay: Relay, dsn: str, ids: list[int]) -> None:
    """Run until every task of ``ids`` succeeded and every occurrence is published."""

    async def tasks_done() -> bool:
        # Every task there (an enqueue whose acknowledgement was lost may be there too).
        outcomes = await task_outcomes(dsn, QUEUE)
        return set(ids) <= set(outcomes) and all(ok >= 1 for ok in outcomes.values())

    await poll("every acknowledged task to succeed on the new primary", tasks_done, 120)
    await relay.pause()
    for _ in range(200):
        _, states = await node_outcomes(dsn)
        if states and all(s == "published" for s in states.values()):
            return
        with contextlib.suppress(RecurringError, RecurringRelayError):
            await relay.round()
    raise AssertionError(f"occurrences never all published: {Counter(states.values())}")


def check_recurring(relay: Relay, states: dict[str, str]) -> None:
    """Each occurrence published under exactly one key, and every key is one occurrence's."""
    keys = {key for _, key in relay.broker.published}
    assert set(relay.broker.keys_attempted) == keys  # every retry under the same key
    published = [i for i, s in states.items() if s == "published"]
    assert len(keys) == len(published) == len(states), (len(keys), Counter(states.values()))


def _logged(caplog: pytest.LogCaptureFixture, logger: str, text: str) -> Callable[[], Any]:
    async def check() -> bool:
        return any(
            text in r.getMessage() and r.name.startswith(logger)
            for r in caplog.records
            if r.levelno >= logging.WARNING
        )

    return check


@pytest.mark.timeout(300)
async def test_failover_to_a_synchronous_standby_loses_nothing_and_refuses_the_stale_node(
    pg_clusters: Clusters, running: list[Any], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    clock = FakeClock(START)
    primary = pg_clusters.new("primary")
    await deploy(primary.dsn(), clock)
    replica = pg_clusters.replica(primary, "replica")
    await streaming(primary, replica)
    # Synchronous from here on: a commit returns once the standby has flushed it. (Set
    # after the base backup, so the promoted standby does not wait for a standby itself.)
    await execute(
        primary.dsn(),
        "ALTER SYSTEM SET synchronous_standby_names = 'replica'",
        "ALTER SYSTEM SET synchronous_commit = 'on'",
        "SELECT pg_reload_conf()",
    )
    await poll(
        "the standby to be synchronous",
        lambda: _is(primary.dsn(), "SELECT sync_state FROM pg_stat_replication", "sync"),
    )
    key_value, url = urls(primary, replica)  # the old primary first: a stale node wins ties

    store = await PostgresRecurringStore.connect(url, CONFIG, KEYRING, clock)
    running.append(store)
    relay, worker, app = Relay(store, clock), Worker(key_value), Enqueuer(key_value)
    for thing in (relay, worker, app):
        thing.start()
        running.append(thing)
    await poll("work on the primary", lambda: _progress(app, worker, relay, 20))
    await asyncio.sleep(PHASE)

    # --- promotion while tasks run and relays publish; then the old primary stops ---------
    await asyncio.to_thread(replica.promote)
    # Nothing the old primary commits from now on is acknowledged (its commits wait for a
    # synchronous standby that is gone): what it shows now is all it acknowledged.
    acked_tasks, acked_states = await node_outcomes(primary.dsn())
    acked_enqueues = list(app.acknowledged)
    acked_relays = set(relay.acknowledged)
    await asyncio.to_thread(primary.stop, "fast")
    assert await fetchval(replica.dsn(), "SELECT pg_is_in_recovery()") is False

    # --- everything reconnects to the new primary without help -----------------------------
    marks = (len(app.acknowledged), len(worker.runs), len(relay.acknowledged))
    await poll(
        "work to go on on the new primary",
        lambda: _progress(app, worker, relay, 20, since=marks),
        120,
    )
    await asyncio.sleep(PHASE)

    # --- the old primary comes back as a stale node: refused ------------------------------
    await asyncio.to_thread(primary.start, primary.port)
    assert await fetchval(primary.dsn(), "SELECT pg_is_in_recovery()") is False
    # Started alone, without the standby it waited for: it acknowledges commits again, so
    # whatever reaches it is written there (and lost with it).
    await execute(
        primary.dsn(),
        "ALTER SYSTEM RESET synchronous_standby_names",
        "SELECT pg_reload_conf()",
    )
    await poll(
        "the stale node to commit alone",
        lambda: _is(primary.dsn(), "SHOW synchronous_standby_names", ""),
    )
    stale_before = await node_outcomes(primary.dsn())
    # Every steeple connection to the new primary ends: new ones reach the stale node first.
    await terminate_steeple_sessions(replica.dsn())
    await poll(
        "the worker to refuse the stale node",
        _logged(caplog, "steeple.postgres.queue", STALE_LINE),
        60,
    )
    await poll(
        "the store to refuse the stale node",
        lambda: _refused_by_store(relay),
        60,
    )
    assert await _logged(caplog, "steeple.postgres.recurring", STALE_LINE)()
    await poll("the application to refuse the stale node", lambda: _refused_by_app(app), 60)
    await asyncio.sleep(PHASE)
    # Nothing enqueued, claimed or finalized there.
    assert await node_outcomes(primary.dsn()) == stale_before

    # --- the stale node is stopped (fenced): the work goes on -----------------------------
    await asyncio.to_thread(primary.stop, "fast")
    marks = (len(app.acknowledged), len(worker.runs), len(relay.acknowledged))
    await poll("work to resume", lambda: _progress(app, worker, relay, 10, since=marks), 120)
    await app.stop()

    # --- the checker -----------------------------------------------------------------------
    new = replica.dsn()
    await drain(worker, relay, new, app.acknowledged)
    tasks, states = await node_outcomes(new)
    assert set(acked_enqueues) <= set(tasks), "an acknowledged enqueue was lost"
    lost = [i for i, ok in acked_tasks.items() if ok and not tasks.get(i)]
    assert not lost, f"acknowledged completions lost: {lost}"
    assert set(tasks.values()) == {1}, "a task succeeded twice"
    assert acked_relays <= {i for i, s in states.items() if s == "published"}
    assert {i for i, s in acked_states.items() if s == "published"} <= {
        i for i, s in states.items() if s == "published"
    }
    check_recurring(relay, states)


@pytest.mark.timeout(300)
async def test_failover_to_an_asynchronous_standby_reruns_and_republishes_what_it_lost(
    pg_clusters: Clusters, running: list[Any]
) -> None:
    clock = FakeClock(START)
    primary = pg_clusters.new("primary")
    await deploy(primary.dsn(), clock)
    replica = pg_clusters.replica(primary, "replica")
    key_value, url = urls(replica, primary)

    store = await PostgresRecurringStore.connect(url, CONFIG, KEYRING, clock)
    running.append(store)
    relay = Relay(store, clock)
    running.append(relay)
    conn = await psycopg.AsyncConnection.connect(key_value, autocommit=True)
    try:
        ids = [(await enqueue(conn, WORK, n, OPTIONS, schema=QUEUE)).id for n in range(40)]
    finally:
        await conn.close()
    clock.advance(timedelta(minutes=10))
    assert (await store.tick(100)).materialized == 15  # 04:56 .. 05:10
    await streaming(primary, replica)  # every enqueue and occurrence is on the standby

    # The standby stops receiving (a lagging asynchronous standby, frozen for the test):
    # restarted without a primary to stream from, it stays in recovery and gets nothing.
    await asyncio.to_thread(replica.stop, "fast")
    with (replica.data / "postgresql.auto.conf").open("a") as conf:
        conf.write("primary_conninfo = ''\n")
    await asyncio.to_thread(replica.start, replica.port)
    assert await fetchval(replica.dsn(), "SELECT pg_is_in_recovery()") is True
    assert await _not_streaming(primary, replica)

    # The primary acknowledges every completion and publication: the standby has none.
    worker = Worker(key_value)
    worker.start()
    running.append(worker)
    await poll("the tasks to succeed on the primary", lambda: _all_ok(primary.dsn(), ids))
    while len(relay.acknowledged) < 15:
        await relay.round()
    published_before = list(relay.broker.published)
    attempted_before = len(relay.broker.keys_attempted)
    runs_before = worker.ran()
    assert set(runs_before) == set(ids)

    # What the frozen standby holds is what its promotion starts from (it receives nothing
    # more): read it now, in recovery, since once promoted the running worker reconnects
    # to it within a fraction of a second and starts rerunning what it lacks.
    lost_tasks, lost_states = await node_outcomes(replica.dsn())
    assert not any(lost_tasks.values()), "the standby was not behind"
    assert "published" not in lost_states.values()
    # The primary dies; the standby is promoted without what it never received.
    await asyncio.to_thread(primary.stop, "immediate")
    await asyncio.to_thread(replica.promote)

    # Run again on the new primary: the same tasks, new attempts...
    relay.start()
    await drain(worker, relay, replica.dsn(), ids)
    tasks, states = await node_outcomes(replica.dsn())
    assert set(tasks) == set(ids)
    assert set(tasks.values()) == {1}
    reran = worker.ran() - runs_before
    assert set(reran) == set(ids), "a lost completion was not run again"
    assert all(attempt >= 1 for _, attempt in worker.runs)
    # ...and the same publications again, under the same idempotency keys.
    # (the broker deduplicates them: it stores each key once, as NATS JetStream would)
    again = relay.broker.keys_attempted[attempted_before:]
    assert set(again) >= {key for _, key in published_before}
    assert relay.broker.published[: len(published_before)] == published_before
    stored = Counter(key for _, key in relay.broker.published)
    assert set(stored.values()) == {1}  # each key stored once
    check_recurring(relay, states)


# --- helpers ---------------------------------------------------------------------------------


async def _is(dsn: str, query: str, wanted: object) -> bool:
    return bool(await fetchval(dsn, query) == wanted)


async def _not_streaming(primary: Cluster, replica: Cluster) -> bool:
    row = await _fetchrow(
        primary.dsn(),
        "SELECT count(*) AS n FROM pg_stat_replication WHERE application_name = $1",
        replica.name,
    )
    return bool(row["n"] == 0)


async def _all_ok(dsn: str, ids: list[int]) -> bool:
    outcomes = await task_outcomes(dsn, QUEUE)
    return all(outcomes.get(i, 0) == 1 for i in ids)


async def _progress(
    app: Enqueuer,
    worker: Worker,
    relay: Relay,
    at_least: int,
    since: tuple[int, int, int] = (0, 0, 0),
) -> bool:
    enqueued, ran, relayed = since
    return (
        len(app.acknowledged) - enqueued >= at_least
        and len(worker.runs) - ran >= at_least
        and len(relay.acknowledged) - relayed >= 2
    )


async def _refused_by_app(app: Enqueuer) -> bool:
    return app.refused > 0


async def _refused_by_store(relay: Relay) -> bool:
    return relay.errors[RecurringClusterError.__name__] > 0
