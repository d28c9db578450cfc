"""The recurring store's check of each new pooled connection, against a model.

A store's pool opens connections one by one; after a failover the DSN's first writable
host may be another cluster, or the old primary left behind on an older timeline. Random
sequences of the nodes new connections reach (a system identifier, a timeline) go through
the check the store's pool runs on every new connection (on a real connection: its
durability is checked on the server): it must admit exactly what the model admits (the
first node; then the same cluster on the same or a newer timeline, which is remembered)
and refuse every other with ``RecurringClusterError`` naming what it knew and what it saw.
"""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from steeple.core.cluster import ClusterWatch
from steeple.core.errors import RecurringClusterError
from steeple.postgres._durability import IDENTITY_QUERY
from steeple.postgres.recurring._store import _connection_checker

pytestmark = pytest.mark.postgres

NODES = st.lists(
    st.tuples(st.sampled_from([7001, 7002]), st.integers(1, 4)), min_size=1, max_size=8
)


class Reaching:
    """A real connection whose identity query answers ``node`` (the node it reached)."""

    def __init__(self, conn: asyncpg.Connection, node: tuple[int, int]) -> None:
        self._conn = conn
        self._node = node

    async def fetchrow(self, sql: str, *args: Any) -> Any:
        if sql == IDENTITY_QUERY:
            return self._node
        return await self._conn.fetchrow(sql, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


def admitted(nodes: list[tuple[int, int]]) -> list[bool]:
    """The model: which new connections are admitted, in order."""
    known: tuple[int, int] | None = None
    verdicts = []
    for system, timeline in nodes:
        ok = known is None or (system == known[0] and timeline >= known[1])
        if ok:
            known = (system, timeline)
        verdicts.append(ok)
    return verdicts


async def test_each_new_connection_is_admitted_exactly_when_the_model_admits_it(
    pg_dsn: str,
) -> None:
    loop = asyncio.get_running_loop()
    conn = await asyncpg.connect(pg_dsn)
    try:

        async def one(nodes: list[tuple[int, int]]) -> None:
            check = _connection_checker(ClusterWatch())
            known: tuple[int, int] | None = None
            for node, expected in zip(nodes, admitted(nodes), strict=True):
                if expected:
                    await check(Reaching(conn, node))  # type: ignore[arg-type]
                    known = node
                    continue
                with pytest.raises(RecurringClusterError) as refused:
                    await check(Reaching(conn, node))  # type: ignore[arg-type]
                assert (refused.value.known, refused.value.seen) == (known, node)

        @settings(
            max_examples=100,
            deadline=None,
            database=None,
            suppress_health_check=[HealthCheck.too_slow],
        )
        @given(nodes=NODES)
        def check(nodes: list[tuple[int, int]]) -> None:
            asyncio.run_coroutine_threadsafe(one(nodes), loop).result()

        await asyncio.to_thread(check)
    finally:
        await conn.close()
