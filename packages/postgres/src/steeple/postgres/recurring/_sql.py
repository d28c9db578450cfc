"""SQL of the recurring store: DDL, migrations and grants from package files, queries here.

``{schema}`` in every statement is replaced once per store by the quoted schema name.
Every query filters by namespace (``$1``), so a namespace only ever sees its own rows.
Instants are always parameters the engine computed from the injected clock, never
``now()``. Selections by state are built from the values the engine passes (states of a
lifecycle step, the core's claim rule), inlined as literals so that the partial indexes
apply, and cached per distinct value. Array parameters other than ``text[]`` arrive as
``text[]`` and are cast here (``$3::text[]::bytea[]``, see ``steeple.postgres._arrays``):
a fresh connection then needs no type introspection before its first use of a statement.
"""

from __future__ import annotations

import functools
from importlib import resources

import attrs

from steeple.core.leases import ClaimRule
from steeple.core.occurrences import OccurrenceState
from steeple.core.records import ScheduleState
from steeple.engine.sql_rules import claim_predicate
from steeple.engine.sql_rules import state_list as _in

SCHEMA_VERSION = 2
"""The layout this library reads and writes (2: topic and message type are sealed only)."""

MIGRATIONS: dict[int, str] = {2: "migrations/0002_seal_topic_and_message_type.sql"}
"""Forward migrations: the file that takes the schema from ``version - 1`` to ``version``."""

TABLES = (
    "recurring_schema_version",
    "recurring_namespaces",
    "recurring_definitions",
    "recurring_occurrences",
)

RUNTIME_PRIVILEGES: dict[str, tuple[str, ...]] = {
    "recurring_schema_version": ("SELECT",),
    "recurring_namespaces": ("SELECT", "UPDATE"),
    "recurring_definitions": ("SELECT", "INSERT", "UPDATE"),
    "recurring_occurrences": ("SELECT", "INSERT", "UPDATE", "DELETE"),
}
"""What the runtime role needs (and ``grants.sql`` grants)."""


def package_sql(name: str) -> str:
    """Return a ``.sql`` file shipped in this package."""
    return resources.files(__package__).joinpath(name).read_text(encoding="utf-8")


DEFINITION_COLUMNS = (
    "name, key_id, cron, policy, first_after, state, cursor_at, next_due_at, created_at,"
    " cancelled_at, sealed"
)
OCCURRENCE_COLUMNS = (
    "id, definition_name, due_at, state, attempts, window_ends_at, created_at, updated_at,"
    " finished_at, next_attempt_at, last_error, lease_expires_at, lease_revision,"
    " lease_capability"
)
"""An occurrence's columns without its content (listings, claims, classification)."""


@attrs.frozen
class Queries:
    """Every statement of the store, with the schema filled in."""

    schema: str
    lock_namespace: str
    touch_namespace: str
    reseal_binding: str
    read_namespace: str
    insert_namespace: str
    read_version: str
    select_definition: str
    select_definitions: str
    insert_definitions: str
    due_definitions: str
    update_definitions: str
    list_definitions: str
    insert_occurrences: str
    read_occurrences: str
    update_occurrences: str
    list_occurrences: str

    @classmethod
    def for_schema(cls, quoted_schema: str) -> Queries:
        """Fill the quoted schema name into every statement."""
        filled = {k: v.replace("{schema}", quoted_schema) for k, v in _TEMPLATES.items()}
        return cls(schema=quoted_schema, **filled)

    def with_touch(self, write: str, parameters: int) -> str:
        """``write`` (namespace ``$1``, ``parameters`` in all) and ``touch_namespace`` in one.

        The touch's recorded time and counter deltas follow as the next three parameters.
        """
        return _with_touch(self.schema, write, parameters)

    def claimable(self, rule: ClaimRule) -> str:
        """Occurrences ``rule`` admits at ``$2``, oldest first, at most ``$3``."""
        return _claimable(self.schema, rule)

    def window_ended(self, states: frozenset[OccurrenceState]) -> str:
        """Occurrences in ``states`` whose window ended by ``$2``."""
        return _window_ended(self.schema, states)

    def occurrences_of(self, states: frozenset[OccurrenceState]) -> str:
        """Occurrences of definition ``$2`` in ``states``."""
        return _occurrences_of(self.schema, states)

    def purge(self, states: frozenset[OccurrenceState]) -> str:
        """Delete at most ``$3`` occurrences in ``states`` finished before ``$2``."""
        return _purge(self.schema, states)


@functools.lru_cache(maxsize=64)
def _with_touch(schema: str, write: str, parameters: int) -> str:
    # A data-modifying WITH runs exactly once, to completion, before the commit, whether
    # or not the outer statement reads it; the outer UPDATE touches another table.
    n = parameters
    return (
        f"WITH written AS ({write}) UPDATE {schema}.recurring_namespaces"
        f" SET recorded_time = ${n + 1}, definition_count = definition_count + ${n + 2},"
        f" occurrence_count = occurrence_count + ${n + 3} WHERE namespace = $1"
    )


@functools.lru_cache(maxsize=64)
def _claimable(schema: str, rule: ClaimRule) -> str:
    return (
        f"SELECT {OCCURRENCE_COLUMNS} FROM {schema}.recurring_occurrences"
        f" WHERE namespace = $1 AND window_ends_at > $2 AND {claim_predicate(rule, '$2')}"
        " ORDER BY due_at, definition_name, id LIMIT $3"
    )


@functools.lru_cache(maxsize=64)
def _window_ended(schema: str, states: frozenset[OccurrenceState]) -> str:
    return (
        f"SELECT {OCCURRENCE_COLUMNS} FROM {schema}.recurring_occurrences"
        f" WHERE namespace = $1 AND state IN {_in(states)} AND window_ends_at <= $2"
    )


@functools.lru_cache(maxsize=64)
def _occurrences_of(schema: str, states: frozenset[OccurrenceState]) -> str:
    return (
        f"SELECT {OCCURRENCE_COLUMNS} FROM {schema}.recurring_occurrences"
        f" WHERE namespace = $1 AND definition_name = $2 AND state IN {_in(states)}"
    )


@functools.lru_cache(maxsize=64)
def _purge(schema: str, states: frozenset[OccurrenceState]) -> str:
    return (
        f"DELETE FROM {schema}.recurring_occurrences WHERE namespace = $1 AND id IN ("
        f" SELECT id FROM {schema}.recurring_occurrences"
        f" WHERE namespace = $1 AND state IN {_in(states)} AND finished_at < $2"
        " ORDER BY finished_at, due_at, definition_name, id LIMIT $3)"
    )


_TEMPLATES: dict[str, str] = {
    "lock_namespace": (
        # set_config(..., true) is SET LOCAL: this transaction commits durably whatever
        # the session says, in the same round trip as the lock.
        "SELECT set_config('synchronous_commit', 'on', true) AS synchronous_commit,"
        " binding, binding_key_id, recorded_time, definition_count, occurrence_count,"
        # The server's clock, read in the statement that takes the lock: the engine
        # judges this host's clock against it before adopting a reading.
        " clock_timestamp() AS server_time"
        " FROM {schema}.recurring_namespaces WHERE namespace = $1 FOR UPDATE"
    ),
    "touch_namespace": (
        "UPDATE {schema}.recurring_namespaces SET recorded_time = $2,"
        " definition_count = definition_count + $3, occurrence_count = occurrence_count + $4"
        " WHERE namespace = $1"
    ),
    "reseal_binding": (
        "UPDATE {schema}.recurring_namespaces SET binding = $2, binding_key_id = $3"
        " WHERE namespace = $1"
    ),
    "read_namespace": (
        "SELECT binding, binding_key_id, recorded_time FROM {schema}.recurring_namespaces"
        " WHERE namespace = $1"
    ),
    "insert_namespace": (
        "INSERT INTO {schema}.recurring_namespaces"
        " (namespace, binding, binding_key_id, recorded_time, created_at)"
        " VALUES ($1, $2, $3, $4, $4)"
    ),
    "read_version": (
        "SELECT version FROM {schema}.recurring_schema_version WHERE component = 'recurring'"
    ),
    "select_definition": (
        f"SELECT {DEFINITION_COLUMNS} FROM {{schema}}.recurring_definitions"
        " WHERE namespace = $1 AND name = $2"
    ),
    "select_definitions": (
        f"SELECT {DEFINITION_COLUMNS} FROM {{schema}}.recurring_definitions"
        " WHERE namespace = $1 AND name = ANY($2::text[])"
    ),
    "insert_definitions": (
        "INSERT INTO {schema}.recurring_definitions (namespace, name, sealed, key_id, cron,"
        " policy, first_after, state, cursor_at, next_due_at, created_at, cancelled_at)"
        " SELECT $1, u.* FROM unnest($2::text[], $3::text[]::bytea[], $4::text[],"
        " $5::text[], $6::text[], $7::text[]::timestamptz[], $8::text[],"
        " $9::text[]::timestamptz[], $10::text[]::timestamptz[],"
        " $11::text[]::timestamptz[], $12::text[]::timestamptz[])"
        " AS u(name, sealed, key_id, cron, policy, first_after, state, cursor_at,"
        " next_due_at, created_at, cancelled_at)"
    ),
    "due_definitions": (
        # Only active definitions have a next due time; saying so uses the partial index.
        f"SELECT {DEFINITION_COLUMNS} FROM {{schema}}.recurring_definitions"
        f" WHERE namespace = $1 AND state = '{ScheduleState.ACTIVE}' AND next_due_at <= $2"
        " ORDER BY next_due_at, name LIMIT $3"
    ),
    "update_definitions": (
        "UPDATE {schema}.recurring_definitions AS d"
        " SET state = u.state, cursor_at = u.cursor_at, next_due_at = u.next_due_at,"
        " cancelled_at = u.cancelled_at"
        " FROM unnest($2::text[], $3::text[], $4::text[]::timestamptz[],"
        " $5::text[]::timestamptz[], $6::text[]::timestamptz[])"
        " AS u(name, state, cursor_at, next_due_at, cancelled_at)"
        " WHERE d.namespace = $1 AND d.name = u.name"
    ),
    "list_definitions": (
        f"SELECT {DEFINITION_COLUMNS} FROM {{schema}}.recurring_definitions"
        " WHERE namespace = $1 AND ($2::text IS NULL OR name > $2)"
        " ORDER BY name LIMIT $3"
    ),
    "insert_occurrences": (
        "INSERT INTO {schema}.recurring_occurrences (namespace, id, definition_name, due_at,"
        " state, attempts, window_ends_at, created_at, updated_at, content, key_id)"
        " SELECT $1, u.* FROM unnest($2::text[], $3::text[], $4::text[]::timestamptz[],"
        " $5::text[], $6::text[]::integer[], $7::text[]::timestamptz[],"
        " $8::text[]::timestamptz[], $9::text[]::timestamptz[], $10::text[]::bytea[],"
        " $11::text[])"
        " AS u(id, definition_name, due_at, state, attempts, window_ends_at, created_at,"
        " updated_at, content, key_id)"
    ),
    "read_occurrences": (
        f"SELECT {OCCURRENCE_COLUMNS}, content, key_id FROM {{schema}}.recurring_occurrences"
        " WHERE namespace = $1 AND id = ANY($2::text[])"
    ),
    "update_occurrences": (
        "UPDATE {schema}.recurring_occurrences AS o SET state = u.state,"
        " attempts = u.attempts, next_attempt_at = u.next_attempt_at,"
        " last_error = u.last_error, lease_expires_at = u.lease_expires_at,"
        " lease_revision = u.lease_revision, lease_capability = u.lease_capability,"
        " updated_at = u.updated_at, finished_at = u.finished_at,"
        " content = CASE WHEN u.erase THEN NULL ELSE o.content END,"
        " key_id = CASE WHEN u.erase THEN NULL ELSE o.key_id END"
        " FROM unnest($2::text[], $3::text[], $4::text[]::integer[],"
        " $5::text[]::timestamptz[], $6::text[], $7::text[]::timestamptz[],"
        " $8::text[]::bigint[], $9::text[]::bytea[], $10::text[]::timestamptz[],"
        " $11::text[]::timestamptz[], $12::text[]::boolean[])"
        " AS u(id, state, attempts, next_attempt_at, last_error, lease_expires_at,"
        " lease_revision, lease_capability, updated_at, finished_at, erase)"
        " WHERE o.namespace = $1 AND o.id = u.id"
    ),
    "list_occurrences": (
        f"SELECT {OCCURRENCE_COLUMNS} FROM {{schema}}.recurring_occurrences"
        " WHERE namespace = $1"
        " AND ($2::timestamptz IS NULL OR (due_at, id) > ($2::timestamptz, $3::text))"
        " ORDER BY due_at, id LIMIT $4"
    ),
}
