"""Cancellation at every suspension point (RELIABILITY row 15), counted, not timed.

Each operation -- the recurring store's tick, claim, relay and claim_and_relay, and the
queue's enqueue, claim, renewal and completion statements as the worker runs them -- is
cancelled at its k-th real suspension (see ``suspensions.py``) for k = 1, 2, ... until
it completes before reaching k. After every cut the database holds the operation wholly
or not at all, no backend of the store's (or the worker's) pool is idle in a transaction
or holds a lock, and the next uncancelled call works.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import pytest

import faultprobe
from queue_support import installed_queue
from steeple.core import (
    MissedRunPolicy,
    RecurringConfig,
    RecurringDefinition,
    ScheduledMessage,
)
from steeple.core.records import Lease
from steeple.keyring import Keyring, StorageKey
from steeple.postgres import PostgresRecurringStore
from steeple.postgres._arrays import array_literal, text_array
from steeple.postgres.queue import EnqueueOptions, Task, enqueue
from steeple.postgres.queue._db import open_db
from steeple.postgres.queue._sql import queue_sql
from steeple.testing import FakeClock, MemoryBroker
from suspensions import Cut, every_suspension

pytestmark = [pytest.mark.postgres]

START = datetime(2031, 3, 4, 5, 6, 7, tzinfo=UTC)
KEYRING = Keyring(StorageKey("k1", b"\x0d" * 32))
CONFIG = RecurringConfig("everyawait", 20, 5000, lease_duration=timedelta(minutes=5))


class Recurring:
    """A store with a long backlog, and views of its rows and its pool's backends."""

    def __init__(self, dsn: str, schema: str, store: PostgresRecurringStore) -> None:
        self.dsn = dsn
        self.schema = schema
        self.store = store
        self.pids: set[int] = set()

    async def counts(self) -> dict[str, int]:
        """Occurrences by state; the namespace's counter must match the rows."""
        conn = await asyncpg.connect(self.dsn, timeout=10)
        try:
            rows = await conn.fetch(
                f'SELECT state, count(*) AS n FROM "{self.schema}".recurring_occurrences '
                "GROUP BY state"
            )
            counter = await conn.fetchval(
                f'SELECT occurrence_count FROM "{self.schema}".recurring_namespaces'
            )
            cursor_ok = await conn.fetchval(
                # the definition's cursor is exactly the latest materialized due time
                f"SELECT d.cursor_at = coalesce(max(o.due_at), d.first_after) "
                f'FROM "{self.schema}".recurring_definitions d '
                f'LEFT JOIN "{self.schema}".recurring_occurrences o '
                "ON o.definition_name = d.name GROUP BY d.name, d.cursor_at, d.first_after"
            )
        finally:
            await conn.close()
        by_state = {r["state"]: r["n"] for r in rows}
        assert counter == sum(by_state.values()), (counter, by_state)
        assert cursor_ok, "the tick cursor and the stored occurrences disagree"
        return by_state

    async def occurrence(self, occurrence_id: str) -> tuple[str, int]:
        conn = await asyncpg.connect(self.dsn, timeout=10)
        try:
            row = await conn.fetchrow(
                f'SELECT state, attempts FROM "{self.schema}".recurring_occurrences WHERE id = $1',
                occurrence_id,
            )
        finally:
            await conn.close()
        assert row is not None
        return row["state"], row["attempts"]

    async def clean(self) -> None:
        """No backend the pool ever had is idle in a transaction or holds a lock."""
        pool: Any = self.store._pool
        for holder in pool._holders:
            con = holder._con
            if con is not None and not con.is_closed():
                self.pids.add(con.get_server_pid())
        await faultprobe.wait_for_clean(self.dsn, self.pids, timeout=5.0)


@pytest.fixture
async def recurring(pg_schema: tuple[str, str]) -> AsyncIterator[Recurring]:
    dsn, schema = pg_schema
    clock = FakeClock(START)
    store = await PostgresRecurringStore.initialize(dsn, CONFIG, KEYRING, clock, schema=schema)
    async with store:
        await store.create(
            RecurringDefinition(
                "a",
                "* * * * *",
                START - timedelta(minutes=600),
                MissedRunPolicy.CATCH_UP,
                ScheduledMessage("every", "await", b"a"),
            )
        )
        yield Recurring(dsn, schema, store)


async def test_a_tick_cut_at_any_await_is_all_or_nothing(recurring: Recurring) -> None:
    before = {"n": 0}

    async def check(cut: Cut) -> None:
        # Settle first: a COMMIT sent before the cut may still be running on the server.
        await recurring.clean()
        stored = sum((await recurring.counts()).values())
        assert stored - before["n"] in (0, 5), (cut, stored, before)
        if cut.completed:
            assert stored - before["n"] == 5
        before["n"] = stored

    cuts = await every_suspension(lambda: recurring.store.tick(5), check)
    assert len(cuts) >= 5, cuts  # acquire, begin, lock, reads, writes, commit at least
    assert (await recurring.store.tick(5)).materialized == 5  # the store still works


async def test_a_claim_cut_at_any_await_is_all_or_nothing(recurring: Recurring) -> None:
    await recurring.store.tick(20)
    before = {"n": 0}

    async def check(cut: Cut) -> None:
        await recurring.clean()  # settle first (see the tick's check)
        leased = (await recurring.counts()).get("leased", 0)
        assert leased - before["n"] in (0, 2), (cut, leased, before)
        before["n"] = leased

    cuts = await every_suspension(lambda: recurring.store.claim(2), check)
    assert len(cuts) >= 5, cuts
    assert len(await recurring.store.claim(2)) == 2


async def test_a_relay_cut_at_any_await_records_each_step_wholly(recurring: Recurring) -> None:
    store = recurring.store
    await store.tick(20)
    broker = MemoryBroker()
    current: dict[str, Any] = {}

    async def prepare() -> None:
        [lease] = await store.claim(1)
        current["lease"] = lease
        current["before"] = await recurring.occurrence(lease.occurrence_id)
        current["sent"] = len(broker.published)

    async def relay() -> Any:
        return await store.relay(current["lease"], broker)

    async def check(cut: Cut) -> None:
        await recurring.clean()
        lease: Lease = current["lease"]
        state, attempts = await recurring.occurrence(lease.occurrence_id)
        _, attempts_before = current["before"]
        sent = len(broker.published) - current["sent"]
        # step one (the attempt counted) and step three (published) each happened or not
        assert (state, attempts - attempts_before) in {
            ("leased", 0),
            ("leased", 1),
            ("published", 1),
        }, (cut, state, attempts)
        assert sent in (0, 1)
        if state == "published":
            assert sent == 1
        if attempts == attempts_before:
            assert sent == 0
        if cut.completed:
            assert state == "published"

    cuts = await every_suspension(relay, check, prepare)
    assert len(cuts) >= 8, cuts


async def test_a_batched_relay_cut_at_any_await_records_each_step_wholly(
    recurring: Recurring,
) -> None:
    store = recurring.store
    await store.tick(20)
    broker = MemoryBroker()
    seen = {"leased": 0, "published": 0, "sent": 0}

    async def check(cut: Cut) -> None:
        await recurring.clean()
        counts = await recurring.counts()
        leased, published = counts.get("leased", 0), counts.get("published", 0)
        sent = len(broker.published)
        # the claim (with each attempt counted) and the record are each whole
        assert (leased + published) - (seen["leased"] + seen["published"]) in (0, 2), cut
        assert published - seen["published"] in (0, 2), cut
        assert sent - seen["sent"] in (0, 1, 2), cut
        assert sent >= published
        seen.update(leased=leased, published=published, sent=sent)

    cuts = await every_suspension(lambda: store.claim_and_relay(2, broker), check)
    assert len(cuts) >= 6, cuts


# --- the work queue ------------------------------------------------------------------


class Queue:
    """A queue schema, a pool named for this test, and the worker's statements."""

    def __init__(self, dsn: str, schema: str, conn: asyncpg.Connection, pool: Any) -> None:
        self.dsn = dsn
        self.schema = schema
        self.conn = conn
        self.pool = pool
        self.db = open_db(pool)
        self.sql = queue_sql(schema)
        self.app = f"cancel-{schema}"[:63]
        self.round = 0

    async def clean(self) -> None:
        rows = await self.conn.fetch(
            "SELECT pid FROM pg_stat_activity WHERE application_name = $1", self.app
        )
        await faultprobe.wait_for_clean(self.dsn, [r["pid"] for r in rows], timeout=5.0)

    async def task(self, name: str) -> tuple[str, int]:
        row = await self.conn.fetchrow(
            f'SELECT state, (SELECT count(*) FROM "{self.schema}".attempts a '
            "WHERE a.task_id = t.id) AS history "
            f'FROM "{self.schema}".tasks t WHERE task_name = $1',
            name,
        )
        assert row is not None
        return row["state"], row["history"]

    async def claim(self, name: str) -> tuple[int, Any]:
        assert self.db is not None
        [row] = await self.db.fetch(self.sql.claim, [name], 1, "w", time.time() + 3600, timeout=10)
        return row[0], row[6]


@pytest.fixture
async def queue(pg_schema: tuple[str, str]) -> AsyncIterator[Queue]:
    dsn, schema = pg_schema
    async with installed_queue(dsn, schema) as conn:
        pool = await asyncpg.create_pool(
            dsn,
            min_size=0,
            max_size=4,
            server_settings={"application_name": f"cancel-{schema}"[:63]},
        )
        try:
            yield Queue(dsn, schema, conn, pool)
        finally:
            await pool.close()


def _next_name(queue: Queue) -> str:
    queue.round += 1
    return f"cut-{queue.round}"


async def test_an_enqueue_cut_at_any_await_is_all_or_nothing(queue: Queue) -> None:
    names: list[str] = []

    async def prepare() -> None:
        names.append(_next_name(queue))

    async def op() -> Any:
        async with queue.pool.acquire() as conn:
            return await enqueue(
                conn, Task(names[-1]), {"n": 1}, EnqueueOptions.immediate(), schema=queue.schema
            )

    async def check(cut: Cut) -> None:
        await queue.clean()
        count = await queue.conn.fetchval(
            f'SELECT count(*) FROM "{queue.schema}".tasks WHERE task_name = $1', names[-1]
        )
        assert count in (0, 1), cut
        if cut.completed:
            assert count == 1

    cuts = await every_suspension(op, check, prepare)
    assert len(cuts) >= 2, cuts


async def test_a_queue_claim_cut_at_any_await_is_all_or_nothing(queue: Queue) -> None:
    names: list[str] = []

    async def prepare() -> None:
        names.append(_next_name(queue))
        for n in range(2):
            await enqueue(
                queue.conn,
                Task(names[-1]),
                {"n": n},
                EnqueueOptions.immediate(),
                schema=queue.schema,
            )

    async def op() -> Any:
        assert queue.db is not None
        return await queue.db.fetch(
            queue.sql.claim_timed,
            ["default"],
            text_array([2]),
            [names[-1]],
            "w",
            time.time() + 3600,
            [None],
            [None],
            [None],
            timeout=10,
        )

    async def check(cut: Cut) -> None:
        await queue.clean()
        running = await queue.conn.fetchval(
            f'SELECT count(*) FROM "{queue.schema}".tasks '
            "WHERE task_name = $1 AND state = 'running'",
            names[-1],
        )
        assert running in (0, 2), cut
        if cut.completed:
            assert running == 2

    cuts = await every_suspension(op, check, prepare)
    assert len(cuts) >= 2, cuts


async def test_a_renewal_cut_at_any_await_leaves_the_lease_whole(queue: Queue) -> None:
    current: dict[str, Any] = {}

    async def prepare() -> None:
        name = _next_name(queue)
        await enqueue(queue.conn, Task(name), {}, EnqueueOptions.immediate(), schema=queue.schema)
        current["id"], current["token"] = await queue.claim(name)
        current["expires"] = await queue.conn.fetchval(
            f'SELECT lease_expires_at FROM "{queue.schema}".tasks WHERE id = $1', current["id"]
        )

    async def op() -> Any:
        assert queue.db is not None
        return await queue.db.fetch(
            queue.sql.renew,
            text_array([current["id"]]),
            text_array([current["token"]]),
            timeout=10,
        )

    async def check(cut: Cut) -> None:
        await queue.clean()
        row = await queue.conn.fetchrow(
            f'SELECT state, lease_token, lease_expires_at FROM "{queue.schema}".tasks '
            "WHERE id = $1",
            current["id"],
        )
        assert row is not None
        state, token, expires = row
        assert (state, token) == ("running", current["token"]), cut
        if cut.completed:
            assert expires > current["expires"]

    cuts = await every_suspension(op, check, prepare)
    assert len(cuts) >= 2, cuts


async def test_a_completion_cut_at_any_await_is_all_or_nothing(queue: Queue) -> None:
    current: dict[str, Any] = {}

    async def prepare() -> None:
        current["name"] = name = _next_name(queue)
        await enqueue(queue.conn, Task(name), {}, EnqueueOptions.immediate(), schema=queue.schema)
        current["id"], current["token"] = await queue.claim(name)

    async def op() -> Any:
        assert queue.db is not None
        return await queue.db.fetch(
            queue.sql.complete,
            array_literal([current["id"]]),
            array_literal([current["token"]]),
            "w",
            [None],  # no result
            [None],  # no progress
            timeout=10,
        )

    async def check(cut: Cut) -> None:
        await queue.clean()
        # succeeded together with its history row, or still running without one
        state = await queue.task(current["name"])
        assert state in {("running", 0), ("succeeded", 1)}, (cut, state)
        if cut.completed:
            assert state == ("succeeded", 1)

    cuts = await every_suspension(op, check, prepare)
    assert len(cuts) >= 2, cuts
