"""A PostgreSQL recurring store behind a :class:`FaultProxy`, for the recurring fault tests."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from faultproxy import FaultProxy
from steeple.core import RecurringConfig
from steeple.keyring import Keyring
from steeple.postgres import PostgresRecurringStore
from steeple.testing import FakeClock


@contextlib.asynccontextmanager
async def store_behind_proxy(
    dsn: str,
    schema: str,
    proxy: FaultProxy,
    config: RecurringConfig,
    keyring: Keyring,
    clock: FakeClock,
) -> AsyncIterator[PostgresRecurringStore]:
    """Initialize the namespace over the direct ``dsn``, then connect a store through ``proxy``.

    On exit the proxy is healed (pass-through, pending one-shot faults forgotten) before
    the store is closed, within a bound and ignoring the close's errors.
    """
    deployer = await PostgresRecurringStore.initialize(dsn, config, keyring, clock, schema=schema)
    await deployer.close()
    store = await PostgresRecurringStore.connect(proxy.dsn(), config, keyring, clock, schema=schema)
    try:
        yield store
    finally:
        proxy.pass_through()
        proxy.disarm()
        with contextlib.suppress(Exception):
            async with asyncio.timeout(10):
                await store.close()
