"""Concurrency specs of the work queue's SQL: every interleaving of two sessions, step by step.

Each spec races two sessions, each running one of the queue's own statements (the text
of ``queue_sql`` or, for operators, ``admin_sql``: the text the code sends) inside an
explicit transaction: BEGIN, the
statement, COMMIT, so a statement's locks are held across the other session's steps. Every
interleaving of the two sessions' three steps (20) runs from the same starting rows (made
by the real code: enqueue, claim). A small runner plays isolationtester's part: it starts
each step and watches it until it completes or waits on a lock (``pg_blocking_pids``);
an order that needs a step of a session still waiting cannot happen and is skipped.
(Debian's ``isolationtester`` 15 waits forever on such an order instead of skipping it,
so the orders would have to be known in advance.) After each interleaving the rows are
judged against the model and the verdict is ``verdict:ok`` or ``verdict:BAD ...``.

The model (per task): at most one outcome recorded per attempt; ``succeeded`` exactly
when one success is recorded; attempts never below the highest recorded; plus what each
spec says about its race (below), over the rows and over what each session was told.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import timedelta
from typing import Any
from uuid import UUID

import asyncpg
import pytest

from queue_support import installed_queue
from steeple.postgres._arrays import array_literal, text_array
from steeple.postgres.queue import EnqueueOptions, Task, enqueue
from steeple.postgres.queue._admin_sql import admin_sql
from steeple.postgres.queue._sql import QueueSql, queue_sql

pytestmark = [pytest.mark.postgres]

TOKEN = "00000000-0000-0000-0000-0000000000a1"


def _interleavings(first: list[str], second: list[str]) -> list[list[str]]:
    """Every order of the two step lists that keeps each session's own order."""
    total = len(first) + len(second)
    orders = []
    for positions in itertools.combinations(range(total), len(first)):
        a, b = iter(first), iter(second)
        orders.append([next(a) if i in positions else next(b) for i in range(total)])
    return orders


_MODEL = """
SELECT CASE WHEN bad IS NULL THEN 'verdict:ok' ELSE 'verdict:BAD ' || bad END AS verdict FROM (
  SELECT string_agg(problem, '; ') AS bad FROM (
    SELECT 'two outcomes for attempt ' || attempt AS problem FROM {s}.attempts
      GROUP BY task_id, attempt HAVING count(*) > 1
    UNION ALL
    SELECT 'state ' || t.state || ' with ' || count(a.id) FILTER (WHERE a.outcome = 'succeeded')
           || ' successes recorded'
      FROM {s}.tasks t LEFT JOIN {s}.attempts a ON a.task_id = t.id
      GROUP BY t.id, t.state
      HAVING (t.state = 'succeeded') <> (count(a.id) FILTER (WHERE a.outcome = 'succeeded') = 1)
          OR count(a.id) FILTER (WHERE a.outcome = 'succeeded') > 1
    UNION ALL
    SELECT 'attempts below the history' FROM {s}.tasks t
      WHERE t.attempts < (SELECT coalesce(max(attempt), 0) FROM {s}.attempts a
                          WHERE a.task_id = t.id)
    UNION ALL
    SELECT 'race: ' || {race_name} FROM {s}.tasks t WHERE NOT ({race})
  ) problems
) verdicts
"""


class Spec:
    """Two sessions' statements, the starting rows, and what the race may end in."""

    def __init__(
        self,
        name: str,
        first: tuple[str, tuple[Any, ...]],
        second: tuple[str, tuple[Any, ...]],
        race: str,
        setup: Callable[[asyncpg.Connection, str, QueueSql], Awaitable[None]],
        told: Callable[[list[Any], list[Any], str], str | None] | None = None,
    ) -> None:
        self.name = name
        # (the statement's name in QueueSql, or "admin." and its name in AdminSql; its
        # arguments)
        self.first = first
        self.second = second
        self.race = race
        self.setup = setup
        # Judges what the sessions were told (each one's rows) against the task's final
        # state: a problem, or None.
        self.told = told


class Runner:
    """Runs one interleaving of two sessions' steps, step by step, like isolationtester.

    Each step is started and then watched until it completes or its backend waits on a
    lock (``pg_blocking_pids``); a blocked session's steps wait for it, and an order that
    asks a blocked session for its next step cannot happen (it is skipped, as
    isolationtester's "invalid permutation").
    """

    def __init__(self, dsn: str, schema: str, sql: QueueSql, spec: Spec) -> None:
        self.dsn = dsn
        self.s = f'"{schema}"'
        self.sql = sql
        self.admin = admin_sql(schema)
        self.spec = spec

    def statement(self, name: str) -> str:
        if name.startswith("admin."):
            return str(getattr(self.admin, name.removeprefix("admin.")))
        return str(getattr(self.sql, name))

    async def reset(self, conn: asyncpg.Connection) -> None:
        s = self.s
        copy = "OVERRIDING SYSTEM VALUE SELECT * FROM"
        await conn.execute(
            # tasks first: a step left running by the last order (its client gone) holds
            # tasks and may still read task_dependencies; it ends before we lock the rest
            f"TRUNCATE {s}.tasks, {s}.attempts, {s}.task_dependencies; "
            f"INSERT INTO {s}.tasks {copy} {s}.fixture_tasks; "
            f"INSERT INTO {s}.attempts {copy} {s}.fixture_attempts; "
            f"INSERT INTO {s}.task_dependencies SELECT * FROM {s}.fixture_dependencies"
        )

    async def run(self, order: list[str], watcher: asyncpg.Connection) -> str | None:
        """Return the verdict, or None when the order cannot happen."""
        await self.reset(watcher)
        sessions = {
            "s1": await asyncpg.connect(self.dsn, timeout=10),
            "s2": await asyncpg.connect(self.dsn, timeout=10),
        }
        statements = {"s1": self.spec.first, "s2": self.spec.second}
        pids = {name: conn.get_server_pid() for name, conn in sessions.items()}
        blocked: dict[str, asyncio.Task[Any]] = {}
        told: dict[str, asyncio.Task[Any]] = {}
        try:
            for step in order:
                session, action = step[:2], step[2:]
                await self._settle(blocked, pids, watcher)
                if session in blocked:
                    return None
                conn = sessions[session]
                if action == "b":
                    work = conn.execute("BEGIN")
                elif action == "c":
                    work = conn.execute("COMMIT")
                else:
                    name, args = statements[session]
                    work = conn.fetch(self.statement(name), *args)  # type: ignore[assignment]
                task: asyncio.Task[Any] = asyncio.create_task(work)
                if action == "q":
                    told[session] = task
                blocked[session] = task
                await self._settle(blocked, pids, watcher)
            async with asyncio.timeout(30):
                for task in blocked.values():
                    await task
            verdict: str = await watcher.fetchval(
                _MODEL.format(s=self.s, race=self.spec.race, race_name="'race'")
            )
            if verdict == "verdict:ok" and self.spec.told is not None:
                state = await watcher.fetchval(
                    f"SELECT state FROM {self.s}.tasks ORDER BY id LIMIT 1"
                )
                rows = [[tuple(r) for r in told[n].result()] for n in ("s1", "s2")]
                problem = self.spec.told(rows[0], rows[1], state)
                if problem is not None:
                    return f"verdict:BAD told: {problem} ({rows}, final state {state})"
            return verdict
        finally:
            for conn in sessions.values():
                conn.terminate()
            # A step left waiting by an impossible order fails with its connection.
            await asyncio.gather(*blocked.values(), return_exceptions=True)

    async def _settle(
        self,
        running: dict[str, asyncio.Task[Any]],
        pids: dict[str, int],
        watcher: asyncpg.Connection,
    ) -> None:
        """Wait until every running step has completed (raising its error) or is blocked."""
        async with asyncio.timeout(30):
            while running:
                for session, task in list(running.items()):
                    if task.done():
                        task.result()
                        del running[session]
                waiting = await watcher.fetchval(
                    "SELECT count(*) FROM unnest($1::int[]) AS p(pid) "
                    "WHERE cardinality(pg_blocking_pids(pid)) > 0",
                    [pids[session] for session in running],
                )
                if waiting == len(running):
                    return
                await asyncio.sleep(0.002)


async def _running(conn: asyncpg.Connection, s: str, sql: QueueSql, *, expired: bool) -> None:
    """One task, claimed by the real claim, its token made known to the spec."""
    await conn.fetch(sql.claim, ["iso"], 1, "w0", time.time() + 3600)
    lease = "clock_timestamp() - interval '1 second'" if expired else "lease_expires_at"
    await conn.execute(f"UPDATE {s}.tasks SET lease_token = $1, lease_expires_at = {lease}", TOKEN)


async def _pending(conn: asyncpg.Connection, s: str, sql: QueueSql) -> None:
    pass


async def _expired(conn: asyncpg.Connection, s: str, sql: QueueSql) -> None:
    await _running(conn, s, sql, expired=True)


async def _live(conn: asyncpg.Connection, s: str, sql: QueueSql) -> None:
    await _running(conn, s, sql, expired=False)


async def _failed(conn: asyncpg.Connection, s: str, sql: QueueSql) -> None:
    """The task claimed, then failed for good by the worker's own statement."""
    await _running(conn, s, sql, expired=False)
    # $1 id, $2 token, $3 error, $4 worker, $5 error type, $6 traceback, $7 progress
    failed = await conn.fetch(sql.fail, 1, UUID(TOKEN), "broken", "w0", "RuntimeError", None, None)
    assert len(failed) == 1


async def _live_with_dependent(conn: asyncpg.Connection, s: str, sql: QueueSql) -> None:
    """The running task (1) and a task enqueued after it (2), waiting for it."""
    await _running(conn, s, sql, expired=False)
    child = await enqueue(conn, Task("iso"), {}, schema=s.strip('"'), after=[1])
    assert child.id == 2


# The parent (1) and its dependent (2), as one word: what a workflow race may end in.
_BOTH = "(SELECT string_agg(w.state, '/' ORDER BY w.id) FROM {s}.tasks w)"


def _one_cancel_or_one_success(cancel: list[Any], complete: list[Any], state: str) -> str | None:
    """The operator is told "cancelled" exactly when the task ends cancelled, and the
    worker's completion is acknowledged exactly when it ends succeeded."""
    ((found, cancelled),) = cancel
    if bool(cancelled) != (state == "cancelled"):
        return f"cancel reported {cancelled} change(s) from {found}"
    if bool(complete) != (state == "succeeded"):
        return f"the completion was acknowledged {len(complete)} time(s)"
    return None


def _one_retry(first: list[Any], second: list[Any], state: str) -> str | None:
    """Of two operators retrying the one failed task, exactly one is told it was retried;
    the other finds it already pending (and is refused)."""
    changed = [rows[0][1] for rows in (first, second)]
    found = sorted(rows[0][0] for rows in (first, second))
    if sorted(changed) != [0, 1] or found != ["failed", "pending"]:
        return f"retries reported {changed} change(s), finding {found}"
    return None


CLAIM: tuple[str, tuple[Any, ...]] = ("claim", (["iso"], 1, "w", 1e12))
# $4 results[], $5 progress[] (schema version 7): none here.
COMPLETE: tuple[str, tuple[Any, ...]] = (
    "complete",
    (array_literal([1]), array_literal([UUID(TOKEN)]), "w", [None], [None]),
)
RENEW: tuple[str, tuple[Any, ...]] = ("renew", (text_array([1]), text_array([UUID(TOKEN)])))
RECOVER: tuple[str, tuple[Any, ...]] = ("recover_expired", (100,))
RETRY: tuple[str, tuple[Any, ...]] = (
    "retry",
    # $6 error type, $7 traceback, $8 progress (schema version 7)
    (1, UUID(TOKEN), timedelta(0), "failed once", "w", "RuntimeError", None, None),
)
CANCEL: tuple[str, tuple[Any, ...]] = ("cancel", (1,))
OPERATOR_RETRY: tuple[str, tuple[Any, ...]] = ("admin.retry", (1,))

SPECS = [
    # two workers claim the one pending task: exactly one gets it, attempt 1
    Spec("claim-claim", CLAIM, CLAIM, "t.state = 'running' AND t.attempts = 1", _pending),
    # an expired lease is recovered while its late completion arrives: one of them wins
    Spec(
        "recover-complete",
        RECOVER,
        COMPLETE,
        "(t.state = 'succeeded' AND t.lease_token IS NULL) OR (t.state = 'pending' AND "
        "(SELECT count(*) FROM {s}.attempts a WHERE a.outcome = 'lease_expired') = 1)",
        _expired,
    ),
    # a renewal racing the recovery of its expired lease: renewed (still running, same
    # token) or recovered (pending, the renewal found nothing), never half of each
    Spec(
        "recover-renew",
        RECOVER,
        RENEW,
        f"(t.state = 'running' AND t.lease_token = '{TOKEN}' "
        "AND t.lease_expires_at > clock_timestamp()) OR (t.state = 'pending' AND "
        "t.lease_token IS NULL)",
        _expired,
    ),
    # a completion sent twice (a retry after an ambiguous COMMIT): one success recorded
    Spec("complete-complete", COMPLETE, COMPLETE, "t.state = 'succeeded'", _live),
    # a retry racing the completion of the same attempt: exactly one outcome
    Spec(
        "retry-complete",
        RETRY,
        COMPLETE,
        "t.state IN ('succeeded', 'pending') AND t.lease_token IS NULL",
        _live,
    ),
    # a claim racing the recovery of an expired lease: the task is claimed again only
    # after the recovery committed, under attempt 2
    Spec(
        "recover-claim",
        RECOVER,
        CLAIM,
        "(t.state = 'pending' AND t.attempts = 1) OR (t.state = 'running' AND t.attempts = 2 "
        f"AND t.lease_token <> '{TOKEN}')",
        _expired,
    ),
    # an operator cancels a running task as its worker completes it: it ends cancelled
    # (the completion refused) or succeeded (the cancel finds it finished), each party
    # told the truth; never a cancelled task with a success recorded
    Spec(
        "cancel-complete",
        CANCEL,
        COMPLETE,
        "t.state IN ('succeeded', 'cancelled') AND t.lease_token IS NULL",
        _live,
        _one_cancel_or_one_success,
    ),
    # an operator cancels a workflow's running task as its worker completes it: the
    # completion releases the dependent (succeeded/pending) or the cancel cancels both;
    # never a released dependent of a cancelled task, nor a cancelled one of a success
    Spec(
        "workflow-cancel-complete",
        CANCEL,
        COMPLETE,
        f"{_BOTH} IN ('succeeded/pending', 'cancelled/cancelled')",
        _live_with_dependent,
        _one_cancel_or_one_success,
    ),
    # the dependent itself is cancelled as its parent completes: it stays cancelled
    Spec(
        "workflow-cancel-dependent-complete",
        ("cancel", (2,)),
        COMPLETE,
        f"{_BOTH} = 'succeeded/cancelled'",
        _live_with_dependent,
    ),
    # two operators retry the same failed task at once: it runs once more, pending, and
    # exactly one of them is told so
    Spec(
        "retry-retry",
        OPERATOR_RETRY,
        OPERATOR_RETRY,
        "t.state = 'pending' AND t.attempts = 1 AND t.max_attempts = 5 "
        "AND t.lease_token IS NULL AND t.finished_at IS NULL",
        _failed,
        _one_retry,
    ),
]


@pytest.fixture
async def queue_schema(
    pg_schema: tuple[str, str],
) -> AsyncIterator[tuple[str, str, asyncpg.Connection]]:
    dsn, schema = pg_schema
    async with installed_queue(dsn, schema) as conn:
        yield dsn, schema, conn


@pytest.mark.timeout(300)
@pytest.mark.parametrize("spec", SPECS, ids=lambda spec: spec.name)
async def test_every_interleaving_of_two_sessions_ends_in_a_state_the_model_allows(
    spec: Spec, queue_schema: tuple[str, str, asyncpg.Connection]
) -> None:
    dsn, schema, conn = queue_schema
    s = f'"{schema}"'
    sql = queue_sql(schema)
    await enqueue(conn, Task("iso"), {}, EnqueueOptions.immediate(max_attempts=5), schema=schema)
    await spec.setup(conn, s, sql)
    await conn.execute(f"CREATE TABLE {s}.fixture_tasks AS SELECT * FROM {s}.tasks")
    await conn.execute(f"CREATE TABLE {s}.fixture_attempts AS SELECT * FROM {s}.attempts")
    await conn.execute(
        f"CREATE TABLE {s}.fixture_dependencies AS SELECT * FROM {s}.task_dependencies"
    )
    spec.race = spec.race.replace("{s}", s)
    runner = Runner(dsn, schema, sql, spec)
    verdicts: dict[str, str | None] = {}
    for order in _interleavings(["s1b", "s1q", "s1c"], ["s2b", "s2q", "s2c"]):
        verdicts[" ".join(order)] = await runner.run(order, conn)
    possible = {order: v for order, v in verdicts.items() if v is not None}
    bad = {order: v for order, v in possible.items() if v != "verdict:ok"}
    assert not bad, bad
    assert len(verdicts) == 20
    # the orders where a session waited for the other's lock were found (and skipped
    # when impossible), except where SKIP LOCKED means nobody waits
    if spec.name not in {"claim-claim", "recover-claim"}:
        assert len(possible) < 20, verdicts
    assert len(possible) >= 2
