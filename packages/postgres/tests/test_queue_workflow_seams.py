"""Where workflows meet older code: a task enqueued after others keeps its limit key (schema
15), and a worker's maintenance settles waiting tasks whose parents were ended by a worker of
an earlier release, which settles nothing (a rolling upgrade)."""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg
import pytest

from queue_support import QueueFixture, wait_until
from steeple.core.workflows import ParentFailure
from steeple.postgres._arrays import text_array
from steeple.postgres.queue import (
    EnqueueOptions,
    JobContext,
    Scheduler,
    Task,
    Workflow,
    enqueue,
    enqueue_workflow,
    limit_queue,
)
from steeple.postgres.queue._sql import queue_sql

pytestmark = pytest.mark.postgres

STEP: Task[Any] = Task("seam-step")


async def _claim(conn: asyncpg.Connection, schema: str, want: int) -> list[int]:
    give_up = await conn.fetchval("SELECT extract(epoch FROM clock_timestamp()) + 60")
    rows = await conn.fetch(
        queue_sql(schema).claim_timed,
        ["default"],
        text_array([want]),
        [STEP.name],
        "w",
        give_up,
        [None],
        [None],
        [None],
    )
    return [r["id"] for r in rows if r["id"] is not None]


async def _old_end(conn: asyncpg.Connection, schema: str, task_id: int, state: str) -> None:
    """End a task as a worker of an earlier release does: no settlement of its dependents."""
    await conn.execute(
        f'UPDATE "{schema}".tasks SET state = $2, lease_token = NULL, lease_expires_at = NULL,'
        " finished_at = clock_timestamp() WHERE id = $1",
        task_id,
        state,
    )


async def _state(conn: asyncpg.Connection, schema: str, task_id: int) -> str:
    return str(await conn.fetchval(f'SELECT state FROM "{schema}".tasks WHERE id = $1', task_id))


async def test_tasks_enqueued_after_others_keep_their_limit_key_and_its_limit_holds(
    queue: QueueFixture,
) -> None:
    """Before schema 15 enqueue_graph stored no limit_key: both keyed dependents ran at once."""
    _, schema, conn = queue
    await limit_queue(conn, "default", max_running_per_key=1, schema=schema)
    wf = Workflow()
    first = wf.add(STEP, {})
    keyed = [wf.add(STEP, {}, EnqueueOptions(limit_key="k"), after=[first]) for _ in range(2)]
    handle = await enqueue_workflow(conn, wf, schema=schema)
    later = await enqueue(
        conn, STEP, {}, EnqueueOptions(limit_key="k"), after=[handle.id_of(first)], schema=schema
    )
    ids = [handle.id_of(s) for s in keyed] + [later.id]
    keys = await conn.fetch(
        f'SELECT id, limit_key FROM "{schema}".tasks WHERE id = ANY($1::bigint[]) ORDER BY id',
        ids,
    )
    assert [(r["id"], r["limit_key"]) for r in keys] == [(i, "k") for i in sorted(ids)]
    assert await _claim(conn, schema, 10) == [handle.id_of(first)]
    token = await conn.fetchval(
        f'SELECT lease_token FROM "{schema}".tasks WHERE id = $1', handle.id_of(first)
    )
    sql = queue_sql(schema)
    assert await conn.fetch(
        sql.complete, f"{{{handle.id_of(first)}}}", f"{{{token}}}", "w", [None], [None]
    )
    assert [await _state(conn, schema, i) for i in ids] == ["pending"] * 3
    taken = await _claim(conn, schema, 10)
    assert len(taken) == 1
    assert taken[0] in ids
    assert await _claim(conn, schema, 10) == []


async def test_maintenance_settles_dependents_of_tasks_ended_by_an_earlier_release(
    queue: QueueFixture,
) -> None:
    """Before: B stayed waiting forever after its parent was ended without settlement."""
    dsn, schema, conn = queue
    ran: list[int] = []
    parent = await enqueue(conn, STEP, {"s": "a"}, schema=schema)
    child = await enqueue(conn, STEP, {"s": "b"}, after=[parent], schema=schema)
    doomed = await enqueue(conn, STEP, {"s": "c"}, schema=schema)
    cancelled = await enqueue(conn, STEP, {"s": "d"}, after=[doomed], schema=schema)
    anyway = await enqueue(
        conn, STEP, {"s": "e"}, after=[doomed, parent],
        on_parent_failure=ParentFailure.RUN, schema=schema,
    )  # fmt: skip
    # Claimed and ended as a worker of the earlier release would: no settlement.
    assert sorted(await _claim(conn, schema, 10)) == [parent.id, doomed.id]
    await _old_end(conn, schema, parent.id, "succeeded")
    await _old_end(conn, schema, doomed.id, "failed")
    assert await _state(conn, schema, child.id) == "waiting"

    def handle(ctx: JobContext, args: Any) -> None:
        ran.append(ctx.task_id)

    worker = Scheduler(
        dsn, worker_id="seams", schema=schema, poll_interval=0.05, maintenance_interval=0.05
    )
    worker.register(STEP, handle)
    stop = asyncio.Event()
    run = asyncio.create_task(worker.run_until_shutdown(stop, drain_timeout=10.0))
    try:

        async def settled() -> bool:
            states = [await _state(conn, schema, t.id) for t in (child, cancelled, anyway)]
            return states == ["succeeded", "cancelled", "succeeded"] or run.done()

        await wait_until(settled)
        if run.done():
            run.result()
    finally:
        stop.set()
        await asyncio.wait_for(run, 30)
    assert sorted(ran) == sorted([child.id, anyway.id])
    waiting_on = await conn.fetch(
        f'SELECT waiting_on FROM "{schema}".tasks WHERE id = ANY($1::bigint[])',
        [child.id, anyway.id],
    )
    assert [r[0] for r in waiting_on] == [0, 0]


async def test_a_dependent_whose_unsettled_parent_was_pruned_is_settled_as_after_a_failure(
    queue: QueueFixture,
) -> None:
    """Before: a waiting task whose every parent was deleted unsettled waited forever.

    The parent's outcome is unknown once its row is gone, so it does not count as a success:
    the dependent that runs only after successes is cancelled (and its own dependent after
    it), the one that runs anyway becomes due.
    """
    _dsn, schema, conn = queue
    sql = queue_sql(schema)
    parent = await enqueue(conn, STEP, {"s": "a"}, schema=schema)
    child = await enqueue(conn, STEP, {"s": "b"}, after=[parent], schema=schema)
    grandchild = await enqueue(conn, STEP, {"s": "c"}, after=[child], schema=schema)
    anyway = await enqueue(
        conn, STEP, {"s": "d"}, after=[parent], on_parent_failure=ParentFailure.RUN, schema=schema
    )
    assert await _claim(conn, schema, 10) == [parent.id]
    await _old_end(conn, schema, parent.id, "succeeded")
    await conn.execute(f'DELETE FROM "{schema}".tasks WHERE id = $1', parent.id)  # pruned
    await conn.fetch(sql.settle_stranded, 100, 0)
    assert await _state(conn, schema, child.id) == "cancelled"
    assert await _state(conn, schema, anyway.id) == "pending"
    error = await conn.fetchval(f'SELECT last_error FROM "{schema}".tasks WHERE id = $1', child.id)
    assert "deleted" in error
    # The cancelled one's dependent has no live parent left: the next pass settles it.
    await conn.fetch(sql.settle_stranded, 100, 0)
    assert await _state(conn, schema, grandchild.id) == "cancelled"
    assert await _claim(conn, schema, 10) == [anyway.id]
