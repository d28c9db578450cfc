"""The work queue in five minutes: declare tasks, enqueue in your transaction, run a worker."""

import asyncio
import os
import time
from datetime import timedelta

import asyncpg

from steeple.admin.embedded import database_url
from steeple.postgres import queue
from steeple.postgres.queue import JobContext, JobError, RetryPolicy

app = queue.App(schema=os.environ.get("STEEPLE_QUEUE_SCHEMA", "steeple_queue"))


@app.task(name="send-email", max_attempts=3)
async def send_email(ctx: JobContext, args: dict[str, str]) -> None:
    # ctx.run_id is stable across retries: use it as the idempotency key of side effects.
    if args["to"] == "flaky@example.com" and ctx.attempt == 1:
        raise JobError.retry("mail server busy", delay=timedelta(milliseconds=100))
    print("sent to", args["to"], "run", ctx.run_id)


# A plain def runs in the worker's thread pool. retry= makes its ordinary exceptions
# retryable (by default only JobError.retry retries); what it returns is stored.
@app.task(name="thumbnail", retry=RetryPolicy(max_attempts=4, base_delay=timedelta(seconds=0.1)))
def thumbnail(ctx: JobContext, args: dict[str, int]) -> dict[str, int]:
    for done in range(1, 5):
        time.sleep(0.05)  # blocking work is fine here: it is not the event loop
        ctx.report_progress(done / 4, f"tile {done} of 4")
    if ctx.attempt == 1:
        raise TimeoutError("the image store timed out")
    return {"width": args["width"] // 4}


async def main(dsn: str) -> None:
    conn = await asyncpg.connect(dsn)
    await queue.install(conn, schema=app.schema)  # or: steeple migrate

    # Enqueue inside your own transaction: the tasks exist only if your data commits.
    async with conn.transaction():
        first = await send_email.enqueue(conn, {"to": "ada@example.com"})
        await send_email.enqueue(conn, {"to": "flaky@example.com"})
    await send_email.enqueue(conn, {"to": "later@example.com"}, delay=timedelta(seconds=1))
    thumb = await thumbnail.enqueue(conn, {"width": 1024})

    worker = app.scheduler(dsn, worker_id="tour-1", poll_interval=0.2)  # every task of app
    stop = asyncio.Event()
    running = asyncio.create_task(worker.run_until_shutdown(stop))
    await asyncio.sleep(3)  # in production: until SIGTERM (`steeple worker` does this)
    stop.set()
    await running

    done = await queue.run_state(conn, thumb.id, schema=app.schema)
    print(done.result, done.progress)  # {'width': 256} Progress(fraction=1.0, message=...)
    for attempt in done.history:  # each failed attempt keeps its type and traceback
        print(attempt.attempt, attempt.outcome, attempt.error_type or "")
    state = await queue.run_state(conn, first.id, schema=app.schema)
    print(state.state.value)  # succeeded
    await conn.close()


if __name__ == "__main__":
    # STEEPLE_DATABASE_URL if set, else a private PostgreSQL in .steeple/tour (pgserver).
    with database_url(".steeple/tour") as dsn:
        asyncio.run(main(dsn))
