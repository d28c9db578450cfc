-- steeple work queue, schema version 2: the claim as a function with pinned planner settings.
--
-- The claim must walk tasks_claim_idx in order and stop after p_limit rows. With stale or
-- missing statistics (a fresh or bursty queue) the planner may instead bitmap-scan every
-- pending row and sort them, costing milliseconds per claim on a large backlog. A SQL
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
