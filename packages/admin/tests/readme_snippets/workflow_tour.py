"""A workflow: fetch, then two parses side by side, then a report that reads their results."""

import asyncio
import os

import asyncpg

from steeple.admin.embedded import database_url
from steeple.postgres import queue
from steeple.postgres.queue import JobContext

app = queue.App(schema=os.environ.get("STEEPLE_QUEUE_SCHEMA", "steeple_queue"))
pool: asyncpg.Pool


@app.task(name="fetch")
async def fetch(ctx: JobContext, args: dict[str, str]) -> int:
    return len(args["url"])


@app.task(name="parse")
async def parse(ctx: JobContext, args: dict[str, int]) -> int:
    (source,) = await queue.parent_results(pool, ctx.task_id, schema=app.schema)
    return int(source.result) * args["factor"]  # a result is JSON: here fetch's int


@app.task(name="report")
async def report(ctx: JobContext, args: None) -> list[int]:
    parents = await queue.parent_results(pool, ctx.task_id, schema=app.schema)
    return sorted(p.result for p in parents)


async def main(dsn: str) -> None:
    global pool
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=4)
    async with pool.acquire() as conn:
        await queue.install(conn, schema=app.schema)  # or: steeple migrate
    wf = queue.Workflow()
    first = wf.add(fetch, {"url": "https://example.com"})
    parts = wf.group((parse, {"factor": 2}), (parse, {"factor": 3}), after=[first])
    last = wf.add(report, None, after=parts)  # runs once both parses succeeded
    async with pool.acquire() as conn, conn.transaction():  # one statement, your transaction
        handle = await queue.enqueue_workflow(conn, wf, schema=app.schema)

    worker = app.scheduler(dsn, worker_id="workflow-tour", poll_interval=0.2)
    stop = asyncio.Event()
    running = asyncio.create_task(worker.run_until_shutdown(stop))
    # Read the graph until every task finished (here; in production the worker runs on).
    graph = await queue.workflow_state(pool, handle.workflow_id, schema=app.schema)
    while not graph.finished:
        await asyncio.sleep(0.1)
        graph = await queue.workflow_state(pool, handle.workflow_id, schema=app.schema)
    stop.set()
    await running
    print([t.run.state.value for t in graph.tasks])  # every one succeeded
    print((await queue.run_state(pool, handle.id_of(last), schema=app.schema)).result)
    await pool.close()


if __name__ == "__main__":
    # STEEPLE_DATABASE_URL if set, else a private PostgreSQL in .steeple/tour (pgserver).
    with database_url(".steeple/tour") as dsn:
        asyncio.run(main(dsn))
