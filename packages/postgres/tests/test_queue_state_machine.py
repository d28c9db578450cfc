"""A hypothesis state machine: the queue's SQL against an independent model of the lifecycle.

Each rule runs one of the worker's statements (enqueue, claim, renew, complete, retry, fail,
cancel, lease expiry + recovery, prune) on a real PostgreSQL and the same step on a small
model written from the contract (never from the implementation); after every step the
stored tasks must equal the model. Stale and forged lease tokens must change nothing.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import asyncpg
import psycopg
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from steeple.postgres.queue import EnqueueOptions, Task, install
from steeple.postgres.queue._driver import fetch_sync
from steeple.postgres.queue._enqueue import enqueue_sync
from steeple.postgres.queue._sql import queue_sql

TASK = Task("m")
MAX_ATTEMPTS = 2


@dataclass
class ModelTask:
    seq: int
    priority: int
    due: bool
    state: str = "pending"
    attempts: int = 0
    token: uuid.UUID | None = None
    old_tokens: list[uuid.UUID] = field(default_factory=list)


class QueueMachine(RuleBasedStateMachine):
    dsn: str
    schema: str

    def __init__(self) -> None:
        super().__init__()
        self.conn = psycopg.connect(self.dsn, autocommit=True)
        self.sql = queue_sql(self.schema)
        self.conn.execute(f'TRUNCATE "{self.schema}".tasks, "{self.schema}".attempts CASCADE')
        self.model: dict[int, ModelTask] = {}
        self.seq = 0

    def teardown(self) -> None:
        self.conn.close()

    def run(self, sql: str, *args: Any) -> list[tuple[Any, ...]]:
        return fetch_sync(self.conn, sql, *args)

    def ids_in(self, *states: str) -> list[int]:
        return sorted(i for i, t in self.model.items() if t.state in states)

    # --- rules ---------------------------------------------------------------------------

    @rule(priority=st.integers(-2, 2), delayed=st.booleans())
    def enqueue(self, priority: int, delayed: bool) -> None:
        options = EnqueueOptions(priority=priority, max_attempts=MAX_ATTEMPTS)
        if delayed:
            (now,) = self.run("SELECT clock_timestamp()")[0]
            options = EnqueueOptions.at(
                now + timedelta(hours=1), priority=priority, max_attempts=MAX_ATTEMPTS
            )
        done = enqueue_sync(self.conn, TASK, {"seq": self.seq}, options, schema=self.schema)
        self.model[done.id] = ModelTask(seq=self.seq, priority=priority, due=not delayed)
        self.seq += 1

    def server_time(self) -> float:
        ((now,),) = self.run("SELECT extract(epoch FROM clock_timestamp())::double precision")
        return float(now)

    @rule(limit=st.integers(1, 3))
    def late_claim_does_nothing(self, limit: int) -> None:
        # delivered after its sender gave up (a held network): it must not take effect
        rows = self.run(self.sql.claim, ["m"], limit, "w", self.server_time() - 0.001)
        assert rows == []

    @rule(limit=st.integers(1, 3))
    def claim(self, limit: int) -> None:
        rows = self.run(self.sql.claim, ["m"], limit, "w", self.server_time() + 60)
        due = sorted(
            (t.priority * -1, t.seq, i)
            for i, t in self.model.items()
            if t.state == "pending" and t.due
        )
        expected = [i for _p, _s, i in due[:limit]]
        assert sorted(r[0] for r in rows) == sorted(expected)
        for row in rows:
            task = self.model[row[0]]
            task.state = "running"
            task.attempts += 1
            assert row[3] == task.attempts
            task.token = row[6]

    def _token(self, task: ModelTask, data: st.DataObject) -> tuple[uuid.UUID, bool]:
        choice = data.draw(st.sampled_from(["current", "old", "forged"]))
        if choice == "current" and task.token is not None:
            return task.token, True
        if choice == "old" and task.old_tokens:
            return data.draw(st.sampled_from(task.old_tokens)), False
        return uuid.uuid4(), False

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def complete(self, data: st.DataObject) -> None:
        task_id = data.draw(st.sampled_from(sorted(self.model)))
        task = self.model[task_id]
        token, current = self._token(task, data)
        rows = self.run(self.sql.complete, [task_id], [token], "w")
        accepted = current and task.state == "running"
        assert bool(rows) == accepted
        if accepted:
            task.state = "succeeded"
            task.old_tokens.append(token)
            task.token = None

    @precondition(lambda self: self.model)
    @rule(data=st.data(), permanent=st.booleans())
    def fail(self, data: st.DataObject, permanent: bool) -> None:
        task_id = data.draw(st.sampled_from(sorted(self.model)))
        task = self.model[task_id]
        token, current = self._token(task, data)
        if permanent:
            rows = self.run(self.sql.fail, task_id, token, "boom", "w")
        else:
            rows = self.run(self.sql.retry, task_id, token, timedelta(0), "flaky", "w")
        accepted = current and task.state == "running"
        assert bool(rows) == accepted
        if accepted:
            task.state = "failed" if permanent else "pending"
            task.due = True
            if not permanent:  # due again now: behind everything already waiting
                task.seq = self.seq
                self.seq += 1
            task.old_tokens.append(token)
            task.token = None

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def renew(self, data: st.DataObject) -> None:
        task_id = data.draw(st.sampled_from(sorted(self.model)))
        task = self.model[task_id]
        token, current = self._token(task, data)
        rows = self.run(self.sql.renew, [task_id], [token])
        assert bool(rows) == (current and task.state == "running")

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        task_id = data.draw(st.sampled_from(sorted(self.model)))
        task = self.model[task_id]
        ((before, changed),) = self.run(self.sql.cancel, task_id)
        assert before == task.state
        assert bool(changed) == (task.state in ("pending", "running"))
        if changed:
            if task.token is not None:
                task.old_tokens.append(task.token)
            task.token = None
            task.state = "cancelled"

    @precondition(lambda self: any(t.state == "running" for t in self.model.values()))
    @rule(data=st.data())
    def lease_expires(self, data: st.DataObject) -> None:
        task_id = data.draw(st.sampled_from(self.ids_in("running")))
        self.run(
            f'UPDATE "{self.schema}".tasks SET lease_expires_at = clock_timestamp() '
            "- interval '1 second' WHERE id = $1",
            task_id,
        )
        recovered = self.run(self.sql.recover_expired, 100)
        assert [r[0] for r in recovered] == [task_id]
        task = self.model[task_id]
        assert task.token is not None
        task.old_tokens.append(task.token)
        task.token = None
        task.state = "failed" if task.attempts >= MAX_ATTEMPTS else "pending"
        task.due = True
        assert recovered[0][1] == task.state

    @rule()
    def prune(self) -> None:
        ((count,),) = self.run(self.sql.prune, timedelta(0), 10_000)
        terminal = self.ids_in("succeeded", "failed", "cancelled")
        assert count == len(terminal)
        for task_id in terminal:
            del self.model[task_id]

    # --- invariants ----------------------------------------------------------------------

    @invariant()
    def stored_tasks_match_the_model(self) -> None:
        rows = self.run(
            f"SELECT id, state, attempts, lease_token IS NOT NULL, finished_at IS NOT NULL "
            f'FROM "{self.schema}".tasks ORDER BY id'
        )
        actual = {r[0]: (r[1], r[2], r[3], r[4]) for r in rows}
        expected = {
            i: (
                t.state,
                t.attempts,
                t.state == "running",
                t.state in ("succeeded", "failed", "cancelled"),
            )
            for i, t in self.model.items()
        }
        assert actual == expected

    @invariant()
    def history_belongs_to_live_rows(self) -> None:
        orphans = self.run(
            f'SELECT count(*) FROM "{self.schema}".attempts a '
            f'WHERE NOT EXISTS (SELECT 1 FROM "{self.schema}".tasks t WHERE t.id = a.task_id)'
        )
        assert orphans == [(0,)]


async def test_queue_sql_conforms_to_the_lifecycle_model(pg_schema: tuple[str, str]) -> None:
    dsn, schema = pg_schema
    conn = await asyncpg.connect(dsn)
    try:
        await install(conn, schema=schema)
    finally:
        await conn.close()

    class Bound(QueueMachine):
        pass

    Bound.dsn = dsn
    Bound.schema = schema
    Bound.TestCase.settings = settings(
        max_examples=60,
        stateful_step_count=30,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    await asyncio.to_thread(Bound.TestCase().runTest)
