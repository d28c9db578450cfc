"""A store proves itself: steeple.testing's conformance machine, run on the SQLite store."""

import tempfile
from pathlib import Path

from hypothesis import settings

from steeple.core import RecurringConfig
from steeple.core.ports import Clock, RecurringStore
from steeple.keyring import Keyring, StorageKey
from steeple.sqlite import SqliteRecurringStore
from steeple.testing.conformance.recurring import DEFAULT_SETTINGS, run_recurring_conformance

path = Path(tempfile.mkdtemp()) / "conformance.db"
keyring = Keyring(StorageKey.generate("conformance"))


async def make_store(config: RecurringConfig, clock: Clock) -> RecurringStore:
    # Called once per example, with a fresh namespace and the machine's fake clock.
    return await SqliteRecurringStore.initialize(path, config, keyring, clock)


# Random sequences of every operation beside an independent model; if the store breaks
# the contract, hypothesis shows the shortest sequence of steps that does.
run_recurring_conformance(
    make_store, settings=settings(DEFAULT_SETTINGS, max_examples=20, database=None)
)
print("the SQLite store conforms")
