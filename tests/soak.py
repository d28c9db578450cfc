"""The soak: hours of mixed queue load on real ``steeple worker`` processes, under faults.

A private PostgreSQL cluster (initdb'd for the run, so restarting it touches nothing else)
holds a work queue and a recurring namespace. The harness enqueues a steady stream of
tasks and keeps periodic jobs due every minute, and recurring definitions fall due every
minute or two, while three ``steeple worker`` processes serve them: each runs the task
worker and a recurring relay publishing into a Redis stream. Slot 0 lives for the whole
run and is the one measured; slots 1 and 2 are SIGKILLed in turn and restarted. Every
few minutes every queue and recurring session is ended (``pg_terminate_backend``), and
the server is restarted with ``pg_ctl -m immediate``.

Every ``sample_every`` seconds the harness records slot 0's RSS, open file descriptors and
asyncio task count (its app module writes them: the worker exposes no endpoint), the
queue's throughput and the latency (creation to success) of the tasks finished since.
After the run, the faults stop, the fleet finishes the work and stops, and:

- the queue checker of :mod:`queue_support` (every task succeeded exactly once, no
  attempt executed twice, the success recorded by the attempt that ran last) holds, and
  every enqueue the harness saw acknowledged is among the tasks;
- the recurring checker holds: every instant of every definition's calendar up to the
  end of the load has one occurrence, published; the stream holds one entry per
  idempotency key, and as many keys per definition as it has published occurrences;
- after the warm-up, RSS, and the bytes the C allocator holds in use (glibc), grow by
  less than 1 MB per 10 minutes (Theil-Sen slope; a run shorter than twenty minutes only
  catches a gross leak: 10 MB); asyncio tasks neither trend upwards nor pass a bound;
  file descriptors stay under a bound, those that are not sockets do not trend upwards
  (on a run of twenty minutes or more, all of them), and no socket the server closed
  stays open here for more than a minute.

``python tests/soak.py --minutes 60 --out DIR [--redis-url URL]`` (``nox -s soak``) writes
``samples.csv``, ``events.csv``, ``summary.json`` and, with ``--plot``, ``soak.png`` into DIR.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import csv
import json
import math
import os
import random
import signal
import sys
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg

_HERE = Path(__file__).resolve().parent
for extra in (_HERE, _HERE.parent / "packages" / "postgres" / "tests"):
    if str(extra) not in sys.path:
        sys.path.append(str(extra))

from pg_cluster import Cluster, Clusters  # noqa: E402
from queue_support import check_total_queue  # noqa: E402
from steeple.core import (  # noqa: E402
    MissedRunPolicy,
    OccurrenceInfo,
    OccurrenceState,
    RecurringConfig,
    RecurringDefinition,
    ScheduledMessage,
    SystemClock,
)
from steeple.keyring import Keyring, StorageKey  # noqa: E402
from steeple.postgres import PostgresRecurringStore  # noqa: E402
from steeple.postgres.queue import (  # noqa: E402
    EnqueueOptions,
    Task,
    enqueue_many,
    install,
    jobs,
)

SCHEMA = "soak"
TASK: Task[Any] = Task("soak")
LEASE = timedelta(seconds=4)
OPTIONS = EnqueueOptions(lease_duration=LEASE, max_attempts=10_000)
WORKERS = 3
JOBS = 5  # periodic jobs, each due every minute
REDIS_URL = os.environ.get("STEEPLE_TEST_REDIS", "redis://127.0.0.1:6379/0")
RECURRING_SCHEMA = "soak_recurring"
NAMESPACE = "soak"
RELAY_LEASE = timedelta(seconds=5)  # a killed relay's leases lapse this soon
# Recurring definitions: most every minute (the calendar's finest step), every fourth
# every two minutes; each starts two minutes in the past, a small backlog to catch up.
DEFINITIONS = 16
RSS_LIMIT_KB_PER_10_MIN = 1024.0
# A run shorter than twenty minutes still sees the first minutes' growth (caches filling,
# allocator arenas) after its warm-up: it can only catch a gross leak (a kilobyte a task
# at 20 tasks a second is 12 MB a minute). The 1 MB bound is judged on longer runs.
SHORT_RUN = 1200.0
SHORT_RSS_LIMIT_KB_PER_10_MIN = 10 * 1024.0
# Besides RSS, the sampler records what the allocators hold in use: Python's blocks and,
# on glibc, the C heap's size and the bytes in use (a leak grows the latter, whatever
# the allocator does with free space).
MEMORY = ("blocks", "heap_kb", "in_use_kb")
# Besides all open fds: the sockets among them, and the age of the oldest socket its peer
# closed that is still open here (see the sampler).
FDS = ("fds", "sockets", "half_closed_s")
# A socket the server closed is closed here within a poll or two; one still open after a
# minute was lost track of.
HALF_CLOSED_LIMIT_S = 60.0

# The app module ``steeple worker --app soak_app:app`` imports. Its factory starts a
# sampler on the worker's own event loop: RSS, MEMORY, open fds and asyncio tasks, once a
# second.
APP_MODULE = """
import asyncio, ctypes, json, os, sys, time
from datetime import timedelta
import asyncpg
from steeple.admin import WorkerApp
from steeple.postgres.queue import JobError, Task

_keep = []

def _rss_kb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024

class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

try:  # glibc 2.33+: the C heap's size and what is in use in it (and in its own mappings)
    _mallinfo2 = ctypes.CDLL(None).mallinfo2
    _mallinfo2.restype = _MallInfo2
except AttributeError:
    _mallinfo2 = None

def _malloc():
    if _mallinfo2 is None:
        return {}
    info = _mallinfo2()
    return {"heap_kb": info.arena // 1024, "in_use_kb": (info.uordblks + info.hblkhd) // 1024}

def _fds(half_closed):
    # Every open fd, the sockets among them, and how long the oldest socket the peer closed
    # (TCP CLOSE_WAIT) has stayed open here: a connection the server ended that this process
    # never closed is the leak a fault leaves, while the pools' sockets come and go.
    names = os.listdir("/proc/self/fd")
    sockets = set()
    for name in names:
        try:
            target = os.readlink("/proc/self/fd/" + name)
        except OSError:
            continue
        if target.startswith("socket:["):
            sockets.add(target[8:-1])
    waiting = set()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(table) as f:
                for line in f.readlines()[1:]:
                    fields = line.split()
                    if fields[3] == "08" and fields[9] in sockets:
                        waiting.add(fields[9])
        except OSError:
            pass
    now = time.monotonic()
    for inode in list(half_closed):
        if inode not in waiting:
            del half_closed[inode]
    for inode in waiting:
        half_closed.setdefault(inode, now)
    oldest = now - min(half_closed.values()) if half_closed else 0.0
    return {"fds": len(names), "sockets": len(sockets), "half_closed_s": round(oldest, 1)}

async def _sample(path):
    half_closed = {}
    with open(path, "a") as out:
        while True:
            out.write(json.dumps({
                "t": time.time(), "rss_kb": _rss_kb(), **_fds(half_closed),
                "tasks": len(asyncio.all_tasks()),
                "blocks": sys.getallocatedblocks(), **_malloc(),
            }) + "\\n")
            out.flush()
            await asyncio.sleep(1.0)

async def app():
    dsn, schema = os.environ["SOAK_DSN"], os.environ["SOAK_SCHEMA"]
    worker_id = os.environ["SOAK_WORKER_ID"]
    log = await asyncpg.create_pool(
        dsn, min_size=0, max_size=4, max_inactive_connection_lifetime=30,
        server_settings={"application_name": "soak-log"})
    _keep.append(log)
    _keep.append(asyncio.get_running_loop().create_task(_sample(os.environ["SOAK_SAMPLES"])))

    async def handler(ctx, args):
        try:
            await log.execute(
                f'INSERT INTO "{schema}".executions (task_id, run_id, attempt, worker_id) '
                "VALUES ($1, $2, $3, $4)", ctx.task_id, ctx.run_id, ctx.attempt, worker_id,
                timeout=10)
        except Exception as exc:  # a reset or restart mid-insert: asyncpg raises several
            raise JobError.retry(f"execution log unavailable: {type(exc).__name__}",
                                 timedelta(seconds=0.5)) from None
        await asyncio.sleep(args.get("sleep", 0.02))

    broker = None
    if os.environ.get("SOAK_STREAM"):
        from steeple.brokers.redis import RedisStreamBroker
        broker = RedisStreamBroker(os.environ["SOAK_REDIS_URL"], stream=os.environ["SOAK_STREAM"])
    return WorkerApp(broker=broker, tasks=[(Task("soak"), handler)], worker_id=worker_id,
                     concurrency=8, relay_batch=5, drain_timeout=10)
"""


def theil_sen(xs: Sequence[float], ys: Sequence[float]) -> float:
    """The median of the slopes between every pair of points (robust to outliers)."""
    import numpy as np

    x, y = np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)
    if len(x) < 2:
        return 0.0
    i, j = np.triu_indices(len(x), k=1)
    dx = x[j] - x[i]
    keep = dx > 0
    if not keep.any():
        return 0.0
    return float(np.median((y[j] - y[i])[keep] / dx[keep]))


class Fleet:
    """``steeple worker`` processes by slot; a killed slot restarts under a new worker id.

    ``recurring`` (the relay's environment: the Redis URL, the stream and the keys) adds
    a recurring relay to every worker.
    """

    def __init__(self, workdir: Path, dsn: str, recurring: dict[str, str] | None = None) -> None:
        self.workdir, self.dsn, self.recurring = workdir, dsn, recurring or {}
        self.procs: dict[int, asyncio.subprocess.Process] = {}
        self.ids: dict[int, str] = {}
        self.generation = 0
        self.kills = 0
        (workdir / "soak_app.py").write_text(APP_MODULE)

    def samples_file(self, slot: int) -> Path:
        return self.workdir / f"samples-{self.ids[slot]}.jsonl"

    async def start(self, slot: int) -> None:
        self.generation += 1
        worker_id = f"soak{slot}-{self.generation}"
        self.ids[slot] = worker_id
        env = {
            **os.environ,
            "SOAK_DSN": self.dsn,
            "SOAK_SCHEMA": SCHEMA,
            "SOAK_WORKER_ID": worker_id,
            "SOAK_SAMPLES": str(self.workdir / f"samples-{worker_id}.jsonl"),
            **self.recurring,
            "PYTHONPATH": os.pathsep.join(
                p for p in (str(self.workdir), os.environ.get("PYTHONPATH")) if p
            ),
        }
        steeple = Path(sys.executable).parent / "steeple"
        relay: list[str] = []
        if self.recurring:
            relay = ["--schema", RECURRING_SCHEMA, "--namespace", NAMESPACE,
                     "--lease", f"{RELAY_LEASE.total_seconds():g}s"]  # fmt: skip
        log = (self.workdir / f"{worker_id}.log").open("ab")
        self.procs[slot] = await asyncio.create_subprocess_exec(
            str(steeple), "worker", "--app", "soak_app:app",
            "--dsn", self.dsn, "--queue-schema", SCHEMA, *relay,
            cwd=self.workdir, env=env, stdout=log, stderr=log,
        )  # fmt: skip
        log.close()

    async def wait_sampling(self, slot: int, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not self.samples_file(slot).exists() or not self.samples_file(slot).stat().st_size:
            proc = self.procs[slot]
            if proc.returncode is not None or time.monotonic() > deadline:
                tail = (self.workdir / f"{self.ids[slot]}.log").read_text()[-3000:]
                raise AssertionError(f"worker {self.ids[slot]} did not start:\n{tail}")
            await asyncio.sleep(0.1)

    def last_sample(self, slot: int) -> dict[str, Any] | None:
        try:
            with self.samples_file(slot).open("rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 400))
                lines = f.read().decode().splitlines()
        except OSError:
            return None
        for line in reversed(lines):
            with contextlib.suppress(ValueError):
                sample: dict[str, Any] = json.loads(line)
                return sample
        return None

    async def kill(self, slot: int) -> None:
        proc = self.procs.pop(slot)
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        self.kills += 1

    async def stop_all(self, timeout: float = 90) -> dict[str, int | None]:
        """SIGTERM every worker once it has started (a worker restarted a moment ago may
        not handle signals yet); their exit codes by worker id."""
        deadline = time.monotonic() + 60
        for slot, proc in self.procs.items():
            log = self.workdir / f"{self.ids[slot]}.log"
            while proc.returncode is None and time.monotonic() < deadline:
                if b"steeple worker: running" in log.read_bytes():
                    break
                await asyncio.sleep(0.1)
        for proc in self.procs.values():
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
        codes: dict[str, int | None] = {}
        for slot, proc in self.procs.items():
            try:
                codes[self.ids[slot]] = await asyncio.wait_for(proc.wait(), timeout)
            except TimeoutError:
                proc.kill()
                codes[self.ids[slot]] = await proc.wait()
        self.procs.clear()
        return codes

    async def kill_all(self) -> None:
        for slot in list(self.procs):
            await self.kill(slot)


def unpublished(
    definitions: dict[str, RecurringDefinition], items: Sequence[OccurrenceInfo], until: datetime
) -> list[tuple[str, str]]:
    """Every calendar instant up to ``until`` without a published occurrence."""
    published = {
        (o.definition_name, o.due_at) for o in items if o.state is OccurrenceState.PUBLISHED
    }
    missing = []
    for name, definition in definitions.items():
        due: datetime | None = definition.first_due
        while due is not None and due <= until:
            if (name, due) not in published:
                missing.append((name, due.isoformat()))
            due = definition.cron.next_after(due)
    return missing


def check_recurring(
    definitions: dict[str, RecurringDefinition],
    items: Sequence[OccurrenceInfo],
    entries: Sequence[tuple[str, str]],
    until: datetime,
) -> dict[str, int]:
    """Nothing lost up to ``until``, no instant stored twice, one stream entry (``(key,
    payload)``, the payload a definition's name) per idempotency key, and as many keys per
    definition as it has published occurrences.

    Raises:
        AssertionError: what broke, with the first few offenders.
    """
    missing = unpublished(definitions, items, until)
    assert not missing, f"recurring occurrences lost: {missing[:10]}"
    instants = Counter((o.definition_name, o.due_at) for o in items)
    twice = [k for k, n in instants.items() if n > 1]
    assert not twice, f"an instant stored twice: {twice[:10]}"
    repeated = [k for k, n in Counter(key for key, _ in entries).items() if n > 1]
    assert not repeated, f"published twice under one idempotency key: {repeated[:10]}"
    keys_of: dict[str, set[str]] = {}
    for key, payload in entries:
        keys_of.setdefault(payload, set()).add(key)
    assert set(keys_of) <= set(definitions), f"unknown payloads: {set(keys_of) - set(definitions)}"
    published = [o for o in items if o.state is OccurrenceState.PUBLISHED]
    for name in definitions:
        done = sum(o.definition_name == name for o in published)
        stored = sum(o.definition_name == name for o in items)
        keys = len(keys_of.get(name, ()))
        # A key beyond the published ones: an occurrence the broker took and whose
        # acknowledgement the stop interrupted (it is relayed again, under the same key).
        assert done <= keys <= stored, f"{name}: {done} published, {keys} keys, {stored} stored"
    return {
        "recurring_occurrences": len(items),
        "recurring_published": len(published),
        "stream_entries": len(entries),
    }


class Recurring:
    """The recurring side: a namespace, its definitions, the Redis stream and the checker."""

    def __init__(self, dsn: str, redis_url: str) -> None:
        self.dsn, self.redis_url = dsn, redis_url
        self.stream = f"steeple-soak:{uuid.uuid4().hex[:12]}"
        self.key = StorageKey("soak", os.urandom(32))
        self.config = RecurringConfig(NAMESPACE, 1000, 100_000, lease_duration=RELAY_LEASE)
        self.definitions: dict[str, RecurringDefinition] = {}

    def environment(self) -> dict[str, str]:
        """What a worker's relay needs: the broker's URL and stream, and the keys."""
        secret = base64.b64encode(self.key.key).decode()
        return {
            "SOAK_REDIS_URL": self.redis_url,
            "SOAK_STREAM": self.stream,
            "STEEPLE_KEYS": f"{self.key.key_id}:{secret}",
        }

    async def _store(self, *, initialize: bool = False) -> PostgresRecurringStore:
        opener = PostgresRecurringStore.initialize if initialize else PostgresRecurringStore.connect
        return await opener(
            self.dsn, self.config, Keyring(self.key), SystemClock(), schema=RECURRING_SCHEMA
        )

    async def prepare(self) -> None:
        import redis.asyncio as aioredis

        client = aioredis.Redis.from_url(self.redis_url)
        try:
            await client.ping()  # no broker, no soak: said now, not after the hour
        finally:
            await client.aclose()
        start = SystemClock().now().replace(second=0, microsecond=0) - timedelta(minutes=2)
        store = await self._store(initialize=True)
        try:
            for n in range(DEFINITIONS):
                name = f"soak-{n}"
                definition = RecurringDefinition(
                    name,
                    "*/2 * * * *" if n % 4 == 3 else "* * * * *",
                    start,
                    MissedRunPolicy.CATCH_UP,
                    ScheduledMessage("soak", "tick", name.encode()),
                )
                await store.create(definition)
                self.definitions[name] = definition
        finally:
            await store.close()

    async def occurrences(self) -> list[OccurrenceInfo]:
        store = await self._store()
        try:
            items: list[OccurrenceInfo] = []
            cursor = None
            while True:
                page = await store.occurrences(cursor, 100)
                items.extend(page.items)
                cursor = page.next_cursor
                if cursor is None:
                    return items
        finally:
            await store.close()

    async def drain(self, until: datetime, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while missing := unpublished(self.definitions, await self.occurrences(), until):
            if time.monotonic() > deadline:
                raise AssertionError(f"not published after {timeout} s: {missing[:10]}")
            await asyncio.sleep(1.0)

    async def entries(self) -> list[tuple[str, str]]:
        """The stream's entries as (idempotency key, payload)."""
        import redis.asyncio as aioredis

        client = aioredis.Redis.from_url(self.redis_url)
        try:
            found: list[tuple[str, str]] = []
            start = "-"
            while True:
                batch: Any = await client.xrange(self.stream, start, "+", count=1000)
                if not batch:
                    return found
                found.extend((f[b"key"].decode(), f[b"payload"].decode()) for _, f in batch)
                start = "(" + batch[-1][0].decode()
        finally:
            await client.aclose()

    async def check(self, until: datetime) -> dict[str, int]:
        """The recurring checker (:func:`check_recurring`) on the store and the stream."""
        return check_recurring(
            self.definitions, await self.occurrences(), await self.entries(), until
        )

    async def cleanup(self) -> None:
        import redis.asyncio as aioredis

        client = aioredis.Redis.from_url(self.redis_url)
        try:
            keys = [k async for k in client.scan_iter(match=f"{self.stream}*", count=500)]
            if keys:
                await client.delete(*keys)
        finally:
            await client.aclose()


async def _connect(dsn: str) -> asyncpg.Connection:
    return await asyncpg.connect(dsn, timeout=10, server_settings={"application_name": "soak"})


class Soak:
    """One run: load, faults and sampling for ``duration`` seconds, then the checks."""

    def __init__(
        self,
        cluster: Cluster,
        workdir: Path,
        duration: float,
        *,
        rate: float = 20.0,
        sample_every: float = 5.0,
        seed: int | None = None,
        redis_url: str | None = REDIS_URL,
    ) -> None:
        self.cluster, self.workdir, self.duration = cluster, workdir, duration
        self.dsn = cluster.dsn()
        self.rate, self.sample_every = rate, sample_every
        self.seed = random.SystemRandom().randrange(1 << 31) if seed is None else seed
        self.rng = random.Random(self.seed)
        # Every few minutes over an hour; a short run gets each fault at least twice.
        self.kill_every = min(60.0, duration / 6)
        self.reset_every = min(150.0, duration / 4)
        self.restart_every = min(300.0, duration / 3)
        self.warmup = min(300.0, duration / 3)
        self.acknowledged: list[int] = []
        self.samples: list[dict[str, Any]] = []
        self.events: list[tuple[float, str]] = []
        self.recurring = None if redis_url is None else Recurring(self.dsn, redis_url)
        self.fleet = Fleet(
            workdir, self.dsn, None if self.recurring is None else self.recurring.environment()
        )
        self.started = 0.0
        self.done = asyncio.Event()
        self.restarting = False

    def now(self) -> float:
        return time.monotonic() - self.started

    def event(self, what: str) -> None:
        self.events.append((round(self.now(), 1), what))
        print(f"soak {self.now():7.1f} s: {what}", flush=True)

    async def prepare(self) -> None:
        conn = await _connect(self.dsn)
        try:
            await install(conn, schema=SCHEMA)
            # No unique constraint: the checker, not the database, finds duplicates.
            await conn.execute(
                f'CREATE TABLE "{SCHEMA}".executions (task_id bigint NOT NULL, '
                "run_id uuid NOT NULL, attempt int NOT NULL, worker_id text NOT NULL)"
            )
            await conn.execute(f'CREATE INDEX ON "{SCHEMA}".tasks (finished_at)')
            for n in range(JOBS):
                await jobs.create(conn, f"every-minute-{n}", TASK, "* * * * *", {}, OPTIONS,
                                  schema=SCHEMA)  # fmt: skip
        finally:
            await conn.close()
        if self.recurring is not None:
            await self.recurring.prepare()

    async def enqueue_loop(self) -> None:
        """``rate`` tasks a second in batches of a fifth of a second; an enqueue that fails
        (the server restarting) is not counted as acknowledged, and is not retried."""
        conn: asyncpg.Connection | None = None
        batch = max(1, round(self.rate / 5))
        next_at = time.monotonic()
        while not self.done.is_set():
            next_at += batch / self.rate
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            try:
                if conn is None or conn.is_closed():
                    conn = await _connect(self.dsn)
                args = [{"sleep": self.rng.uniform(0.005, 0.05)} for _ in range(batch)]
                ids = await enqueue_many(conn, TASK, args, OPTIONS, schema=SCHEMA)
                self.acknowledged.extend(ids)
            except (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError):
                if conn is not None:
                    conn.terminate()
                conn = None
                next_at = time.monotonic() + 0.5
        if conn is not None:
            await conn.close()

    async def sample_loop(self) -> None:
        conn: asyncpg.Connection | None = None
        last_done = 0
        last_at = time.monotonic()
        since = None
        while not self.done.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.done.wait(), self.sample_every)
            row: dict[str, Any] = {"t": round(self.now(), 1)}
            worker = self.fleet.last_sample(0)
            if worker is not None:
                row.update(
                    {k: worker[k] for k in ("rss_kb", *FDS, "tasks", *MEMORY) if k in worker}
                )
            try:
                if conn is None or conn.is_closed():
                    conn = await _connect(self.dsn)
                stats = await conn.fetchrow(
                    f"""SELECT count(*) AS n, max(finished_at) AS upto,
                        percentile_cont(0.5) WITHIN GROUP (ORDER BY finished_at - created_at)
                            AS p50,
                        percentile_cont(0.99) WITHIN GROUP (ORDER BY finished_at - created_at)
                            AS p99
                    FROM "{SCHEMA}".tasks
                    WHERE state = 'succeeded' AND job_id IS NULL
                      AND finished_at > coalesce($1::timestamptz, '-infinity')""",
                    since,
                    timeout=10,
                )
                assert stats is not None  # an aggregate answers one row
                at = time.monotonic()
                done = last_done + stats["n"]
                row["throughput"] = round(stats["n"] / (at - last_at), 2)
                if stats["n"]:
                    row["p50_ms"] = round(stats["p50"].total_seconds() * 1000, 1)
                    row["p99_ms"] = round(stats["p99"].total_seconds() * 1000, 1)
                    since = stats["upto"]
                last_done, last_at = done, at
            except (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError):
                if conn is not None:
                    conn.terminate()
                conn = None
            self.samples.append(row)
        if conn is not None:
            await conn.close()

    async def fault_loop(self) -> None:
        kill_at, reset_at, restart_at = self.kill_every, self.reset_every, self.restart_every
        while not self.done.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.done.wait(), 0.5)
            if self.done.is_set():
                return
            now = self.now()
            if now >= kill_at:
                kill_at += self.kill_every
                slot = self.rng.randrange(1, WORKERS)
                await self.fleet.kill(slot)
                self.event(f"SIGKILL worker slot {slot}")
                await self.fleet.start(slot)
            if now >= reset_at:
                reset_at += self.reset_every
                with contextlib.suppress(OSError, TimeoutError, asyncpg.PostgresError):
                    conn = await _connect(self.dsn)
                    try:
                        ended = await conn.fetchval(
                            "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) "
                            "FROM pg_stat_activity WHERE application_name LIKE 'steeple-queue%'"
                            " OR application_name IN ('steeple-recurring', 'soak-log')) ended"
                        )
                    finally:
                        await conn.close()
                    self.event(f"pg_terminate_backend on {ended} worker sessions")
            if now >= restart_at:
                restart_at += self.restart_every
                self.event("PostgreSQL stopped (immediate)")
                await asyncio.to_thread(self.cluster.stop, "immediate")
                await asyncio.to_thread(self.cluster.start)
                self.event("PostgreSQL started")

    async def run(self) -> dict[str, Any]:
        await self.prepare()
        self.started = time.monotonic()
        for slot in range(WORKERS):
            await self.fleet.start(slot)
        try:
            for slot in range(WORKERS):
                await self.fleet.wait_sampling(slot)
            self.event(f"{WORKERS} workers running (seed {self.seed})")
            loops = [
                asyncio.create_task(self.enqueue_loop()),
                asyncio.create_task(self.sample_loop()),
                asyncio.create_task(self.fault_loop()),
            ]
            while self.now() < self.duration:
                await asyncio.sleep(1.0)
                for loop in loops:
                    if loop.done():
                        loop.result()  # a harness bug surfaces now, not after the hour
                if self.fleet.procs[0].returncode is not None:
                    raise AssertionError("the measured worker (slot 0) exited")
            self.done.set()
            await asyncio.gather(*loops)
            until = SystemClock().now()
            self.event("load and faults stopped; draining")
            await self.drain()
            if self.recurring is not None:
                await self.recurring.drain(until)
            codes = await self.fleet.stop_all()
            self.event(f"workers stopped: {codes}")
            conn = await _connect(self.dsn)
            try:
                checked = await check_total_queue(conn, SCHEMA)
                known = {r[0] for r in await conn.fetch(f'SELECT id FROM "{SCHEMA}".tasks')}
            finally:
                await conn.close()
            lost = set(self.acknowledged) - known
            assert not lost, f"acknowledged enqueues lost: {sorted(lost)[:10]}"
            if self.recurring is not None:
                checked = {**checked, **await self.recurring.check(until)}
        finally:
            await self.fleet.kill_all()
            self.write(None)  # the samples of a failed run are kept too
            if self.recurring is not None:
                await self.recurring.cleanup()
        summary = self.summarize(checked, codes)
        self.write(summary)
        return summary

    async def drain(self, timeout: float = 180) -> None:
        conn = await _connect(self.dsn)
        try:
            deadline = time.monotonic() + timeout
            while True:
                left = await conn.fetchval(
                    f"SELECT count(*) FROM \"{SCHEMA}\".tasks WHERE state <> 'succeeded'"
                )
                if left == 0:
                    return
                if time.monotonic() > deadline:
                    states = await conn.fetch(
                        f"SELECT state, count(*), min(last_error) AS error "
                        f'FROM "{SCHEMA}".tasks GROUP BY state'
                    )
                    raise AssertionError(
                        f"work left after {timeout} s: {[tuple(r) for r in states]}"
                    )
                await asyncio.sleep(0.5)
        finally:
            await conn.close()

    def summarize(self, checked: dict[str, int], codes: dict[str, int | None]) -> dict[str, Any]:
        after = [s for s in self.samples if s["t"] >= self.warmup and "rss_kb" in s]
        assert len(after) >= 10, f"too few samples after the warm-up: {len(after)}"
        ts = [s["t"] for s in after]
        slope = theil_sen(ts, [s["rss_kb"] for s in after])  # KB per second
        fd_slope = theil_sen(ts, [s["fds"] for s in after])
        task_slope = theil_sen(ts, [s["tasks"] for s in after])
        throughput = [s["throughput"] for s in self.samples if "throughput" in s]
        p50 = [s["p50_ms"] for s in self.samples if "p50_ms" in s]
        p99 = [s["p99_ms"] for s in self.samples if "p99_ms" in s]

        def median(values: list[float]) -> float | None:
            return sorted(values)[len(values) // 2] if values else None

        summary: dict[str, Any] = {
            "seconds": round(self.duration),
            "seed": self.seed,
            "warmup_seconds": round(self.warmup),
            "tasks": checked["tasks"],
            "executions": checked["executions"],
            "acknowledged_enqueues": len(self.acknowledged),
            **{k: v for k, v in checked.items() if k.startswith(("recurring", "stream"))},
            "kills": self.fleet.kills,
            "resets": sum("pg_terminate_backend" in e for _, e in self.events),
            "restarts": sum("stopped (immediate)" in e for _, e in self.events),
            "rss_kb_first": after[0]["rss_kb"],
            "rss_kb_last": after[-1]["rss_kb"],
            "rss_kb_max": max(s["rss_kb"] for s in after),
            "rss_kb_per_10_min": round(slope * 600, 1),
            **{
                f"{name}_per_10_min": round(theil_sen(ts, [s[name] for s in after]) * 600, 1)
                for name in MEMORY
                if all(name in s for s in after)
            },
            "fds_max": max(s["fds"] for s in after),
            "fds_per_10_min": round(fd_slope * 600, 2),
            "other_fds_per_10_min": round(
                theil_sen(ts, [s["fds"] - s.get("sockets", 0) for s in after]) * 600, 2
            ),
            "half_closed_s_max": max(s.get("half_closed_s", 0.0) for s in after),
            "asyncio_tasks_max": max(s["tasks"] for s in after),
            "asyncio_tasks_per_10_min": round(task_slope * 600, 2),
            "throughput_median": median(throughput),
            "p50_ms_median": median(p50),
            "p99_ms_median": median(p99),
            "p99_ms_max": max(p99) if p99 else None,
            "exit_codes": codes,
        }
        limit = (
            SHORT_RSS_LIMIT_KB_PER_10_MIN if self.duration < SHORT_RUN else RSS_LIMIT_KB_PER_10_MIN
        )
        summary["rss_limit_kb_per_10_min"] = limit
        summary["problems"] = problems_of(summary, long_run=self.duration >= SHORT_RUN)
        return summary

    def write(self, summary: dict[str, Any] | None) -> None:
        fields = ["t", "rss_kb", *MEMORY, *FDS, "tasks", "throughput", "p50_ms", "p99_ms"]
        with (self.workdir / "samples.csv").open("w", newline="") as f:
            writer = csv.DictWriter(f, fields)
            writer.writeheader()
            writer.writerows(self.samples)
        with (self.workdir / "events.csv").open("w", newline="") as f:
            writer_ = csv.writer(f)
            writer_.writerow(["t", "event"])
            writer_.writerows(self.events)
        if summary is not None:
            (self.workdir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")


def problems_of(summary: dict[str, Any], *, long_run: bool) -> list[str]:
    """What a run's summary breaks of the soak's bounds (nothing: it passed)."""
    problems: list[str] = []
    limit = summary["rss_limit_kb_per_10_min"]
    if summary["rss_kb_per_10_min"] >= limit:
        problems.append(
            f"RSS grows {summary['rss_kb_per_10_min']} KB per 10 minutes (limit {limit:g})"
        )
    if summary.get("in_use_kb_per_10_min", 0) >= limit:
        problems.append(
            f"the C heap's bytes in use grow {summary['in_use_kb_per_10_min']} KB per 10 "
            f"minutes (limit {limit:g})"
        )
    # The bound on all fds is generous for the pools (8 + 4 connections, a listener)
    # and concurrency (8 handlers). The pools open and close sockets as load and faults
    # come and go, so over a few minutes their count drifts by several either way: a
    # short run judges the fds that are not sockets (constant in a healthy worker) and
    # the sockets a fault left half closed; a long run also judges the slope of all.
    if summary["fds_max"] > 64 or summary["other_fds_per_10_min"] >= 1:
        problems.append(f"file descriptors not bounded: {summary}")
    elif long_run and summary["fds_per_10_min"] >= 1:
        problems.append(f"file descriptors grow: {summary}")
    if summary["half_closed_s_max"] > HALF_CLOSED_LIMIT_S:
        problems.append(
            f"a socket the server closed stayed open {summary['half_closed_s_max']} s "
            f"(limit {HALF_CLOSED_LIMIT_S:g}): {summary}"
        )
    if summary["asyncio_tasks_per_10_min"] >= 1 or summary["asyncio_tasks_max"] > 64:
        problems.append(f"asyncio tasks not bounded: {summary}")
    if any(code != 0 for code in summary["exit_codes"].values()):
        problems.append(f"a worker did not stop cleanly: {summary['exit_codes']}")
    return problems


def plot(workdir: Path, out: Path) -> None:
    """RSS, fds, throughput and latency over the run, with the faults marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with (workdir / "samples.csv").open() as f:
        rows = list(csv.DictReader(f))
    with (workdir / "events.csv").open() as f:
        events = list(csv.DictReader(f))

    def series(name: str) -> tuple[list[float], list[float]]:
        pairs = [(float(r["t"]) / 60, float(r[name])) for r in rows if r.get(name)]
        return [p[0] for p in pairs], [p[1] for p in pairs]

    summary = json.loads((workdir / "summary.json").read_text())
    fig, axes = plt.subplots(4, 1, figsize=(10, 10), sharex=True)
    for name, label in (("rss_kb", "RSS"), ("heap_kb", "C heap"), ("in_use_kb", "C heap in use")):
        t, kb = series(name)
        if kb:
            axes[0].plot(t, [v / 1024 for v in kb], label=label)
    axes[0].set_ylabel("MB (worker 0)")
    axes[0].legend(loc="center right")
    axes[0].set_title(
        f"steeple soak: {summary['seconds'] / 60:.0f} min, {summary['tasks']} tasks, "
        f"{summary['kills']} SIGKILLs, {summary['resets']} resets, "
        f"{summary['restarts']} restarts; RSS {summary['rss_kb_per_10_min']:+.0f} KB/10 min"
    )
    t, fds = series("fds")
    axes[1].plot(t, fds, label="open fds")
    t, tasks = series("tasks")
    axes[1].plot(t, tasks, label="asyncio tasks")
    axes[1].set_ylabel("count (worker 0)")
    axes[1].legend(loc="upper right")
    t, thr = series("throughput")
    axes[2].plot(t, thr)
    axes[2].set_ylabel("tasks/s")
    for name in ("p50_ms", "p99_ms"):
        t, lat = series(name)
        axes[3].plot(t, lat, label=name.replace("_ms", ""))
    axes[3].set_yscale("log")
    axes[3].set_ylabel("latency (ms)")
    axes[3].set_xlabel("minutes")
    axes[3].legend(loc="upper right")
    colours = {"SIGKILL": "grey", "pg_terminate": "orange", "stopped": "red"}
    for e in events:
        for key, colour in colours.items():
            if key in e["event"]:
                for ax in axes:
                    ax.axvline(float(e["t"]) / 60, color=colour, alpha=0.3, lw=0.8)
    axes[0].axvline(summary["warmup_seconds"] / 60, color="green", ls="--", lw=1)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)


async def soak(
    workdir: Path, duration: float, seed: int | None = None, redis_url: str | None = REDIS_URL
) -> dict[str, Any]:
    """Run a soak of ``duration`` seconds on a private cluster, stopped and deleted after;
    ``redis_url`` (``None``: no recurring load) is the relays' broker."""
    clusters = Clusters()
    try:
        cluster = clusters.new("soak", settings={"max_connections": "60"})
        return await Soak(cluster, workdir, duration, seed=seed, redis_url=redis_url).run()
    finally:
        clusters.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=60.0)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--plot", type=Path, help="write the plot here as well")
    parser.add_argument(
        "--redis-url", default=REDIS_URL, help="the relays' broker (default: %(default)s)"
    )
    options = parser.parse_args()
    # Stopped early (Ctrl-C, SIGTERM, or SIGINT to a background run, which a shell would
    # have ignored): the workers are killed and the private cluster deleted on the way out.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    options.out.mkdir(parents=True, exist_ok=True)
    summary = asyncio.run(
        soak(options.out.resolve(), options.minutes * 60, options.seed, options.redis_url)
    )
    print(json.dumps(summary, indent=2))
    plot(options.out, options.out / "soak.png")
    if options.plot:
        plot(options.out, options.plot)
    if summary["problems"] or math.isnan(summary["rss_kb_per_10_min"]):
        sys.exit("soak failed: " + "; ".join(summary["problems"]))


if __name__ == "__main__":
    main()
