-- steeple work queue, schema version 15: tasks enqueued after others keep their limit key.
-- Forward-only: there is no down migration. __SCHEMA__ is replaced by the quoted target
-- schema name by install() (or by hand: see "Applying the SQL by hand" in the Scheduler
-- Design page).
--
-- enqueue_graph (version 12) predates the tasks' limit_key column (version 14): a task
-- enqueued with after= or in a Workflow lost its key, so no per-key limit held it. The
-- function is replaced with the same signature and results; it reads the key from each
-- node (absent or null: no key), so a library of version 14 calling it still works.

-- Insert a graph of tasks in one call. p_nodes is a JSON array, one object per task:
-- name, args (JSON), priority, run_at (ISO 8601|null), delay_us (|null), max_attempts,
-- lease_us, backoff_initial_us, backoff_maximum_us, backoff_factor, backoff_jitter, queue,
-- limit_key (|null), policy ('cancel'|'run'), up (positions in p_nodes of the tasks it waits for, each before
-- it) and ids (existing tasks it waits for). The existing tasks are locked FOR SHARE, so
-- none of them can end between our reading its state and our edges being visible: an
-- ending statement waits for this transaction. Returns (position from 1, id, state,
-- workflow id) per task, or when an existing id is unknown one row (0, that id, NULL, NULL)
-- and nothing inserted.
CREATE OR REPLACE FUNCTION __SCHEMA__.enqueue_graph(p_nodes jsonb, p_channel text, p_trace jsonb)
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
        on_parent_failure, limit_key
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
           n.v ->> 'policy', n.v ->> 'limit_key'
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
VALUES (15, '0015_workflow_limit_keys')
ON CONFLICT (version) DO NOTHING;
