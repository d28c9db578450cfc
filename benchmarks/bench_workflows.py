"""Workflows, side by side in one run (``python benchmarks/bench_workflows.py --dsn URL``).

1. The completion statement on tasks without dependents, with the workflow release
   (schema 12) and the same statement with the release cut out: alternating rounds, the
   median per task of each and their ratio.
2. 10,000 tasks in one statement: ``enqueue_many`` beside ``enqueue_workflow`` of a graph
   of ten layers (9,999 edges), the median of four and their ratio.

Each part uses its own schema, dropped afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import asyncpg

from steeple.postgres._arrays import array_literal
from steeple.postgres.queue import Task, Workflow, enqueue_many, enqueue_workflow, install
from steeple.postgres.queue._sql import QueueSql, queue_sql

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._run_names import drop_schemas, run_name

TASK: Task[Any] = Task("b")


async def _clear(conn: asyncpg.Connection, schema: str) -> None:
    await conn.execute(
        f'TRUNCATE "{schema}".tasks, "{schema}".attempts, "{schema}".task_dependencies'
    )


async def _complete_all(
    conn: asyncpg.Connection, schema: str, statement: str, sql: QueueSql, n: int, batch: int
) -> float:
    """Enqueue ``n`` tasks, claim and complete them in batches; microseconds per completion."""
    await enqueue_many(conn, TASK, [{}] * n, schema=schema)
    give_up = await conn.fetchval("SELECT extract(epoch FROM clock_timestamp()) + 600")
    spent = 0.0
    while rows := await conn.fetch(sql.claim, ["b"], batch, "w", give_up):
        ids = array_literal([r["id"] for r in rows])
        tokens = array_literal([r["lease_token"] for r in rows])
        started = time.perf_counter()
        await conn.fetch(statement, ids, tokens, "w", None, None)
        spent += time.perf_counter() - started
    await _clear(conn, schema)
    return spent / n * 1e6


async def completions(conn: asyncpg.Connection, schema: str, rounds: int) -> None:
    sql = queue_sql(schema)
    with_release = sql.complete
    without = re.sub(
        r", settled AS MATERIALIZED \(.*? AS released\)\nSELECT id FROM done, settled",
        "\nSELECT id FROM done",
        with_release,
        flags=re.DOTALL,
    )
    assert "settle" not in without, "the release was not cut out"
    n, batch = 2000, 50
    for statement in (with_release, without):  # warm up both
        await _complete_all(conn, schema, statement, sql, n, batch)
    base: list[float] = []
    head: list[float] = []
    for _ in range(rounds):
        base.append(await _complete_all(conn, schema, without, sql, n, batch))
        head.append(await _complete_all(conn, schema, with_release, sql, n, batch))
    b, h = statistics.median(base), statistics.median(head)
    print(
        f"complete per task, batches of {batch}, no dependents: without release {b:.1f} us, "
        f"with release {h:.1f} us, ratio {h / b:.3f}x (median of {rounds} alternating rounds "
        f"of {n})"
    )


def _layers() -> Workflow:
    workflow = Workflow()
    previous = [workflow.add(TASK, {"i": 0})]
    for _ in range(9):
        previous = [
            workflow.add(TASK, {"i": i}, after=[previous[i % len(previous)]]) for i in range(1111)
        ]
    return workflow


async def graphs(conn: asyncpg.Connection, schema: str) -> None:
    many: list[float] = []
    graph: list[float] = []
    for _ in range(4):
        started = time.perf_counter()
        await enqueue_many(conn, TASK, [{"i": i} for i in range(10_000)], schema=schema)
        many.append(time.perf_counter() - started)
        workflow = _layers()
        started = time.perf_counter()
        await enqueue_workflow(conn, workflow, schema=schema)
        graph.append(time.perf_counter() - started)
        await _clear(conn, schema)
    m, g = statistics.median(many), statistics.median(graph)
    print(
        f"10,000 tasks in one statement: enqueue_many {m * 1e3:.0f} ms, enqueue_workflow "
        f"(10 layers, 9,999 edges) {g * 1e3:.0f} ms, ratio {g / m:.2f}x (median of 4; "
        "building the Workflow in Python not counted)"
    )


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", required=True)
    parser.add_argument("--rounds", type=int, default=6)
    options = parser.parse_args()
    conn = await asyncpg.connect(options.dsn)
    schema = run_name("steeple_bench_workflows")
    try:
        await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')  # a killed run's leftover
        await install(conn, schema=schema)
        await completions(conn, schema, options.rounds)
        await graphs(conn, schema)
    finally:
        await conn.close()
        await drop_schemas(options.dsn, schema)


if __name__ == "__main__":
    asyncio.run(main())
