"""The SQLite journal: steeple's embedded default broker (extra ``steeple-brokers[sqlite]``).

One file in WAL mode with ``synchronous=FULL``: a publication that returned a receipt is on
disk and survives ``kill -9`` of the process. Message content is sealed with a
:class:`~steeple.core.ports.Sealer` (purpose ``"journal"``, identity = the idempotency key),
so the file holds no readable payloads. The idempotency key is ``UNIQUE``: a republication
under a key the journal still holds is reported as a duplicate and stores nothing. Rows are
kept for ``dedup_retention`` after publication (and until acknowledged), which must be at
least the delivery window the journal protects.

All SQL runs on one dedicated thread per journal with the standard library's ``sqlite3``:
each operation is one whole transaction in one call on that thread, so a cancelled or timed
out ``await`` can never leave a transaction half open on the connection.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import sqlite3
import struct
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import TypeVar

from steeple.brokers._common import (
    AsyncLifecycle,
    Delivery,
    check_dedup_window,
    check_key,
    check_message,
    check_size,
    check_timeout,
    encoded_size,
    positive_duration,
    publish_guarded,
)
from steeple.core import limits
from steeple.core.clock import SystemClock
from steeple.core.errors import (
    BrokerError,
    BrokerRejectedError,
    BrokerTimeoutError,
    BrokerUnavailableError,
    ConfigurationError,
    MessageTooLargeError,
)
from steeple.core.messages import BrokerReceipt, ScheduledMessage
from steeple.core.ports import Clock, Sealer
from steeple.core.sqlite_codes import SqliteFailure, sqlite_failure
from steeple.runtime.sqlitelock import retry_while_locked

__all__ = ["JOURNAL_PURPOSE", "SqliteJournalBroker"]

JOURNAL_PURPOSE = "journal"
"""Sealing purpose of journal content (identity = the idempotency key)."""

_T = TypeVar("_T")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS steeple_journal (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    idempotency_key TEXT NOT NULL UNIQUE,
    sealed BLOB NOT NULL,
    published_at REAL NOT NULL,
    visible_at REAL NOT NULL,
    delivery_count INTEGER NOT NULL DEFAULT 0,
    delivery_token TEXT,
    acknowledged_at REAL
);
CREATE INDEX IF NOT EXISTS steeple_journal_ready
    ON steeple_journal (visible_at, seq) WHERE acknowledged_at IS NULL;
CREATE INDEX IF NOT EXISTS steeple_journal_purgeable
    ON steeple_journal (published_at) WHERE acknowledged_at IS NOT NULL;
"""

_MAX_MESSAGE_BYTES = 256 * 1024


def _serialize(message: ScheduledMessage) -> bytes:
    meta = json.dumps(
        {"t": message.topic, "m": message.message_type, "h": dict(message.headers)},
        separators=(",", ":"),
    ).encode()
    return struct.pack(">I", len(meta)) + meta + message.payload


def _deserialize(raw: bytes) -> ScheduledMessage:
    (n,) = struct.unpack(">I", raw[:4])
    meta = json.loads(raw[4 : 4 + n])
    return ScheduledMessage(meta["t"], meta["m"], raw[4 + n :], meta["h"])


def _map_sqlite_error(exc: sqlite3.Error, what: str) -> BrokerError:
    """Return the broker error for a sqlite3 failure of ``what``.

    Which failure it was is :func:`steeple.core.sqlite_codes.sqlite_failure`'s to say.
    """
    failure = sqlite_failure(exc)
    if failure is SqliteFailure.TOO_BIG:
        # A value over the library's length limit: it will never fit.
        return MessageTooLargeError(f"sqlite journal: {what} failed: {exc}")
    if failure is SqliteFailure.CONSTRAINT:
        return BrokerRejectedError(f"sqlite journal: {what} was refused: {exc}")
    if failure is SqliteFailure.LOCKED:
        return BrokerTimeoutError(
            f"sqlite journal: {what} waited past the busy timeout for the write lock "
            "(another connection or process holds it); nothing was written",
        )
    return BrokerUnavailableError(f"sqlite journal: {what} failed: {exc}")


def _switch_to_wal(conn: sqlite3.Connection, deadline: float) -> str:
    """Switch the file to WAL (a no-op once it is); return the journal mode SQLite reports.

    While another connection holds the write lock of a file not yet in WAL mode (another
    journal opening the same new file, say), SQLite refuses the switch at once with
    "database is locked" instead of waiting for the busy timeout: retried here until it.
    """
    return retry_while_locked(
        lambda: str(conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]), deadline
    )


class SqliteJournalBroker(AsyncLifecycle):
    """A durable, deduplicating message journal in one SQLite file; also its consumer.

    Args:
        path: the journal file (created if missing).
        sealer: seals message content (a ``steeple.keyring.Keyring`` in production).
        namespace: sealing namespace, binding content to this journal.
        dedup_retention: how long a key is remembered after publication (default 7 days).
        required_window: the delivery window the journal must protect; a shorter
            ``dedup_retention`` is refused.
        busy_timeout: how long a write waits for another connection's lock.
        max_message_bytes: larger messages are refused for good.
        clock: the time source for visibility and retention.

    Raises:
        ConfigurationError: invalid arguments.
        BrokerConfigurationError: ``dedup_retention`` shorter than ``required_window``.
    """

    def __init__(
        self,
        path: str | Path,
        sealer: Sealer,
        *,
        namespace: str = "steeple",
        dedup_retention: timedelta = limits.MAX_DELIVERY_WINDOW,
        required_window: timedelta = limits.DEFAULT_DELIVERY_WINDOW,
        busy_timeout: timedelta = timedelta(seconds=5),
        max_message_bytes: int = _MAX_MESSAGE_BYTES,
        clock: Clock | None = None,
    ) -> None:
        self._path = Path(path)
        self._sealer = sealer
        if not isinstance(namespace, str) or not namespace:
            raise ConfigurationError("namespace must be a non-empty str")
        self._namespace = namespace
        self._retention = positive_duration(dedup_retention, "dedup_retention")
        positive_duration(required_window, "required_window")
        check_dedup_window(
            self._retention,
            required_window,
            broker="sqlite journal",
            what="dedup_retention",
            fix="Pass a dedup_retention at least as long as the delivery window.",
        )
        self._busy = positive_duration(busy_timeout, "busy_timeout")
        if (
            isinstance(max_message_bytes, bool)
            or not isinstance(max_message_bytes, int)
            or (max_message_bytes < 1)
        ):
            raise ConfigurationError("max_message_bytes must be a positive int")
        self._max_bytes = max_message_bytes
        self._clock: Clock = clock or SystemClock()
        self._executor: ThreadPoolExecutor | None = None
        self._conn: sqlite3.Connection | None = None
        self._closed = False

    def __repr__(self) -> str:
        return (
            f"SqliteJournalBroker(path={str(self._path)!r}, namespace={self._namespace!r}, "
            f"dedup_retention={self._retention}, open={self._conn is not None})"
        )

    @property
    def path(self) -> Path:
        """The journal file."""
        return self._path

    @property
    def dedup_retention(self) -> timedelta:
        """How long keys are remembered after publication."""
        return self._retention

    # --- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        """Open (and if needed create) the journal file. Idempotent.

        Raises:
            BrokerUnavailableError: the file cannot be opened, is not a database, or the
                file system refuses WAL mode.
            BrokerTimeoutError: another connection held the lock past the busy timeout.
        """
        if self._closed:
            raise BrokerUnavailableError("sqlite journal: this journal was closed")
        if self._conn is not None:
            return
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="steeple-j")
        await self._run(self._open_sync)

    async def close(self) -> None:
        """Close the connection and its thread. Idempotent."""
        self._closed = True
        executor, self._executor = self._executor, None
        if executor is None:
            return
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(executor, self._close_sync)
        finally:
            executor.shutdown(wait=False)

    # --- the port ---------------------------------------------------------------------------

    async def publish(
        self, message: ScheduledMessage, *, idempotency_key: str, timeout: float
    ) -> BrokerReceipt:
        """Append ``message`` under ``idempotency_key`` durably, or report the earlier copy.

        Raises:
            ConfigurationError: a bad key or timeout, or not a ScheduledMessage.
            MessageTooLargeError: the message exceeds ``max_message_bytes`` (permanent).
            BrokerRejectedError: a text field without a UTF-8 encoding (permanent).
            BrokerTimeoutError: the lock was held past the busy timeout, or the deadline
                passed (the write may still have committed: republish with the same key).
            BrokerUnavailableError: the file cannot be written.
            RelayAcknowledgementError: the write committed but its result was lost.
            steeple.core.errors.KeyringError: the sealer refused (e.g. its budget is spent).
        """
        key = check_key(idempotency_key)
        seconds = check_timeout(timeout)
        # Refused here: the journal's JSON would escape a lone surrogate and store it, and
        # every consumer would then fail to rebuild the message.
        check_message(message, "sqlite journal")
        check_size(encoded_size(message, key), self._max_bytes, "the sqlite journal")
        sealed = self._sealer.seal(
            _serialize(message),
            namespace=self._namespace,
            purpose=JOURNAL_PURPOSE,
            identity=key,
        )
        return await publish_guarded(
            prepare=self.start,
            broker="sqlite journal",
            key=key,
            timeout=seconds,
            transmit=lambda: self._transmit(key, sealed),
            probe=lambda: self.lookup(key),
        )

    async def _transmit(self, key: str, sealed: bytes) -> BrokerReceipt:
        now = self._clock.now().timestamp()
        return await self._run(lambda: self._append_sync(key, sealed, now))

    async def lookup(self, idempotency_key: str) -> BrokerReceipt | None:
        """Return the receipt of the message held under ``idempotency_key``, if any.

        Raises:
            BrokerUnavailableError: the file cannot be read.
        """
        await self.start()
        return await self._run(lambda: self._lookup_sync(idempotency_key))

    # --- the consumer -----------------------------------------------------------------------

    async def fetch(
        self, limit: int = 10, *, visibility_timeout: timedelta = timedelta(seconds=30)
    ) -> list[Delivery]:
        """Hand out up to ``limit`` unacknowledged messages, oldest first.

        A fetched message is invisible for ``visibility_timeout``; unless acknowledged by
        then, it is handed out again (with a new delivery id and a higher count).

        Raises:
            ConfigurationError: ``limit`` outside 1..1000 or a non-positive timeout.
            BrokerTimeoutError: the lock was held past the busy timeout.
            BrokerUnavailableError: the file cannot be read or written.
            steeple.core.errors.KeyringError: a row cannot be opened with the sealer.
        """
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= 1000:
            raise ConfigurationError("limit must be an int in 1..1000")
        vt = positive_duration(visibility_timeout, "visibility_timeout").total_seconds()
        await self.start()
        now = self._clock.now().timestamp()
        rows = await self._run(lambda: self._fetch_sync(limit, now, vt))
        out = []
        for seq, key, sealed, count, token in rows:
            plain = self._sealer.open(
                sealed, namespace=self._namespace, purpose=JOURNAL_PURPOSE, identity=key
            )
            out.append(Delivery(f"{seq}.{token}", key, _deserialize(plain), count))
        return out

    async def acknowledge(self, delivery_id: str) -> bool:
        """Mark a delivery done. False if unknown, already acknowledged, or handed out again.

        Raises:
            BrokerTimeoutError: the lock was held past the busy timeout.
            BrokerUnavailableError: the file cannot be written.
        """
        seq_text, _, token = delivery_id.partition(".")
        if not seq_text.isdigit() or not token:
            return False
        await self.start()
        now = self._clock.now().timestamp()
        return await self._run(lambda: self._ack_sync(int(seq_text), token, now))

    async def purge(self) -> int:
        """Delete acknowledged messages published longer than ``dedup_retention`` ago.

        Unacknowledged messages are kept, whatever their age. Returns how many were removed.

        Raises:
            BrokerTimeoutError: the lock was held past the busy timeout.
            BrokerUnavailableError: the file cannot be written.
        """
        await self.start()
        cutoff = self._clock.now().timestamp() - self._retention.total_seconds()
        return await self._run(lambda: self._purge_sync(cutoff))

    async def pending(self) -> int:
        """How many messages are not yet acknowledged.

        Raises:
            BrokerUnavailableError: the file cannot be read.
        """
        await self.start()
        return await self._run(self._pending_sync)

    # --- the thread's side ------------------------------------------------------------------

    async def _run(self, fn: Callable[[], _T]) -> _T:
        executor = self._executor
        if executor is None or self._closed:
            raise BrokerUnavailableError("sqlite journal: this journal was closed")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(executor, fn)

    def _open_sync(self) -> None:
        if self._conn is not None:
            return
        try:
            conn = sqlite3.connect(
                self._path,
                timeout=self._busy.total_seconds(),
                isolation_level=None,
                check_same_thread=False,
            )
        except sqlite3.Error as exc:
            raise BrokerUnavailableError(f"sqlite journal: cannot open the file: {exc}") from None
        try:
            conn.execute(f"PRAGMA busy_timeout = {int(self._busy.total_seconds() * 1000)}")
            mode = _switch_to_wal(conn, time.monotonic() + self._busy.total_seconds())
            if str(mode).lower() != "wal":
                raise BrokerUnavailableError(
                    f"sqlite journal: the file system refused WAL mode (got {mode!r})"
                )
            conn.execute("PRAGMA synchronous = FULL")
            conn.execute("PRAGMA foreign_keys = ON")
            conn.executescript("BEGIN IMMEDIATE;" + _SCHEMA + "COMMIT;")
        except sqlite3.Error as exc:
            conn.close()
            raise _map_sqlite_error(exc, "opening the journal") from None
        except BaseException:
            conn.close()
            raise
        self._conn = conn

    def _close_sync(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def _tx(self, what: str, body: Callable[[sqlite3.Connection], _T]) -> _T:
        conn = self._conn
        if conn is None:
            raise BrokerUnavailableError("sqlite journal: not open")
        try:
            conn.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as exc:
            raise _map_sqlite_error(exc, what) from None
        try:
            result = body(conn)
            conn.execute("COMMIT")
        except sqlite3.Error as exc:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise _map_sqlite_error(exc, what) from None
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        return result

    def _append_sync(self, key: str, sealed: bytes, now: float) -> BrokerReceipt:
        def body(conn: sqlite3.Connection) -> BrokerReceipt:
            row = conn.execute(
                "INSERT INTO steeple_journal (idempotency_key, sealed, published_at, visible_at)"
                " VALUES (?, ?, ?, ?) ON CONFLICT (idempotency_key) DO NOTHING RETURNING seq",
                (key, sealed, now, now),
            ).fetchone()
            if row is not None:
                return BrokerReceipt("sqlite", key, duplicate=False, location=str(row[0]))
            (seq,) = conn.execute(
                "SELECT seq FROM steeple_journal WHERE idempotency_key = ?", (key,)
            ).fetchone()
            return BrokerReceipt("sqlite", key, duplicate=True, location=str(seq))

        return self._tx("publishing", body)

    def _lookup_sync(self, key: str) -> BrokerReceipt | None:
        conn = self._conn
        if conn is None:
            raise BrokerUnavailableError("sqlite journal: not open")
        try:
            row = conn.execute(
                "SELECT seq FROM steeple_journal WHERE idempotency_key = ?", (key,)
            ).fetchone()
        except sqlite3.Error as exc:
            raise _map_sqlite_error(exc, "looking a key up") from None
        if row is None:
            return None
        return BrokerReceipt("sqlite", key, duplicate=True, location=str(row[0]))

    def _fetch_sync(
        self, limit: int, now: float, vt: float
    ) -> list[tuple[int, str, bytes, int, str]]:
        def body(conn: sqlite3.Connection) -> list[tuple[int, str, bytes, int, str]]:
            rows = conn.execute(
                "SELECT seq, idempotency_key, sealed, delivery_count FROM steeple_journal"
                " WHERE acknowledged_at IS NULL AND visible_at <= ? ORDER BY seq LIMIT ?",
                (now, limit),
            ).fetchall()
            out = []
            for seq, key, sealed, count in rows:
                token = secrets.token_hex(8)
                conn.execute(
                    "UPDATE steeple_journal SET visible_at = ?, delivery_count = ?,"
                    " delivery_token = ? WHERE seq = ?",
                    (now + vt, count + 1, token, seq),
                )
                out.append((seq, key, sealed, count + 1, token))
            return out

        return self._tx("fetching", body)

    def _ack_sync(self, seq: int, token: str, now: float) -> bool:
        def body(conn: sqlite3.Connection) -> bool:
            cur = conn.execute(
                "UPDATE steeple_journal SET acknowledged_at = ?, delivery_token = NULL"
                " WHERE seq = ? AND delivery_token = ? AND acknowledged_at IS NULL",
                (now, seq, token),
            )
            return cur.rowcount == 1

        return self._tx("acknowledging", body)

    def _purge_sync(self, cutoff: float) -> int:
        def body(conn: sqlite3.Connection) -> int:
            cur = conn.execute(
                "DELETE FROM steeple_journal WHERE acknowledged_at IS NOT NULL"
                " AND published_at < ?",
                (cutoff,),
            )
            return cur.rowcount

        return self._tx("purging", body)

    def _pending_sync(self) -> int:
        conn = self._conn
        if conn is None:
            raise BrokerUnavailableError("sqlite journal: not open")
        try:
            (n,) = conn.execute(
                "SELECT count(*) FROM steeple_journal WHERE acknowledged_at IS NULL"
            ).fetchone()
        except sqlite3.Error as exc:
            raise _map_sqlite_error(exc, "counting") from None
        return int(n)
