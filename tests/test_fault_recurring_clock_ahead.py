"""Relay hosts whose clocks run ahead of the database server's, for real (libfaketime).

Two relay processes share one PostgreSQL namespace; one of them runs on a wall clock
offset by libfaketime (``faketime_support``). The database server runs on the real clock,
as does the other host. Every publication is written by the processes' broker into a
table with the server's ``clock_timestamp()``, so the checks are by the server's clock:

- a host an hour ahead is refused (a ``RecurringClockError`` naming the skew), never
  materializes, publishes or records anything, and the correct host goes on;
- pairs whose clocks differ by 3 s either way, with 1 s leases, work normally;
- a host whose clock flips between the real time and an hour ahead is refused on every
  flip ahead and works again on every flip back; the correct host is never refused.

After each: nothing was published before its due time by the server's clock (beyond the
5 s a host may be ahead), the recorded time and every occurrence's due time are within 5 s
of the server's clock, and every occurrence due was published.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg
import pytest

import faketime_support
from faketime_support import SteppedClock
from steeple.core import MissedRunPolicy, RecurringConfig, ScheduledMessage, SystemClock
from steeple.core.config import RecurringDefinition
from steeple.core.idempotency import PUBLISH_PURPOSE, idempotency_key
from steeple.keyring import Keyring, StorageKey
from steeple.postgres import PostgresRecurringStore

pytestmark = [pytest.mark.postgres]

KEY = b"\x0d" * 32
CONFIG = RecurringConfig(
    "clock", 10, 1000, lease_duration=timedelta(seconds=1), delivery_window=timedelta(hours=2)
)
BOUND = timedelta(seconds=5)
WAIT = 60.0  # bounds a hang only; every wait is on state

RELAY_SCRIPT = """
import asyncio, signal, sys
from datetime import timedelta
import asyncpg
from steeple.core import RecurringConfig, SystemClock
from steeple.core.errors import RecurringClockError
from steeple.core.messages import BrokerReceipt
from steeple.keyring import Keyring, StorageKey
from steeple.postgres import PostgresRecurringStore, RecurringRelay

CONFIG = RecurringConfig(
    "clock", 10, 1000, lease_duration=timedelta(seconds=1), delivery_window=timedelta(hours=2)
)

class TableBroker:
    # Every publication is a row stamped with the server's clock.
    def __init__(self, conn, schema, host):
        self.conn, self.schema, self.host = conn, schema, host
        self.lock = asyncio.Lock()  # publications run concurrently; one connection

    async def publish(self, message, *, idempotency_key, timeout):
        async with self.lock:
            await self.conn.execute(
                f'INSERT INTO "{self.schema}".published (key, host) VALUES ($1, $2)',
                idempotency_key, self.host,
            )
        return BrokerReceipt("table", idempotency_key)

async def pause(stop, seconds):
    try:
        async with asyncio.timeout(seconds):
            await stop.wait()
    except TimeoutError:
        pass

async def main():
    dsn, schema, host = sys.argv[1:4]
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    keyring = Keyring(StorageKey("k1", b"\\x0d" * 32))
    store = None
    while store is None and not stop.is_set():
        try:
            store = await PostgresRecurringStore.connect(
                dsn, CONFIG, keyring, SystemClock(), schema=schema
            )
        except RecurringClockError as exc:
            print("refused", exc, flush=True)
            await pause(stop, 0.2)
    if store is None:
        return
    conn = await asyncpg.connect(dsn)
    relay = RecurringRelay(store, TableBroker(conn, schema, host), claim_limit=10)
    print("ready", flush=True)
    async with store:
        while not stop.is_set():
            try:
                print("round", await relay.run_once(stop), flush=True)
            except RecurringClockError as exc:
                print("refused", exc, flush=True)
            await pause(stop, 0.1)
    await conn.close()

asyncio.run(main())
"""


def _faketime() -> str:
    library = faketime_support.libfaketime()
    if library is None:
        message = "libfaketime is not installed (apt-get install faketime)"
        if os.environ.get("CI", "").lower() in {"1", "true", "yes"}:
            pytest.fail(f"{message}, and under CI=true that is a failure")
        pytest.skip(message)
    return library


@pytest.fixture
def clocks() -> Iterator[Callable[[str], SteppedClock]]:
    """Makes libfaketime control files (one per host) in a fresh directory."""
    library = _faketime()
    with tempfile.TemporaryDirectory(prefix="steeple-faketime-") as directory:
        yield lambda name: SteppedClock(Path(directory) / name, library)


class Host:
    """A relay process; its output lines are collected as they come."""

    def __init__(self, name: str, proc: asyncio.subprocess.Process) -> None:
        self.name = name
        self.proc = proc
        self.lines: list[str] = []
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        async for raw in self.proc.stdout:
            self.lines.append(raw.decode().rstrip("\n"))

    def refusals(self) -> list[str]:
        return [line for line in self.lines if line.startswith("refused")]

    def rounds(self) -> int:
        return sum(line.startswith("round") for line in self.lines)

    async def until(self, what: str, done: Callable[[], bool]) -> None:
        async with asyncio.timeout(WAIT):
            while not done():
                if self.proc.returncode is not None:
                    raise AssertionError(f"{self.name} exited: {self.lines[-5:]}")
                await asyncio.sleep(0.05)
        del what

    async def stop(self) -> None:
        if self.proc.returncode is None:
            self.proc.terminate()
            try:
                await asyncio.wait_for(self.proc.wait(), 30)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        await self._reader


@contextlib.asynccontextmanager
async def hosts(
    dsn: str, schema: str, *clocks: tuple[str, SteppedClock]
) -> AsyncIterator[list[Host]]:
    started: list[Host] = []
    try:
        for name, clock in clocks:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-c", RELAY_SCRIPT, dsn, schema, name,
                stdout=asyncio.subprocess.PIPE, env=clock.env(),
            )  # fmt: skip
            started.append(Host(name, proc))
        yield started
    finally:
        for host in started:
            await host.stop()


async def _namespace(dsn: str, schema: str, first_after: timedelta) -> asyncpg.Connection:
    """Initialize the namespace on the real clock, with one every-minute definition whose
    first occurrence is ``first_after`` ago; create the publications table."""
    conn = await asyncpg.connect(dsn, timeout=30)
    server_now: datetime = await conn.fetchval("SELECT clock_timestamp()")
    keyring = Keyring(StorageKey("k1", KEY))
    store = await PostgresRecurringStore.initialize(
        dsn, CONFIG, keyring, SystemClock(), schema=schema
    )
    async with store:
        await store.create(
            RecurringDefinition(
                "minutely",
                "* * * * *",
                server_now - first_after,
                MissedRunPolicy.CATCH_UP,
                ScheduledMessage("clock.topic", "clock.tick", b"tick"),
            )
        )
    await conn.execute(
        f'CREATE TABLE "{schema}".published (key text NOT NULL, host text NOT NULL,'
        " at timestamptz NOT NULL DEFAULT clock_timestamp())"
    )
    return conn


async def _due_by_server(conn: asyncpg.Connection) -> datetime:
    return await conn.fetchval("SELECT clock_timestamp()")  # type: ignore[no-any-return]


async def _check(conn: asyncpg.Connection, schema: str, ahead: timedelta) -> dict[str, Any]:
    """The checks every test ends with, by the server's clock; returns what was seen.

    ``ahead``: how far ahead of the server a publication may be (0 with only hosts on the
    server's clock publishing).
    """
    server_now = await _due_by_server(conn)
    recorded = await conn.fetchval(f'SELECT recorded_time FROM "{schema}".recurring_namespaces')
    assert recorded <= server_now + BOUND, (recorded, server_now)
    rows = await conn.fetch(
        f'SELECT id, definition_name, due_at FROM "{schema}".recurring_occurrences'
    )
    assert rows, "nothing was materialized"
    assert max(r["due_at"] for r in rows) <= server_now + BOUND, "materialized ahead of time"
    due = {
        idempotency_key(
            purpose=PUBLISH_PURPOSE,
            namespace=CONFIG.namespace,
            definition_name=r["definition_name"],
            due_at=r["due_at"],
            generation=bytes.fromhex(r["id"]),
        ): r["due_at"]
        for r in rows
    }
    published = await conn.fetch(f'SELECT key, host, at FROM "{schema}".published')
    for row in published:
        assert row["key"] in due, "published a key no occurrence has"
        early = due[row["key"]] - row["at"]
        assert early <= ahead, f"{row['host']} published {early} before the due time"
    due_now = {key for key, at in due.items() if at <= server_now - timedelta(seconds=2)}
    assert due_now <= {row["key"] for row in published}, "an occurrence due was not published"
    return {"occurrences": len(rows), "published": published}


async def _all_due_published(conn: asyncpg.Connection, schema: str) -> bool:
    pending = await conn.fetchval(
        f'SELECT count(*) FROM "{schema}".recurring_occurrences o'
        " WHERE o.due_at <= clock_timestamp() - interval '2 seconds'"
        " AND o.state <> 'published'"
    )
    materialized = await conn.fetchval(f'SELECT count(*) FROM "{schema}".recurring_occurrences')
    return bool(pending == 0 and materialized > 0)


async def _wait(check: Callable[[], Any]) -> None:
    async with asyncio.timeout(WAIT):
        while not await check():  # noqa: ASYNC110 (polling rows of another process)
            await asyncio.sleep(0.05)


@pytest.mark.timeout(180)
async def test_a_host_an_hour_ahead_is_refused_and_the_synced_host_goes_on(
    pg_schema: tuple[str, str], clocks: Callable[[str], SteppedClock]
) -> None:
    dsn, schema = pg_schema
    conn = await _namespace(dsn, schema, first_after=timedelta(seconds=150))
    try:
        fast = clocks("fast")
        fast.set(3600)
        async with hosts(dsn, schema, ("synced", clocks("synced")), ("fast", fast)) as (
            synced,
            ahead,
        ):
            await ahead.until("refused twice", lambda: len(ahead.refusals()) >= 2)
            await synced.until("ready", lambda: "ready" in synced.lines)
            await _wait(lambda: _all_due_published(conn, schema))
            await synced.until("three more rounds", lambda: synced.rounds() >= 3)
            seen = await _check(conn, schema, ahead=timedelta(0))
        refusal = ahead.refusals()[0]
        assert "ahead of the database server's clock" in refusal, refusal
        assert ") by 1:00:00 (" in refusal, refusal
        assert "ready" not in ahead.lines
        assert synced.refusals() == []
        # Two or three were due (not the 62 an hour ahead would have ticked).
        assert seen["occurrences"] <= 4
        assert {row["host"] for row in seen["published"]} == {"synced"}
    finally:
        await conn.close()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("offset", [3, -3], ids=["plus-3s", "minus-3s"])
async def test_hosts_three_seconds_apart_with_one_second_leases_work_normally(
    pg_schema: tuple[str, str], clocks: Callable[[str], SteppedClock], offset: int
) -> None:
    dsn, schema = pg_schema
    conn = await _namespace(dsn, schema, first_after=timedelta(minutes=20))
    try:
        skewed = clocks("skewed")
        skewed.set(offset)
        async with hosts(dsn, schema, ("synced", clocks("synced")), ("skewed", skewed)) as pair:
            for host in pair:
                await host.until("ready", lambda h=host: "ready" in h.lines)  # type: ignore[misc]
            try:
                await _wait(lambda: _all_due_published(conn, schema))
            except TimeoutError:
                states = await conn.fetch(
                    f'SELECT state, attempts, last_error, count(*) FROM "{schema}".'
                    "recurring_occurrences GROUP BY 1, 2, 3"
                )
                raise AssertionError(
                    f"{states} {pair[0].lines[-6:]} {pair[1].lines[-6:]}"
                ) from None
            # Both keep working side by side for a few more rounds each.
            marks = [host.rounds() + 5 for host in pair]
            for host, mark in zip(pair, marks, strict=True):
                await host.until("five more rounds", lambda h=host, m=mark: h.rounds() >= m)  # type: ignore[misc]
            await _check(conn, schema, ahead=BOUND if offset > 0 else timedelta(0))
        for host in pair:
            assert host.refusals() == [], host.refusals()[:3]
    finally:
        await conn.close()


@pytest.mark.timeout(180)
async def test_a_clock_flipping_back_and_forth_is_refused_only_while_ahead(
    pg_schema: tuple[str, str], clocks: Callable[[str], SteppedClock]
) -> None:
    dsn, schema = pg_schema
    conn = await _namespace(dsn, schema, first_after=timedelta(seconds=150))
    try:
        flipping = clocks("flipping")
        async with hosts(dsn, schema, ("synced", clocks("synced")), ("flipping", flipping)) as (
            synced,
            flipper,
        ):
            for host in (synced, flipper):
                await host.until("ready", lambda h=host: "ready" in h.lines)  # type: ignore[misc]
            for _ in range(3):
                refused = len(flipper.refusals())
                flipping.set(3600)
                await flipper.until("refused", lambda r=refused: len(flipper.refusals()) > r)  # type: ignore[misc]
                # The synced host publishes what came due (on state: a loaded machine may
                # take longer than the check's two seconds), nothing ahead of time.
                await _wait(lambda: _all_due_published(conn, schema))
                await _check(conn, schema, ahead=BOUND)
                rounds = flipper.rounds()
                flipping.set(0)
                await flipper.until("a round", lambda r=rounds: flipper.rounds() > r)  # type: ignore[misc]
            await _wait(lambda: _all_due_published(conn, schema))
            await _check(conn, schema, ahead=timedelta(0))
        assert synced.refusals() == []
        assert all("by 1:00:00" in line for line in flipper.refusals()), flipper.refusals()
    finally:
        await conn.close()
