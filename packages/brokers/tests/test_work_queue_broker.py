"""The work-queue broker against a real PostgreSQL (its own schema per test)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from datetime import timedelta
from typing import Any

import asyncpg
import pytest

from broker_support import (
    BROKER_CHECKS,
    ProxiedHarness,
    TcpProxy,
    eventually,
    lose_next_ack,
    message,
    new_key,
    running_proxy,
    take_pending_tasks,
)
from faultproxy import dsn_via, open_pg, pg_endpoint
from steeple.brokers.queue import WorkQueueBroker, decode_task_args
from steeple.core.cluster import ClusterIdentity
from steeple.core.errors import (
    BrokerConfigurationError,
    BrokerUnavailableError,
    ConfigurationError,
    RelayAcknowledgementError,
)
from steeple.core.messages import ScheduledMessage
from steeple.postgres.queue import JobContext, Scheduler, Task, install

pytestmark = pytest.mark.postgres


async def wait_for(condition: Callable[[], bool]) -> None:
    async def check() -> bool:
        return condition()

    await eventually(check)


class QueueHarness(ProxiedHarness):
    name = "queue"
    deduplicates = True
    recognises_lost_acknowledgement = True

    def __init__(self, dsn: str, schema: str, proxy: TcpProxy) -> None:
        super().__init__(proxy)
        self.dsn = dsn
        self.schema = schema

    async def make_broker(self) -> WorkQueueBroker:
        b = WorkQueueBroker(
            dsn_via(self.dsn, self.proxy.port),
            schema=self.schema,
            max_message_bytes=4096,
            connect_timeout=2.0,
        )
        self.brokers.append(b)
        return b

    async def drain(self) -> list[tuple[str, ScheduledMessage]]:
        # A Scheduler consumes in its own test.
        return await take_pending_tasks(self.dsn, self.schema)

    def secrets_in_config(self) -> list[str]:
        return []


@pytest.fixture
async def queue_schema(pg_schema: tuple[str, str]) -> tuple[str, str]:
    dsn, schema = pg_schema
    conn = await asyncpg.connect(dsn)
    try:
        await install(conn, schema=schema)
    finally:
        await conn.close()
    await WorkQueueBroker(dsn, schema=schema).install()
    return dsn, schema


@pytest.fixture
async def harness(queue_schema: tuple[str, str]) -> AsyncIterator[QueueHarness]:
    dsn, schema = queue_schema
    host, port = pg_endpoint(dsn)  # the test server itself, TCP or a Unix socket
    async with (
        running_proxy(host, port, connect=lambda: open_pg(host, port)) as proxy,
        QueueHarness(dsn, schema, proxy) as h,
    ):
        yield h


@pytest.mark.parametrize("check", sorted(BROKER_CHECKS))
async def test_work_queue_conformance(check: str, harness: QueueHarness) -> None:
    await BROKER_CHECKS[check](harness)


async def test_replay_after_the_task_finished_is_still_a_duplicate(
    harness: QueueHarness,
) -> None:
    """The queue's own dedup_key covers live tasks only; the ledger covers finished ones."""
    broker = await harness.make_broker()
    key = new_key()
    first = await broker.publish(message(1), idempotency_key=key, timeout=5)
    assert await harness.drain() == [(key, message(1))]  # the task is now terminal
    again = await broker.publish(message(1), idempotency_key=key, timeout=5)
    assert again.duplicate is True
    assert again.location == first.location
    assert await harness.drain() == []


async def test_a_real_worker_runs_each_relayed_message_once(harness: QueueHarness) -> None:
    broker = await harness.make_broker()
    keys = [new_key() for _ in range(3)]
    for i, key in enumerate(keys):
        await broker.publish(message(i), idempotency_key=key, timeout=5)
    lose_next_ack(broker)
    with pytest.raises(RelayAcknowledgementError):
        await broker.publish(message(0), idempotency_key=keys[0], timeout=5)
    await broker.publish(message(1), idempotency_key=keys[1], timeout=5)

    ran: list[str] = []
    stop = asyncio.Event()

    async def handle(ctx: JobContext, args: Any) -> None:
        key, msg = decode_task_args(args)
        assert msg.message_type == "reminder.requested"
        ran.append(key)
        if len(ran) >= 3:
            stop.set()

    worker = Scheduler(
        harness.dsn, worker_id="relay-check", schema=harness.schema, poll_interval=0.1, listen=False
    )
    worker.register(Task("reminder.requested"), handle)
    await asyncio.wait_for(worker.run_until_shutdown(stop, drain_timeout=5), 60)
    assert sorted(ran) == sorted(keys)
    # Republishing after the worker finished them changes nothing.
    for i, key in enumerate(keys):
        assert (await broker.publish(message(i), idempotency_key=key, timeout=5)).duplicate


async def test_concurrent_relays_on_one_key_enqueue_one_task(harness: QueueHarness) -> None:
    brokers = [WorkQueueBroker(harness.dsn, schema=harness.schema) for _ in range(5)]
    key = new_key()
    receipts = await asyncio.gather(
        *(b.publish(message(1), idempotency_key=key, timeout=10) for b in brokers)
    )
    assert sum(not r.duplicate for r in receipts) == 1
    assert len(await harness.drain()) == 1


async def test_concurrent_publications_share_a_bounded_number_of_connections(
    harness: QueueHarness,
) -> None:
    """Found by the relay stress test: each publication opened its own connection, so a
    relay's 32 concurrent publications times four relay processes ran the server out of
    connections (TooManyConnectionsError) and occurrences became dead letters."""
    broker = WorkQueueBroker(
        dsn_via(harness.dsn, harness.proxy.port), schema=harness.schema, max_connections=3
    )
    harness.brokers.append(broker)
    keys = [new_key() for _ in range(30)]
    receipts = await asyncio.gather(
        *(broker.publish(message(i), idempotency_key=k, timeout=20) for i, k in enumerate(keys))
    )
    assert [r.idempotency_key for r in receipts] == keys
    assert not any(r.duplicate for r in receipts)
    assert harness.proxy.peak == 3  # waited for a turn, never more at once
    assert sorted(k for k, _ in await harness.drain()) == sorted(keys)


@pytest.mark.parametrize("bad", [0, 101, -1, True, 2.5, "8", None])
def test_max_connections_out_of_range_is_refused(bad: Any) -> None:
    with pytest.raises(ConfigurationError, match="max_connections"):
        WorkQueueBroker("postgresql://u@127.0.0.1/db", max_connections=bad)


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), True, "30", None])
def test_idle_timeout_out_of_range_is_refused(bad: Any) -> None:
    with pytest.raises(ConfigurationError, match="idle_timeout"):
        WorkQueueBroker("postgresql://u@127.0.0.1/db", idle_timeout=bad)


async def test_ledger_window_and_purge(harness: QueueHarness) -> None:
    with pytest.raises(BrokerConfigurationError, match="dedup_retention"):
        WorkQueueBroker(harness.dsn, schema=harness.schema, dedup_retention=timedelta(hours=1))
    # Two brokers over one ledger: an hour's retention keeps a key seconds old whatever the
    # machine's speed; 200 ms forgets it once it is older (polled for, not slept on).
    hour = timedelta(hours=1)
    long = WorkQueueBroker(
        harness.dsn, schema=harness.schema, dedup_retention=hour, required_window=hour
    )
    short = WorkQueueBroker(
        harness.dsn,
        schema=harness.schema,
        dedup_retention=timedelta(milliseconds=200),
        required_window=timedelta(milliseconds=200),
    )
    key = new_key()
    await short.publish(message(1), idempotency_key=key, timeout=5)
    assert await long.purge() == 0
    assert await long.lookup(key) is not None
    purged = 0

    async def forgotten() -> bool:
        nonlocal purged
        purged += await short.purge()
        return purged >= 1

    await eventually(forgotten)
    assert purged == 1
    assert await short.lookup(key) is None
    await long.close()
    await short.close()


async def test_missing_ledger_is_a_configuration_error(pg_schema: tuple[str, str]) -> None:
    dsn, schema = pg_schema
    broker = WorkQueueBroker(dsn, schema=schema)
    with pytest.raises(BrokerConfigurationError, match="install"):
        await broker.publish(message(1), idempotency_key=new_key(), timeout=5)


async def test_unreachable_database_is_unavailable() -> None:
    from nats_support import free_port

    broker = WorkQueueBroker(
        f"postgresql://u:pw-secret@127.0.0.1:{free_port()}/x", connect_timeout=1
    )
    assert "pw-secret" not in repr(broker)
    with pytest.raises(BrokerUnavailableError):
        await broker.publish(message(1), idempotency_key=new_key(), timeout=3)


@pytest.mark.parametrize(
    "dsn",
    [
        "postgresql://app:pw-secret@db:5432/app",
        "postgres://app:pw%2Dsecret%40x@db/app",
        "postgresql://app@db/app?password=pw-secret",
        "postgresql://app@db/app?sslmode=require&password=pw%2Dsecret",
        "postgresql://app@db/app?sslpassword=pw-secret&sslkey=/k",
        "postgresql://app:pw-secret@db1:5432,db2:5433/app?target_session_attrs=read-write",
    ],
)
@pytest.mark.parametrize("pooler", [None, "transaction"])
def test_the_repr_shows_the_pooler_and_no_password(dsn: str, pooler: Any) -> None:
    broker = WorkQueueBroker(dsn, schema="jobs", pooler=pooler)
    shown = repr(broker)
    assert shown.startswith("WorkQueueBroker(dsn='postgres"), shown
    assert shown.endswith(f", schema='jobs', pooler={pooler!r})"), shown
    for piece in ("pw-secret", "pw%2Dsecret", "secret"):
        assert piece not in shown, shown


def test_a_key_value_dsn_is_refused_without_quoting_it() -> None:
    with pytest.raises(ConfigurationError) as refused:
        WorkQueueBroker("host=db user=app password=pw-secret dbname=app", pooler="transaction")
    assert "secret" not in str(refused.value)


async def test_a_node_left_behind_by_a_failover_is_refused_and_nothing_is_enqueued(
    harness: QueueHarness, caplog: pytest.LogCaptureFixture
) -> None:
    """Each connection the broker opens is checked as a worker checks its own: a node on
    an older timeline than one already seen (an old primary started again after its
    standby was promoted) is refused, logged, closed, and nothing is written there."""
    caplog.set_level(logging.WARNING)
    broker = await harness.make_broker()
    assert (await broker.lookup(new_key())) is None
    here = broker._guard.known
    assert here is not None  # the first connection was checked
    await broker.close()
    await wait_for(lambda: harness.proxy.connections == 0)
    broker = await harness.make_broker()
    # As if the broker had followed a promotion of this cluster to the next timeline.
    broker._guard._watch.observe(ClusterIdentity(here.system_identifier, here.timeline + 1))
    key = new_key()
    with pytest.raises(BrokerUnavailableError, match="stale node left behind by a failover"):
        await broker.publish(message(1), idempotency_key=key, timeout=5)
    assert any(
        "stale node" in r.getMessage() and r.name == "steeple.postgres.queue"
        for r in caplog.records
    )
    await wait_for(lambda: harness.proxy.connections == 0)  # the refused one is closed
    conn = await asyncpg.connect(harness.dsn)
    try:
        ledger = await conn.fetchval(
            f"SELECT count(*) FROM {harness.schema}.broker_dedup WHERE idempotency_key = $1",
            key,
        )
    finally:
        await conn.close()
    assert ledger == 0
    assert await harness.drain() == []


async def test_sequential_publications_reuse_one_connection(harness: QueueHarness) -> None:
    """Found by the relay stress test: a fresh connection per publication (startup,
    authentication, statement preparation) made four relays under CPU contention manage
    about 25 occurrences/s, so claimed occurrences' leases lapsed and attempts ran out."""
    broker = await harness.make_broker()
    keys = [new_key() for _ in range(20)]
    for i, key in enumerate(keys):
        assert not (await broker.publish(message(i), idempotency_key=key, timeout=5)).duplicate
    assert (await broker.lookup(keys[0])) is not None
    assert await broker.purge() == 0
    assert harness.proxy.accepted == 1
    assert broker.connections_opened == 1
    assert harness.proxy.connections == 1  # kept for the next publication
    await broker.close()
    await wait_for(lambda: harness.proxy.connections == 0)
    with pytest.raises(BrokerUnavailableError, match="closed"):
        await broker.publish(message(0), idempotency_key=new_key(), timeout=5)
    assert sorted(k for k, _ in await harness.drain()) == sorted(keys)


async def test_a_connection_that_saw_an_error_is_not_reused(harness: QueueHarness) -> None:
    broker = await harness.make_broker()
    await broker.publish(message(1), idempotency_key=new_key(), timeout=5)
    lose_next_ack(broker)  # the reply is lost after the commit: the connection is fine
    with pytest.raises(RelayAcknowledgementError):
        await broker.publish(message(2), idempotency_key=new_key(), timeout=5)
    assert harness.proxy.accepted == 1
    # A statement the database refuses: the connection is closed, not pooled.
    conn = await asyncpg.connect(harness.dsn)
    try:
        await conn.execute(f'ALTER TABLE "{harness.schema}".broker_dedup RENAME TO gone')
        with pytest.raises(BrokerConfigurationError):
            await broker.publish(message(3), idempotency_key=new_key(), timeout=5)
        await wait_for(lambda: harness.proxy.connections == 0)
        await conn.execute(f'ALTER TABLE "{harness.schema}".gone RENAME TO broker_dedup')
    finally:
        await conn.close()
    await broker.publish(message(4), idempotency_key=new_key(), timeout=5)
    assert harness.proxy.accepted == 2


async def test_pooled_connections_cut_while_idle_never_fail_a_publication(
    harness: QueueHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    broker = await harness.make_broker()
    keys = [new_key() for _ in range(3)]
    await asyncio.gather(
        *(broker.publish(message(i), idempotency_key=k, timeout=10) for i, k in enumerate(keys))
    )
    assert harness.proxy.accepted == 3
    pooled = [conn for conn, _ in broker._idle]
    assert len(pooled) == 3
    harness.proxy.reset_all()  # a server restart while the connections sit idle
    await wait_for(lambda: all(c.is_closed() for c in pooled))
    # The worst case: the driver has not noticed the cut yet when a publication takes one.
    stale = pooled[-1]
    real_is_closed = asyncpg.Connection.is_closed
    monkeypatch.setattr(
        asyncpg.Connection, "is_closed", lambda self: self is not stale and real_is_closed(self)
    )
    more = [new_key() for _ in range(4)]
    for i, key in enumerate(more):
        receipt = await broker.publish(message(i), idempotency_key=key, timeout=5)
        assert not receipt.duplicate
    monkeypatch.undo()
    assert harness.proxy.accepted == 4  # one new connection, reused after the cut
    assert sorted(k for k, _ in await harness.drain()) == sorted(keys + more)


async def test_a_connection_idle_over_idle_timeout_is_replaced(harness: QueueHarness) -> None:
    broker = WorkQueueBroker(
        dsn_via(harness.dsn, harness.proxy.port), schema=harness.schema, idle_timeout=10
    )
    harness.brokers.append(broker)
    await broker.publish(message(1), idempotency_key=new_key(), timeout=5)
    [(old, since)] = broker._idle
    broker._idle = [(old, since - 11)]  # as if put back 11 s ago (the server may drop it)
    await broker.publish(message(2), idempotency_key=new_key(), timeout=5)
    assert old.is_closed()
    assert harness.proxy.accepted == 2
    assert broker.connections_opened == 2
