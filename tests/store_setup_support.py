"""Initialize a recurring namespace for a test's setup, patient with a loaded machine."""

from __future__ import annotations

from typing import Any

from steeple.core import RecurringDeadlineError
from steeple.postgres import PostgresRecurringStore

_ATTEMPTS = 4


async def initialize_patiently(*args: Any, **kwargs: Any) -> PostgresRecurringStore:
    """:meth:`PostgresRecurringStore.initialize`, tried again when one of its deadlines passes.

    The store's deadlines (5 s to connect, 5 s per statement or lock wait) are the
    product's, and right for it; a test's setup on a CI machine under load can miss them
    without anything being wrong. Initializing is idempotent, so trying again is safe; what
    a test asserts is never behind this.
    """
    for attempt in range(1, _ATTEMPTS + 1):
        try:
            return await PostgresRecurringStore.initialize(*args, **kwargs)
        except RecurringDeadlineError:
            if attempt == _ATTEMPTS:
                raise
    raise AssertionError("unreachable")
