"""The SQLite journal against real files and real processes (RELIABILITY rows 27, 28, 30)."""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from broker_support import BROKER_CHECKS, drain_deliveries, lose_next_ack, message, new_key
from steeple.brokers import Delivery
from steeple.brokers.sqlite import SqliteJournalBroker
from steeple.core.errors import (
    AuthenticationFailedError,
    BrokerConfigurationError,
    BrokerTimeoutError,
    BrokerUnavailableError,
    ConfigurationError,
    MessageTooLargeError,
)
from steeple.core.messages import ScheduledMessage
from steeple.keyring import Keyring, StorageKey

KEY = StorageKey("journal-test", bytes(range(32)))
OTHER = StorageKey("journal-test", bytes(range(1, 33)))


class StepClock:
    def __init__(self) -> None:
        self.at = datetime(2031, 3, 4, 5, 6, 7, 123000, tzinfo=UTC)

    def now(self) -> datetime:
        return self.at

    def advance(self, delta: timedelta) -> None:
        self.at += delta


class SqliteHarness:
    name = "sqlite"
    deduplicates = True
    recognises_lost_acknowledgement = True

    def __init__(self, path: Path) -> None:
        self.path = path
        self.brokers: list[SqliteJournalBroker] = []
        self.blocker: sqlite3.Connection | None = None

    def _new(self) -> SqliteJournalBroker:
        b = SqliteJournalBroker(
            self.path, Keyring(KEY), busy_timeout=timedelta(seconds=2), max_message_bytes=4096
        )
        self.brokers.append(b)
        return b

    async def make_broker(self) -> SqliteJournalBroker:
        b = self._new()
        await b.start()
        return b

    async def drain(self) -> list[tuple[str, ScheduledMessage]]:
        consumer = self.brokers[-1] if self.brokers else await self.make_broker()
        return await drain_deliveries(
            lambda: consumer.fetch(100), lambda d: consumer.acknowledge(d.delivery_id)
        )

    def too_large(self) -> ScheduledMessage:
        return message(0, size=8000)

    def lose_next_acknowledgement(self, broker: Any) -> None:
        lose_next_ack(broker)

    async def stall(self) -> None:
        # Another connection takes the write lock and keeps it: a busy journal.
        self.blocker = sqlite3.connect(self.path, isolation_level=None)
        self.blocker.execute("BEGIN IMMEDIATE")

    async def heal(self) -> None:
        if self.blocker is not None:
            self.blocker.execute("ROLLBACK")
            self.blocker.close()
            self.blocker = None

    async def restart(self, broker: Any) -> Any:
        # The journal's "server" is the process: close it and open the file afresh.
        await broker.close()
        return await self.make_broker()

    def secrets_in_config(self) -> list[str]:
        return [KEY.key.hex()]

    async def close(self) -> None:
        await self.heal()
        for b in self.brokers:
            await b.close()


@pytest.fixture
async def harness(tmp_path: Path) -> AsyncIterator[SqliteHarness]:
    h = SqliteHarness(tmp_path / "journal.db")
    try:
        yield h
    finally:
        await h.close()


@pytest.mark.parametrize("check", sorted(BROKER_CHECKS))
async def test_sqlite_journal_conformance(check: str, harness: SqliteHarness) -> None:
    await BROKER_CHECKS[check](harness)


@pytest.fixture
async def journal(tmp_path: Path) -> AsyncIterator[SqliteJournalBroker]:
    async with SqliteJournalBroker(tmp_path / "j.db", Keyring(KEY)) as j:
        yield j


async def test_file_is_wal_full_sync_and_holds_no_plaintext(
    journal: SqliteJournalBroker, tmp_path: Path
) -> None:
    secret = b"very-personal-payload-" * 20
    msg = ScheduledMessage("reminders", "reminder.requested", secret, {"email": "a@example.org"})
    await journal.publish(msg, idempotency_key=new_key(), timeout=5)
    conn = sqlite3.connect(tmp_path / "j.db")
    try:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        (sealed,) = conn.execute("SELECT sealed FROM steeple_journal").fetchone()
    finally:
        conn.close()
    assert b"very-personal" not in sealed
    assert b"example.org" not in sealed
    raw = (tmp_path / "j.db").read_bytes() + (tmp_path / "j.db-wal").read_bytes()
    assert b"very-personal" not in raw
    assert b"example.org" not in raw
    # synchronous is per connection: check the journal's own connection.
    assert journal._conn is not None
    assert journal._conn.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL


async def test_content_is_bound_to_the_key_and_the_journal_key(tmp_path: Path) -> None:
    path = tmp_path / "j.db"
    async with SqliteJournalBroker(path, Keyring(KEY)) as j:
        await j.publish(message(1), idempotency_key="k-1", timeout=5)
    # A journal opened with other key material cannot read it: authentication fails.
    async with SqliteJournalBroker(path, Keyring(OTHER)) as j:
        with pytest.raises(AuthenticationFailedError):
            await j.fetch(10)
    # Content moved to another key's row fails too (identity = idempotency key).
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute(
        "INSERT INTO steeple_journal (idempotency_key, sealed, published_at, visible_at)"
        " SELECT 'k-2', sealed, 0, 0 FROM steeple_journal WHERE idempotency_key='k-1'"
    )
    conn.execute("UPDATE steeple_journal SET acknowledged_at = 1 WHERE idempotency_key='k-1'")
    conn.close()
    async with SqliteJournalBroker(path, Keyring(KEY)) as j:
        with pytest.raises(AuthenticationFailedError):
            await j.fetch(10)


async def test_visibility_timeout_redelivers_and_fences_stale_acks(tmp_path: Path) -> None:
    clock = StepClock()
    async with SqliteJournalBroker(tmp_path / "j.db", Keyring(KEY), clock=clock) as j:
        key = new_key()
        await j.publish(message(1), idempotency_key=key, timeout=5)
        [first] = await j.fetch(10, visibility_timeout=timedelta(seconds=30))
        assert isinstance(first, Delivery)
        assert first.delivery_count == 1
        assert await j.fetch(10) == []  # invisible while leased
        clock.advance(timedelta(seconds=31))
        [second] = await j.fetch(10)
        assert second.idempotency_key == key
        assert second.delivery_count == 2
        assert second.delivery_id != first.delivery_id
        assert await j.acknowledge(first.delivery_id) is False  # handed out again since
        assert await j.acknowledge(second.delivery_id) is True
        assert await j.acknowledge(second.delivery_id) is False
        assert await j.acknowledge("garbage") is False
        clock.advance(timedelta(hours=1))
        assert await j.fetch(10) == []
        assert await j.pending() == 0


async def test_dedup_lasts_for_the_retention_then_purge_forgets(tmp_path: Path) -> None:
    clock = StepClock()
    retention = timedelta(days=1)
    async with SqliteJournalBroker(
        tmp_path / "j.db",
        Keyring(KEY),
        clock=clock,
        dedup_retention=retention,
        required_window=retention,
    ) as j:
        acked, unacked = new_key(), new_key()
        await j.publish(message(1), idempotency_key=acked, timeout=5)
        await j.publish(message(2), idempotency_key=unacked, timeout=5)
        [d1, _d2] = await j.fetch(10)
        assert await j.acknowledge(d1.delivery_id)
        clock.advance(retention - timedelta(seconds=1))
        assert await j.purge() == 0
        again = await j.publish(message(1), idempotency_key=acked, timeout=5)
        assert again.duplicate is True
        clock.advance(timedelta(seconds=2))
        assert await j.purge() == 1  # the acknowledged one; the unacknowledged one stays
        assert (await j.publish(message(2), idempotency_key=unacked, timeout=5)).duplicate
        # Past the retention the key is forgotten: this is the documented window end.
        assert (await j.publish(message(1), idempotency_key=acked, timeout=5)).duplicate is False


def test_retention_shorter_than_the_delivery_window_is_refused(tmp_path: Path) -> None:
    with pytest.raises(BrokerConfigurationError, match="shorter than the delivery window"):
        SqliteJournalBroker(
            tmp_path / "j.db",
            Keyring(KEY),
            dedup_retention=timedelta(hours=23),
            required_window=timedelta(days=1),
        )
    with pytest.raises(ConfigurationError):
        SqliteJournalBroker(tmp_path / "j.db", Keyring(KEY), dedup_retention=timedelta(0))
    with pytest.raises(ConfigurationError):
        SqliteJournalBroker(tmp_path / "j.db", Keyring(KEY), max_message_bytes=0)


async def test_oversized_limit_is_permanent(journal: SqliteJournalBroker) -> None:
    small = SqliteJournalBroker(journal.path, Keyring(KEY), max_message_bytes=200)
    try:
        with pytest.raises(MessageTooLargeError) as info:
            await small.publish(message(0, size=150), idempotency_key="k", timeout=5)
        assert info.value.permanent
    finally:
        await small.close()


async def test_not_a_database_is_unavailable(tmp_path: Path) -> None:
    path = tmp_path / "garbage.db"
    path.write_bytes(b"this is not sqlite at all" * 100)
    j = SqliteJournalBroker(path, Keyring(KEY))
    with pytest.raises(BrokerUnavailableError):
        await j.publish(message(), idempotency_key="k", timeout=5)
    await j.close()
    with pytest.raises(BrokerUnavailableError, match="closed"):
        await j.publish(message(), idempotency_key="k", timeout=5)


async def test_a_missing_directory_is_unavailable(tmp_path: Path) -> None:
    j = SqliteJournalBroker(tmp_path / "no" / "such" / "dir.db", Keyring(KEY))
    with pytest.raises(BrokerUnavailableError):
        await j.start()
    await j.close()


_LOCK_HOLDER = textwrap.dedent(
    """
    import sqlite3, sys, time
    conn = sqlite3.connect(sys.argv[1], isolation_level=None)
    conn.execute("BEGIN IMMEDIATE")
    conn.execute("INSERT INTO steeple_journal (idempotency_key, sealed, published_at,"
                 " visible_at) VALUES ('holder', x'00', 0, 0)")
    print("locked", flush=True)
    time.sleep(30)
    """
)


async def test_second_process_holding_the_write_lock_gives_a_typed_timeout(
    tmp_path: Path,
) -> None:
    path = tmp_path / "j.db"
    async with SqliteJournalBroker(
        path, Keyring(KEY), busy_timeout=timedelta(milliseconds=300)
    ) as j:
        holder = subprocess.Popen(  # noqa: ASYNC220 - a plain child process is the point
            [sys.executable, "-c", _LOCK_HOLDER, str(path)], stdout=subprocess.PIPE, text=True
        )
        try:
            assert holder.stdout is not None
            assert holder.stdout.readline().strip() == "locked"
            started = time.monotonic()
            with pytest.raises(BrokerTimeoutError, match=r"busy timeout|may have accepted"):
                await j.publish(message(1), idempotency_key="blocked", timeout=5)
            assert time.monotonic() - started < 3
            # The busy-timeout failure stored nothing and left the connection usable.
        finally:
            holder.kill()
            holder.wait()
        assert await j.lookup("blocked") is None
        receipt = await j.publish(message(1), idempotency_key="blocked", timeout=5)
        assert receipt.duplicate is False
        # The killed holder's uncommitted row is gone.
        assert await j.lookup("holder") is None


_WRITER = textwrap.dedent(
    """
    import asyncio, sys
    from steeple.brokers.sqlite import SqliteJournalBroker
    from steeple.core.messages import ScheduledMessage
    from steeple.keyring import Keyring, StorageKey

    async def main():
        key = StorageKey("journal-test", bytes(range(32)))
        async with SqliteJournalBroker(sys.argv[1], Keyring(key)) as j:
            i = 0
            while True:
                k = f"key-{i}"
                msg = ScheduledMessage("t", "m", (b"x" * 900) + str(i).encode())
                await j.publish(msg, idempotency_key=k, timeout=10)
                print(k, flush=True)
                i += 1

    asyncio.run(main())
    """
)


@pytest.mark.slow
async def test_kill_dash_nine_mid_write_loses_nothing_acknowledged(tmp_path: Path) -> None:
    path = tmp_path / "j.db"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    writer = subprocess.Popen(  # noqa: ASYNC220 - a plain child process is the point
        [sys.executable, "-c", _WRITER, str(path)], stdout=subprocess.PIPE, text=True, env=env
    )
    acknowledged: list[str] = []
    try:
        assert writer.stdout is not None
        while len(acknowledged) < 150:
            line = writer.stdout.readline()
            assert line, "the writer died before being killed"
            acknowledged.append(line.strip())
    finally:
        os.kill(writer.pid, signal.SIGKILL)
        writer.wait()
    assert writer.returncode == -signal.SIGKILL
    # The writer goes on while the 150th line is read and the signal travels: what it
    # printed meanwhile was acknowledged too (read it all, rather than hope there is none).
    assert writer.stdout is not None
    acknowledged += writer.stdout.read().split()
    conn = sqlite3.connect(path)
    try:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    finally:
        conn.close()
    async with SqliteJournalBroker(path, Keyring(KEY)) as j:
        for key in acknowledged:
            assert await j.lookup(key) is not None, key
        # Replay after reopening: every acknowledged key is a duplicate, nothing doubles.
        for i, key in enumerate(acknowledged[-5:]):
            n = len(acknowledged) - 5 + i
            msg = ScheduledMessage("t", "m", (b"x" * 900) + str(n).encode())
            assert (await j.publish(msg, idempotency_key=key, timeout=5)).duplicate
        total = await j.pending()
        assert len(acknowledged) <= total <= len(acknowledged) + 1
        delivered = []
        while batch := await j.fetch(1000):  # however far the writer got
            delivered += batch
        assert len({d.idempotency_key for d in delivered}) == len(delivered) == total
        by_key = {d.idempotency_key: d.message.payload for d in delivered}
        assert by_key["key-7"] == b"x" * 900 + b"7"


async def test_cancelled_publish_leaves_the_connection_clean(
    journal: SqliteJournalBroker,
) -> None:
    task = asyncio.create_task(journal.publish(message(1), idempotency_key="cancelled", timeout=5))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # Whatever the thread did, the next operations work and the key is held at most once.
    receipt = await journal.publish(message(1), idempotency_key="cancelled", timeout=5)
    assert receipt.idempotency_key == "cancelled"
    assert [d.idempotency_key for d in await journal.fetch(10)] == ["cancelled"]


def test_repr_shows_no_secret(tmp_path: Path) -> None:
    j = SqliteJournalBroker(tmp_path / "j.db", Keyring(KEY))
    assert KEY.key.hex() not in repr(j)
    assert "j.db" in repr(j)


async def test_two_journals_on_one_file_racing_on_one_key_store_one_row(tmp_path: Path) -> None:
    path = tmp_path / "j.db"
    journals = [SqliteJournalBroker(path, Keyring(KEY)) for _ in range(3)]
    try:
        # The race under test is the publication. Each journal is opened first, one after
        # the other: first opens of a fresh file racing each other are a different race
        # (SQLite answers the switch to WAL "database is locked" at once, without waiting
        # for the busy timeout), now retried by start and tested on its own below.
        for j in journals:
            await j.start()
        key = new_key()
        receipts = await asyncio.gather(
            *(
                j.publish(message(1), idempotency_key=key, timeout=10)
                for j in journals
                for _ in range(5)
            )
        )
        assert sum(not r.duplicate for r in receipts) == 1
        assert len({r.location for r in receipts}) == 1
        assert await journals[0].pending() == 1
    finally:
        for j in journals:
            await j.close()


async def test_a_new_file_another_connection_is_writing_is_opened_once_it_is_free(
    tmp_path: Path,
) -> None:
    """While another connection holds the write lock of a file not yet in WAL mode (as a
    second journal opening the same new file does), SQLite refuses the switch to WAL at
    once with "database is locked": start waits for the lock within its busy timeout."""
    path = tmp_path / "j.db"
    holder = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    holder.execute("BEGIN IMMEDIATE")
    journal = SqliteJournalBroker(path, Keyring(KEY))
    try:
        starting = asyncio.create_task(journal.start())
        # Long enough for the journal's first attempt, which used to fail at once.
        await asyncio.sleep(0.3)
        holder.execute("ROLLBACK")
        await starting
        receipt = await journal.publish(message(1), idempotency_key=new_key(), timeout=10)
        assert not receipt.duplicate
    finally:
        holder.close()
        await journal.close()
    assert sqlite3.connect(path).execute("PRAGMA journal_mode").fetchone() == ("wal",)
