-- steeple work queue, schema version 17: a claim under limits records per-key starts only
-- when a scope it consulted limits key rates.
-- Forward-only: there is no down migration. __SCHEMA__ is replaced by the quoted target
-- schema name by install() (or by hand: see "Applying the SQL by hand" in the Scheduler
-- Design page).
--
-- Every claim of a paused or limited queue (or task name) called claim_key_starts, a SQL
-- function: PostgreSQL plans its INSERT and DELETE again at each call, and the INSERT
-- looks up every claimed task twice, even when no scope limits key rates, so that call
-- was the largest single cost of a claim under a global running limit. The function is
-- now PL/pgSQL and returns at once when none of the scopes the claim consulted has a key
-- rate limit; otherwise it does what version 14's did. Same signature and result, so the
-- claim (version 14) and running workers of versions 14 to 16 call it as before.

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

-- Every migration records its own version, so a schema built by applying these files in
-- order is one the library accepts; install() records it too (a no-op here).
INSERT INTO __SCHEMA__.schema_migrations (version, name)
VALUES (17, '0017_key_starts_when_key_rates_limit')
ON CONFLICT (version) DO NOTHING;
