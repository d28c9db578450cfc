"""Faults against the real PostgreSQL store: deadlines, cancellation, concurrency, isolation,
encryption binding, clocks and key rotation."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import AsyncIterator, Coroutine
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import pytest

from steeple.core import (
    AuthenticationFailedError,
    MissedRunPolicy,
    OccurrenceState,
    RecurringCapacityError,
    RecurringClockError,
    RecurringConfig,
    RecurringDeadlineError,
    RecurringDefinition,
    RecurringNotFoundError,
    RecurringStorageError,
    ScheduledMessage,
    UnknownKeyIdError,
)
from steeple.core.errors import KeyringError, RelayLeaseLostError
from steeple.keyring import Keyring, StorageKey
from steeple.postgres import PostgresRecurringStore
from steeple.postgres.recurring._store import _map_driver_error
from steeple.testing import FakeClock, MemoryBroker

pytestmark = pytest.mark.postgres

START = datetime(2031, 3, 4, 5, 6, 7, 250000, tzinfo=UTC)
K1 = StorageKey("k1", b"\x04" * 32)
K2 = StorageKey("k2", b"\x05" * 32)


def every_minute(name: str, minutes_back: int, payload: bytes = b"p") -> RecurringDefinition:
    return RecurringDefinition(
        name,
        "* * * * *",
        START - timedelta(minutes=minutes_back),
        MissedRunPolicy.CATCH_UP,
        ScheduledMessage("topic", "type", payload),
    )


async def open_store(
    pg_schema: tuple[str, str],
    clock: FakeClock,
    namespace: str = "ns-a",
    keyring: Keyring | None = None,
    **kw: object,
) -> PostgresRecurringStore:
    dsn, schema = pg_schema
    args: dict[str, object] = {"max_definitions": 50, "max_occurrences": 5000}
    args.update(kw)
    return await PostgresRecurringStore.initialize(
        dsn,
        RecurringConfig(namespace, **args),  # type: ignore[arg-type]
        keyring or Keyring(K1),
        clock,
        schema=schema,
    )


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(START)


@pytest.fixture
async def store(
    pg_schema: tuple[str, str], clock: FakeClock
) -> AsyncIterator[PostgresRecurringStore]:
    s = await open_store(pg_schema, clock)
    async with s:
        yield s


def backend_pids(store: PostgresRecurringStore) -> list[int]:
    """Server pids of this store's pooled connections (only ever kill our own)."""
    pool = store._pool  # test-only peek at the private pool
    return [
        h._con.get_server_pid()
        for h in pool._holders  # type: ignore[attr-defined]
        if h._con is not None and not h._con.is_closed()
    ]


async def terminate(dsn: str, pids: list[int]) -> int:
    conn = await asyncpg.connect(dsn)
    try:
        return int(
            await conn.fetchval(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE pid = ANY($1::int[])",
                pids,
            )
        )
    finally:
        await conn.close()


async def count_rows(dsn: str, schema: str, table: str = "recurring_occurrences") -> int:
    conn = await asyncpg.connect(dsn)
    try:
        return int(await conn.fetchval(f'SELECT count(*) FROM "{schema}".{table}'))
    finally:
        await conn.close()


async def idle_in_transaction(dsn: str, schema: str) -> int:
    """Sessions of this test's store left idle in a transaction (waits out the brief
    between-statement state; other tests' stores on the server are not counted)."""
    conn = await asyncpg.connect(dsn)
    try:
        for _ in range(20):
            n = int(
                await conn.fetchval(
                    "SELECT count(*) FROM pg_stat_activity WHERE application_name = "
                    "'steeple-recurring' AND state LIKE 'idle in transaction%' "
                    "AND position($1 in query) > 0",
                    f'"{schema}"',
                )
            )
            if n == 0:
                return 0
            await asyncio.sleep(0.05)
        return n
    finally:
        await conn.close()


async def test_lock_deadline_is_typed_and_stores_nothing(
    store: PostgresRecurringStore, pg_schema: tuple[str, str]
) -> None:
    dsn, schema = pg_schema
    holder = await asyncpg.connect(dsn)
    try:
        tr = holder.transaction()
        await tr.start()
        await holder.execute(
            f'SELECT * FROM "{schema}".recurring_namespaces WHERE namespace = $1 FOR UPDATE',
            "ns-a",
        )
        started = time.monotonic()
        with pytest.raises(RecurringDeadlineError) as info:
            await store.create(every_minute("blocked", 10))
        elapsed = time.monotonic() - started
        assert 4.0 <= elapsed <= 9.0, elapsed
        assert isinstance(info.value, TimeoutError)
        await tr.rollback()
    finally:
        await holder.close()
    assert await count_rows(dsn, schema, "recurring_definitions") == 0
    assert (await store.schedules()).items == []
    assert await idle_in_transaction(dsn, schema) == 0


async def test_cancelled_futures_leave_nothing_partial(
    store: PostgresRecurringStore, pg_schema: tuple[str, str], clock: FakeClock
) -> None:
    dsn, schema = pg_schema
    await store.create(every_minute("m", 60))
    # Cancel a tick of 60 at a spread of points: it is all or nothing every time.
    for delay in [0, 0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.03]:
        ticking = asyncio.create_task(store.tick(60))
        await asyncio.sleep(delay)
        ticking.cancel()
        try:
            result = await ticking
        except asyncio.CancelledError:
            result = None
        n = await count_rows(dsn, schema)
        assert n in (0, 60), n
        if result is not None or n == 60:
            break
    # while the control row is held, a cancelled waiter leaves no trace either
    holder = await asyncpg.connect(dsn)
    try:
        tr = holder.transaction()
        await tr.start()
        await holder.execute(f'SELECT * FROM "{schema}".recurring_namespaces FOR UPDATE')
        before = await count_rows(dsn, schema)
        ops: tuple[Coroutine[Any, Any, object], ...] = (
            store.tick(60),
            store.claim(10),
            store.create(every_minute("late", 5)),
        )
        for op in ops:
            waiter = asyncio.create_task(op)
            await asyncio.sleep(0.2)
            waiter.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiter
        await tr.rollback()
    finally:
        await holder.close()
    assert await count_rows(dsn, schema) == before
    await store.tick(100)
    # cancel claims and relays at several points
    broker = MemoryBroker(delay=0.05)
    for delay in [0, 0.001, 0.003, 0.01, 0.03, 0.06]:
        task = asyncio.create_task(store.claim(5))
        await asyncio.sleep(delay)
        task.cancel()
        try:
            leases = await task
        except asyncio.CancelledError:
            continue
        for lease in leases:
            relay = asyncio.create_task(store.relay(lease, broker))
            await asyncio.sleep(delay)
            relay.cancel()
            with contextlib.suppress(asyncio.CancelledError, RelayLeaseLostError):
                await relay
    await asyncio.sleep(0.1)
    assert await idle_in_transaction(dsn, schema) == 0
    # every interrupted lease lapses and the work completes with one copy per key
    clock.advance(timedelta(seconds=61))
    broker.delay = 0
    while leases := await store.claim(100):
        for lease in leases:
            await store.relay(lease, broker)
    page = await store.occurrences(limit=100)
    assert {o.state for o in page.items} == {OccurrenceState.PUBLISHED}
    keys = [k for _, k in broker.published]
    assert len(keys) == len(set(keys)) == 60
    # the pool is intact: four calls at once all succeed
    await asyncio.gather(*(store.schedules() for _ in range(8)))


_TICKER = """
import asyncio, sys
from datetime import UTC, datetime
from steeple.core import RecurringConfig
from steeple.keyring import Keyring, StorageKey
from steeple.postgres import PostgresRecurringStore
from steeple.testing import FakeClock

async def main(dsn, schema):
    clock = FakeClock(datetime(2031, 3, 4, 5, 6, 7, 250000, tzinfo=UTC))
    store = await PostgresRecurringStore.connect(
        dsn, RecurringConfig("ns-a", max_definitions=50, max_occurrences=5000),
        Keyring(StorageKey("k1", b"\\x04" * 32)), clock, schema=schema)
    total = 0
    async with store:
        while True:
            n = (await store.tick(7)).materialized
            total += n
            if n == 0:
                break
    print(total)

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


async def test_instances_in_separate_processes_never_double_materialize(
    store: PostgresRecurringStore, pg_schema: tuple[str, str]
) -> None:
    dsn, schema = pg_schema
    for i in range(3):
        await store.create(every_minute(f"d{i}", 100))
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            _TICKER,
            dsn,
            schema,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        for _ in range(2)
    ]
    # and ten concurrent tickers in this process at the same time
    local = await asyncio.gather(*(store.tick(5) for _ in range(10)))
    outputs = await asyncio.gather(*(p.communicate() for p in procs))
    totals = []
    for proc, (out, err) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, err.decode()
        totals.append(int(out))
    assert sum(totals) + sum(r.materialized for r in local) == 300
    conn = await asyncpg.connect(dsn)
    try:
        distinct = await conn.fetchval(
            "SELECT count(DISTINCT (definition_name, due_at)) "
            f'FROM "{schema}".recurring_occurrences'
        )
    finally:
        await conn.close()
    assert distinct == 300 == await count_rows(dsn, schema)


async def test_quota_under_concurrent_creates(pg_schema: tuple[str, str], clock: FakeClock) -> None:
    stores = [await open_store(pg_schema, clock, max_definitions=5) for _ in range(4)]
    try:
        results = await asyncio.gather(
            *(stores[i % 4].create(every_minute(f"n{i}", 5)) for i in range(20)),
            return_exceptions=True,
        )
    finally:
        for s in stores:
            await s.close()
    ok = [r for r in results if not isinstance(r, BaseException)]
    refused = [r for r in results if isinstance(r, RecurringCapacityError)]
    assert len(ok) == 5
    assert len(refused) == 15
    dsn, schema = pg_schema
    assert await count_rows(dsn, schema, "recurring_definitions") == 5


async def test_cross_namespace_denial(
    store: PostgresRecurringStore, pg_schema: tuple[str, str], clock: FakeClock
) -> None:
    async with await open_store(pg_schema, clock, namespace="ns-b") as other:
        await store.create(every_minute("secret", 3))
        await store.tick(10)
        [lease] = await store.claim(1)
        assert (await other.schedules()).items == []
        assert (await other.occurrences()).items == []
        assert (await other.tick(100)).materialized == 0
        assert await other.claim(100) == []
        broker = MemoryBroker()
        with pytest.raises(RelayLeaseLostError):
            await other.relay(lease, broker)
        with pytest.raises(RecurringNotFoundError):
            await other.cancel("secret")
        with pytest.raises(RecurringNotFoundError):
            await other.retry_failed(lease.occurrence_id)
        assert await other.purge_terminal(clock.now() + timedelta(days=9)) == 0
        assert broker.attempts == 0
        # same name in the other namespace is a different definition
        await other.create(every_minute("secret", 3, payload=b"different"))
        await store.relay(lease, broker)
        assert len((await store.occurrences()).items) == 3


async def test_content_moved_between_rows_fails_authentication(
    store: PostgresRecurringStore, pg_schema: tuple[str, str], clock: FakeClock
) -> None:
    dsn, schema = pg_schema
    async with await open_store(pg_schema, clock, namespace="ns-b") as other:
        await store.create(every_minute("a", 2, payload=b"tenant a"))
        await other.create(every_minute("a", 2, payload=b"tenant b"))
        await store.tick(10)
        await other.tick(10)
        conn = await asyncpg.connect(dsn)
        try:
            t = f'"{schema}".recurring_occurrences'
            ids_a = [
                r["id"]
                for r in await conn.fetch(
                    f"SELECT id FROM {t} WHERE namespace = 'ns-a' ORDER BY due_at"
                )
            ]
            ids_b = [
                r["id"]
                for r in await conn.fetch(
                    f"SELECT id FROM {t} WHERE namespace = 'ns-b' ORDER BY due_at"
                )
            ]
            # namespace b's first occurrence gets namespace a's ciphertext
            await conn.execute(
                f"UPDATE {t} SET content = (SELECT content FROM {t} WHERE id = $1) WHERE id = $2",
                ids_a[0],
                ids_b[0],
            )
            # within namespace a, two occurrences swap ciphertexts
            await conn.execute(
                f"UPDATE {t} SET content = (SELECT content FROM {t} WHERE id = $1) WHERE id = $2",
                ids_a[0],
                ids_a[1],
            )
            # a definition moved across namespaces cannot be ticked
            d = f'"{schema}".recurring_definitions'
            await conn.execute(
                f"UPDATE {d} SET sealed = (SELECT sealed FROM {d} WHERE namespace = 'ns-a') "
                "WHERE namespace = 'ns-b'"
            )
        finally:
            await conn.close()
        broker = MemoryBroker()
        for s, bad in ((other, ids_b[0]), (store, ids_a[1])):
            for lease in await s.claim(10):
                if lease.occurrence_id == bad:
                    with pytest.raises(AuthenticationFailedError):
                        await s.relay(lease, broker)
                else:
                    await s.relay(lease, broker)
        assert sorted(m.payload for m, _ in broker.published) == [b"tenant a", b"tenant b"]
        dead = [o for o in (await other.occurrences()).items if o.state is OccurrenceState.DEAD]
        assert [o.occurrence_id for o in dead] == [ids_b[0]]
        clock.advance(timedelta(minutes=5))
        before = await count_rows(dsn, schema)
        with pytest.raises(KeyringError):
            await other.tick(10)
        assert await count_rows(dsn, schema) == before


@pytest.mark.parametrize(("behind_ms", "ok"), [(4900, True), (5100, False)])
async def test_recorded_time_ahead_of_clock(
    store: PostgresRecurringStore, clock: FakeClock, behind_ms: int, ok: bool
) -> None:
    await store.create(every_minute("m", 1))
    await store.tick(10)
    recorded = clock.now()
    clock.set(recorded - timedelta(milliseconds=behind_ms))
    if ok:
        [lease] = await store.claim(1)
        # judged by the adopted (recorded) time, never earlier
        assert lease.expires_at == recorded + timedelta(seconds=60)
    else:
        with pytest.raises(RecurringClockError):
            await store.claim(1)
        with pytest.raises(RecurringClockError):
            await store.tick(1)


async def test_binding_resealed_after_rotation(
    pg_schema: tuple[str, str], clock: FakeClock
) -> None:
    dsn, schema = pg_schema
    async with await open_store(pg_schema, clock) as first:
        await first.create(every_minute("old", 2))
    rotated = Keyring(K2, K1)
    cfg = RecurringConfig("ns-a", max_definitions=50, max_occurrences=5000)
    async with await PostgresRecurringStore.connect(
        dsn, cfg, rotated, clock, schema=schema
    ) as second:
        await second.tick(10)  # first operation after rotation re-seals the binding
        await second.create(every_minute("new", 2))
    conn = await asyncpg.connect(dsn)
    try:
        key_id = await conn.fetchval(f'SELECT binding_key_id FROM "{schema}".recurring_namespaces')
    finally:
        await conn.close()
    assert key_id == "k2"
    # k1 is no longer needed for the binding, but still for what it sealed
    async with await PostgresRecurringStore.connect(
        dsn, cfg, Keyring(K2), clock, schema=schema
    ) as third:
        assert (await third.create(every_minute("new", 2))).name == "new"
        with pytest.raises(UnknownKeyIdError):
            await third.create(every_minute("old", 2))


async def test_killed_connection_is_a_typed_storage_error_then_recovers(
    store: PostgresRecurringStore, pg_schema: tuple[str, str]
) -> None:
    dsn, _ = pg_schema
    await store.create(every_minute("m", 3))
    await asyncio.gather(*(store.schedules() for _ in range(4)))  # fill the pool
    killed = await terminate(dsn, backend_pids(store))
    assert killed >= 1
    await asyncio.sleep(0.1)
    outcomes: list[int | str] = []
    for _ in range(6):
        try:
            outcomes.append(len((await store.schedules()).items))
        except RecurringStorageError as exc:
            outcomes.append(type(exc).__name__)
    assert outcomes[-1] == 1  # the pool replaced the dead connections


def test_disk_full_maps_to_storage_error() -> None:
    error = _map_driver_error(asyncpg.DiskFullError("could not extend file"), "tick")
    assert type(error) is RecurringStorageError
    assert "53100" in str(error)
    deadline = _map_driver_error(asyncpg.QueryCanceledError("canceling statement"), "tick")
    assert isinstance(deadline, RecurringDeadlineError)
    lock = _map_driver_error(asyncpg.LockNotAvailableError("lock timeout"), "tick")
    assert isinstance(lock, RecurringDeadlineError)


async def _slow_trigger(dsn: str, schema: str, table: str, seconds: float) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(
            f"""
            CREATE FUNCTION "{schema}".slow_{table}() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN PERFORM pg_sleep({seconds}); RETURN NULL; END $$;
            CREATE TRIGGER slow AFTER INSERT OR UPDATE ON "{schema}".{table}
            FOR EACH STATEMENT EXECUTE FUNCTION "{schema}".slow_{table}();
            """
        )
    finally:
        await conn.close()


async def test_statement_timeout_is_typed_and_stores_nothing(
    store: PostgresRecurringStore, pg_schema: tuple[str, str]
) -> None:
    dsn, schema = pg_schema
    await _slow_trigger(dsn, schema, "recurring_definitions", 6)
    started = time.monotonic()
    with pytest.raises(RecurringDeadlineError, match="statement_timeout"):
        await store.create(every_minute("slow", 3))
    assert time.monotonic() - started < 8
    assert await count_rows(dsn, schema, "recurring_definitions") == 0
    assert await idle_in_transaction(dsn, schema) == 0


async def test_call_deadline_of_ten_seconds(
    store: PostgresRecurringStore, pg_schema: tuple[str, str]
) -> None:
    dsn, schema = pg_schema
    await store.create(every_minute("m", 5))
    # Each wait stays under its own 5 s limit (lock_timeout, statement_timeout); together
    # they pass 10 s: the control row is held for 3 s, then the insert of the occurrences
    # takes 4 s and the last write (the definitions' cursors, sent with the namespace's
    # recorded time) another 4 s.
    await _slow_trigger(dsn, schema, "recurring_occurrences", 4)
    await _slow_trigger(dsn, schema, "recurring_definitions", 4)
    holder = await asyncpg.connect(dsn)
    held = holder.transaction()
    await held.start()
    await holder.execute(f'SELECT 1 FROM "{schema}".recurring_namespaces FOR UPDATE')

    async def release_after_a_while() -> None:
        await holder.execute("SELECT pg_sleep(3)")
        await held.commit()

    releasing = asyncio.create_task(release_after_a_while())
    try:
        started = time.monotonic()
        with pytest.raises(RecurringDeadlineError, match="10 s"):
            await store.tick(100)
        assert 9.5 <= time.monotonic() - started < 13
    finally:
        await releasing
        await holder.close()
    assert await count_rows(dsn, schema) == 0
    await asyncio.sleep(0.2)
    assert await idle_in_transaction(dsn, schema) == 0


async def test_backend_terminated_between_relay_transactions_recovers(
    store: PostgresRecurringStore, pg_schema: tuple[str, str], clock: FakeClock
) -> None:
    dsn, _ = pg_schema
    await store.create(every_minute("m", 1))
    await store.tick(10)
    [lease] = await store.claim(1)
    accepted = MemoryBroker()

    class KillingBroker(MemoryBroker):
        async def publish(self, message, *, idempotency_key, timeout):  # type: ignore[no-untyped-def]
            receipt = await accepted.publish(
                message, idempotency_key=idempotency_key, timeout=timeout
            )
            self.killed = await terminate(dsn, backend_pids(store))
            return receipt

    # The pool notices the dead connection and records the outcome on a fresh one.
    broker = KillingBroker()
    receipt = await store.relay(lease, broker)
    assert broker.killed >= 1
    assert not receipt.duplicate
    [occ] = (await store.occurrences()).items
    assert occ.state is OccurrenceState.PUBLISHED
    assert len(accepted.published) == 1
