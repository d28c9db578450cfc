"""The queue's SQL moves tasks exactly as steeple.core's task transition table says.

``_sql.py`` computes every state it writes from the table; what the migrations hard-code
(the claim function, CHECK constraints, partial index predicates, the column default) is
parsed here and checked against it, and every state-writing statement is run on
PostgreSQL and each move it makes compared with ``transition()``. Editing either the table
or the SQL alone makes this file fail.
"""

from __future__ import annotations

import itertools
import json
import re
from datetime import UTC, datetime, timedelta
from importlib import resources
from typing import Any

import asyncpg
import pytest

from queue_support import pinned_clock
from steeple.core.tasks import (
    TASK_TRANSITIONS,
    TERMINAL_TASK_STATES,
    TaskEvent,
    TaskState,
    lease_expiry_event,
    transition,
)
from steeple.postgres._arrays import array_literal, text_array
from steeple.postgres.queue import EnqueueOptions, Progress, Task, enqueue, run_state
from steeple.postgres.queue._admin_sql import admin_sql
from steeple.postgres.queue._sql import queue_sql

NAME = "lifecycle"
CLAIM_SOURCES = {s for (s, e) in TASK_TRANSITIONS if e is TaskEvent.CLAIM}
NON_TERMINAL = set(TaskState) - TERMINAL_TASK_STATES


# --- the migrations, parsed ---------------------------------------------------------------


def _migrations() -> str:
    root = resources.files("steeple.postgres.queue") / "migrations"
    names = sorted(entry.name for entry in root.iterdir() if entry.is_dir())
    assert names, "no migrations found"
    return "\n".join((root / name / "up.sql").read_text() for name in names)


def _last(pattern: str, text: str) -> re.Match[str]:
    found = list(re.finditer(pattern, text, re.DOTALL))
    assert found, f"{pattern!r} not found in the migrations"
    return found[-1]


def _states(listed: str) -> set[TaskState]:
    return {TaskState(value) for value in re.findall(r"'(\w+)'", listed)}


def test_the_claim_function_moves_tasks_as_the_table_says() -> None:
    sql = _migrations()
    # The newest definition of the claim function that claims is the one installed (the
    # claim of older workers calls it; ALTER FUNCTION only changes settings), and its
    # walks are the newest claim_walk.
    body = [
        found.group(1)
        for found in re.finditer(
            r"CREATE (?:OR REPLACE )?FUNCTION __SCHEMA__\.claim\(.*?AS \$\$(.*?)\$\$;",
            sql,
            re.DOTALL,
        )
        if "SET state" in found.group(1)
    ][-1]
    walk = _last(r"FUNCTION __SCHEMA__\.claim_walk\(.*?AS \$\$(.*?)\$\$;", sql).group(1)
    # Every walk (one per queue, per limited task name, and the rest) picks from one state.
    picked = set(re.findall(r"p\.state = '(\w+)'", body + walk))
    written = re.findall(r"SET state = '(\w+)'", body)
    assert len(picked) == 1, picked
    assert len(written) == 1, written
    source, target = TaskState(picked.pop()), TaskState(written[0])
    assert (source, TaskEvent.CLAIM) in TASK_TRANSITIONS
    assert transition(source, TaskEvent.CLAIM) is target
    # It claims from every state the table allows a claim in, and only those.
    assert {source} == CLAIM_SOURCES
    # Global concurrency limits (the claim's shared claim_room) count the tasks in the
    # state a claim leads to.
    room = _last(r"FUNCTION __SCHEMA__\.claim_room\(.*?AS \$\$(.*?)\$\$;", sql).group(1)
    counted = set(re.findall(r"t\.state = '(\w+)'", body + room))
    assert counted == {target.value}, counted


def test_constraints_and_indexes_match_the_table() -> None:
    sql = _migrations()
    (running,) = {transition(s, TaskEvent.CLAIM) for s in CLAIM_SOURCES}
    # Every state of the table, and no other, may be stored.
    assert _states(_last(r"CHECK \(state IN \(([^)]*)\)\)", sql).group(1)) == set(TaskState)
    # A new task starts where claims take from.
    assert {TaskState(_last(r"state\s+text NOT NULL DEFAULT '(\w+)'", sql).group(1))} == (
        CLAIM_SOURCES
    )
    # The lease token is held exactly in the state a claim leads to.
    lease_check = _last(r"CHECK \(\(state = '(\w+)'\) = \(lease_token IS NOT NULL\)\)", sql)
    assert TaskState(lease_check.group(1)) is running
    finished = _last(r"CHECK \(\(state IN \(([^)]*)\)\) = \(finished_at IS NOT NULL\)\)", sql)
    assert _states(finished.group(1)) == TERMINAL_TASK_STATES
    # Partial indexes: the claim walk, expired leases, retention, live dedup keys.
    claim_idx = _last(r"tasks_claim_idx ON [^;]*WHERE state = '(\w+)'", sql)
    assert {TaskState(claim_idx.group(1))} == CLAIM_SOURCES
    lease_idx = _last(r"tasks_lease_idx ON [^;]*WHERE state = '(\w+)'", sql)
    assert TaskState(lease_idx.group(1)) is running
    running_idx = _last(r"tasks_running_idx ON [^;]*WHERE state = '(\w+)'", sql)
    assert TaskState(running_idx.group(1)) is running
    terminal_idx = _last(r"tasks_terminal_idx ON [^;]*WHERE state IN \(([^)]*)\)", sql)
    assert _states(terminal_idx.group(1)) == TERMINAL_TASK_STATES
    dedup_idx = _last(r"tasks_dedup_idx ON [^;]*state IN \(([^)]*)\)", sql)
    assert _states(dedup_idx.group(1)) == NON_TERMINAL


def test_the_states_in_the_statements_are_the_tables() -> None:
    sql = queue_sql("s")
    # The operator's retry moves failed tasks to pending; a live dedup key blocks it.
    retry = admin_sql("s").retry
    assert "target.state IN ('failed')" in retry
    assert "SET state = 'pending'" in retry
    assert "d.state IN ('waiting', 'pending', 'running')" in retry
    assert "state IN ('waiting', 'pending', 'running')" in sql.enqueue  # the dedup index's
    assert "state IN ('succeeded', 'failed', 'cancelled')" in sql.prune  # retention index
    for statement in (sql.enqueue, sql.find_duplicate, sql.cancel, sql.prune):
        for listed in re.findall(r"state IN (\([^)]*\))", statement):
            assert _states(listed) in (NON_TERMINAL, set(TERMINAL_TASK_STATES)), listed


# --- every statement, run ------------------------------------------------------------------


class Db:
    def __init__(self, conn: asyncpg.Connection, schema: str) -> None:
        self.conn = conn
        self.schema = schema
        self.sql = queue_sql(schema)
        # One task name per task: a claim takes exactly the task a case is about.
        self.names: dict[int, str] = {}

    async def state(self, task_id: int) -> TaskState:
        value = await self.conn.fetchval(
            f'SELECT state FROM "{self.schema}".tasks WHERE id = $1', task_id
        )
        return TaskState(value)

    async def enqueue(self, max_attempts: int = 3, after: list[int] | None = None) -> int:
        options = EnqueueOptions(max_attempts=max_attempts)
        name = f"{NAME}-{len(self.names)}"
        task: Task[Any] = Task(name)
        task_id = (await enqueue(self.conn, task, {}, options, schema=self.schema, after=after)).id
        self.names[task_id] = name
        return task_id

    async def claim(self, task_id: int) -> Any:
        give_up = await self.conn.fetchval(
            "SELECT extract(epoch FROM clock_timestamp())::double precision + 60"
        )
        rows = await self.conn.fetch(self.sql.claim, [self.names[task_id]], 1, "w", give_up)
        assert [r["id"] for r in rows] == [task_id]
        return rows[0]["lease_token"]

    async def moved(self, task_id: int, event: TaskEvent, sql: str, *args: Any) -> None:
        before = await self.state(task_id)
        assert await self.conn.fetch(sql, *args), f"{event} did not apply"
        assert await self.state(task_id) is transition(before, event), event


async def test_each_statement_makes_the_move_of_its_event(queue: Any) -> None:
    _, schema, conn = queue
    db = Db(conn, schema)
    sql = db.sql
    give_up = await conn.fetchval(
        "SELECT extract(epoch FROM clock_timestamp())::double precision + 60"
    )

    claimed = await db.enqueue()
    await db.moved(claimed, TaskEvent.CLAIM, sql.claim, [db.names[claimed]], 1, "w", give_up)

    ok = await db.enqueue()
    token = await db.claim(ok)
    await db.moved(
        ok,
        TaskEvent.SUCCEED,
        sql.complete,
        array_literal([ok]),
        array_literal([token]),
        "w",
        [None],
        [None],
    )
    assert (
        await conn.fetch(
            sql.completed_by,
            text_array([ok]),
            text_array([1]),
            text_array([await _started(db, ok)]),
            "w",
        )
    ) != []

    retried = await db.enqueue()
    token = await db.claim(retried)
    await db.moved(
        retried,
        TaskEvent.FAIL_RETRYABLE,
        sql.retry,
        retried,
        token,
        timedelta(0),
        "e",
        "w",
        None,
        None,
        None,
    )

    failed = await db.enqueue()
    token = await db.claim(failed)
    await db.moved(
        failed, TaskEvent.FAIL_PERMANENT, sql.fail, failed, token, "e", "w", None, None, None
    )

    released = await db.enqueue()
    token = await db.claim(released)
    await db.moved(released, TaskEvent.RELEASE, sql.release, released, token, "w")

    pending = await db.enqueue()
    await db.moved(pending, TaskEvent.CANCEL, sql.cancel, pending)
    running = await db.enqueue()
    await db.claim(running)
    await db.moved(running, TaskEvent.CANCEL, sql.cancel, running)
    # Workflows: the statement that ends a parent moves its waiting dependent.
    for parent_event, child_event in (
        (TaskEvent.SUCCEED, TaskEvent.DEPENDENCIES_MET),
        (TaskEvent.FAIL_PERMANENT, TaskEvent.DEPENDENCY_FAILED),
    ):
        parent = await db.enqueue()
        child = await db.enqueue(after=[parent])
        assert await db.state(child) is TaskState.WAITING
        token = await db.claim(parent)
        if parent_event is TaskEvent.SUCCEED:
            args: tuple[Any, ...] = (array_literal([parent]), array_literal([token]), "w")
            await conn.fetch(sql.complete, *args, [None], [None])
        else:
            await conn.fetch(sql.fail, parent, token, "e", "w", None, None, None)
        assert await db.state(child) is transition(TaskState.WAITING, child_event)
    waiting = await db.enqueue(after=[await db.enqueue()])
    await db.moved(waiting, TaskEvent.CANCEL, sql.cancel, waiting)
    # An operator's retry of a failed task (steeple.postgres.queue.admin).
    await db.moved(failed, TaskEvent.RETRY, admin_sql(schema).retry, failed)
    # A task that is not failed is not retried: the table has no such move.
    assert (await conn.fetchrow(admin_sql(schema).retry, ok))[1] == 0
    assert await db.state(ok) is TaskState.SUCCEEDED

    # A terminal task is not cancelled: the table has no such move, the SQL makes none.
    assert (await conn.fetchrow(sql.cancel, ok))[1] == 0
    assert await db.state(ok) is TaskState.SUCCEEDED

    # finished_at is set exactly for terminal states, whatever move led there.
    rows = await conn.fetch(f'SELECT state, finished_at FROM "{schema}".tasks')
    for row in rows:
        assert (TaskState(row["state"]) in TERMINAL_TASK_STATES) == (row["finished_at"] is not None)


async def _started(db: Db, task_id: int) -> Any:
    return await db.conn.fetchval(
        f'SELECT started_at FROM "{db.schema}".tasks WHERE id = $1', task_id
    )


async def test_recovery_of_expired_leases_follows_core_over_a_grid(queue: Any) -> None:
    _, schema, conn = queue
    db = Db(conn, schema)
    cases: dict[int, tuple[int, int]] = {}
    for attempts, max_attempts in itertools.product(range(1, 6), range(1, 6)):
        task_id = await db.enqueue(max_attempts)
        await db.claim(task_id)
        cases[task_id] = (attempts, max_attempts)
        # As if earlier attempts had run and this one's worker died.
        await conn.execute(
            f'UPDATE "{schema}".tasks SET attempts = $2, '
            "lease_expires_at = clock_timestamp() - interval '1 second' WHERE id = $1",
            task_id,
            attempts,
        )
    recovered = dict(await conn.fetch(db.sql.recover_expired, 100))
    assert set(recovered) == set(cases)
    for task_id, (attempts, max_attempts) in cases.items():
        want = transition(TaskState.RUNNING, lease_expiry_event(attempts, max_attempts))
        assert TaskState(recovered[task_id]) is want, (attempts, max_attempts)
        assert await db.state(task_id) is want
    finished = await conn.fetch(f'SELECT id, finished_at FROM "{schema}".tasks')
    for row in finished:
        state = TaskState(recovered[row["id"]])
        assert (state in TERMINAL_TASK_STATES) == (row["finished_at"] is not None)
    outcomes = await conn.fetch(f'SELECT DISTINCT outcome FROM "{schema}".attempts')
    assert [r["outcome"] for r in outcomes] == ["lease_expired"]


async def test_a_lease_holds_at_its_expiry_instant_and_is_recovered_one_microsecond_after(
    queue: Any,
) -> None:
    dsn, schema, conn = queue
    db = Db(conn, schema)
    task_id = await db.enqueue()
    await db.claim(task_id)
    expiry = datetime(2031, 3, 4, 5, 6, 7, 123456, tzinfo=UTC)
    await conn.execute(
        f'UPDATE "{schema}".tasks SET lease_expires_at = $2 WHERE id = $1', task_id, expiry
    )
    async with pinned_clock(dsn, schema, expiry) as clock:
        # The server's clock reads the expiry instant itself: the lease is still live.
        assert await clock.conn.fetch(db.sql.recover_expired, 100) == []
        assert await db.state(task_id) is TaskState.RUNNING
        # One microsecond later it has lapsed, and recovery takes the task back.
        await clock.set(expiry + timedelta(microseconds=1))
        recovered = await clock.conn.fetch(db.sql.recover_expired, 100)
    assert [r["id"] for r in recovered] == [task_id]
    assert await db.state(task_id) is transition(TaskState.RUNNING, lease_expiry_event(1, 3))


async def test_a_claim_never_takes_a_task_another_worker_runs(queue: Any) -> None:
    _, schema, conn = queue
    sql = queue_sql(schema)
    task: Task[Any] = Task("shared")
    older = (await enqueue(conn, task, {}, EnqueueOptions(), schema=schema)).id
    newer = (await enqueue(conn, task, {}, EnqueueOptions(), schema=schema)).id
    give_up = await conn.fetchval(
        "SELECT extract(epoch FROM clock_timestamp())::double precision + 60"
    )
    [first] = await conn.fetch(sql.claim, ["shared"], 1, "a", give_up)
    assert first["id"] == older
    # Another worker with room for ten gets the one pending task, never the running one.
    assert [r["id"] for r in await conn.fetch(sql.claim, ["shared"], 10, "b", give_up)] == [newer]
    assert await conn.fetch(sql.claim, ["shared"], 10, "c", give_up) == []
    held = await conn.fetchrow(
        f'SELECT worker_id, lease_token, attempts FROM "{schema}".tasks WHERE id = $1', older
    )
    assert (held["worker_id"], held["lease_token"], held["attempts"]) == (
        "a",
        first["lease_token"],
        1,
    )


async def test_a_stale_holder_cannot_overwrite_the_new_holders_progress(queue: Any) -> None:
    _, schema, conn = queue
    db = Db(conn, schema)
    task_id = await db.enqueue()
    stale = await db.claim(task_id)
    # The first holder's lease lapses and is recovered; another claim takes the task over.
    await conn.execute(
        f"UPDATE \"{schema}\".tasks SET lease_expires_at = clock_timestamp() - interval '1 second' "
        "WHERE id = $1",
        task_id,
    )
    assert [r["id"] for r in await conn.fetch(db.sql.recover_expired, 100)] == [task_id]
    current = await db.claim(task_id)
    assert current != stale

    async def write(token: Any, fraction: float) -> list[Any]:
        return list(
            await conn.fetch(
                db.sql.progress,
                text_array([task_id]),
                text_array([token]),
                [json.dumps({"fraction": fraction})],
            )
        )

    assert [r["id"] for r in await write(current, 0.75)] == [task_id]
    # The first holder, not yet aware it lost the task, reports late: nothing is written.
    assert await write(stale, 0.25) == []
    run = await run_state(conn, task_id, schema=schema)
    assert run.progress == Progress(0.75)


@pytest.mark.parametrize("event", list(TaskEvent))
def test_every_event_the_sql_writes_is_covered_here(event: TaskEvent) -> None:
    # A new event in the table must get a statement (and a case above) before it ships.
    covered = {
        TaskEvent.CLAIM,
        TaskEvent.SUCCEED,
        TaskEvent.FAIL_RETRYABLE,
        TaskEvent.FAIL_PERMANENT,
        TaskEvent.RELEASE,
        TaskEvent.LEASE_EXPIRED,
        TaskEvent.LEASE_EXPIRED_FINAL,
        TaskEvent.CANCEL,
        TaskEvent.RETRY,
        TaskEvent.DEPENDENCIES_MET,
        TaskEvent.DEPENDENCY_FAILED,
    }
    assert event in covered
