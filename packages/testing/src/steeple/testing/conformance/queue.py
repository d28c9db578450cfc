"""The work-queue conformance suite: a hypothesis state machine any queue storage can run.

:class:`QueueConformance` drives the queue under test (through a small
:class:`QueueDriver` adapter) with random sequences of the task lifecycle's operations --
enqueue (immediate or delayed, with a priority), claim, a late claim whose sender already
gave up, renew, complete, retry, permanent failure, cancel, lease expiry plus recovery,
prune -- beside an independent model written from the contract (plain dicts; it shares
no code with any implementation). Each example starts with two to six due tasks of mostly
equal priority, and operations favour running tasks and their current token, so orderings,
retries, exhaustion and fencing are reached often. After every step the stored tasks must
equal the model:

- a claim takes exactly the due pending tasks, highest priority first, then oldest due
  (a retried task is due again *now*, behind everything already waiting: a rule retries a
  task that a later peer of its priority waits behind and claims the line ahead of it in
  every example where one exists), and counts an attempt;
- only the current lease token renews, completes, retries or fails a running task; stale
  (earlier leases of the same task) and forged tokens change nothing, also when the stale
  one arrives while a newer claim of the same task is running;
- a claim delivered after its sender's give-up time takes nothing;
- cancel reports the prior state and changes only pending or running work, fencing out
  the running lease;
- an expired lease is recovered to pending, or to failed once attempts are exhausted;
- prune removes exactly the terminal tasks no live task depends on, and the attempt
  history never outlives them.

Three optional capabilities widen the machine when the driver has them:

- :class:`DependencyQueueDriver` (tasks enqueued after others): random graphs of
  dependents, amid failures, cancellations and lease lapses. A dependent is ``waiting``
  (claimed by nobody) until every task it waits for has ended; it then becomes due once
  they all succeeded, or is cancelled (and its own dependents after it) when one failed
  for good or was cancelled -- unless it runs anyway (``on_parent_failure="run"``), once
  they all ended. A stale completion releases nothing. So every dependent runs only
  after its parents, exactly as often as its own attempts say, or never.
- :class:`KeyLimitedQueueDriver` (a per-key running limit): tasks carry one of a few
  limit keys and a claim skips each whose key already runs the limit, walking on to the
  tasks behind it, so no key ever runs more than the limit and a full key blocks no other.
- :class:`ReleasingQueueDriver` (a holder hands unfinished work back): only the current
  lease token returns a running task to pending, due at once with its attempt refunded;
  a stale holder's hand-back, also one arriving while another worker runs the task, and
  a forged one change nothing.

A queue opts in with an adapter::

    async def make_driver() -> QueueDriver:
        return MyDriver(await connect(), schema)  # empty queue, once per example

    def test_conformance() -> None:  # a plain (sync) test: the suite owns its loop
        run_queue_conformance(make_driver)

The factory is awaited inside an :class:`asyncio.Runner` the machine owns, once per
example; it must return a driver over an EMPTY queue. ``driver.close()`` runs at the end
of each example in the same runner.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Hashable, Sequence
from typing import Any, ClassVar, Protocol, TypeVar, runtime_checkable

import attrs
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

__all__ = [
    "DEFAULT_SETTINGS",
    "MAX_ATTEMPTS",
    "ClaimedTask",
    "DependencyQueueDriver",
    "KeyLimitedQueueDriver",
    "MakeDriver",
    "QueueConformance",
    "QueueDriver",
    "ReleasingQueueDriver",
    "StoredTask",
    "queue_conformance_machine",
    "run_queue_conformance",
]

T = TypeVar("T")

MAX_ATTEMPTS = 2
"""Every task the suite enqueues allows this many attempts (so exhaustion is reached)."""
TERMINAL = frozenset({"succeeded", "failed", "cancelled"})
LIMIT_KEYS = ("a", "b")
"""The limit keys the suite's tasks carry (with a key limiting driver)."""

DEFAULT_SETTINGS = settings(
    max_examples=60,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
"""What :func:`run_queue_conformance` uses unless told otherwise."""


@attrs.frozen
class ClaimedTask:
    """One task a claim returned: its id, the attempt number it now runs and its lease."""

    task_id: int
    attempt: int
    token: Hashable = attrs.field(repr=False)


@attrs.frozen
class StoredTask:
    """What the suite compares of a stored task."""

    state: str
    attempts: int
    has_lease: bool
    finished: bool


class QueueDriver(Protocol):
    """The queue under test, as the conformance machine drives it.

    States are the lifecycle's names: ``pending``, ``running``, ``succeeded``, ``failed``,
    ``cancelled``. Lease tokens are opaque to the suite (compared with ``==`` only).
    """

    async def enqueue(self, *, priority: int, delayed: bool, max_attempts: int) -> int:
        """Create a task due now (or, if ``delayed``, an hour from now); return its id."""
        ...

    async def claim(self, limit: int) -> list[ClaimedTask]:
        """Claim up to ``limit`` due tasks for a worker that waits a minute for the answer."""
        ...

    async def late_claim(self, limit: int) -> list[ClaimedTask]:
        """Deliver a claim whose sender's give-up time has already passed."""
        ...

    def forge_token(self) -> Hashable:
        """Return a token of the right type that no claim ever issued."""
        ...

    async def renew(self, task_id: int, token: Hashable) -> bool:
        """Extend the lease; ``True`` if it was extended."""
        ...

    async def complete(self, task_id: int, token: Hashable) -> bool:
        """Record success; ``True`` if it was recorded."""
        ...

    async def retry(self, task_id: int, token: Hashable) -> bool:
        """Record a retryable failure due again immediately; ``True`` if recorded."""
        ...

    async def fail(self, task_id: int, token: Hashable) -> bool:
        """Record a permanent failure; ``True`` if recorded."""
        ...

    async def cancel(self, task_id: int) -> tuple[str, bool]:
        """Cancel; return the state before and whether anything changed."""
        ...

    async def expire_lease(self, task_id: int) -> None:
        """Make the running task's lease lapse now (as if its worker died)."""
        ...

    async def recover_expired(self) -> list[tuple[int, str]]:
        """Recover every expired lease; return ``(task id, new state)`` pairs."""
        ...

    async def prune(self) -> int:
        """Delete every terminal task no live task depends on (and its history); return how many."""
        ...

    async def tasks(self) -> dict[int, StoredTask]:
        """Return every stored task by id."""
        ...

    async def orphan_history(self) -> int:
        """Count attempt-history entries whose task no longer exists (0 if none kept)."""
        ...

    async def close(self) -> None:
        """Release the driver's resources (end of one example)."""
        ...


@runtime_checkable
class DependencyQueueDriver(QueueDriver, Protocol):
    """A queue whose tasks can wait for others (the ``waiting`` state)."""

    async def enqueue_after(
        self,
        parents: Sequence[int],
        *,
        priority: int,
        max_attempts: int,
        run_on_parent_failure: bool,
        limit_key: str | None,
    ) -> int:
        """Create a task due now that waits for ``parents`` (existing tasks); return its id.

        ``limit_key`` is ``None`` unless the driver is also a :class:`KeyLimitedQueueDriver`.
        """
        ...


@runtime_checkable
class KeyLimitedQueueDriver(QueueDriver, Protocol):
    """A queue that caps how many tasks of one limit key run at once."""

    async def limit_running_per_key(self, limit: int) -> None:
        """Let at most ``limit`` tasks of any one key run at once in the suite's queue."""
        ...

    async def enqueue_keyed(self, key: str, *, priority: int, max_attempts: int) -> int:
        """Create a task due now with limit key ``key``; return its id."""
        ...


@runtime_checkable
class ReleasingQueueDriver(QueueDriver, Protocol):
    """A queue whose holder can hand a running task back unfinished (at shutdown)."""

    async def release(self, task_id: int, token: Hashable) -> bool:
        """Return a running task to pending if ``token`` is its lease; report whether it was.

        The task stays due and its attempt is refunded.
        """
        ...


MakeDriver = Callable[[], Awaitable[QueueDriver]]
"""Builds a driver over an empty queue (awaited inside the machine's runner)."""


@attrs.define
class _ModelTask:
    seq: int
    priority: int
    due: bool
    state: str = "pending"
    attempts: int = 0
    token: Hashable | None = None
    old_tokens: list[Hashable] = attrs.field(factory=list)
    key: str | None = None
    waits_for: set[int] = attrs.field(factory=set)  # parents not yet ended
    parents: frozenset[int] = frozenset()  # every task it waits on, ended or not
    runs_anyway: bool = False  # on_parent_failure="run"


class QueueConformance(RuleBasedStateMachine):
    """The queue under test beside an independent model; bind a driver factory first.

    Use :func:`queue_conformance_machine` (or :func:`run_queue_conformance`); this base
    class has none.
    """

    make_driver: ClassVar[MakeDriver | None] = None

    def __init__(self) -> None:
        super().__init__()
        factory = type(self).make_driver
        if factory is None:
            raise TypeError("bind a driver factory with queue_conformance_machine()")
        self.runner = asyncio.Runner()
        self.model: dict[int, _ModelTask] = {}
        self.seq = 0
        self.key_limit: int | None = None
        self.driver: QueueDriver = self._run(_awaitable(factory()))
        self.dependencies = isinstance(self.driver, DependencyQueueDriver)
        self.keyed = isinstance(self.driver, KeyLimitedQueueDriver)
        self.releases = isinstance(self.driver, ReleasingQueueDriver)

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.runner.run(coro)

    def teardown(self) -> None:
        """Close the driver and the runner."""
        try:
            self._run(_awaitable(self.driver.close()))
        finally:
            self.runner.close()

    def _ids_in(self, *states: str) -> list[int]:
        return sorted(i for i, t in self.model.items() if t.state in states)

    def _pick(self, data: st.DataObject) -> int:
        # Mostly a running task: the accepted paths are the ones a wrong model or wrong SQL
        # gets wrong in interesting ways (order after a retry, exhaustion, fencing).
        running = self._ids_in("running")
        if running and data.draw(st.integers(0, 2)) < 2:
            return data.draw(st.sampled_from(running))
        return data.draw(st.sampled_from(sorted(self.model)))

    def _token(self, task: _ModelTask, data: st.DataObject) -> tuple[Hashable, bool]:
        choice = data.draw(st.sampled_from(["current", "current", "old", "forged"]))
        if choice == "current" and task.token is not None:
            return task.token, True
        if choice == "old" and task.old_tokens:
            return data.draw(st.sampled_from(task.old_tokens)), False
        return self.driver.forge_token(), False

    def _end_lease(self, task: _ModelTask) -> None:
        if task.token is not None:
            task.old_tokens.append(task.token)
        task.token = None

    def _ended(self, parent_id: int) -> None:
        """Settle the waiting dependents of a task that just reached a terminal state."""
        for child_id in sorted(self.model):
            self._settle_one(parent_id, child_id)

    def _settle_one(self, parent_id: int, child_id: int) -> None:
        """Settle one dependent of an ended parent.

        One fewer to wait for (the last one releases it), or it is cancelled and its own
        dependents are settled in turn.
        """
        child = self.model[child_id]
        if child.state != "waiting" or parent_id not in child.waits_for:
            return
        child.waits_for.discard(parent_id)
        if self.model[parent_id].state == "succeeded" or child.runs_anyway:
            if not child.waits_for:
                child.state = "pending"
        else:
            child.state = "cancelled"
            child.waits_for.clear()
            self._ended(child_id)

    def _walk(self, limit: int) -> list[int]:
        """Return what a claim of ``limit`` takes.

        The due pending tasks in claim order, each skipped whose key already runs the limit
        (counting what this claim took).
        """
        due = sorted(
            (-t.priority, t.seq, i) for i, t in self.model.items() if t.state == "pending" and t.due
        )
        running = Counter(t.key for t in self.model.values() if t.state == "running")
        taken: list[int] = []
        for _p, _s, i in due:
            if len(taken) >= limit:
                break
            key = self.model[i].key
            if key is not None and self.key_limit is not None:
                if running[key] >= self.key_limit:
                    continue  # a full key: the walk goes on to the tasks behind it
                running[key] += 1
            taken.append(i)
        return taken

    # --- rules ---------------------------------------------------------------------------

    @initialize(priorities=st.lists(st.sampled_from((0, 0, 1, -1)), min_size=2, max_size=6))
    def some_due_work(self, priorities: list[int]) -> None:
        """Start with a line of due work: ordering, retries and exhaustion need company."""
        for priority in priorities:
            self.enqueue(priority, False)

    @rule(
        priority=st.sampled_from((0, 0, 0, 1, -1, 2, -2)),
        delayed=st.sampled_from((False, False, True)),
    )
    def enqueue(self, priority: int, delayed: bool) -> None:
        """Enqueue one task, due now or in an hour; mostly equal priorities (ties show order)."""
        task_id = self._run(
            self.driver.enqueue(priority=priority, delayed=delayed, max_attempts=MAX_ATTEMPTS)
        )
        assert task_id not in self.model, f"task id {task_id} reused"
        self.model[task_id] = _ModelTask(seq=self.seq, priority=priority, due=not delayed)
        self.seq += 1

    @initialize(limit=st.integers(1, 2))
    def a_per_key_limit(self, limit: int) -> None:
        """With a key limiting driver, cap each key's running tasks (1 or 2)."""
        if isinstance(self.driver, KeyLimitedQueueDriver):
            self._run(self.driver.limit_running_per_key(limit))
            self.key_limit = limit

    @precondition(lambda self: self.keyed)
    @rule(key=st.sampled_from(LIMIT_KEYS), priority=st.sampled_from((0, 0, 1)))
    def enqueue_keyed(self, key: str, priority: int) -> None:
        """Enqueue a task due now with a limit key (a few keys: they fill up)."""
        assert isinstance(self.driver, KeyLimitedQueueDriver)
        task_id = self._run(
            self.driver.enqueue_keyed(key, priority=priority, max_attempts=MAX_ATTEMPTS)
        )
        self._add(task_id, _ModelTask(seq=self.seq, priority=priority, due=True, key=key))

    @precondition(lambda self: self.dependencies and self.model)
    @rule(
        data=st.data(),
        runs_anyway=st.sampled_from((False, False, True)),
        priority=st.sampled_from((0, 0, 1)),
    )
    def enqueue_after(self, data: st.DataObject, runs_anyway: bool, priority: int) -> None:
        """Enqueue a task after one to three stored tasks, live or ended.

        Waiting ones are among them, so chains and diamonds form; some run anyway, some
        carry a limit key.
        """
        assert isinstance(self.driver, DependencyQueueDriver)
        chosen = set(data.draw(st.lists(st.sampled_from(sorted(self.model)), max_size=2)))
        # Mostly after a waiting task too: chains, whose cancellation must go all the way.
        waiting = self._ids_in("waiting")
        if (waiting and data.draw(st.integers(0, 2)) < 2) or not chosen:
            chosen.add(data.draw(st.sampled_from(waiting or sorted(self.model))))
        parents = sorted(chosen)
        key = data.draw(st.sampled_from((None, *LIMIT_KEYS))) if self.keyed else None
        task_id = self._run(
            self.driver.enqueue_after(
                parents,
                priority=priority,
                max_attempts=MAX_ATTEMPTS,
                run_on_parent_failure=runs_anyway,
                limit_key=key,
            )
        )
        task = _ModelTask(
            seq=self.seq, priority=priority, due=True, key=key, runs_anyway=runs_anyway
        )
        task.state = "waiting"
        task.waits_for = set(parents)
        task.parents = frozenset(parents)
        self._add(task_id, task)
        # Parents that had already ended settle it at once, as their endings would have.
        for parent_id in parents:
            if self.model[parent_id].state in TERMINAL:
                self._settle_one(parent_id, task_id)

    def _add(self, task_id: int, task: _ModelTask) -> None:
        assert task_id not in self.model, f"task id {task_id} reused"
        self.model[task_id] = task
        self.seq += 1

    @rule(limit=st.integers(1, 3))
    def late_claim_does_nothing(self, limit: int) -> None:
        """Deliver a claim after its sender gave up (a held network): it takes nothing."""
        assert self._run(self.driver.late_claim(limit)) == []

    @rule(limit=st.integers(1, 3))
    def claim(self, limit: int) -> None:
        """Claim the due pending tasks, highest priority first, then longest waiting."""
        expected = self._walk(limit)
        claimed = self._run(self.driver.claim(limit))
        assert sorted(c.task_id for c in claimed) == sorted(expected)
        for c in claimed:
            task = self.model[c.task_id]
            assert not task.waits_for, "a task ran before every task it waits for ended"
            task.state = "running"
            task.attempts += 1
            assert c.attempt == task.attempts
            assert c.token not in task.old_tokens, "a lease token was reused"
            task.token = c.token

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def complete(self, data: st.DataObject) -> None:
        """Complete with the current, a stale or a forged token: only the current one counts."""
        task_id = self._pick(data)
        task = self.model[task_id]
        token, current = self._token(task, data)
        accepted = current and task.state == "running"
        assert self._run(self.driver.complete(task_id, token)) == accepted
        if accepted:
            task.state = "succeeded"
            self._end_lease(task)
            self._ended(task_id)

    @precondition(lambda self: self.model)
    @rule(data=st.data(), permanent=st.sampled_from((False, False, True)))
    def fail(self, data: st.DataObject, permanent: bool) -> None:
        """Retry (due again now, behind the waiting) or fail for good, token-fenced."""
        task_id = self._pick(data)
        task = self.model[task_id]
        token, current = self._token(task, data)
        call = self.driver.fail if permanent else self.driver.retry
        accepted = current and task.state == "running"
        assert self._run(call(task_id, token)) == accepted
        if accepted:
            task.state = "failed" if permanent else "pending"
            task.due = True
            if not permanent:  # due again now: behind everything already waiting
                task.seq = self.seq
                self.seq += 1
            self._end_lease(task)
            if permanent:
                self._ended(task_id)

    def _retried_with_peers(self) -> list[int]:
        """List the running tasks with a due peer of their priority that became due after them."""
        return [
            i
            for i, t in self.model.items()
            if t.state == "running"
            and any(
                p.state == "pending" and p.due and p.priority == t.priority and p.seq > t.seq
                for p in self.model.values()
            )
        ]

    @precondition(lambda self: self._retried_with_peers())
    @rule(data=st.data())
    def a_retry_waits_behind_its_peers(self, data: st.DataObject) -> None:
        """Retry a task that a later peer of its priority waits behind, then claim the line.

        The retried task is due again now, behind every task already waiting: a claim of
        exactly those ahead of it leaves it pending (a queue that puts it back in its old
        place hands it out instead of the later peer). Reached on purpose, not by chance.
        """
        task_id = data.draw(st.sampled_from(sorted(self._retried_with_peers())))
        task = self.model[task_id]
        assert self._run(self.driver.retry(task_id, task.token)), "the current lease's retry"
        task.state, task.due, task.seq = "pending", True, self.seq
        self.seq += 1
        self._end_lease(task)
        line = self._walk(len(self.model))
        ahead = line.index(task_id) if task_id in line else 0  # absent: its key is full
        if ahead:
            self.claim(ahead)
        assert task.state == "pending", "a retried task jumped the line"

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def renew(self, data: st.DataObject) -> None:
        """Renew with the current, a stale or a forged token: only the current one renews."""
        task_id = self._pick(data)
        task = self.model[task_id]
        token, current = self._token(task, data)
        renewed = self._run(self.driver.renew(task_id, token))
        assert renewed == (current and task.state == "running")

    @precondition(lambda self: self.releases and self.model)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        """Hand back with the current, a stale or a forged token: only the current one counts."""
        assert isinstance(self.driver, ReleasingQueueDriver)
        task_id = self._pick(data)
        task = self.model[task_id]
        token, current = self._token(task, data)
        accepted = current and task.state == "running"
        assert self._run(self.driver.release(task_id, token)) == accepted
        if accepted:  # due again in its old place (it was due), the attempt refunded
            task.state, task.due = "pending", True
            task.attempts -= 1
            self._end_lease(task)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        """Cancel: reports the prior state; changes (and fences) only live work."""
        task_id = self._pick(data)
        task = self.model[task_id]
        before, changed = self._run(self.driver.cancel(task_id))
        assert before == task.state
        assert changed == (task.state in ("waiting", "pending", "running"))
        if changed:
            self._end_lease(task)
            task.state = "cancelled"
            task.waits_for.clear()
            self._ended(task_id)

    @precondition(lambda self: any(t.state == "running" for t in self.model.values()))
    @rule(data=st.data())
    def lease_expires(self, data: st.DataObject) -> None:
        """Let a running task's lease lapse; recovery requeues or fails it."""
        self._expire(data.draw(st.sampled_from(self._ids_in("running"))))

    @precondition(lambda self: any(t.state == "running" for t in self.model.values()))
    @rule(
        data=st.data(),
        late=st.sampled_from(("complete", "retry", "fail", "renew", "release")),
    )
    def stale_holder_reports_while_another_runs_it(self, data: st.DataObject, late: str) -> None:
        """Take a task over, then deliver the first holder's late outcome: it is refused.

        The lease lapses, the task is claimed again, and the first holder's completion,
        retry, failure, renewal or hand-back arrives while the new holder runs it: nothing
        changes.
        """
        if late == "release" and not self.releases:
            late = "complete"
        task_id = data.draw(st.sampled_from(self._ids_in("running")))
        task = self.model[task_id]
        stale = task.token
        self._expire(task_id)
        if task.state != "pending":
            return  # attempts exhausted: failed for good, nobody takes it over
        # Claim every due task, so this one is taken over whatever its place in line.
        self.claim(sum(1 for t in self.model.values() if t.state == "pending" and t.due))
        if task.state != "running":
            assert task.key is not None, "a due task with no key was left behind"
            return  # its key already runs the limit
        assert task.token != stale
        calls = {
            "complete": self.driver.complete,
            "retry": self.driver.retry,
            "fail": self.driver.fail,
            "renew": self.driver.renew,
        }
        if isinstance(self.driver, ReleasingQueueDriver):
            calls["release"] = self.driver.release
        call = calls[late]
        assert not self._run(call(task_id, stale)), f"a stale {late} was accepted"

    def _expire(self, task_id: int) -> None:
        self._run(self.driver.expire_lease(task_id))
        recovered = self._run(self.driver.recover_expired())
        task = self.model[task_id]
        self._end_lease(task)
        task.state = "failed" if task.attempts >= MAX_ATTEMPTS else "pending"
        task.due = True
        assert recovered == [(task_id, task.state)]
        if task.state == "failed":
            self._ended(task_id)

    @rule()
    def prune(self) -> None:
        """Prune every terminal task no live task depends on."""
        count = self._run(self.driver.prune())
        needed = {p for t in self.model.values() if t.state not in TERMINAL for p in t.parents}
        terminal = [i for i in self._ids_in(*TERMINAL) if i not in needed]
        assert count == len(terminal)
        for task_id in terminal:
            del self.model[task_id]

    # --- invariants ----------------------------------------------------------------------

    @invariant()
    def stored_tasks_match_the_model(self) -> None:
        """Every stored task has the model's state, attempts, lease and finish."""
        actual = self._run(self.driver.tasks())
        expected = {
            i: StoredTask(
                state=t.state,
                attempts=t.attempts,
                has_lease=t.state == "running",
                finished=t.state in TERMINAL,
            )
            for i, t in self.model.items()
        }
        assert actual == expected

    @invariant()
    def no_key_runs_over_its_limit(self) -> None:
        """No limit key has more running tasks than the per-key limit."""
        if self.key_limit is not None:
            running = Counter(t.key for t in self.model.values() if t.state == "running")
            assert all(n <= self.key_limit for k, n in running.items() if k is not None)

    @invariant()
    def history_belongs_to_live_tasks(self) -> None:
        """No attempt history outlives its task."""
        assert self._run(self.driver.orphan_history()) == 0


async def _awaitable(value: Awaitable[T]) -> T:
    return await value


def queue_conformance_machine(make_driver: MakeDriver) -> type[QueueConformance]:
    """Return a :class:`QueueConformance` subclass bound to a driver factory.

    Args:
        make_driver: ``async () -> QueueDriver`` over an empty queue; called once per
            example inside the machine's own event loop.
    """

    class Bound(QueueConformance):
        pass

    Bound.make_driver = make_driver
    Bound.__name__ = Bound.__qualname__ = "QueueConformance"
    return Bound


def run_queue_conformance(make_driver: MakeDriver, *, settings: settings | None = None) -> None:
    """Run the queue conformance state machine against a driver factory.

    Call it from a synchronous test or a worker thread (the machine owns its event loop).

    Args:
        make_driver: ``async () -> QueueDriver`` over an empty queue; called once per example.
        settings: hypothesis settings; :data:`DEFAULT_SETTINGS` by default.

    Raises:
        AssertionError: the queue broke the contract (hypothesis shows the shortest
            sequence of steps that does).
    """
    machine = queue_conformance_machine(make_driver)
    run_state_machine_as_test(machine, settings=settings or DEFAULT_SETTINGS)
