"""Fixtures for the admin package's tests: keys, a seeded namespace on real PostgreSQL."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import attrs
import pytest
import typer.main
import typer.testing

from steeple.core import (
    MissedRunPolicy,
    RecurringConfig,
    RecurringDefinition,
    RecurringRelayError,
    ScheduledMessage,
    SystemClock,
)
from steeple.keyring import Keyring, StorageKey
from steeple.testing import MemoryBroker
from store_setup_support import initialize_patiently

NAMESPACE = "ops"


@attrs.frozen
class Seeded:
    """A namespace initialized with the CLI's default configuration and some history."""

    dsn: str
    schema: str
    keys: str
    occurrence_ids: tuple[str, ...]
    dead_id: str
    published: int
    task_ids: tuple[int, ...]

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("STEEPLE_")}
        env["STEEPLE_KEYS"] = self.keys
        env["STEEPLE_DATABASE_URL"] = self.dsn
        env["STEEPLE_SCHEMA"] = self.schema
        env["STEEPLE_QUEUE_SCHEMA"] = self.schema
        env["STEEPLE_NAMESPACE"] = NAMESPACE
        return env


def make_keys() -> tuple[str, Keyring]:
    key = StorageKey.generate("k1")
    return f"k1:{key.to_base64()}", Keyring(key)


@pytest.fixture(autouse=True, scope="session")
def _cli_built_once() -> Iterator[None]:
    """typer's ``CliRunner.invoke`` builds the click command from the app at every call,
    evaluating the annotations of every command anew: most of an in-process invocation's
    time. Built once per app, the same command runs every invocation (as in a process)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(typer.testing, "_get_command", functools.cache(typer.main.get_command))
        yield


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No STEEPLE_* variables from the outer environment leak into a test."""
    for name in list(os.environ):
        if name.startswith("STEEPLE_") and name != "STEEPLE_TEST_DSN":
            monkeypatch.delenv(name, raising=False)


async def seed_namespace(dsn: str, schema: str) -> Seeded:
    """Initialize ``ops`` in ``schema``, materialize ten minutes of a catch-up schedule, publish
    some, kill one (permanent broker failure), and enqueue a few tasks in the same schema."""
    from steeple.postgres import queue

    keys, keyring = make_keys()
    config = RecurringConfig(NAMESPACE, 1000, 100_000)
    now = datetime.now(UTC)
    store = await initialize_patiently(dsn, config, keyring, SystemClock(), schema=schema)
    try:
        for name, cron, policy in (
            ("minutely", "* * * * *", MissedRunPolicy.CATCH_UP),
            ("five-minutely", "*/5 * * * *", MissedRunPolicy.COALESCE),
        ):
            await store.create(
                RecurringDefinition(
                    name,
                    cron,
                    now - timedelta(minutes=10),
                    policy,
                    ScheduledMessage("ops.events", "Tick", b'{"secret":"payload"}', {"h": "v"}),
                )
            )
        await store.tick(100)
        broker = MemoryBroker()
        broker.fail_next(1, permanent=True)
        leases = await store.claim(100)
        names = {
            o.occurrence_id: o.definition_name for o in (await store.occurrences(limit=100)).items
        }
        # The permanent failure must hit a "minutely" occurrence (tests cancel the other).
        leases.sort(key=lambda lease: names[lease.occurrence_id] != "minutely")
        for lease in leases:
            # the permanent failure raises, and the store records the occurrence as dead
            with contextlib.suppress(RecurringRelayError):
                await store.relay(lease, broker)
        page = await store.occurrences(limit=100)
        dead = [o.occurrence_id for o in page.items if o.state.value == "dead"]
        assert len(dead) == 1, page.items
        ids = tuple(o.occurrence_id for o in page.items)
    finally:
        await store.close()
    conn = await asyncpg.connect(dsn)
    try:
        await queue.install(conn, schema=schema)
        task: queue.Task[Any] = queue.Task("send-report")
        task_ids = []
        for n in range(3):
            enqueued = await queue.enqueue(
                conn, task, {"n": n}, queue.EnqueueOptions.immediate(), schema=schema
            )
            task_ids.append(enqueued.id)
    finally:
        await conn.close()
    return Seeded(dsn, schema, keys, ids, dead[0], len(broker.published), tuple(task_ids))


@pytest.fixture
async def seeded(pg_schema: tuple[str, str]) -> Seeded:
    dsn, schema = pg_schema
    return await seed_namespace(dsn, schema)


@pytest.fixture
async def drop_queue_schema(pg_dsn: str) -> AsyncIterator[list[str]]:
    """Schemas a test names here are dropped after it (the demo makes <schema>_queue)."""
    names: list[str] = []
    yield names
    if names:
        conn = await asyncpg.connect(pg_dsn)
        try:
            for name in names:
                await conn.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')
        finally:
            await conn.close()
