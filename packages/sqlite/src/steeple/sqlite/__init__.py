"""steeple's embedded recurring-publication store: the recurring engine over one SQLite file.

:class:`SqliteRecurringStore` keeps one namespace's definitions and occurrences in a
SQLite file (WAL, ``synchronous=FULL``, mode 0600), single node, embedded: the same
contract, engine and conformance suite as the PostgreSQL store, with the standard
library's ``sqlite3`` on one dedicated thread per store. Content is sealed with the
keyring the caller passes (any :class:`~steeple.core.ports.Sealer`).

Errors are the recurring contract's (:mod:`steeple.core.errors`); what only a file can do
wrong has a subclass of ``RecurringStorageError`` in :mod:`steeple.sqlite.errors`.
"""

from steeple.sqlite._store import SqliteRecurringStore
from steeple.sqlite.errors import (
    SqliteCorruptionError,
    SqliteDiskFullError,
    SqliteDurabilityError,
    SqliteReadOnlyError,
    SqliteStorageError,
)

__all__ = [
    "SqliteCorruptionError",
    "SqliteDiskFullError",
    "SqliteDurabilityError",
    "SqliteReadOnlyError",
    "SqliteRecurringStore",
    "SqliteStorageError",
]
