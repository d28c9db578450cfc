"""The framework recipes are real: the docs include these files verbatim, and each runs
against a real PostgreSQL in its real framework.

- FastAPI (``recipes/fastapi_app.py``): served by uvicorn in its own process; a request
  commits an order and its task together, a declined one rolls both back, the in-process
  worker runs the task, and SIGTERM stops the server through the lifespan (drained).
- Django (``recipes/django_project``, the recipe is ``shop/views.py``): a minimal real
  project on Django's own PostgreSQL backend (psycopg 3), driven by Django's test client in
  its own process; the view enqueues on ``django.db.connection.connection`` inside
  ``transaction.atomic()``.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import asyncpg
import httpx

from queue_support import QueueFixture, wait_until
from steeple.postgres.queue import JobContext, Scheduler, Task, run_state

HERE = Path(__file__).parent
RECIPES = HERE / "recipes"
ROOT = HERE.parents[2]
RECIPE_FILES = ("fastapi_app.py", "django_project/shop/views.py")
RECEIPT: Task[dict[str, int]] = Task("send-receipt")  # the recipes' task, by name


def test_the_docs_include_every_recipe() -> None:
    docs = (ROOT / "docs" / "queue" / "recipes.md").read_text(encoding="utf-8")
    included = set(re.findall(r'--8<-- "(packages/postgres/tests/recipes/\S+?)"', docs))
    assert included == {f"packages/postgres/tests/recipes/{name}" for name in RECIPE_FILES}


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STEEPLE_", "DJANGO_"))}
    env.update(extra)
    return env


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


async def _task_ids(conn: asyncpg.Connection, schema: str) -> list[int]:
    rows = await conn.fetch(f'SELECT id FROM "{schema}".tasks ORDER BY id')
    return [r[0] for r in rows]


async def test_the_fastapi_recipe_under_uvicorn(queue: QueueFixture, tmp_path: Path) -> None:
    dsn, schema, conn = queue
    await conn.execute(f'CREATE TABLE "{schema}".orders (id integer PRIMARY KEY)')
    # The app's own table is found through the search path (asyncpg passes unknown DSN
    # parameters as server settings); the queue's schema is named explicitly.
    app_dsn = dsn + ("&" if "?" in dsn else "?") + f"search_path={schema}"
    port = _free_port()
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    with out.open("w") as stdout, err.open("w") as stderr:
        server = subprocess.Popen(  # noqa: ASYNC220 - started once, awaited in threads
            [
                sys.executable, "-m", "uvicorn", "fastapi_app:app", "--app-dir", str(RECIPES),
                "--host", "127.0.0.1", "--port", str(port), "--no-access-log",
            ],
            env=_env(STEEPLE_DATABASE_URL=app_dsn, STEEPLE_QUEUE_SCHEMA=schema),
            stdout=stdout,
            stderr=stderr,
        )  # fmt: skip
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:

            async def ready() -> bool:
                assert server.poll() is None, err.read_text()
                try:
                    answer = await client.get("/health")
                except httpx.TransportError:
                    return False
                return answer.status_code == 200 and answer.json() == {"worker": "healthy"}

            await wait_until(ready, timeout=60)

            placed = await client.post("/orders/1")
            assert placed.status_code == 200, placed.text
            task_id = placed.json()["task"]
            assert placed.json() == {"order": 1, "task": task_id}

            async def ran() -> bool:
                return (await run_state(conn, task_id, schema=schema)).state.value == "succeeded"

            await wait_until(ran)  # run by the worker inside the web process

            declined = await client.post("/orders/2", params={"declined": "true"})
            assert declined.status_code == 402
            assert declined.json() == {"detail": "payment declined"}

        orders = [r[0] for r in await conn.fetch(f'SELECT id FROM "{schema}".orders')]
        assert orders == [1]  # the declined order rolled back ...
        assert await _task_ids(conn, schema) == [task_id]  # ... and its task with it

        server.send_signal(signal.SIGTERM)  # the server's graceful shutdown: the lifespan
        # uvicorn shuts down gracefully, then re-raises the signal it caught (so the exit
        # status says SIGTERM); the log below shows the lifespan's exit completed.
        assert await asyncio.to_thread(server.wait, 60) == -signal.SIGTERM
    finally:
        if server.poll() is None:
            server.kill()
            await asyncio.to_thread(server.wait, 60)
    log = err.read_text()
    assert "Application startup complete" in log
    assert "Application shutdown complete" in log  # the lifespan's exit (the drain) finished
    assert "Traceback" not in log
    assert out.read_text().splitlines() == ["receipt sent for order 1"]


async def test_the_django_recipe_in_a_real_project(queue: QueueFixture) -> None:
    dsn, schema, conn = queue
    project = RECIPES / "django_project"
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, str(project / "drive.py")],
        env=_env(
            STEEPLE_DATABASE_URL=dsn,
            STEEPLE_QUEUE_SCHEMA=schema,
            DJANGO_SETTINGS_MODULE="project.settings",
            PYTHONPATH=str(project),
        ),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    placed, declined = (json.loads(line) for line in done.stdout.splitlines())
    assert placed["status"] == 200
    assert declined == {"status": 402, "body": {"error": "payment declined"}}

    # Django's table, in this test's schema (Django's search path), and the queue's.
    orders = await conn.fetch(f'SELECT id, item FROM "{schema}".shop_order ORDER BY id')
    assert [(r["id"], r["item"]) for r in orders] == [(placed["body"]["order"], "book")]
    task_id = placed["body"]["task"]
    assert await _task_ids(conn, schema) == [task_id]  # the declined order's task rolled back
    row = await conn.fetchrow(f'SELECT task_name, args::text FROM "{schema}".tasks')
    assert row is not None
    assert (row["task_name"], json.loads(row["args"])) == (
        "send-receipt",
        {"order": placed["body"]["order"]},
    )

    # A worker (here in this process; in production `steeple worker`) runs it.
    seen: list[Any] = []

    async def handle(ctx: JobContext, args: dict[str, int]) -> None:
        seen.append(args)

    worker = Scheduler(dsn, worker_id="django-worker", schema=schema, poll_interval=0.05)
    worker.register(RECEIPT, handle)
    stop = asyncio.Event()
    running = asyncio.create_task(worker.run_until_shutdown(stop))

    async def ran() -> bool:
        return (await run_state(conn, task_id, schema=schema)).state.value == "succeeded"

    try:
        await wait_until(ran)
    finally:
        stop.set()
        await running
    assert seen == [{"order": placed["body"]["order"]}]
