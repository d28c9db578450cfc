"""Operations: run_state, cancel, prune_terminal; and the OpenTelemetry metrics."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from datetime import timedelta
from typing import Any

import asyncpg
import psycopg
import pytest

from queue_support import QueueFixture
from steeple.postgres.queue import (
    QueueConfigurationError,
    Task,
    TaskNotFoundError,
    cancel,
    enqueue,
    enqueue_many,
    prune_terminal,
    run_state,
)

PLAIN: Task[Any] = Task("plain")


async def test_run_state_reports_without_args_or_credentials(queue: QueueFixture) -> None:
    dsn, schema, conn = queue
    done = await enqueue(conn, PLAIN, {"secret": "s3cr3t"}, schema=schema)
    state = await run_state(conn, done.id, schema=schema)
    assert state.id == done.id
    assert state.state.value == "pending"
    assert state.attempts == 0
    assert "s3cr3t" not in repr(state)
    assert "token" not in repr(state)
    async with await psycopg.AsyncConnection.connect(dsn) as pconn:
        assert (await run_state(pconn, done.id, schema=schema)) == state
    with pytest.raises(TaskNotFoundError) as err:
        await run_state(conn, 10**12, schema=schema)
    assert isinstance(err.value, LookupError)
    with pytest.raises(TaskNotFoundError):
        await cancel(conn, 10**12, schema=schema)


async def _finish(
    conn: asyncpg.Connection, schema: str, ids: list[int], state: str, ago: str
) -> None:
    await conn.execute(
        f'UPDATE "{schema}".tasks SET state = $2, '
        "finished_at = clock_timestamp() - $3::text::interval WHERE id = ANY($1)",
        ids,
        state,
        ago,
    )
    await conn.executemany(
        f'INSERT INTO "{schema}".attempts (task_id, attempt, outcome) VALUES ($1, 1, $2)',
        [(i, "succeeded" if state == "succeeded" else "failed") for i in ids],
    )


async def test_prune_terminal_deletes_old_terminal_tasks_in_bounded_batches(
    queue: QueueFixture,
) -> None:
    _dsn, schema, conn = queue
    ids = await enqueue_many(conn, PLAIN, list(range(30)), schema=schema)
    old_ok, old_failed, recent, live = ids[:10], ids[10:15], ids[15:20], ids[20:]
    await _finish(conn, schema, old_ok, "succeeded", "2 days")
    await _finish(conn, schema, old_failed, "failed", "3 days")
    await _finish(conn, schema, recent, "cancelled", "1 minute")
    assert await prune_terminal(conn, timedelta(days=1), limit=6, schema=schema) == 6
    assert await prune_terminal(conn, timedelta(days=1), limit=6, schema=schema) == 6
    assert await prune_terminal(conn, timedelta(days=1), limit=6, schema=schema) == 3
    assert await prune_terminal(conn, timedelta(days=1), limit=6, schema=schema) == 0
    left = {r[0] for r in await conn.fetch(f'SELECT id FROM "{schema}".tasks')}
    assert left == set(recent + live)
    # attempt history goes only with pruned tasks
    history = {r[0] for r in await conn.fetch(f'SELECT task_id FROM "{schema}".attempts')}
    assert history == set(recent)
    # oldest first: the failed ones (3 days) went in the first batch
    with pytest.raises(QueueConfigurationError):
        await prune_terminal(conn, timedelta(days=-1), schema=schema)
    with pytest.raises(QueueConfigurationError):
        await prune_terminal(conn, timedelta(days=1), limit=0, schema=schema)


async def test_prune_never_touches_live_work(queue: QueueFixture) -> None:
    _dsn, schema, conn = queue
    ids = await enqueue_many(conn, PLAIN, [1, 2], schema=schema)
    assert await prune_terminal(conn, timedelta(0), schema=schema) == 0
    await cancel(conn, ids[0], schema=schema)
    await asyncio.sleep(0.01)
    assert await prune_terminal(conn, timedelta(0), schema=schema) == 1
    assert (await run_state(conn, ids[1], schema=schema)).state.value == "pending"


METRICS_SCRIPT = textwrap.dedent(
    """
    import asyncio, sys
    import asyncpg
    from opentelemetry import metrics
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from steeple.postgres.queue import JobError, Scheduler, Task, cancel, enqueue, enqueue_many

    reader = InMemoryMetricReader()
    metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))

    async def main():
        dsn, schema = sys.argv[1:3]
        conn = await asyncpg.connect(dsn)
        ok, bad = Task("ok"), Task("bad")
        await enqueue_many(conn, ok, [1, 2, 3], schema=schema)
        await enqueue(conn, bad, 1, schema=schema, queue="other")
        doomed = await enqueue(conn, Task("never"), 1, schema=schema)
        await cancel(conn, doomed.id, schema=schema)
        worker = Scheduler(dsn, worker_id="m", schema=schema, poll_interval=0.05,
                           queues=["default", "other"])
        async def fine(ctx, args): return None
        async def fail(ctx, args): raise JobError.permanent("no")
        worker.register(ok, fine)
        worker.register(bad, fail)
        stop = asyncio.Event()
        run = asyncio.create_task(worker.run_until_shutdown(stop))
        while worker.stats.succeeded < 3 or worker.stats.failed < 1:
            await asyncio.sleep(0.05)
        stop.set()
        await run
        totals = {}
        for rm in reader.get_metrics_data().resource_metrics:
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    points = m.data.data_points
                    totals[m.name] = sum(getattr(p, "value", None) or getattr(p, "count", 0)
                                         for p in points)
                    labels = sorted({(p.attributes.get("task"), p.attributes.get("queue"))
                                     for p in points if "queue" in p.attributes})
                    if labels:
                        print("labels:" + m.name, repr(labels).replace(" ", ""))
        for name in sorted(totals):
            print(name, totals[name])

    asyncio.run(main())
    """
)


async def test_metrics_are_exported_when_an_sdk_is_configured(queue: QueueFixture) -> None:
    dsn, schema, _conn = queue
    out = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-c", METRICS_SCRIPT, dsn, schema],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    totals = dict(line.rsplit(" ", 1) for line in out.stdout.splitlines())
    # Each per-task measurement carries the task name and its queue.
    both = "[('bad','other'),('ok','default')]"
    assert totals["labels:steeple.queue.tasks.enqueued"] == (
        "[('bad','other'),('never','default'),('ok','default')]"
    )
    assert totals["labels:steeple.queue.tasks.claimed"] == both
    assert totals["labels:steeple.queue.tasks.succeeded"] == "[('ok','default')]"
    assert totals["labels:steeple.queue.tasks.failed"] == "[('bad','other')]"
    assert totals["labels:steeple.queue.run_time"] == both
    assert float(totals["steeple.queue.tasks.enqueued"]) == 5
    assert float(totals["steeple.queue.tasks.claimed"]) == 4
    assert float(totals["steeple.queue.tasks.succeeded"]) == 3
    assert float(totals["steeple.queue.tasks.failed"]) == 1
    assert float(totals["steeple.queue.tasks.cancelled"]) == 1
    assert float(totals["steeple.queue.run_time"]) == 4
    assert float(totals["steeple.queue.pickup_latency"]) == 4


RECORDING_SCRIPT = textwrap.dedent(
    """
    from opentelemetry import metrics
    from opentelemetry.sdk.metrics import MeterProvider
    from steeple.postgres.queue import _metrics

    assert _metrics.recording() is None  # no provider yet: the hot path measures nothing
    metrics.set_meter_provider(MeterProvider())
    assert _metrics.recording() is _metrics.instruments()
    print("ok")
    """
)


async def test_the_hot_path_measures_once_a_meter_provider_is_set() -> None:
    out = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-c", RECORDING_SCRIPT],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert out.stdout.strip() == "ok"
