"""The PostgreSQL recurring store behind a faulty network (RELIABILITY.md rows 3-7, 9).

The store's tables are created through the direct DSN; the store under test then
connects through a :class:`FaultProxy`. The server is inspected from the side, limited to
the backends that served the proxy's connections.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import attrs
import pytest

import faultprobe
from faultproxy import FaultProxy
from recurring_fault_support import store_behind_proxy
from steeple.core import (
    MissedRunPolicy,
    OccurrenceState,
    RecurringConfig,
    RecurringDeadlineError,
    RecurringDefinition,
    RecurringStorageError,
    ScheduledMessage,
)
from steeple.core.errors import RelayAcknowledgementError, RelayLeaseLostError
from steeple.core.idempotency import PUBLISH_PURPOSE, idempotency_key
from steeple.keyring import Keyring, StorageKey
from steeple.postgres import PostgresRecurringStore, grant_runtime_role
from steeple.postgres.recurring import SERVER_SETTINGS
from steeple.testing import FakeClock, MemoryBroker

pytestmark = [pytest.mark.postgres]

START = datetime(2031, 3, 4, 5, 6, 7, tzinfo=UTC)
KEYRING = Keyring(StorageKey("k1", b"\x07" * 32))
CONFIG = RecurringConfig("faults", 20, 2000)
# Nothing a fault test does may take longer than this; a hang fails the test.
BOUND = 30.0


def every_minute(name: str, minutes_back: int, payload: bytes = b"p") -> RecurringDefinition:
    return RecurringDefinition(
        name,
        "* * * * *",
        START - timedelta(minutes=minutes_back),
        MissedRunPolicy.CATCH_UP,
        ScheduledMessage("faults", "fault.tested", payload),
    )


@attrs.define
class Net:
    """One test's world: the direct DSN, the schema, the proxy and a store behind it."""

    dsn: str
    schema: str
    proxy: FaultProxy
    clock: FakeClock
    store: PostgresRecurringStore

    async def scalar(self, query: str, *args: Any) -> Any:
        conn = await asyncpg.connect(self.dsn, timeout=10)
        try:
            return await conn.fetchval(query.replace("{s}", f'"{self.schema}"'), *args)
        finally:
            await conn.close()

    async def rows(self, query: str, *args: Any) -> list[asyncpg.Record]:
        conn = await asyncpg.connect(self.dsn, timeout=10)
        try:
            return list(await conn.fetch(query.replace("{s}", f'"{self.schema}"'), *args))
        finally:
            await conn.close()

    async def counters_match(self) -> tuple[int, int]:
        """Assert the namespace's counters equal the rows stored; return them."""
        [row] = await self.rows(
            "SELECT definition_count, occurrence_count FROM {s}.recurring_namespaces"
        )
        definitions = await self.scalar("SELECT count(*) FROM {s}.recurring_definitions")
        occurrences = await self.scalar("SELECT count(*) FROM {s}.recurring_occurrences")
        assert (row["definition_count"], row["occurrence_count"]) == (definitions, occurrences)
        return definitions, occurrences

    async def clean(self, timeout: float = 5.0) -> None:
        """No backend that served the proxy holds a lock or idles in a transaction."""
        await faultprobe.wait_for_clean(self.dsn, self.proxy.backend_pids, timeout)

    async def drain_and_check(self, broker: MemoryBroker) -> None:
        """The checker: heal the network, let every lease lapse, publish everything.

        Then every occurrence is published, under the one key derived from its identity,
        exactly one copy per key reached the broker, no publish attempt ever used another
        key, and nothing is left held.
        """
        self.proxy.pass_through()
        self.clock.advance(CONFIG.lease_duration + timedelta(seconds=1))
        while leases := await self.store.claim(100):
            for lease in leases:
                await self.store.relay(lease, broker)
        rows = await self.rows(
            "SELECT id, definition_name, due_at, state FROM {s}.recurring_occurrences"
        )
        assert {r["state"] for r in rows} <= {"published"}
        expected = {
            idempotency_key(
                purpose=PUBLISH_PURPOSE,
                namespace=CONFIG.namespace,
                definition_name=r["definition_name"],
                due_at=r["due_at"],
                generation=bytes.fromhex(r["id"]),
            )
            for r in rows
        }
        keys = [key for _, key in broker.published]
        assert len(keys) == len(set(keys)) == len(rows)
        assert set(keys) == expected
        assert set(broker.keys_attempted) == expected
        await self.counters_match()
        await self.clean()


@pytest.fixture
async def net(pg_schema: tuple[str, str], fault_proxy: FaultProxy) -> AsyncIterator[Net]:
    dsn, schema = pg_schema
    clock = FakeClock(START)
    async with store_behind_proxy(dsn, schema, fault_proxy, CONFIG, KEYRING, clock) as store:
        yield Net(dsn, schema, fault_proxy, clock, store)


async def bounded(awaitable: Any, bound: float = BOUND) -> tuple[Any, float]:
    """Await ``awaitable``; return ``(result or raised exception, seconds)``.

    A call that outlives ``bound`` is reported as the string ``"hung"``.
    """
    started = time.monotonic()
    try:
        async with asyncio.timeout(bound):
            result = await awaitable
    except TimeoutError as exc:
        if isinstance(exc, RecurringStorageError):
            return exc, time.monotonic() - started
        return "hung", time.monotonic() - started
    except Exception as exc:
        return exc, time.monotonic() - started
    return result, time.monotonic() - started


# --- blackhole (row 5) and a control row held by a silent peer (row 9) -------------------


async def test_blackhole_mid_transaction_meets_the_deadline(net: Net) -> None:
    # The first create on this pooled connection sends select_definition's text; the
    # network dies when the server has answered it and waits, idle in the transaction
    # that holds the namespace's control row.
    net.proxy.blackhole_after(b", sealed FROM", at_reply=True)
    outcome, elapsed = await bounded(net.store.create(every_minute("m", 3)), bound=25)
    assert await faultprobe.idle_in_transaction(net.dsn, net.proxy.backend_pids)
    assert await faultprobe.locks_held(net.dsn, net.proxy.backend_pids)
    assert isinstance(outcome, RecurringDeadlineError), (outcome, elapsed)
    assert elapsed <= 12.0, elapsed
    # Still blackholed, the close never reaches the server: its own
    # idle_in_transaction_session_timeout ends the session and releases the lock.
    idle_timeout = int(SERVER_SETTINGS["idle_in_transaction_session_timeout"]) / 1000
    assert idle_timeout <= 60
    await net.clean(timeout=idle_timeout - elapsed + 3)
    net.proxy.pass_through()
    assert (await net.store.create(every_minute("m", 3))).name == "m"
    assert await net.counters_match() == (1, 0)


async def test_blackhole_holding_the_control_row(net: Net) -> None:
    """A blackholed peer holds the control row: a healthy instance gets a typed lock deadline,
    nothing partial is stored, and restoring the network releases every lock."""
    net.proxy.blackhole_after(b", sealed FROM")
    stuck = asyncio.create_task(net.store.create(every_minute("m", 3)))
    # wait until the server runs the blackholed transaction and holds the row lock
    deadline = time.monotonic() + 5
    while not any(
        "recurring_namespaces" in rel
        for _, _, rel in await faultprobe.locks_held(net.dsn, net.proxy.backend_pids)
    ):
        assert time.monotonic() < deadline, "the blackholed transaction never took the lock"
        await asyncio.sleep(0.05)
    healthy = await PostgresRecurringStore.connect(
        net.dsn, CONFIG, KEYRING, net.clock, schema=net.schema
    )
    try:
        outcome, elapsed = await bounded(healthy.create(every_minute("other", 3)))
        # lock_timeout (5 s), mapped to the typed deadline error, well within the call's 10 s
        assert isinstance(outcome, RecurringDeadlineError), outcome
        assert 4.0 <= elapsed <= 9.0, elapsed
        net.proxy.pass_through()
        # the stuck call ends (typed) once the network is back, and leaves nothing held
        result, _ = await bounded(stuck, bound=20)
        assert result != "hung"
        assert isinstance(result, RecurringStorageError) or result.name == "m", result
        await net.clean()
        # nothing partial: counters equal rows, and both instances work again
        await net.counters_match()
        assert (await healthy.create(every_minute("other", 3))).name == "other"
        assert (await net.store.create(every_minute("m", 3))).name == "m"
        assert await net.counters_match() == (2, 0)
    finally:
        await healthy.close()


async def test_blackholed_new_connections_time_out_typed(net: Net) -> None:
    await net.store.create(every_minute("m", 3))
    net.proxy.reset()  # the pool must open a new connection, into the blackhole
    await asyncio.sleep(0.05)
    net.proxy.blackhole()
    outcome, elapsed = await bounded(net.store.schedules())
    assert isinstance(outcome, RecurringDeadlineError), outcome
    assert elapsed <= 11.0, elapsed
    net.proxy.pass_through()
    page, _ = await bounded(net.store.schedules())
    assert [s.name for s in page.items] == ["m"]
    await net.clean()


# --- ambiguous COMMIT (row 4) ---------------------------------------------------------------


@pytest.mark.parametrize("commit", ["forwarded", "withheld"])
async def test_ambiguous_commit_on_initialize_converges(
    pg_schema: tuple[str, str], fault_proxy: FaultProxy, commit: str
) -> None:
    dsn, schema = pg_schema
    clock = FakeClock(START)
    if commit == "forwarded":
        fault_proxy.cut_after_commit()
    else:
        fault_proxy.cut_before_commit()
    first, _ = await bounded(
        PostgresRecurringStore.initialize(fault_proxy.dsn(), CONFIG, KEYRING, clock, schema=schema)
    )
    assert fault_proxy.commits_cut == 1
    assert isinstance(first, RecurringStorageError), first
    conn = await asyncpg.connect(dsn, timeout=10)
    try:
        installed = await conn.fetchval(
            "SELECT to_regclass($1) IS NOT NULL", f'"{schema}".recurring_namespaces'
        )
        namespaces = (
            await conn.fetchval(f'SELECT count(*) FROM "{schema}".recurring_namespaces')
            if installed
            else 0
        )
    finally:
        await conn.close()
    # the schema and the namespace come together or not at all
    assert (installed, namespaces) in ((True, 1), (False, 0))
    if commit == "withheld":
        assert not installed
    # initializing again converges, and the store works
    store = await PostgresRecurringStore.initialize(
        fault_proxy.dsn(), CONFIG, KEYRING, clock, schema=schema
    )
    try:
        assert (await store.create(every_minute("m", 2))).name == "m"
        assert (await store.tick(10)).materialized == 2
    finally:
        await store.close()
    await faultprobe.wait_for_clean(dsn, fault_proxy.backend_pids)


@pytest.mark.parametrize("commit", ["forwarded", "withheld"])
async def test_ambiguous_commit_on_create_rereads_and_converges(net: Net, commit: str) -> None:
    definition = every_minute("m", 3)
    if commit == "forwarded":
        net.proxy.cut_after_commit()
    else:
        net.proxy.cut_before_commit()
    outcome, _ = await bounded(net.store.create(definition))
    assert net.proxy.commits_cut == 1
    assert isinstance(outcome, RecurringStorageError), outcome
    await net.clean()
    # re-read, never assume: the definition is wholly there or wholly absent
    stored = await net.rows("SELECT name, created_at, cursor_at FROM {s}.recurring_definitions")
    definitions, _ = await net.counters_match()
    assert definitions == len(stored) <= 1
    if commit == "withheld":
        assert stored == []  # the server never saw the COMMIT
    replay = await net.store.create(definition)
    again = await net.store.create(definition)
    assert replay == again
    if stored:
        # the first, unacknowledged create is the one that counts
        assert replay.created_at == stored[0]["created_at"]
    assert await net.counters_match() == (1, 0)


@pytest.mark.parametrize("commit", ["forwarded", "withheld"])
async def test_ambiguous_commit_on_tick_is_all_or_nothing(net: Net, commit: str) -> None:
    for name in ("a", "b"):
        await net.store.create(every_minute(name, 30))
    if commit == "forwarded":
        net.proxy.cut_after_commit()
    else:
        net.proxy.cut_before_commit()
    outcome, _ = await bounded(net.store.tick(40))
    assert isinstance(outcome, RecurringStorageError), outcome
    await net.clean()
    _, occurrences = await net.counters_match()
    assert occurrences in (0, 40)
    assert occurrences == (40 if commit == "forwarded" and occurrences else 0)
    # a retry converges on exactly the 60 due occurrences, each once
    total = occurrences
    while (result := await net.store.tick(40)).materialized:
        total += result.materialized
    assert total == 60
    distinct = await net.scalar(
        "SELECT count(DISTINCT (definition_name, due_at)) FROM {s}.recurring_occurrences"
    )
    assert distinct == 60
    assert await net.counters_match() == (2, 60)
    await net.drain_and_check(MemoryBroker())


async def test_ambiguous_commit_of_a_relay_outcome_converges_on_one_copy(net: Net) -> None:
    await net.store.create(every_minute("m", 1))
    await net.store.tick(10)
    [lease] = await net.store.claim(1)
    broker = MemoryBroker()
    # relay commits twice: the live-lease check, then the outcome; cut at the second
    net.proxy.cut_after_commit(skip=1)
    outcome, _ = await bounded(net.store.relay(lease, broker))
    assert net.proxy.commits_cut == 1
    # accepted, then the outcome's COMMIT went unanswered: the acknowledgement error
    # carries the receipt, the storage error is its cause (seed 000, issue 11)
    assert isinstance(outcome, RelayAcknowledgementError), outcome
    assert outcome.receipt.idempotency_key == broker.keys()[0]
    assert isinstance(outcome.__cause__, RecurringStorageError), outcome.__cause__
    assert len(broker.published) == 1
    await net.clean()
    [occ] = (await net.store.occurrences()).items
    assert occ.state in (OccurrenceState.PUBLISHED, OccurrenceState.LEASED)
    # the worker retries with the lease it holds: republished under the same key, or
    # told that the occurrence moved on (the outcome was recorded after all)
    retried, _ = await bounded(net.store.relay(lease, broker))
    if occ.state is OccurrenceState.LEASED:
        assert retried.duplicate
    else:
        assert isinstance(retried, RelayLeaseLostError), retried
    [occ] = (await net.store.occurrences()).items
    assert occ.state is OccurrenceState.PUBLISHED
    assert len(broker.published) == 1
    assert len(set(broker.keys_attempted)) == 1
    await net.drain_and_check(broker)


# --- reset and pg_terminate_backend mid-operation (rows 3, 4) ---------------------------------


async def test_reset_mid_tick_is_typed_then_recovers(net: Net) -> None:
    await net.store.create(every_minute("m", 50))
    net.proxy.delay(0.05)  # each round trip 0.1 s: the reset lands inside the transaction
    task = asyncio.create_task(net.store.tick(50))
    await asyncio.sleep(0.35)
    net.proxy.reset()
    outcome, _ = await bounded(task)
    assert isinstance(outcome, RecurringStorageError), outcome
    net.proxy.pass_through()
    await net.clean()
    _, occurrences = await net.counters_match()
    assert occurrences in (0, 50)
    # the next call works on a fresh connection and completes the batch
    if occurrences == 0:
        assert (await net.store.tick(50)).materialized == 50
    assert await net.counters_match() == (1, 50)
    await net.drain_and_check(MemoryBroker())


async def test_terminated_backend_mid_claim_is_typed_then_recovers(net: Net) -> None:
    await net.store.create(every_minute("m", 20))
    await net.store.tick(50)
    net.proxy.delay(0.05)
    task = asyncio.create_task(net.store.claim(20))
    await asyncio.sleep(0.35)
    assert await faultprobe.terminate(net.dsn, net.proxy.live_backend_pids) >= 1
    outcome, _ = await bounded(task)
    assert isinstance(outcome, RecurringStorageError), outcome
    net.proxy.pass_through()
    await net.clean()
    leased = await net.scalar(
        "SELECT count(*) FROM {s}.recurring_occurrences WHERE state = 'leased'"
    )
    assert leased == 0  # the claim died before its commit: nothing leased
    leases = await net.store.claim(20)
    assert len(leases) == 20
    await net.drain_and_check(MemoryBroker())


async def test_terminated_backend_mid_relay_is_typed_then_relays_once(net: Net) -> None:
    await net.store.create(every_minute("m", 1))
    await net.store.tick(10)
    [lease] = await net.store.claim(1)
    broker = MemoryBroker()
    net.proxy.delay(0.05)  # the live-lease check takes about six round trips
    task = asyncio.create_task(net.store.relay(lease, broker))
    await asyncio.sleep(0.25)
    assert await faultprobe.terminate(net.dsn, net.proxy.live_backend_pids) >= 1
    outcome, _ = await bounded(task)
    assert isinstance(outcome, RecurringStorageError), outcome
    assert broker.attempts == 0  # it died before publishing
    net.proxy.pass_through()
    await net.clean()
    # the lease is still live and still this worker's: the retry publishes, once
    receipt = await net.store.relay(lease, broker)
    assert not receipt.duplicate
    await net.drain_and_check(broker)


async def test_pooled_connections_killed_while_idle_are_typed_then_replaced(net: Net) -> None:
    """Backends terminated while the pool holds them idle, their close slower than their
    FATAL message: calls fail typed (or retry onto a fresh connection), never untyped."""
    await net.store.create(every_minute("m", 3))
    await asyncio.gather(*(net.store.schedules() for _ in range(4)))  # fill the pool
    net.proxy.delay_close(0.5)
    assert await faultprobe.terminate(net.dsn, net.proxy.live_backend_pids) >= 1
    await asyncio.sleep(0.05)  # the FATAL messages arrive; the sockets still look open
    outcomes: list[Any] = []
    for _ in range(6):
        result, _ = await bounded(net.store.create(every_minute("m", 3)))
        outcomes.append(result)
    for result in outcomes:
        assert isinstance(result, RecurringStorageError) or result.name == "m", repr(result)
    assert not isinstance(outcomes[-1], BaseException), outcomes
    net.proxy.delay_close(0)
    assert await net.counters_match() == (1, 0)
    await net.clean()


async def test_reset_between_publish_and_record_republishes_with_same_key(net: Net) -> None:
    await net.store.create(every_minute("m", 1))
    await net.store.tick(10)
    [lease] = await net.store.claim(1)
    proxy = net.proxy

    class CuttingBroker(MemoryBroker):
        async def publish(self, message: Any, *, idempotency_key: str, timeout: float) -> Any:
            receipt = await super().publish(
                message, idempotency_key=idempotency_key, timeout=timeout
            )
            if self.attempts == 1:
                # the outcome's transaction gets its BEGIN through and dies at its first
                # statement (a BEGIN that fails is retried on a fresh connection)
                proxy.cut_at_client_chunk(2)
            return receipt

    broker = CuttingBroker()
    outcome, _ = await bounded(net.store.relay(lease, broker))
    assert proxy.cuts == 1
    assert isinstance(outcome, RelayAcknowledgementError), outcome
    assert outcome.receipt.idempotency_key == broker.keys()[0]
    assert isinstance(outcome.__cause__, RecurringStorageError), outcome.__cause__
    [occ] = (await net.store.occurrences()).items
    assert occ.state is OccurrenceState.LEASED  # accepted by the broker, not recorded
    receipt = await net.store.relay(lease, broker)
    assert receipt.duplicate
    [occ] = (await net.store.occurrences()).items
    assert occ.state is OccurrenceState.PUBLISHED
    assert len(broker.published) == 1
    assert len(set(broker.keys_attempted)) == 1
    await net.drain_and_check(broker)


# --- slow network (row 6) ----------------------------------------------------------------------


async def test_slow_network_completes_and_fences_a_stale_lease(net: Net) -> None:
    store, clock = net.store, net.clock
    await store.create(every_minute("m", 2))
    await store.tick(10)
    [stale] = await store.claim(1)
    broker = MemoryBroker()
    net.proxy.delay(0.15)  # 0.3 s per round trip, about ten round trips per call
    # the lease outlives its expiry (the clock moves on while the network is slow) and a
    # new claim fences it
    clock.advance(timedelta(seconds=61))
    fresh, elapsed = await bounded(store.claim(1))
    assert elapsed < 10.0
    [fresh] = fresh
    assert fresh.occurrence_id == stale.occurrence_id
    assert fresh.revision == stale.revision + 1
    outcome, _ = await bounded(store.relay(stale, broker))
    assert isinstance(outcome, RelayLeaseLostError), outcome
    assert broker.attempts == 0
    receipt, elapsed = await bounded(store.relay(fresh, broker))
    assert not isinstance(receipt, BaseException), receipt
    assert not receipt.duplicate
    assert elapsed < 10.0
    net.proxy.pass_through()
    states = sorted(o.state.value for o in (await store.occurrences()).items)
    assert states == ["pending", "published"]
    await net.drain_and_check(broker)


async def test_very_slow_network_meets_the_deadline_all_or_nothing(net: Net) -> None:
    await net.store.create(every_minute("m", 50))
    net.proxy.delay(1.0)  # 2 s per round trip: a tick cannot finish in its 10 s
    outcome, elapsed = await bounded(net.store.tick(50))
    assert isinstance(outcome, RecurringDeadlineError), outcome
    assert elapsed <= 12.0, elapsed
    net.proxy.pass_through()
    await net.clean()
    # the deadline may have passed with the COMMIT in flight: re-read, whole or nothing
    _, occurrences = await net.counters_match()
    assert occurrences in (0, 50)
    while (await net.store.tick(50)).materialized:
        pass
    assert await net.counters_match() == (1, 50)
    await net.drain_and_check(MemoryBroker())


# --- connection limit lower than the pool (row 7) ----------------------------------------------


async def test_connection_limit_below_the_pool_is_typed_back_pressure(
    net: Net, pg_name: Callable[[str], str]
) -> None:
    role = pg_name("steeple_cl")
    admin = await asyncpg.connect(net.dsn, timeout=10)
    try:
        await admin.execute(f'CREATE ROLE "{role}" LOGIN CONNECTION LIMIT 1')
        await grant_runtime_role(admin, role, net.schema)
        limited = await PostgresRecurringStore.connect(
            net.proxy.dsn(user=role), CONFIG, KEYRING, net.clock, schema=net.schema
        )
        try:
            await limited.create(every_minute("m", 3))
            before = net.proxy.accepted
            started = time.monotonic()
            async with asyncio.timeout(BOUND):
                results = await asyncio.gather(
                    *(limited.schedules() for _ in range(8)), return_exceptions=True
                )
            elapsed = time.monotonic() - started
            errors = [r for r in results if isinstance(r, BaseException)]
            assert errors, "eight concurrent calls on one allowed connection all succeeded"
            for error in errors:
                assert isinstance(error, RecurringStorageError), repr(error)
            assert any("53300" in str(e) for e in errors), [str(e) for e in errors]
            assert all(len(r.items) == 1 for r in results if not isinstance(r, BaseException))
            assert elapsed < 11.0, elapsed
            # no reconnect storm: at most one connection attempt per refused call
            assert net.proxy.accepted - before <= len(errors)
            sessions = await admin.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE usename = $1", role
            )
            assert sessions <= 1
            # the one connection keeps serving, one call at a time
            for _ in range(5):
                assert len((await limited.schedules()).items) == 1
        finally:
            async with asyncio.timeout(10):
                await limited.close()
    finally:
        await admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = $1", role
        )
        await admin.execute(f'DROP OWNED BY "{role}"; DROP ROLE "{role}"')
        await admin.close()
