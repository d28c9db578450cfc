"""SQL of the recurring store: DDL and grants from package files, queries here.

``{schema}`` in every statement is replaced once per store by the quoted schema name.
Every query filters by namespace (``$1``), so a namespace only ever sees its own rows.
Instants are always parameters computed from the injected clock, never ``now()``.
"""

from __future__ import annotations

from importlib import resources

import attrs

from steeple.core.occurrences import (
    OCCURRENCE_TRANSITIONS,
    PURGED,
    TERMINAL_STATES,
    OccurrenceEvent,
    OccurrenceState,
)

SCHEMA_VERSION = 1
"""The layout this library reads and writes."""

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


def _states_for(event: OccurrenceEvent, target: object) -> tuple[str, ...]:
    # Derived from the lifecycle table so the bulk SQL can never disagree with it.
    return tuple(
        sorted(
            state.value
            for (state, ev), nxt in OCCURRENCE_TRANSITIONS.items()
            if ev is event and nxt is target
        )
    )


EXPIRABLE = _states_for(OccurrenceEvent.WINDOW_EXPIRED, OccurrenceState.EXPIRED)
CANCELLABLE = _states_for(OccurrenceEvent.CANCEL, OccurrenceState.CANCELLED)
PURGEABLE = _states_for(OccurrenceEvent.PURGE, PURGED)
TERMINAL = tuple(sorted(s.value for s in TERMINAL_STATES))


def _in(states: tuple[str, ...]) -> str:
    return "(" + ", ".join(f"'{s}'" for s in states) + ")"


def package_sql(name: str) -> str:
    """Return a ``.sql`` file shipped in this package."""
    return resources.files(__package__).joinpath(name).read_text(encoding="utf-8")


_OCC_COLUMNS = (
    "id, definition_name, due_at, state, attempts, window_ends_at, created_at,"
    " next_attempt_at, last_error"
)
_DEF_COLUMNS = (
    "name, cron, policy, first_after, topic, message_type, state, next_due_at, created_at,"
    " cancelled_at"
)


@attrs.frozen
class Queries:
    """Every statement of the store, with the schema filled in."""

    lock_namespace: str
    touch_namespace: str
    reseal_binding: str
    read_namespace: str
    insert_namespace: str
    read_version: str
    select_definition: str
    insert_definition: str
    due_definitions: str
    advance_definitions: str
    cancel_definition: str
    list_definitions: str
    insert_occurrences: str
    expire_occurrences: str
    claimable: str
    lease_occurrences: str
    read_occurrence: str
    start_attempt: str
    mark_published: str
    mark_failed: str
    cancel_occurrences: str
    operator_retry: str
    list_occurrences: str
    purge: str

    @classmethod
    def for_schema(cls, quoted_schema: str) -> Queries:
        """Fill the quoted schema name into every statement."""
        fields = {f.name: _TEMPLATES[f.name] for f in attrs.fields(cls)}
        return cls(**{k: v.replace("{schema}", quoted_schema) for k, v in fields.items()})


_TEMPLATES: dict[str, str] = {
    "lock_namespace": (
        # set_config(..., true) is SET LOCAL: this transaction commits durably whatever
        # the session says, in the same round trip as the lock.
        "SELECT set_config('synchronous_commit', 'on', true) AS synchronous_commit,"
        " binding, binding_key_id, recorded_time, definition_count, occurrence_count"
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
        f"SELECT {_DEF_COLUMNS}, sealed FROM {{schema}}.recurring_definitions"
        " WHERE namespace = $1 AND name = $2"
    ),
    "insert_definition": (
        "INSERT INTO {schema}.recurring_definitions (namespace, name, sealed, key_id, cron,"
        " policy, first_after, topic, message_type, state, cursor_at, next_due_at, created_at)"
        " VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, 'active', $7, $10, $11)"
        f" RETURNING {_DEF_COLUMNS}"
    ),
    "due_definitions": (
        "SELECT name, sealed, cron, policy, cursor_at, next_due_at"
        " FROM {schema}.recurring_definitions"
        " WHERE namespace = $1 AND state = 'active' AND next_due_at <= $2"
        " ORDER BY next_due_at, name LIMIT $3"
    ),
    "advance_definitions": (
        "UPDATE {schema}.recurring_definitions AS d"
        " SET cursor_at = u.cursor_at, next_due_at = u.next_due_at, state = u.state"
        " FROM unnest($2::text[], $3::timestamptz[], $4::timestamptz[], $5::text[])"
        " AS u(name, cursor_at, next_due_at, state)"
        " WHERE d.namespace = $1 AND d.name = u.name"
    ),
    "cancel_definition": (
        "UPDATE {schema}.recurring_definitions SET state = 'cancelled', cancelled_at = $3,"
        " next_due_at = NULL WHERE namespace = $1 AND name = $2"
        f" RETURNING {_DEF_COLUMNS}"
    ),
    "list_definitions": (
        f"SELECT {_DEF_COLUMNS} FROM {{schema}}.recurring_definitions"
        " WHERE namespace = $1 AND ($2::text IS NULL OR name > $2)"
        " ORDER BY name LIMIT $3"
    ),
    "insert_occurrences": (
        "INSERT INTO {schema}.recurring_occurrences (namespace, id, definition_name, due_at,"
        " state, window_ends_at, content, key_id, created_at, updated_at)"
        " SELECT $1, u.id, u.definition_name, u.due_at, 'pending', $2, u.content, $3, $4, $4"
        " FROM unnest($5::text[], $6::text[], $7::timestamptz[], $8::bytea[])"
        " AS u(id, definition_name, due_at, content)"
    ),
    "expire_occurrences": (
        "UPDATE {schema}.recurring_occurrences SET state = 'expired', content = NULL,"
        " key_id = NULL, lease_expires_at = NULL, next_attempt_at = NULL,"
        # An expired occurrence's last update is the end of its window (the instant it
        # expired), whenever it is classified.
        " updated_at = window_ends_at, finished_at = window_ends_at"
        f" WHERE namespace = $1 AND state IN {_in(EXPIRABLE)} AND window_ends_at <= $2"
    ),
    "claimable": (
        "SELECT id, window_ends_at FROM {schema}.recurring_occurrences"
        " WHERE namespace = $1 AND window_ends_at > $2 AND ("
        " state = 'pending'"
        " OR (state = 'retry_wait' AND next_attempt_at <= $2)"
        " OR (state = 'leased' AND lease_expires_at <= $2))"
        " ORDER BY due_at, definition_name, id LIMIT $3"
    ),
    "lease_occurrences": (
        "UPDATE {schema}.recurring_occurrences AS o SET state = 'leased',"
        " lease_capability = u.capability, lease_expires_at = u.expires_at,"
        " lease_revision = o.lease_revision + 1, next_attempt_at = NULL, updated_at = $2"
        " FROM unnest($3::text[], $4::bytea[], $5::timestamptz[])"
        " AS u(id, capability, expires_at)"
        " WHERE o.namespace = $1 AND o.id = u.id"
        " RETURNING o.id, o.lease_revision, o.lease_expires_at"
    ),
    "read_occurrence": (
        "SELECT id, definition_name, due_at, state, attempts, window_ends_at,"
        " lease_expires_at, lease_capability, lease_revision, content"
        " FROM {schema}.recurring_occurrences WHERE namespace = $1 AND id = $2"
    ),
    "start_attempt": (
        "UPDATE {schema}.recurring_occurrences SET attempts = attempts + 1, updated_at = $3"
        " WHERE namespace = $1 AND id = $2 RETURNING attempts"
    ),
    "mark_published": (
        "UPDATE {schema}.recurring_occurrences SET state = 'published', content = NULL,"
        " key_id = NULL, lease_expires_at = NULL, next_attempt_at = NULL, last_error = NULL,"
        " updated_at = $3, finished_at = $3 WHERE namespace = $1 AND id = $2"
    ),
    "mark_failed": (
        "UPDATE {schema}.recurring_occurrences SET state = $3::text,"
        " next_attempt_at = $4::timestamptz, last_error = $5::text, lease_expires_at = NULL,"
        " updated_at = $6::timestamptz,"
        " finished_at = CASE WHEN $3::text = 'dead' THEN $6::timestamptz ELSE NULL END"
        " WHERE namespace = $1 AND id = $2"
    ),
    "cancel_occurrences": (
        # The capability and revision stay so an in-flight relay can still prove it held
        # the lease (its late publication is reported, the state stays cancelled).
        "UPDATE {schema}.recurring_occurrences SET state = 'cancelled', content = NULL,"
        " key_id = NULL, lease_expires_at = NULL, next_attempt_at = NULL,"
        " updated_at = $3, finished_at = $3"
        f" WHERE namespace = $1 AND definition_name = $2 AND state IN {_in(CANCELLABLE)}"
    ),
    "operator_retry": (
        "UPDATE {schema}.recurring_occurrences SET state = 'pending', attempts = 0,"
        " next_attempt_at = NULL, last_error = NULL, finished_at = NULL, updated_at = $3"
        f" WHERE namespace = $1 AND id = $2 RETURNING {_OCC_COLUMNS}"
    ),
    "list_occurrences": (
        f"SELECT {_OCC_COLUMNS} FROM {{schema}}.recurring_occurrences"
        " WHERE namespace = $1"
        " AND ($2::timestamptz IS NULL OR (due_at, id) > ($2::timestamptz, $3::text))"
        " ORDER BY due_at, id LIMIT $4"
    ),
    "purge": (
        "DELETE FROM {schema}.recurring_occurrences WHERE namespace = $1 AND id IN ("
        " SELECT id FROM {schema}.recurring_occurrences"
        f" WHERE namespace = $1 AND state IN {_in(PURGEABLE)} AND finished_at < $2"
        " ORDER BY finished_at, due_at, definition_name, id LIMIT $3)"
    ),
}
