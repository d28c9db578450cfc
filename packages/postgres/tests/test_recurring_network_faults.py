"""Network faults between the store and PostgreSQL, through a small asyncio TCP proxy:
a blackholed connection hits the deadline and nothing hangs; a frozen holder of the
control row is ended by the server so the others proceed."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import asyncpg
import pytest

from faultproxy import dsn_via, open_pg, pg_endpoint
from steeple.core import (
    MissedRunPolicy,
    RecurringConfig,
    RecurringDeadlineError,
    RecurringDefinition,
    RecurringStorageError,
    ScheduledMessage,
)
from steeple.keyring import Keyring, StorageKey
from steeple.postgres import PostgresRecurringStore
from steeple.postgres.recurring import SERVER_SETTINGS
from steeple.testing import FakeClock

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

START = datetime(2031, 3, 4, 5, 6, 7, tzinfo=UTC)
KEYRING = Keyring(StorageKey("k1", b"\x09" * 32))
CONFIG = RecurringConfig("net", 10, 100)


class Proxy:
    """Forwards TCP to PostgreSQL; ``blackhole`` silently drops every byte both ways."""

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.blackhole = False
        self.cut_after: bytes | None = None
        """Forward a client chunk containing these bytes, then cut the connection."""
        self.cuts = 0
        self.muted = False
        self.server: asyncio.Server | None = None
        self.tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._client, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def _pipe(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        upstream: bool = False,
        other: asyncio.StreamWriter | None = None,
    ) -> None:
        try:
            while data := await reader.read(65536):
                cutting = upstream and self.cut_after is not None and self.cut_after in data
                if cutting:
                    self.muted = True  # the server's answer to this will be lost
                if not self.blackhole and (upstream or not self.muted):
                    writer.write(data)
                    await writer.drain()
                if upstream and self.cut_after is not None and self.cut_after in data:
                    self.cut_after = None
                    self.cuts += 1
                    await asyncio.sleep(0.2)  # the server commits; its answer is lost
                    if other is not None:
                        other.close()
                    self.muted = False
                    break
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await open_pg(*self.target)
        for task in (
            asyncio.create_task(self._pipe(reader, up_writer, True, writer)),
            asyncio.create_task(self._pipe(up_reader, writer)),
        ):
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for task in list(self.tasks):
            task.cancel()
        for task in list(self.tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task


@pytest.fixture
async def proxied(pg_schema: tuple[str, str]) -> AsyncIterator[tuple[str, str, Proxy]]:
    dsn, schema = pg_schema
    proxy = Proxy(*pg_endpoint(dsn))  # the test server itself, TCP or a Unix socket
    via = dsn_via(dsn, await proxy.start())
    try:
        yield via, schema, proxy
    finally:
        await proxy.close()


def definition(name: str) -> RecurringDefinition:
    return RecurringDefinition(
        name,
        "* * * * *",
        START - timedelta(minutes=5),
        MissedRunPolicy.CATCH_UP,
        ScheduledMessage("t", "m", b"p"),
    )


@pytest.mark.timeout(120)
async def test_blackholed_connection_hits_the_deadline_and_recovers(
    proxied: tuple[str, str, Proxy],
) -> None:
    via, schema, proxy = proxied
    store = await PostgresRecurringStore.initialize(
        via, CONFIG, KEYRING, FakeClock(START), schema=schema
    )
    try:
        await store.create(definition("a"))
        proxy.blackhole = True
        started = time.monotonic()
        with pytest.raises(RecurringDeadlineError):
            await store.tick(10)
        assert time.monotonic() - started < 12
        started = time.monotonic()
        with pytest.raises(RecurringStorageError):  # no hang on the next call either
            await store.schedules()
        assert time.monotonic() - started < 12
        proxy.blackhole = False
        result = None
        for _ in range(30):
            try:
                result = await store.tick(10)
                break
            except RecurringStorageError:
                await asyncio.sleep(0.2)
        assert result is not None
        assert result.materialized == 5
    finally:
        proxy.blackhole = False
        await store.close()


@pytest.mark.timeout(120)
async def test_frozen_holder_of_the_control_row_is_ended_by_the_server(
    pg_schema: tuple[str, str],
) -> None:
    dsn, schema = pg_schema
    store = await PostgresRecurringStore.initialize(
        dsn, CONFIG, KEYRING, FakeClock(START), schema=schema
    )
    # A worker that took the lock and then froze (SIGSTOP, a blocked event loop): its
    # session carries the store's settings, as a store's pooled connection does.
    frozen = await asyncpg.connect(dsn, server_settings=dict(SERVER_SETTINGS))
    try:
        await frozen.execute("BEGIN")
        await frozen.execute(
            f'SELECT * FROM "{schema}".recurring_namespaces WHERE namespace = $1 FOR UPDATE',
            "net",
        )
        started = time.monotonic()
        with pytest.raises(RecurringDeadlineError):
            await store.create(definition("a"))
        info = None
        while info is None and time.monotonic() - started < 40:
            with contextlib.suppress(RecurringDeadlineError):
                info = await store.create(definition("a"))
        assert info is not None, "the frozen session was never ended"
        assert time.monotonic() - started < 25  # 15 s idle-in-transaction limit + a wait
        with pytest.raises((asyncpg.PostgresError, asyncpg.InterfaceError, OSError)):
            await frozen.execute("COMMIT")  # its late work is refused
    finally:
        await frozen.close(timeout=5)
        await store.close()


async def test_ambiguous_commit_is_reported_and_rereading_finds_it(
    proxied: tuple[str, str, Proxy],
) -> None:
    """The link is cut right after COMMIT is forwarded: the caller gets a typed storage
    error, and re-reading (never assuming failure) shows the work was committed."""
    via, schema, proxy = proxied
    store = await PostgresRecurringStore.initialize(
        via, CONFIG, KEYRING, FakeClock(START), schema=schema
    )
    try:
        first = await store.create(definition("a"))
        proxy.cut_after = b"COMMIT"
        with pytest.raises(RecurringStorageError):
            await store.create(definition("b"))
        assert proxy.cuts == 1
        names = None
        for _ in range(20):
            try:
                names = [s.name for s in (await store.schedules()).items]
                break
            except RecurringStorageError:
                await asyncio.sleep(0.1)
        assert names == ["a", "b"]  # it was committed after all
        again = await store.create(definition("b"))  # the safe retry replays it
        assert again.name == "b"
        assert again.created_at == first.created_at
    finally:
        await store.close()
