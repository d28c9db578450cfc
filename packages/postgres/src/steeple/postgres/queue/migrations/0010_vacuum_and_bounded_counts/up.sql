-- steeple work queue, schema version 10: room on every page of the busy tables for the new
-- versions of the rows updated there, vacuum that keeps up with a queue's churn, and
-- bounded counts for operators over a backlog of millions.
-- Forward-only: there is no down migration.
-- __SCHEMA__ is replaced by the quoted target schema name by install() (or by hand: see
-- "Applying the SQL by hand" in the Scheduler Design page).
--
-- Every task row is updated two to four times in its life (claim, lease renewals, progress,
-- outcome) and then deleted by pruning. An update writes a new version of the row; when the
-- old version's page has room, the new one goes on the same page, and when no indexed
-- column changed (progress, a rate-limited queue's window of starts) it is a heap-only
-- tuple (HOT) that adds no index entry at all and is cleaned by any later reader of the
-- page, without waiting for VACUUM. The claim and the outcome change `state`, which the
-- partial indexes test, so they cannot be HOT; they still stay on their page when it has
-- room, which keeps the table's pages and the claim index's heap visits few.
--
-- A fill factor only applies to pages written from now on: existing pages fill as before
-- until their rows are pruned. Setting storage parameters takes a SHARE UPDATE EXCLUSIVE
-- lock: it never blocks reads or writes of the table (only another ALTER or a VACUUM).
--
-- Vacuum: the default scale factor (20% of the table) lets a table of a million finished
-- tasks collect 200,000 dead rows before it is vacuumed; a queue's table churns all the
-- time, so it is vacuumed after 2% (plus 1,000 rows) changes instead, and analyzed after 5%,
-- which also keeps the planner's picture of the pending work current. Operators may change
-- these with ALTER TABLE ... SET (...) or RESET (...); later migrations never touch them.
ALTER TABLE __SCHEMA__.tasks SET (
    fillfactor = 80,
    autovacuum_vacuum_scale_factor = 0.02,
    autovacuum_vacuum_threshold = 1000,
    autovacuum_vacuum_insert_scale_factor = 0.05,
    autovacuum_analyze_scale_factor = 0.05
);
ALTER TABLE __SCHEMA__.attempts SET (
    autovacuum_vacuum_scale_factor = 0.02,
    autovacuum_vacuum_threshold = 1000
);
-- A limited queue's or task name's row is rewritten by every claim of it (its window of
-- recent starts is not indexed, so those updates can be HOT when the page has room).
ALTER TABLE __SCHEMA__.settings SET (fillfactor = 50);

-- The claim is never JIT-compiled. Its batch size is a parameter, so the planner costs each
-- walk as if it read a tenth of the pending tasks; once the statistics say a queue holds
-- millions, that estimate passes jit_above_cost and every claim spent 20-200 ms compiling
-- a plan that then ran in well under a millisecond (10 million pending tasks, after ANALYZE:
-- 36 ms per claim of one task instead of 3). Only the function's settings change: its body,
-- signature and result stay, so running workers call it as before.
ALTER FUNCTION __SCHEMA__.claim(text[], integer[], text[], text, double precision)
    SET jit = off;

-- Bounded counts for operators and dashboards, which ask every few seconds: at most p_cap
-- tasks are read per state (pending, running; terminal ones in all), each part walking its
-- state's partial index in the index's order and stopping, never a pass over a backlog of
-- millions. The SET clauses keep the plan on those walks whatever the statistics say (a
-- bulk-loaded table without statistics would otherwise be bitmap-scanned and sorted in
-- full). With p_queue, only that queue's pending and running tasks are counted.
-- due_since: the earliest due instant among the pending tasks read (all of them when
-- fewer than p_cap).
CREATE FUNCTION __SCHEMA__.count_states(p_cap integer, p_queue text)
RETURNS TABLE (state text, n bigint, due_since timestamptz)
LANGUAGE plpgsql
STABLE
SET enable_sort = off
SET enable_bitmapscan = off
SET enable_seqscan = off
-- A plan that must sort anyway (the queues' union) costs as much as a disabled node, far
-- past jit_above_cost: compiling it would take longer than running it.
SET jit = off
SET plan_cache_mode = force_custom_plan
AS $$
#variable_conflict use_column
BEGIN
    IF p_queue IS NULL THEN
        RETURN QUERY
        SELECT 'pending'::text, count(*), min(x.due) FROM (
            SELECT greatest(t.run_at, t.created_at) AS due FROM __SCHEMA__.tasks t
            WHERE t.state = 'pending' ORDER BY t.queue, t.priority DESC, t.run_at, t.id
            LIMIT p_cap) AS x;
        RETURN QUERY
        SELECT 'running'::text, count(*), NULL::timestamptz FROM (
            SELECT 1 FROM __SCHEMA__.tasks t
            WHERE t.state = 'running' ORDER BY t.queue, t.task_name LIMIT p_cap) AS x;
        RETURN QUERY
        SELECT x.state, count(*), NULL::timestamptz FROM (
            SELECT t.state FROM __SCHEMA__.tasks t
            WHERE t.state IN ('succeeded', 'failed', 'cancelled')
            ORDER BY t.finished_at DESC LIMIT p_cap) AS x
        GROUP BY x.state;
    ELSE
        RETURN QUERY
        SELECT 'pending'::text, count(*), min(x.due) FROM (
            SELECT greatest(t.run_at, t.created_at) AS due FROM __SCHEMA__.tasks t
            WHERE t.queue = p_queue AND t.state = 'pending'
            ORDER BY t.priority DESC, t.run_at, t.id LIMIT p_cap) AS x;
        RETURN QUERY
        SELECT 'running'::text, count(*), NULL::timestamptz FROM (
            SELECT 1 FROM __SCHEMA__.tasks t
            WHERE t.queue = p_queue AND t.state = 'running' ORDER BY t.task_name LIMIT p_cap
        ) AS x;
    END IF;
END
$$;

-- The queues that hold pending or running tasks, by name (at most p_limit): a skip scan of
-- the two partial indexes (one probe per queue), never a pass over their tasks.
CREATE FUNCTION __SCHEMA__.live_queues(p_limit integer)
RETURNS TABLE (queue text)
LANGUAGE sql
STABLE
SET enable_sort = off
SET enable_bitmapscan = off
SET enable_seqscan = off
SET jit = off
AS $$
WITH RECURSIVE pending_queues AS (
    (SELECT t.queue FROM __SCHEMA__.tasks t WHERE t.state = 'pending'
     ORDER BY t.queue, t.priority DESC, t.run_at, t.id LIMIT 1)
    UNION ALL
    SELECT (SELECT t.queue FROM __SCHEMA__.tasks t
            WHERE t.state = 'pending' AND t.queue > q.queue
            ORDER BY t.queue, t.priority DESC, t.run_at, t.id LIMIT 1)
    FROM pending_queues q WHERE q.queue IS NOT NULL
), running_queues AS (
    (SELECT t.queue FROM __SCHEMA__.tasks t WHERE t.state = 'running'
     ORDER BY t.queue, t.task_name LIMIT 1)
    UNION ALL
    SELECT (SELECT t.queue FROM __SCHEMA__.tasks t
            WHERE t.state = 'running' AND t.queue > q.queue
            ORDER BY t.queue, t.task_name LIMIT 1)
    FROM running_queues q WHERE q.queue IS NOT NULL
), found AS (
    SELECT p.queue FROM pending_queues p WHERE p.queue IS NOT NULL
    UNION SELECT r.queue FROM running_queues r WHERE r.queue IS NOT NULL
)
SELECT f.queue FROM found f ORDER BY 1 LIMIT p_limit
$$;

-- Every migration records its own version, so a schema built by applying these files in
-- order is one the library accepts; install() records it too (a no-op here).
INSERT INTO __SCHEMA__.schema_migrations (version, name)
VALUES (10, '0010_vacuum_and_bounded_counts')
ON CONFLICT (version) DO NOTHING;
