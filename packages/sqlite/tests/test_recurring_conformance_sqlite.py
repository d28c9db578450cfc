"""The recurring-store conformance suite (steeple.testing) against the SQLite store.

Every example gets a fresh namespace in the same file, so the run also shows that
namespaces sharing a file see only their own rows.
"""

from __future__ import annotations

import os
from pathlib import Path

from hypothesis import HealthCheck, settings

from steeple.core.config import RecurringConfig
from steeple.core.ports import Clock, RecurringStore
from steeple.keyring import Keyring, StorageKey
from steeple.sqlite import SqliteRecurringStore
from steeple.testing.conformance.recurring import run_recurring_conformance

KEYRING = Keyring(StorageKey("conformance", os.urandom(32)))


def test_sqlite_store_conforms(tmp_path: Path) -> None:
    path = tmp_path / "conformance.db"

    async def make_store(config: RecurringConfig, clock: Clock) -> RecurringStore:
        return await SqliteRecurringStore.initialize(path, config, KEYRING, clock)

    run_recurring_conformance(
        make_store,
        settings=settings(
            max_examples=int(os.environ.get("STEEPLE_CONFORMANCE_EXAMPLES", "60")),
            stateful_step_count=30,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )
