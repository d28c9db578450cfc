"""SIGTERM to a real ``steeple worker`` with work in flight (RELIABILITY.md row 16).

Handlers are running and relay publications are in flight (each waits on a gate) when the
signal arrives. Either the work drains within the deadline and every outcome is recorded
once, or the stop is hard (a second signal, or the drain deadline) and the work is handed
back: tasks released, relay leases left to lapse. A second worker then finishes it: nothing
lost, nothing completed twice, every occurrence delivered under its one idempotency key.
"""

from __future__ import annotations

import functools
import signal
from collections import Counter
from datetime import timedelta
from pathlib import Path

import pytest

import queue_support
from pg_cluster import Clusters
from worker_fault_support import World, private_database, world

# Each test runs on a private cluster: worker processes and their pools only.
pytestmark = [pytest.mark.postgres, pytest.mark.slow]

TASKS = 4
OCCURRENCES = 3
# Renewed every second while the handlers wait; long enough that a loaded machine's
# pauses never let one lapse (a lapse would let the worker's own maintenance rerun it).
TASK_LEASE = timedelta(seconds=3)
wait_until = functools.partial(queue_support.wait_until, interval=0.05, timeout=60)


async def _in_flight(w: World, worker: str) -> None:
    """Wait until ``worker`` runs every task and publishes every occurrence due."""

    async def ready() -> bool:
        started = await w.traces("start", worker)
        publishing = await w.traces("publish-start", worker)
        return len(started) == TASKS and len(publishing) >= OCCURRENCES

    await wait_until(ready)


async def _everything_done_once(w: World, task_ids: list[int], finisher: str) -> None:
    """The checker: every task succeeded once, every occurrence was delivered once."""
    tasks = await w.tasks()
    assert {tasks[i][0] for i in task_ids} == {"succeeded"}
    ends = await w.traces("end")
    assert len(ends) == len(set(ends)) == TASKS  # each handler finished once
    succeeded = [a for a in await w.attempts() if a[2] == "succeeded"]
    assert sorted(a[0] for a in succeeded) == sorted(task_ids)  # completed once each
    assert {a[3] for a in succeeded} == {finisher}
    occurrences = await w.occurrences()
    assert len(occurrences) >= OCCURRENCES
    assert {o["state"] for o in occurrences} == {"published"}
    accepted = Counter(w.accepted())
    assert len(accepted) == len(occurrences)
    assert set(accepted.values()) == {1}  # one delivery per idempotency key
    # every publication attempt of any worker used the key that was delivered
    assert set(await w.traces("publish-start")) == set(accepted)


async def test_sigterm_drains_in_flight_work_and_records_it_once(
    pg_clusters: Clusters, tmp_path: Path
) -> None:
    dsn, schema = private_database(pg_clusters)
    async with world(
        dsn, schema, tmp_path, lease=timedelta(seconds=10), occurrences=OCCURRENCES
    ) as w:
        task_ids = await w.enqueue(TASKS, lease=TASK_LEASE)
        worker = await w.spawn("draining")
        await _in_flight(w, "draining")
        worker.signal(signal.SIGTERM)
        await worker.wait_for_line("SIGTERM received, stopping gracefully")
        # Still running, still publishing: the signal stopped nothing that was in flight.
        assert await w.traces("end") == []
        assert w.accepted() == []
        w.open_gate()
        assert await worker.exited() == 0, worker.stderr
        assert "stopping hard" not in worker.stderr
        assert f"tasks: {TASKS} succeeded, 0 retried, 0 failed, 0 handed back" in worker.stderr
        assert "steeple worker: stopped" in worker.stderr
        assert {a[3] for a in await w.attempts()} == {"draining"}
        await _everything_done_once(w, task_ids, "draining")


@pytest.mark.parametrize("how", ["second-signal", "deadline"])
async def test_hard_stop_hands_work_back_and_another_worker_finishes_it_once(
    pg_clusters: Clusters, tmp_path: Path, how: str
) -> None:
    dsn, schema = private_database(pg_clusters)
    async with world(
        dsn, schema, tmp_path, lease=timedelta(seconds=6), occurrences=OCCURRENCES
    ) as w:
        task_ids = await w.enqueue(TASKS, lease=TASK_LEASE)
        drain = "60" if how == "second-signal" else "1"
        worker = await w.spawn("stopped", FAULT_DRAIN=drain)
        await _in_flight(w, "stopped")
        keys = set(await w.traces("publish-start", "stopped"))
        worker.signal(signal.SIGTERM)
        await worker.wait_for_line("SIGTERM received, stopping gracefully")
        if how == "second-signal":
            worker.signal(signal.SIGINT)
            await worker.wait_for_line("SIGINT received again, stopping hard")
        else:
            await worker.wait_for_line("the 1 s drain deadline passed; stopping hard")
        assert await worker.exited(timeout=20) == 0, worker.stderr
        assert f"{TASKS} handed back" in worker.stderr
        assert "relay round cancelled" in worker.stderr
        # Handed back: pending again with the attempt refunded, nothing finished.
        tasks = await w.tasks()
        assert {tasks[i][:2] for i in task_ids} == {("pending", 0)}
        assert await w.traces("end") == []
        assert {a[2] for a in await w.attempts()} == {"released"}
        # The relay leases were left to lapse; nothing reached the broker.
        assert {o["state"] for o in await w.occurrences()} == {"leased"}
        assert w.accepted() == []

        w.open_gate()
        finisher = await w.spawn("finisher")

        async def finished() -> bool:
            tasks = await w.tasks()
            occurrences = await w.occurrences()
            return {tasks[i][0] for i in task_ids} == {"succeeded"} and {
                o["state"] for o in occurrences
            } == {"published"}

        await wait_until(finished)
        finisher.signal(signal.SIGTERM)
        assert await finisher.exited() == 0, finisher.stderr
        await _everything_done_once(w, task_ids, "finisher")
        # republished under the same idempotency keys the stopped worker had used
        assert keys <= set(w.accepted("finisher"))
