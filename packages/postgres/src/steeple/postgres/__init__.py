"""steeple on PostgreSQL: the recurring-publication store (and, in ``queue``, the work queue).

``PostgresRecurringStore.initialize(...)`` / ``.connect(...)`` build the store;
``RecurringRelay`` is a ready worker loop (``RelayStatistics``: what it did so far);
``grant_runtime_role`` applies the runtime role's grants (the statements of
``runtime_grant_statements``, as in ``recurring/grants.sql``).

These names are loaded on first use: a program that imports only the work queue
(``steeple.postgres.queue``) does not load the recurring store or the recurring engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from steeple.core._lazy import lazy_exports as _lazy_exports

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

__getattr__, __dir__ = _lazy_exports(
    "steeple.postgres", dict.fromkeys(__all__, "steeple.postgres.recurring"), globals(), __all__
)
