"""steeple on PostgreSQL: the recurring-publication store (and, in ``queue``, the work queue).

``PostgresRecurringStore.initialize(...)`` / ``.connect(...)`` build the store;
``RecurringRelay`` is a ready worker loop (``RelayStatistics``: what it did so far);
``grant_runtime_role`` applies the runtime role's grants (the statements of
``runtime_grant_statements``, as in ``recurring/grants.sql``).
"""

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
