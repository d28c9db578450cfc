"""The database's claim function follows the core's claim rule (steeple.core.claims).

A differential test: random queue and task-name settings (pauses, running limits, rate
limits with starts inside and outside their window, and the same per limit key), random
running tasks, random due work (with and without keys) and a random position per queue to
walk from (or none) go into a real database; one call of the plpgsql claim must start
exactly the tasks ``plan_claim`` starts from the same picture (the due tasks after each
queue's position), say alike whether a limit held work back and when a rate window frees
a start, and append the same starts to every rate window (the keys' too).

Rate windows are an hour long and recorded starts lie at least ten minutes from a window's
edge, so the few milliseconds between reading the server's clock and the claim's own do not
move a start across it. Also here: the claim keeps the settings it needs, and every task
state the queue's SQL names is one of the core's transition table, and every one it writes
is one the table leads to.
"""

from __future__ import annotations

import asyncio
import re
from collections import Counter
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg
import attrs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from queue_support import QueueFixture
from steeple.core.claims import (
    ClaimPosition,
    KeyScope,
    KeyState,
    ScopeLimits,
    ScopeState,
    plan_claim,
    starts_in_window,
)
from steeple.core.tasks import TASK_TRANSITIONS, TaskState
from steeple.postgres.queue import EnqueueOptions, Task, enqueue

pytestmark = pytest.mark.postgres

QUEUES = ["q1", "q2", "q3"]
NAMES = ["a", "b", "c"]
KEYS = ["k1", "k2", "k3"]
PERIOD = timedelta(hours=1)
# Minutes before now: inside the window (1-50) or out of it (70-120), far from its edge.
START_AGO = st.integers(1, 50) | st.integers(70, 120)

LIMITS = st.tuples(
    st.none() | st.integers(1, 3),  # max_running
    st.none() | st.integers(1, 3),  # rate_limit
    st.lists(START_AGO, max_size=4),  # recorded starts, minutes ago
    st.none() | st.integers(1, 2),  # max_running_per_key
    st.none() | st.integers(1, 2),  # rate_limit_per_key
    st.lists(st.tuples(st.sampled_from(KEYS), START_AGO), max_size=4),  # keys' starts
)


@attrs.frozen
class Candidate:
    id: int
    queue: str
    task_name: str
    limit_key: str | None
    place: ClaimPosition


@st.composite
def pictures(draw: st.DrawFn) -> dict[str, Any]:
    return {
        "wants": [
            (q, draw(st.integers(1, 4)))
            for q in draw(st.lists(st.sampled_from(QUEUES), unique=True, min_size=1))
        ],
        "names": draw(st.lists(st.sampled_from(NAMES), unique=True, min_size=1)),
        "queue_settings": draw(
            st.dictionaries(st.sampled_from(QUEUES), st.tuples(st.booleans(), LIMITS))
        ),
        "name_settings": draw(st.dictionaries(st.sampled_from(NAMES), LIMITS)),
        # (queue, name, priority, running?, key) of each task, in enqueue order.
        "tasks": draw(
            st.lists(
                st.tuples(
                    st.sampled_from(QUEUES),
                    st.sampled_from(NAMES),
                    st.integers(0, 2),
                    st.booleans(),
                    st.none() | st.sampled_from(KEYS),
                ),
                max_size=14,
            )
        ),
        # Per queue asked: walk from the front (None), or after the place of the task at
        # this index among the picture's tasks (taken modulo their count).
        "after": draw(st.lists(st.none() | st.integers(0, 11), min_size=3, max_size=3)),
    }


def _scope(limits: tuple[Any, ...], paused: bool, running: int, now: datetime) -> ScopeState:
    max_running, rate_limit, ago, key_max_running, key_rate_limit, _key_starts = limits
    starts = () if rate_limit is None else tuple(now - timedelta(minutes=m) for m in ago)
    period = None if rate_limit is None else PERIOD
    key_period = None if key_rate_limit is None else PERIOD
    return ScopeState(
        ScopeLimits(
            paused, max_running, rate_limit, period, key_max_running, key_rate_limit, key_period
        ),
        running,
        starts,
    )


def _key_starts(
    kind: str, name: str, limits: tuple[Any, ...], now: datetime
) -> dict[KeyScope, list[datetime]]:
    """The keys' recorded starts of a scope (none unless it limits key rates)."""
    found: dict[KeyScope, list[datetime]] = {}
    if limits[4] is None:
        return found
    for key, ago in limits[5]:
        found.setdefault((kind, name, key), []).append(now - timedelta(minutes=ago))
    return found


async def _claim_both(conn: asyncpg.Connection, schema: str, picture: dict[str, Any]) -> None:
    s = f'"{schema}"'
    await conn.execute(f"DELETE FROM {s}.attempts; DELETE FROM {s}.tasks; DELETE FROM {s}.settings")
    await conn.execute(f"DELETE FROM {s}.key_starts")
    running_ids = []
    ids = []
    for queue, name, priority, running, key in picture["tasks"]:
        options = EnqueueOptions(priority=priority, queue=queue, limit_key=key)
        done = await enqueue(conn, Task(name), {}, options, schema=schema)
        ids.append(done.id)
        if running:
            running_ids.append(done.id)
    await conn.execute(
        f"UPDATE {s}.tasks SET state = 'running', attempts = 1, lease_token = gen_random_uuid(),"
        " lease_expires_at = now() + interval '1 hour', worker_id = 'other',"
        " started_at = now() WHERE id = ANY($1::bigint[])",
        running_ids,
    )
    now: datetime = await conn.fetchval("SELECT clock_timestamp()")
    runs = await conn.fetch(
        f"SELECT queue, task_name, limit_key FROM {s}.tasks WHERE state = 'running'"
    )
    by_queue = Counter(r["queue"] for r in runs)
    by_name = Counter(r["task_name"] for r in runs)
    by_key = Counter(("queue", r["queue"], r["limit_key"]) for r in runs if r["limit_key"])
    by_key += Counter(("task", r["task_name"], r["limit_key"]) for r in runs if r["limit_key"])
    key_starts: dict[KeyScope, list[datetime]] = {}
    for q, (_paused, limits) in picture["queue_settings"].items():
        key_starts |= _key_starts("queue", q, limits, now)
    for n, limits in picture["name_settings"].items():
        key_starts |= _key_starts("task", n, limits, now)
    keys = {
        k: KeyState(by_key[k], tuple(key_starts.get(k, ()))) for k in set(by_key) | set(key_starts)
    }
    queues = {
        q: _scope(limits, paused, by_queue[q], now)
        for q, (paused, limits) in picture["queue_settings"].items()
    }
    names = {
        n: _scope(limits, False, by_name[n], now) for n, limits in picture["name_settings"].items()
    }
    rows = [("queue", q, st_) for q, st_ in queues.items()]
    rows += [("task", n, st_) for n, st_ in names.items()]
    for scope, name, state in rows:
        await conn.execute(
            f"INSERT INTO {s}.settings (scope, name, paused, max_running, rate_limit,"
            " rate_period, recent_starts, key_max_running, key_rate_limit, key_rate_period)"
            " VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)",
            scope,
            name,
            state.limits.paused,
            state.limits.max_running,
            state.limits.rate_limit,
            state.limits.rate_period,
            list(state.starts),
            state.limits.max_running_per_key,
            state.limits.rate_limit_per_key,
            state.limits.rate_period_per_key,
        )
    await conn.executemany(
        f"INSERT INTO {s}.key_starts (scope, name, limit_key, started_at) VALUES ($1, $2, $3, $4)",
        [(*k, at) for k, ats in key_starts.items() for at in ats],
    )
    asked = picture["names"]
    places = {
        r["id"]: ClaimPosition(r["priority"], r["run_at"], r["id"])
        for r in await conn.fetch(f"SELECT id, priority, run_at FROM {s}.tasks")
    }
    after: list[ClaimPosition | None] = [
        None if not ids or i is None else places[ids[i % len(ids)]]
        for i, _ in zip(picture["after"], picture["wants"], strict=False)
    ]
    position = dict(zip([q for q, _ in picture["wants"]], after, strict=True))
    candidates = [
        Candidate(r["id"], r["queue"], r["task_name"], r["limit_key"], places[r["id"]])
        for r in await conn.fetch(
            f"SELECT id, queue, task_name, limit_key FROM {s}.tasks WHERE state = 'pending'"
            " AND task_name = ANY($1::text[]) ORDER BY priority DESC, run_at, id",
            asked,
        )
    ]
    # A walk from a position sees the due tasks after it only.
    candidates = [
        c for c in candidates if (at := position.get(c.queue)) is None or at.precedes(c.place)
    ]
    plan = plan_claim(
        picture["wants"],
        candidates,
        queues=queues,
        names={n: state for n, state in names.items() if n in asked},
        now=now,
        keys=keys,
    )

    result = await conn.fetch(
        f"SELECT * FROM {s}.claim($1::text[], $2::integer[], $3::text[], 'w', 4e9,"
        " $4::integer[], $5::timestamptz[], $6::bigint[])",
        [q for q, _ in picture["wants"]],
        [w for _, w in picture["wants"]],
        asked,
        [None if p is None else p.priority for p in after],
        [None if p is None else p.run_at for p in after],
        [None if p is None else p.id for p in after],
    )
    claimed = {r["id"] for r in result if r["id"] is not None}
    held = [r for r in result if r["id"] is None]
    assert claimed == {c.id for c in plan.started}
    assert bool(held) == plan.held
    if held:
        frees = held[0]["run_at"]
        assert (frees is None) == (plan.frees_at is None)
        if frees is not None and plan.frees_at is not None:
            assert abs(frees - plan.frees_at) < timedelta(minutes=1)
    # Each rate window holds its starts still in it plus this claim's.
    started_queue = Counter(c.queue for c in plan.started)
    started_name = Counter(c.task_name for c in plan.started)
    windows = {
        (r["scope"], r["name"]): len(r["recent_starts"])
        for r in await conn.fetch(f"SELECT scope, name, recent_starts FROM {s}.settings")
    }
    for scope, name, state in rows:
        if state.limits.rate_period is None:
            assert windows[(scope, name)] == 0
            continue
        took = (started_queue if scope == "queue" else started_name)[name]
        if scope == "task" and name not in asked:
            took = 0
        kept = len(starts_in_window(state.starts, state.limits.rate_period, now))
        expected = kept + took if took else len(state.starts)
        assert windows[(scope, name)] == expected, (scope, name)
    await _check_key_windows(conn, s, rows, plan.started, asked, key_starts, now)


async def _check_key_windows(
    conn: asyncpg.Connection,
    s: str,
    rows: list[tuple[str, str, ScopeState]],
    started: tuple[Candidate, ...],
    asked: list[str],
    key_starts: dict[KeyScope, list[datetime]],
    now: datetime,
) -> None:
    """Each key's window holds its starts still in it plus this claim's, in every scope
    with a per-key rate limit (a scope the claim did not ask keeps what it had)."""
    in_window = Counter(
        (r["scope"], r["name"], r["limit_key"])
        for r in await conn.fetch(
            f"SELECT scope, name, limit_key FROM {s}.key_starts"
            " WHERE started_at > clock_timestamp() - $1::interval",
            PERIOD,
        )
    )
    expected: Counter[KeyScope] = Counter()
    for key, ats in key_starts.items():
        expected[key] += len(starts_in_window(ats, PERIOD, now))
    for scope, name, state in rows:
        if state.limits.rate_limit_per_key is None or (scope == "task" and name not in asked):
            continue
        for c in started:
            if c.limit_key is not None and name == (c.queue if scope == "queue" else c.task_name):
                expected[(scope, name, c.limit_key)] += 1
    assert in_window == +expected


async def test_the_sql_claim_starts_what_the_core_rule_starts(queue: QueueFixture) -> None:
    dsn, schema, _conn = queue

    @settings(
        max_examples=80,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(picture=pictures())
    def check(picture: dict[str, Any]) -> None:
        async def one() -> None:
            conn = await asyncpg.connect(dsn)
            try:
                await _claim_both(conn, schema, picture)
            finally:
                await conn.close()

        asyncio.run(one())

    await asyncio.to_thread(check)


async def test_the_claim_keeps_the_settings_it_needs(queue: QueueFixture) -> None:
    _dsn, schema, conn = queue
    # The claim with positions; the one of older workers calls it.
    config = await conn.fetchval(
        "SELECT proconfig FROM pg_proc WHERE oid = to_regprocedure($1)",
        f'"{schema}".claim(text[], integer[], text[], text, double precision, integer[],'
        " timestamptz[], bigint[])",
    )
    assert {"jit=off", "enable_seqscan=off", "enable_sort=off", "enable_bitmapscan=off"} <= set(
        config
    )
    # Planned once per session, its plans kept: with the settings above each statement has
    # one way to run whatever the values, so planning at every call bought nothing and was
    # most of an idle claim's server time.
    assert "plan_cache_mode=force_generic_plan" in config


MIGRATIONS = Path(__file__).parents[1] / "src/steeple/postgres/queue/migrations"
STATE_TEST = re.compile(r"\bstate\s*(?:=|<>|IN\s*\()\s*((?:'[a-z_]+'(?:\s*,\s*)?)+)", re.I)
STATE_WRITE = re.compile(r"\bSET\s+state\s*=\s*'([a-z_]+)'", re.I)


def _queue_sql() -> str:
    from steeple.postgres.queue import _sql

    texts = [p.read_text() for p in sorted(MIGRATIONS.glob("*/up.sql"))]
    return "\n".join([*texts, Path(_sql.__file__).read_text()])


def test_every_task_state_the_sql_names_is_one_of_the_core_table() -> None:
    states = {s.value for s in TaskState}
    named = {
        literal.strip("'")
        for match in STATE_TEST.finditer(_queue_sql())
        for literal in re.findall(r"'[a-z_]+'", match.group(1))
    }
    assert named
    assert named <= states, named - states
    # Where the SQL writes a state, the table leads to it (the claim's own write is checked
    # against its event in test_queue_lifecycle_sql.py).
    targets = {target.value for target in TASK_TRANSITIONS.values()}
    assert set(STATE_WRITE.findall(_queue_sql())) <= targets
