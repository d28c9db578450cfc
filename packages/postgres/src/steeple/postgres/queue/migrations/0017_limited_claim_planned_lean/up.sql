-- steeple work queue, schema version 17: a claim under limits is planned lean.
-- Forward-only: there is no down migration. __SCHEMA__ is replaced by the quoted target
-- schema name by install() (or by hand: see "Applying the SQL by hand" in the Scheduler
-- Design page).
--
-- The claim plans each of its statements at every call (plan_cache_mode is
-- force_custom_plan). Under a pause or a limit two of them cost more to plan than to run:
-- claim_key_starts, a SQL function, whose INSERT and DELETE PostgreSQL plans again at each
-- call (and whose INSERT looks every claimed task up twice) even when no scope limits key
-- rates; and the claim's last statement, which held the fast path's walk of every queue
-- (the inlined claim_walk: its text parsed and both ordered walks planned) even when the
-- limited walks had already picked the ids. Now claim_key_starts is PL/pgSQL and returns
-- at once when none of the scopes the claim consulted limits key rates, and the fast path
-- collects its walk's ids as the limited path does, so the last statement only marks the
-- picked ids running. The rules, the locks (taken by the walks, held to the commit) and
-- the results are those of version 14; same signatures, so running workers of versions
-- 14 to 16 call them as before.

-- Append this claim's starts (p_ids, still pending) to the windows of the keys of the
-- scopes it consulted that limit key rates, and drop those windows' starts older than a
-- period (a bounded delete: the index leads with the scope, then the instant). Nothing to
-- do, and nothing read but the settings, when none of those scopes limits key rates.
CREATE OR REPLACE FUNCTION __SCHEMA__.claim_key_starts(
    p_queues text[], p_names text[], p_ids bigint[], p_now timestamptz
)
RETURNS void
LANGUAGE plpgsql
VOLATILE
AS $$
BEGIN
    IF NOT EXISTS (
        SELECT 1 FROM __SCHEMA__.settings s
        WHERE s.key_rate_limit IS NOT NULL
          AND ((s.scope = 'queue' AND s.name = ANY(p_queues))
               OR (s.scope = 'task' AND s.name = ANY(p_names)))
    ) THEN
        RETURN;
    END IF;
    INSERT INTO __SCHEMA__.key_starts (scope, name, limit_key, started_at)
    SELECT s.scope, s.name, t.limit_key, p_now
    FROM __SCHEMA__.tasks t
    JOIN __SCHEMA__.settings s ON s.scope = 'queue' AND s.name = t.queue
    WHERE t.id = ANY(p_ids) AND t.limit_key IS NOT NULL AND s.key_rate_limit IS NOT NULL
    UNION ALL
    SELECT s.scope, s.name, t.limit_key, p_now
    FROM __SCHEMA__.tasks t
    JOIN __SCHEMA__.settings s ON s.scope = 'task' AND s.name = t.task_name
    WHERE t.id = ANY(p_ids) AND t.limit_key IS NOT NULL AND s.key_rate_limit IS NOT NULL;
    DELETE FROM __SCHEMA__.key_starts k
    USING __SCHEMA__.settings s
    WHERE s.key_rate_limit IS NOT NULL
      AND ((s.scope = 'queue' AND s.name = ANY(p_queues))
           OR (s.scope = 'task' AND s.name = ANY(p_names)))
      AND k.scope = s.scope AND k.name = s.name
      AND k.started_at <= p_now - s.key_rate_period;
END
$$;

-- The claim of version 14, whose last statement no longer holds the fast path's walk.
CREATE OR REPLACE FUNCTION __SCHEMA__.claim(
    p_queues text[], p_wants integer[], p_names text[], p_worker text,
    p_deadline double precision, p_after_priorities integer[],
    p_after_run_ats timestamptz[], p_after_ids bigint[]
)
RETURNS TABLE (
    id bigint, task_name text, args text, attempts integer, max_attempts integer,
    run_id uuid, lease_token uuid, lease_duration interval, backoff_initial_us bigint,
    backoff_maximum_us bigint, backoff_factor integer, backoff_jitter double precision,
    run_at timestamptz, started_at timestamptz, scheduled_for timestamptz, queue text,
    held boolean, priority integer
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
    v_kheld boolean;
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
          AND (s.max_running IS NOT NULL OR s.rate_limit IS NOT NULL
               OR s.key_max_running IS NOT NULL OR s.key_rate_limit IS NOT NULL)
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
                SELECT k.ids, k.held, k.frees_at INTO v_got, v_kheld, v_frees
                FROM __SCHEMA__.claim_pick(
                    v_queue, ARRAY[v_limited[v_j]], v_nb, v_ids, v_now, p_after_priorities[v_i],
                    p_after_run_ats[v_i], p_after_ids[v_i]) AS k;
                v_held := v_held OR v_kheld;
                v_next := least(v_next, v_frees);
                v_taken[v_j] := v_taken[v_j] + coalesce(array_length(v_got, 1), 0);
                v_qgot := v_qgot + coalesce(array_length(v_got, 1), 0);
                v_ids := v_ids || v_got;
            END LOOP;
            IF v_budget - v_qgot > 0 AND coalesce(array_length(v_free, 1), 0) > 0 THEN
                SELECT k.ids, k.held, k.frees_at INTO v_got, v_kheld, v_frees
                FROM __SCHEMA__.claim_pick(
                    v_queue, v_free, v_budget - v_qgot, v_ids, v_now, p_after_priorities[v_i],
                    p_after_run_ats[v_i], p_after_ids[v_i]) AS k;
                v_held := v_held OR v_kheld;
                v_next := least(v_next, v_frees);
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
        PERFORM __SCHEMA__.claim_key_starts(p_queues, p_names, v_ids, v_now);
    END IF;
    -- On the fast path one statement walks every queue (one LATERAL walk per queue, as
    -- version 2 did) and locks what it picks; otherwise the limited walks above did. Then
    -- one statement marks the picked ids running.
    IF v_fast THEN
        v_ids := ARRAY(
            SELECT c.id FROM unnest(p_queues, p_wants) WITH ORDINALITY AS w(queue, want, i)
            CROSS JOIN LATERAL __SCHEMA__.claim_walk(
                w.queue, p_names, w.want, v_now, p_after_priorities[w.i],
                p_after_run_ats[w.i], p_after_ids[w.i]) AS c(id)
        );
    END IF;
    RETURN QUERY
    WITH claimed AS (
        UPDATE __SCHEMA__.tasks t
        SET state = 'running', attempts = t.attempts + 1, lease_token = gen_random_uuid(),
            lease_expires_at = v_now + t.lease_duration, worker_id = p_worker,
            started_at = v_now, updated_at = v_now
        FROM unnest(v_ids) AS picked(id)
        WHERE t.id = picked.id
        RETURNING t.id, t.task_name, t.args::text, t.attempts, t.max_attempts, t.run_id,
                  t.lease_token, t.lease_duration, t.backoff_initial_us,
                  t.backoff_maximum_us, t.backoff_factor, t.backoff_jitter, t.run_at,
                  t.started_at, t.scheduled_for, t.queue, false, t.priority
    )
    SELECT * FROM claimed
    UNION ALL
    SELECT NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, v_next, NULL,
           NULL, NULL, true, NULL
    WHERE v_held;
END
$$;

-- Every migration records its own version, so a schema built by applying these files in
-- order is one the library accepts; install() records it too (a no-op here).
INSERT INTO __SCHEMA__.schema_migrations (version, name)
VALUES (17, '0017_limited_claim_planned_lean')
ON CONFLICT (version) DO NOTHING;
