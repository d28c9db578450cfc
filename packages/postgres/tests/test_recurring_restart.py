"""An actual PostgreSQL restart (pg_ctl -m immediate) in the middle of work, on a private
cluster. (Server-level durability settings: test_durability_real.py.)"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from steeple.core import (
    MissedRunPolicy,
    OccurrenceState,
    RecurringConfig,
    RecurringDefinition,
    RecurringStorageError,
    ScheduledMessage,
)
from steeple.core.errors import RelayAcknowledgementError
from steeple.core.messages import BrokerReceipt
from steeple.keyring import Keyring, StorageKey
from steeple.postgres import PostgresRecurringStore
from steeple.testing import FakeClock, MemoryBroker

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

START = datetime(2031, 3, 4, 5, 6, 7, 250000, tzinfo=UTC)
KEYRING = Keyring(StorageKey("k1", b"\x06" * 32))
CONFIG = RecurringConfig("restart", max_definitions=10, max_occurrences=1000)


def _pg_ctl(server: Any, *args: str) -> None:
    # pg_ctl is made at import time (one function per bundled binary): mypy cannot see it.
    from pgserver._commands import pg_ctl  # type: ignore[attr-defined]

    pg_ctl(list(args), pgdata=server.pgdata, user=server.system_user, timeout=30)


def crash(server: Any) -> None:
    _pg_ctl(server, "-m", "immediate", "-w", "stop")


def start(server: Any) -> None:
    with server._lock:
        server.ensure_postgres_running()


async def until_ok(call: Any, attempts: int = 50) -> Any:
    """Retry a store call across the restart: storage errors are typed, never hangs."""
    last: Exception | None = None
    for _ in range(attempts):
        try:
            return await call()
        except RecurringStorageError as exc:
            last = exc
            await asyncio.sleep(0.1)
    raise AssertionError(f"the store never recovered: {last!r}")


@pytest.mark.timeout(240)
async def test_restart_mid_work_survives_and_reclaims_with_same_key(private_pg: Any) -> None:
    dsn = private_pg.get_uri()
    clock = FakeClock(START)
    store = await PostgresRecurringStore.initialize(dsn, CONFIG, KEYRING, clock, schema="steeple")
    try:
        await store.create(
            RecurringDefinition(
                "minutely",
                "* * * * *",
                START - timedelta(minutes=50),
                MissedRunPolicy.CATCH_UP,
                ScheduledMessage("t", "m", b"payload"),
            )
        )
        assert (await store.tick(20)).materialized == 20
        leases = await store.claim(3)
        broker = MemoryBroker()
        await store.relay(leases[0], broker)  # published before the crash

        class CrashAfterAccept(MemoryBroker):
            """Accepts the message, then the database dies before the outcome is recorded."""

            async def publish(
                self, message: ScheduledMessage, *, idempotency_key: str, timeout: float
            ) -> BrokerReceipt:
                receipt = await broker.publish(
                    message, idempotency_key=idempotency_key, timeout=timeout
                )
                await asyncio.to_thread(crash, private_pg)
                return receipt

        with pytest.raises(RelayAcknowledgementError) as acknowledgement:
            await store.relay(leases[1], CrashAfterAccept())
        key_before_crash = broker.keys_attempted[-1]
        # accepted, then the database died: the receipt survives, the cause is typed
        assert acknowledgement.value.receipt.idempotency_key == key_before_crash
        assert isinstance(acknowledgement.value.__cause__, RecurringStorageError)
        # a tick racing the crash: afterwards all of its batch or none
        with pytest.raises(RecurringStorageError):
            await store.tick(30)
        await asyncio.to_thread(start, private_pg)
        assert private_pg.get_uri() == dsn

        page = await until_ok(lambda: store.occurrences(limit=100))
        assert len(page.items) == 20  # committed work survived; the failed tick left nothing
        by_id = {o.occurrence_id: o for o in page.items}
        assert by_id[leases[0].occurrence_id].state is OccurrenceState.PUBLISHED
        assert by_id[leases[1].occurrence_id].state is OccurrenceState.LEASED
        assert by_id[leases[1].occurrence_id].attempts == 1

        # the leases lapse; a new claim fences them with a new capability and revision
        clock.advance(timedelta(seconds=61))
        reclaimed = {lease.occurrence_id: lease for lease in await store.claim(100)}
        assert leases[1].occurrence_id in reclaimed
        assert leases[2].occurrence_id in reclaimed
        again = reclaimed[leases[1].occurrence_id]
        assert again.revision == leases[1].revision + 1
        assert again.capability != leases[1].capability
        receipt = await store.relay(again, broker)
        assert receipt.duplicate
        assert receipt.idempotency_key == key_before_crash
        for lease in reclaimed.values():
            if lease is not again:
                await store.relay(lease, broker)
        assert (await store.tick(100)).materialized == 31  # 30 left + the 05:07 one
        while batch := await store.claim(100):
            for lease in batch:
                await store.relay(lease, broker)
        final = await store.occurrences(limit=100)
        assert {o.state for o in final.items} == {OccurrenceState.PUBLISHED}
        keys = [k for _, k in broker.published]
        assert len(keys) == len(set(keys)) == 51
    finally:
        await store.close()
