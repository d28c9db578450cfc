"""Real ``steeple worker`` processes for the fault tests: an application whose handlers and
broker wait on a gate file, a trace table they write to, and helpers to read the rows.

The application (:data:`APP`, written into the test's ``tmp_path``) runs one task name,
``slow``, whose handler traces ``start``, waits for the gate, then traces ``end``; and a
broker whose ``publish`` traces ``publish-start``, waits for the gate, then accepts the
message (a line in ``accepted.txt``, the broker's store shared by the processes). With
``FAULT_BLOCKING=1`` the wait is a synchronous ``time.sleep`` loop, which blocks the
worker's event loop for as long as the gate stays shut (RELIABILITY.md row 14). Every
trace row names the worker process that wrote it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg
import attrs

from pg_cluster import Clusters
from steeple.core import (
    MissedRunPolicy,
    RecurringConfig,
    RecurringDefinition,
    ScheduledMessage,
    SystemClock,
)
from steeple.keyring import Keyring, StorageKey
from steeple.postgres import queue as q
from store_setup_support import initialize_patiently

__all__ = ["APP", "WorkerProc", "World", "private_database", "world"]

STEEPLE = [sys.executable, "-c", "from steeple.admin.cli import main; main()"]

APP = """
import asyncio, os, time
from pathlib import Path

import asyncpg

from steeple.admin import WorkerApp
from steeple.core import BrokerReceipt
from steeple.postgres.queue import Task

DSN = os.environ["STEEPLE_DATABASE_URL"]
SCHEMA = os.environ["STEEPLE_QUEUE_SCHEMA"]
GATE = Path(os.environ["FAULT_GATE"])
BLOCKING = os.environ.get("FAULT_BLOCKING") == "1"
WORKER = os.environ["FAULT_WORKER"]
ACCEPTED = Path(__file__).with_name("accepted.txt")


async def trace(event, key):
    conn = await asyncpg.connect(DSN)
    try:
        await conn.execute(
            f'INSERT INTO "{SCHEMA}".fault_trace (worker, event, key) VALUES ($1, $2, $3)',
            WORKER, event, key,
        )
    finally:
        await conn.close()


def block_until_gate():
    # A careless synchronous wait inside async code: the event loop stops meanwhile.
    while not GATE.exists():
        time.sleep(0.02)


async def wait_for_gate():
    if BLOCKING:
        block_until_gate()
    else:
        while not GATE.exists():
            await asyncio.sleep(0.02)


async def slow_task(ctx, args):
    key = f"{ctx.task_id}/{ctx.attempt}"
    await trace("start", key)
    await wait_for_gate()
    await trace("end", key)


class GatedBroker:
    async def publish(self, message, *, idempotency_key, timeout):
        await trace("publish-start", idempotency_key)
        await wait_for_gate()
        # Accepted: written down before returning, with no await in between (an await
        # after a blocked loop would meet the publication's expired deadline first).
        with ACCEPTED.open("a") as journal:
            journal.write(f"{WORKER} {idempotency_key}\\n")
        return BrokerReceipt("gated", idempotency_key)


def make():
    return WorkerApp(
        broker=GatedBroker(),
        tasks=[(Task("slow"), slow_task)],
        worker_id=WORKER,
        drain_timeout=float(os.environ.get("FAULT_DRAIN", "60")),
        loop_lag_threshold=float(os.environ.get("FAULT_LAG", "0.5")),
    )
"""


@attrs.define
class WorkerProc:
    """A running ``steeple worker`` and the stderr lines it has written so far."""

    name: str
    proc: asyncio.subprocess.Process
    lines: list[str] = attrs.field(factory=list)
    reader: asyncio.Task[None] | None = None

    async def _read(self) -> None:
        assert self.proc.stderr is not None
        while line := await self.proc.stderr.readline():
            self.lines.append(line.decode(errors="replace").rstrip("\n"))

    @property
    def stderr(self) -> str:
        return "\n".join(self.lines)

    async def wait_for_line(self, text: str, *also: str, timeout: float = 30.0) -> str:
        """Return the first stderr line holding ``text`` and each of ``also`` (waiting)."""
        async with asyncio.timeout(timeout):
            while True:
                for line in self.lines:
                    if text in line and all(more in line for more in also):
                        return line
                if self.proc.returncode is not None and self.reader and self.reader.done():
                    raise AssertionError(f"{self.name} exited without {text!r}:\n{self.stderr}")
                await asyncio.sleep(0.02)

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    async def exited(self, timeout: float = 30.0) -> int:
        """Wait for the process to end (within ``timeout``); return its exit code."""
        async with asyncio.timeout(timeout):
            code = await self.proc.wait()
            if self.reader is not None:
                await self.reader
        return code

    async def reap(self) -> None:
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGCONT)
                self.proc.kill()
            await self.proc.wait()
        if self.reader is not None:
            self.reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.reader


@attrs.define
class World:
    """One test's database (recurring store and queue in one schema) and worker processes."""

    dsn: str
    schema: str
    key: StorageKey
    config: RecurringConfig
    home: Path
    procs: list[WorkerProc] = attrs.field(factory=list)

    @property
    def gate(self) -> Path:
        return self.home / "gate"

    def open_gate(self) -> None:
        self.gate.touch()

    def env(self, worker: str, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("STEEPLE_")}
        env.update(
            STEEPLE_KEYS=f"{self.key.key_id}:{self.key.to_base64()}",
            STEEPLE_DATABASE_URL=self.dsn,
            STEEPLE_SCHEMA=self.schema,
            STEEPLE_QUEUE_SCHEMA=self.schema,
            FAULT_GATE=str(self.gate),
            FAULT_WORKER=worker,
            PYTHONUNBUFFERED="1",
            COLUMNS="200",
        )
        env.update(extra)
        return env

    async def spawn(self, worker: str, app: str = "faultapp:make", **extra: str) -> WorkerProc:
        """Start ``steeple worker --app <app>`` named ``worker``; wait until it runs.

        ``app`` is a ``module:object`` in :attr:`home` (default: :data:`APP`'s ``make``).
        """
        proc = await asyncio.create_subprocess_exec(
            *STEEPLE,
            "worker",
            "--app",
            app,
            env=self.env(worker, **extra),
            cwd=self.home,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        running = WorkerProc(worker, proc)
        running.reader = asyncio.create_task(running._read())
        self.procs.append(running)
        await running.wait_for_line("steeple worker: running", timeout=60)
        return running

    async def fetch(self, query: str, *args: Any) -> list[asyncpg.Record]:
        conn = await asyncpg.connect(self.dsn, timeout=10)
        try:
            return list(await conn.fetch(query.replace("{s}", f'"{self.schema}"'), *args))
        finally:
            await conn.close()

    async def traces(self, event: str, worker: str | None = None) -> list[str]:
        """Keys traced with ``event`` (by ``worker``, or by any), in order."""
        rows = await self.fetch(
            "SELECT key FROM {s}.fault_trace WHERE event = $1 AND ($2::text IS NULL "
            "OR worker = $2) ORDER BY id",
            event,
            worker,
        )
        return [r[0] for r in rows]

    async def enqueue(self, count: int, lease: timedelta) -> list[int]:
        conn = await asyncpg.connect(self.dsn, timeout=10)
        try:
            options = q.EnqueueOptions(lease_duration=lease)
            return [
                (await q.enqueue(conn, q.Task("slow"), {}, options, schema=self.schema)).id
                for _ in range(count)
            ]
        finally:
            await conn.close()

    async def tasks(self) -> dict[int, tuple[str, int, str | None]]:
        """Task id -> (state, attempts, worker id)."""
        rows = await self.fetch("SELECT id, state, attempts, worker_id FROM {s}.tasks")
        return {r[0]: (r[1], r[2], r[3]) for r in rows}

    async def attempts(self) -> list[tuple[int, int, str, str]]:
        """Every recorded attempt: (task id, attempt, outcome, worker id)."""
        rows = await self.fetch(
            "SELECT task_id, attempt, outcome, worker_id FROM {s}.attempts ORDER BY id"
        )
        return [(r[0], r[1], r[2], r[3]) for r in rows]

    def accepted(self, worker: str | None = None) -> list[str]:
        """Idempotency keys the broker accepted (from ``worker``, or from any), in order."""
        journal = self.home / "accepted.txt"
        lines = journal.read_text().splitlines() if journal.exists() else []
        pairs = [line.split(" ", 1) for line in lines]
        return [key for who, key in pairs if worker is None or who == worker]

    async def occurrences(self) -> list[asyncpg.Record]:
        return await self.fetch(
            "SELECT id, state, attempts, lease_revision FROM {s}.recurring_occurrences ORDER BY id"
        )


def private_database(clusters: Clusters) -> tuple[str, str]:
    """A private cluster's DSN and a schema name for one test (nothing else connects)."""
    cluster = clusters.new("primary", settings={"max_connections": "80"})
    return cluster.dsn(), "steeple_fault"


@contextlib.asynccontextmanager
async def world(
    dsn: str, schema: str, home: Path, *, lease: timedelta, occurrences: int
) -> AsyncIterator[World]:
    """Set up ``schema`` (created if missing) and yield the test's :class:`World`.

    In it: a recurring namespace with ``occurrences`` due (``lease`` long leases), the
    work queue, the trace table; in ``home``: the application and ``steeple.toml``. Every
    worker process started is reaped at the end.
    """
    conn = await asyncpg.connect(dsn, timeout=10)
    try:
        await conn.execute(f'CREATE SCHEMA IF NOT EXISTS "{schema}"')
    finally:
        await conn.close()
    key = StorageKey.generate("k1")
    config = RecurringConfig("default", 1000, 100_000, lease_duration=lease)
    store = await initialize_patiently(dsn, config, Keyring(key), SystemClock(), schema=schema)
    try:
        # Each definition fires once, a few minutes ago, and next a year later: exactly
        # ``occurrences`` are due whenever the test runs (a minute boundary adds none).
        now = datetime.now(UTC).replace(second=0, microsecond=0)
        for n in range(occurrences):
            due = now - timedelta(minutes=2 + n)
            await store.create(
                RecurringDefinition(
                    f"once-{n}",
                    f"{due.minute} {due.hour} {due.day} {due.month} *",
                    due - timedelta(seconds=1),
                    MissedRunPolicy.CATCH_UP,
                    ScheduledMessage("t", "T", b"{}"),
                )
            )
    finally:
        await store.close()
    conn = await asyncpg.connect(dsn, timeout=10)
    try:
        await q.install(conn, schema=schema)
        await conn.execute(
            f'CREATE TABLE "{schema}".fault_trace (id bigserial PRIMARY KEY, '
            "worker text NOT NULL, event text NOT NULL, key text NOT NULL)"
        )
    finally:
        await conn.close()
    (home / "faultapp.py").write_text(APP)
    seconds = int(lease.total_seconds())
    (home / "steeple.toml").write_text(f'namespace = "default"\nlease = "{seconds}s"\n')
    made = World(dsn, schema, key, config, home)
    try:
        yield made
    finally:
        for proc in made.procs:
            await proc.reap()
