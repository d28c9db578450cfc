-- steeple work queue, schema version 12: workflows, tasks that run after others.
-- Forward-only: there is no down migration. __SCHEMA__ is replaced by the quoted target
-- schema name by install() (or by hand: see "Applying the SQL by hand" in the Scheduler
-- Design page).
--
-- A task enqueued after others is 'waiting' (a state no claim selects: the claim function
-- is unchanged) with waiting_on, the count of the tasks it still waits for. Each edge of
-- task_dependencies says a child waits for a parent. The statement that ends a parent
-- (success, final failure, final lease lapse, cancel) settles its children in the same
-- transaction, through settle_dependents(): only the parents the statement really moved
-- (their lease token matched) are passed to it, so a stale completion releases nothing.

ALTER TABLE __SCHEMA__.tasks
    DROP CONSTRAINT tasks_state_check,
    ADD CONSTRAINT tasks_state_check
        CHECK (state IN ('waiting', 'pending', 'running', 'succeeded', 'failed', 'cancelled')),
    -- The tasks it still waits for (0 once released; NULL for a task enqueued after none).
    ADD COLUMN waiting_on integer CHECK (waiting_on >= 0),
    -- The graph it belongs to: the id of its first task (NULL outside a workflow).
    ADD COLUMN workflow_id bigint,
    -- What it does when a task it waits for fails for good or is cancelled.
    ADD COLUMN on_parent_failure text CHECK (on_parent_failure IN ('cancel', 'run'));

-- A waiting task is live: it holds its dedup key like a pending or running one.
DROP INDEX __SCHEMA__.tasks_dedup_idx;
CREATE UNIQUE INDEX tasks_dedup_idx ON __SCHEMA__.tasks (task_name, dedup_key)
    WHERE dedup_key IS NOT NULL AND state IN ('waiting', 'pending', 'running');
CREATE INDEX tasks_workflow_idx ON __SCHEMA__.tasks (workflow_id)
    WHERE workflow_id IS NOT NULL;
-- The operators' bounded count walks the waiting tasks by this index and stops at its cap.
CREATE INDEX tasks_waiting_idx ON __SCHEMA__.tasks (id) WHERE state = 'waiting';

CREATE TABLE __SCHEMA__.task_dependencies (
    parent_id  bigint NOT NULL REFERENCES __SCHEMA__.tasks (id) ON DELETE CASCADE,
    child_id   bigint NOT NULL REFERENCES __SCHEMA__.tasks (id) ON DELETE CASCADE,
    PRIMARY KEY (parent_id, child_id)
);
CREATE INDEX task_dependencies_child_idx ON __SCHEMA__.task_dependencies (child_id);

-- Settle the waiting children of p_parents, which just ended in p_state ('succeeded',
-- 'failed' or 'cancelled'); only children in p_only when it is given (a new graph settling
-- against parents that had ended before it). Each parent counts once per child: one fewer
-- to wait for (success, or a child that runs anyway), or the child is cancelled and its
-- own waiting children are settled as cancelled in turn. Children that reach zero become
-- pending and the workers are woken. Returns how many became pending. The rule is
-- steeple.core.workflows.settlement; test_workflows checks this function against it.
CREATE FUNCTION __SCHEMA__.settle_dependents(
    p_parents bigint[], p_state text, p_channel text, p_only bigint[] DEFAULT NULL
)
RETURNS integer
LANGUAGE plpgsql
VOLATILE
AS $$
DECLARE
    v_frontier bigint[] := p_parents;
    v_state text := p_state;
    v_children bigint[];
    v_released integer := 0;
    v_n integer;
BEGIN
    WHILE coalesce(cardinality(v_frontier), 0) > 0 LOOP
        -- One entry per edge (a child waiting for two of the frontier appears twice).
        SELECT coalesce(array_agg(e.child_id), '{}') INTO v_children
        FROM __SCHEMA__.task_dependencies e
        WHERE e.parent_id = ANY(v_frontier)
          AND (p_only IS NULL OR e.child_id = ANY(p_only));
        EXIT WHEN cardinality(v_children) = 0;
        WITH hits AS (
            SELECT h.id, count(*)::integer AS n FROM unnest(v_children) AS h(id) GROUP BY h.id
        ), fewer AS (
            UPDATE __SCHEMA__.tasks c
            SET waiting_on = c.waiting_on - hits.n,
                state = CASE WHEN c.waiting_on - hits.n <= 0 THEN 'pending' ELSE 'waiting' END,
                updated_at = clock_timestamp()
            FROM hits
            WHERE c.id = hits.id AND c.state = 'waiting'
              AND (v_state = 'succeeded' OR c.on_parent_failure = 'run')
            RETURNING c.state
        )
        SELECT count(*) FILTER (WHERE fewer.state = 'pending') INTO v_n FROM fewer;
        v_released := v_released + v_n;
        EXIT WHEN v_state = 'succeeded';
        WITH gone AS (
            UPDATE __SCHEMA__.tasks c
            SET state = 'cancelled', finished_at = clock_timestamp(),
                updated_at = clock_timestamp(),
                last_error = 'cancelled: a task it waited for failed or was cancelled'
            FROM (SELECT DISTINCT h.id FROM unnest(v_children) AS h(id)) AS hits
            WHERE c.id = hits.id AND c.state = 'waiting' AND c.on_parent_failure = 'cancel'
            RETURNING c.id
        )
        SELECT coalesce(array_agg(gone.id), '{}') INTO v_frontier FROM gone;
        v_state := 'cancelled';
    END LOOP;
    IF v_released > 0 THEN
        PERFORM pg_notify(p_channel, '');
    END IF;
    RETURN v_released;
END
$$;

-- Insert a graph of tasks in one call. p_nodes is a JSON array, one object per task:
-- name, args (JSON), priority, run_at (ISO 8601|null), delay_us (|null), max_attempts,
-- lease_us, backoff_initial_us, backoff_maximum_us, backoff_factor, backoff_jitter, queue,
-- policy ('cancel'|'run'), up (positions in p_nodes of the tasks it waits for, each before
-- it) and ids (existing tasks it waits for). The existing tasks are locked FOR SHARE, so
-- none of them can end between our reading its state and our edges being visible: an
-- ending statement waits for this transaction. Returns (position from 1, id, state,
-- workflow id) per task, or when an existing id is unknown one row (0, that id, NULL, NULL)
-- and nothing inserted.
CREATE FUNCTION __SCHEMA__.enqueue_graph(p_nodes jsonb, p_channel text, p_trace jsonb)
RETURNS TABLE (pos integer, id bigint, state text, workflow_id bigint)
LANGUAGE plpgsql
VOLATILE
AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz := clock_timestamp();
    v_wanted bigint[];
    v_found integer;
    v_ids bigint[];
    v_workflow bigint;
    v_done bigint[];
    v_broken bigint[];
BEGIN
    PERFORM set_config('synchronous_commit', 'on', true);
    SELECT coalesce(array_agg(DISTINCT x.v::bigint), '{}') INTO v_wanted
    FROM jsonb_array_elements(p_nodes) AS n(v), jsonb_array_elements_text(n.v -> 'ids') AS x(v);
    SELECT count(*), min(coalesce(s.workflow_id, s.id)),
           coalesce(array_agg(s.id) FILTER (WHERE s.state = 'succeeded'), '{}'),
           coalesce(array_agg(s.id) FILTER (WHERE s.state IN ('failed', 'cancelled')), '{}')
    INTO v_found, v_workflow, v_done, v_broken
    FROM (
        SELECT t.id, t.state, t.workflow_id FROM __SCHEMA__.tasks t
        WHERE t.id = ANY(v_wanted) ORDER BY t.id FOR SHARE
    ) AS s;
    IF v_found < cardinality(v_wanted) THEN
        RETURN QUERY
        SELECT 0, w.id, NULL::text, NULL::bigint
        FROM unnest(v_wanted) AS w(id)
        WHERE NOT EXISTS (SELECT 1 FROM __SCHEMA__.tasks t WHERE t.id = w.id)
        ORDER BY w.id LIMIT 1;
        RETURN;
    END IF;
    SELECT array_agg(nextval(pg_get_serial_sequence('__SCHEMA__.tasks', 'id')) ORDER BY n.i)
    INTO v_ids
    FROM generate_series(1, jsonb_array_length(p_nodes)) AS n(i);
    v_workflow := coalesce(v_workflow, v_ids[1]);
    INSERT INTO __SCHEMA__.tasks (
        id, task_name, args, priority, run_at, max_attempts, lease_duration,
        backoff_initial_us, backoff_maximum_us, backoff_factor, backoff_jitter, queue,
        created_at, updated_at, trace_context, state, waiting_on, workflow_id,
        on_parent_failure
    ) OVERRIDING SYSTEM VALUE
    SELECT v_ids[n.i], n.v ->> 'name', n.v -> 'args', (n.v ->> 'priority')::integer,
           coalesce((n.v ->> 'run_at')::timestamptz,
                    v_now + coalesce((n.v ->> 'delay_us')::bigint, 0) * interval '1 microsecond'),
           (n.v ->> 'max_attempts')::integer,
           (n.v ->> 'lease_us')::bigint * interval '1 microsecond',
           (n.v ->> 'backoff_initial_us')::bigint, (n.v ->> 'backoff_maximum_us')::bigint,
           (n.v ->> 'backoff_factor')::integer, (n.v ->> 'backoff_jitter')::double precision,
           n.v ->> 'queue', v_now, v_now, p_trace,
           CASE WHEN w.n > 0 THEN 'waiting' ELSE 'pending' END, w.n, v_workflow,
           n.v ->> 'policy'
    FROM jsonb_array_elements(p_nodes) WITH ORDINALITY AS n(v, i)
    CROSS JOIN LATERAL (
        SELECT (SELECT count(DISTINCT u.v) FROM jsonb_array_elements_text(n.v -> 'up') AS u(v))
             + (SELECT count(DISTINCT u.v) FROM jsonb_array_elements_text(n.v -> 'ids') AS u(v))
             AS n
    ) AS w
    ORDER BY n.i;
    INSERT INTO __SCHEMA__.task_dependencies (parent_id, child_id)
    SELECT DISTINCT v_ids[u.v::integer + 1], v_ids[n.i]
    FROM jsonb_array_elements(p_nodes) WITH ORDINALITY AS n(v, i),
         jsonb_array_elements_text(n.v -> 'up') AS u(v)
    UNION
    SELECT DISTINCT u.v::bigint, v_ids[n.i]
    FROM jsonb_array_elements(p_nodes) WITH ORDINALITY AS n(v, i),
         jsonb_array_elements_text(n.v -> 'ids') AS u(v);
    PERFORM __SCHEMA__.settle_dependents(v_done, 'succeeded', p_channel, v_ids);
    PERFORM __SCHEMA__.settle_dependents(v_broken, 'failed', p_channel, v_ids);
    IF EXISTS (SELECT 1 FROM __SCHEMA__.tasks t WHERE t.id = ANY(v_ids) AND t.state = 'pending')
    THEN
        PERFORM pg_notify(p_channel, '');
    END IF;
    RETURN QUERY
    SELECT o.i::integer, t.id, t.state, t.workflow_id
    FROM unnest(v_ids) WITH ORDINALITY AS o(id, i) JOIN __SCHEMA__.tasks t ON t.id = o.id
    ORDER BY o.i;
END
$$;

-- Every migration records its own version, so a schema built by applying these files in
-- order is one the library accepts; install() records it too (a no-op here).
INSERT INTO __SCHEMA__.schema_migrations (version, name)
VALUES (12, '0012_workflows')
ON CONFLICT (version) DO NOTHING;
