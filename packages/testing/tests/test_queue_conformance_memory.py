"""The queue conformance suite passes a small in-memory queue and fails broken ones."""

from __future__ import annotations

import itertools
import math
import uuid
from collections.abc import Awaitable, Callable, Hashable

import attrs
import pytest
from hypothesis import HealthCheck, Phase, settings

from steeple.testing.conformance.queue import (
    ClaimedTask,
    QueueDriver,
    StoredTask,
    run_queue_conformance,
)

HUNT = settings(
    max_examples=1000,
    stateful_step_count=40,
    deadline=None,
    phases=[Phase.generate],
    report_multiple_bugs=False,
    database=None,
    derandomize=True,  # a fixed search: the same verdict on every run
    suppress_health_check=list(HealthCheck),
)


@attrs.define
class _Task:
    priority: int
    due: float
    max_attempts: int
    state: str = "pending"
    attempts: int = 0
    token: uuid.UUID | None = None
    history: int = 0


@attrs.define
class MemoryQueue:
    """A list-based queue written from the contract (a second opinion, not the oracle)."""

    store: dict[int, _Task] = attrs.field(factory=dict)
    expired: list[int] = attrs.field(factory=list)
    ids: itertools.count[int] = attrs.field(factory=lambda: itertools.count(1))
    ticks: itertools.count[int] = attrs.field(factory=itertools.count)

    def _now(self) -> float:
        return float(next(self.ticks))

    def _holds(self, task_id: int, token: Hashable) -> _Task | None:
        task = self.store.get(task_id)
        return task if task is not None and task.token is not None and task.token == token else None

    async def enqueue(self, *, priority: int, delayed: bool, max_attempts: int) -> int:
        task_id = next(self.ids)
        self.store[task_id] = _Task(priority, math.inf if delayed else self._now(), max_attempts)
        return task_id

    def _order(self, item: tuple[int, _Task]) -> tuple[int, float, int]:
        return (-item[1].priority, item[1].due, item[0])

    async def claim(self, limit: int) -> list[ClaimedTask]:
        due = [kv for kv in self.store.items() if kv[1].state == "pending" and kv[1].due < math.inf]
        out = []
        for task_id, task in sorted(due, key=self._order)[:limit]:
            task.state, task.token = "running", uuid.uuid4()
            task.attempts += 1
            out.append(ClaimedTask(task_id, task.attempts, task.token))
        return out

    async def late_claim(self, limit: int) -> list[ClaimedTask]:
        return []

    def forge_token(self) -> Hashable:
        return uuid.uuid4()

    async def renew(self, task_id: int, token: Hashable) -> bool:
        return self._holds(task_id, token) is not None

    def _finish(self, task_id: int, token: Hashable, state: str) -> bool:
        task = self._holds(task_id, token)
        if task is None:
            return False
        task.state, task.token = state, None
        task.history += 1
        if state == "pending":
            task.due = self._now()
        return True

    async def complete(self, task_id: int, token: Hashable) -> bool:
        return self._finish(task_id, token, "succeeded")

    async def retry(self, task_id: int, token: Hashable) -> bool:
        return self._finish(task_id, token, "pending")

    async def fail(self, task_id: int, token: Hashable) -> bool:
        return self._finish(task_id, token, "failed")

    async def release(self, task_id: int, token: Hashable) -> bool:
        task = self._holds(task_id, token)
        if task is None:
            return False
        task.state, task.token = "pending", None  # keeps its place in line
        task.attempts -= 1
        task.history += 1
        return True

    async def cancel(self, task_id: int) -> tuple[str, bool]:
        task = self.store[task_id]
        before = task.state
        if before not in ("pending", "running"):
            return before, False
        task.state, task.token = "cancelled", None
        return before, True

    async def expire_lease(self, task_id: int) -> None:
        self.expired.append(task_id)

    async def recover_expired(self) -> list[tuple[int, str]]:
        out = []
        for task_id in self.expired:
            task = self.store[task_id]
            if task.state == "running":
                task.token = None
                task.state = "failed" if task.attempts >= task.max_attempts else "pending"
                out.append((task_id, task.state))
        self.expired.clear()
        return out

    async def prune(self) -> int:
        gone = [i for i, t in self.store.items() if t.state in ("succeeded", "failed", "cancelled")]
        for task_id in gone:
            del self.store[task_id]
        return len(gone)

    async def tasks(self) -> dict[int, StoredTask]:
        return {
            i: StoredTask(
                t.state,
                t.attempts,
                t.token is not None,
                t.state in ("succeeded", "failed", "cancelled"),
            )
            for i, t in self.store.items()
        }

    async def orphan_history(self) -> int:
        return 0

    async def close(self) -> None:
        return None


class RetryKeepsItsPlace(MemoryQueue):
    """A retried task goes back to its old place in line instead of behind the waiting."""

    async def retry(self, task_id: int, token: Hashable) -> bool:
        task = self._holds(task_id, token)
        due = task.due if task is not None else 0.0
        done = await super().retry(task_id, token)
        if task is not None:
            task.due = due
        return done


class StaleTokenCompletes(MemoryQueue):
    """Accepts a completion from any lease the task ever had."""

    async def claim(self, limit: int) -> list[ClaimedTask]:
        if not hasattr(self, "seen"):
            self.seen: dict[int, list[Hashable]] = {}
        out = await super().claim(limit)
        for c in out:
            self.seen.setdefault(c.task_id, []).append(c.token)
        return out

    async def complete(self, task_id: int, token: Hashable) -> bool:
        task = self.store.get(task_id)
        if (
            task is not None
            and task.state == "running"
            and isinstance(token, uuid.UUID)
            and token in getattr(self, "seen", {}).get(task_id, [])
        ):
            task.token = token
        return await super().complete(task_id, token)


class RecoveryNeverExhausts(MemoryQueue):
    """Recovers expired leases to pending even after the last attempt."""

    async def recover_expired(self) -> list[tuple[int, str]]:
        for task_id in self.expired:
            self.store[task_id].max_attempts = 10**6
        return await super().recover_expired()


class CancelKeepsLease(MemoryQueue):
    """Cancels a running task but lets its worker still complete it."""

    async def cancel(self, task_id: int) -> tuple[str, bool]:
        task = self.store[task_id]
        token = task.token
        result = await super().cancel(task_id)
        task.token = token
        return result


class StaleHandBackTaken(MemoryQueue):
    """Hands back a running task whatever lease token comes with it."""

    async def release(self, task_id: int, token: Hashable) -> bool:
        task = self.store.get(task_id)
        if task is not None and task.state == "running":
            token = task.token
        return await super().release(task_id, token)


class LowPriorityFirst(MemoryQueue):
    """Claims the lowest priority first."""

    def _order(self, item: tuple[int, _Task]) -> tuple[int, float, int]:
        return (item[1].priority, item[1].due, item[0])


def _factory(cls: type[MemoryQueue]) -> Callable[[], Awaitable[QueueDriver]]:
    async def make() -> QueueDriver:
        return cls()

    return make


def test_the_memory_queue_conforms() -> None:
    run_queue_conformance(_factory(MemoryQueue), settings=settings(HUNT, max_examples=100))


@pytest.mark.parametrize(
    "mutant",
    [RetryKeepsItsPlace, StaleTokenCompletes, RecoveryNeverExhausts, CancelKeepsLease,
     StaleHandBackTaken, LowPriorityFirst],
)  # fmt: skip
def test_the_suite_fails_a_broken_queue(mutant: type[MemoryQueue]) -> None:
    with pytest.raises(AssertionError):
        run_queue_conformance(_factory(mutant), settings=HUNT)
