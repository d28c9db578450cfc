"""Relay stress with real brokers (RELIABILITY row 17 extended; issue 15, item 9).

For each broker (NATS JetStream, Redis Streams, RabbitMQ, the work queue): four relay
*processes* (``relay_stress_worker.py``: a ``RecurringRelay`` running ``tick`` and
``claim_and_relay``) share one namespace of the PostgreSQL recurring store while the test
keeps adding definitions (while the backlog is short) whose occurrences are all due at
once (each definition fires every minute of one past hour: 60 due occurrences, none
later). Every broker connection goes through a TCP proxy (``steeple.testing.proxy.TcpProxy``).
For a set duration, on a seeded random schedule, the test:

- SIGKILLs a relay process and starts a new one in its slot;
- cuts every broker connection (TCP close on both sides, as a broker restart would);
- drops the broker's replies for a moment, then cuts (publications accepted, their
  acknowledgements lost: the republication must be recognised).

Then the faults stop, the fleet finishes the work and stops (SIGTERM), and a checker
compares the store with everything the broker holds:

- every occurrence of every definition was materialized and is ``published``;
- every occurrence reached the broker, under its one idempotency key (derived from the
  stored occurrence: namespace, definition, due instant, id), with its definition's
  message; nothing reached it under any other key;
- a deduplicating broker (NATS ``Nats-Msg-Id``, the Redis marker script, the work queue's
  ledger) holds no duplicate; RabbitMQ (which cannot deduplicate) may hold duplicates,
  which are counted, and each is a byte-identical copy under the same key, so the
  consumer-side dedup (``DedupingConsumer``) drops it;
- no session of the store is left ``idle in transaction``.

``STEEPLE_RELAY_STRESS_SECONDS`` sets the fault phase per broker (default 10 s, the CI
run; ``nox -s stress`` runs 60 s), ``STEEPLE_RELAY_STRESS_SEED`` the seed (printed, and in
every failure message, so a failing schedule reruns).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import sys
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import aio_pika
import asyncpg
import nats
import pytest
import redis.asyncio as aioredis

from broker_support import TcpProxy, drain_deliveries, running_proxy, take_pending_tasks
from faultproxy import open_pg, pg_endpoint
from relay_stress_worker import KEYRING, MAX_DEFINITIONS, MAX_OCCURRENCES
from steeple.brokers.nats import JetStreamBroker, JetStreamConsumer
from steeple.brokers.queue import WorkQueueBroker
from steeple.brokers.rabbitmq import RabbitMQConsumer
from steeple.brokers.redis import RedisStreamConsumer
from steeple.core.clock import SystemClock
from steeple.core.config import RecurringConfig, RecurringDefinition
from steeple.core.idempotency import PUBLISH_PURPOSE, idempotency_key
from steeple.core.messages import ScheduledMessage
from steeple.core.policies import MissedRunPolicy
from steeple.postgres import PostgresRecurringStore
from steeple.postgres.queue import install

pytestmark = [pytest.mark.postgres, pytest.mark.broker, pytest.mark.slow]


SECONDS = float(os.environ.get("STEEPLE_RELAY_STRESS_SECONDS", "10"))
RELAYS = 4
LEASE = timedelta(seconds=5)
PER_DEFINITION = 60  # every minute of one past hour
FIRST_DEFINITIONS = 10
# Every second of the fault phase, five more definitions (300 occurrences) while fewer
# than BACKLOG occurrences wait: the relays stay busy (faults hit publications in flight)
# and the work left when the faults stop stays bounded, whatever the broker's pace.
DEFINITIONS_PER_ROUND = 5
BACKLOG = 900
FINISH_WITHIN = 180.0  # seconds for the fleet to finish once the faults stop
WORKER = Path(__file__).parent / "relay_stress_worker.py"


def _seed() -> int:
    given = os.environ.get("STEEPLE_RELAY_STRESS_SEED")
    return int(given) if given else random.SystemRandom().randrange(2**32)


class Target:
    """One broker under test: its proxied spec for the relays, and what it holds."""

    name: str
    dedups = True
    upstream: tuple[str, int]

    def spec(self, proxy: TcpProxy) -> dict[str, Any]:
        raise NotImplementedError

    async def prepare(self) -> None:
        """Create the private stream/queue/ledger."""

    async def consume(self) -> list[tuple[str, ScheduledMessage]]:
        raise NotImplementedError

    async def delete(self) -> None:
        """Delete the private stream/queue/keys (also after a failure)."""


class NatsTarget(Target):
    name = "nats"
    upstream = ("127.0.0.1", 4222)

    def __init__(self, url: str) -> None:
        tag = uuid.uuid4().hex[:10]
        self.url, self.stream, self.subject = url, f"STRESS_{tag}", f"stress.{tag}"

    def spec(self, proxy: TcpProxy) -> dict[str, Any]:
        return {"url": proxy.url("nats"), "stream": self.stream, "subject": self.subject}

    async def prepare(self) -> None:
        # The stream (file storage, a dedup window as long as the delivery window) is
        # made once here, not by four racing relays.
        broker = JetStreamBroker(
            self.url, stream=self.stream, subject=self.subject, manage_stream=True
        )
        await broker.start()
        await broker.close()

    async def consume(self) -> list[tuple[str, ScheduledMessage]]:
        async with JetStreamConsumer(self.url, stream=self.stream, durable="stress") as c:
            return await drain_deliveries(
                lambda: c.fetch(500, wait=1.0), lambda d: c.acknowledge(d.delivery_id)
            )

    async def delete(self) -> None:
        nc = await nats.connect(self.url)
        try:
            with contextlib.suppress(nats.js.errors.NotFoundError):
                await nc.jetstream().delete_stream(self.stream)
        finally:
            await nc.close()


class RedisTarget(Target):
    name = "redis"
    upstream = ("127.0.0.1", 6379)

    def __init__(self, url: str) -> None:
        self.url, self.stream = url, f"steeple-stress:{uuid.uuid4().hex[:10]}"

    def spec(self, proxy: TcpProxy) -> dict[str, Any]:
        return {"url": proxy.url("redis", path="/0"), "stream": self.stream}

    async def consume(self) -> list[tuple[str, ScheduledMessage]]:
        async with RedisStreamConsumer(self.url, stream=self.stream, group="stress") as c:
            return await drain_deliveries(
                lambda: c.fetch(500), lambda d: c.acknowledge(d.delivery_id)
            )

    async def delete(self) -> None:
        client = aioredis.Redis.from_url(self.url)
        try:
            keys = [k async for k in client.scan_iter(match=f"{self.stream}*", count=1000)]
            for start in range(0, len(keys), 1000):
                await client.delete(*keys[start : start + 1000])
        finally:
            await client.aclose()


class RabbitTarget(Target):
    name = "rabbitmq"
    dedups = False
    upstream = ("127.0.0.1", 5672)

    def __init__(self, url: str) -> None:
        self.url, self.queue = url, f"steeple-stress-{uuid.uuid4().hex[:10]}"

    def spec(self, proxy: TcpProxy) -> dict[str, Any]:
        return {"url": proxy.url("amqp", userinfo="guest:guest@", path="/"), "queue": self.queue}

    async def prepare(self) -> None:
        conn = await aio_pika.connect(self.url)
        async with conn:
            await (await conn.channel()).declare_queue(self.queue, durable=True)

    async def consume(self) -> list[tuple[str, ScheduledMessage]]:
        # The raw consumer: every copy the queue holds, duplicates included.
        async with RabbitMQConsumer(self.url, queue=self.queue) as c:
            return await drain_deliveries(
                lambda: c.fetch(500), lambda d: c.acknowledge(d.delivery_id)
            )

    async def delete(self) -> None:
        conn = await aio_pika.connect(self.url)
        async with conn:
            await (await conn.channel()).queue_delete(self.queue)


class QueueTarget(Target):
    name = "queue"

    def __init__(self, dsn: str, schema: str) -> None:
        self.dsn, self.schema = dsn, schema
        self.upstream = pg_endpoint(dsn)

    def spec(self, proxy: TcpProxy) -> dict[str, Any]:
        user = self.dsn.partition("://")[2].rpartition("@")[0] or "postgres"
        database = self.dsn.rpartition("/")[2].partition("?")[0] or "postgres"
        dsn = f"postgresql://{user}@127.0.0.1:{proxy.port}/{database}?sslmode=disable"
        return {"dsn": dsn, "schema": self.schema}

    async def prepare(self) -> None:
        conn = await asyncpg.connect(self.dsn)
        try:
            await install(conn, schema=self.schema)
        finally:
            await conn.close()
        await WorkQueueBroker(self.dsn, schema=self.schema).install()

    async def consume(self) -> list[tuple[str, ScheduledMessage]]:
        return await take_pending_tasks(self.dsn, self.schema)

    async def delete(self) -> None:
        conn = await asyncpg.connect(self.dsn)
        try:
            await conn.execute(f'DROP SCHEMA IF EXISTS "{self.schema}" CASCADE')
        finally:
            await conn.close()


@pytest.fixture
async def target(
    request: pytest.FixtureRequest, pg_schema: tuple[str, str]
) -> AsyncIterator[Target]:
    kind = request.param
    made: Target
    if kind == "nats":
        made = NatsTarget(request.getfixturevalue("nats_url"))
    elif kind == "redis":
        made = RedisTarget(request.getfixturevalue("redis_url"))
    elif kind == "rabbitmq":
        made = RabbitTarget(request.getfixturevalue("amqp_url"))
    else:
        made = QueueTarget(pg_schema[0], f"{pg_schema[1]}_q")
    try:
        await made.prepare()
        yield made
    finally:
        await made.delete()


class Fleet:
    """Relay processes by slot; a killed slot is started again."""

    def __init__(self, args: list[str], logs: Path) -> None:
        self.args = args
        self.logs = logs
        self.procs: dict[int, asyncio.subprocess.Process] = {}
        self.restarting: dict[int, asyncio.Task[None]] = {}
        self.started = 0
        self.kills = 0
        self.stats: list[dict[str, int]] = []

    async def start(self, slot: int) -> None:
        # Each process's log (warnings, tracebacks) goes to its slot's file in tmp_path.
        with (self.logs / f"relay-{slot}.log").open("ab") as log:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, str(WORKER), *self.args, stdout=asyncio.subprocess.PIPE,
                stderr=log,
            )  # fmt: skip
        self.procs[slot] = proc
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 60)
        assert line.strip() == b"ready", (slot, line)
        self.started += 1

    def ready(self) -> list[int]:
        """Slots whose process runs (not being started again)."""
        for slot, task in list(self.restarting.items()):
            if task.done():
                task.result()  # a start that failed fails the test
                del self.restarting[slot]
        return [slot for slot in self.procs if slot not in self.restarting]

    async def restart(self, slot: int) -> None:
        """SIGKILL the slot's process; start a new one in the background."""
        await self.kill(slot)
        self.restarting[slot] = asyncio.create_task(self.start(slot))

    async def settle(self) -> None:
        """Wait for every restart in progress."""
        for task in list(self.restarting.values()):
            await task
        self.ready()

    async def kill(self, slot: int) -> None:
        proc = self.procs.pop(slot)
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        self.kills += 1

    async def stop_all(self) -> None:
        for proc in self.procs.values():
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            assert proc.stdout is not None
            out = await asyncio.wait_for(proc.stdout.read(), 60)
            assert await proc.wait() == 0
            for line in out.decode().splitlines():
                if line.startswith("stats "):
                    self.stats.append(json.loads(line[6:]))
        self.procs.clear()

    async def kill_all(self) -> None:
        for task in self.restarting.values():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        for slot in list(self.procs):
            await self.kill(slot)


def _past_hour_definition(name: str, hour: datetime) -> RecurringDefinition:
    """Fires every minute of ``hour`` (a past hour of this year): 60 due occurrences, then
    none until next year."""
    return RecurringDefinition(
        name,
        f"* {hour.hour} {hour.day} {hour.month} *",
        hour - timedelta(seconds=1),
        MissedRunPolicy.CATCH_UP,
        ScheduledMessage("stress", "stress.fired", name.encode(), {"definition": name}),
    )


@pytest.mark.parametrize("target", ["nats", "redis", "rabbitmq", "queue"], indirect=True)
async def test_four_relays_killed_and_cut_off_deliver_everything_once_per_key(
    target: Target, pg_schema: tuple[str, str], tmp_path: Path
) -> None:
    seed = _seed()
    print(f"relay stress {target.name}: seed {seed} ({SECONDS:g} s of faults)")
    rng = random.Random(seed)
    tag = (
        f"[{target.name}, seed {seed}; rerun with STEEPLE_RELAY_STRESS_SEED={seed}; "
        f"relay logs in {tmp_path}]"
    )
    dsn, schema = pg_schema
    namespace = f"stress-{target.name}"
    config = RecurringConfig(namespace, MAX_DEFINITIONS, MAX_OCCURRENCES, lease_duration=LEASE)
    clock = SystemClock()
    # Two hours back: due, well inside the one-day delivery window, never again this year.
    hour = (clock.now() - timedelta(hours=2)).replace(minute=0, second=0, microsecond=0)
    store = await PostgresRecurringStore.initialize(dsn, config, KEYRING, clock, schema=schema)
    names: list[str] = []

    async def add(count: int) -> None:
        batch = [f"d{len(names) + i:05d}" for i in range(count)]
        created = await store.create_many([_past_hour_definition(n, hour) for n in batch])
        assert all(not isinstance(c, Exception) for c in created), created
        names.extend(batch)

    conn = await asyncpg.connect(dsn)
    s = f'"{schema}"'
    cuts = lost_acks = 0
    started = time.monotonic()
    try:
        await add(FIRST_DEFINITIONS)
        async with running_proxy(*target.upstream, connect=_connector(target)) as proxy:
            args = [dsn, schema, namespace, str(LEASE // timedelta(milliseconds=1)), target.name]
            fleet = Fleet([*args, json.dumps(target.spec(proxy))], tmp_path)
            try:
                await asyncio.gather(*(fleet.start(slot) for slot in range(RELAYS)))
                faults_from = next_round = time.monotonic()
                while time.monotonic() - faults_from < SECONDS:
                    if time.monotonic() >= next_round:
                        next_round += 1.0
                        published = await conn.fetchval(
                            f"SELECT count(*) FROM {s}.recurring_occurrences "
                            "WHERE namespace = $1 AND state = 'published'",
                            namespace,
                        )
                        if len(names) * PER_DEFINITION - published < BACKLOG:
                            await add(DEFINITIONS_PER_ROUND)
                    await asyncio.sleep(rng.uniform(0.2, 0.8))
                    roll = rng.random()
                    if roll < 0.4:
                        if ready := fleet.ready():
                            await fleet.restart(rng.choice(sorted(ready)))
                    elif roll < 0.8:
                        proxy.reset_all()
                        cuts += 1
                    else:
                        # Let requests through, drop the answers, then cut: accepted
                        # publications whose acknowledgements never arrive.
                        proxy.drop_replies()
                        await asyncio.sleep(rng.uniform(0.05, 0.5))
                        proxy.reset_all()
                        lost_acks += 1
                fault_phase = time.monotonic() - faults_from
                await fleet.settle()

                async def unfinished() -> list[asyncpg.Record]:
                    return list(
                        await conn.fetch(
                            f"SELECT state, count(*) FROM {s}.recurring_occurrences "
                            "WHERE namespace = $1 AND state <> 'published' GROUP BY state",
                            namespace,
                        )
                    )

                async def unticked() -> int:
                    return int(
                        await conn.fetchval(
                            f"SELECT count(*) FROM {s}.recurring_definitions "
                            "WHERE namespace = $1 AND next_due_at <= now()",
                            namespace,
                        )
                    )

                deadline = time.monotonic() + FINISH_WITHIN
                while (left := await unfinished()) or await unticked():
                    assert time.monotonic() < deadline, f"{tag} not finished: {left}"
                    dead = [r for r in left if r["state"] == "dead"]
                    assert not dead, f"{tag} dead letters (never delivered): {left}"
                    await asyncio.sleep(0.2)
                await fleet.stop_all()
            finally:
                await fleet.kill_all()
        elapsed = time.monotonic() - started

        # --- the checker ------------------------------------------------------------------
        rows = await conn.fetch(
            f"SELECT id, definition_name, due_at, state, attempts "
            f"FROM {s}.recurring_occurrences WHERE namespace = $1",
            namespace,
        )
        assert len(rows) == len(names) * PER_DEFINITION, tag
        assert Counter(r["state"] for r in rows) == {"published": len(rows)}, tag
        expected = {
            idempotency_key(
                purpose=PUBLISH_PURPOSE,
                namespace=namespace,
                definition_name=r["definition_name"],
                due_at=r["due_at"],
                generation=bytes.fromhex(r["id"]),
            ): r["definition_name"]
            for r in rows
        }
        assert len(expected) == len(rows), f"{tag} two occurrences share a key"

        delivered = await target.consume()
        copies = Counter(key for key, _ in delivered)
        missing = expected.keys() - copies.keys()
        foreign = copies.keys() - expected.keys()
        assert not missing, f"{tag} {len(missing)} occurrences never reached the broker"
        assert not foreign, f"{tag} {len(foreign)} publications under keys of no occurrence"
        for key, message in delivered:
            name = expected[key]
            assert message == _past_hour_definition(name, hour).message, f"{tag} {key}"
        duplicates = len(delivered) - len(copies)
        if target.dedups:
            assert duplicates == 0, f"{tag} {copies.most_common(3)}"

        idle_in_tx = await conn.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND state LIKE 'idle in transaction%' AND query LIKE $1",
            f"%{s}%",
        )
        assert idle_in_tx == 0, tag

        attempts = Counter(r["attempts"] for r in rows)
        totals = Counter[str]()
        for stats in fleet.stats:
            totals.update(stats)
        print(
            f"relay stress {target.name}: seed {seed}, {len(rows)} occurrences of "
            f"{len(names)} definitions, {fault_phase:.1f} s of faults ({elapsed:.1f} s in all), "
            f"{fleet.kills} SIGKILLs, {cuts} connection cuts, {lost_acks} lost-ack cuts, "
            f"{len(delivered)} copies at the broker, {duplicates} duplicates; attempts "
            f"{dict(sorted(attempts.items()))}; last relays' counters {dict(totals)}"
        )
    finally:
        await conn.close()
        await store.close()


def _connector(target: Target) -> Any:
    """How the proxy reaches the broker: PostgreSQL by its endpoint (maybe a socket)."""
    if isinstance(target, QueueTarget):
        host, port = target.upstream
        return lambda: open_pg(host, port)
    return None
