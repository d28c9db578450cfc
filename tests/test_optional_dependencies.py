"""Optional extras stay optional: every module imports, and the queue works, without them.

Each check runs in a fresh interpreter whose import system refuses the optional packages
(a ``sys.meta_path`` finder raising ``ModuleNotFoundError``, as if they were not
installed), so an import of an extra at module import time fails here, whatever the
development environment has installed.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.postgres

# Every optional extra of every package (and the test-only SDK): none may be needed to
# import a module or to run the plain asyncpg path of the queue and the CLI.
OPTIONAL = (
    "opentelemetry",
    "psycopg",
    "psycopg_pool",
    "psycopg_binary",
    "nats",
    "redis",
    "aio_pika",
    "aiormq",
)

BLOCKER = textwrap.dedent(
    """
    import importlib.abc, sys

    BLOCKED = set(sys.argv[1].split(","))

    class Blocker(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"No module named {name!r} (blocked)", name=name)
            return None

    sys.meta_path.insert(0, Blocker())
    for name in list(sys.modules):
        assert name.split(".")[0] not in BLOCKED, f"{name} was imported before the blocker"
    """
)

IMPORT_ALL = textwrap.dedent(
    """
    import importlib, pkgutil

    def import_all(package_name):
        package = importlib.import_module(package_name)
        names = [package_name]
        for info in pkgutil.walk_packages(package.__path__, package_name + "."):
            importlib.import_module(info.name)
            names.append(info.name)
        return names
    """
)

POSTGRES_SCRIPT = (
    BLOCKER
    + IMPORT_ALL
    + textwrap.dedent(
        """
    import asyncio
    import asyncpg

    modules = import_all("steeple.postgres")
    from steeple.postgres.queue import Scheduler, Task, enqueue, install, run_state

    async def main():
        dsn, schema = sys.argv[2:4]
        conn = await asyncpg.connect(dsn)
        try:
            await install(conn, schema=schema)
            task = Task("smoke")
            done = asyncio.Event()
            worker = Scheduler(dsn, worker_id="smoke", schema=schema, poll_interval=0.05)

            async def handle(ctx, args):
                assert args == {"n": 1}
                done.set()

            worker.register(task, handle)
            stop = asyncio.Event()
            run = asyncio.create_task(worker.run_until_shutdown(stop))
            queued = await enqueue(conn, task, {"n": 1}, schema=schema)
            await asyncio.wait_for(done.wait(), 60)
            while (await run_state(conn, queued.id, schema=schema)).state.value != "succeeded":
                await asyncio.sleep(0.02)
            stop.set()
            await run
            # Without opentelemetry, no trace context is written.
            context = await conn.fetchval(
                f'SELECT trace_context FROM "{schema}".tasks WHERE id = $1', queued.id
            )
            assert context is None, context
        finally:
            await conn.close()

    asyncio.run(main())
    leaked = sorted(n for n in sys.modules if n.split(".")[0] in BLOCKED)
    assert not leaked, leaked
    print("imported", len(modules), "modules; a task ran")
    """
    )
)

OTHERS_SCRIPT = (
    BLOCKER
    + IMPORT_ALL
    + textwrap.dedent(
        """
    import steeple.brokers

    counts = {}
    for package in ("steeple.core", "steeple.keyring", "steeple.testing", "steeple.admin"):
        counts[package] = len(import_all(package))
    # The brokers' backend modules ARE their extras; the rest must import without them.
    importlib.import_module("steeple.brokers._common")
    importlib.import_module("steeple.brokers.sqlite")
    assert steeple.brokers.SqliteJournalBroker is not None
    for name, extra in [("JetStreamBroker", "[nats]"), ("RedisStreamBroker", "[redis]"),
                        ("RabbitMQBroker", "[rabbitmq]")]:
        try:
            getattr(steeple.brokers, name)
        except ImportError as exc:
            assert f"steeple-brokers{extra}" in str(exc), str(exc)
        else:
            raise AssertionError(f"{name} imported without its extra")

    from steeple.admin.cli import main

    dsn, schema = sys.argv[2:4]
    sys.argv = ["steeple", "migrate", "--dsn", dsn, "--queue-schema", schema]
    try:
        main()
    except SystemExit as exc:
        assert exc.code in (0, None), exc.code
    print("imported", counts)
    """
    )
)


async def _run(script: str, *args: str) -> str:
    proc = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-c", script, ",".join(OPTIONAL), *args],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


async def test_postgres_imports_and_runs_a_task_without_any_optional_extra(
    pg_schema: tuple[str, str],
) -> None:
    dsn, schema = pg_schema
    out = await _run(POSTGRES_SCRIPT, dsn, schema)
    assert "a task ran" in out


async def test_other_packages_and_the_cli_without_optional_extras(
    pg_schema: tuple[str, str],
) -> None:
    dsn, schema = pg_schema
    out = await _run(OTHERS_SCRIPT, dsn, schema)
    assert f"work queue schema {schema!r} is at version" in out
    assert "imported" in out


def test_the_blocker_really_blocks() -> None:
    """The finder turns an installed optional package into a missing one."""
    script = BLOCKER + "import opentelemetry\n"
    proc = subprocess.run(
        [sys.executable, "-c", script, ",".join(OPTIONAL)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    assert "ModuleNotFoundError" in proc.stderr
