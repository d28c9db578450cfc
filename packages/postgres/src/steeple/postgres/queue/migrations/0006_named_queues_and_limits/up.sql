-- steeple work queue, schema version 6: named queues, global limits, rate limits, paused
-- queues. Forward-only: there is no down migration.
-- __SCHEMA__ is replaced by the quoted target schema name by install() (or by hand: see
-- "Applying the SQL by hand" in the Scheduler Design page).
--
-- Every task and recurring job belongs to a named queue ('default' unless told). A constant
-- default is a catalogue-only change (no table rewrite); the CHECKs are NOT VALID so they
-- need no scan under the table's lock (every existing row holds the valid default).
ALTER TABLE __SCHEMA__.tasks ADD COLUMN queue text NOT NULL DEFAULT 'default';
ALTER TABLE __SCHEMA__.tasks
    ADD CONSTRAINT tasks_queue_check CHECK (length(queue) BETWEEN 1 AND 200) NOT VALID;
ALTER TABLE __SCHEMA__.jobs ADD COLUMN queue text NOT NULL DEFAULT 'default';
ALTER TABLE __SCHEMA__.jobs
    ADD CONSTRAINT jobs_queue_check CHECK (length(queue) BETWEEN 1 AND 200) NOT VALID;

-- The claim walks one queue's pending work in claim order: the queue leads the index, so
-- the claim stays an ordered index walk per queue. It replaces version 1's index.
DROP INDEX __SCHEMA__.tasks_claim_idx;
CREATE INDEX tasks_claim_idx ON __SCHEMA__.tasks (queue, priority DESC, run_at, id)
    WHERE state = 'pending';
-- What runs now, per queue and task name: global concurrency limits count here.
CREATE INDEX tasks_running_idx ON __SCHEMA__.tasks (queue, task_name)
    WHERE state = 'running';

-- Operator settings of a queue (scope 'queue') or of a task name across queues (scope
-- 'task'): paused (queues only), the most tasks running at once across all workers, and
-- the most starts per period across all workers. A queue or name without a row has none.
-- recent_starts: the start instants inside the last rate_period (the sliding-window log
-- the claim reads and appends to while holding this row's lock).
CREATE TABLE __SCHEMA__.settings (
    scope          text NOT NULL CHECK (scope IN ('queue', 'task')),
    name           text NOT NULL CHECK (length(name) BETWEEN 1 AND 200),
    paused         boolean NOT NULL DEFAULT false,
    max_running    integer CHECK (max_running BETWEEN 1 AND 1000000),
    rate_limit     integer CHECK (rate_limit BETWEEN 1 AND 10000),
    rate_period    interval CHECK (rate_period > interval '0' AND rate_period <= interval '1 day'),
    recent_starts  timestamptz[] NOT NULL DEFAULT '{}',
    updated_at     timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (scope, name),
    CHECK ((rate_limit IS NULL) = (rate_period IS NULL)),
    CHECK (scope = 'queue' OR NOT paused)
);

-- The claim, version 6. Takes up to p_wants[i] due tasks of queue p_queues[i] (queues
-- distinct) whose name is in p_names.
--
-- Fast path: when no settings row concerns these queues or names (no pause, no limit), one
-- statement walks each queue's claim index (a LATERAL per queue), as version 2 did.
--
-- Otherwise the settings rows holding a limit are locked FOR NO KEY UPDATE, all in one
-- order (scope, name) so concurrent claimers cannot deadlock; a claimer then counts what
-- runs and what started in the last period in statements that begin after it holds the
-- locks (in READ COMMITTED each statement of a volatile function sees what committed
-- before it began), so the previous holder's claims, committed when it released the lock,
-- are counted: two claimers can never both take the last slot. Per-name limits are walked
-- first, one name at a time (bounded by their budgets), then the queue's other names.
--
-- A row with id NULL and held = true says a limit held back part of what was asked for
-- (the worker then claims again when it writes an outcome); its run_at, when not NULL, is
-- when the oldest start in a rate window leaves it (the worker claims again then).
DROP FUNCTION __SCHEMA__.claim(text[], integer, text, double precision);

CREATE FUNCTION __SCHEMA__.claim(
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
AS $$
#variable_conflict use_column
DECLARE
    v_ids bigint[] := '{}';
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
    v_s record;
BEGIN
    -- Claims may commit asynchronously: one lost in a crash leaves the task pending and
    -- the next claim fences the old holder with a new token.
    PERFORM set_config('synchronous_commit', 'off', true);
    -- p_deadline: the claimer's give-up time on this server's clock (epoch seconds).
    -- A claim that reaches the server after its sender gave up takes nothing.
    IF clock_timestamp() >= to_timestamp(p_deadline) THEN
        RETURN;
    END IF;
    IF NOT EXISTS (
        SELECT 1 FROM __SCHEMA__.settings s
        WHERE (s.scope = 'queue' AND s.name = ANY(p_queues))
           OR (s.scope = 'task' AND s.name = ANY(p_names))
    ) THEN
        SELECT coalesce(array_agg(c.id), '{}') INTO v_ids
        FROM unnest(p_queues, p_wants) AS w(queue, want)
        CROSS JOIN LATERAL (
            SELECT p.id FROM __SCHEMA__.tasks p
            WHERE p.queue = w.queue AND p.state = 'pending'
              AND p.run_at <= greatest(clock_timestamp(), p.created_at)
              AND p.task_name = ANY(p_names)
            ORDER BY p.priority DESC, p.run_at, p.id
            LIMIT w.want
            FOR NO KEY UPDATE SKIP LOCKED
        ) AS c;
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
            IF FOUND THEN
                CONTINUE WHEN v_s.paused;
                IF v_s.max_running IS NOT NULL THEN
                    v_budget := least(v_budget, v_s.max_running - (
                        SELECT count(*) FROM __SCHEMA__.tasks t
                        WHERE t.queue = v_queue AND t.state = 'running')::integer);
                END IF;
                IF v_s.rate_limit IS NOT NULL THEN
                    v_budget := least(v_budget, v_s.rate_limit - (
                        SELECT count(*) FROM unnest(v_s.recent_starts) AS r(at)
                        WHERE r.at > v_now - v_s.rate_period)::integer);
                    -- The oldest start in the window leaves it first (this claim's
                    -- starts, at v_now, when the window is empty).
                    v_next := least(v_next, coalesce((
                        SELECT min(r.at) FROM unnest(v_s.recent_starts) AS r(at)
                        WHERE r.at > v_now - v_s.rate_period), v_now) + v_s.rate_period);
                END IF;
                IF v_budget < p_wants[v_i] THEN
                    v_held := true;
                END IF;
            END IF;
            v_qgot := 0;
            -- Limited task names first, each within its own budget.
            FOR v_j IN 1 .. coalesce(array_length(v_limited, 1), 0) LOOP
                EXIT WHEN v_budget - v_qgot <= 0;
                SELECT s.* INTO v_s FROM __SCHEMA__.settings s
                WHERE s.scope = 'task' AND s.name = v_limited[v_j];
                v_nb := v_budget - v_qgot;
                IF v_s.max_running IS NOT NULL THEN
                    v_nb := least(v_nb, v_s.max_running - v_taken[v_j] - (
                        SELECT count(*) FROM __SCHEMA__.tasks t
                        WHERE t.task_name = v_limited[v_j] AND t.state = 'running')::integer);
                END IF;
                IF v_s.rate_limit IS NOT NULL THEN
                    v_nb := least(v_nb, v_s.rate_limit - v_taken[v_j] - (
                        SELECT count(*) FROM unnest(v_s.recent_starts) AS r(at)
                        WHERE r.at > v_now - v_s.rate_period)::integer);
                    -- The oldest start in the window leaves it first (this claim's
                    -- starts, at v_now, when the window is empty).
                    v_next := least(v_next, coalesce((
                        SELECT min(r.at) FROM unnest(v_s.recent_starts) AS r(at)
                        WHERE r.at > v_now - v_s.rate_period), v_now) + v_s.rate_period);
                END IF;
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
            IF v_qgot > 0 THEN
                -- The queue's sliding window: drop starts older than a period, add these.
                UPDATE __SCHEMA__.settings s
                SET recent_starts = ARRAY(
                        SELECT r.at FROM unnest(s.recent_starts) AS r(at)
                        WHERE r.at > v_now - s.rate_period
                    ) || array_fill(v_now, ARRAY[v_qgot])
                WHERE s.scope = 'queue' AND s.name = v_queue AND s.rate_limit IS NOT NULL;
            END IF;
        END LOOP;
        FOR v_j IN 1 .. coalesce(array_length(v_limited, 1), 0) LOOP
            CONTINUE WHEN v_taken[v_j] = 0;
            UPDATE __SCHEMA__.settings s
            SET recent_starts = ARRAY(
                    SELECT r.at FROM unnest(s.recent_starts) AS r(at)
                    WHERE r.at > v_now - s.rate_period
                ) || array_fill(v_now, ARRAY[v_taken[v_j]])
            WHERE s.scope = 'task' AND s.name = v_limited[v_j] AND s.rate_limit IS NOT NULL;
        END LOOP;
    END IF;
    RETURN QUERY
    WITH claimed AS (
        UPDATE __SCHEMA__.tasks t
        SET state = 'running', attempts = t.attempts + 1, lease_token = gen_random_uuid(),
            lease_expires_at = v_now + t.lease_duration, worker_id = p_worker,
            started_at = v_now, updated_at = v_now
        WHERE t.id = ANY(v_ids)
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
VALUES (6, '0006_named_queues_and_limits')
ON CONFLICT (version) DO NOTHING;
