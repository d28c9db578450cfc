"""The queue under a held vacuum horizon: dead rows, HOT updates, and who holds it.

- The claim stays an index walk while dead row versions pile up in a table without
  statistics (counted by the transaction's own ``pg_stat_xact_user_tables``).
- Schema 10's fill factor leaves room on each page, so updates that change no indexed
  column (a handler's progress) are heap-only (HOT).
- ``held_horizon`` names an idle-in-transaction session that keeps vacuum from removing
  the queue's dead rows, and the worker's ``health_reasons()`` says so. These run on a
  private server: on the shared one another session may be the oldest holder.
"""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg
import pytest

from pg_cluster import Clusters
from queue_support import wait_until
from steeple.postgres import horizon
from steeple.postgres.horizon import held_horizon
from steeple.postgres.queue import Health, Scheduler, Task, _maintenance, install, limit_queue

_INSERT = """INSERT INTO {s}.tasks (task_name, args, max_attempts, lease_duration,
    backoff_initial_us, backoff_maximum_us, backoff_factor, backoff_jitter)
SELECT 'vacuum-t', jsonb_build_object('i', i), 3, interval '30 s', 1000, 1000, 2, 0
FROM generate_series(1, $1) AS i"""


async def _claim_scans(conn: Any, s: str, want: int) -> tuple[int, int, int]:
    """Claim ``want`` tasks in a rolled-back transaction: (claimed, seq scans, index scans)."""
    # The view holds this session's counts not yet flushed (earlier transactions' too):
    # the claim's are the difference across it.
    scans = (
        "SELECT seq_scan, coalesce(idx_scan, 0) FROM pg_stat_xact_user_tables"
        " WHERE relid = $1::regclass"
    )
    transaction = conn.transaction()
    await transaction.start()
    try:
        seq0, idx0 = tuple(await conn.fetchrow(scans, f"{s}.tasks") or ())
        rows = await conn.fetch(
            f"""SELECT * FROM {s}.claim(ARRAY['default'], ARRAY[$1]::integer[],
                ARRAY['vacuum-t'], 'w', extract(epoch FROM clock_timestamp()) + 60)""",
            want,
        )
        seq, idx = tuple(await conn.fetchrow(scans, f"{s}.tasks") or ())
    finally:
        await transaction.rollback()
    return len([r for r in rows if r["id"] is not None]), int(seq - seq0), int(idx - idx0)


async def test_claim_walks_the_index_while_dead_rows_pile_up(
    pg_schema: tuple[str, str],
) -> None:
    dsn, schema = pg_schema
    s = f'"{schema}"'
    conn = await asyncpg.connect(dsn)
    try:
        await install(conn, schema=schema)
        # No autovacuum and no ANALYZE: the dead rows stay and the planner knows nothing.
        await conn.execute(f"ALTER TABLE {s}.tasks SET (autovacuum_enabled = false)")
        await conn.execute(_INSERT.format(s=s), 20_000)
        await conn.execute(f"DELETE FROM {s}.tasks")
        await conn.execute(_INSERT.format(s=s), 50)
        claimed, seq, idx = await _claim_scans(conn, s, 10)
        assert (claimed, seq) == (10, 0), (claimed, seq)
        assert idx > 0
        # The limited path (a settings row) too.
        await limit_queue(conn, "default", max_running=1000, schema=schema)
        claimed, seq, idx = await _claim_scans(conn, s, 10)
        assert (claimed, seq) == (10, 0), (claimed, seq)
    finally:
        await conn.close()


async def _updates(conn: Any, table: str) -> tuple[int, int]:
    """This session's unflushed updates of ``table``, and how many of them were HOT."""
    row = await conn.fetchrow(
        "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_xact_user_tables WHERE relid = $1::regclass",
        table,
    )
    return int(row[0]), int(row[1])


async def test_the_claim_is_never_jit_compiled(pg_schema: tuple[str, str]) -> None:
    """A claim costed as a walk over millions (its batch size is a parameter) must not
    spend tens of milliseconds compiling a plan that runs in microseconds."""
    dsn, schema = pg_schema
    s = f'"{schema}"'
    conn = await asyncpg.connect(dsn)
    logged: list[str] = []
    try:
        await install(conn, schema=schema)
        await conn.execute(_INSERT.format(s=s), 20)
        try:
            await conn.execute("LOAD 'auto_explain'")
        except asyncpg.PostgresError as exc:
            pytest.skip(f"auto_explain cannot be loaded here: {exc}")
        if await conn.fetchval("SELECT pg_jit_available()") is not True:
            pytest.skip("the server has no JIT provider")
        await conn.execute(
            "SET jit = on; SET jit_above_cost = 0; SET jit_inline_above_cost = 0;"
            " SET auto_explain.log_min_duration = 0;"
            " SET auto_explain.log_nested_statements = on; SET client_min_messages = log"
        )
        conn.add_log_listener(lambda _c, message: logged.append(message.message))
        claimed, _, _ = await _claim_scans(conn, s, 5)
        await conn.execute("SET client_min_messages = notice")
        assert claimed == 5
        statements = [m for m in logged if "Query Text" in m and "tasks" in m]
        assert statements, logged
        assert not [m for m in statements if "JIT:" in m], statements
    finally:
        await conn.close()


async def test_progress_updates_are_heap_only(pg_schema: tuple[str, str]) -> None:
    dsn, schema = pg_schema
    s = f'"{schema}"'
    conn = await asyncpg.connect(dsn)
    try:
        await install(conn, schema=schema)
        await conn.execute(f"ALTER TABLE {s}.tasks SET (autovacuum_enabled = false)")
        await conn.execute(_INSERT.format(s=s), 5_000)
        async with conn.transaction():
            upd0, hot0 = await _updates(conn, f"{s}.tasks")
            # One row in six gets a progress report (as handlers running at once do).
            await conn.execute(
                f"""UPDATE {s}.tasks SET progress = '{{"fraction": 0.5}}'::jsonb
                WHERE id % 6 = 0"""
            )
            upd, hot = await _updates(conn, f"{s}.tasks")
        upd, hot = upd - upd0, hot - hot0
        assert upd > 800
        # Packed pages (fill factor 100) leave room for almost none of them.
        assert hot >= 0.9 * upd, (hot, upd)
    finally:
        await conn.close()


@pytest.fixture
def private_dsn(pg_clusters: Clusters) -> str:
    return pg_clusters.new("horizon").dsn()


async def _make_dead_rows(dsn: str, n: int) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(_INSERT.format(s="steeple_queue"), n)
        await conn.execute("DELETE FROM steeple_queue.tasks WHERE task_name = 'vacuum-t'")
        await conn.execute("SELECT pg_stat_force_next_flush()")
        await conn.execute("SELECT 1")  # a transaction end: the counts are flushed
    finally:
        await conn.close()


async def test_held_horizon_names_an_idle_in_transaction_session(private_dsn: str) -> None:
    conn = await asyncpg.connect(private_dsn)
    holder = await asyncpg.connect(
        private_dsn, server_settings={"application_name": "forgotten-begin"}
    )
    try:
        await install(conn)
        assert await held_horizon(conn, ["steeple_queue"], dead_rows=100) is None
        await holder.execute("BEGIN")
        await holder.fetchval("SELECT txid_current()")
        holder_pid = await holder.fetchval("SELECT pg_backend_pid()")
        await _make_dead_rows(private_dsn, 500)
        await conn.execute("VACUUM steeple_queue.tasks")  # removes nothing: the horizon is held

        async def seen() -> horizon.HeldHorizon | None:
            return await held_horizon(conn, ["steeple_queue"], dead_rows=100)

        await wait_until(seen)
        held = await seen()
        assert held is not None
        assert held.table == "steeple_queue.tasks"
        assert held.dead_rows >= 100
        assert (held.kind, held.pid, held.application_name, held.state) == (
            "session",
            holder_pid,
            "forgotten-begin",
            "idle in transaction",
        )
        assert held.seconds is not None
        assert held.seconds >= 0
        line = held.describe()
        assert f"session pid {holder_pid}" in line, line
        assert "'forgotten-begin'" in line, line
        # Other schemas are not judged.
        assert await held_horizon(conn, ["elsewhere"], dead_rows=100) is None
        # Released: vacuum removes them and nothing is reported.
        await holder.execute("ROLLBACK")
        await conn.execute("VACUUM steeple_queue.tasks")
        await wait_until(seen_none(conn))
    finally:
        await holder.close()
        await conn.close()


def seen_none(conn: Any) -> Any:
    async def check() -> bool:
        return await held_horizon(conn, ["steeple_queue"], dead_rows=100) is None

    return check


async def test_worker_health_names_the_holder(
    private_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(horizon, "DEAD_ROWS_THRESHOLD", 100)
    monkeypatch.setattr(_maintenance, "HORIZON_CHECK_INTERVAL", 0.05)
    conn = await asyncpg.connect(private_dsn)
    holder = await asyncpg.connect(private_dsn, server_settings={"application_name": "report"})
    worker = Scheduler(private_dsn, worker_id="w", poll_interval=0.05, maintenance_interval=0.05)

    async def handler(ctx: Any, args: Any) -> None:
        return None

    worker.register(Task("other"), handler)
    stop = asyncio.Event()
    try:
        await install(conn)
        run = asyncio.create_task(worker.run_until_shutdown(stop))
        await wait_until(lambda: worker.health() is Health.HEALTHY or run.done())
        await holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        await holder.fetchval("SELECT count(*) FROM steeple_queue.tasks")
        await _make_dead_rows(private_dsn, 500)
        await wait_until(lambda: worker.health() is Health.DEGRADED or run.done())
        (reason,) = worker.health_reasons()
        assert "dead rows in steeple_queue.tasks" in reason, reason
        assert "'report'" in reason, reason
        await holder.execute("ROLLBACK")
        await conn.execute("VACUUM steeple_queue.tasks")
        await wait_until(lambda: worker.health() is Health.HEALTHY or run.done())
        assert not run.done()
    finally:
        stop.set()
        await holder.close()
        await conn.close()
    await asyncio.wait_for(run, 30)
