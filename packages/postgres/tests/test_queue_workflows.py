"""Workflows on PostgreSQL: tasks enqueued after others wait, and are released or cancelled
by the statements that end those others, in the same transaction, fenced by their token.
"""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

import asyncpg
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from queue_support import QueueFixture
from steeple.core.tasks import TERMINAL_TASK_STATES, TaskState
from steeple.core.workflows import ParentFailure, Settlement, settlement
from steeple.postgres._arrays import array_literal
from steeple.postgres.queue import (
    EnqueuedTask,
    EnqueueOptions,
    QueueConfigurationError,
    QueueTypeError,
    Step,
    Task,
    TaskNotFoundError,
    Workflow,
    WorkflowCycleError,
    _driver,
    cancel,
    enqueue,
    enqueue_workflow,
    parent_results,
    prune_terminal,
    workflow_state,
)
from steeple.postgres.queue._sql import queue_sql

pytestmark = pytest.mark.postgres

STEP: Task[Any] = Task("step")


async def _claim(conn: asyncpg.Connection, schema: str, limit: int = 100) -> list[Any]:
    sql = queue_sql(schema)
    give_up = await conn.fetchval("SELECT extract(epoch FROM clock_timestamp()) + 60")
    return list(await conn.fetch(sql.claim, ["step"], limit, "w", give_up))


async def _complete(
    conn: asyncpg.Connection, schema: str, task_id: int, token: Any, result: str | None = None
) -> bool:
    rows = await conn.fetch(
        queue_sql(schema).complete,
        array_literal([task_id]),
        array_literal([token]),
        "w",
        [result],
        [None],
    )
    return bool(rows)


async def _fail(conn: asyncpg.Connection, schema: str, task_id: int, token: Any) -> bool:
    sql = queue_sql(schema)
    return bool(await conn.fetch(sql.fail, task_id, token, "boom", "w", None, None, None))


async def _states(conn: asyncpg.Connection, schema: str) -> dict[int, str]:
    rows = await conn.fetch(f'SELECT id, state FROM "{schema}".tasks ORDER BY id')
    return {r[0]: r[1] for r in rows}


async def _run_all(conn: asyncpg.Connection, schema: str) -> list[int]:
    """Claim and complete whatever is claimable until nothing is; return the order run."""
    ran: list[int] = []
    while claimed := await _claim(conn, schema):
        for row in claimed:
            ran.append(row["id"])
            assert await _complete(conn, schema, row["id"], row["lease_token"], '{"n": 1}')
    return ran


async def test_a_chain_runs_in_order_and_a_join_waits_for_every_branch(
    queue: QueueFixture,
) -> None:
    _, schema, conn = queue
    wf = Workflow()
    a, b = wf.chain((STEP, {"s": "a"}), (STEP, {"s": "b"}))
    c, d = wf.group((STEP, {"s": "c"}), (STEP, {"s": "d"}), after=[b])
    e = wf.add(STEP, {"s": "e"}, after=[c, d])
    handle = await enqueue_workflow(conn, wf, schema=schema)
    ids = {s: handle.id_of(x) for s, x in zip("abcde", (a, b, c, d, e), strict=True)}
    assert handle.states[0] is TaskState.PENDING
    assert set(handle.states[1:]) == {TaskState.WAITING}
    ran = await _run_all(conn, schema)
    assert ran[:2] == [ids["a"], ids["b"]]
    assert set(ran[2:4]) == {ids["c"], ids["d"]}
    assert ran[4] == ids["e"]
    state = await workflow_state(conn, ids["c"], schema=schema)
    assert state.workflow_id == handle.workflow_id
    assert state.finished
    assert state.counts() == {TaskState.SUCCEEDED: 5}
    assert {t.run.id: t.after for t in state.tasks}[ids["e"]] == (ids["c"], ids["d"])
    results = await parent_results(conn, ids["e"], schema=schema)
    assert [(r.id, r.state, r.result) for r in results] == [
        (ids["c"], TaskState.SUCCEEDED, {"n": 1}),
        (ids["d"], TaskState.SUCCEEDED, {"n": 1}),
    ]


async def test_enqueue_after_waits_in_the_callers_transaction(queue: QueueFixture) -> None:
    _, schema, conn = queue
    parent = await enqueue(conn, STEP, {}, schema=schema)
    async with conn.transaction():
        child = await enqueue(conn, STEP, {}, schema=schema, after=[parent])
        assert (await _states(conn, schema))[child.id] == "waiting"
    (row,) = await _claim(conn, schema)
    assert row["id"] == parent.id
    assert not await _claim(conn, schema)  # the child waits
    assert await _complete(conn, schema, parent.id, row["lease_token"])
    assert (await _states(conn, schema))[child.id] == "pending"
    # After an already-succeeded task: claimable at once.
    late = await enqueue(conn, STEP, {}, schema=schema, after=[parent.id])
    assert (await _states(conn, schema))[late.id] == "pending"


async def test_prune_keeps_a_parent_until_its_dependents_have_finished(
    queue: QueueFixture,
) -> None:
    """A dependent reads its parents' results: pruning never takes them from under it."""
    _, schema, conn = queue
    parent = await enqueue(conn, STEP, {"s": "a"}, schema=schema)
    child = await enqueue(conn, STEP, {"s": "b"}, after=[parent], schema=schema)
    grandchild = await enqueue(conn, STEP, {"s": "c"}, after=[child], schema=schema)
    (row,) = await _claim(conn, schema)
    assert await _complete(conn, schema, parent.id, row["lease_token"], '{"n": 7}')
    # Finished, old enough, and still needed by the pending child: kept.
    assert await prune_terminal(conn, timedelta(0), schema=schema) == 0
    (row,) = await _claim(conn, schema)
    assert row["id"] == child.id
    # The running child still reads its parent's outcome.
    results = await parent_results(conn, child.id, schema=schema)
    assert [(r.id, r.state, r.result) for r in results] == [
        (parent.id, TaskState.SUCCEEDED, {"n": 7})
    ]
    assert await _complete(conn, schema, child.id, row["lease_token"])
    # The parent's only dependent finished: it goes; the child stays for the grandchild.
    assert await prune_terminal(conn, timedelta(0), schema=schema) == 1
    assert set(await _states(conn, schema)) == {child.id, grandchild.id}
    await _run_all(conn, schema)
    assert await prune_terminal(conn, timedelta(0), schema=schema) == 2
    assert await _states(conn, schema) == {}


async def test_a_stale_completion_releases_nothing(queue: QueueFixture) -> None:
    """The release is fenced by the completing lease's token: a lapsed holder's completion
    changes neither the parent nor its dependents."""
    _, schema, conn = queue
    parent = await enqueue(conn, STEP, {}, EnqueueOptions(max_attempts=3), schema=schema)
    child = await enqueue(conn, STEP, {}, schema=schema, after=[parent])
    (first,) = await _claim(conn, schema)
    await conn.execute(
        f"UPDATE \"{schema}\".tasks SET lease_expires_at = clock_timestamp() - interval '1 s'"
        " WHERE id = $1",
        parent.id,
    )
    await conn.fetch(queue_sql(schema).recover_expired, 10)
    (second,) = await _claim(conn, schema)
    assert second["lease_token"] != first["lease_token"]
    assert not await _complete(conn, schema, parent.id, first["lease_token"])
    assert not await _complete(conn, schema, parent.id, uuid.uuid4())
    assert (await _states(conn, schema))[child.id] == "waiting"
    assert await _complete(conn, schema, parent.id, second["lease_token"])
    assert (await _states(conn, schema))[child.id] == "pending"


async def test_a_batch_of_completions_releases_only_the_dependents_of_fenced_ones(
    queue: QueueFixture,
) -> None:
    """A worker completes in batches: a stale entry beside a current one releases nothing."""
    _, schema, conn = queue
    stale_parent = await enqueue(conn, STEP, {}, schema=schema)
    fresh_parent = await enqueue(conn, STEP, {}, schema=schema)
    stale_child = await enqueue(conn, STEP, {}, schema=schema, after=[stale_parent])
    fresh_child = await enqueue(conn, STEP, {}, schema=schema, after=[fresh_parent])
    tokens = {r["id"]: r["lease_token"] for r in await _claim(conn, schema)}
    done = await conn.fetch(
        queue_sql(schema).complete,
        array_literal([stale_parent.id, fresh_parent.id]),
        array_literal([uuid.uuid4(), tokens[fresh_parent.id]]),
        "w",
        [None, None],
        [None, None],
    )
    assert [r["id"] for r in done] == [fresh_parent.id]
    states = await _states(conn, schema)
    assert states[stale_parent.id] == "running"
    assert states[stale_child.id] == "waiting"
    assert states[fresh_child.id] == "pending"


async def test_a_failure_cancels_dependents_transitively_unless_they_run_anyway(
    queue: QueueFixture,
) -> None:
    _, schema, conn = queue
    wf = Workflow()
    root = wf.add(STEP, {}, EnqueueOptions(max_attempts=1))
    mid = wf.add(STEP, {}, after=[root])
    leaf = wf.add(STEP, {}, after=[mid])
    cleanup = wf.add(STEP, {}, after=[root], on_parent_failure="run")
    after_cleanup = wf.add(STEP, {}, after=[cleanup])
    handle = await enqueue_workflow(conn, wf, schema=schema)
    (row,) = await _claim(conn, schema)
    assert await _fail(conn, schema, row["id"], row["lease_token"])
    states = await _states(conn, schema)
    assert states[handle.id_of(mid)] == "cancelled"
    assert states[handle.id_of(leaf)] == "cancelled"
    assert states[handle.id_of(cleanup)] == "pending"
    assert states[handle.id_of(after_cleanup)] == "waiting"
    assert await _run_all(conn, schema) == [handle.id_of(cleanup), handle.id_of(after_cleanup)]
    # A task enqueued after a failed one is cancelled at once.
    late = await enqueue(conn, STEP, {}, schema=schema, after=[handle.id_of(root)])
    assert (await _states(conn, schema))[late.id] == "cancelled"


async def test_cancelling_a_parent_cancels_its_waiting_dependents(queue: QueueFixture) -> None:
    _, schema, conn = queue
    parent = await enqueue(conn, STEP, {}, schema=schema)
    child = await enqueue(conn, STEP, {}, schema=schema, after=[parent])
    grandchild = await enqueue(conn, STEP, {}, schema=schema, after=[child])
    assert await cancel(conn, parent.id, schema=schema) is TaskState.CANCELLED
    states = await _states(conn, schema)
    assert states[child.id] == states[grandchild.id] == "cancelled"
    # A waiting task can be cancelled itself.
    other = await enqueue(conn, STEP, {}, schema=schema)
    waiting = await enqueue(conn, STEP, {}, schema=schema, after=[other])
    assert await cancel(conn, waiting.id, schema=schema) is TaskState.CANCELLED


async def test_a_final_lease_lapse_cancels_dependents(queue: QueueFixture) -> None:
    _, schema, conn = queue
    parent = await enqueue(conn, STEP, {}, EnqueueOptions(max_attempts=1), schema=schema)
    child = await enqueue(conn, STEP, {}, schema=schema, after=[parent])
    await _claim(conn, schema)
    await conn.execute(
        f"UPDATE \"{schema}\".tasks SET lease_expires_at = clock_timestamp() - interval '1 s'"
        " WHERE id = $1",
        parent.id,
    )
    await conn.fetch(queue_sql(schema).recover_expired, 10)
    states = await _states(conn, schema)
    assert states[parent.id] == "failed"
    assert states[child.id] == "cancelled"


async def test_ten_thousand_tasks_enqueue_in_one_statement(
    queue: QueueFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, schema, conn = queue
    wf = Workflow()
    first = wf.add(STEP, {"i": 0})
    layer = wf.group(*[(STEP, {"i": i}) for i in range(1, 9_999)], after=[first])
    wf.add(STEP, {"i": "join"}, after=layer[:1000])
    statements: list[str] = []
    real_fetch = _driver.fetch

    async def counted(conn: Any, sql: str, *args: Any) -> Any:
        statements.append(sql)
        return await real_fetch(conn, sql, *args)

    monkeypatch.setattr(_driver, "fetch", counted)
    handle = await enqueue_workflow(conn, wf, schema=schema)
    statements = [s for s in statements if "enqueue_graph" in s or "tasks" in s]
    assert len(statements) == 1
    assert len(handle.ids) == 10_000
    rows = await conn.fetch(f'SELECT state, count(*) FROM "{schema}".tasks GROUP BY state')
    counts = {r[0]: r[1] for r in rows}
    assert counts == {"pending": 1, "waiting": 9_999}
    from steeple.postgres.queue import admin

    bounded = await admin.count_by_state_bounded(conn, schema=schema)
    assert bounded[TaskState.WAITING].n == min(9_999, admin.COUNT_CAP)
    with pytest.raises(QueueConfigurationError):
        wf.add(STEP, {})


async def test_cycles_and_hostile_after_are_refused_and_store_nothing(
    queue: QueueFixture,
) -> None:
    _, schema, conn = queue
    wf = Workflow()
    a = wf.add(STEP, {})
    b = wf.add(STEP, {}, after=[a])
    c = wf.add(STEP, {}, after=[b])
    wf.link(c, a)
    with pytest.raises(WorkflowCycleError) as cycle:
        await enqueue_workflow(conn, wf, schema=schema)
    assert cycle.value.cycle == (0, 2, 1, 0)
    bad: list[tuple[object, type[Exception]]] = [
        ("1", QueueTypeError),
        ([1.5], QueueTypeError),
        ([True], QueueTypeError),
        ([None], QueueTypeError),
        ({1, 2}, QueueTypeError),
        ([2**63], QueueConfigurationError),
        ([0], QueueConfigurationError),
        ([-1], QueueConfigurationError),
        (list(range(1, 1_002)), QueueConfigurationError),
        ([10**9], TaskNotFoundError),
        ([b], QueueConfigurationError),  # a step of another workflow
    ]
    for after, error in bad:
        with pytest.raises(error):
            await enqueue(conn, STEP, {}, schema=schema, after=after)  # type: ignore[arg-type]
    with pytest.raises(QueueConfigurationError):
        await enqueue(conn, STEP, {}, schema=schema, after=[], on_parent_failure="maybe")
    with pytest.raises(QueueTypeError):
        await enqueue(conn, STEP, {}, schema=schema, after=[], on_parent_failure=1)
    with pytest.raises(QueueConfigurationError):
        await enqueue(conn, STEP, {}, EnqueueOptions(dedup_key="k"), schema=schema, after=[])
    with pytest.raises(QueueTypeError):
        await enqueue_workflow(conn, "graph", schema=schema)  # type: ignore[arg-type]
    with pytest.raises(QueueConfigurationError):
        await enqueue_workflow(conn, Workflow(), schema=schema)
    assert await conn.fetchval(f'SELECT count(*) FROM "{schema}".tasks') == 0
    assert await conn.fetchval(f'SELECT count(*) FROM "{schema}".task_dependencies') == 0
    ok = await enqueue(conn, STEP, {}, schema=schema, after=[EnqueuedTask(2**63 - 1)][:0])
    assert (await _states(conn, schema))[ok.id] == "pending"


# --- random graphs, failures, cancellations and lease lapses --------------------------------


class WorkflowMachine(RuleBasedStateMachine):
    """Random DAGs run by claims, completions (fresh and stale), failures, cancellations and
    lease lapses, checked against the core's settlement rule after every step."""

    def __init__(self) -> None:
        super().__init__()
        self.runner: Any = None

    def _run(self, coro: Any) -> Any:
        return self.runner.run(coro)

    @initialize(
        graph=st.lists(
            st.tuples(st.sets(st.integers(0, 30), max_size=3), st.booleans()),
            min_size=1,
            max_size=12,
        )
    )
    def build(self, graph: list[tuple[set[int], bool]]) -> None:
        self.conn: asyncpg.Connection = self._run(asyncpg.connect(MACHINE_DSN))
        self._run(self.conn.execute(f'TRUNCATE "{MACHINE_SCHEMA}".tasks CASCADE'))
        wf = Workflow()
        steps: list[Step] = []
        self.parents: dict[int, list[int]] = {}
        self.policy: dict[int, ParentFailure] = {}
        for i, (ups, runs) in enumerate(graph):
            after = sorted({u % i for u in ups}) if i else []
            policy = ParentFailure.RUN if runs else ParentFailure.CANCEL
            steps.append(
                wf.add(
                    STEP,
                    {"i": i},
                    EnqueueOptions(max_attempts=2),
                    after=[steps[u] for u in after],
                    on_parent_failure=policy,
                )
            )
            self.parents[i] = after
            self.policy[i] = policy
        handle = self._run(enqueue_workflow(self.conn, wf, schema=MACHINE_SCHEMA))
        self.ids = list(handle.ids)
        self.position = {task_id: i for i, task_id in enumerate(self.ids)}
        self.held: dict[int, Any] = {}  # position -> token of its current lease
        self.stale: list[tuple[int, Any]] = []
        self.claims: dict[int, int] = dict.fromkeys(range(len(graph)), 0)
        self.succeeded_once: set[int] = set()

    def _states(self) -> dict[int, TaskState]:
        rows = self._run(_states(self.conn, MACHINE_SCHEMA))
        return {self.position[k]: TaskState(v) for k, v in rows.items()}

    @rule()
    def claim(self) -> None:
        before = self._states()
        for row in self._run(_claim(self.conn, MACHINE_SCHEMA, 3)):
            i = self.position[row["id"]]
            # Claimed only once every parent ended as its policy asks.
            for up in self.parents[i]:
                assert before[up] in TERMINAL_TASK_STATES
                if self.policy[i] is ParentFailure.CANCEL:
                    assert before[up] is TaskState.SUCCEEDED
            self.held[i] = row["lease_token"]
            self.claims[i] += 1

    @rule(data=st.data(), outcome=st.sampled_from(["complete", "fail", "lapse"]))
    def finish(self, data: st.DataObject, outcome: str) -> None:
        if not self.held:
            return
        i = data.draw(st.sampled_from(sorted(self.held)))
        token = self.held.pop(i)
        task_id = self.ids[i]
        if outcome == "complete":
            assert self._run(_complete(self.conn, MACHINE_SCHEMA, task_id, token))
            assert i not in self.succeeded_once
            self.succeeded_once.add(i)
        elif outcome == "fail":
            assert self._run(_fail(self.conn, MACHINE_SCHEMA, task_id, token))
        else:
            self._run(
                self.conn.execute(
                    f'UPDATE "{MACHINE_SCHEMA}".tasks SET lease_expires_at = '
                    "clock_timestamp() - interval '1 s' WHERE id = $1",
                    task_id,
                )
            )
            self._run(self.conn.fetch(queue_sql(MACHINE_SCHEMA).recover_expired, 100))
            self.stale.append((i, token))

    @rule(data=st.data())
    def stale_completion(self, data: st.DataObject) -> None:
        if not self.stale:
            return
        i, token = data.draw(st.sampled_from(self.stale))
        before = self._states()
        assert not self._run(_complete(self.conn, MACHINE_SCHEMA, self.ids[i], token))
        assert self._states() == before

    @rule(data=st.data())
    def cancel_one(self, data: st.DataObject) -> None:
        i = data.draw(st.integers(0, len(self.ids) - 1))
        self._run(cancel(self.conn, self.ids[i], schema=MACHINE_SCHEMA))
        self.held.pop(i, None)

    @invariant()
    def settled_as_the_core_says(self) -> None:
        if self.runner is None or not hasattr(self, "ids"):
            return
        states = self._states()
        waiting = self._run(self.conn.fetch(f'SELECT id, waiting_on FROM "{MACHINE_SCHEMA}".tasks'))
        count = {self.position[r[0]]: r[1] for r in waiting}
        for i, ups in self.parents.items():
            ended = [states[u] for u in ups if states[u] in TERMINAL_TASK_STATES]
            verdicts = {settlement(s, self.policy[i]) for s in ended}
            if states[i] is TaskState.WAITING:
                # Waits exactly for its parents still live, none having cancelled it.
                assert Settlement.CANCEL not in verdicts
                assert count[i] == len(ups) - len(ended) > 0
            elif ups and states[i] is not TaskState.CANCELLED:
                # Released: every parent ended, each one releasing it.
                assert len(ended) == len(ups)
                assert verdicts <= {Settlement.ONE_FEWER}
            if i in self.succeeded_once:
                assert states[i] is TaskState.SUCCEEDED

    def teardown(self) -> None:
        if hasattr(self, "conn"):
            self._run(self.conn.close())


MACHINE_DSN = ""
MACHINE_SCHEMA = ""


async def test_random_workflows_settle_as_the_core_rule_says(queue: QueueFixture) -> None:
    import asyncio

    from hypothesis.stateful import run_state_machine_as_test

    global MACHINE_DSN, MACHINE_SCHEMA
    MACHINE_DSN, MACHINE_SCHEMA, _ = queue

    def run() -> None:
        with asyncio.Runner() as runner:

            def make() -> WorkflowMachine:
                machine = WorkflowMachine()
                machine.runner = runner
                return machine

            run_state_machine_as_test(
                make,  # type: ignore[arg-type]  # hypothesis takes any factory
                settings=settings(
                    max_examples=40,
                    stateful_step_count=25,
                    deadline=None,
                    derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow],
                ),
            )

    await asyncio.to_thread(run)


async def test_the_in_memory_queue_refuses_after() -> None:
    from steeple.postgres.queue import App
    from steeple.postgres.queue.testing import InMemoryQueue

    memory = InMemoryQueue(App())
    parent = await enqueue(memory, STEP, {})
    with pytest.raises(QueueConfigurationError, match="PostgreSQL"):
        await enqueue(memory, STEP, {}, after=[parent])
    assert [t.task_id for t in memory.claim(5)] == [parent.id]
