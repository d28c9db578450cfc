-- steeple recurring publications: the fixed schema (version 2).
-- Only names, calendars, policies, states, instants, attempt counts and key ids are
-- plaintext: topics, message types, headers and payloads live in the sealed columns.
-- The schema placeholder is replaced by the quoted schema name. Run by `initialize` (the
-- deployment role) under an advisory lock, so concurrent initializers converge.
-- The placeholder appears only where an identifier goes, never in a comment or a literal:
-- a quoted name may hold a newline, which would end a comment and run the rest as SQL.
CREATE SCHEMA IF NOT EXISTS {schema};

CREATE TABLE IF NOT EXISTS {schema}.recurring_schema_version (
    component   text        PRIMARY KEY,
    version     integer     NOT NULL,
    installed_at timestamptz NOT NULL DEFAULT clock_timestamp()
);

-- One control row per namespace: every operation locks it first (SELECT ... FOR UPDATE),
-- so all work in a namespace is serialized and shares one recorded time.
CREATE TABLE IF NOT EXISTS {schema}.recurring_namespaces (
    namespace         text        PRIMARY KEY,
    binding           bytea       NOT NULL,
    binding_key_id    text        NOT NULL,
    recorded_time     timestamptz NOT NULL,
    definition_count  integer     NOT NULL DEFAULT 0 CHECK (definition_count >= 0),
    occurrence_count  integer     NOT NULL DEFAULT 0 CHECK (occurrence_count >= 0),
    created_at        timestamptz NOT NULL
);

CREATE TABLE IF NOT EXISTS {schema}.recurring_definitions (
    namespace     text        NOT NULL REFERENCES {schema}.recurring_namespaces (namespace),
    name          text        NOT NULL,
    sealed        bytea       NOT NULL,
    key_id        text        NOT NULL,
    cron          text        NOT NULL,
    policy        text        NOT NULL,
    first_after   timestamptz NOT NULL,
    state         text        NOT NULL CHECK (state IN ('active', 'cancelled', 'exhausted')),
    cursor_at     timestamptz NOT NULL,
    next_due_at   timestamptz,
    created_at    timestamptz NOT NULL,
    cancelled_at  timestamptz,
    PRIMARY KEY (namespace, name)
);

CREATE INDEX IF NOT EXISTS recurring_definitions_due
    ON {schema}.recurring_definitions (namespace, next_due_at, name)
    WHERE state = 'active';

CREATE TABLE IF NOT EXISTS {schema}.recurring_occurrences (
    namespace        text        NOT NULL,
    id               text        NOT NULL CHECK (id ~ '^[0-9a-f]{32}$'),
    definition_name  text        NOT NULL,
    due_at           timestamptz NOT NULL,
    state            text        NOT NULL CHECK (state IN ('pending', 'leased', 'retry_wait',
                                     'published', 'dead', 'expired', 'cancelled')),
    attempts         integer     NOT NULL DEFAULT 0,
    window_ends_at   timestamptz NOT NULL,
    lease_expires_at timestamptz,
    lease_capability bytea,
    lease_revision   bigint      NOT NULL DEFAULT 0,
    content          bytea,
    key_id           text,
    next_attempt_at  timestamptz,
    last_error       text,
    created_at       timestamptz NOT NULL,
    updated_at       timestamptz NOT NULL,
    finished_at      timestamptz,
    PRIMARY KEY (namespace, id),
    -- A due instant of a definition is materialized at most once, ever (until purged).
    -- No foreign key to the definitions: they are never deleted, every insert comes from
    -- a definition read under the same control-row lock, and a per-row RI check would
    -- triple the cost of materializing a tick.
    UNIQUE (namespace, definition_name, due_at)
);

-- claim: publishable work in (due time, definition, id) order
CREATE INDEX IF NOT EXISTS recurring_occurrences_claimable
    ON {schema}.recurring_occurrences (namespace, due_at, definition_name, id)
    WHERE state IN ('pending', 'leased', 'retry_wait');

-- classification of window-expired work (claim, listing, purge, cancel, retry)
CREATE INDEX IF NOT EXISTS recurring_occurrences_live_windows
    ON {schema}.recurring_occurrences (namespace, window_ends_at)
    WHERE state IN ('pending', 'leased', 'retry_wait', 'dead');

-- listing pages in (due time, id) order with an exclusive cursor
CREATE INDEX IF NOT EXISTS recurring_occurrences_listing
    ON {schema}.recurring_occurrences (namespace, due_at, id);

CREATE INDEX IF NOT EXISTS recurring_occurrences_finished
    ON {schema}.recurring_occurrences (namespace, finished_at, id)
    WHERE finished_at IS NOT NULL;

INSERT INTO {schema}.recurring_schema_version (component, version)
VALUES ('recurring', 2)
ON CONFLICT (component) DO NOTHING;
