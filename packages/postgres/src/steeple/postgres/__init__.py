"""steeple on PostgreSQL: the recurring-publication store (and, in ``queue``, the work queue).

``PostgresRecurringStore.initialize(...)`` / ``.connect(...)`` build the store;
``RecurringRelay`` is a ready worker loop (``RelayStatistics``: what it did so far);
``grant_runtime_role`` applies the runtime role's grants (``recurring/grants.sql``).
"""

from steeple.postgres.recurring import (
    PostgresRecurringStore,
    RecurringRelay,
    RelayStatistics,
    grant_runtime_role,
)

__all__ = ["PostgresRecurringStore", "RecurringRelay", "RelayStatistics", "grant_runtime_role"]
