"""Work-queue benchmark: steeple vs PgQueuer vs procrastinate vs raw SQL, in ONE run.

Run:  .venv/bin/python benchmarks/bench_queue.py --dsn postgresql://postgres@127.0.0.1:5432/test

Measured on the same PostgreSQL, one system at a time, each in its own schema:
- bulk enqueue rate (tasks/s) of N no-op tasks (each system's bulk API);
- processing rate (tasks/s) of those N no-op tasks by one worker process (this one);
- pickup latency p50/p99 (ms) of single tasks on an idle queue: from just before the
  enqueue call to the start of the handler, with the worker already waiting. It includes
  the enqueue's own round trip and durable commit (a WAL flush); the table also gives that
  round trip alone, and the time from the enqueue's return (its commit acknowledged) to
  the handler's start. That part is what the worker adds: the NOTIFY is sent at the
  commit, so it can even come first (the part is then 0);
- named queues ("mix"): the processing rate of --mix-n tasks of one queue at the worker's
  defaults, served alone, then with an extra idle queue, then with an extra paused one
  (the three take turns, three times; the median of each).

The "limit" is the same insert -> claim -> complete lifecycle as raw SQL on the steeple
schema with no Python in the loop: a server-side INSERT ... SELECT generate_series for
enqueue, and a procedure that claims batches with steeple's claim statement and completes
them, committing each batch. Its latency is a bare asyncpg client doing INSERT + NOTIFY,
LISTEN wake-up and the claim. A peer that cannot run is reported in the table with the reason.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import time
import traceback
from collections.abc import Awaitable, Callable
from typing import Any

import asyncpg

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._run_names import run_name

# Each run's own schemas (the process id in their names): runs started at once against one
# server must not drop each other's schemas, nor have one's workers take the other's tasks.
SCHEMAS = {
    name: run_name(schema)
    for name, schema in {
        "mix": "bench_steeple_mix",
        "steeple": "bench_steeple",
        "pgqueuer": "bench_pgqueuer",
        "procrastinate": "bench_procrastinate",
        "limit": "bench_limit",
    }.items()
}
CHUNK = 5000
PGQUEUER_BATCH = 100
PROCRASTINATE_CONCURRENCY = 20
PROCRASTINATE_MAX_N = 5000
LIMIT_SESSIONS = 2
LIMIT_BATCH = 1000
GLOBAL_LIMIT = 50
MIX_REPEATS = 3
STEEPLE_TUNED: dict[str, Any] = {
    "concurrency": 200,
    "batch_size": 200,
    "poll_interval": 1.0,
    "maintenance_interval": 5.0,
}


class Result:
    def __init__(self) -> None:
        self.enqueue: float | None = None
        self.process: float | None = None
        # processing at the library's default worker settings
        self.process_defaults: float | None = None
        # processing under a global concurrency limit of GLOBAL_LIMIT on the one queue
        self.process_limited: float | None = None
        # one queue drained at the defaults: served alone, with an idle and a paused queue
        self.mix_alone: float | None = None
        self.mix_idle: float | None = None
        self.mix_paused: float | None = None
        self.p50: float | None = None
        self.p99: float | None = None
        # the enqueue call's round trip (its commit included), and pickup after its return
        self.enqueue_p50: float | None = None
        self.after_p50: float | None = None
        self.after_p99: float | None = None
        self.error: str | None = None


async def reset_schema(dsn: str, schema: str) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        await conn.execute(f'CREATE SCHEMA "{schema}"')
    finally:
        await conn.close()


async def drop_schema(dsn: str, schema: str) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    finally:
        await conn.close()


def percentiles(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    p50 = statistics.median(ordered)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return p50 * 1000, p99 * 1000


async def measure_latency(
    result: Result,
    samples: int,
    enqueue_one: Callable[[], Awaitable[Any]],
    started: asyncio.Queue[float],
) -> None:
    """Enqueue one task at a time on an idle queue; latency = enqueue start -> handler start.

    Also the enqueue's round trip, and handler start - enqueue return (0 when the handler
    started first), into ``result``.
    """
    latencies, enqueues, after = [], [], []
    for i in range(samples + 5):
        await asyncio.sleep(0.02)  # idle: the worker is waiting, not mid-poll
        t0 = time.perf_counter()
        await enqueue_one()
        returned = time.perf_counter()
        t1 = await asyncio.wait_for(started.get(), 30)
        if i >= 5:  # warm-up
            latencies.append(t1 - t0)
            enqueues.append(returned - t0)
            after.append(max(0.0, t1 - returned))
    result.p50, result.p99 = percentiles(latencies)
    result.enqueue_p50 = percentiles(enqueues)[0]
    result.after_p50, result.after_p99 = percentiles(after)


# --- steeple --------------------------------------------------------------------------


async def steeple_drain(
    dsn: str,
    schema: str,
    conn: asyncpg.Connection,
    n: int,
    settings: dict[str, Any],
    queue: str | None = None,
) -> float:
    """Process the ``n`` pending no-op tasks (of ``queue``: the others may stay pending)
    with one worker of ``settings``; tasks/s."""
    from steeple.postgres.queue import Scheduler, Task

    done = asyncio.Event()
    count = 0

    async def handler(ctx: Any, args: Any) -> None:
        nonlocal count
        count += 1
        if count >= n:
            done.set()

    worker = Scheduler(dsn, worker_id="bench", schema=schema, **settings)
    worker.register(Task("noop"), handler)
    stop = asyncio.Event()
    t0 = time.perf_counter()
    run = asyncio.create_task(worker.run_until_shutdown(stop))
    await asyncio.wait_for(done.wait(), 3600)
    # wait until the completions are recorded, too
    while worker.stats.succeeded < n:  # noqa: ASYNC110 (a counter, polled)
        await asyncio.sleep(0.001)
    rate = n / (time.perf_counter() - t0)
    stop.set()
    await run
    stuck = await conn.fetchval(
        f"SELECT count(*) FROM \"{schema}\".tasks WHERE state <> 'succeeded' "
        "AND ($1::text IS NULL OR queue = $1)",
        queue,
    )
    assert stuck == 0, f"{stuck} tasks not succeeded"
    return rate


async def bench_mix(dsn: str, n: int, samples: int) -> Result:
    """Drain ``n`` tasks of queue ``b`` at the worker's defaults, serving ``b`` alone, then
    ``["a", "b"]`` with ``a`` empty, then with ``a`` paused (holding tasks)."""
    from steeple.postgres.queue import Task, enqueue_many, install, pause_queue, resume_queue

    schema = SCHEMAS["mix"]
    result = Result()
    await reset_schema(dsn, schema)
    conn = await asyncpg.connect(dsn)
    try:
        await install(conn, schema=schema)
        noop: Task[dict[str, int]] = Task("noop")
        payloads = [{"i": i} for i in range(n)]
        rates: dict[str, list[float]] = {"alone": [], "idle": [], "paused": []}
        # The variants take turns, MIX_REPEATS times: a busy machine slows them alike.
        for _ in range(MIX_REPEATS):
            for label, queues in (("alone", ["b"]), ("idle", ["a", "b"]), ("paused", ["a", "b"])):
                if label == "paused":
                    await pause_queue(conn, "a", schema=schema)
                    await enqueue_many(conn, noop, payloads[:100], schema=schema, queue="a")
                for start in range(0, n, CHUNK):
                    await enqueue_many(
                        conn, noop, payloads[start : start + CHUNK], schema=schema, queue="b"
                    )
                settings: dict[str, Any] = {"queues": queues}
                rates[label].append(await steeple_drain(dsn, schema, conn, n, settings, queue="b"))
                if label == "paused":
                    await resume_queue(conn, "a", schema=schema)
                    await conn.execute(f'DELETE FROM "{schema}".tasks')
        result.mix_alone, result.mix_idle, result.mix_paused = (
            statistics.median(rates[k]) for k in ("alone", "idle", "paused")
        )
    finally:
        await conn.close()
        await drop_schema(dsn, schema)
    return result


async def bench_steeple(dsn: str, n: int, samples: int) -> Result:
    from steeple.postgres.queue import (
        Scheduler,
        Task,
        enqueue,
        enqueue_many,
        install,
        limit_queue,
    )

    schema = SCHEMAS["steeple"]
    result = Result()
    await reset_schema(dsn, schema)
    conn = await asyncpg.connect(dsn)
    try:
        await install(conn, schema=schema)
        noop: Task[dict[str, int]] = Task("noop")
        done = asyncio.Event()
        count = 0
        started: asyncio.Queue[float] = asyncio.Queue()
        latency_mode = True

        async def handler(ctx: Any, args: Any) -> None:
            nonlocal count
            if latency_mode:
                started.put_nowait(time.perf_counter())
                return
            count += 1
            if count >= n:
                done.set()

        def make_worker() -> Scheduler:
            worker = Scheduler(dsn, worker_id="bench", schema=schema, **STEEPLE_TUNED)
            worker.register(noop, handler)
            return worker

        worker = make_worker()
        stop = asyncio.Event()
        run = asyncio.create_task(worker.run_until_shutdown(stop))
        await asyncio.sleep(1.0)
        await measure_latency(
            result, samples, lambda: enqueue(conn, noop, {}, schema=schema), started
        )
        stop.set()
        await run

        payloads = [{"i": i} for i in range(n)]
        t0 = time.perf_counter()
        for start in range(0, n, CHUNK):
            await enqueue_many(conn, noop, payloads[start : start + CHUNK], schema=schema)
        result.enqueue = n / (time.perf_counter() - t0)

        latency_mode = False
        result.process = await steeple_drain(dsn, schema, conn, n, STEEPLE_TUNED)
        for label, settings, limit in (
            ("defaults", {}, None),  # Scheduler's defaults: concurrency 16, poll 1 s
            ("limited", STEEPLE_TUNED, GLOBAL_LIMIT),
        ):
            for start in range(0, n, CHUNK):
                await enqueue_many(conn, noop, payloads[start : start + CHUNK], schema=schema)
            await limit_queue(conn, "default", max_running=limit, schema=schema)
            rate = await steeple_drain(dsn, schema, conn, n, settings)
            await limit_queue(conn, "default", schema=schema)
            if label == "defaults":
                result.process_defaults = rate
            else:
                result.process_limited = rate
    finally:
        await conn.close()
        await drop_schema(dsn, schema)
    return result


# --- PgQueuer --------------------------------------------------------------------------


async def pgqueuer_drain(
    dsn: str, n: int, *, batch_size: int | None, concurrency_limit: int = 0
) -> float:
    """Process the ``n`` pending PgQueuer jobs with one QueueManager in drain mode; jobs/s.

    ``batch_size`` None keeps ``QueueManager.run``'s default; ``concurrency_limit`` is the
    entrypoint's (PgQueuer's limit of jobs of that entrypoint running at once).
    """
    from datetime import timedelta

    from pgqueuer import AsyncpgDriver, Job, Queries, QueueManager
    from pgqueuer.types import QueueExecutionMode

    worker_conn = await asyncpg.connect(dsn)
    try:
        qm = QueueManager(Queries(AsyncpgDriver(worker_conn)))

        @qm.entrypoint("noop", concurrency_limit=concurrency_limit)
        async def noop(job: Job) -> None:
            return None

        tuning: dict[str, Any] = {}
        if batch_size is not None:
            tuning = {"batch_size": batch_size, "log_aggregation_interval": timedelta(0)}
        t0 = time.perf_counter()
        # drain mode ends the run when the queue is empty (the timeout bounds that wait)
        await qm.run(mode=QueueExecutionMode.drain, dequeue_timeout=timedelta(seconds=1), **tuning)
        return n / (time.perf_counter() - t0)
    finally:
        await worker_conn.close()


async def bench_pgqueuer(dsn: str, n: int, samples: int) -> Result:
    schema = SCHEMAS["pgqueuer"]
    os.environ["PGQUEUER_SCHEMA"] = schema
    from datetime import timedelta

    from pgqueuer import AsyncpgDriver, Job, Queries, QueueManager

    result = Result()
    await drop_schema(dsn, schema)  # PgQueuer creates its schema itself
    conn = await asyncpg.connect(dsn)
    try:
        queries = Queries(AsyncpgDriver(conn))
        await queries.install()
        started: asyncio.Queue[float] = asyncio.Queue()

        worker_conn = await asyncpg.connect(dsn)
        try:
            qm = QueueManager(Queries(AsyncpgDriver(worker_conn)))

            @qm.entrypoint("noop")
            async def timed(job: Job) -> None:
                started.put_nowait(time.perf_counter())

            run = asyncio.create_task(qm.run(batch_size=10, dequeue_timeout=timedelta(seconds=30)))
            await asyncio.sleep(1.0)
            await measure_latency(result, samples, lambda: queries.enqueue("noop", None), started)
            qm.shutdown.set()
            await asyncio.wait_for(run, 30)
        finally:
            await worker_conn.close()

        t0 = time.perf_counter()
        for start in range(0, n, CHUNK):
            m = min(CHUNK, n - start)
            await queries.enqueue(["noop"] * m, [None] * m, [0] * m)
        result.enqueue = n / (time.perf_counter() - t0)

        result.process = await pgqueuer_drain(dsn, n, batch_size=PGQUEUER_BATCH)
        for label in ("defaults", "limited"):
            for start in range(0, n, CHUNK):
                m = min(CHUNK, n - start)
                await queries.enqueue(["noop"] * m, [None] * m, [0] * m)
            if label == "defaults":  # QueueManager.run's default batch size (10)
                result.process_defaults = await pgqueuer_drain(dsn, n, batch_size=None)
            else:
                result.process_limited = await pgqueuer_drain(
                    dsn, n, batch_size=PGQUEUER_BATCH, concurrency_limit=GLOBAL_LIMIT
                )
        left = await conn.fetchval(f'SELECT count(*) FROM "{schema}".pgqueuer')
        assert left == 0, f"{left} PgQueuer jobs left"
    finally:
        await conn.close()
        await drop_schema(dsn, schema)
    return result


# --- procrastinate ---------------------------------------------------------------------


async def bench_procrastinate(dsn: str, n: int, samples: int) -> Result:
    import procrastinate
    from procrastinate.types import JSONDict

    n = min(n, PROCRASTINATE_MAX_N)  # ~100 tasks/s here: 50,000 would take ten minutes

    schema = SCHEMAS["procrastinate"]
    result = Result()
    await reset_schema(dsn, schema)
    try:
        app = procrastinate.App(
            connector=procrastinate.PsycopgConnector(
                conninfo=dsn, kwargs={"options": f"-c search_path={schema}"}
            )
        )
        started: asyncio.Queue[float] = asyncio.Queue()
        latency_mode = True

        @app.task(name="noop")
        async def noop(i: int = 0) -> None:
            if latency_mode:
                started.put_nowait(time.perf_counter())

        async with app.open_async():
            await app.schema_manager.apply_schema_async()
            run = asyncio.create_task(
                app.run_worker_async(
                    concurrency=10,
                    wait=True,
                    install_signal_handlers=False,
                    delete_jobs="always",
                    listen_notify=True,
                )
            )
            await asyncio.sleep(1.0)
            await measure_latency(result, samples, lambda: noop.defer_async(i=0), started)
            run.cancel()
            with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                await asyncio.wait_for(run, 30)

            latency_mode = False
            t0 = time.perf_counter()
            for start in range(0, n, CHUNK):
                m = min(CHUNK, n - start)
                batch: list[JSONDict] = [{"i": start + k} for k in range(m)]
                await noop.batch_defer_async(*batch)
            result.enqueue = n / (time.perf_counter() - t0)

            t0 = time.perf_counter()
            await app.run_worker_async(
                concurrency=PROCRASTINATE_CONCURRENCY,
                wait=False,
                install_signal_handlers=False,
                delete_jobs="always",
                listen_notify=False,
                fetch_job_polling_interval=0.01,
            )
            result.process = n / (time.perf_counter() - t0)
    finally:
        await drop_schema(dsn, schema)
    return result


# --- the SQL-only limit ----------------------------------------------------------------


LIMIT_PROCEDURE = """
CREATE PROCEDURE {s}.drain(batch int) LANGUAGE plpgsql AS $$
DECLARE
    claimed bigint[];
    tokens uuid[];
BEGIN
    LOOP
        -- steeple's own claim function (it commits the claim asynchronously, as steeple's
        -- worker does); the completion below commits durably
        SELECT array_agg(c.id), array_agg(c.lease_token) INTO claimed, tokens
        FROM {s}.claim(ARRAY['default'], ARRAY[batch], ARRAY['noop'], 'sql',
                       extract(epoch FROM clock_timestamp())::double precision + 60) AS c
        WHERE c.id IS NOT NULL;
        EXIT WHEN claimed IS NULL;
        COMMIT;
        SET LOCAL synchronous_commit = on;
        WITH done AS (
            UPDATE {s}.tasks t
            SET state = 'succeeded', finished_at = clock_timestamp(),
                updated_at = clock_timestamp(), lease_token = NULL, lease_expires_at = NULL
            FROM unnest(claimed, tokens) AS h(id, token)
            WHERE t.id = h.id AND t.lease_token = h.token
            RETURNING t.id, t.attempts, t.started_at, t.finished_at
        )
        INSERT INTO {s}.attempts (task_id, attempt, worker_id, outcome, started_at, finished_at)
        SELECT id, attempts, 'sql', 'succeeded', started_at, finished_at FROM done;
        COMMIT;
    END LOOP;
END $$;
"""


async def bench_limit(dsn: str, n: int, samples: int) -> Result:
    from steeple.postgres.queue import install
    from steeple.postgres.queue._schema import notify_channel

    schema = SCHEMAS["limit"]
    s = f'"{schema}"'
    result = Result()
    await reset_schema(dsn, schema)
    conn = await asyncpg.connect(dsn)
    try:
        await install(conn, schema=schema)
        await conn.execute(LIMIT_PROCEDURE.format(s=s))
        insert = f"""
            INSERT INTO {s}.tasks (task_name, args, max_attempts, lease_duration,
                backoff_initial_us, backoff_maximum_us, backoff_factor, backoff_jitter)
            SELECT 'noop', jsonb_build_object('i', g), 5, interval '60 s', 1000000,
                   300000000, 2, 0
            FROM generate_series($1::int, $2::int) AS g"""
        t0 = time.perf_counter()
        for start in range(0, n, CHUNK):
            await conn.execute(insert, start, min(n, start + CHUNK) - 1)
        result.enqueue = n / (time.perf_counter() - t0)

        # two sessions, as steeple's worker claims and completes on two connections at once
        drainers = [await asyncpg.connect(dsn) for _ in range(LIMIT_SESSIONS)]
        t0 = time.perf_counter()
        await asyncio.gather(*(d.execute(f"CALL {s}.drain({LIMIT_BATCH})") for d in drainers))
        result.process = n / (time.perf_counter() - t0)
        for d in drainers:
            await d.close()
        left = await conn.fetchval(f"SELECT count(*) FROM {s}.tasks WHERE state <> 'succeeded'")
        assert left == 0, f"{left} tasks left by the SQL drain"

        # latency: a bare client (INSERT + NOTIFY, LISTEN wake-up, claim)
        channel = notify_channel(schema)
        listener = await asyncpg.connect(dsn)
        wake = asyncio.Event()
        await listener.add_listener(channel, lambda *_: wake.set())
        started: asyncio.Queue[float] = asyncio.Queue()
        claim = (
            f"SELECT id FROM {s}.claim(ARRAY['default'], ARRAY[10], ARRAY['noop'], 'sql', "
            "extract(epoch FROM clock_timestamp())::double precision + 60) WHERE id IS NOT NULL"
        )
        worker_conn = await asyncpg.connect(dsn)
        stop = asyncio.Event()

        async def loop() -> None:
            while not stop.is_set():
                await wake.wait()
                wake.clear()
                if await worker_conn.fetch(claim):
                    started.put_nowait(time.perf_counter())

        runner = asyncio.create_task(loop())
        one = insert.replace("generate_series($1::int, $2::int)", "generate_series(1, 1)")
        one_notify = f"WITH ins AS ({one} RETURNING id) SELECT pg_notify($1, '') FROM ins"
        await measure_latency(result, samples, lambda: conn.execute(one_notify, channel), started)
        stop.set()
        wake.set()
        await runner
        await listener.close()
        await worker_conn.close()
    finally:
        await conn.close()
        await drop_schema(dsn, schema)
    return result


# --- the table -------------------------------------------------------------------------


def fmt(value: float | None, digits: int = 0) -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}"


def ratio(a: float | None, b: float | None, inverse: bool = False) -> str:
    if a is None or b is None or a == 0 or b == 0:
        return "-"
    return f"{(b / a if inverse else a / b):.2f}x"


def print_table(results: dict[str, Result], n: int, samples: int, mix_n: int) -> None:
    names = ["steeple", "pgqueuer", "procrastinate", "limit"]
    head = [
        "metric",
        "steeple",
        "PgQueuer",
        "procrastinate",
        "SQL limit",
        "steeple/PgQueuer",
        "steeple/limit",
    ]
    rows = []
    s, p, lim = results["steeple"], results["pgqueuer"], results["limit"]
    rows.append(
        [f"bulk enqueue (tasks/s, N={n:,})"]
        + [fmt(results[k].enqueue) for k in names]
        + [ratio(s.enqueue, p.enqueue), ratio(s.enqueue, lim.enqueue)]
    )
    rows.append(
        ["processing, tuned (tasks/s, 1 worker)"]
        + [fmt(results[k].process) for k in names]
        + [ratio(s.process, p.process), ratio(s.process, lim.process)]
    )
    rows.append(
        ["processing, defaults (tasks/s)"]
        + [fmt(results[k].process_defaults) for k in names]
        + [ratio(s.process_defaults, p.process_defaults), "-"]
    )
    rows.append(
        [f"processing, global limit {GLOBAL_LIMIT} (tasks/s)"]
        + [fmt(results[k].process_limited) for k in names]
        + [ratio(s.process_limited, p.process_limited), "-"]
    )
    # for latency, lower is better: ratios are speed-ups (peer / steeple)
    rows.append(
        [f"idle pickup p50 (ms, {samples} tasks)"]
        + [fmt(results[k].p50, 2) for k in names]
        + [ratio(s.p50, p.p50, inverse=True), ratio(s.p50, lim.p50, inverse=True)]
    )
    rows.append(
        ["idle pickup p99 (ms)"]
        + [fmt(results[k].p99, 2) for k in names]
        + [ratio(s.p99, p.p99, inverse=True), ratio(s.p99, lim.p99, inverse=True)]
    )
    rows.append(
        ["  of which the enqueue call, p50 (ms)"]
        + [fmt(results[k].enqueue_p50, 2) for k in names]
        + ["-", "-"]
    )
    rows.append(
        ["  after the enqueue returned, p50 (ms)"]
        + [fmt(results[k].after_p50, 2) for k in names]
        + [
            ratio(s.after_p50, p.after_p50, inverse=True),
            ratio(s.after_p50, lim.after_p50, inverse=True),
        ]
    )
    rows.append(
        ["  after the enqueue returned, p99 (ms)"]
        + [fmt(results[k].after_p99, 2) for k in names]
        + [
            ratio(s.after_p99, p.after_p99, inverse=True),
            ratio(s.after_p99, lim.after_p99, inverse=True),
        ]
    )
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    line = "  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True))
    print(line)
    print("-" * len(line))
    for r in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)))
    print(
        "\nratios: throughput = steeple / peer (higher is better); latency = peer / steeple "
        "(higher is better: how many times faster steeple picks up)"
    )
    if results["procrastinate"].process is not None and n > PROCRASTINATE_MAX_N:
        print(
            f"procrastinate: enqueue/processing measured on N={PROCRASTINATE_MAX_N:,} "
            "(its rate is far lower; the full N would take many minutes)"
        )
    for k in names:
        if results[k].error:
            print(f"{k}: could not run: {results[k].error}")
    mix = results.get("mix")
    if mix is not None and mix.mix_alone is not None:
        print(
            f"\nnamed queues (steeple at its defaults, N={mix_n:,} tasks of queue 'b', "
            f"tasks/s, median of {MIX_REPEATS}; ratio = rate / rate served alone, "
            "higher is better):"
        )
        for label, rate in (
            ("served alone (queues=['b'])", mix.mix_alone),
            ("with an idle queue (['a', 'b'], 'a' empty)", mix.mix_idle),
            ("with a paused queue (['a', 'b'], 'a' paused)", mix.mix_paused),
        ):
            print(f"  {label:<46} {fmt(rate):>8}  {ratio(rate, mix.mix_alone)}")
    elif mix is not None and mix.error:
        print(f"mix: could not run: {mix.error}")


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", default=os.environ.get("STEEPLE_TEST_DSN"), required=False)
    parser.add_argument("--n", type=int, default=50_000, help="tasks for enqueue/processing")
    parser.add_argument("--samples", type=int, default=200, help="latency samples")
    parser.add_argument(
        "--mix-n", type=int, default=2000, help="tasks for the named-queues drain (mix)"
    )
    parser.add_argument(
        "--only", choices=["steeple", "pgqueuer", "procrastinate", "limit", "mix"], action="append"
    )
    args = parser.parse_args()
    server = None
    if not args.dsn:
        # No server named: a private PostgreSQL (pgserver), as the test suite does.
        import tempfile

        from pgserver.postgres_server import get_server

        print("no --dsn: starting a private PostgreSQL (pgserver)", file=sys.stderr)
        server = get_server(tempfile.mkdtemp(prefix="steeple-bench-"), cleanup_mode="delete")
        args.dsn = server.get_uri()
    try:
        return await run_all(args)
    finally:
        if server is not None:
            server.cleanup()


async def run_all(args: argparse.Namespace) -> int:
    benches = {
        "limit": bench_limit,
        "steeple": bench_steeple,
        "pgqueuer": bench_pgqueuer,
        "procrastinate": bench_procrastinate,
        "mix": bench_mix,
    }
    results: dict[str, Result] = {}
    for name, bench in benches.items():
        if args.only and name not in args.only:
            results[name] = Result()
            results[name].error = "skipped (--only)"
            continue
        print(f"running {name} ...", file=sys.stderr, flush=True)
        try:
            n = args.mix_n if name == "mix" else args.n
            results[name] = await bench(args.dsn, n, args.samples)
        except Exception as exc:  # a peer that cannot run is reported, not fatal
            traceback.print_exc()
            results[name] = Result()
            results[name].error = f"{type(exc).__name__}: {exc}"
    print_table(results, args.n, args.samples, args.mix_n)
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
