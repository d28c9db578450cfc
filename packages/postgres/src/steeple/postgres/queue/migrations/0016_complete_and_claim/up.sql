-- steeple work queue, schema version 16: a worker may write a batch of successes and claim
-- its next tasks in one call.
-- Forward-only: there is no down migration. __SCHEMA__ is replaced by the quoted target
-- schema name by install() (or by hand: see "Applying the SQL by hand" in the Scheduler
-- Design page).
--
-- Under a global running limit a worker's claim is held until its own outcomes free the
-- slots: each round waited for the write of the successes, then for the claim. Now the
-- successes' write is a function, complete_tasks, and complete_and_claim calls it and then
-- the claim (version 14) in one transaction, so the claim counts the slots those successes
-- freed and a round is one call. The claim and the other statements are unchanged, so
-- running workers of version 15 call them as before.

-- Record the successes of (p_ids, p_tokens): each task whose lease token still matches
-- succeeds (result p_results, latest progress p_progress, NULL keeping the stored one),
-- its attempt is added to the history and its waiting dependents are settled
-- (settle_dependents, notifying p_channel). A stale token moves nothing and settles
-- nothing. Returns the ids that succeeded. The commit is durable (synchronous_commit on).
CREATE FUNCTION __SCHEMA__.complete_tasks(
    p_ids bigint[], p_tokens uuid[], p_worker text, p_results text[], p_progress text[],
    p_channel text
)
RETURNS SETOF bigint
LANGUAGE plpgsql
VOLATILE
AS $$
DECLARE
    v_done bigint[];
BEGIN
    PERFORM set_config('synchronous_commit', 'on', true);
    WITH done AS (
        UPDATE __SCHEMA__.tasks t
        SET state = 'succeeded', finished_at = clock_timestamp(), updated_at = clock_timestamp(),
            lease_token = NULL, lease_expires_at = NULL, result = h.result::jsonb,
            progress = coalesce(h.progress::jsonb, t.progress)
        FROM unnest(p_ids, p_tokens, p_results, p_progress) AS h(id, token, result, progress)
        WHERE t.id = h.id AND t.lease_token = h.token
        RETURNING t.id, t.attempts, t.started_at, t.finished_at
    ), history AS (
        INSERT INTO __SCHEMA__.attempts
            (task_id, attempt, worker_id, outcome, started_at, finished_at)
        SELECT d.id, d.attempts, p_worker, 'succeeded', d.started_at, d.finished_at FROM done d
    )
    SELECT coalesce(array_agg(d.id), '{}') INTO v_done FROM done d;
    -- settle_dependents is called only when one of them has a dependent: on a queue
    -- without workflows this costs one index probe per task.
    IF EXISTS (SELECT 1 FROM __SCHEMA__.task_dependencies e WHERE e.parent_id = ANY(v_done))
    THEN
        PERFORM __SCHEMA__.settle_dependents(v_done, 'succeeded', p_channel);
    END IF;
    RETURN QUERY SELECT u.id FROM unnest(v_done) AS u(id);
END
$$;

-- complete_tasks(p_ids .. p_channel), then claim(p_queues .. p_after_ids) in the same
-- transaction: the claim sees the slots the successes freed. The claim's rows, then one
-- row whose completed holds the ids that succeeded (its other columns NULL, held false).
-- The commit is durable, as complete_tasks's is.
CREATE FUNCTION __SCHEMA__.complete_and_claim(
    p_ids bigint[], p_tokens uuid[], p_results text[], p_progress text[], p_channel text,
    p_queues text[], p_wants integer[], p_names text[], p_worker text,
    p_deadline double precision, p_after_priorities integer[],
    p_after_run_ats timestamptz[], p_after_ids bigint[]
)
RETURNS TABLE (
    id bigint, task_name text, args text, attempts integer, max_attempts integer,
    run_id uuid, lease_token uuid, lease_duration interval, backoff_initial_us bigint,
    backoff_maximum_us bigint, backoff_factor integer, backoff_jitter double precision,
    run_at timestamptz, started_at timestamptz, scheduled_for timestamptz, queue text,
    held boolean, priority integer, completed bigint[]
)
LANGUAGE plpgsql
VOLATILE
AS $$
DECLARE
    v_done bigint[];
BEGIN
    v_done := ARRAY(
        SELECT c.id FROM __SCHEMA__.complete_tasks(
            p_ids, p_tokens, p_worker, p_results, p_progress, p_channel) AS c(id)
    );
    RETURN QUERY
    SELECT c.*, NULL::bigint[] FROM __SCHEMA__.claim(
        p_queues, p_wants, p_names, p_worker, p_deadline, p_after_priorities,
        p_after_run_ats, p_after_ids) AS c;
    -- The claim made its commit asynchronous (a lost claim is harmless); a success is not.
    PERFORM set_config('synchronous_commit', 'on', true);
    RETURN QUERY
    SELECT NULL::bigint, NULL::text, NULL::text, NULL::integer, NULL::integer, NULL::uuid,
           NULL::uuid, NULL::interval, NULL::bigint, NULL::bigint, NULL::integer,
           NULL::double precision, NULL::timestamptz, NULL::timestamptz, NULL::timestamptz,
           NULL::text, false, NULL::integer, v_done;
END
$$;

-- Every migration records its own version, so a schema built by applying these files in
-- order is one the library accepts; install() records it too (a no-op here).
INSERT INTO __SCHEMA__.schema_migrations (version, name)
VALUES (16, '0016_complete_and_claim')
ON CONFLICT (version) DO NOTHING;
