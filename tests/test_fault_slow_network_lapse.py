"""A network slower than the lease makes it lapse, for real (RELIABILITY.md row 6).

A :class:`FaultProxy` between one worker and a private PostgreSQL delays every packet,
both ways, by more than the lease (no fake clock anywhere). The work queue's renewals and
the recurring relay's record step then cannot arrive in time: the lease lapses on the
server, a second worker (connected directly) takes the work over and records it, and the
slow worker's late writes are fenced. The rows show one completion, made under the
winner's lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import pytest

import faultprobe
import queue_support
from faultproxy import FaultProxy, running_proxy
from pg_cluster import Clusters
from steeple.core import (
    BrokerReceipt,
    MissedRunPolicy,
    RecurringConfig,
    RecurringDeadlineError,
    RecurringDefinition,
    ScheduledMessage,
    SystemClock,
)
from steeple.core.errors import RelayAcknowledgementError, RelayLeaseLostError
from steeple.keyring import Keyring, StorageKey
from steeple.postgres import PostgresRecurringStore
from steeple.postgres.queue import EnqueueOptions, JobContext, Scheduler, Task, enqueue, install
from steeple.testing import MemoryBroker

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

SCHEMA = "steeple_slow"
# One way, every packet, longer than the lease: the recurring lease (at least 1 s) and
# the task lease (0.5 s here) lapse while a renewal or a record step is on its way.
LEASE = timedelta(seconds=1)
DELAY = 1.5
TASK_LEASE = timedelta(milliseconds=500)
TASK_DELAY = 0.75
SLOW: Task[Any] = Task("slow")
wait_until = functools.partial(queue_support.wait_until, interval=0.05, timeout=60)


@contextlib.asynccontextmanager
async def slow_world(clusters: Clusters) -> AsyncIterator[tuple[str, FaultProxy]]:
    """A private cluster with the schema, and a proxy to it (stopped after)."""
    dsn = clusters.new("primary").dsn()
    conn = await asyncpg.connect(dsn, timeout=10)
    try:
        await conn.execute(f'CREATE SCHEMA "{SCHEMA}"')
    finally:
        await conn.close()
    async with running_proxy(dsn) as proxy:
        yield dsn, proxy


async def _rows(dsn: str, query: str, *args: Any) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(dsn, timeout=10)
    try:
        return list(await conn.fetch(query.replace("{s}", f'"{SCHEMA}"'), *args))
    finally:
        await conn.close()


async def test_renewals_slower_than_the_lease_lose_it_and_the_late_completion_is_fenced(
    pg_clusters: Clusters,
) -> None:
    async with slow_world(pg_clusters) as (dsn, proxy):
        conn = await asyncpg.connect(dsn, timeout=10)
        try:
            await install(conn, schema=SCHEMA)
            task_id = (
                await enqueue(
                    conn, SLOW, {}, EnqueueOptions(lease_duration=TASK_LEASE), schema=SCHEMA
                )
            ).id
        finally:
            await conn.close()
        contexts: list[JobContext] = []
        finish = asyncio.Event()

        async def stale_handler(ctx: JobContext, args: Any) -> None:
            contexts.append(ctx)
            await finish.wait()  # it finishes, but only after the task was taken over

        async def winner_handler(ctx: JobContext, args: Any) -> None:
            contexts.append(ctx)

        # One handler at a time: the slow worker claims nothing more while it runs. Its
        # query_timeout is the default 30 s: a statement's first use on a fresh asyncpg
        # connection costs 8 round trips here, 12 s (asyncpg introspects bigint[] and
        # uuid[]), and every statement that times out closes its connection.
        stale = Scheduler(
            proxy.dsn(),
            worker_id="slow",
            schema=SCHEMA,
            concurrency=1,
            poll_interval=0.1,
            maintenance_interval=0.1,
        )
        stale.register(SLOW, stale_handler)
        winner = Scheduler(
            dsn, worker_id="winner", schema=SCHEMA, poll_interval=0.1, maintenance_interval=0.1
        )
        winner.register(SLOW, winner_handler)
        stop_stale, stop_winner = asyncio.Event(), asyncio.Event()
        stale_run = asyncio.create_task(stale.run_until_shutdown(stop_stale, drain_timeout=30))
        try:
            await wait_until(lambda: contexts)
            [slow_ctx] = contexts
            proxy.delay(TASK_DELAY)  # every renewal now arrives after the lease has lapsed
            # The renewer gives up on the lease by its own monotonic clock and says so.
            await wait_until(slow_ctx.lease_lost.is_set)
            assert stale.stats.lease_lost == 1
            winner_run = asyncio.create_task(
                winner.run_until_shutdown(stop_winner, drain_timeout=30)
            )
            try:
                await wait_until(lambda: winner.stats.succeeded == 1)
            finally:
                stop_winner.set()
                await asyncio.wait_for(winner_run, 30)
            # The slow worker's handler returns now; its completion crawls to the server
            # and is rejected there: the winner's completion cleared the token it carries.
            finish.set()
            await wait_until(lambda: stale.stats.rejected_completions == 1)
            proxy.pass_through()
        finally:
            finish.set()
            proxy.pass_through()
            stop_stale.set()
            await asyncio.wait_for(stale_run, 60)
        assert stale.stats.succeeded == 0
        assert [(c.worker_id, c.attempt) for c in contexts] == [("slow", 1), ("winner", 2)]
        attempts = await _rows(
            dsn, "SELECT attempt, outcome, worker_id FROM {s}.attempts ORDER BY id"
        )
        assert [tuple(a) for a in attempts] == [
            (1, "lease_expired", "slow"),
            (2, "succeeded", "winner"),
        ]
        [task] = await _rows(
            dsn, "SELECT state, attempts, worker_id, lease_token FROM {s}.tasks WHERE id = $1",
            task_id,
        )  # fmt: skip
        assert tuple(task) == ("succeeded", 2, "winner", None)
        await faultprobe.wait_for_clean(dsn, proxy.backend_pids, timeout=15)


class SlowsTheNetwork:
    """A broker that accepts at once, then makes the network slow (or holds it) for what
    follows: the relay's record step."""

    def __init__(self, inner: MemoryBroker, proxy: FaultProxy, network: str) -> None:
        self.inner = inner
        self.proxy = proxy
        self.network = network

    async def publish(
        self, message: ScheduledMessage, *, idempotency_key: str, timeout: float
    ) -> BrokerReceipt:
        receipt = await self.inner.publish(
            message, idempotency_key=idempotency_key, timeout=timeout
        )
        if self.network == "slow":
            self.proxy.delay(DELAY)
        else:
            self.proxy.blackhole()
        return receipt


@pytest.mark.parametrize("network", ["slow", "held"])
async def test_a_record_step_slower_than_the_lease_is_fenced_and_the_winner_stands(
    pg_clusters: Clusters, network: str
) -> None:
    """``slow``: every packet 1.5 s late (a round trip is three leases); ``held``: nothing
    passes until the winner has recorded, then everything does."""
    config = RecurringConfig("slow", 10, 100, lease_duration=LEASE)
    keyring = Keyring(StorageKey("k1", b"\x05" * 32))
    async with slow_world(pg_clusters) as (dsn, proxy):
        async with await PostgresRecurringStore.initialize(
            dsn, config, keyring, SystemClock(), schema=SCHEMA
        ) as direct:
            await direct.create(
                RecurringDefinition(
                    "once",
                    "* * * * *",
                    datetime.now(UTC).replace(second=0, microsecond=0) - timedelta(seconds=59),
                    MissedRunPolicy.CATCH_UP,
                    ScheduledMessage("t", "T", b"{}"),
                )
            )
            assert (await direct.tick(1)).materialized == 1
            broker = MemoryBroker()
            async with await PostgresRecurringStore.connect(
                proxy.dsn(), config, keyring, SystemClock(), schema=SCHEMA
            ) as slow:
                [stale] = await slow.claim(1)
                relaying = asyncio.create_task(
                    slow.relay(stale, SlowsTheNetwork(broker, proxy, network))
                )
                await wait_until(lambda: broker.published)

                async def lapsed() -> bool:
                    [row] = await _rows(
                        dsn,
                        "SELECT lease_expires_at < clock_timestamp() "
                        "FROM {s}.recurring_occurrences",
                    )
                    return bool(row[0])

                # The slow record step has not reached the server: the lease lapses there.
                await wait_until(lapsed)
                [fresh] = await direct.claim(1)
                assert fresh.occurrence_id == stale.occurrence_id
                assert fresh.revision == stale.revision + 1
                receipt = await direct.relay(fresh, broker)
                assert receipt.duplicate  # the broker had the stale worker's copy
                if network == "held":
                    proxy.pass_through()  # the stale record step reaches the server now
                outcome: BaseException | BrokerReceipt
                try:
                    outcome = await asyncio.wait_for(relaying, 60)
                except BaseException as exc:
                    outcome = exc
                proxy.pass_through()
        if network == "slow":
            # Six round trips of 3 s: the record step runs past the 10 s deadline of a
            # storage call, is abandoned (its connection closed: the server rolls back)
            # and reported as uncertain; the winner had recorded it already.
            assert isinstance(outcome, RelayAcknowledgementError), outcome
            assert isinstance(outcome.__cause__, RecurringDeadlineError)
        else:
            # It reached the server after the takeover: fenced by the winner's revision.
            assert isinstance(outcome, RelayLeaseLostError), outcome
            assert "fenced by a newer claim" in str(outcome)
        [row] = await _rows(
            dsn,
            "SELECT state, attempts, lease_revision, lease_capability "
            "FROM {s}.recurring_occurrences",
        )
        assert row["state"] == "published"
        assert row["attempts"] == 2
        assert row["lease_revision"] == fresh.revision  # the winner's fencing token
        assert row["lease_capability"] is None  # a published occurrence keeps no capability
        # delivered under one idempotency key; one copy kept
        assert len(broker.published) == 1
        assert len(set(broker.keys_attempted)) == 1
        assert len(broker.keys_attempted) == 2
        await faultprobe.wait_for_clean(dsn, proxy.backend_pids, timeout=15)
