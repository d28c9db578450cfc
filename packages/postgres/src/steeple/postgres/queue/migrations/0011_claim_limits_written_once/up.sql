-- steeple work queue, schema version 11: the claim's limit arithmetic written once.
-- Forward-only: there is no down migration.
-- __SCHEMA__ is replaced by the quoted target schema name by install() (or by hand: see
-- "Applying the SQL by hand" in the Scheduler Design page).
--
-- The rule is steeple.core.claims.plan_claim (pauses, running limits, start rates, limited
-- task names first, claim order); a differential test holds this function to it. A queue
-- and a task name are both scopes of the settings table, and one function says how many
-- more of a scope's tasks may start and when its rate window frees a start; the claim asks
-- it for the queue, then for each limited task name, and appends every scope's starts to
-- its window in one statement. The path without pauses or limits is the one statement of
-- version 9, and the claim keeps the settings of versions 9 and 10 (never JIT-compiled,
-- every statement on its index). Same signature and result as version 6, so workers of
-- versions 6 to 10 that are already running call it as before.

-- How many more tasks of scope s may start at p_now (NULL: no limit applies; may be
-- negative when a limit was lowered below what runs), p_taken being what this claim
-- already started in the scope: the tighter of max_running minus what runs and rate_limit
-- minus the starts in the window. A start counts while it is later than a period ago.
-- frees_at: when the oldest start in the window leaves it (p_now's, when the window is
-- empty), NULL without a rate limit. Called by the claim while it holds s's lock, under
-- the claim's settings.
CREATE FUNCTION __SCHEMA__.claim_room(
    s __SCHEMA__.settings, p_taken integer, p_now timestamptz,
    OUT room integer, OUT frees_at timestamptz
)
LANGUAGE plpgsql
STABLE
AS $$
BEGIN
    IF s.max_running IS NOT NULL THEN
        IF s.scope = 'queue' THEN
            room := s.max_running - p_taken - (
                SELECT count(*) FROM __SCHEMA__.tasks t
                WHERE t.queue = s.name AND t.state = 'running')::integer;
        ELSE
            room := s.max_running - p_taken - (
                SELECT count(*) FROM __SCHEMA__.tasks t
                WHERE t.task_name = s.name AND t.state = 'running')::integer;
        END IF;
    END IF;
    IF s.rate_limit IS NOT NULL THEN
        room := least(room, s.rate_limit - p_taken - (
            SELECT count(*) FROM unnest(s.recent_starts) AS r(at)
            WHERE r.at > p_now - s.rate_period)::integer);
        frees_at := coalesce((
            SELECT min(r.at) FROM unnest(s.recent_starts) AS r(at)
            WHERE r.at > p_now - s.rate_period), p_now) + s.rate_period;
    END IF;
END
$$;

CREATE OR REPLACE FUNCTION __SCHEMA__.claim(
    p_queues text[], p_wants integer[], p_names text[], p_worker text,
    p_deadline double precision
)
RETURNS TABLE (
    id bigint, task_name text, args text, attempts integer, max_attempts integer,
    run_id uuid, lease_token uuid, lease_duration interval, backoff_initial_us bigint,
    backoff_maximum_us bigint, backoff_factor integer, backoff_jitter double precision,
    run_at timestamptz, started_at timestamptz, scheduled_for timestamptz, queue text,
    held boolean
)
LANGUAGE plpgsql
VOLATILE
SET enable_sort = off
SET enable_bitmapscan = off
-- Plan with the actual limit and names every time (a generic plan guesses both).
SET plan_cache_mode = force_custom_plan
-- Every statement has an index that serves it (see version 8).
SET enable_seqscan = off
-- Never JIT-compiled (see version 10).
SET jit = off
AS $$
#variable_conflict use_column
DECLARE
    v_ids bigint[] := '{}';
    v_fast boolean;
    v_now timestamptz;
    v_held boolean := false;
    v_next timestamptz;
    v_free text[];
    v_limited text[];
    v_taken integer[];
    v_queue text;
    v_budget integer;
    v_nb integer;
    v_got bigint[];
    v_qgot integer;
    v_j integer;
    v_s __SCHEMA__.settings;
    v_queue_set boolean;
    v_room integer;
    v_frees timestamptz;
    v_scopes text[] := '{}';
    v_scope_names text[] := '{}';
    -- The scopes (scope, name) whose windows this claim's starts (count) go to.
    v_starts integer[] := '{}';
BEGIN
    -- Claims may commit asynchronously: one lost in a crash leaves the task pending and
    -- the next claim fences the old holder with a new token.
    PERFORM set_config('synchronous_commit', 'off', true);
    -- p_deadline: the claimer's give-up time on this server's clock (epoch seconds).
    -- A claim that reaches the server after its sender gave up takes nothing.
    IF clock_timestamp() >= to_timestamp(p_deadline) THEN
        RETURN;
    END IF;
    -- No settings row concerns these queues or names (no pause, no limit): the claim
    -- statement below walks and locks each queue's claim index itself.
    v_fast := NOT EXISTS (
        SELECT 1 FROM __SCHEMA__.settings s
        WHERE (s.scope = 'queue' AND s.name = ANY(p_queues))
           OR (s.scope = 'task' AND s.name = ANY(p_names))
    );
    IF v_fast THEN
        v_now := clock_timestamp();
    ELSE
        PERFORM 1 FROM __SCHEMA__.settings s
        WHERE ((s.scope = 'queue' AND s.name = ANY(p_queues))
            OR (s.scope = 'task' AND s.name = ANY(p_names)))
          AND (s.max_running IS NOT NULL OR s.rate_limit IS NOT NULL)
        ORDER BY s.scope, s.name
        FOR NO KEY UPDATE;
        -- The lock may have been waited for: judge the deadline and starts on a fresh clock.
        v_now := clock_timestamp();
        IF v_now >= to_timestamp(p_deadline) THEN
            RETURN;
        END IF;
        v_limited := ARRAY(
            SELECT s.name FROM __SCHEMA__.settings s
            WHERE s.scope = 'task' AND s.name = ANY(p_names)
              AND (s.max_running IS NOT NULL OR s.rate_limit IS NOT NULL)
            ORDER BY s.name
        );
        v_free := ARRAY(SELECT n FROM unnest(p_names) AS n WHERE NOT n = ANY(v_limited));
        v_taken := array_fill(0, ARRAY[coalesce(array_length(v_limited, 1), 0)]);
        FOR v_i IN 1 .. coalesce(array_length(p_queues, 1), 0) LOOP
            v_queue := p_queues[v_i];
            v_budget := p_wants[v_i];
            SELECT s.* INTO v_s FROM __SCHEMA__.settings s
            WHERE s.scope = 'queue' AND s.name = v_queue;
            v_queue_set := FOUND;
            IF v_queue_set THEN
                CONTINUE WHEN v_s.paused;
                SELECT r.room, r.frees_at INTO v_room, v_frees
                FROM __SCHEMA__.claim_room(v_s, 0, v_now) AS r;
                -- least() ignores NULL: no limit leaves the budget as it is.
                v_budget := least(v_budget, v_room);
                v_next := least(v_next, v_frees);
                IF v_budget < p_wants[v_i] THEN
                    v_held := true;
                END IF;
            END IF;
            v_qgot := 0;
            -- Limited task names first, each within its own room.
            FOR v_j IN 1 .. coalesce(array_length(v_limited, 1), 0) LOOP
                EXIT WHEN v_budget - v_qgot <= 0;
                SELECT s.* INTO v_s FROM __SCHEMA__.settings s
                WHERE s.scope = 'task' AND s.name = v_limited[v_j];
                SELECT r.room, r.frees_at INTO v_room, v_frees
                FROM __SCHEMA__.claim_room(v_s, v_taken[v_j], v_now) AS r;
                v_nb := least(v_budget - v_qgot, v_room);
                v_next := least(v_next, v_frees);
                IF v_nb < v_budget - v_qgot THEN
                    v_held := true;
                END IF;
                CONTINUE WHEN v_nb <= 0;
                v_got := ARRAY(
                    SELECT c.id FROM (
                        SELECT p.id FROM __SCHEMA__.tasks p
                        WHERE p.queue = v_queue AND p.state = 'pending'
                          AND p.run_at <= greatest(v_now, p.created_at)
                          AND p.task_name = v_limited[v_j]
                        ORDER BY p.priority DESC, p.run_at, p.id
                        LIMIT v_nb
                        FOR NO KEY UPDATE SKIP LOCKED
                    ) AS c
                );
                v_taken[v_j] := v_taken[v_j] + coalesce(array_length(v_got, 1), 0);
                v_qgot := v_qgot + coalesce(array_length(v_got, 1), 0);
                v_ids := v_ids || v_got;
            END LOOP;
            IF v_budget - v_qgot > 0 AND coalesce(array_length(v_free, 1), 0) > 0 THEN
                v_got := ARRAY(
                    SELECT c.id FROM (
                        SELECT p.id FROM __SCHEMA__.tasks p
                        WHERE p.queue = v_queue AND p.state = 'pending'
                          AND p.run_at <= greatest(v_now, p.created_at)
                          AND p.task_name = ANY(v_free)
                        ORDER BY p.priority DESC, p.run_at, p.id
                        LIMIT v_budget - v_qgot
                        FOR NO KEY UPDATE SKIP LOCKED
                    ) AS c
                );
                v_qgot := v_qgot + coalesce(array_length(v_got, 1), 0);
                v_ids := v_ids || v_got;
            END IF;
            IF v_queue_set THEN
                v_scopes := v_scopes || 'queue'::text;
                v_scope_names := v_scope_names || v_queue;
                v_starts := v_starts || v_qgot;
            END IF;
        END LOOP;
        v_scopes := v_scopes || array_fill('task'::text, ARRAY[cardinality(v_limited)]);
        v_scope_names := v_scope_names || v_limited;
        v_starts := v_starts || v_taken;
        -- Every scope's sliding window: drop starts older than a period, add this claim's.
        UPDATE __SCHEMA__.settings s
        SET recent_starts = ARRAY(
                SELECT r.at FROM unnest(s.recent_starts) AS r(at)
                WHERE r.at > v_now - s.rate_period
            ) || array_fill(v_now, ARRAY[u.n])
        FROM unnest(v_scopes, v_scope_names, v_starts) AS u(scope, name, n)
        WHERE s.scope = u.scope AND s.name = u.name AND u.n > 0 AND s.rate_limit IS NOT NULL;
    END IF;
    -- One statement claims: on the fast path it picks (one LATERAL walk per queue, as
    -- version 2 did) and locks; otherwise it takes the ids the limited walks above locked.
    -- A plan is made for each call with v_fast as a constant, so only one branch runs.
    RETURN QUERY
    WITH picked AS MATERIALIZED (
        SELECT c.id FROM unnest(p_queues, p_wants) AS w(queue, want)
        CROSS JOIN LATERAL (
            SELECT p.id FROM __SCHEMA__.tasks p
            WHERE p.queue = w.queue AND p.state = 'pending'
              AND p.run_at <= greatest(clock_timestamp(), p.created_at)
              AND p.task_name = ANY(p_names)
            ORDER BY p.priority DESC, p.run_at, p.id
            LIMIT w.want
            FOR NO KEY UPDATE SKIP LOCKED
        ) AS c
        WHERE v_fast
        UNION ALL
        SELECT u.id FROM unnest(v_ids) AS u(id)
        WHERE NOT v_fast
    ), claimed AS (
        UPDATE __SCHEMA__.tasks t
        SET state = 'running', attempts = t.attempts + 1, lease_token = gen_random_uuid(),
            lease_expires_at = v_now + t.lease_duration, worker_id = p_worker,
            started_at = v_now, updated_at = v_now
        FROM picked
        WHERE t.id = picked.id
        RETURNING t.id, t.task_name, t.args::text, t.attempts, t.max_attempts, t.run_id,
                  t.lease_token, t.lease_duration, t.backoff_initial_us,
                  t.backoff_maximum_us, t.backoff_factor, t.backoff_jitter, t.run_at,
                  t.started_at, t.scheduled_for, t.queue, false
    )
    SELECT * FROM claimed
    UNION ALL
    SELECT NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, v_next, NULL,
           NULL, NULL, true
    WHERE v_held;
END
$$;

-- Every migration records its own version, so a schema built by applying these files in
-- order is one the library accepts; install() records it too (a no-op here).
INSERT INTO __SCHEMA__.schema_migrations (version, name)
VALUES (11, '0011_claim_limits_written_once')
ON CONFLICT (version) DO NOTHING;
