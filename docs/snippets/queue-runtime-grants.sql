-- The work queue's runtime role: what a worker (and a producer calling enqueue) needs.
-- {schema} is the queue schema (default steeple_queue), {role} the runtime role.
-- Run as the role that installed the schema (`steeple migrate` / queue.install).
-- Executed by packages/postgres/tests/test_queue_documented.py, which runs enqueue,
-- a worker, cancel, prune_terminal, every jobs operation and the queue settings (pause,
-- resume, limits, which every claim then locks and updates) as a role holding only these.
GRANT USAGE ON SCHEMA {schema} TO {role};
GRANT SELECT ON {schema}.schema_migrations TO {role};
GRANT SELECT, INSERT, UPDATE, DELETE ON {schema}.tasks TO {role};
-- SELECT on attempts: run_state returns the attempt history (schema version 7 and later).
GRANT SELECT, INSERT ON {schema}.attempts TO {role};
GRANT SELECT, INSERT, UPDATE, DELETE ON {schema}.jobs TO {role};
GRANT SELECT, INSERT, UPDATE, DELETE ON {schema}.settings TO {role};
-- key_starts: each per-key rate window, appended to and pruned by every claim (version 14).
GRANT SELECT, INSERT, DELETE ON {schema}.key_starts TO {role};
-- task_dependencies: every statement that ends a task looks up its waiting tasks, and a
-- workflow's enqueue inserts its edges (version 12); a workflow's task ids are drawn from
-- the tasks' identity sequence in the same statement, which needs USAGE on it.
GRANT SELECT, INSERT ON {schema}.task_dependencies TO {role};
GRANT USAGE ON ALL SEQUENCES IN SCHEMA {schema} TO {role};
