-- steeple work queue, schema version 13: a claim may walk a queue's claim order from where
-- the claimer's last claim of it stopped, instead of from the front.
-- Forward-only: there is no down migration.
-- __SCHEMA__ is replaced by the quoted target schema name by install() (or by hand: see
-- "Applying the SQL by hand" in the Scheduler Design page).
--
-- Every claimed task leaves a dead entry at the front of the claim index (the pending
-- version it had), and while a session holds the vacuum horizon nothing may remove it:
-- a claim that walks from the front visits the dead entry of every task claimed since the
-- horizon was taken (a heap visit each). Ten minutes of 300 tasks/s put 180,000 of them in
-- front of the live tasks, and the claims grew slow enough that the worker fell behind.
--
-- The claim now takes, per queue, a position: the claim-order key (priority, run_at, id)
-- of the last task the claimer took from that queue, or NULL (walk from the front). From a
-- position the walk is two ordered index walks: the rest of the position's priority after
-- its (run_at, id), then every lower priority; both start where the claim index holds
-- those keys, so the entries before the position (the dead ones among them) are never
-- visited. Without a position the first walk finds nothing (priority = NULL) and the second
-- is the walk from the front of earlier versions. Which tasks a walk takes is the claim
-- rule of steeple.core.claims, applied to the due tasks after the position.
--
-- Why nothing waits for ever: a task can lie before a claimer's position while it is
-- pending and due: one of higher priority or an earlier due time enqueued after the
-- claimer went past its key, a retry whose backoff ended, a task handed back or whose lease
-- expired, an enqueue that committed after a later one was claimed, one skipped while
-- another claim had it locked. Only a walk from the front finds those. The claimer decides
-- (by steeple.core.claims.ClaimWalk, which the worker asks before each claim) to walk from the
-- front when it holds no position, when its last walk from the front is a poll interval
-- old or more, and right after a walk from its position found nothing (unless a pause or
-- limit held that claim back, which says nothing of the walk). So a due task
-- before the position waits at most one poll interval (plus the claim's own time) for a
-- worker with room, and the walk from the front takes in claim order, so the higher
-- priority and earlier due tasks come first; tasks after the position are taken by the
-- walks from it in claim order, as before. The rule only ever delays: it never takes a
-- task another rule would not.
--
-- The new claim is an overload with the three arrays of positions (aligned with p_queues)
-- and one more result column, the task's priority (the worker builds its next position
-- from it). The claim of versions 6 to 12 keeps its signature and result and calls the
-- new one without positions, so workers of versions 6 to 12 that are already running
-- call it as before and walk from the front. The limited paths (pauses, running limits,
-- start rates) walk from the positions too; their rule is unchanged.

-- The due pending tasks of one queue with one of p_names, after the position (p_priority,
-- p_run_at, p_id) in claim order (all of the queue's when p_priority is NULL), locked, at
-- most p_want, in claim order. One statement, inlined into its callers, so each walk is
-- planned with the caller's values; the priority bound 2^31 lies above every integer
-- priority, so the front's walk is one ordered range of the claim index. STABLE is what
-- lets PostgreSQL inline it (its locks are the caller's, which is VOLATILE); a call it
-- cannot inline (an argument such as clock_timestamp() that is itself volatile) is
-- refused ("not allowed in a non-volatile function"), never run another way.
CREATE FUNCTION __SCHEMA__.claim_walk(
    p_queue text, p_names text[], p_want integer, p_now timestamptz,
    p_priority integer, p_run_at timestamptz, p_id bigint
)
RETURNS SETOF bigint
LANGUAGE sql
STABLE
AS $$
SELECT w.id FROM (
    SELECT a.id FROM (
        SELECT p.id FROM __SCHEMA__.tasks p
        WHERE p.queue = p_queue AND p.state = 'pending'
          AND p.priority = p_priority AND (p.run_at, p.id) > (p_run_at, p_id)
          AND p.run_at <= greatest(p_now, p.created_at)
          AND p.task_name = ANY(p_names)
        ORDER BY p.priority DESC, p.run_at, p.id
        LIMIT p_want
        FOR NO KEY UPDATE SKIP LOCKED
    ) AS a
    UNION ALL
    SELECT b.id FROM (
        SELECT p.id FROM __SCHEMA__.tasks p
        WHERE p.queue = p_queue AND p.state = 'pending'
          AND p.priority < coalesce(p_priority::bigint, 2147483648)
          AND p.run_at <= greatest(p_now, p.created_at)
          AND p.task_name = ANY(p_names)
        ORDER BY p.priority DESC, p.run_at, p.id
        LIMIT p_want
        FOR NO KEY UPDATE SKIP LOCKED
    ) AS b
) AS w
LIMIT p_want
$$;

CREATE FUNCTION __SCHEMA__.claim(
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
                    SELECT w.id FROM __SCHEMA__.claim_walk(
                        v_queue, ARRAY[v_limited[v_j]], v_nb, v_now, p_after_priorities[v_i],
                        p_after_run_ats[v_i], p_after_ids[v_i]) AS w(id)
                );
                v_taken[v_j] := v_taken[v_j] + coalesce(array_length(v_got, 1), 0);
                v_qgot := v_qgot + coalesce(array_length(v_got, 1), 0);
                v_ids := v_ids || v_got;
            END LOOP;
            IF v_budget - v_qgot > 0 AND coalesce(array_length(v_free, 1), 0) > 0 THEN
                v_got := ARRAY(
                    SELECT w.id FROM __SCHEMA__.claim_walk(
                        v_queue, v_free, v_budget - v_qgot, v_now, p_after_priorities[v_i],
                        p_after_run_ats[v_i], p_after_ids[v_i]) AS w(id)
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

-- The claim of versions 6 to 12: the same, always from the front, without the priority.
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
LANGUAGE sql
VOLATILE
AS $$
SELECT c.id, c.task_name, c.args, c.attempts, c.max_attempts, c.run_id, c.lease_token,
       c.lease_duration, c.backoff_initial_us, c.backoff_maximum_us, c.backoff_factor,
       c.backoff_jitter, c.run_at, c.started_at, c.scheduled_for, c.queue, c.held
FROM __SCHEMA__.claim(p_queues, p_wants, p_names, p_worker, p_deadline, NULL::integer[],
                      NULL::timestamptz[], NULL::bigint[]) AS c
$$;

-- Every migration records its own version, so a schema built by applying these files in
-- order is one the library accepts; install() records it too (a no-op here).
INSERT INTO __SCHEMA__.schema_migrations (version, name)
VALUES (13, '0013_claim_walks_from_a_position')
ON CONFLICT (version) DO NOTHING;
