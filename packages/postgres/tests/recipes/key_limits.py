"""Per-key limits: one import at a time per customer, 10 emails a second per tenant."""

from datetime import timedelta

import asyncpg

from steeple.postgres import queue
from steeple.postgres.queue import EnqueueOptions, Task

IMPORT: Task[dict[str, str]] = Task("import-file")
EMAIL: Task[dict[str, str]] = Task("send-email")


async def set_up(conn: asyncpg.Connection, schema: str = "steeple_queue") -> None:
    # Every worker together: one import running per customer, ten emails started per
    # second per tenant. A full key's tasks wait; other keys' tasks run past them.
    await queue.limit_queue(conn, "imports", max_running_per_key=1, schema=schema)
    await queue.limit_queue(
        conn, "mail", rate_limit_per_key=10, per_key=timedelta(seconds=1), schema=schema
    )


async def enqueue_work(
    conn: asyncpg.Connection, customer: str, schema: str = "steeple_queue"
) -> None:
    imports = EnqueueOptions(queue="imports", limit_key=customer)
    await queue.enqueue(conn, IMPORT, {"file": "orders.csv"}, imports, schema=schema)
    mail = EnqueueOptions(queue="mail", limit_key=f"tenant-of-{customer}")
    await queue.enqueue(conn, EMAIL, {"to": "ada@example.com"}, mail, schema=schema)
