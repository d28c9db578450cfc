"""Races and clock jumps against the real PostgreSQL recurring store.

RELIABILITY.md rows 13 (a SIGSTOPped relay worker's late acknowledgement), 18 (cancel
racing relay completion; two operators retrying one dead letter), 19 (ten tickers on one
namespace), 37 (the clock jumps an hour and a day) and the pool's recovery after its
connections died (every idle one terminated at once; one lost mid-transaction).
"""

from __future__ import annotations

import asyncio
import importlib
import signal
import sqlite3
import sys
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from steeple.brokers.sqlite import SqliteJournalBroker
from steeple.core import (
    MissedRunPolicy,
    OccurrenceState,
    RecurringConfig,
    RecurringDeadlineError,
    RecurringDefinition,
    RecurringInvalidStateError,
    RecurringStorageError,
    ScheduledMessage,
    SystemClock,
)
from steeple.core.errors import RelayBrokerError, RelayLeaseLostError
from steeple.core.idempotency import PUBLISH_PURPOSE, idempotency_key
from steeple.core.messages import BrokerReceipt
from steeple.core.records import Lease
from steeple.keyring import Keyring, StorageKey
from steeple.postgres import PostgresRecurringStore
from steeple.testing import FakeClock, MemoryBroker

pytestmark = pytest.mark.postgres

START = datetime(2031, 3, 4, 5, 6, 7, 250000, tzinfo=UTC)
KEY = StorageKey("k1", b"\x0b" * 32)
NAMESPACE = "races"


def cfg(**kw: object) -> RecurringConfig:
    args: dict[str, object] = {"max_definitions": 50, "max_occurrences": 5000}
    args.update(kw)
    return RecurringConfig(NAMESPACE, **args)  # type: ignore[arg-type]


def every_minute(
    name: str,
    first_after: datetime,
    policy: MissedRunPolicy = MissedRunPolicy.CATCH_UP,
    payload: bytes = b"p",
) -> RecurringDefinition:
    return RecurringDefinition(
        name, "* * * * *", first_after, policy, ScheduledMessage("races", "race.run", payload)
    )


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(START)


@pytest.fixture
async def store(
    pg_schema: tuple[str, str], clock: FakeClock
) -> AsyncIterator[PostgresRecurringStore]:
    dsn, schema = pg_schema
    async with await PostgresRecurringStore.initialize(
        dsn, cfg(), Keyring(KEY), clock, schema=schema
    ) as s:
        yield s


async def connect(pg_schema: tuple[str, str], clock: Any, **kw: object) -> PostgresRecurringStore:
    """Another instance on the same namespace: its own pool, its own connections."""
    dsn, schema = pg_schema
    return await PostgresRecurringStore.connect(dsn, cfg(**kw), Keyring(KEY), clock, schema=schema)


async def sql(dsn: str, schema: str, query: str, *args: object) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(dsn)
    try:
        return list(await conn.fetch(query.replace("{s}", f'"{schema}"'), *args))
    finally:
        await conn.close()


async def occurrence_rows(dsn: str, schema: str) -> dict[str, asyncpg.Record]:
    rows = await sql(
        dsn,
        schema,
        "SELECT id, definition_name, due_at, state, attempts, content, key_id,"
        " window_ends_at, finished_at, lease_revision FROM {s}.recurring_occurrences",
    )
    return {r["id"]: r for r in rows}


async def counters_match(dsn: str, schema: str) -> int:
    """The namespace's occurrence counter equals the rows stored; return it."""
    [row] = await sql(dsn, schema, "SELECT occurrence_count FROM {s}.recurring_namespaces")
    [count] = await sql(dsn, schema, "SELECT count(*) AS n FROM {s}.recurring_occurrences")
    assert row["occurrence_count"] == count["n"]
    return int(count["n"])


async def idle_in_transaction(dsn: str, schema: str) -> int:
    """This test's store sessions left idle in a transaction (after the brief
    between-statement state; other tests' sessions are not counted)."""
    n = 0
    for _ in range(20):
        [row] = await sql(
            dsn,
            schema,
            "SELECT count(*) AS n FROM pg_stat_activity WHERE application_name = "
            "'steeple-recurring' AND state LIKE 'idle in transaction%'"
            " AND position($1 in query) > 0",
            f'"{schema}"',
        )
        n = int(row["n"])
        if n == 0:
            return 0
        await asyncio.sleep(0.05)
    return n


def expected_key(row: asyncpg.Record) -> str:
    return idempotency_key(
        purpose=PUBLISH_PURPOSE,
        namespace=NAMESPACE,
        definition_name=row["definition_name"],
        due_at=row["due_at"],
        generation=bytes.fromhex(row["id"]),
    )


# --- row 13: a SIGSTOPped relay worker ------------------------------------------------------

_STOPPABLE_WORKER = """
import asyncio, os, sys, time
from datetime import timedelta
from steeple.brokers.sqlite import SqliteJournalBroker
from steeple.core import RecurringConfig, SystemClock
from steeple.core.errors import RelayLeaseLostError
from steeple.keyring import Keyring, StorageKey
from steeple.postgres import PostgresRecurringStore

dsn, schema, journal_path, gate, point = sys.argv[1:]

def hold(what):
    # Announce the point, then block the whole process (event loop included, so no
    # timer fires late) until the test has re-claimed the occurrence. The test SIGSTOPs
    # the process on the announcement; the gate only makes the interleaving exact.
    print(what, flush=True)
    while not os.path.exists(gate):
        time.sleep(0.01)

class SlowBroker:
    '''The journal, with a confirmation that arrives only after the lease has lapsed.'''
    def __init__(self, journal):
        self.journal = journal
    async def publish(self, message, *, idempotency_key, timeout):
        receipt = await self.journal.publish(
            message, idempotency_key=idempotency_key, timeout=timeout)
        hold("accepted")
        return receipt

async def main():
    config = RecurringConfig("races", 50, 5000, lease_duration=timedelta(seconds=1),
                             delivery_window=timedelta(hours=1))
    keyring = Keyring(StorageKey("k1", b"\\x0b" * 32))
    journal = SqliteJournalBroker(journal_path, keyring, required_window=timedelta(hours=1))
    store = await PostgresRecurringStore.connect(
        dsn, config, keyring, SystemClock(), schema=schema)
    async with store, journal:
        [lease] = await store.claim(1)
        if point == "claimed":
            hold("claimed")
        try:
            receipt = await store.relay(lease, SlowBroker(journal))
        except RelayLeaseLostError:
            print("RelayLeaseLostError", flush=True)
        else:
            print("relayed", receipt.duplicate, flush=True)

asyncio.run(main())
"""


def journal_rows(path: Path) -> list[tuple[str, int]]:
    conn = sqlite3.connect(path)
    try:
        return list(conn.execute("SELECT idempotency_key, delivery_count FROM steeple_journal"))
    finally:
        conn.close()


def process_state(pid: int) -> str:
    # Field 3 of /proc/<pid>/stat: "T" is stopped.
    text = Path(f"/proc/{pid}/stat").read_text()
    return text.rsplit(")", 1)[1].split()[0]


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("order", ["new-holder-first", "stale-first"])
@pytest.mark.parametrize("point", ["claimed", "accepted"])
async def test_sigstopped_worker_late_acknowledgement_is_rejected(
    pg_schema: tuple[str, str], tmp_path: Path, point: str, order: str
) -> None:
    """Stopped after its claim, or after the broker accepted but before the database
    acknowledgement; past its lease another instance re-claims (and publishes before or
    after the SIGCONT). The stale worker is fenced out (RelayLeaseLostError), finalizes
    nothing, and the journal holds one copy under the occurrence's one key."""
    dsn, schema = pg_schema
    keyring = Keyring(KEY)
    config = cfg(lease_duration=timedelta(seconds=1), delivery_window=timedelta(hours=1))
    journal_path = tmp_path / "journal.db"
    gate = tmp_path / "go"
    store = await PostgresRecurringStore.initialize(
        dsn, config, keyring, SystemClock(), schema=schema
    )
    journal = SqliteJournalBroker(journal_path, keyring, required_window=timedelta(hours=1))
    proc: asyncio.subprocess.Process | None = None
    try:
        now = SystemClock().now()
        # Coalesce: exactly one occurrence, whatever the minute.
        await store.create(every_minute("m", now - timedelta(minutes=10), MissedRunPolicy.COALESCE))
        assert (await store.tick(10)).materialized == 1
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            _STOPPABLE_WORKER,
            dsn,
            schema,
            str(journal_path),
            str(gate),
            point,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 30)
        if line.decode().strip() != point:
            proc.kill()
            raise AssertionError((line, (await proc.communicate())[1].decode()))
        proc.send_signal(signal.SIGSTOP)
        for _ in range(100):
            if process_state(proc.pid) == "T":
                break
            await asyncio.sleep(0.01)
        assert process_state(proc.pid) == "T"
        [stale] = await sql(dsn, schema, "SELECT * FROM {s}.recurring_occurrences")
        assert stale["state"] == "leased"
        assert stale["lease_revision"] == 1
        published_by_stale = len(journal_rows(journal_path)) if journal_path.exists() else 0
        assert published_by_stale == (1 if point == "accepted" else 0)

        # Past the stopped worker's lease, another instance claims it with a new revision.
        fresh: list[Lease] = []
        for _ in range(100):
            fresh = await store.claim(1)
            if fresh:
                break
            await asyncio.sleep(0.05)
        [lease] = fresh
        assert lease.revision == 2
        if order == "new-holder-first":
            receipt = await store.relay(lease, journal)
            assert receipt.duplicate is (point == "accepted")

        gate.touch()
        proc.send_signal(signal.SIGCONT)
        try:
            out, err = await asyncio.wait_for(proc.communicate(), 30)
        except TimeoutError:
            proc.kill()
            out, err = await proc.communicate()
            raise AssertionError(f"the worker hung: {out.decode()} {err.decode()}") from None
        assert proc.returncode == 0, err.decode()
        assert out.decode().split()[-1] == "RelayLeaseLostError", out.decode()

        [row] = await sql(dsn, schema, "SELECT * FROM {s}.recurring_occurrences")
        # the stale worker finalized nothing: not the new holder's lease, not its outcome
        assert row["lease_revision"] == 2
        if order == "stale-first":
            assert row["state"] == "leased"
            # The new holder finishes (re-claiming if its one-second lease lapsed meanwhile).
            for _ in range(20):
                try:
                    receipt = await store.relay(lease, journal)
                    break
                except RelayLeaseLostError:
                    for _ in range(100):
                        if again := await store.claim(1):
                            break
                        await asyncio.sleep(0.05)
                    [lease] = again
            assert receipt.duplicate is (point == "accepted")
            [row] = await sql(dsn, schema, "SELECT * FROM {s}.recurring_occurrences")
        assert row["state"] == "published"
        assert row["content"] is None
        # The checker: one copy in the broker, under the key derived from the occurrence.
        assert journal_rows(journal_path) == [(expected_key(row), 0)]
        assert await idle_in_transaction(dsn, schema) == 0
    finally:
        if proc is not None and proc.returncode is None:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
            await proc.wait()
        await journal.close()
        await store.close()


# --- row 18: cancel racing relay completion ---------------------------------------------


class GatedBroker:
    """A broker whose publish waits until the test releases it (deterministic races)."""

    def __init__(self) -> None:
        self.inner = MemoryBroker()
        self.entered = asyncio.Event()
        self.release = asyncio.Event()

    async def publish(
        self, message: ScheduledMessage, *, idempotency_key: str, timeout: float
    ) -> BrokerReceipt:
        self.entered.set()
        await self.release.wait()
        return await self.inner.publish(message, idempotency_key=idempotency_key, timeout=timeout)


async def test_cancel_while_publication_is_in_flight_keeps_it_cancelled(
    store: PostgresRecurringStore, pg_schema: tuple[str, str], clock: FakeClock
) -> None:
    dsn, schema = pg_schema
    await store.create(every_minute("d", START - timedelta(minutes=3)))
    await store.tick(10)
    [lease, *_] = await store.claim(1)
    broker = GatedBroker()
    relay = asyncio.create_task(store.relay(lease, broker))
    await asyncio.wait_for(broker.entered.wait(), 10)  # past the final lease check
    async with await connect(pg_schema, clock) as operator:
        info = await operator.cancel("d")
    assert info.state == "cancelled"
    rows = await occurrence_rows(dsn, schema)
    assert {r["state"] for r in rows.values()} == {"cancelled"}
    assert all(r["content"] is None for r in rows.values())
    broker.release.set()
    receipt = await asyncio.wait_for(relay, 10)  # no error: the publication cannot be recalled
    assert not receipt.duplicate
    assert [k for _, k in broker.inner.published] == [expected_key(rows[lease.occurrence_id])]
    after = await occurrence_rows(dsn, schema)
    assert {r["state"] for r in after.values()} == {"cancelled"}  # it stays cancelled
    assert all(r["content"] is None for r in after.values())
    assert await store.claim(10) == []
    assert await idle_in_transaction(dsn, schema) == 0


async def test_cancel_while_a_failing_publication_is_in_flight_records_no_retry(
    store: PostgresRecurringStore, pg_schema: tuple[str, str], clock: FakeClock
) -> None:
    dsn, schema = pg_schema
    await store.create(every_minute("d", START - timedelta(minutes=1)))
    await store.tick(10)
    [lease] = await store.claim(1)
    broker = GatedBroker()
    broker.inner.fail_next()
    relay = asyncio.create_task(store.relay(lease, broker))
    await asyncio.wait_for(broker.entered.wait(), 10)
    async with await connect(pg_schema, clock) as operator:
        await operator.cancel("d")
    broker.release.set()
    with pytest.raises(RelayBrokerError, match="cancelled meanwhile") as info:
        await asyncio.wait_for(relay, 10)
    assert not info.value.permanent
    [row] = (await occurrence_rows(dsn, schema)).values()
    assert (row["state"], row["content"]) == ("cancelled", None)  # no retry_wait, no dead
    clock.advance(timedelta(minutes=10))
    assert [i for i in await store.claim(10) if i.occurrence_id == lease.occurrence_id] == []
    with pytest.raises(RecurringInvalidStateError):
        await store.retry_failed(lease.occurrence_id)


async def test_cancel_before_the_final_check_publishes_nothing(
    store: PostgresRecurringStore, clock: FakeClock, pg_schema: tuple[str, str]
) -> None:
    await store.create(every_minute("d", START - timedelta(minutes=1)))
    await store.tick(10)
    [lease] = await store.claim(1)
    async with await connect(pg_schema, clock) as operator:
        await operator.cancel("d")
    broker = MemoryBroker()
    with pytest.raises(RelayLeaseLostError):
        await store.relay(lease, broker)
    assert broker.attempts == 0


async def test_cancel_racing_the_outcome_transaction(
    store: PostgresRecurringStore, pg_schema: tuple[str, str], clock: FakeClock
) -> None:
    """The broker answers and the cancellation commits at the same moment: whichever
    takes the control row first, the relay returns its receipt without error, the state is
    published or cancelled (never anything else), content is erased, one copy per key."""
    dsn, schema = pg_schema
    async with await connect(pg_schema, clock) as operator:
        for i in range(8):
            name = f"d{i}"
            await store.create(every_minute(name, START - timedelta(minutes=1)))
            await store.tick(10)
            [lease] = await store.claim(1)
            broker = GatedBroker()
            relay = asyncio.create_task(store.relay(lease, broker))
            await asyncio.wait_for(broker.entered.wait(), 10)
            cancel = asyncio.create_task(operator.cancel(name))
            await asyncio.sleep(0.001 * i)  # spread the interleavings
            broker.release.set()
            receipt, info = await asyncio.wait_for(asyncio.gather(relay, cancel), 10)
            assert info.state == "cancelled"
            row = (await occurrence_rows(dsn, schema))[lease.occurrence_id]
            assert row["state"] in {"published", "cancelled"}
            assert row["content"] is None
            assert receipt.idempotency_key == expected_key(row)
            assert broker.inner.keys() == [expected_key(row)]
    assert await store.claim(10) == []
    assert await counters_match(dsn, schema) == 8
    assert await idle_in_transaction(dsn, schema) == 0


async def lock_waiters(dsn: str, schema: str) -> int:
    """This test's store sessions waiting on a lock (the namespace's control row)."""
    [row] = await sql(
        dsn,
        schema,
        "SELECT count(*) AS n FROM pg_stat_activity WHERE application_name ="
        " 'steeple-recurring' AND wait_event_type = 'Lock' AND position($1 in query) > 0",
        f'"{schema}"',
    )
    return int(row["n"])


async def wait_for_waiters(dsn: str, schema: str, n: int) -> None:
    for _ in range(250):
        if await lock_waiters(dsn, schema) >= n:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"{n} sessions never queued on the control row")


@pytest.mark.parametrize("first", ["outcome", "cancel"])
async def test_cancel_and_relay_outcome_queued_in_either_order(
    store: PostgresRecurringStore, pg_schema: tuple[str, str], clock: FakeClock, first: str
) -> None:
    """Both orders, made exact by queueing the two transactions behind a held control
    row: outcome first leaves it published, cancel first leaves it cancelled; the relay
    returns its receipt either way and the content is erased."""
    dsn, schema = pg_schema
    await store.create(every_minute("d", START - timedelta(minutes=1)))
    await store.tick(10)
    [lease] = await store.claim(1)
    broker = GatedBroker()
    relay = asyncio.create_task(store.relay(lease, broker))
    await asyncio.wait_for(broker.entered.wait(), 10)
    async with await connect(pg_schema, clock) as operator:
        holder = await asyncpg.connect(dsn)
        try:
            tr = holder.transaction()
            await tr.start()
            await holder.execute(f'SELECT 1 FROM "{schema}".recurring_namespaces FOR UPDATE')
            cancel: asyncio.Task[Any] | None = None
            for step in (first, "cancel" if first == "outcome" else "outcome"):
                if step == "cancel":
                    cancel = asyncio.create_task(operator.cancel("d"))
                else:
                    broker.release.set()  # the relay's outcome transaction queues
                await wait_for_waiters(dsn, schema, 1 if step == first else 2)
            await tr.rollback()
        finally:
            await holder.close()
        assert cancel is not None
        receipt, info = await asyncio.wait_for(asyncio.gather(relay, cancel), 10)
    assert info.state == "cancelled"
    [row] = (await occurrence_rows(dsn, schema)).values()
    assert row["state"] == ("published" if first == "outcome" else "cancelled")
    assert row["content"] is None
    assert receipt.idempotency_key == expected_key(row)
    assert broker.inner.keys() == [expected_key(row)]
    assert await idle_in_transaction(dsn, schema) == 0


# --- row 18: two operators retrying one dead letter -------------------------------------


async def dead_letter(store: PostgresRecurringStore, name: str) -> str:
    # Fires once a year (03:00 on 4 March): exactly one occurrence, whatever the clock does.
    await store.create(
        RecurringDefinition(
            name,
            "0 3 4 3 *",
            START - timedelta(days=1),
            MissedRunPolicy.CATCH_UP,
            ScheduledMessage("races", "race.run", b"dead"),
        )
    )
    await store.tick(10)
    [lease] = await store.claim(1)
    broker = MemoryBroker()
    broker.fail_next(permanent=True)
    with pytest.raises(RelayBrokerError):
        await store.relay(lease, broker)
    return lease.occurrence_id


async def test_two_operators_retry_one_dead_letter(
    store: PostgresRecurringStore, pg_schema: tuple[str, str], clock: FakeClock
) -> None:
    dsn, schema = pg_schema
    first = await connect(pg_schema, clock)
    second = await connect(pg_schema, clock)
    try:
        for round_ in range(5):
            occurrence_id = await dead_letter(store, f"d{round_}")
            before = (await occurrence_rows(dsn, schema))[occurrence_id]
            assert before["state"] == "dead"
            assert before["content"] is not None  # a retryable dead letter keeps its content
            # Both retries queue behind a held control row and are released together.
            holder = await asyncpg.connect(dsn)
            try:
                tr = holder.transaction()
                await tr.start()
                await holder.execute(
                    f'SELECT 1 FROM "{schema}".recurring_namespaces WHERE namespace = $1'
                    " FOR UPDATE",
                    NAMESPACE,
                )
                racing = [
                    asyncio.create_task(s.retry_failed(occurrence_id)) for s in (first, second)
                ]
                await asyncio.sleep(0.2)
                assert not any(t.done() for t in racing)
                await tr.rollback()
            finally:
                await holder.close()
            results = await asyncio.gather(*racing, return_exceptions=True)
            revived = [r for r in results if not isinstance(r, BaseException)]
            refused = [r for r in results if isinstance(r, BaseException)]
            assert len(revived) == 1, results
            assert len(refused) == 1
            assert isinstance(refused[0], RecurringInvalidStateError)
            assert revived[0].state is OccurrenceState.PENDING
            assert revived[0].attempts == 0
            row = (await occurrence_rows(dsn, schema))[occurrence_id]
            assert (row["state"], row["attempts"], row["finished_at"]) == ("pending", 0, None)
            assert row["content"] == before["content"]
            # the one fresh budget is the normal one: ten automatic attempts, then dead
            broker = MemoryBroker()
            broker.fail_next(10)
            for attempt in range(1, 11):
                [lease] = await store.claim(1)
                with pytest.raises(RelayBrokerError):
                    await store.relay(lease, broker)
                row = (await occurrence_rows(dsn, schema))[occurrence_id]
                assert row["attempts"] == attempt
                if attempt < 10:
                    assert row["state"] == "retry_wait"
                    clock.advance(timedelta(minutes=5))
            assert row["state"] == "dead"
            assert await store.claim(1) == []
            # retire it so the next round's dead letter is the only claimable work
            await store.cancel(f"d{round_}")
    finally:
        await first.close()
        await second.close()
    assert await idle_in_transaction(dsn, schema) == 0


# --- row 37: the clock jumps forward -----------------------------------------------------


async def test_clock_jump_catch_up_is_bounded_and_oldest_first(
    store: PostgresRecurringStore, pg_schema: tuple[str, str], clock: FakeClock
) -> None:
    dsn, schema = pg_schema
    await store.create(every_minute("c", START))
    first_due = START.replace(second=0, microsecond=0) + timedelta(minutes=1)
    clock.advance(timedelta(hours=1))
    sizes = []
    while (n := (await store.tick(25)).materialized) > 0:
        sizes.append(n)
    assert sizes == [25, 25, 10]
    hour_rows = await occurrence_rows(dsn, schema)
    # a day later: 1440 more, at most 100 per tick, each tick the oldest still due
    clock.advance(timedelta(days=1))
    sizes = []
    previous_max = max(r["due_at"] for r in hour_rows.values())
    while (result := await store.tick(100)).materialized > 0:
        sizes.append(result.materialized)
        rows = await occurrence_rows(dsn, schema)
        dues = sorted(rows[i]["due_at"] for i in result.occurrence_ids)
        assert dues[0] == previous_max + timedelta(minutes=1)  # nothing skipped
        previous_max = dues[-1]
    assert sizes == [100] * 14 + [40]
    rows = await occurrence_rows(dsn, schema)
    dues = sorted(r["due_at"] for r in rows.values())
    assert dues == [first_due + timedelta(minutes=i) for i in range(1500)]
    assert await counters_match(dsn, schema) == 1500
    # The hour's sixty occurrences had windows from their materialization: they expired
    # with the day's jump; caught-up work got windows from its own materialization.
    for r in rows.values():
        if r["id"] in hour_rows:
            assert r["window_ends_at"] == START + timedelta(hours=1, days=1)
        else:
            assert r["window_ends_at"] == clock.now() + timedelta(days=1)
    leases = await store.claim(100)
    assert len(leases) == 100
    states = {r["id"]: r["state"] for r in (await occurrence_rows(dsn, schema)).values()}
    assert all(states[i] == "expired" for i in hour_rows)
    assert {states[lease.occurrence_id] for lease in leases} == {"leased"}


async def test_clock_jump_across_a_namespace_is_oldest_first(
    store: PostgresRecurringStore, pg_schema: tuple[str, str], clock: FakeClock
) -> None:
    """A day's jump over three definitions: each tick of 100 takes exactly the next 100
    outstanding instants by (due time, name); the coalescing one contributes one."""
    dsn, schema = pg_schema
    await store.create(every_minute("c1", START))
    await store.create(
        RecurringDefinition(
            "c2",
            "*/2 * * * *",
            START,
            MissedRunPolicy.CATCH_UP,
            ScheduledMessage("races", "race.run", b"p"),
        )
    )
    await store.create(every_minute("co", START, MissedRunPolicy.COALESCE))
    clock.advance(timedelta(days=1))
    first = START.replace(second=0, microsecond=0) + timedelta(minutes=1)
    minutes = [first + timedelta(minutes=i) for i in range(1440)]
    expected = sorted(
        [(d, "c1") for d in minutes]
        + [(d, "c2") for d in minutes if d.minute % 2 == 0]
        + [(first, "co")]
    )
    taken: list[tuple[datetime, str]] = []
    while (result := await store.tick(100)).materialized > 0:
        assert result.materialized == min(100, len(expected) - len(taken))
        rows = await sql(
            dsn,
            schema,
            "SELECT due_at, definition_name FROM {s}.recurring_occurrences"
            " WHERE id = ANY($1::text[])",
            list(result.occurrence_ids),
        )
        batch = sorted((r["due_at"], r["definition_name"]) for r in rows)
        assert batch == expected[len(taken) : len(taken) + len(batch)]
        taken.extend(batch)
    assert taken == expected
    assert await counters_match(dsn, schema) == 1440 + 720 + 1


async def test_clock_jump_coalesce_emits_one(
    store: PostgresRecurringStore, pg_schema: tuple[str, str], clock: FakeClock
) -> None:
    dsn, schema = pg_schema
    await store.create(every_minute("co", START, MissedRunPolicy.COALESCE))
    for jump in (timedelta(hours=1), timedelta(days=1)):
        clock.advance(jump)
        assert (await store.tick(100)).materialized == 1
        assert (await store.tick(100)).materialized == 0
    dues = sorted(r["due_at"] for r in (await occurrence_rows(dsn, schema)).values())
    # the oldest outstanding due time each time; then the cursor passed the observed time
    assert dues[0] == START.replace(second=0, microsecond=0) + timedelta(minutes=1)
    assert START + timedelta(hours=1) < dues[1] <= START + timedelta(hours=1, minutes=1)
    clock.advance(timedelta(minutes=1))
    assert (await store.tick(100)).materialized == 1


@pytest.mark.parametrize("entry", ["claim", "occurrences", "purge_terminal"])
async def test_clock_jump_classifies_expired_windows_and_erases_content(
    store: PostgresRecurringStore, pg_schema: tuple[str, str], clock: FakeClock, entry: str
) -> None:
    dsn, schema = pg_schema
    await store.create(every_minute("w", START - timedelta(minutes=5)))
    await store.create(every_minute("gone", START - timedelta(minutes=1)))
    await store.tick(100)
    leases = await store.claim(4)  # the four oldest of "w" (and "gone"'s one stays pending)
    by_id = {lease.occurrence_id: lease for lease in leases}
    broker = MemoryBroker()
    broker.fail_next(permanent=True)
    with pytest.raises(RelayBrokerError):
        await store.relay(leases[0], broker)  # dead
    broker.fail_next()
    with pytest.raises(RelayBrokerError):
        await store.relay(leases[1], broker)  # retry_wait
    await store.relay(leases[3], broker)  # published; leases[2] stays leased
    await store.cancel("gone")
    before = await occurrence_rows(dsn, schema)
    assert sorted(r["state"] for r in before.values()) == [
        "cancelled",
        "dead",
        "leased",
        "pending",
        "published",
        "retry_wait",
    ]
    # An hour: inside every window, nothing expires.
    clock.advance(timedelta(hours=1))
    assert all(o.state is not OccurrenceState.EXPIRED for o in (await store.occurrences()).items)
    # A day: every window has passed; classification is lazy until an entry point runs.
    clock.advance(timedelta(days=1))
    unchanged = await occurrence_rows(dsn, schema)
    assert {i: r["state"] for i, r in unchanged.items()} == {
        i: r["state"] for i, r in before.items()
    }
    if entry == "claim":
        assert await store.claim(100) == []
    elif entry == "occurrences":
        page = await store.occurrences()
        assert sorted(o.state.value for o in page.items) == [
            "cancelled",
            "expired",
            "expired",
            "expired",
            "expired",
            "published",
        ]
    else:
        assert await store.purge_terminal(START - timedelta(days=1)) == 0
    after = await occurrence_rows(dsn, schema)
    for occurrence_id, row in after.items():
        was = before[occurrence_id]["state"]
        if was in {"pending", "leased", "retry_wait", "dead"}:
            assert row["state"] == "expired", (was, row["state"])
            assert row["content"] is None  # the sealed content is erased
            assert row["key_id"] is None
            assert row["finished_at"] == row["window_ends_at"]
        else:
            assert row["state"] == was
            assert row["content"] is None
    # Nothing expired can be revived or acknowledged.
    dead_id = leases[0].occurrence_id
    with pytest.raises(RecurringInvalidStateError):
        await store.retry_failed(dead_id)
    with pytest.raises(RelayLeaseLostError):
        await store.relay(by_id[leases[2].occurrence_id], broker)
    assert len(broker.published) == 1
    assert await counters_match(dsn, schema) == 6


@pytest.mark.parametrize("classified", [False, True])
async def test_clock_jumps_past_the_window_while_a_publication_is_in_flight(
    store: PostgresRecurringStore,
    pg_schema: tuple[str, str],
    clock: FakeClock,
    classified: bool,
) -> None:
    """The broker accepts, then the clock jumps a day (past the window) before the
    outcome is recorded. Unclassified, the accepted publication is recorded; classified
    expired first (by a listing), the stale lease cannot record it: a typed
    RelayLeaseLostError. Either way one copy, content erased, a terminal state."""
    dsn, schema = pg_schema
    await store.create(every_minute("d", START - timedelta(minutes=1)))
    await store.tick(10)
    [lease] = await store.claim(1)
    broker = GatedBroker()
    relay = asyncio.create_task(store.relay(lease, broker))
    await asyncio.wait_for(broker.entered.wait(), 10)
    clock.advance(timedelta(days=1, minutes=1))
    if classified:
        [listed] = (await store.occurrences()).items
        assert listed.state is OccurrenceState.EXPIRED
    broker.release.set()
    if classified:
        with pytest.raises(RelayLeaseLostError, match="expired"):
            await asyncio.wait_for(relay, 10)
    else:
        await asyncio.wait_for(relay, 10)
    [row] = (await occurrence_rows(dsn, schema)).values()
    assert row["state"] == ("expired" if classified else "published")
    assert row["content"] is None
    assert broker.inner.keys() == [expected_key(row)]
    assert await store.claim(10) == []


# --- row 19: ten concurrent tickers --------------------------------------------------------


async def test_ten_tickers_on_one_namespace_never_materialize_twice(
    store: PostgresRecurringStore, pg_schema: tuple[str, str], clock: FakeClock
) -> None:
    dsn, schema = pg_schema
    for i in range(5):
        await store.create(every_minute(f"c{i}", START - timedelta(minutes=60)))
    for i in range(2):
        await store.create(
            every_minute(f"k{i}", START - timedelta(minutes=60), MissedRunPolicy.COALESCE)
        )
    tickers = [await connect(pg_schema, clock) for _ in range(10)]

    async def tick_until_idle(s: PostgresRecurringStore, budget: int) -> int:
        total = 0
        while (n := (await s.tick(budget)).materialized) > 0:
            total += n
        return total

    try:
        totals = await asyncio.gather(*(tick_until_idle(s, 3 + i) for i, s in enumerate(tickers)))
        assert sum(totals) == 5 * 60 + 2
        assert sum(1 for t in totals if t > 0) >= 2  # they really interleaved
        clock.advance(timedelta(minutes=5))
        totals = await asyncio.gather(*(tick_until_idle(s, 2) for s in tickers))
        assert sum(totals) == 5 * 5 + 2
    finally:
        for s in tickers:
            await s.close()
    [row] = await sql(
        dsn,
        schema,
        "SELECT count(*) AS n, count(DISTINCT (definition_name, due_at)) AS d"
        " FROM {s}.recurring_occurrences",
    )
    assert row["n"] == row["d"] == 5 * 65 + 4
    coalesced = await sql(
        dsn,
        schema,
        "SELECT definition_name, count(*) AS n FROM {s}.recurring_occurrences"
        " WHERE definition_name LIKE 'k%' GROUP BY definition_name",
    )
    assert sorted((r["definition_name"], r["n"]) for r in coalesced) == [("k0", 2), ("k1", 2)]
    assert await counters_match(dsn, schema) == 5 * 65 + 4
    assert await idle_in_transaction(dsn, schema) == 0


# --- the pool after its idle connections were all terminated ---------------------------

_SUITE_TESTS = str(Path(__file__).resolve().parents[3] / "tests")


@pytest.fixture
async def fault_proxy(pg_dsn: str) -> AsyncIterator[Any]:
    """The suite's fault-injecting TCP proxy (tests/faultproxy.py) to the test server."""
    if _SUITE_TESTS not in sys.path:
        sys.path.insert(0, _SUITE_TESTS)
    proxy = importlib.import_module("faultproxy").FaultProxy.for_dsn(pg_dsn)
    await proxy.start()
    try:
        yield proxy
    finally:
        await proxy.stop()


async def test_all_idle_connections_terminated_next_calls_succeed(
    pg_schema: tuple[str, str], clock: FakeClock, fault_proxy: Any
) -> None:
    """Every pooled backend terminated while idle; their sockets look open a while longer
    (the FIN trails the FATAL message). The first dead connection found expires the whole
    pool, so the very next two calls both succeed instead of meeting the other corpses."""
    dsn, schema = pg_schema
    await (
        await PostgresRecurringStore.initialize(dsn, cfg(), Keyring(KEY), clock, schema=schema)
    ).close()
    store = await PostgresRecurringStore.connect(
        fault_proxy.dsn(), cfg(), Keyring(KEY), clock, schema=schema
    )
    async with store:
        await store.create(every_minute("m", START - timedelta(minutes=2)))
        await asyncio.gather(*(store.schedules() for _ in range(4)))  # four open connections
        assert len(fault_proxy.live_backend_pids) == 4
        fault_proxy.delay_close(1.0)
        [killed] = await sql(
            dsn,
            schema,
            "SELECT count(pg_terminate_backend(pid)) AS n FROM pg_stat_activity"
            " WHERE pid = ANY($1::int[])",
            list(fault_proxy.live_backend_pids),
        )
        assert killed["n"] == 4
        await asyncio.sleep(0.1)  # the FATAL messages arrive; the sockets still look open
        assert [s.name for s in (await store.schedules()).items] == ["m"]
        assert (await store.tick(10)).materialized == 2
        fault_proxy.delay_close(0)
    assert await counters_match(dsn, schema) == 2


async def test_connection_lost_mid_transaction_expires_the_pool(
    pg_schema: tuple[str, str], clock: FakeClock
) -> None:
    """A backend terminated inside a transaction expires the pool (its siblings are
    replaced on their next use); an error the server answered, over a live link, does not."""
    dsn, schema = pg_schema
    async with await PostgresRecurringStore.initialize(
        dsn, cfg(), Keyring(KEY), clock, schema=schema
    ) as store:
        await store.create(every_minute("m", START - timedelta(minutes=2)))
        await asyncio.gather(*(store.schedules() for _ in range(4)))
        pool = store._pool  # test-only peek at the private pool's generation
        generation = pool._generation  # type: ignore[attr-defined]
        fn = (
            "CREATE OR REPLACE FUNCTION {s}.trap() RETURNS trigger LANGUAGE plpgsql AS $$"
            " BEGIN %s; RETURN NULL; END $$"
        )
        await sql(dsn, schema, fn % "RAISE EXCEPTION 'refused by a trigger'")
        await sql(
            dsn,
            schema,
            "CREATE TRIGGER trap AFTER INSERT ON {s}.recurring_occurrences"
            " FOR EACH STATEMENT EXECUTE FUNCTION {s}.trap()",
        )
        # an error the server answered: the link is healthy, the pool is kept
        with pytest.raises(RecurringStorageError, match="P0001"):
            await store.tick(10)
        assert pool._generation == generation  # type: ignore[attr-defined]
        await sql(dsn, schema, fn % "PERFORM pg_sleep(6)")
        # now terminate the backend while it sleeps inside the tick's transaction
        tick = asyncio.create_task(store.tick(10))
        pids: list[int] = []
        for _ in range(100):
            rows = await sql(
                dsn,
                schema,
                "SELECT pid FROM pg_stat_activity WHERE application_name = 'steeple-recurring'"
                " AND state = 'active' AND position('INSERT INTO' in query) > 0"
                " AND position($1 in query) > 0",
                f'"{schema}"',
            )
            pids = [r["pid"] for r in rows]
            if pids:
                break
            await asyncio.sleep(0.02)
        assert len(pids) == 1
        await sql(dsn, schema, "SELECT pg_terminate_backend($1)", pids[0])
        with pytest.raises(RecurringStorageError) as info:
            await tick
        assert not isinstance(info.value, RecurringDeadlineError)
        assert pool._generation == generation + 1  # type: ignore[attr-defined]
        await sql(dsn, schema, "DROP TRIGGER trap ON {s}.recurring_occurrences")
        assert (await store.tick(10)).materialized == 2
        assert [s.name for s in (await store.schedules()).items] == ["m"]
    assert await counters_match(dsn, schema) == 2
    assert await idle_in_transaction(dsn, schema) == 0
