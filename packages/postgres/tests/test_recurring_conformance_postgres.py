"""The recurring-store conformance suite (steeple.testing) against PostgreSQL."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable

import asyncpg
import pytest
from hypothesis import HealthCheck, settings

from steeple.core.config import RecurringConfig
from steeple.core.ports import Clock, RecurringStore
from steeple.keyring import Keyring, StorageKey
from steeple.postgres import PostgresRecurringStore
from steeple.testing.conformance.recurring import run_recurring_conformance

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

KEYRING = Keyring(StorageKey("conformance", os.urandom(32)))


def test_postgres_store_conforms(pg_dsn: str, pg_name: Callable[[str], str]) -> None:
    schema = pg_name("conf")

    async def make_store(config: RecurringConfig, clock: Clock) -> RecurringStore:
        return await PostgresRecurringStore.initialize(
            pg_dsn, config, KEYRING, clock, schema=schema
        )

    try:
        run_recurring_conformance(
            make_store,
            settings=settings(
                max_examples=int(os.environ.get("STEEPLE_CONFORMANCE_EXAMPLES", "40")),
                stateful_step_count=30,
                deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
            ),
        )
    finally:

        async def drop() -> None:
            conn = await asyncpg.connect(pg_dsn)
            try:
                await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
            finally:
                await conn.close()

        asyncio.run(drop())
