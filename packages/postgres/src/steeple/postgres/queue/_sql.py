"""Every SQL statement of the queue, built once per schema.

Each statement that must be durable calls ``set_config('synchronous_commit', 'on', true)``
inside itself: a session or role with ``synchronous_commit=off`` would otherwise lose
acknowledged commits on a crash, and doing it in-statement costs no round trip. A lease token
is present exactly while a task runs (a CHECK constraint), so fenced statements match on
``id`` and ``lease_token`` alone and never mention ``state = 'running'``: with statistics
taken while nothing ran, that predicate lures the planner onto the expired-lease index and a
scan of every running row. Every lease comparison uses ``clock_timestamp()``: ``now()``
is the transaction start, stale after a lock wait.

Every task state a statement writes or selects on comes from ``steeple.core.tasks``'
transition table, never from a literal: a write of event E from states S is
``transition(S, E)``, computed once here when the statements are built (so the SQL text,
and the hot path, are the same as hand-written literals). What the migrations hard-code
(the claim function, CHECK constraints, partial indexes) is checked against the table by
``test_queue_lifecycle_sql.py``, which also runs every statement and compares each move
it makes with ``transition()``.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Final

import attrs

from steeple.core.tasks import (
    TASK_TRANSITIONS,
    TERMINAL_TASK_STATES,
    TaskEvent,
    TaskState,
    transition,
)
from steeple.core.workflows import DELETED_PARENT, ParentFailure, settlement
from steeple.postgres.queue._schema import notify_channel, validate_schema
from steeple.postgres.queue._validate import DEFAULT_QUEUE


def _after(event: TaskEvent) -> TaskState:
    """Return the one state ``event`` leads to, from every state the table allows it in."""
    targets = {after for (_, on), after in TASK_TRANSITIONS.items() if on is event}
    if len(targets) != 1:  # a statement writes one state per event; more needs a CASE here
        raise AssertionError(f"{event} leads to {len(targets)} states")
    return targets.pop()


def _from(event: TaskEvent) -> frozenset[TaskState]:
    """Return the states the table allows ``event`` in."""
    return frozenset(state for (state, on) in TASK_TRANSITIONS if on is event)


def _quoted(text: str) -> str:
    """``text`` as an SQL string literal (a NOTIFY channel: built from a validated schema)."""
    return "'" + text.replace("'", "''") + "'"


def _lit(state: TaskState) -> str:
    return f"'{state.value}'"


def _in(states: Iterable[TaskState]) -> str:
    chosen = set(states)
    return "(" + ", ".join(_lit(s) for s in TaskState if s in chosen) + ")"


def _finished(state: TaskState) -> str:
    """``finished_at`` for a task entering ``state``: set exactly for terminal states."""
    return "clock_timestamp()" if state in TERMINAL_TASK_STATES else "NULL"


def _only(states: frozenset[TaskState]) -> TaskState:
    if len(states) != 1:
        raise AssertionError(f"expected one state, got {sorted(s.value for s in states)}")
    return next(iter(states))


PENDING: Final = _only(_from(TaskEvent.CLAIM))
"""The state claims take tasks from (the claim index's predicate)."""
RUNNING: Final = transition(PENDING, TaskEvent.CLAIM)
"""The state of a claimed task, which holds the lease token."""
LIVE: Final = _in(s for s in TaskState if s not in TERMINAL_TASK_STATES)
TERMINAL: Final = _in(TERMINAL_TASK_STATES)
PRUNABLE: Final = f"state IN {TERMINAL} AND finished_at < clock_timestamp() - $1::interval"
"""The tasks ``prune_terminal`` removes ($1: the age, an interval), oldest finished first.

Those a live dependent still needs are kept too (see :func:`kept_for_dependents`).
"""


def kept_for_dependents(schema: str, task: str) -> str:
    """Return the condition that no live task of ``schema`` depends on ``task`` (an alias).

    A dependent reads its parents' results when it runs, and a waiting one is settled
    by its parents' outcomes: prune keeps a finished task until every task that waits
    on it has finished too.
    """
    return (
        f"NOT EXISTS (SELECT 1 FROM {schema}.task_dependencies e "
        f"JOIN {schema}.tasks c ON c.id = e.child_id "
        f"WHERE e.parent_id = {task}.id AND c.state IN {LIVE})"
    )


SUCCEEDED: Final = transition(RUNNING, TaskEvent.SUCCEED)
_RETRIED = transition(RUNNING, TaskEvent.FAIL_RETRYABLE)
_FAILED = transition(RUNNING, TaskEvent.FAIL_PERMANENT)
_RELEASED = transition(RUNNING, TaskEvent.RELEASE)
_EXPIRED = transition(RUNNING, TaskEvent.LEASE_EXPIRED)
_EXPIRED_FINAL = transition(RUNNING, TaskEvent.LEASE_EXPIRED_FINAL)
_CANCELLED = _after(TaskEvent.CANCEL)
_CANCELLABLE = _in(_from(TaskEvent.CANCEL))
# The attempt history's word for each outcome (the attempts.outcome CHECK constraint).
_OUTCOME: Final = {
    TaskEvent.SUCCEED: "'succeeded'",
    TaskEvent.FAIL_RETRYABLE: "'retried'",
    TaskEvent.FAIL_PERMANENT: "'failed'",
    TaskEvent.RELEASE: "'released'",
    TaskEvent.LEASE_EXPIRED: "'lease_expired'",
}
# core's attempts_exhausted(attempt, max_attempts), set-based: a row's attempts counts the
# running attempt. Checked against core over a grid of values by test_queue_lifecycle_sql.
_EXHAUSTED = "t.attempts >= t.max_attempts"


def _orphan_settled(s: str) -> str:
    """Return SET clauses settling a stranded waiting task none of whose parents exists.

    Such a task (``t``) is settled against :data:`DELETED_PARENT` by core's settlement for
    its policy; one with a parent left keeps its state, finish and error.
    """
    kept = f"EXISTS (SELECT 1 FROM {s}.task_dependencies e WHERE e.child_id = t.id)"
    state, finished, error = [f"CASE WHEN {kept} THEN t.{c}" for c in _ORPHAN_COLUMNS]
    for policy in ParentFailure:
        event = settlement(DELETED_PARENT, policy).event or TaskEvent.DEPENDENCIES_MET
        after = transition(TaskState.WAITING, event)
        when = f" WHEN t.on_parent_failure = '{policy.value}' THEN "
        state += when + _lit(after)
        finished += when + _finished(after)
        error += when + (_ORPHAN_ERROR if after in TERMINAL_TASK_STATES else "t.last_error")
    return ", ".join(
        f"{c} = {case} ELSE t.{c} END"
        for c, case in zip(_ORPHAN_COLUMNS, (state, finished, error), strict=True)
    )


_ORPHAN_COLUMNS = ("state", "finished_at", "last_error")
_ORPHAN_ERROR = "'cancelled: a task it waited for was deleted before its outcome settled this one'"

DURABLE = "(SELECT set_config('synchronous_commit', 'on', true)) AS durable"
# Claims and renewals may commit asynchronously: losing one in a server crash leaves the
# task pending (or its lease shorter), so it is claimed again under a NEW token and the old
# holder is fenced out; at-least-once holds, and the pickup path saves a WAL flush.
RELAXED = "(SELECT set_config('synchronous_commit', 'off', true)) AS relaxed"
# The NOTIFY payload: empty for work due now, else its due time in epoch seconds, so
# listening workers can wake exactly then instead of at their next poll.
_DUE_PAYLOAD = (
    "CASE WHEN {run_at} > clock_timestamp() THEN extract(epoch FROM {run_at})::text ELSE '' END"
)
# One server instant per statement: an immediate task's run_at equals its created_at
# exactly, which is how the claim knows it was due when it was created (see migration 0002).
_NOW = "created AS MATERIALIZED (SELECT clock_timestamp() AS at)"
_RUN_AT = "coalesce({run_at}::timestamptz, created.at + coalesce({delay}::interval, interval '0'))"
RUN_STATE_COLUMNS: Final = (
    "id, task_name, state, priority, run_at, attempts, max_attempts, run_id, worker_id, "
    "lease_expires_at, dedup_key, job_id, scheduled_for, created_at, started_at, finished_at, "
    "last_error, queue, progress::text"
)
"""The columns of a ``TaskRun`` (``TaskRun.from_row``), in order: ``run_state`` and listings."""
_TASK_COLUMNS = (
    "task_name, args, priority, run_at, max_attempts, lease_duration, "
    "backoff_initial_us, backoff_maximum_us, backoff_factor, backoff_jitter, queue, limit_key"
)


# The tasks a lease-recovery statement failed for good (the others are pending again).
_ENDED_FOR_GOOD: Final = f"SELECT id FROM done WHERE state = {_lit(_EXPIRED_FINAL)}"
_RUN_STATE_OF_T: Final = ", ".join("t." + c.strip() for c in RUN_STATE_COLUMNS.split(","))


def _settled(s: str, ended: str, state: TaskState, schema: str) -> str:
    """Return the CTE ``settled``: the waiting dependents of the tasks ``ended`` selects, settled.

    ``ended`` must select only the tasks this statement moved (a token-fenced ``done``), so
    a stale completion settles nothing. MATERIALIZED: evaluated once, never per row.
    """
    # The function is called only when one of them has a dependent: on a queue without
    # workflows the release costs one index probe per ended task, no function call.
    return (
        f"settled AS MATERIALIZED (SELECT CASE WHEN EXISTS (SELECT 1 FROM {s}.task_dependencies"
        f" e WHERE e.parent_id IN ({ended})) THEN {s}.settle_dependents(ARRAY({ended}), "
        f"{_lit(state)}, {_quoted(notify_channel(schema))}) ELSE 0 END AS released)"
    )


@attrs.frozen
class QueueSql:
    """The statements of one schema."""

    schema: str
    channel: str
    enqueue: str
    enqueue_many: str
    find_duplicate: str
    trace_contexts: str
    claim: str
    claim_timed: str
    renew: str
    complete: str
    complete_and_claim: str
    completed_by: str
    failure_recorded: str
    retry: str
    fail: str
    progress: str
    release: str
    recover_expired: str
    settle_stranded: str
    lost_states: str
    run_state: str
    cancel: str
    prune: str
    enqueue_graph: str
    workflow: str
    parent_results: str


def queue_sql(schema: str) -> QueueSql:
    """Return the statements for ``schema`` (built once per schema).

    Raises:
        QueueConfigurationError: invalid schema name.
        QueueTypeError: a schema that is not a str.
    """
    validate_schema(schema)  # before the cache: an unhashable schema is a typed error too
    return _queue_sql(schema)


@functools.lru_cache(maxsize=64)
def _queue_sql(schema: str) -> QueueSql:
    s = validate_schema(schema)
    return QueueSql(
        schema=schema,
        channel=notify_channel(schema),
        # $1 name, $2 args, $3 priority, $4 run_at|null, $5 max_attempts, $6 lease,
        # $7..$10 backoff, $11 dedup key, $12 channel, $13 delay|null (from the server's now),
        # $14 trace context|null (JSON text, see _tracing.py), $15 queue, $16 limit key|null
        enqueue=f"""
WITH {_NOW}
INSERT INTO {s}.tasks ({_TASK_COLUMNS}, dedup_key, created_at, updated_at, trace_context)
SELECT $1, $2::text::jsonb, $3, {_RUN_AT.format(run_at="$4", delay="$13")}, $5, $6::interval,
       $7, $8, $9, $10, $15, $16, $11, created.at, created.at, $14::text::jsonb
FROM created, {DURABLE}
ON CONFLICT (task_name, dedup_key) WHERE dedup_key IS NOT NULL AND state IN {LIVE} DO NOTHING
RETURNING id, pg_notify($12, {_DUE_PAYLOAD.format(run_at="run_at")})::text""",
        # $1 name, $2 every args as one JSON array text (Task.encode_all), $3.. as above
        # but no dedup; $11 channel, $12 delay|null, $13 queue, $14 limit key|null, $15 trace
        # context|null (one for the batch), $16 the run ids: 16 random bytes per task, in
        # order (random_run_ids: the column's default, gen_random_uuid(), cost the server
        # 5-40% of the insert, by its build's random source; too short a $16 fails the
        # statement, never a row).
        enqueue_many=f"""
WITH {_NOW}, ins AS (
    INSERT INTO {s}.tasks ({_TASK_COLUMNS}, created_at, updated_at, trace_context, run_id)
    SELECT $1, u.a, $3, {_RUN_AT.format(run_at="$4", delay="$12")}, $5, $6::interval,
           $7, $8, $9, $10, $13, $14, created.at, created.at, $15::text::jsonb,
           encode(substr($16::bytea, u.n::integer * 16 - 15, 16), 'hex')::uuid
    FROM created, {DURABLE}, jsonb_array_elements($2::text::jsonb) WITH ORDINALITY AS u(a, n)
    ORDER BY u.n
    RETURNING id, run_at
)
SELECT array_agg(id ORDER BY id),
       pg_notify($11, {_DUE_PAYLOAD.format(run_at="min(run_at)")})::text
FROM ins""",
        find_duplicate=f"""
SELECT id FROM {s}.tasks
WHERE task_name = $1 AND dedup_key = $2 AND state IN {LIVE}""",
        # $1 ids[]: the enqueuers' trace contexts of claimed tasks (only while tracing)
        trace_contexts=f"""
SELECT id, trace_context::text FROM {s}.tasks
WHERE id = ANY($1::text[]::bigint[]) AND trace_context IS NOT NULL""",
        # $1 names[], $2 limit, $3 worker id, $4 the claimer's give-up time (epoch s, in
        # server time): a claim from the default queue (operators' and tests' one-off
        # claims). The statement lives in a function (see the migrations) that pins the
        # planner to the ordered claim index, applies pauses and global limits and ignores
        # claims delivered too late. Rows of id NULL (a limit held some back) are dropped.
        claim=f"""
SELECT * FROM {s}.claim(ARRAY['{DEFAULT_QUEUE}'], ARRAY[$2::integer], $1::text[], $3::text,
                        $4::double precision) AS c
WHERE c.id IS NOT NULL""",
        # The worker's claim: $1 queues[], $2 wanted per queue[], $3 names[], $4 worker id,
        # $5 give-up time, $6 $7 $8 each queue's position to walk after (priority, run_at,
        # id; NULL: from the front); plus the server's clock read after the claim ran
        # (epoch s) as the first column, and one row of NULLs when nothing was claimed, so
        # every answer re-anchors the worker's estimate of the server's clock.
        claim_timed=f"""
WITH claimed AS (
    SELECT * FROM {s}.claim($1::text[], $2::text[]::integer[], $3::text[], $4::text,
                            $5::double precision, $6::text[]::integer[],
                            $7::text[]::timestamptz[], $8::text[]::bigint[])
)
SELECT extract(epoch FROM clock_timestamp())::double precision, claimed.*
FROM (SELECT) AS one LEFT JOIN claimed ON true""",
        # $1 ids[], $2 tokens[]
        renew=f"""
UPDATE {s}.tasks t
SET lease_expires_at = clock_timestamp() + t.lease_duration
FROM {RELAXED}, unnest($1::text[]::bigint[], $2::text[]::uuid[]) AS h(id, token)
WHERE t.id = h.id AND t.lease_token = h.token
RETURNING t.id""",
        # $1 ids, $2 tokens (array literals, see _arrays.array_literal), $3 worker id,
        # $4 results[] (JSON text|null), $5 latest progress[] (JSON text|null: keep what
        # was written); $4 or $5 NULL when all of theirs are (unnest pads it with NULLs)
        complete=f"""
SELECT c.id FROM {s}.complete_tasks($1::text::bigint[], $2::text::uuid[], $3::text,
                                    $4::text[], $5::text[], {_quoted(notify_channel(schema))})
    AS c(id)""",
        # The successes of complete ($1 .. $4 as its $1, $2, $4, $5; the worker id is the
        # claim's $8), then claim_timed's claim ($5 .. $12 as its $1 .. $8), in one
        # transaction: claim_timed's columns, then one more, completed (the ids that
        # succeeded), set in one row only (its id NULL, held false).
        complete_and_claim=f"""
WITH claimed AS (
    SELECT * FROM {s}.complete_and_claim(
        $1::text::bigint[], $2::text::uuid[], $3::text[], $4::text[],
        {_quoted(notify_channel(schema))}, $5::text[], $6::text[]::integer[], $7::text[],
        $8::text, $9::double precision, $10::text[]::integer[], $11::text[]::timestamptz[],
        $12::text[]::bigint[])
)
SELECT extract(epoch FROM clock_timestamp())::double precision, claimed.* FROM claimed""",
        # $1 ids[], $2 attempts[], $3 claim start times[], $4 worker id: which of these
        # claims did complete (their token is gone; no later claim keeps attempt and start)
        completed_by=f"""
SELECT t.id FROM {s}.tasks t
JOIN unnest($1::text[]::bigint[], $2::text[]::integer[], $3::text[]::timestamptz[])
  AS h(id, attempt, started_at)
  ON t.id = h.id
WHERE t.state = {_lit(SUCCEEDED)} AND t.attempts = h.attempt AND t.started_at = h.started_at
  AND t.worker_id = $4""",
        # $1 id, $2 attempt, $3 claim start time, $4 worker id, $5 retried (else failed):
        # whether that claim's failure is in the history (written by this worker)
        failure_recorded=f"""
SELECT a.task_id FROM {s}.attempts a
WHERE a.task_id = $1 AND a.attempt = $2 AND a.started_at = $3 AND a.worker_id = $4
  AND a.outcome = CASE WHEN $5::boolean THEN {_OUTCOME[TaskEvent.FAIL_RETRYABLE]}
                       ELSE {_OUTCOME[TaskEvent.FAIL_PERMANENT]} END""",
        # $1 id, $2 token, $3 delay interval, $4 error, $5 worker id, $6 error type,
        # $7 traceback, $8 latest progress (JSON text|null: keep what was written)
        retry=f"""
WITH done AS (
    UPDATE {s}.tasks t
    SET state = {_lit(_RETRIED)}, run_at = clock_timestamp() + $3::interval, lease_token = NULL,
        lease_expires_at = NULL, worker_id = NULL, last_error = $4, updated_at = clock_timestamp(),
        progress = coalesce($8::text::jsonb, t.progress)
    FROM {DURABLE}
    WHERE t.id = $1 AND t.lease_token = $2
    RETURNING t.id, t.attempts, t.started_at
), history AS (
    INSERT INTO {s}.attempts
        (task_id, attempt, worker_id, outcome, started_at, error, error_type, traceback)
    SELECT id, attempts, $5, {_OUTCOME[TaskEvent.FAIL_RETRYABLE]}, started_at, $4, $6, $7
    FROM done
)
SELECT id FROM done""",
        # $1 id, $2 token, $3 error, $4 worker id, $5 error type, $6 traceback,
        # $7 latest progress (JSON text|null: keep what was written)
        fail=f"""
WITH done AS (
    UPDATE {s}.tasks t
    SET state = {_lit(_FAILED)}, finished_at = clock_timestamp(), lease_token = NULL,
        lease_expires_at = NULL, last_error = $3, updated_at = clock_timestamp(),
        progress = coalesce($7::text::jsonb, t.progress)
    FROM {DURABLE}
    WHERE t.id = $1 AND t.lease_token = $2
    RETURNING t.id, t.attempts, t.started_at
), history AS (
    INSERT INTO {s}.attempts
        (task_id, attempt, worker_id, outcome, started_at, error, error_type, traceback)
    SELECT id, attempts, $4, {_OUTCOME[TaskEvent.FAIL_PERMANENT]}, started_at, $3, $5, $6
    FROM done
), {_settled(s, "SELECT id FROM done", _FAILED, schema)}
SELECT id FROM done, settled""",
        # $1 ids[], $2 tokens[], $3 progress[] (JSON text): the handlers' latest progress
        progress=f"""
UPDATE {s}.tasks t
SET progress = h.progress::jsonb
FROM {RELAXED}, unnest($1::text[]::bigint[], $2::text[]::uuid[], $3::text[])
    AS h(id, token, progress)
WHERE t.id = h.id AND t.lease_token = h.token
RETURNING t.id""",
        # $1 id, $2 token, $3 worker id: hand back work this worker will not finish (at
        # shutdown, or not started for want of a thread), attempt refunded. It keeps its
        # run_at: it was due, and stays due whatever the server's clock does; a NOTIFY wakes
        # the listening workers to take it.
        release=f"""
WITH done AS (
    UPDATE {s}.tasks t
    SET state = {_lit(_RELEASED)}, attempts = greatest(t.attempts - 1, 0),
        lease_token = NULL, lease_expires_at = NULL, worker_id = NULL,
        updated_at = clock_timestamp()
    FROM {DURABLE}
    WHERE t.id = $1 AND t.lease_token = $2
    RETURNING t.id, t.attempts, t.started_at
), history AS (
    INSERT INTO {s}.attempts (task_id, attempt, worker_id, outcome, started_at)
    SELECT id, attempts + 1, $3, {_OUTCOME[TaskEvent.RELEASE]}, started_at FROM done
)
SELECT id, pg_notify({_quoted(notify_channel(schema))}, '') FROM done""",
        # $1 limit. Exhausted attempts fail for good so a task that kills workers stops.
        # A recovered task keeps its run_at: it has waited longest and goes first again.
        recover_expired=f"""
WITH expired AS (
    SELECT id FROM {s}.tasks
    WHERE state = {_lit(RUNNING)} AND lease_expires_at < clock_timestamp()
    ORDER BY lease_expires_at
    LIMIT $1
    FOR NO KEY UPDATE SKIP LOCKED
), done AS (
    UPDATE {s}.tasks t
    SET state = CASE WHEN {_EXHAUSTED} THEN {_lit(_EXPIRED_FINAL)} ELSE {_lit(_EXPIRED)} END,
        finished_at = CASE WHEN {_EXHAUSTED} THEN {_finished(_EXPIRED_FINAL)}
                           ELSE {_finished(_EXPIRED)} END,
        last_error = 'lease expired', lease_token = NULL,
        lease_expires_at = NULL, updated_at = clock_timestamp()
    FROM {DURABLE}, expired
    WHERE t.id = expired.id AND t.lease_expires_at < clock_timestamp()
    RETURNING t.id, t.attempts, t.worker_id, t.started_at, t.state
), history AS (
    INSERT INTO {s}.attempts (task_id, attempt, worker_id, outcome, started_at, error)
    SELECT id, attempts, worker_id, {_OUTCOME[TaskEvent.LEASE_EXPIRED]}, started_at, 'lease expired'
    FROM done
), {_settled(s, _ENDED_FOR_GOOD, _EXPIRED_FINAL, schema)}
SELECT id, state FROM done, settled""",
        # $1 how many waiting tasks to look at, $2 the id to look after (0: from the
        # start). A worker of an earlier release ends tasks without settling their waiting
        # dependents; this finds waiting tasks (by the index on them, at most $1) whose
        # parents all ended, counts their parents again and settles them against those
        # parents by settle_dependents, as a new graph is settled against ended parents
        # (migration 0012). Returns the last id looked at (NULL: none), how many were
        # looked at, and how many were settled. A cancelled one's own dependents are
        # settled by a later pass. One none of whose parents exists any more (pruned
        # before this pass) is settled against DELETED_PARENT (_orphan_settled).
        settle_stranded=f"""
WITH looked AS MATERIALIZED (
    SELECT id FROM {s}.tasks WHERE state = {_lit(TaskState.WAITING)} AND id > $2 ORDER BY id
    LIMIT $1
), stranded AS MATERIALIZED (
    SELECT t.id FROM {s}.tasks t
    WHERE t.id = ANY(ARRAY(SELECT id FROM looked)) AND t.state = {_lit(TaskState.WAITING)}
      AND NOT EXISTS (
          SELECT 1 FROM {s}.task_dependencies e JOIN {s}.tasks p ON p.id = e.parent_id
          WHERE e.child_id = t.id AND p.state IN {LIVE})
    FOR NO KEY UPDATE OF t SKIP LOCKED
), recounted AS MATERIALIZED (
    UPDATE {s}.tasks t
    SET waiting_on = (SELECT count(*) FROM {s}.task_dependencies e WHERE e.child_id = t.id),
        {_orphan_settled(s)}
    FROM {DURABLE}, stranded
    WHERE t.id = stranded.id
    RETURNING t.id, t.state
), woken AS MATERIALIZED (
    SELECT pg_notify({_quoted(notify_channel(schema))}, '')
    FROM recounted WHERE state = {_lit(TaskState.PENDING)} LIMIT 1
), parents AS MATERIALIZED (
    SELECT DISTINCT e.parent_id AS id, p.state
    FROM recounted r JOIN {s}.task_dependencies e ON e.child_id = r.id
    JOIN {s}.tasks p ON p.id = e.parent_id
), released AS MATERIALIZED (
    SELECT {s}.settle_dependents(
        ARRAY(SELECT id FROM parents WHERE state = {_lit(SUCCEEDED)}), {_lit(SUCCEEDED)},
        {_quoted(notify_channel(schema))}, ARRAY(SELECT id FROM recounted)) AS n
), settled AS MATERIALIZED (
    SELECT {s}.settle_dependents(
        ARRAY(SELECT id FROM parents WHERE state <> {_lit(SUCCEEDED)}), {_lit(_FAILED)},
        {_quoted(notify_channel(schema))}, ARRAY(SELECT id FROM recounted)) AS n
    FROM released
)
SELECT (SELECT max(id) FROM looked), (SELECT count(*) FROM looked),
       (SELECT count(*) FROM recounted)
FROM settled, (SELECT count(*) FROM woken) AS w""",
        lost_states=f"SELECT id, state FROM {s}.tasks WHERE id = ANY($1::text[]::bigint[])",
        # $1 id, $2 the most attempts of its history returned (the latest ones); then the
        # limit key and workflow id (TaskRun's last fields)
        run_state=f"""
SELECT {RUN_STATE_COLUMNS}, result::text, (
    SELECT coalesce(json_agg(h ORDER BY h.id), '[]'::json)::text FROM (
        SELECT a.id, a.attempt, a.outcome, a.worker_id, a.started_at, a.finished_at, a.error,
               a.error_type, a.traceback
        FROM {s}.attempts a WHERE a.task_id = t.id ORDER BY a.id DESC LIMIT $2
    ) AS h
), limit_key, workflow_id
FROM {s}.tasks t WHERE t.id = $1""",
        cancel=f"""
WITH target AS (
    SELECT id, state FROM {s}.tasks WHERE id = $1 FOR NO KEY UPDATE
), done AS (
    UPDATE {s}.tasks t
    SET state = {_lit(_CANCELLED)}, finished_at = clock_timestamp(), lease_token = NULL,
        lease_expires_at = NULL, updated_at = clock_timestamp(),
        last_error = coalesce(t.last_error, 'cancelled')
    FROM {DURABLE}, target
    WHERE t.id = target.id AND target.state IN {_CANCELLABLE}
    RETURNING t.id
), {_settled(s, "SELECT id FROM done", _CANCELLED, schema)}
SELECT target.state, (SELECT count(*) FROM done) FROM target, settled""",
        # $1 older-than interval, $2 limit
        prune=f"""
WITH victims AS (
    SELECT p.id FROM {s}.tasks p
    WHERE {PRUNABLE} AND {kept_for_dependents(s, "p")}
    ORDER BY finished_at
    LIMIT $2
    FOR UPDATE SKIP LOCKED
), gone AS (
    DELETE FROM {s}.tasks t USING {DURABLE}, victims WHERE t.id = victims.id RETURNING t.id
)
SELECT count(*) FROM gone""",
        # $1 the graph's tasks (JSON array text, see migration 0012), $2 trace context|null
        enqueue_graph=f"""
SELECT g.pos, g.id, g.state, g.workflow_id
FROM {s}.enqueue_graph($1::text::jsonb, {_quoted(notify_channel(schema))}, $2::text::jsonb) AS g
ORDER BY g.pos""",
        # $1 a task id: every task of its workflow (its own id for a task outside one, or
        # the workflow's id), with the ids of the tasks each waits for
        workflow=f"""
WITH wf AS (
    SELECT coalesce(t.workflow_id, t.id) AS id FROM {s}.tasks t WHERE t.id = $1
)
SELECT {_RUN_STATE_OF_T}, wf.id,
       t.waiting_on, t.on_parent_failure,
       coalesce((SELECT array_agg(e.parent_id ORDER BY e.parent_id)::text
                 FROM {s}.task_dependencies e WHERE e.child_id = t.id), '{{}}')
FROM wf JOIN {s}.tasks t ON t.id = wf.id
UNION ALL
SELECT {_RUN_STATE_OF_T}, wf.id,
       t.waiting_on, t.on_parent_failure,
       coalesce((SELECT array_agg(e.parent_id ORDER BY e.parent_id)::text
                 FROM {s}.task_dependencies e WHERE e.child_id = t.id), '{{}}')
FROM wf JOIN {s}.tasks t ON t.workflow_id = wf.id AND t.id <> wf.id
ORDER BY 1""",
        # $1 a task id: the tasks it waits (or waited) for, with their states and results
        parent_results=f"""
SELECT p.id, p.task_name, p.state, p.result::text
FROM {s}.task_dependencies e JOIN {s}.tasks p ON p.id = e.parent_id
WHERE e.child_id = $1
ORDER BY p.id""",
    )
