-- steeple work queue, schema version 1. Forward-only: there is no down migration.
-- __SCHEMA__ is replaced by the quoted target schema name by install() (or by hand: see
-- "Applying the SQL by hand" in the Scheduler Design page).

-- The schema and the version table, so that this file applied alone (by psql or a host's
-- own migration tool) starts the schema exactly as install() does; both already exist when
-- install() runs it.
CREATE SCHEMA IF NOT EXISTS __SCHEMA__;
CREATE TABLE IF NOT EXISTS __SCHEMA__.schema_migrations (
    version     integer PRIMARY KEY,
    name        text NOT NULL,
    applied_at  timestamptz NOT NULL DEFAULT clock_timestamp()
);

CREATE TABLE __SCHEMA__.tasks (
    id                  bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    task_name           text NOT NULL CHECK (length(task_name) BETWEEN 1 AND 200),
    args                jsonb NOT NULL,
    state               text NOT NULL DEFAULT 'pending'
                        CHECK (state IN ('pending', 'running', 'succeeded', 'failed', 'cancelled')),
    priority            integer NOT NULL DEFAULT 0,
    run_at              timestamptz NOT NULL DEFAULT clock_timestamp(),
    attempts            integer NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    max_attempts        integer NOT NULL CHECK (max_attempts >= 1),
    -- The execution snapshot: lease and retry policy copied at creation, never re-read.
    lease_duration      interval NOT NULL CHECK (lease_duration > interval '0'),
    backoff_initial_us  bigint NOT NULL CHECK (backoff_initial_us > 0),
    backoff_maximum_us  bigint NOT NULL CHECK (backoff_maximum_us >= backoff_initial_us),
    backoff_factor      integer NOT NULL CHECK (backoff_factor >= 1),
    backoff_jitter      double precision NOT NULL CHECK (backoff_jitter >= 0 AND backoff_jitter <= 1),
    dedup_key           text,
    -- Stable across attempts: the idempotency key handlers give to side effects.
    run_id              uuid NOT NULL DEFAULT gen_random_uuid(),
    -- Recurring provenance; no foreign key, so deleting a job never touches its tasks.
    job_id              bigint,
    scheduled_for       timestamptz,
    lease_token         uuid,
    lease_expires_at    timestamptz,
    worker_id           text,
    created_at          timestamptz NOT NULL DEFAULT clock_timestamp(),
    updated_at          timestamptz NOT NULL DEFAULT clock_timestamp(),
    started_at          timestamptz,
    finished_at         timestamptz,
    last_error          text,
    CHECK ((state = 'running') = (lease_token IS NOT NULL)),
    CHECK ((state IN ('succeeded', 'failed', 'cancelled')) = (finished_at IS NOT NULL))
);

-- The claim hot path: pending work by priority (higher first), then due time.
CREATE INDEX tasks_claim_idx ON __SCHEMA__.tasks (priority DESC, run_at, id)
    WHERE state = 'pending';
-- Recovery of expired leases (dead or stalled workers).
CREATE INDEX tasks_lease_idx ON __SCHEMA__.tasks (lease_expires_at)
    WHERE state = 'running';
-- Terminal retention (prune_terminal).
CREATE INDEX tasks_terminal_idx ON __SCHEMA__.tasks (finished_at)
    WHERE state IN ('succeeded', 'failed', 'cancelled');
-- At most one live task per (task name, dedup key).
CREATE UNIQUE INDEX tasks_dedup_idx ON __SCHEMA__.tasks (task_name, dedup_key)
    WHERE dedup_key IS NOT NULL AND state IN ('pending', 'running');
-- A recurring occurrence is materialized at most once, however many workers tick.
CREATE UNIQUE INDEX tasks_job_occurrence_idx ON __SCHEMA__.tasks (job_id, scheduled_for)
    WHERE job_id IS NOT NULL;

CREATE TABLE __SCHEMA__.attempts (
    id           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    task_id      bigint NOT NULL REFERENCES __SCHEMA__.tasks (id) ON DELETE CASCADE,
    attempt      integer NOT NULL,
    worker_id    text,
    outcome      text NOT NULL
                 CHECK (outcome IN ('succeeded', 'retried', 'failed', 'lease_expired', 'released')),
    started_at   timestamptz,
    finished_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    error        text
);
CREATE INDEX attempts_task_idx ON __SCHEMA__.attempts (task_id);

CREATE TABLE __SCHEMA__.jobs (
    id                  bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    name                text NOT NULL UNIQUE CHECK (length(name) BETWEEN 1 AND 200),
    task_name           text NOT NULL CHECK (length(task_name) BETWEEN 1 AND 200),
    cron                text NOT NULL,
    args                jsonb NOT NULL,
    -- Options snapshot copied onto every materialized task.
    priority            integer NOT NULL,
    max_attempts        integer NOT NULL CHECK (max_attempts >= 1),
    lease_duration      interval NOT NULL CHECK (lease_duration > interval '0'),
    backoff_initial_us  bigint NOT NULL,
    backoff_maximum_us  bigint NOT NULL,
    backoff_factor      integer NOT NULL,
    backoff_jitter      double precision NOT NULL,
    paused              boolean NOT NULL DEFAULT false,
    -- Exclusive cursor (last materialized due instant, or creation time) and the next due
    -- instant after it (NULL once the calendar is exhausted).
    cursor_at           timestamptz NOT NULL,
    next_run_at         timestamptz,
    created_at          timestamptz NOT NULL DEFAULT clock_timestamp(),
    updated_at          timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX jobs_due_idx ON __SCHEMA__.jobs (next_run_at)
    WHERE NOT paused AND next_run_at IS NOT NULL;

-- The claim, as a function with pinned planner settings.
--
-- The claim must walk tasks_claim_idx in order and stop after p_limit rows. With stale or
-- missing statistics (a fresh or bursty queue) the planner may instead bitmap-scan every
-- pending row and sort them, costing milliseconds per claim on a large backlog. A
-- function's SET clause applies while its body is planned and run, so the ordered index
-- scan is chosen whatever the statistics say.
--
-- p_deadline is the claimer's give-up time (epoch seconds, server clock): a claim delivered
-- after its sender gave up (held by a dead or blackholed network) takes nothing, instead of
-- stranding tasks under a lease nobody holds.

CREATE FUNCTION __SCHEMA__.claim(
    p_names text[], p_limit integer, p_worker text, p_deadline double precision
)
RETURNS TABLE (
    id bigint, task_name text, args text, attempts integer, max_attempts integer,
    run_id uuid, lease_token uuid, lease_duration interval, backoff_initial_us bigint,
    backoff_maximum_us bigint, backoff_factor integer, backoff_jitter double precision,
    run_at timestamptz, started_at timestamptz, scheduled_for timestamptz
)
LANGUAGE plpgsql
VOLATILE
SET enable_sort = off
SET enable_bitmapscan = off
-- Plan with the actual limit and names every time (a generic plan guesses both).
SET plan_cache_mode = force_custom_plan
AS $$
#variable_conflict use_column
BEGIN
    -- Claims may commit asynchronously: one lost in a crash leaves the task pending and
    -- the next claim fences the old holder with a new token.
    PERFORM set_config('synchronous_commit', 'off', true);
    RETURN QUERY
    WITH picked AS (
        SELECT p.id FROM __SCHEMA__.tasks p
        WHERE p.state = 'pending' AND p.run_at <= clock_timestamp()
          AND p.task_name = ANY(p_names)
          AND clock_timestamp() < to_timestamp(p_deadline)
        ORDER BY p.priority DESC, p.run_at, p.id
        LIMIT p_limit
        FOR NO KEY UPDATE SKIP LOCKED
    ), claimed AS (
        UPDATE __SCHEMA__.tasks t
        SET state = 'running', attempts = t.attempts + 1, lease_token = gen_random_uuid(),
            lease_expires_at = clock_timestamp() + t.lease_duration, worker_id = p_worker,
            started_at = clock_timestamp(), updated_at = clock_timestamp()
        FROM picked
        WHERE t.id = picked.id
        RETURNING t.id, t.task_name, t.args::text, t.attempts, t.max_attempts, t.run_id,
                  t.lease_token, t.lease_duration, t.backoff_initial_us,
                  t.backoff_maximum_us, t.backoff_factor, t.backoff_jitter, t.run_at,
                  t.started_at, t.scheduled_for
    )
    SELECT * FROM claimed;
END
$$;

-- Every migration records its own version, so a schema built by applying these files in
-- order is one the library accepts; install() records it too (a no-op here).
INSERT INTO __SCHEMA__.schema_migrations (version, name)
VALUES (1, '0001_create_queue_tables')
ON CONFLICT (version) DO NOTHING;
