"""steeple on PostgreSQL: the recurring-publication store (and, in ``queue``, the work queue).

``PostgresRecurringStore.initialize(...)`` / ``.connect(...)`` build the store;
``RecurringRelay`` is a ready worker loop (``RelayStatistics``: what it did so far);
``grant_runtime_role`` applies the runtime role's grants (the statements of
``runtime_grant_statements``, as in ``recurring/grants.sql``).

These names are loaded on first use: a program that imports only the work queue
(``steeple.postgres.queue``) does not load the recurring store or the recurring engine.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from steeple.postgres.recurring import (
        PostgresRecurringStore,
        RecurringRelay,
        RelayStatistics,
        grant_runtime_role,
        runtime_grant_statements,
    )

__all__ = [
    "PostgresRecurringStore",
    "RecurringRelay",
    "RelayStatistics",
    "grant_runtime_role",
    "runtime_grant_statements",
]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'steeple.postgres' has no attribute {name!r}")
    value = getattr(importlib.import_module("steeple.postgres.recurring"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
