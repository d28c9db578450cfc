"""The recurring stores that the shared operation tests run on.

Each store is a :class:`StoreKind`: how to open one for a test (given its configuration,
clock and random source) and two test-only peeks at what it stores (an occurrence's
sealed content, and replacing it to simulate tampering). To run every operation test on
a new store (the SQLite store, yours), add one ``StoreKind`` to :data:`STORE_KINDS`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import pytest

from steeple.core.config import RecurringConfig
from steeple.core.ports import Clock, RandomSource
from steeple.keyring import Keyring, StorageKey

KEYRING = Keyring(StorageKey("k1", b"\x2a" * 32))
"""The keyring every store under test seals with."""

Open = Callable[[dict[str, Any], RecurringConfig, Clock, RandomSource | None], Awaitable[Any]]


@attrs.frozen
class StoreKind:
    """A recurring store the operation tests run on.

    Attributes:
        name: the test id.
        open: ``await open(fixtures, config, clock, random)`` returns a new store for one
            namespace (the test closes it); ``fixtures`` holds the values of ``needs``.
        contents: ``await contents(store)`` maps occurrence ids to stored content
            (``None`` once erased).
        set_content: ``await set_content(store, occurrence_id, content)`` overwrites one
            occurrence's stored content (tampering).
        needs: pytest fixtures the store needs (e.g. ``pg_schema``).
        marks: pytest marks (``postgres`` for stores that need a server).
    """

    name: str
    open: Open
    contents: Callable[[Any], Awaitable[dict[str, bytes | None]]]
    set_content: Callable[[Any, str, bytes | None], Awaitable[None]]
    needs: tuple[str, ...] = ()
    marks: tuple[pytest.MarkDecorator, ...] = ()


@attrs.frozen
class OpenableStore:
    """A :class:`StoreKind` with the fixtures it needs resolved for one test."""

    kind: StoreKind
    fixtures: dict[str, Any]


OpenStore = Callable[..., Awaitable[Any]]
"""``await open_store(config, clock, *, random=None)``: a new store of the kind under test
(the ``open_store`` fixture of ``tests/conftest.py``)."""


# --- in memory ----------------------------------------------------------------------------


async def _open_memory(
    fixtures: dict[str, Any],
    config: RecurringConfig,
    clock: Clock,
    random: RandomSource | None,
) -> Any:
    from steeple.testing import InMemoryRecurringStore

    return InMemoryRecurringStore(config, clock, random=random, sealer=KEYRING)


async def _memory_contents(store: Any) -> dict[str, bytes | None]:
    return {i: o.content for i, o in store._occurrences.items()}


async def _memory_set_content(store: Any, occurrence_id: str, content: bytes | None) -> None:
    occurrences = store._occurrences
    occurrences[occurrence_id] = attrs.evolve(occurrences[occurrence_id], content=content)


# --- PostgreSQL ---------------------------------------------------------------------------


async def _open_postgres(
    fixtures: dict[str, Any],
    config: RecurringConfig,
    clock: Clock,
    random: RandomSource | None,
) -> Any:
    from steeple.postgres import PostgresRecurringStore

    dsn, schema = fixtures["pg_schema"]
    return await PostgresRecurringStore.initialize(
        dsn, config, KEYRING, clock, schema=schema, random=random
    )


async def _postgres_contents(store: Any) -> dict[str, bytes | None]:
    # A test-only peek through the store's own pool, at its own schema and namespace.
    async with store._pool.acquire() as conn:
        rows = await conn.fetch(
            f'SELECT id, content FROM "{store._schema}".recurring_occurrences WHERE namespace = $1',
            store.namespace,
        )
    return {r["id"]: None if r["content"] is None else bytes(r["content"]) for r in rows}


async def _postgres_set_content(store: Any, occurrence_id: str, content: bytes | None) -> None:
    async with store._pool.acquire() as conn:
        await conn.execute(
            f'UPDATE "{store._schema}".recurring_occurrences SET content = $3'
            " WHERE namespace = $1 AND id = $2",
            store.namespace,
            occurrence_id,
            content,
        )


# --- SQLite -------------------------------------------------------------------------------


async def _open_sqlite(
    fixtures: dict[str, Any],
    config: RecurringConfig,
    clock: Clock,
    random: RandomSource | None,
) -> Any:
    from steeple.sqlite import SqliteRecurringStore

    # One file per test, as PostgreSQL gives one schema per test.
    path = fixtures["tmp_path"] / "recurring.db"
    return await SqliteRecurringStore.initialize(path, config, KEYRING, clock, random=random)


async def _sqlite_contents(store: Any) -> dict[str, bytes | None]:
    # A test-only peek on the store's own thread and connection.
    storage = store._storage

    def peek(call: Any) -> dict[str, bytes | None]:
        rows = (
            storage.connection(call)
            .execute(
                "SELECT id, content FROM recurring_occurrences WHERE namespace = ?",
                (store.namespace,),
            )
            .fetchall()
        )
        return {i: None if c is None else bytes(c) for i, c in rows}

    result: dict[str, bytes | None] = await storage.run("peek", peek)
    return result


async def _sqlite_set_content(store: Any, occurrence_id: str, content: bytes | None) -> None:
    storage = store._storage

    def tamper(call: Any) -> None:
        storage.connection(call).execute(
            "UPDATE recurring_occurrences SET content = ? WHERE namespace = ? AND id = ?",
            (content, store.namespace, occurrence_id),
        )

    await storage.run("tamper", tamper)


STORE_KINDS: tuple[StoreKind, ...] = (
    StoreKind("memory", _open_memory, _memory_contents, _memory_set_content),
    StoreKind(
        "postgres",
        _open_postgres,
        _postgres_contents,
        _postgres_set_content,
        needs=("pg_schema",),
        marks=(pytest.mark.postgres,),
    ),
    StoreKind("sqlite", _open_sqlite, _sqlite_contents, _sqlite_set_content, needs=("tmp_path",)),
)
"""Every store the operation tests (``test_recurring_store_operations.py``) run on."""
