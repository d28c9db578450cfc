"""The PostgreSQL recurring-publication store and its relay loop."""

from steeple.postgres.recurring._grants import grant_runtime_role, runtime_grant_statements
from steeple.postgres.recurring._relay import RecurringRelay, RelayStatistics
from steeple.postgres.recurring._sql import RUNTIME_PRIVILEGES, SCHEMA_VERSION, TABLES
from steeple.postgres.recurring._store import SERVER_SETTINGS, PostgresRecurringStore

__all__ = [
    "RUNTIME_PRIVILEGES",
    "SCHEMA_VERSION",
    "SERVER_SETTINGS",
    "TABLES",
    "PostgresRecurringStore",
    "RecurringRelay",
    "RelayStatistics",
    "grant_runtime_role",
    "runtime_grant_statements",
]
