-- steeple work queue, schema version 14: per-key running limits and per-key start rates.
-- Forward-only: there is no down migration.
-- __SCHEMA__ is replaced by the quoted target schema name by install() (or by hand: see
-- "Applying the SQL by hand" in the Scheduler Design page).
--
-- A task may carry a limit key (a customer, a tenant), and a queue or a task name may limit
-- each key apart: the most of its tasks with one key running at once (key_max_running) and
-- started per key_rate_period (key_rate_limit). The rule is steeple.core.claims.plan_claim
-- (a candidate whose key is full in its queue or its task name is skipped, and the walk
-- goes on in claim order: no head-of-line blocking); a differential test holds the SQL to
-- it. The claim of version 13 (with positions) changes in three places only: the settings
-- rows it locks include those with per-key limits (so claimers count a key's running tasks
-- and starts one at a time, as for the other limits), each walk of its limited path is
-- claim_pick (below) instead of claim_walk, and claim_key_starts appends the starts to the
-- keys' windows. Same signatures and results as version 13 (the claim of versions 6 to 12
-- still calls it without positions), so running workers call it as before.

-- The task's key; NULL: no per-key limit applies. Nullable without a default: a
-- catalogue-only change; the CHECK is NOT VALID (every existing row is NULL).
ALTER TABLE __SCHEMA__.tasks ADD COLUMN limit_key text;
ALTER TABLE __SCHEMA__.tasks
    ADD CONSTRAINT tasks_limit_key_check CHECK (length(limit_key) BETWEEN 1 AND 200) NOT VALID;
-- What runs now per key: per-key running limits count here (queue or task name after
-- the key).
CREATE INDEX tasks_running_key_idx ON __SCHEMA__.tasks (limit_key, queue, task_name)
    WHERE state = 'running' AND limit_key IS NOT NULL;

ALTER TABLE __SCHEMA__.settings
    ADD COLUMN key_max_running integer CHECK (key_max_running BETWEEN 1 AND 1000000),
    ADD COLUMN key_rate_limit integer CHECK (key_rate_limit BETWEEN 1 AND 10000),
    ADD COLUMN key_rate_period interval
        CHECK (key_rate_period > interval '0' AND key_rate_period <= interval '1 day'),
    ADD CONSTRAINT settings_key_rate_check
        CHECK ((key_rate_limit IS NULL) = (key_rate_period IS NULL));

-- The per-key sliding-window logs: one row per start of a key of a scope with a per-key
-- rate limit, written and pruned by the claim while it holds the scope's settings row.
CREATE TABLE __SCHEMA__.key_starts (
    scope      text NOT NULL,
    name       text NOT NULL,
    limit_key  text NOT NULL,
    started_at timestamptz NOT NULL
);
CREATE INDEX key_starts_key_idx ON __SCHEMA__.key_starts (scope, name, limit_key, started_at);
CREATE INDEX key_starts_age_idx ON __SCHEMA__.key_starts (scope, name, started_at);
-- Every start adds a row and a period later a claim deletes it: vacuumed often, as the
-- tasks table is (see version 10).
ALTER TABLE __SCHEMA__.key_starts SET (
    autovacuum_vacuum_scale_factor = 0.02,
    autovacuum_vacuum_threshold = 1000,
    autovacuum_vacuum_insert_scale_factor = 0.05,
    autovacuum_analyze_scale_factor = 0.05
);

-- How many more tasks with key p_key of scope s may start at p_now (NULL: no per-key
-- limit; may be negative), p_taken being the ids this claim already took (still pending,
-- locked by it): the tighter of key_max_running minus what of the key runs and
-- key_rate_limit minus the key's starts in the window; frees_at: when the oldest of those
-- starts leaves the window (p_now's when none), NULL without a per-key rate limit. The
-- arithmetic of claim_room, over the key's tasks and starts.
CREATE FUNCTION __SCHEMA__.claim_key_room(
    s __SCHEMA__.settings, p_key text, p_taken bigint[], p_now timestamptz,
    OUT room integer, OUT frees_at timestamptz
)
LANGUAGE plpgsql
STABLE
-- Called once per candidate with a key: its statements keep one plan (each serves the same
-- index whatever the key), instead of the claim's plan per call.
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    v_taken integer := 0;
BEGIN
    IF cardinality(p_taken) = 0 THEN
        NULL;  -- the claim took nothing yet
    ELSIF s.scope = 'queue' THEN
        v_taken := (SELECT count(*) FROM __SCHEMA__.tasks t
                    WHERE t.id = ANY(p_taken) AND t.limit_key = p_key AND t.queue = s.name);
    ELSE
        v_taken := (SELECT count(*) FROM __SCHEMA__.tasks t
                    WHERE t.id = ANY(p_taken) AND t.limit_key = p_key
                      AND t.task_name = s.name);
    END IF;
    IF s.key_max_running IS NOT NULL THEN
        IF s.scope = 'queue' THEN
            room := s.key_max_running - v_taken - (
                SELECT count(*) FROM __SCHEMA__.tasks t
                WHERE t.limit_key = p_key AND t.queue = s.name AND t.state = 'running')::integer;
        ELSE
            room := s.key_max_running - v_taken - (
                SELECT count(*) FROM __SCHEMA__.tasks t
                WHERE t.limit_key = p_key AND t.task_name = s.name
                  AND t.state = 'running')::integer;
        END IF;
    END IF;
    IF s.key_rate_limit IS NOT NULL THEN
        SELECT least(room, s.key_rate_limit - v_taken - count(*)::integer),
               coalesce(min(k.started_at), p_now) + s.key_rate_period
        INTO room, frees_at
        FROM __SCHEMA__.key_starts k
        WHERE k.scope = s.scope AND k.name = s.name AND k.limit_key = p_key
          AND k.started_at > p_now - s.key_rate_period;
    END IF;
END
$$;

-- One walk of the claim: up to p_n due tasks of queue p_queue named in p_names, in claim
-- order after the position (p_priority, p_run_at, p_id; from the front when p_priority is
-- NULL), locked (SKIP LOCKED). When neither the queue nor those names limit keys, it is
-- claim_walk (version 13). Otherwise it walks the same due tasks and skips each whose
-- key has no room in its queue or its task name (claim_key_room, counting p_taken and
-- what this walk took): held says one was skipped, frees_at the earliest instant a
-- skipped key's rate window frees a start. Only the tasks it takes are locked (a skipped
-- one is not written to), and a key found full is remembered for the rest of the walk, so
-- a saturated key's long backlog costs a read of each of its tasks and no lookup.
CREATE FUNCTION __SCHEMA__.claim_pick(
    p_queue text, p_names text[], p_n integer, p_taken bigint[], p_now timestamptz,
    p_priority integer, p_run_at timestamptz, p_id bigint,
    OUT ids bigint[], OUT held boolean, OUT frees_at timestamptz
)
LANGUAGE plpgsql
VOLATILE
AS $$
DECLARE
    v_qs __SCHEMA__.settings;
    v_ns __SCHEMA__.settings;
    v_keyed text[];
    v_row record;
    v_blocked boolean;
    v_room integer;
    v_frees timestamptz;
    -- The keys found full in the queue, and (task name, key) found full in a task name,
    -- as name || chr(31) || key (neither holds a control character).
    v_full text[] := '{}';
    v_full_named text[] := '{}';
BEGIN
    ids := '{}';
    held := false;
    SELECT s.* INTO v_qs FROM __SCHEMA__.settings s
    WHERE s.scope = 'queue' AND s.name = p_queue
      AND (s.key_max_running IS NOT NULL OR s.key_rate_limit IS NOT NULL);
    v_keyed := ARRAY(
        SELECT s.name FROM __SCHEMA__.settings s
        WHERE s.scope = 'task' AND s.name = ANY(p_names)
          AND (s.key_max_running IS NOT NULL OR s.key_rate_limit IS NOT NULL)
    );
    IF v_qs.name IS NULL AND cardinality(v_keyed) = 0 THEN
        ids := ARRAY(
            SELECT w.id FROM __SCHEMA__.claim_walk(
                p_queue, p_names, p_n, p_now, p_priority, p_run_at, p_id) AS w(id)
        );
        RETURN;
    END IF;
    -- claim_walk's two ordered walks (the rest of the position's priority, then every
    -- lower one), read without locks.
    FOR v_row IN
        SELECT a.id, a.task_name, a.limit_key FROM (
            SELECT p.id, p.task_name, p.limit_key FROM __SCHEMA__.tasks p
            WHERE p.queue = p_queue AND p.state = 'pending'
              AND p.priority = p_priority AND (p.run_at, p.id) > (p_run_at, p_id)
              AND p.run_at <= greatest(p_now, p.created_at)
              AND p.task_name = ANY(p_names)
            ORDER BY p.priority DESC, p.run_at, p.id
        ) AS a
        UNION ALL
        SELECT b.id, b.task_name, b.limit_key FROM (
            SELECT p.id, p.task_name, p.limit_key FROM __SCHEMA__.tasks p
            WHERE p.queue = p_queue AND p.state = 'pending'
              AND p.priority < coalesce(p_priority::bigint, 2147483648)
              AND p.run_at <= greatest(p_now, p.created_at)
              AND p.task_name = ANY(p_names)
            ORDER BY p.priority DESC, p.run_at, p.id
        ) AS b
    LOOP
        EXIT WHEN cardinality(ids) >= p_n;
        v_blocked := false;
        IF v_row.limit_key IS NOT NULL AND v_qs.name IS NOT NULL THEN
            IF v_row.limit_key = ANY(v_full) THEN
                v_blocked := true;
            ELSE
                SELECT r.room, r.frees_at INTO v_room, v_frees
                FROM __SCHEMA__.claim_key_room(v_qs, v_row.limit_key, p_taken || ids, p_now) AS r;
                IF v_room <= 0 THEN
                    v_blocked := true;
                    v_full := v_full || v_row.limit_key;
                    frees_at := least(frees_at, v_frees);
                END IF;
            END IF;
        END IF;
        IF v_row.limit_key IS NOT NULL AND v_row.task_name = ANY(v_keyed) THEN
            IF v_row.task_name || chr(31) || v_row.limit_key = ANY(v_full_named) THEN
                v_blocked := true;
            ELSE
                SELECT s.* INTO v_ns FROM __SCHEMA__.settings s
                WHERE s.scope = 'task' AND s.name = v_row.task_name;
                SELECT r.room, r.frees_at INTO v_room, v_frees
                FROM __SCHEMA__.claim_key_room(v_ns, v_row.limit_key, p_taken || ids, p_now) AS r;
                IF v_room <= 0 THEN
                    v_blocked := true;
                    v_full_named := v_full_named || (v_row.task_name || chr(31) || v_row.limit_key);
                    frees_at := least(frees_at, v_frees);
                END IF;
            END IF;
        END IF;
        IF v_blocked THEN
            held := true;
        ELSE
            -- Locked only now, and still pending (another claimer may have taken it).
            PERFORM 1 FROM __SCHEMA__.tasks p
            WHERE p.id = v_row.id AND p.state = 'pending'
            FOR NO KEY UPDATE SKIP LOCKED;
            IF FOUND THEN
                ids := ids || v_row.id;
            END IF;
        END IF;
    END LOOP;
END
$$;

-- Append this claim's starts (p_ids, still pending) to the windows of the keys of the
-- scopes it consulted that limit key rates, and drop those windows' starts older than a
-- period (a bounded delete: the index leads with the scope, then the instant).
CREATE FUNCTION __SCHEMA__.claim_key_starts(
    p_queues text[], p_names text[], p_ids bigint[], p_now timestamptz
)
RETURNS void
LANGUAGE sql
VOLATILE
AS $$
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
$$;

-- The claim of version 13 (with positions) with the three changes above.
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
    -- One statement claims: on the fast path it picks (one LATERAL walk per queue, as
    -- version 2 did) and locks; otherwise it takes the ids the limited walks above locked.
    -- A plan is made for each call with v_fast as a constant, so only one branch runs.
    RETURN QUERY
    WITH picked AS MATERIALIZED (
        SELECT c.id FROM unnest(p_queues, p_wants) WITH ORDINALITY AS w(queue, want, i)
        CROSS JOIN LATERAL __SCHEMA__.claim_walk(
            w.queue, p_names, w.want, v_now, p_after_priorities[w.i], p_after_run_ats[w.i],
            p_after_ids[w.i]) AS c(id)
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
VALUES (14, '0014_per_key_limits')
ON CONFLICT (version) DO NOTHING;
