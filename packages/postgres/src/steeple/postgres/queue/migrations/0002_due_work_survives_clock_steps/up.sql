-- steeple work queue, schema version 2: work that was due when it was created stays due
-- when the server's clock is stepped back. Forward-only: there is no down migration.
-- __SCHEMA__ is replaced by the quoted target schema name by install() (or by hand: see
-- "Applying the SQL by hand" in the Scheduler Design page).
--
-- Version 1 judged every pending task by `run_at <= clock_timestamp()`. After the server's
-- clock steps back by X (NTP, an operator, a failover to a host whose clock is behind),
-- every task that was already due, including all immediate work enqueued in the last X,
-- looked "not yet due" again and waited out the step. A task whose run_at is not after its
-- created_at (immediate work, work scheduled in the past, recurring occurrences, recovered
-- leases, released work) was due the moment it existed, on any clock: it is always due now.
-- Delayed work (run_at after created_at) and retries are still judged by the server clock.
--
-- Same signature and result as version 1, so workers of either version can call it.

CREATE OR REPLACE FUNCTION __SCHEMA__.claim(
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
        WHERE p.state = 'pending'
          AND p.run_at <= greatest(clock_timestamp(), p.created_at)
          AND p.task_name = ANY(p_names)
          -- p_deadline: the claimer's give-up time on this server's clock (epoch seconds).
          -- A claim that reaches the server after its sender gave up takes nothing.
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
VALUES (2, '0002_due_work_survives_clock_steps')
ON CONFLICT (version) DO NOTHING;
