"""The queue conformance state machine (steeple.testing) against the in-memory queue.

The same machine runs against the queue's real SQL in ``test_queue_state_machine.py``: the
in-memory queue a test suite uses stores, claims, fences and recovers tasks as PostgreSQL
does. Its enqueues go through the public ``enqueue`` function, as user code's do.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Hashable
from datetime import timedelta
from typing import Any

from hypothesis import HealthCheck, settings

from steeple.postgres.queue import App, EnqueueOptions, Task, enqueue
from steeple.postgres.queue.testing import InMemoryQueue
from steeple.testing.conformance.queue import (
    ClaimedTask,
    QueueDriver,
    StoredTask,
    run_queue_conformance,
)

TASK: Task[Any] = Task("m")


class InMemoryQueueDriver:
    """Drives an :class:`InMemoryQueue`'s storage operations, one worker step at a time."""

    def __init__(self) -> None:
        self.queue = InMemoryQueue(App())

    async def enqueue(self, *, priority: int, delayed: bool, max_attempts: int) -> int:
        options = EnqueueOptions(priority=priority, max_attempts=max_attempts)
        if delayed:
            options = EnqueueOptions.after(
                timedelta(hours=1), priority=priority, max_attempts=max_attempts
            )
        return (await enqueue(self.queue, TASK, {"p": priority}, options)).id

    async def limit_running_per_key(self, limit: int) -> None:
        self.queue.limit_queue("default", max_running_per_key=limit)

    async def enqueue_keyed(self, key: str, *, priority: int, max_attempts: int) -> int:
        options = EnqueueOptions(priority=priority, max_attempts=max_attempts, limit_key=key)
        return (await enqueue(self.queue, TASK, {}, options)).id

    async def claim(self, limit: int) -> list[ClaimedTask]:
        deadline = self.queue.clock.now() + timedelta(minutes=1)
        return [
            ClaimedTask(c.task_id, c.attempt, c.token)
            for c in self.queue.claim(limit, deadline=deadline)
        ]

    async def late_claim(self, limit: int) -> list[ClaimedTask]:
        deadline = self.queue.clock.now() - timedelta(milliseconds=1)
        return [
            ClaimedTask(c.task_id, c.attempt, c.token)
            for c in self.queue.claim(limit, deadline=deadline)
        ]

    def forge_token(self) -> Hashable:
        return uuid.uuid4()

    async def renew(self, task_id: int, token: Hashable) -> bool:
        return self.queue.renew(task_id, token)

    async def complete(self, task_id: int, token: Hashable) -> bool:
        return self.queue.complete(task_id, token)

    async def retry(self, task_id: int, token: Hashable) -> bool:
        return self.queue.retry(task_id, token, timedelta(0))

    async def fail(self, task_id: int, token: Hashable) -> bool:
        return self.queue.fail(task_id, token)

    async def cancel(self, task_id: int) -> tuple[str, bool]:
        before = self.queue.run_state(task_id).state
        after = self.queue.cancel(task_id)
        return before.value, after != before

    async def expire_lease(self, task_id: int) -> None:
        self.queue.expire_lease(task_id)

    async def recover_expired(self) -> list[tuple[int, str]]:
        return [(i, state.value) for i, state in self.queue.recover_expired()]

    async def prune(self) -> int:
        return self.queue.prune()

    async def tasks(self) -> dict[int, StoredTask]:
        return {
            t.id: StoredTask(
                t.state.value, t.attempts, t.lease_expires_at is not None, t.finished_at is not None
            )
            for t in self.queue.tasks()
        }

    async def orphan_history(self) -> int:
        return 0  # the history lives on the task: pruning a task removes it

    async def close(self) -> None:
        pass


def test_in_memory_queue_conforms_to_the_lifecycle_model() -> None:
    async def make_driver() -> QueueDriver:
        return InMemoryQueueDriver()

    # No I/O: more examples than the PostgreSQL run affords, for the rarer orderings.
    examples = int(os.environ.get("STEEPLE_CONFORMANCE_EXAMPLES", "150"))
    run_queue_conformance(
        make_driver,
        settings=settings(
            max_examples=examples,
            stateful_step_count=30,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
