"""The SQLite store's file: creation, durability checks, refusals and typed failures.

Real files, real SQLite: a VFS that cannot do WAL, a file switched out of WAL, garbage
and a damaged page, a read-only and a full tmpfs, hostile paths.
"""

from __future__ import annotations

import asyncio
import base64
import os
import sqlite3
import stat
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from sqlite_support import (
    CONFIG,
    KEYRING,
    MESSAGE_TYPE,
    START,
    TOPIC,
    Mount,
    consistent,
    definition,
    integrity,
    query,
    remount,
)
from steeple.core.config import RecurringConfig
from steeple.core.errors import (
    RecurringConfigurationError,
    RecurringNotFoundError,
    RecurringSchemaVersionError,
    RecurringStorageError,
)
from steeple.core.leases import CLAIM_RULE
from steeple.core.occurrences import OccurrenceState
from steeple.keyring import Keyring, StorageKey
from steeple.sqlite import (
    SqliteCorruptionError,
    SqliteDiskFullError,
    SqliteDurabilityError,
    SqliteReadOnlyError,
    SqliteRecurringStore,
    SqliteStorageError,
    _sql,
)
from steeple.sqlite._file import open_database
from steeple.testing import FakeClock, MemoryBroker


def modes(directory: Path) -> dict[str, int]:
    """The permission bits of each file in ``directory``."""
    return {p.name: stat.S_IMODE(p.stat().st_mode) for p in directory.iterdir()}


def used(directory: Path) -> int:
    """Bytes in use on the file system holding ``directory``."""
    fs = os.statvfs(directory)
    return (fs.f_blocks - fs.f_bfree) * fs.f_frsize


def read_all(directory: Path) -> list[bytes]:
    """The bytes of every file in ``directory`` (the database, its -wal and -shm)."""
    return [p.read_bytes() for p in sorted(directory.iterdir())]


async def store_pragma(store: SqliteRecurringStore, pragma: str) -> Any:
    storage = store._storage
    return await storage.run(
        "peek", lambda call: storage.connection(call).execute(f"PRAGMA {pragma}").fetchone()[0]
    )


# --- creation and the checks at open ------------------------------------------------------


async def test_initialize_creates_an_owner_only_file_in_wal_with_synchronous_full(
    tmp_path: Path,
) -> None:
    path = tmp_path / "store.db"
    old = os.umask(0o022)
    try:
        store = await SqliteRecurringStore.initialize(path, CONFIG, KEYRING, FakeClock(START))
    finally:
        os.umask(old)
    async with store:
        await store.create(definition("a"))
        assert modes(tmp_path) == {"store.db": 0o600, "store.db-wal": 0o600, "store.db-shm": 0o600}
        assert await store_pragma(store, "journal_mode") == "wal"
        assert await store_pragma(store, "synchronous") == 2  # FULL
        assert store.warnings == []
        assert str(path) in repr(store)
        assert "payload" not in repr(store)
    assert integrity(path) == "ok"


async def test_initialize_is_idempotent_and_connect_shares_the_namespace(tmp_path: Path) -> None:
    path = tmp_path / "store.db"
    clock = FakeClock(START)
    async with await SqliteRecurringStore.initialize(path, CONFIG, KEYRING, clock) as first:
        await first.create(definition("a"))
    async with (
        await SqliteRecurringStore.initialize(path, CONFIG, KEYRING, clock) as again,
        await SqliteRecurringStore.connect(path, CONFIG, KEYRING, clock) as worker,
    ):
        assert [s.name for s in (await again.schedules()).items] == ["a"]
        assert (await worker.tick(100)).materialized == 10
        assert len((await again.occurrences()).items) == 10
    assert query(path, "SELECT count(*) FROM recurring_schema_version") == [(1,)]


async def test_twenty_concurrent_initializers_of_a_new_file_converge(tmp_path: Path) -> None:
    path = tmp_path / "new.db"
    clock = FakeClock(START)
    stores = await asyncio.gather(
        *(SqliteRecurringStore.initialize(path, CONFIG, KEYRING, clock) for _ in range(20))
    )
    try:
        await stores[0].create(definition("a"))
        for store in stores:
            assert [s.name for s in (await store.schedules()).items] == ["a"]
    finally:
        for store in stores:
            await store.close()
    assert query(path, "SELECT namespace FROM recurring_namespaces") == [(CONFIG.namespace,)]


async def test_a_new_file_another_connection_is_writing_is_initialized_once_it_is_free(
    tmp_path: Path,
) -> None:
    """SQLite refuses the switch to WAL at once ("database is locked", no busy wait) while
    another connection holds the write lock of a file not in WAL mode yet: initialize
    retries within its deadline."""
    path = tmp_path / "store.db"
    holder = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    holder.execute("BEGIN IMMEDIATE")
    try:
        opening = asyncio.create_task(
            SqliteRecurringStore.initialize(path, CONFIG, KEYRING, FakeClock(START))
        )
        await asyncio.sleep(0.3)  # long enough for the first attempt, which used to fail
        holder.execute("ROLLBACK")
        async with await opening as store:
            await store.create(definition("a"))
    finally:
        holder.close()
    assert query(path, "PRAGMA journal_mode") == [("wal",)]


INITIALIZER = """
import asyncio, sys, time
from datetime import UTC, datetime
from pathlib import Path
from steeple.core.config import RecurringConfig
from steeple.keyring import Keyring, StorageKey
from steeple.sqlite import SqliteRecurringStore
from steeple.testing import FakeClock

path, go = Path(sys.argv[1]), Path(sys.argv[2])
while not go.exists():  # every process opens the new file at the same moment
    time.sleep(0.001)

async def main():
    store = await SqliteRecurringStore.initialize(
        path,
        RecurringConfig("files", max_definitions=10, max_occurrences=10_000),
        Keyring(StorageKey("k1", b"\\x2a" * 32)),
        FakeClock(datetime(2031, 5, 17, 3, 14, 15, 926000, tzinfo=UTC)),
    )
    await store.close()

asyncio.run(main())
"""


@pytest.mark.timeout(120)
async def test_processes_opening_a_new_file_at_once_all_initialize_it(tmp_path: Path) -> None:
    """Concurrent first opens switch a new file to WAL without "database is locked"."""
    for round_ in range(5):
        path, go = tmp_path / f"new-{round_}.db", tmp_path / f"go-{round_}"
        procs = [
            subprocess.Popen(  # noqa: ASYNC220 - separate processes are the point
                [sys.executable, "-c", INITIALIZER, str(path), str(go)],
                stderr=subprocess.PIPE,
                text=True,
            )
            for _ in range(4)
        ]
        go.touch()
        for proc in procs:
            _, err = proc.communicate(timeout=60)
            assert proc.returncode == 0, err
        assert query(path, "PRAGMA journal_mode") == [("wal",)]
        assert query(path, "SELECT count(*) FROM recurring_namespaces") == [(1,)]


async def test_connect_never_creates_or_repairs(tmp_path: Path) -> None:
    clock = FakeClock(START)
    missing = tmp_path / "missing.db"
    with pytest.raises(RecurringStorageError, match="run initialize"):
        await SqliteRecurringStore.connect(missing, CONFIG, KEYRING, clock)
    assert modes(tmp_path) == {}

    foreign = tmp_path / "foreign.db"
    conn = sqlite3.connect(foreign)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("CREATE TABLE other (x)")
    conn.close()
    with pytest.raises(RecurringStorageError, match="holds no steeple recurring store"):
        await SqliteRecurringStore.connect(foreign, CONFIG, KEYRING, clock)
    assert query(foreign, "SELECT name FROM sqlite_schema") == [("other",)]

    path = tmp_path / "store.db"
    await (await SqliteRecurringStore.initialize(path, CONFIG, KEYRING, clock)).close()
    other = RecurringConfig("elsewhere", max_definitions=10, max_occurrences=10_000)
    with pytest.raises(RecurringNotFoundError, match="elsewhere"):
        await SqliteRecurringStore.connect(path, other, KEYRING, clock)
    assert query(path, "SELECT namespace FROM recurring_namespaces") == [("files",)]


async def test_a_different_configuration_or_keyring_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "store.db"
    clock = FakeClock(START)
    await (await SqliteRecurringStore.initialize(path, CONFIG, KEYRING, clock)).close()
    bigger = RecurringConfig("files", max_definitions=11, max_occurrences=10_000)
    other_keys = Keyring(StorageKey("k2", b"\x07" * 32))
    for config, keyring in ((bigger, KEYRING), (CONFIG, other_keys)):
        for opener in (SqliteRecurringStore.initialize, SqliteRecurringStore.connect):
            with pytest.raises(RecurringConfigurationError):
                await opener(path, config, keyring, clock)


async def test_another_schema_version_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "store.db"
    clock = FakeClock(START)
    await (await SqliteRecurringStore.initialize(path, CONFIG, KEYRING, clock)).close()
    conn = sqlite3.connect(path)
    conn.execute("UPDATE recurring_schema_version SET version = 99")
    conn.commit()
    conn.close()
    for opener in (SqliteRecurringStore.initialize, SqliteRecurringStore.connect):
        with pytest.raises(RecurringSchemaVersionError) as caught:
            await opener(path, CONFIG, KEYRING, clock)
        assert caught.value.found == 99
        assert caught.value.expected == _sql.SCHEMA_VERSION


def test_a_vfs_without_wal_is_refused(tmp_path: Path) -> None:
    """The dot-file locking VFS has no shared memory: WAL cannot be had, so no store."""
    with pytest.raises(SqliteDurabilityError, match="not 'wal'"):
        open_database(
            tmp_path / "x.db", create=True, deadline=time.monotonic() + 10, vfs="unix-dotfile"
        )


async def test_a_file_switched_out_of_wal_is_refused_by_connect_not_repaired(
    tmp_path: Path,
) -> None:
    path = tmp_path / "store.db"
    clock = FakeClock(START)
    await (await SqliteRecurringStore.initialize(path, CONFIG, KEYRING, clock)).close()
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA journal_mode = DELETE")
    conn.close()
    with pytest.raises(SqliteDurabilityError, match="run initialize"):
        await SqliteRecurringStore.connect(path, CONFIG, KEYRING, clock)
    assert query(path, "PRAGMA journal_mode") == [("delete",)]
    # initialize is the deployment step: it switches the file back.
    await (await SqliteRecurringStore.initialize(path, CONFIG, KEYRING, clock)).close()
    async with await SqliteRecurringStore.connect(path, CONFIG, KEYRING, clock) as store:
        assert await store_pragma(store, "journal_mode") == "wal"


async def test_a_file_that_is_not_a_database_is_refused_untouched(tmp_path: Path) -> None:
    path = tmp_path / "garbage.db"
    garbage = os.urandom(8192)
    path.write_bytes(garbage)
    for opener in (SqliteRecurringStore.initialize, SqliteRecurringStore.connect):
        with pytest.raises(SqliteCorruptionError, match="SQLITE_NOTADB") as caught:
            await opener(path, CONFIG, KEYRING, FakeClock(START))
        assert caught.value.sqlite_error == "SQLITE_NOTADB"
    assert path.read_bytes() == garbage


async def test_a_damaged_page_is_a_typed_corruption_error(tmp_path: Path) -> None:
    path = tmp_path / "store.db"
    clock = FakeClock(START)
    async with await SqliteRecurringStore.initialize(path, CONFIG, KEYRING, clock) as store:
        for i in range(5):
            await store.create(definition(f"d{i}", minutes_back=60, payload=os.urandom(2000)))
        while (await store.tick(100)).materialized:
            pass
    # Closing the last connection checkpointed the WAL into the file: damage the b-tree
    # page at the root of the occurrences table.
    [(page_size,)] = query(path, "PRAGMA page_size")
    [(root,)] = query(
        path, "SELECT rootpage FROM sqlite_schema WHERE name = 'recurring_occurrences'"
    )
    with path.open("r+b") as f:
        f.seek((root - 1) * page_size)
        f.write(b"\xff" * 64)
    async with await SqliteRecurringStore.connect(path, CONFIG, KEYRING, clock) as store:
        with pytest.raises(SqliteCorruptionError, match="restore it from a backup") as caught:
            await store.occurrences()
        assert caught.value.sqlite_error == "SQLITE_CORRUPT"
        assert isinstance(caught.value, RecurringStorageError)
        # The rest of the file still answers.
        assert len((await store.schedules()).items) == 5


# --- read-only and full file systems ----------------------------------------------------


LEAVE_WAL_BEHIND = """
import asyncio, os, sys
from datetime import UTC, datetime
from steeple.core.config import RecurringConfig
from steeple.keyring import Keyring, StorageKey
from steeple.sqlite import SqliteRecurringStore
from steeple.testing import FakeClock

async def main():
    await SqliteRecurringStore.initialize(
        sys.argv[1],
        RecurringConfig("files", max_definitions=10, max_occurrences=10_000),
        Keyring(StorageKey("k1", b"\\x2a" * 32)),
        FakeClock(datetime(2031, 5, 17, 3, 14, 15, 926000, tzinfo=UTC)),
    )
    os._exit(0)  # as a kill would: the -wal and -shm files stay

asyncio.run(main())
"""


async def test_a_read_only_file_system_is_refused_with_a_typed_error(tmpfs: Mount) -> None:
    clock = FakeClock(START)
    mount = tmpfs("4m")
    clean, crashed = mount / "clean.db", mount / "crashed.db"
    async with await SqliteRecurringStore.initialize(clean, CONFIG, KEYRING, clock) as store:
        await store.create(definition("a"))
    done = subprocess.run(  # noqa: ASYNC221 - a process that dies is the point
        [sys.executable, "-c", LEAVE_WAL_BEHIND, str(crashed)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert set(modes(mount)) >= {"crashed.db-wal", "crashed.db-shm"}
    remount(mount, "ro")
    try:
        # Without -shm the file cannot even be opened; with it, it opens and reads, and
        # the write probe finds out.
        for path in (clean, crashed):
            with pytest.raises(SqliteReadOnlyError, match="read-only"):
                await SqliteRecurringStore.connect(path, CONFIG, KEYRING, clock)
        with pytest.raises(SqliteReadOnlyError, match="read-only"):
            await SqliteRecurringStore.initialize(mount / "new.db", CONFIG, KEYRING, clock)
        assert not (mount / "new.db").exists()
    finally:
        remount(mount, "rw")
    async with await SqliteRecurringStore.connect(clean, CONFIG, KEYRING, clock) as store:
        assert [s.name for s in (await store.schedules()).items] == ["a"]


@pytest.mark.timeout(120)
async def test_a_full_file_system_fails_typed_and_loses_nothing(tmpfs: Mount) -> None:
    """Ticks of 100 large occurrences on a nearly full tmpfs: typed, all or nothing."""
    clock = FakeClock(START)
    size = 40 * 1024 * 1024  # 600 sealed 16 KiB contents are about 10 MB, plus the WAL
    mount = tmpfs(str(size))
    path = mount / "store.db"
    store = await SqliteRecurringStore.initialize(path, CONFIG, KEYRING, clock)
    try:
        for i in range(10):  # 10 x 60 occurrences of 16 KiB (sealed: incompressible)
            await store.create(definition(f"d{i}", minutes_back=60, payload=os.urandom(16384)))
        filler = mount / "filler"
        with filler.open("wb") as f:  # leave about 2.5 MB: one or two ticks fit
            f.write(b"\0" * (size - used(mount) - 2_500_000))
        materialized, failures = 0, []
        for _ in range(6):
            try:
                materialized += (await store.tick(100)).materialized
            except SqliteDiskFullError as exc:
                failures.append(exc)
        assert failures, "the disk never filled"
        assert all("full" in str(e) and e.sqlite_error == "SQLITE_FULL" for e in failures)
        assert materialized < 600
        assert integrity(path) == "ok"
        consistent(path)  # no partial tick: counters and cursors match the rows
        assert query(path, "SELECT count(*) FROM recurring_occurrences") == [(materialized,)]

        filler.unlink()
        while (result := await store.tick(100)).materialized:
            materialized += result.materialized
        assert materialized == 600
        consistent(path)
        broker = MemoryBroker()
        while leases := await store.claim(100):
            for lease in leases:
                await store.relay(lease, broker)
        assert len(broker.keys()) == 600
    finally:
        await store.close()
    assert integrity(path) == "ok"


# --- hostile input and what the file holds --------------------------------------------------


@pytest.mark.parametrize(
    "path",
    ["", ":memory:", "file:x.db?mode=memory", "x\x00.db", "\ud800.db", b"x.db", 42, None],
    ids=["empty", "memory", "uri", "nul", "surrogate", "bytes", "int", "none"],
)
async def test_hostile_paths_are_refused_and_nothing_is_created(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, path: object
) -> None:
    monkeypatch.chdir(tmp_path)
    for opener in (SqliteRecurringStore.initialize, SqliteRecurringStore.connect):
        with pytest.raises(RecurringConfigurationError):
            await opener(path, CONFIG, KEYRING, FakeClock(START))  # type: ignore[arg-type]
    assert modes(tmp_path) == {}


async def test_a_directory_or_a_missing_parent_is_a_storage_error(tmp_path: Path) -> None:
    for path in (tmp_path, tmp_path / "missing" / "store.db"):
        with pytest.raises(SqliteStorageError):
            await SqliteRecurringStore.initialize(path, CONFIG, KEYRING, FakeClock(START))


async def test_a_file_others_can_read_is_reported(tmp_path: Path) -> None:
    path = tmp_path / "store.db"
    clock = FakeClock(START)
    await (await SqliteRecurringStore.initialize(path, CONFIG, KEYRING, clock)).close()
    path.chmod(0o644)
    async with await SqliteRecurringStore.connect(path, CONFIG, KEYRING, clock) as store:
        [warning] = store.warnings
        assert "chmod 600" in warning


async def test_topics_types_headers_and_payloads_are_nowhere_in_the_files(tmp_path: Path) -> None:
    """Every byte of the database, its WAL, every column: only sealed content."""
    path = tmp_path / "store.db"
    payload = b"payload-that-must-stay-sealed"
    async with await SqliteRecurringStore.initialize(
        path, CONFIG, KEYRING, FakeClock(START)
    ) as store:
        await store.create(definition("visible-name", payload=payload))
        await store.tick(100)
        await store.claim(3)
        raw = b"".join(read_all(tmp_path))
        assert b"visible-name" in raw  # names are plaintext, so the search does find text
        secrets = [TOPIC.encode(), MESSAGE_TYPE.encode(), b"header-value", payload]
        for secret in secrets:
            for form in (secret, secret.hex().encode(), base64.b64encode(secret)):
                assert form not in raw, form


def test_claims_purges_and_ticks_walk_their_indexes(tmp_path: Path) -> None:
    """SQLite uses each partial index in order (no sort of every live occurrence)."""
    path = tmp_path / "plans.db"
    conn = sqlite3.connect(path)
    for statement in _sql.SCHEMA:
        conn.execute(statement)
    terminal = frozenset({OccurrenceState.PUBLISHED, OccurrenceState.EXPIRED})
    plans = {
        "recurring_occurrences_claimable": (_sql.claimable(CLAIM_RULE), ("n", 0, 100)),
        "recurring_occurrences_finished": (
            _sql.purge(terminal).split(" id IN (", 1)[1].rstrip(")"),
            ("n", 0, 100),
        ),
        "recurring_definitions_due": (_sql.DUE_DEFINITIONS, ("n", 0, 100)),
        "recurring_occurrences_windows": (_sql.window_ended(terminal), ("n", 0)),
    }
    for index, (statement, args) in plans.items():
        plan = " | ".join(row[-1] for row in conn.execute(f"EXPLAIN QUERY PLAN {statement}", args))
        assert index in plan, (index, plan)
        assert "TEMP B-TREE" not in plan, (index, plan)
    conn.close()


class _NaiveClock:
    """A clock that forgets its time zone (a common mistake: ``datetime.now()``)."""

    def __init__(self, aware: bool = False) -> None:
        self.aware = aware

    def now(self) -> datetime:
        reading = datetime(2031, 3, 4, 5, 6, 7)
        return reading.replace(tzinfo=UTC) if self.aware else reading


async def test_initialize_with_an_exhausted_seal_budget_raises_a_recurring_error(
    tmp_path: Path,
) -> None:
    from steeple.core.errors import RecurringError, SealBudgetExhaustedError

    spent = Keyring(StorageKey("k1", b"\x02" * 32), seal_budget=1, seal_counts={"k1": 1})
    with pytest.raises(RecurringError) as caught:
        await SqliteRecurringStore.initialize(tmp_path / "s.db", CONFIG, spent, FakeClock(START))
    assert isinstance(caught.value, SealBudgetExhaustedError)
    assert "rotate" in str(caught.value)


async def test_initialize_connect_and_operations_with_a_naive_clock_raise_recurring_errors(
    tmp_path: Path,
) -> None:
    path = tmp_path / "s.db"
    with pytest.raises(RecurringConfigurationError, match="timezone-aware"):
        await SqliteRecurringStore.initialize(path, CONFIG, KEYRING, _NaiveClock())
    clock = _NaiveClock(aware=True)
    store = await SqliteRecurringStore.initialize(path, CONFIG, KEYRING, clock)
    try:
        clock.aware = False
        with pytest.raises(RecurringConfigurationError, match="timezone-aware"):
            await store.tick(10)
        with pytest.raises(RecurringConfigurationError, match="timezone-aware"):
            await store.schedules()
    finally:
        await store.close()
    with pytest.raises(RecurringConfigurationError, match="timezone-aware"):
        await SqliteRecurringStore.connect(path, CONFIG, KEYRING, _NaiveClock())
