"""Seed 000's relay sentences against a real PostgreSQL (issue 11, item 4).

- "Broker acceptance followed by an uncertain acknowledgement returns
  RecurringRelayError::Acknowledgement, retaining the broker receipt": the broker accepts,
  then recording the outcome fails for real (another session holds the namespace's control
  row past ``lock_timeout``; the backend is terminated while it waits): ``relay`` raises
  :class:`RelayAcknowledgementError` carrying the receipt, the storage error as its cause.
- "recheck persisted server time after lock waits and around commit", in relay too: a
  lease that lapsed while the relay's check waited for the lock, or while its commit was
  acknowledged (a deferred trigger makes the COMMIT slow), publishes nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import pytest

from steeple.core import (
    MissedRunPolicy,
    OccurrenceState,
    RecurringConfig,
    RecurringDeadlineError,
    RecurringDefinition,
    RecurringStorageError,
    ScheduledMessage,
    SystemClock,
)
from steeple.core.errors import RelayAcknowledgementError, RelayLeaseLostError
from steeple.core.messages import BrokerReceipt
from steeple.core.ports import Clock
from steeple.core.records import Lease
from steeple.keyring import Keyring, StorageKey
from steeple.postgres import PostgresRecurringStore
from steeple.testing import FakeClock, MemoryBroker

pytestmark = pytest.mark.postgres

START = datetime(2031, 3, 4, 5, 6, 7, 250000, tzinfo=UTC)
KEYRING = Keyring(StorageKey("k1", b"\x0c" * 32))
NAMESPACE = "acks"


def config(**kw: Any) -> RecurringConfig:
    return RecurringConfig(NAMESPACE, 10, 100, **kw)


async def open_leased(
    pg_schema: tuple[str, str], clock: Clock, **kw: Any
) -> tuple[PostgresRecurringStore, Lease]:
    dsn, schema = pg_schema
    store = await PostgresRecurringStore.initialize(
        dsn, config(**kw), KEYRING, clock, schema=schema
    )
    now = clock.now()
    await store.create(
        RecurringDefinition(
            "d",
            "* * * * *",
            now - timedelta(minutes=1, seconds=1),
            MissedRunPolicy.CATCH_UP,
            ScheduledMessage("acks", "ack.tested", b"payload"),
        )
    )
    assert (await store.tick(1)).materialized == 1
    [lease] = await store.claim(1)
    return store, lease


@pytest.fixture
async def holder(pg_schema: tuple[str, str]) -> AsyncIterator[asyncpg.Connection]:
    """Another session of the test, able to hold the namespace's control row."""
    conn = await asyncpg.connect(pg_schema[0])
    try:
        yield conn
    finally:
        await conn.close()


async def hold_control_row(holder: asyncpg.Connection, schema: str) -> Any:
    tr = holder.transaction()
    await tr.start()
    await holder.execute(
        f'SELECT 1 FROM "{schema}".recurring_namespaces WHERE namespace = $1 FOR UPDATE',
        NAMESPACE,
    )
    return tr


async def lock_waiter(dsn: str, schema: str) -> int:
    """The pid of this test's store session waiting for the control row."""
    conn = await asyncpg.connect(dsn)
    try:
        async with asyncio.timeout(10):
            while True:
                pid = await conn.fetchval(
                    "SELECT pid FROM pg_stat_activity WHERE application_name ="
                    " 'steeple-recurring' AND wait_event_type = 'Lock'"
                    " AND position($1 in query) > 0",
                    f'"{schema}"',
                )
                if pid is not None:
                    return int(pid)
                await asyncio.sleep(0.01)
    finally:
        await conn.close()


class AcceptThen(MemoryBroker):
    """Accepts the message, then runs ``after`` before answering (the outcome follows)."""

    def __init__(self, after: Callable[[], Awaitable[Any]]) -> None:
        super().__init__()
        self.after = after

    async def publish(
        self, message: ScheduledMessage, *, idempotency_key: str, timeout: float
    ) -> BrokerReceipt:
        receipt = await super().publish(message, idempotency_key=idempotency_key, timeout=timeout)
        if self.attempts == 1:
            await self.after()
        return receipt


async def test_outcome_behind_a_held_control_row_keeps_the_receipt(
    pg_schema: tuple[str, str], holder: asyncpg.Connection
) -> None:
    clock = FakeClock(START)
    store, lease = await open_leased(pg_schema, clock)
    held: list[Any] = []

    async def hold() -> None:
        held.append(await hold_control_row(holder, pg_schema[1]))

    broker = AcceptThen(hold)
    try:
        with pytest.raises(RelayAcknowledgementError) as info:
            await store.relay(lease, broker)
    finally:
        for tr in held:
            await tr.rollback()
    # the real lock wait deadline (lock_timeout and statement_timeout are both 5 s),
    # typed, is the cause; the receipt is the broker's
    assert isinstance(info.value.__cause__, RecurringDeadlineError)
    assert "_timeout" in str(info.value.__cause__)
    assert info.value.receipt.idempotency_key == broker.keys()[0]
    assert not info.value.receipt.duplicate
    try:
        [occ] = (await store.occurrences()).items
        assert occ.state is OccurrenceState.LEASED  # accepted, not recorded
        # recovery repeats the same key: the broker deduplicates, the outcome is recorded
        receipt = await store.relay(lease, broker)
        assert receipt.duplicate
        [occ] = (await store.occurrences()).items
        assert occ.state is OccurrenceState.PUBLISHED
        assert len(broker.published) == 1
    finally:
        await store.close()


async def test_outcome_on_a_terminated_backend_keeps_the_receipt(
    pg_schema: tuple[str, str], holder: asyncpg.Connection
) -> None:
    dsn, schema = pg_schema
    clock = FakeClock(START)
    store, lease = await open_leased(pg_schema, clock)
    held: list[Any] = []
    killer: list[asyncio.Task[Any]] = []

    async def kill_the_waiting_backend() -> None:
        pid = await lock_waiter(dsn, schema)
        conn = await asyncpg.connect(dsn)
        try:
            assert await conn.fetchval("SELECT pg_terminate_backend($1)", pid)
        finally:
            await conn.close()

    async def hold() -> None:
        held.append(await hold_control_row(holder, schema))
        killer.append(asyncio.create_task(kill_the_waiting_backend()))

    broker = AcceptThen(hold)
    try:
        with pytest.raises(RelayAcknowledgementError) as info:
            await store.relay(lease, broker)
        await killer[0]
    finally:
        for tr in held:
            await tr.rollback()
    cause = info.value.__cause__
    assert isinstance(cause, RecurringStorageError)
    assert not isinstance(cause, RecurringDeadlineError)  # the connection died, no deadline
    assert info.value.receipt.idempotency_key == broker.keys()[0]
    try:
        receipt = await store.relay(lease, broker)
        assert receipt.duplicate
        [occ] = (await store.occurrences()).items
        assert occ.state is OccurrenceState.PUBLISHED
        assert len(broker.published) == 1
    finally:
        await store.close()


async def test_a_lease_that_lapsed_during_the_lock_wait_publishes_nothing(
    pg_schema: tuple[str, str], holder: asyncpg.Connection
) -> None:
    dsn, schema = pg_schema
    clock = FakeClock(START)
    store, lease = await open_leased(pg_schema, clock)
    broker = MemoryBroker()
    tr = await hold_control_row(holder, schema)
    try:
        relay = asyncio.create_task(store.relay(lease, broker))
        await lock_waiter(dsn, schema)
        clock.advance(timedelta(seconds=61))  # the lease lapses while the check is queued
    finally:
        await tr.rollback()
    try:
        with pytest.raises(RelayLeaseLostError):
            await relay
        assert broker.attempts == 0
        [occ] = (await store.occurrences()).items
        assert (occ.state, occ.attempts) == (OccurrenceState.LEASED, 0)
    finally:
        await store.close()


async def test_a_lease_that_lapsed_while_the_check_committed_publishes_nothing(
    pg_schema: tuple[str, str],
) -> None:
    dsn, schema = pg_schema
    # A real clock and a 1 s lease; the relay's check then commits for 3 s.
    store, lease = await open_leased(
        pg_schema,
        SystemClock(),
        lease_duration=timedelta(seconds=1),
        delivery_window=timedelta(minutes=10),
    )
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(
            f'CREATE FUNCTION "{schema}".slow_commit() RETURNS trigger LANGUAGE plpgsql AS $$'
            " BEGIN PERFORM pg_sleep(3); RETURN NULL; END $$"
        )
        await conn.execute(
            "CREATE CONSTRAINT TRIGGER slow_commit"
            f' AFTER UPDATE ON "{schema}".recurring_occurrences'
            " DEFERRABLE INITIALLY DEFERRED FOR EACH ROW"
            f' EXECUTE FUNCTION "{schema}".slow_commit()'
        )
    finally:
        await conn.close()
    broker = MemoryBroker()
    try:
        with pytest.raises(RelayLeaseLostError, match="while its check committed"):
            await store.relay(lease, broker)
        assert broker.attempts == 0
    finally:
        await store.close()
