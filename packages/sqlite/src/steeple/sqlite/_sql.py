"""The SQLite store's schema and statements (SQL only; nothing here runs anything).

Instants are INTEGER microseconds since the Unix epoch (UTC): exact, and ordered as the
instants are. Tables are STRICT (SQLite checks every value's type). In each table the
sealed blobs come last, so reading the other columns never walks a blob's overflow pages.
"""

from __future__ import annotations

import functools

from steeple.core.leases import ClaimRule
from steeple.core.occurrences import OccurrenceState
from steeple.core.records import ScheduleState
from steeple.engine.sql_rules import claim_predicate
from steeple.engine.sql_rules import state_list as _in

SCHEMA_VERSION = 1
"""The version of the file layout this library reads and writes."""

MIN_SQLITE = (3, 37, 0)
"""STRICT tables need SQLite 3.37."""

_CLAIMABLE = ("leased", "pending", "retry_wait")


SCHEMA: tuple[str, ...] = (
    """CREATE TABLE IF NOT EXISTS recurring_schema_version (
        component    TEXT    PRIMARY KEY,
        version      INTEGER NOT NULL,
        installed_at INTEGER NOT NULL
    ) STRICT""",
    # One control row per namespace. Every operation runs in BEGIN IMMEDIATE (the whole
    # file's write lock), so all work is serialized and shares one recorded time.
    """CREATE TABLE IF NOT EXISTS recurring_namespaces (
        namespace        TEXT    PRIMARY KEY,
        binding_key_id   TEXT    NOT NULL,
        recorded_time    INTEGER NOT NULL,
        definition_count INTEGER NOT NULL DEFAULT 0 CHECK (definition_count >= 0),
        occurrence_count INTEGER NOT NULL DEFAULT 0 CHECK (occurrence_count >= 0),
        created_at       INTEGER NOT NULL,
        binding          BLOB    NOT NULL
    ) STRICT""",
    """CREATE TABLE IF NOT EXISTS recurring_definitions (
        namespace    TEXT    NOT NULL REFERENCES recurring_namespaces (namespace),
        name         TEXT    NOT NULL,
        key_id       TEXT    NOT NULL,
        cron         TEXT    NOT NULL,
        policy       TEXT    NOT NULL,
        first_after  INTEGER NOT NULL,
        state        TEXT    NOT NULL CHECK (state IN ('active', 'cancelled', 'exhausted')),
        cursor_at    INTEGER NOT NULL,
        next_due_at  INTEGER,
        created_at   INTEGER NOT NULL,
        cancelled_at INTEGER,
        sealed       BLOB    NOT NULL,
        PRIMARY KEY (namespace, name)
    ) STRICT""",
    f"""CREATE INDEX IF NOT EXISTS recurring_definitions_due
        ON recurring_definitions (namespace, next_due_at, name)
        WHERE state = '{ScheduleState.ACTIVE}'""",
    f"""CREATE TABLE IF NOT EXISTS recurring_occurrences (
        namespace        TEXT    NOT NULL,
        id               TEXT    NOT NULL
                         CHECK (length(id) = 32 AND id NOT GLOB '*[^0-9a-f]*'),
        definition_name  TEXT    NOT NULL,
        due_at           INTEGER NOT NULL,
        state            TEXT    NOT NULL CHECK (state IN {_in(OccurrenceState)}),
        attempts         INTEGER NOT NULL,
        window_ends_at   INTEGER NOT NULL,
        lease_expires_at INTEGER,
        lease_revision   INTEGER NOT NULL DEFAULT 0,
        next_attempt_at  INTEGER,
        last_error       TEXT,
        created_at       INTEGER NOT NULL,
        updated_at       INTEGER NOT NULL,
        finished_at      INTEGER,
        key_id           TEXT,
        lease_capability BLOB,
        content          BLOB,
        PRIMARY KEY (namespace, id),
        -- A due instant of a definition is materialized at most once, ever (until purged).
        UNIQUE (namespace, definition_name, due_at)
    ) STRICT""",
    # claim: publishable work in (due time, definition, id) order. SQLite uses a partial
    # index only when the query repeats its condition: the claim query does (_claimable).
    f"""CREATE INDEX IF NOT EXISTS recurring_occurrences_claimable
        ON recurring_occurrences (namespace, due_at, definition_name, id)
        WHERE state IN {_in(_CLAIMABLE)}""",
    # classification of window-expired work: one range per state
    """CREATE INDEX IF NOT EXISTS recurring_occurrences_windows
        ON recurring_occurrences (namespace, state, window_ends_at)""",
    # listing pages in (due time, id) order with an exclusive cursor
    """CREATE INDEX IF NOT EXISTS recurring_occurrences_listing
        ON recurring_occurrences (namespace, due_at, id)""",
    # purge: the oldest finished first
    """CREATE INDEX IF NOT EXISTS recurring_occurrences_finished
        ON recurring_occurrences (namespace, finished_at, due_at, definition_name, id)
        WHERE finished_at IS NOT NULL""",
)
"""The statements ``initialize`` runs, in one transaction (each is idempotent)."""

INSERT_VERSION = (
    "INSERT INTO recurring_schema_version (component, version, installed_at)"
    f" VALUES ('recurring', {SCHEMA_VERSION}, ?) ON CONFLICT (component) DO NOTHING"
)

TABLES = ("recurring_schema_version", "recurring_namespaces", "recurring_definitions")

DEFINITION_COLUMNS = (
    "name, sealed, key_id, cron, policy, first_after, state, cursor_at, next_due_at,"
    " created_at, cancelled_at"
)
OCCURRENCE_COLUMNS = (
    "id, definition_name, due_at, state, attempts, window_ends_at, created_at, updated_at,"
    " finished_at, next_attempt_at, last_error, lease_expires_at, lease_revision,"
    " lease_capability"
)

READ_VERSION = "SELECT version FROM recurring_schema_version WHERE component = 'recurring'"
HAS_VERSION_TABLE = (
    "SELECT count(*) FROM sqlite_schema WHERE type = 'table' AND name = 'recurring_schema_version'"
)
READ_NAMESPACE = (
    "SELECT binding, binding_key_id, recorded_time, definition_count, occurrence_count"
    " FROM recurring_namespaces WHERE namespace = ?"
)
INSERT_NAMESPACE = (
    "INSERT INTO recurring_namespaces"
    " (namespace, binding, binding_key_id, recorded_time, created_at) VALUES (?, ?, ?, ?, ?)"
)
# A write that changes nothing, rolled back at once: does the file accept writes?
PROBE_WRITE = "UPDATE recurring_namespaces SET binding_key_id = binding_key_id WHERE namespace = ?"
TOUCH_NAMESPACE = (
    "UPDATE recurring_namespaces SET recorded_time = ?,"
    " definition_count = definition_count + ?, occurrence_count = occurrence_count + ?"
    " WHERE namespace = ?"
)
RESEAL_BINDING = (
    "UPDATE recurring_namespaces SET binding = ?, binding_key_id = ? WHERE namespace = ?"
)
SELECT_DEFINITION = (
    f"SELECT {DEFINITION_COLUMNS} FROM recurring_definitions WHERE namespace = ? AND name = ?"
)
LIST_DEFINITIONS = (
    f"SELECT {DEFINITION_COLUMNS} FROM recurring_definitions"
    " WHERE namespace = ? AND (? IS NULL OR name > ?) ORDER BY name LIMIT ?"
)
DUE_DEFINITIONS = (
    f"SELECT {DEFINITION_COLUMNS} FROM recurring_definitions"
    f" WHERE namespace = ? AND state = '{ScheduleState.ACTIVE}' AND next_due_at <= ?"
    " ORDER BY next_due_at, name LIMIT ?"
)
INSERT_DEFINITION = (
    "INSERT INTO recurring_definitions (namespace, name, sealed, key_id, cron, policy,"
    " first_after, state, cursor_at, next_due_at, created_at, cancelled_at)"
    " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)
UPDATE_DEFINITION = (
    "UPDATE recurring_definitions SET state = ?, cursor_at = ?, next_due_at = ?,"
    " cancelled_at = ? WHERE namespace = ? AND name = ?"
)
INSERT_OCCURRENCE = (
    "INSERT INTO recurring_occurrences (namespace, id, definition_name, due_at, state,"
    " attempts, window_ends_at, created_at, updated_at, finished_at, next_attempt_at,"
    " last_error, lease_expires_at, lease_revision, lease_capability, content, key_id)"
    " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)
UPDATE_OCCURRENCE = (
    "UPDATE recurring_occurrences SET state = ?, attempts = ?, next_attempt_at = ?,"
    " last_error = ?, lease_expires_at = ?, lease_revision = ?, lease_capability = ?,"
    " updated_at = ?, finished_at = ?,"
    " content = CASE WHEN ? THEN NULL ELSE content END,"
    " key_id = CASE WHEN ? THEN NULL ELSE key_id END"
    " WHERE namespace = ? AND id = ?"
)
LIST_OCCURRENCES = (
    f"SELECT {OCCURRENCE_COLUMNS} FROM recurring_occurrences"
    " WHERE namespace = ? AND (? IS NULL OR (due_at, id) > (?, ?))"
    " ORDER BY due_at, id LIMIT ?"
)


@functools.lru_cache(maxsize=16)
def definitions_named(count: int) -> str:
    """Definitions with ``count`` names (a power of two: few statements)."""
    marks = ", ".join("?" * count)
    return (
        f"SELECT {DEFINITION_COLUMNS} FROM recurring_definitions"
        f" WHERE namespace = ? AND name IN ({marks})"
    )


@functools.lru_cache(maxsize=16)
def read_occurrences(count: int) -> str:
    """Occurrences (content included) of ``count`` ids (a power of two: few statements)."""
    marks = ", ".join("?" * count)
    return (
        f"SELECT {OCCURRENCE_COLUMNS}, content, key_id FROM recurring_occurrences"
        f" WHERE namespace = ? AND id IN ({marks})"
    )


@functools.lru_cache(maxsize=64)
def claimable(rule: ClaimRule) -> str:
    """Occurrences ``rule`` admits at ``?2``, oldest first, at most ``?3``."""
    # Repeating the partial index's condition (when it holds) lets SQLite walk the index
    # in claim order instead of sorting every live occurrence.
    claimable_states = {s.value for s in rule.states}
    indexed = f" AND state IN {_in(_CLAIMABLE)}" if claimable_states <= set(_CLAIMABLE) else ""
    return (
        f"SELECT {OCCURRENCE_COLUMNS} FROM recurring_occurrences"
        f" WHERE namespace = ?1 AND window_ends_at > ?2{indexed}"
        f" AND {claim_predicate(rule, '?2')}"
        " ORDER BY due_at, definition_name, id LIMIT ?3"
    )


@functools.lru_cache(maxsize=64)
def window_ended(states: frozenset[OccurrenceState]) -> str:
    """Occurrences in ``states`` whose window ended by ``?2``."""
    return (
        f"SELECT {OCCURRENCE_COLUMNS} FROM recurring_occurrences"
        f" WHERE namespace = ?1 AND state IN {_in(states)} AND window_ends_at <= ?2"
    )


@functools.lru_cache(maxsize=64)
def occurrences_of(states: frozenset[OccurrenceState]) -> str:
    """Occurrences of definition ``?2`` in ``states``."""
    return (
        f"SELECT {OCCURRENCE_COLUMNS} FROM recurring_occurrences"
        f" WHERE namespace = ?1 AND definition_name = ?2 AND state IN {_in(states)}"
    )


@functools.lru_cache(maxsize=64)
def purge(states: frozenset[OccurrenceState]) -> str:
    """Delete at most ``?3`` occurrences in ``states`` finished before ``?2``."""
    return (
        "DELETE FROM recurring_occurrences WHERE namespace = ?1 AND id IN ("
        " SELECT id FROM recurring_occurrences"
        f" WHERE namespace = ?1 AND state IN {_in(states)} AND finished_at < ?2"
        " ORDER BY finished_at, due_at, definition_name, id LIMIT ?3)"
    )
