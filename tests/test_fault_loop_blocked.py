"""A handler or broker call that blocks the event loop past its lease (RELIABILITY.md row 14).

A real ``steeple worker`` process runs a task handler (or a broker ``publish``) that waits
with a synchronous ``time.sleep`` loop, so its whole event loop stops: no renewal, no
heartbeat. Its lease lapses for real; a second ``steeple worker`` process takes the work
and finishes it. When the first one's loop runs again, its late completion (or its record
of the publication) is fenced, and its log names the handler that blocked the loop.
"""

from __future__ import annotations

import functools
import re
import signal
from datetime import timedelta
from pathlib import Path

import pytest

import queue_support
from pg_cluster import Clusters
from worker_fault_support import World, private_database, world

# Each test runs on a private cluster: worker processes and their pools only.
pytestmark = [pytest.mark.postgres, pytest.mark.slow]

wait_until = functools.partial(queue_support.wait_until, interval=0.05, timeout=60)
# The gate's frame: a line about the stall the test made, not an earlier one of a loaded
# machine (an import or a connection that held the loop just past the threshold).
GATE = "block_until_gate (faultapp.py:"


async def test_a_handler_blocking_the_loop_loses_its_task_and_is_named(
    pg_clusters: Clusters, tmp_path: Path
) -> None:
    dsn, schema = private_database(pg_clusters)
    async with world(dsn, schema, tmp_path, lease=timedelta(seconds=1), occurrences=0) as w:
        [task_id] = await w.enqueue(1, lease=timedelta(seconds=1))
        blocked = await w.spawn("blocked", FAULT_BLOCKING="1")
        await wait_until(lambda: _traced(w, "start", "blocked"))
        # While the loop is blocked the watchdog thread already names the culprit.
        during = await blocked.wait_for_line("has been blocked for", GATE)
        assert f"task \"steeple task 'slow' #{task_id} attempt 1\"" in during
        assert "block_until_gate (faultapp.py:" in during

        (tmp_path / "open").touch()
        taker = await w.spawn("taker", FAULT_GATE=str(tmp_path / "open"))

        async def taken_over() -> bool:
            return (await w.tasks())[task_id] == ("succeeded", 2, "taker")

        await wait_until(taken_over)
        w.open_gate()  # the blocked handler returns; its loop runs again
        await wait_until(lambda: _traced(w, "end", "blocked"))
        after = await blocked.wait_for_line("the event loop stalled for", GATE)
        lag = float(re.search(r"stalled for ([\d.]+) s", after).group(1))  # type: ignore[union-attr]
        assert lag > 1.0  # longer than the lease it lost
        assert f"task \"steeple task 'slow' #{task_id} attempt 1\"" in after
        assert re.search(
            r"block_until_gate \(faultapp\.py:\d+\) <- wait_for_gate \(faultapp\.py:\d+\) "
            r"<- slow_task \(faultapp\.py:\d+\)",
            after,
        ), after
        blocked.signal(signal.SIGTERM)
        assert await blocked.exited() == 0, blocked.stderr
        # its completion reached the database and was rejected: the lease was lost
        assert "tasks: 0 succeeded, 0 retried, 0 failed, 0 handed back, 1 outcomes rejected" in (
            blocked.stderr
        )
        taker.signal(signal.SIGTERM)
        assert await taker.exited() == 0, taker.stderr
    assert await w.attempts() == [
        (task_id, 1, "lease_expired", "blocked"),
        (task_id, 2, "succeeded", "taker"),
    ]
    assert await w.tasks() == {task_id: ("succeeded", 2, "taker")}
    # both handlers ran to their end; only the taker's outcome counts
    assert sorted(await w.traces("end")) == [f"{task_id}/1", f"{task_id}/2"]


async def test_a_broker_publish_blocking_the_loop_loses_its_lease_and_is_named(
    pg_clusters: Clusters, tmp_path: Path
) -> None:
    dsn, schema = private_database(pg_clusters)
    async with world(dsn, schema, tmp_path, lease=timedelta(seconds=1), occurrences=1) as w:
        blocked = await w.spawn("blocked", FAULT_BLOCKING="1")
        await wait_until(lambda: _traced(w, "publish-start", "blocked"))
        [before] = await w.occurrences()
        assert (before["state"], before["lease_revision"]) == ("leased", 1)
        during = await blocked.wait_for_line("has been blocked for", GATE)
        assert f"steeple relay: publish occurrence {before['id']}" in during
        assert "GatedBroker.publish (faultapp.py:" in during

        (tmp_path / "open").touch()
        taker = await w.spawn("taker", FAULT_GATE=str(tmp_path / "open"))

        async def taken_over() -> bool:
            [row] = await w.occurrences()
            return (row["state"], row["lease_revision"]) == ("published", 2)

        await wait_until(taken_over)
        w.open_gate()  # the blocked publish returns: the broker accepted it, late
        await wait_until(lambda: w.accepted("blocked"))
        after = await blocked.wait_for_line("the event loop stalled for", GATE)
        assert f"steeple relay: publish occurrence {before['id']}" in after
        assert re.search(
            r"block_until_gate \(faultapp\.py:\d+\) <- wait_for_gate \(faultapp\.py:\d+\) "
            r"<- GatedBroker\.publish \(faultapp\.py:\d+\)",
            after,
        ), after
        # The graceful stop lets the round finish: its record is fenced (lease lost).
        blocked.signal(signal.SIGTERM)
        assert await blocked.exited() == 0, blocked.stderr
        assert "relayed 0 occurrences (1 relay failure)" in blocked.stderr
        taker.signal(signal.SIGTERM)
        assert await taker.exited() == 0, taker.stderr
        assert "relayed 1 occurrence (0 relay failures)" in taker.stderr
    [row] = await w.occurrences()
    # the taker's claim (revision 2) recorded it; the stale holder's record changed nothing
    assert (row["state"], row["lease_revision"], row["attempts"]) == ("published", 2, 2)
    keys = w.accepted()
    # delivered twice (at least once), under the one idempotency key a consumer dedups on
    assert len(keys) == 2
    assert len(set(keys)) == 1
    assert set(await w.traces("publish-start")) == set(keys)


async def _traced(w: World, event: str, worker: str) -> bool:
    return bool(await w.traces(event, worker))
