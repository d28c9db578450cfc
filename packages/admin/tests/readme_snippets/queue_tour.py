"""The work queue in five minutes: enqueue in your transaction, run a worker."""

import asyncio
import os
from datetime import timedelta

import asyncpg

from steeple.admin.embedded import database_url
from steeple.postgres import queue
from steeple.postgres.queue import EnqueueOptions, JobContext, JobError, Scheduler, Task

send_email: Task[dict[str, str]] = Task("send-email")


async def handle_send_email(ctx: JobContext, args: dict[str, str]) -> None:
    # ctx.run_id is stable across retries: use it as the idempotency key of side effects.
    if args["to"] == "flaky@example.com" and ctx.attempt == 1:
        raise JobError.retry("mail server busy", delay=timedelta(milliseconds=100))
    print("sent to", args["to"], "run", ctx.run_id)


async def main(dsn: str) -> None:
    schema = os.environ.get("STEEPLE_QUEUE_SCHEMA", "steeple_queue")
    conn = await asyncpg.connect(dsn)
    await queue.install(conn, schema=schema)  # or: steeple migrate

    # Enqueue inside your own transaction: the task exists only if your data commits.
    async with conn.transaction():
        first = await queue.enqueue(
            conn, send_email, {"to": "ada@example.com"}, EnqueueOptions.immediate(), schema=schema
        )
        await queue.enqueue(
            conn,
            send_email,
            {"to": "flaky@example.com"},
            EnqueueOptions.immediate(max_attempts=3),
            schema=schema,
        )
    soon = await conn.fetchval("SELECT clock_timestamp() + interval '1 second'")
    await queue.enqueue(
        conn, send_email, {"to": "later@example.com"}, EnqueueOptions.at(soon), schema=schema
    )

    worker = Scheduler(dsn, worker_id="tour-1", schema=schema, poll_interval=0.2)
    worker.register(send_email, handle_send_email)
    stop = asyncio.Event()
    running = asyncio.create_task(worker.run_until_shutdown(stop))
    await asyncio.sleep(3)  # in production: until SIGTERM (`steeple worker` does this)
    stop.set()
    await running

    state = await queue.run_state(conn, first.id, schema=schema)
    print(state.state.value)  # succeeded
    await conn.close()


if __name__ == "__main__":
    # STEEPLE_DATABASE_URL if set, else a private PostgreSQL in .steeple/tour (pgserver).
    with database_url(".steeple/tour") as dsn:
        asyncio.run(main(dsn))
