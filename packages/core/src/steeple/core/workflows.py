"""Workflows: tasks that run after others. Who waits for what, and what an ending means.

A task enqueued ``after`` others is ``waiting`` (see :data:`steeple.core.tasks.TASK_TRANSITIONS`)
with a count of the tasks it still waits for. Each of those that reaches a terminal state
settles its dependents once, by :func:`settlement`: one fewer to wait for (the last one makes
the dependent claimable, ``DEPENDENCIES_MET``), or, for a dependent that runs only after
successes, ``DEPENDENCY_FAILED`` (cancelled, and its own dependents after it).

Cancelling is the default because a dependent reads what its parents produced: running it
after a parent failed would run it on results that do not exist. A dependent that must run
whatever happened (a cleanup, a report) says so with :attr:`ParentFailure.RUN`.
"""

from __future__ import annotations

import enum
import heapq
from collections.abc import Sequence
from typing import Final

from steeple.core._validate import TypedEnumType
from steeple.core.errors import ConfigurationError, ConfigurationTypeError
from steeple.core.tasks import TERMINAL_TASK_STATES, TaskEvent, TaskState

__all__ = [
    "DELETED_PARENT",
    "MAX_PARENTS",
    "MAX_WORKFLOW_TASKS",
    "ParentFailure",
    "Settlement",
    "WorkflowCycleError",
    "parent_failure",
    "settlement",
    "workflow_order",
]

MAX_WORKFLOW_TASKS: Final = 10_000
"""The most tasks one workflow enqueue inserts (one statement)."""
MAX_PARENTS: Final = 1_000
"""The most tasks one task may wait for."""
DELETED_PARENT: Final = TaskState.FAILED
"""What a parent deleted before it settled its dependents counts as.

Its outcome is unknown (a worker of an earlier release ended it without settling, then it
was pruned), so it is not taken for a success: a dependent that runs only after successes
is cancelled, one that runs anyway runs.
"""


class WorkflowCycleError(ConfigurationError):
    """The dependencies asked for form a cycle: no task of it could ever run.

    Attributes:
        cycle: the positions (in the order the tasks were given) of the tasks on the cycle.
    """

    def __init__(self, cycle: Sequence[int]) -> None:
        self.cycle = tuple(cycle)
        shown = " -> ".join(str(i) for i in self.cycle)
        super().__init__(f"the tasks' dependencies form a cycle: {shown}")


class ParentFailure(enum.Enum, metaclass=TypedEnumType):
    """What a dependent does when a task it waits for fails for good or is cancelled."""

    CANCEL = "cancel"
    """It is cancelled, and its dependents after it (the default)."""
    RUN = "run"
    """It runs anyway, once every task it waits for has ended."""


class Settlement(enum.Enum, metaclass=TypedEnumType):
    """What one parent's ending does to one waiting dependent."""

    ONE_FEWER = "one_fewer"
    """It waits for one task fewer; the last makes it claimable (``DEPENDENCIES_MET``)."""
    CANCEL = "cancel"
    """It is cancelled (``DEPENDENCY_FAILED``), and so are its waiting dependents."""

    @property
    def event(self) -> TaskEvent | None:
        """The dependent's event, when the settlement moves it at once."""
        return TaskEvent.DEPENDENCY_FAILED if self is Settlement.CANCEL else None


def parent_failure(value: object) -> ParentFailure:
    """Return ``value`` as a :class:`ParentFailure` (a member, or ``"cancel"`` or ``"run"``).

    Raises:
        ConfigurationTypeError: not a ParentFailure or str.
        ConfigurationError: a str naming no policy.
    """
    if isinstance(value, ParentFailure):
        return value
    if not isinstance(value, str):
        raise ConfigurationTypeError(
            f"on_parent_failure must be 'cancel' or 'run', not {type(value).__name__}"
        )
    for member in ParentFailure:
        if member.value == value:
            return member
    raise ConfigurationError("on_parent_failure must be 'cancel' or 'run'")


def settlement(parent: TaskState, policy: ParentFailure) -> Settlement:
    """Decide what ``parent`` reaching its terminal state does to a dependent of ``policy``.

    Raises:
        ConfigurationTypeError: ``parent`` not a TaskState or ``policy`` not a ParentFailure.
        ConfigurationError: ``parent`` is not terminal (a live parent settles nothing).
    """
    if not isinstance(parent, TaskState):
        raise ConfigurationTypeError(f"parent must be a TaskState, not {type(parent).__name__}")
    if not isinstance(policy, ParentFailure):
        raise ConfigurationTypeError(f"policy must be a ParentFailure, not {type(policy).__name__}")
    if parent not in TERMINAL_TASK_STATES:
        raise ConfigurationError(f"a {parent.value} task settles no dependent")
    if parent is TaskState.SUCCEEDED or policy is ParentFailure.RUN:
        return Settlement.ONE_FEWER
    return Settlement.CANCEL


def workflow_order(parents: Sequence[Sequence[int]]) -> list[int]:
    """Return the positions of a graph's tasks, each after every task it waits for.

    ``parents[i]`` lists the positions of the tasks task ``i`` waits for. The order is stable:
    tasks given in dependency order come back as they are.

    Raises:
        WorkflowCycleError: the dependencies form a cycle (a task waiting for itself too).
        ConfigurationError: a position outside the graph.
    """
    count = len(parents)
    children: list[list[int]] = [[] for _ in range(count)]
    missing = [0] * count
    for child, ups in enumerate(parents):
        for up in set(ups):
            if not 0 <= up < count:
                raise ConfigurationError(f"task {child} waits for {up}, which is not in the graph")
            children[up].append(child)
            missing[child] += 1
    ready = [i for i in range(count) if missing[i] == 0]  # sorted: a heap already
    order: list[int] = []
    while ready:
        node = heapq.heappop(ready)
        order.append(node)
        for child in children[node]:
            missing[child] -= 1
            if missing[child] == 0:
                heapq.heappush(ready, child)
    if len(order) < count:
        raise WorkflowCycleError(_a_cycle(parents, {i for i in range(count) if missing[i]}))
    return order


def _a_cycle(parents: Sequence[Sequence[int]], stuck: set[int]) -> list[int]:
    """Return one cycle among ``stuck`` (each waits, transitively, for a stuck task)."""
    node = min(stuck)
    seen: dict[int, int] = {}
    path: list[int] = []
    while node not in seen:
        seen[node] = len(path)
        path.append(node)
        node = min(up for up in parents[node] if up in stuck)
    cycle = path[seen[node] :]
    return [*cycle, cycle[0]]
