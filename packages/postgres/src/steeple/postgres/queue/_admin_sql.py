"""The operator statements of the queue (listings, counts, retry), built once per schema.

Kept apart from ``_sql.py`` (the worker's hot path). Every task state a statement writes or
selects on comes from ``steeple.core.tasks``' transition table, as in ``_sql.py``.
"""

from __future__ import annotations

import functools

import attrs

from steeple.core.tasks import TaskEvent
from steeple.postgres.queue._schema import validate_schema
from steeple.postgres.queue._sql import (
    DURABLE,
    LIVE,
    PRUNABLE,
    RUN_STATE_COLUMNS,
    TERMINAL,
    _after,
    _from,
    _in,
    _only,
    kept_for_dependents,
)
from steeple.postgres.queue.jobs import _COLUMNS as JOB_COLUMNS

_RETRIED = _after(TaskEvent.RETRY)
# The state a task enqueued after others waits in (the only one DEPENDENCIES_MET leaves).
_WAITING = _only(_from(TaskEvent.DEPENDENCIES_MET))
_RETRYABLE = _in(_from(TaskEvent.RETRY))


@attrs.frozen
class AdminSql:
    """The operator statements of one schema."""

    list_tasks: str
    list_tasks_newest: str
    list_pending: str
    count_by_state: str
    throughput: str
    task_args: str
    retry: str
    count_prunable: str
    list_jobs: str
    count_by_state_bounded: str


def admin_sql(schema: str) -> AdminSql:
    """Return the operator statements for ``schema``.

    Raises:
        QueueConfigurationError: invalid schema name.
        QueueTypeError: a schema that is not a str.
    """
    validate_schema(schema)  # before the cache: an unhashable schema is a typed error too
    return _admin_sql(schema)


@functools.lru_cache(maxsize=64)
def _admin_sql(schema: str) -> AdminSql:
    s = validate_schema(schema)
    return AdminSql(
        # $1 exclusive id cursor, $2 state|null, $3 task name|null, $4 limit,
        # $5/$6 created at or after / before (null: unbounded), $7 queue|null,
        # $8 JSON the args contain (jsonb @>), or null
        list_tasks=f"""
SELECT {RUN_STATE_COLUMNS} FROM {s}.tasks
WHERE id > $1 AND ($2::text IS NULL OR state = $2) AND ($3::text IS NULL OR task_name = $3)
  AND ($5::timestamptz IS NULL OR created_at >= $5)
  AND ($6::timestamptz IS NULL OR created_at < $6) AND ($7::text IS NULL OR queue = $7)
  AND ($8::text IS NULL OR args @> $8::text::jsonb)
ORDER BY id
LIMIT $4""",
        # The same, newest first: $1 is the exclusive upper id cursor (null: from the top).
        list_tasks_newest=f"""
SELECT {RUN_STATE_COLUMNS} FROM {s}.tasks
WHERE ($1::bigint IS NULL OR id < $1) AND ($2::text IS NULL OR state = $2)
  AND ($3::text IS NULL OR task_name = $3)
  AND ($5::timestamptz IS NULL OR created_at >= $5)
  AND ($6::timestamptz IS NULL OR created_at < $6) AND ($7::text IS NULL OR queue = $7)
  AND ($8::text IS NULL OR args @> $8::text::jsonb)
ORDER BY id DESC
LIMIT $4""",
        # Pending tasks only, the parameters of list_tasks ($2 is 'pending'; $1 null and
        # $9 true: newest first, from the top): pending_page walks the pending tasks' id
        # index and stops after the page, however long the backlog.
        list_pending=f"""
SELECT {RUN_STATE_COLUMNS} FROM {s}.tasks
WHERE $2::text = 'pending' AND id = ANY (ARRAY(
    SELECT p.id FROM {s}.pending_page($1, $9, $4, $3, $5, $6, $7, $8::text::jsonb) AS p))
ORDER BY CASE WHEN $9::boolean THEN -id ELSE id END""",
        count_by_state=f"SELECT state, count(*) FROM {s}.tasks GROUP BY state",
        # $1 window (interval), $2 bucket width (interval). Terminal tasks by how many whole
        # buckets ago they finished, on the server's clock (read once); the terminal index
        # on finished_at serves the range. The first row carries the clock even when empty.
        throughput=f"""
WITH now AS (SELECT clock_timestamp() AS at)
SELECT now.at, NULL::text, NULL::integer, 0::bigint, NULL::text FROM now
UNION ALL
SELECT now.at, t.state,
       floor(extract(epoch FROM now.at - t.finished_at) / extract(epoch FROM $2::interval))::int,
       count(*), t.queue
FROM {s}.tasks t, now
WHERE t.state IN {TERMINAL} AND t.finished_at > now.at - $1::interval
  AND t.finished_at <= now.at
GROUP BY now.at, t.state, 3, t.queue""",
        # $1 task id: the args as stored (JSON text)
        task_args=f"SELECT args::text FROM {s}.tasks WHERE id = $1",
        # $1 id. A live task holding the same dedup key blocks the retry (the unique index
        # allows one live task per name and key); otherwise the task is pending again, due at
        # once on any clock (run_at = created_at, as for immediate work) and granted at least
        # one more attempt. Its id, run_id and attempt history stay.
        retry=f"""
WITH target AS (
    SELECT id, state, task_name, dedup_key FROM {s}.tasks WHERE id = $1 FOR NO KEY UPDATE
), blocker AS (
    SELECT d.id FROM {s}.tasks d, target
    WHERE target.dedup_key IS NOT NULL AND d.task_name = target.task_name
      AND d.dedup_key = target.dedup_key AND d.state IN {LIVE} AND d.id <> target.id
    LIMIT 1
), done AS (
    UPDATE {s}.tasks t
    SET state = '{_RETRIED.value}', run_at = t.created_at, finished_at = NULL,
        max_attempts = greatest(t.max_attempts, t.attempts + 1), worker_id = NULL,
        updated_at = clock_timestamp()
    FROM {DURABLE}, target
    WHERE t.id = target.id AND target.state IN {_RETRYABLE}
      AND NOT EXISTS (SELECT 1 FROM blocker)
    RETURNING t.id
)
SELECT target.state, (SELECT count(*) FROM done), (SELECT id FROM blocker) FROM target""",
        # $1 older-than interval: what prune_terminal would remove, however many batches
        count_prunable=(
            f"SELECT count(*) FROM {s}.tasks p WHERE {PRUNABLE} AND {kept_for_dependents(s, 'p')}"
        ),
        # $1 how many to count at most per state (pending, running) or in all (terminal),
        # $2 the schema's name. count_states walks each state's partial index and stops;
        # then the statistics' estimate of each state, from the last ANALYZE (none before).
        count_by_state_bounded=f"""
SELECT c.state, c.n FROM {s}.count_states($1, NULL) AS c
UNION ALL
SELECT '{_WAITING.value}', count(*) FROM (
    SELECT 1 FROM {s}.tasks w WHERE w.state = '{_WAITING.value}' ORDER BY w.id LIMIT $1
) AS waiting
UNION ALL
SELECT 'about ' || m.state, (m.freq * greatest(c.reltuples, 0))::bigint
FROM pg_stats st
JOIN pg_class c ON c.relname = st.tablename
JOIN pg_namespace n ON n.oid = c.relnamespace AND n.nspname = st.schemaname
CROSS JOIN LATERAL unnest(st.most_common_vals::text::text[], st.most_common_freqs)
    AS m(state, freq)
WHERE st.schemaname = $2 AND st.tablename = 'tasks' AND st.attname = 'state'""",
        # $1 exclusive name cursor ('' for the first page), $2 limit
        list_jobs=f"""
SELECT {JOB_COLUMNS} FROM {s}.jobs WHERE name > $1 ORDER BY name LIMIT $2""",
    )
