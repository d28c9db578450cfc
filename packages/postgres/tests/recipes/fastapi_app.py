"""FastAPI: a queue worker in the app's lifespan, and enqueue in the request's transaction."""

import os
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TypedDict

import asyncpg
from fastapi import FastAPI, HTTPException, Request

from steeple.postgres import queue
from steeple.postgres.queue import JobContext, Scheduler, Task
from steeple.postgres.queue.contrib.asgi import running_workers

DSN = os.environ["STEEPLE_DATABASE_URL"]
SCHEMA = os.environ.get("STEEPLE_QUEUE_SCHEMA", "steeple_queue")

send_receipt: Task[dict[str, int]] = Task("send-receipt")


async def handle_send_receipt(ctx: JobContext, args: dict[str, int]) -> None:
    print("receipt sent for order", args["order"], flush=True)


class State(TypedDict):
    pool: asyncpg.Pool
    worker: Scheduler


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[State]:
    worker = Scheduler(DSN, worker_id=f"{socket.gethostname()}-{os.getpid()}", schema=SCHEMA)
    worker.register(send_receipt, handle_send_receipt)
    # Start-up fails if the worker cannot start (schema missing, database unfit...).
    # At shutdown (SIGTERM) the worker stops claiming and running handlers get 20 s.
    async with asyncpg.create_pool(DSN) as pool, running_workers(worker, drain_timeout=20):
        yield {"pool": pool, "worker": worker}


app = FastAPI(lifespan=lifespan)


@app.post("/orders/{order}")
async def place_order(order: int, request: Request, declined: bool = False) -> dict[str, int]:
    async with request.state.pool.acquire() as conn, conn.transaction():
        await conn.execute("INSERT INTO orders (id) VALUES ($1)", order)
        queued = await queue.enqueue(conn, send_receipt, {"order": order}, schema=SCHEMA)
        if declined:  # raised inside the transaction: the order and its task roll back
            raise HTTPException(status_code=402, detail="payment declined")
    return {"order": order, "task": queued.id}


@app.get("/health")
async def health(request: Request) -> dict[str, str]:
    return {"worker": request.state.worker.health().value}  # for the readiness probe
