-- steeple work queue, schema version 19: pending tasks listed by id from an index.
-- Forward-only: there is no down migration. __SCHEMA__ is replaced by the quoted target
-- schema name by install() (or by hand: see "Applying the SQL by hand" in the Scheduler
-- Design page).
--
-- Operators list pending tasks in id order (the dashboard's pending page), most often
-- when a backlog has built up. No index served that order: the listing read every pending
-- task through the claim index and sorted them (330,000 pending tasks: 10,000 heap pages
-- and 0.4 s for a page of 50). This partial index keeps the pending tasks' ids in order,
-- like tasks_waiting_idx for waiting ones, and pending_page walks it and stops after the
-- page. Enqueueing writes one more index entry per pending task; nothing else changes, so
-- running workers and operators of earlier versions work as before.
-- IF NOT EXISTS: on a large table an operator builds this index beforehand with
-- CREATE INDEX CONCURRENTLY (writes go on meanwhile) and the migration keeps it; built
-- here, inside the migration's transaction, enqueues wait for the build.
CREATE INDEX IF NOT EXISTS tasks_pending_id_idx ON __SCHEMA__.tasks (id) WHERE state = 'pending';

-- The ids of one page of pending tasks in id order (descending when p_newest), after the
-- exclusive cursor p_after (null: from the start), of the optional task name, creation
-- range, queue and args containment: an index walk that stops after p_limit matches. The
-- SET clauses keep the plan on that walk whatever the statistics say (a bulk-loaded table
-- without statistics would otherwise be bitmap-scanned and sorted in full).
CREATE FUNCTION __SCHEMA__.pending_page(
    p_after bigint, p_newest boolean, p_limit integer, p_task_name text,
    p_since timestamptz, p_until timestamptz, p_queue text, p_args jsonb
)
RETURNS TABLE (id bigint)
LANGUAGE plpgsql
STABLE
SET enable_sort = off
SET enable_bitmapscan = off
SET enable_seqscan = off
SET jit = off
SET plan_cache_mode = force_custom_plan
AS $$
#variable_conflict use_column
BEGIN
    IF p_newest THEN
        RETURN QUERY
        SELECT t.id FROM __SCHEMA__.tasks t
        WHERE t.state = 'pending' AND (p_after IS NULL OR t.id < p_after)
          AND (p_task_name IS NULL OR t.task_name = p_task_name)
          AND (p_since IS NULL OR t.created_at >= p_since)
          AND (p_until IS NULL OR t.created_at < p_until)
          AND (p_queue IS NULL OR t.queue = p_queue)
          AND (p_args IS NULL OR t.args @> p_args)
        ORDER BY t.id DESC LIMIT p_limit;
    ELSE
        RETURN QUERY
        SELECT t.id FROM __SCHEMA__.tasks t
        WHERE t.state = 'pending' AND t.id > coalesce(p_after, 0)
          AND (p_task_name IS NULL OR t.task_name = p_task_name)
          AND (p_since IS NULL OR t.created_at >= p_since)
          AND (p_until IS NULL OR t.created_at < p_until)
          AND (p_queue IS NULL OR t.queue = p_queue)
          AND (p_args IS NULL OR t.args @> p_args)
        ORDER BY t.id LIMIT p_limit;
    END IF;
END
$$;

-- Every migration records its own version, so a schema built by applying these files in
-- order is one the library accepts; install() records it too (a no-op here).
INSERT INTO __SCHEMA__.schema_migrations (version, name)
VALUES (19, '0019_pending_tasks_listed_by_id')
ON CONFLICT (version) DO NOTHING;
