"""Workflows: tasks enqueued after others, released by the completions of those others.

The rules (what a parent's ending does to a waiting task, the cycle check) live in
:mod:`steeple.core.workflows`; this module checks what callers give, sends a whole graph as
one JSON array to one statement, and reads graphs back.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Final, TypeVar

import attrs

from steeple.core.errors import ConfigurationError
from steeple.core.tasks import TaskState
from steeple.core.workflows import (
    MAX_PARENTS,
    MAX_WORKFLOW_TASKS,
    ParentFailure,
    parent_failure,
    workflow_order,
)
from steeple.core.workflows import WorkflowCycleError as _CoreCycleError
from steeple.postgres.queue import _driver, _metrics, _tracing
from steeple.postgres.queue._enqueue import _checked
from steeple.postgres.queue._local import local_queue
from steeple.postgres.queue._ops import TaskRun
from steeple.postgres.queue._schema import DEFAULT_SCHEMA, entry_point, entry_point_sync
from steeple.postgres.queue._sql import queue_sql
from steeple.postgres.queue._validate import check_task_id
from steeple.postgres.queue.errors import (
    QueueConfigurationError,
    QueueTypeError,
    TaskNotFoundError,
    WorkflowCycleError,
)
from steeple.postgres.queue.tasks import EnqueuedTask, EnqueueOptions, Task

if TYPE_CHECKING:
    from steeple.postgres.queue._app import TaskFunction

__all__ = [
    "ParentResult",
    "Step",
    "Workflow",
    "WorkflowHandle",
    "WorkflowState",
    "WorkflowTask",
    "enqueue_workflow",
    "enqueue_workflow_sync",
    "parent_results",
    "workflow_state",
]

A = TypeVar("A")
_US: Final = timedelta(microseconds=1)


@attrs.frozen
class Step:
    """One task of a :class:`Workflow` not yet enqueued: what ``after=`` names inside it.

    Attributes:
        position: its place in the order the workflow's steps were added (0-based).
    """

    position: int
    _owner: int = attrs.field(repr=False, eq=False)


@attrs.frozen
class _Node:
    text: str  # the node's JSON object, without its "up" and "ids"
    up: tuple[int, ...]
    ids: tuple[int, ...]
    task_name: str
    queue: str


def _parents(after: object, *, owner: int | None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Check ``after``; return the positions of its steps and the ids of its existing tasks.

    Raises:
        QueueTypeError: not a list or tuple; an item not a Step, EnqueuedTask or int.
        QueueConfigurationError: more than ``MAX_PARENTS``; an id outside 1..2**63-1; a
            step of another workflow (or any step where no workflow is being built).
    """
    if not isinstance(after, list | tuple):
        raise QueueTypeError(f"after must be a list or tuple of tasks, not {type(after).__name__}")
    if len(after) > MAX_PARENTS:
        raise QueueConfigurationError(
            f"a task waits for at most {MAX_PARENTS} tasks; after names {len(after)}"
        )
    steps: list[int] = []
    ids: list[int] = []
    for item in after:
        if isinstance(item, Step):
            if owner is None or item._owner != owner:
                raise QueueConfigurationError("after names a step of another workflow")
            steps.append(item.position)
            continue
        if isinstance(item, EnqueuedTask):
            item = item.id
        if isinstance(item, bool) or not isinstance(item, int):
            raise QueueTypeError(
                f"after takes Steps, EnqueuedTasks or task ids, not {type(item).__name__}"
            )
        ids.append(check_task_id(item, "a task id in after"))
    return tuple(dict.fromkeys(steps)), tuple(dict.fromkeys(ids))


def _node(
    task: object, args: object, options: object, queue: object, policy: object
) -> tuple[Task[Any], EnqueueOptions, dict[str, Any], str]:
    checked, chosen = _checked(task, options, queue)
    if chosen.dedup_key is not None:
        raise QueueConfigurationError("a task enqueued after others takes no dedup_key")
    try:
        rule = parent_failure(policy)
    except ConfigurationError as exc:
        raise (QueueTypeError if isinstance(exc, TypeError) else QueueConfigurationError)(
            str(exc)
        ) from None
    args_text = checked.encode(args)
    priority, attempts, lease, b_init, b_max, b_factor, b_jitter = chosen.snapshot(checked)
    fields = {
        "name": checked.name,
        "priority": priority,
        "run_at": None if chosen.run_at is None else chosen.run_at.isoformat(),
        "delay_us": None if chosen.delay is None else chosen.delay // _US,
        "max_attempts": attempts,
        "lease_us": lease // _US,
        "backoff_initial_us": b_init,
        "backoff_maximum_us": b_max,
        "backoff_factor": b_factor,
        "backoff_jitter": b_jitter,
        "queue": chosen.queue,
        "limit_key": chosen.limit_key,
        "policy": rule.value,
    }
    return checked, chosen, fields, args_text


class Workflow:
    """A graph of tasks enqueued together: each runs once the tasks it waits for succeeded.

    Add steps with :meth:`add` (``after=`` names earlier steps or existing task ids),
    :meth:`chain` and :meth:`group`; :meth:`link` adds a dependency between two steps
    afterwards. :func:`enqueue_workflow` inserts the whole graph with one statement, in
    the caller's transaction, and refuses a cycle with :class:`WorkflowCycleError`.
    """

    def __init__(self) -> None:
        self._nodes: list[_Node] = []
        self._extra: dict[int, list[int]] = {}

    def __repr__(self) -> str:
        return f"<Workflow of {len(self._nodes)} tasks>"

    def __len__(self) -> int:
        return len(self._nodes)

    def add(
        self,
        task: Task[A] | TaskFunction[A],
        args: A,
        options: EnqueueOptions | None = None,
        *,
        after: Sequence[Step | EnqueuedTask | int] = (),
        on_parent_failure: ParentFailure | str = ParentFailure.CANCEL,
        queue: str | None = None,
    ) -> Step:
        """Add one task; it waits for every task ``after`` names (steps or task ids).

        Args:
            task: the task definition, or an ``@app.task`` function.
            args: its arguments.
            options: as :func:`~steeple.postgres.queue.enqueue` (no ``dedup_key``).
            after: steps of this workflow, or enqueued tasks (or their ids).
            on_parent_failure: ``"cancel"`` (default: cancelled when one of them fails for
                good or is cancelled) or ``"run"`` (runs once they all ended, however).
            queue: its named queue, as for ``enqueue``.

        Raises:
            ArgsEncodingError: ``args`` cannot be encoded.
            QueueTypeError: a wrong type anywhere (``after`` included).
            QueueConfigurationError: a dedup key, an unknown policy, more than 1,000
                parents or 10,000 steps, a task id outside 1..2**63-1, a step of another
                workflow.
        """
        if len(self._nodes) >= MAX_WORKFLOW_TASKS:
            raise QueueConfigurationError(
                f"a workflow holds at most {MAX_WORKFLOW_TASKS} tasks per enqueue"
            )
        up, ids = _parents(after, owner=id(self))
        checked, chosen, fields, args_text = _node(task, args, options, queue, on_parent_failure)
        text = json.dumps(fields, separators=(",", ":"))[:-1] + ',"args":' + args_text
        self._nodes.append(_Node(text, up, ids, checked.name, chosen.queue))
        return Step(len(self._nodes) - 1, id(self))

    def chain(
        self,
        *steps: tuple[Task[Any] | TaskFunction[Any], Any],
        after: Sequence[Step | EnqueuedTask | int] = (),
    ) -> list[Step]:
        """Add ``(task, args)`` pairs that run one after another (the first after ``after``).

        Raises:
            QueueTypeError: an item that is not a (task, args) pair; as :meth:`add`.
            QueueConfigurationError: as :meth:`add`.
            ArgsEncodingError: as :meth:`add`.
        """
        added: list[Step] = []
        previous: Sequence[Step | EnqueuedTask | int] = after
        for pair in steps:
            task, args = _pair(pair)
            added.append(self.add(task, args, after=previous))
            previous = [added[-1]]
        return added

    def group(
        self,
        *steps: tuple[Task[Any] | TaskFunction[Any], Any],
        after: Sequence[Step | EnqueuedTask | int] = (),
    ) -> list[Step]:
        """Add ``(task, args)`` pairs that run side by side, each after ``after``.

        Pass the result as ``after=`` of a later step to join them.

        Raises:
            QueueTypeError: an item that is not a (task, args) pair; as :meth:`add`.
            QueueConfigurationError: as :meth:`add`.
            ArgsEncodingError: as :meth:`add`.
        """
        return [self.add(*_pair(pair), after=after) for pair in steps]

    def link(self, parent: Step, child: Step) -> None:
        """Make ``child`` wait for ``parent`` too (a cycle is refused at enqueue).

        Raises:
            QueueTypeError: not Steps.
            QueueConfigurationError: a step of another workflow, or more than 1,000 parents.
        """
        for step in (parent, child):
            if not isinstance(step, Step):
                raise QueueTypeError(f"link takes Steps, not {type(step).__name__}")
            if step._owner != id(self):
                raise QueueConfigurationError("link names a step of another workflow")
        extra = self._extra.setdefault(child.position, [])
        if len(self._nodes[child.position].up) + len(extra) >= MAX_PARENTS:
            raise QueueConfigurationError(f"a task waits for at most {MAX_PARENTS} tasks")
        extra.append(parent.position)

    def _payload(self) -> tuple[str, list[int]]:
        """Return the nodes as one JSON array text, in dependency order, and that order.

        Raises:
            WorkflowCycleError: the steps' dependencies form a cycle.
        """
        ups = [tuple(n.up) + tuple(self._extra.get(i, ())) for i, n in enumerate(self._nodes)]
        try:
            order = workflow_order(ups)
        except _CoreCycleError as exc:
            raise WorkflowCycleError(exc.cycle) from None
        place = {position: sent for sent, position in enumerate(order)}
        parts = []
        for position in order:
            node = self._nodes[position]
            up = sorted({place[u] for u in ups[position]})
            parts.append(f'{node.text},"up":{json.dumps(up)},"ids":{json.dumps(list(node.ids))}}}')
        return "[" + ",".join(parts) + "]", order


def _pair(pair: object) -> tuple[Any, Any]:
    if not isinstance(pair, tuple) or len(pair) != 2:
        raise QueueTypeError("chain and group take (task, args) pairs")
    return pair[0], pair[1]


@attrs.frozen
class WorkflowHandle:
    """An enqueued workflow.

    Attributes:
        workflow_id: the workflow's id (read it with :func:`workflow_state`).
        ids: the task ids, in the order the steps were added.
        states: each task's state right after the enqueue (``waiting``, ``pending``, or
            ``cancelled`` when an existing task it waits for had already failed).
    """

    workflow_id: int
    ids: tuple[int, ...]
    states: tuple[TaskState, ...]

    def id_of(self, step: Step) -> int:
        """Return the task id of ``step``.

        Raises:
            QueueTypeError: not a Step.
            QueueConfigurationError: a step this workflow does not have.
        """
        if not isinstance(step, Step):
            raise QueueTypeError(f"step must be a Step, not {type(step).__name__}")
        if not 0 <= step.position < len(self.ids):
            raise QueueConfigurationError("no such step in this workflow")
        return self.ids[step.position]


def _handle(workflow: Workflow, order: list[int], rows: Sequence[Sequence[Any]]) -> WorkflowHandle:
    if rows and int(rows[0][0]) == 0:  # an unknown id in some after: nothing was inserted
        raise TaskNotFoundError(int(rows[0][1]))
    ids = [0] * len(order)
    states = [TaskState.PENDING] * len(order)
    for row in rows:
        position = order[int(row[0]) - 1]
        ids[position], states[position] = int(row[1]), TaskState(row[2])
    counts = Counter((n.task_name, n.queue) for n in workflow._nodes)
    for (name, queue), count in counts.items():
        _metrics.instruments().enqueued.add(count, _metrics.task_attributes(name, queue))
    return WorkflowHandle(int(rows[0][3]), tuple(ids), tuple(states))


def _prepared(conn: Any, workflow: object, schema: str) -> tuple[Workflow, str, list[int]]:
    if not isinstance(workflow, Workflow):
        raise QueueTypeError(f"workflow must be a Workflow, not {type(workflow).__name__}")
    queue_sql(schema)
    if local_queue(conn, schema) is not None:
        raise QueueConfigurationError("workflows need the PostgreSQL queue, not a local one")
    _driver.connection_kind(conn)
    if not workflow._nodes:
        raise QueueConfigurationError("a workflow needs at least one task")
    payload, order = workflow._payload()
    return workflow, payload, order


@entry_point
async def enqueue_workflow(
    conn: Any, workflow: Workflow, *, schema: str = DEFAULT_SCHEMA
) -> WorkflowHandle:
    """Insert every task of ``workflow`` with one statement, in the caller's transaction.

    Tasks that wait for nothing are ``pending`` at once; the others are ``waiting`` until
    the statement that ends their last parent releases them (see the Workflows page).

    Raises:
        WorkflowCycleError: the steps' dependencies form a cycle; nothing was stored.
        TaskNotFoundError: a task id in some ``after`` does not exist; nothing was stored.
        QueueTypeError: ``workflow`` is not a Workflow.
        QueueConfigurationError: an empty workflow, a local queue, an invalid schema name.
        UnsupportedConnectionError: ``conn`` is not an async asyncpg/psycopg connection.
        UnfitDatabaseError: the server refused the write; nothing was stored.
    """
    workflow, payload, order = _prepared(conn, workflow, schema)
    first = workflow._nodes[0]
    with _tracing.sending(first.task_name, len(order), first.queue) as sending:
        rows = await _driver.fetch(conn, queue_sql(schema).enqueue_graph, payload, sending.carrier)
    return _handle(workflow, order, rows)


@entry_point_sync
def enqueue_workflow_sync(
    conn: Any, workflow: Workflow, *, schema: str = DEFAULT_SCHEMA
) -> WorkflowHandle:
    """Like :func:`enqueue_workflow`, for a psycopg (sync) ``Connection``.

    Raises:
        WorkflowCycleError: the steps' dependencies form a cycle; nothing was stored.
        TaskNotFoundError: a task id in some ``after`` does not exist; nothing was stored.
        QueueTypeError: ``workflow`` is not a Workflow.
        QueueConfigurationError: an empty workflow, a local queue, an invalid schema name.
        UnsupportedConnectionError: ``conn`` is not a psycopg sync connection.
        UnfitDatabaseError: the server refused the write; nothing was stored.
    """
    workflow, payload, order = _prepared(conn, workflow, schema)
    first = workflow._nodes[0]
    with _tracing.sending(first.task_name, len(order), first.queue) as sending:
        rows = _driver.fetch_sync(conn, queue_sql(schema).enqueue_graph, payload, sending.carrier)
    return _handle(workflow, order, rows)


def single(
    task: object, args: object, options: object, queue: object, after: object, policy: object
) -> Workflow:
    """Return the one-task workflow that ``enqueue(..., after=...)`` sends."""
    workflow = Workflow()
    workflow.add(task, args, options, after=after, on_parent_failure=policy, queue=queue)  # type: ignore[arg-type]
    return workflow


@attrs.frozen
class WorkflowTask:
    """One task of a workflow as stored.

    Attributes:
        run: the task (its state, result excluded).
        after: the ids of the tasks it waits (or waited) for.
        waiting_on: how many of them it still waits for (``None`` outside a workflow).
        on_parent_failure: what it does when one of them fails (``None`` outside one).
    """

    run: TaskRun
    after: tuple[int, ...]
    waiting_on: int | None
    on_parent_failure: ParentFailure | None

    def to_json(self) -> dict[str, Any]:
        """Return a JSON-ready dict (the run's fields, plus the dependencies)."""
        return {
            **self.run.to_json(),
            "after": list(self.after),
            "waiting_on": self.waiting_on,
            "on_parent_failure": None if self.on_parent_failure is None
            else self.on_parent_failure.value,
        }  # fmt: skip


@attrs.frozen
class WorkflowState:
    """A whole workflow: every task, in id order.

    Attributes:
        workflow_id: the workflow's id.
        tasks: its tasks.
    """

    workflow_id: int
    tasks: tuple[WorkflowTask, ...]

    def counts(self) -> dict[TaskState, int]:
        """How many of its tasks are in each state."""
        return dict(Counter(t.run.state for t in self.tasks))

    @property
    def finished(self) -> bool:
        """Whether every task reached a terminal state."""
        return all(t.run.finished_at is not None for t in self.tasks)


def _ids(text: str) -> tuple[int, ...]:
    inner = text.strip("{}")
    return tuple(int(x) for x in inner.split(",")) if inner else ()


@entry_point
async def workflow_state(conn: Any, task_id: int, *, schema: str = DEFAULT_SCHEMA) -> WorkflowState:
    """Return the workflow ``task_id`` belongs to (or is the id of), every task's state.

    Raises:
        TaskNotFoundError: no such task.
        QueueTypeError: ``task_id`` is not an int.
        QueueConfigurationError: ``task_id`` outside 1..2**63-1, an invalid schema name.
    """
    sql = queue_sql(schema)
    rows = await _driver.fetch(conn, sql.workflow, check_task_id(task_id))
    if not rows:
        raise TaskNotFoundError(task_id)
    tasks = []
    for row in rows:
        policy = row[21]
        tasks.append(
            WorkflowTask(
                TaskRun.from_row(tuple(row[:19])),
                _ids(row[22]),
                row[20],
                None if policy is None else parent_failure(policy),
            )
        )
    return WorkflowState(int(rows[0][19]), tuple(tasks))


@attrs.frozen
class ParentResult:
    """A task another waits (or waited) for: its state and what its handler returned.

    Attributes:
        id: its id.
        task_name: its task's name.
        state: its state (a released dependent's parents all ``succeeded``, unless it
            runs whatever they did).
        result: the JSON value its handler returned (``None`` unless it succeeded).
    """

    id: int
    task_name: str
    state: TaskState
    result: Any


@entry_point
async def parent_results(
    conn: Any, task_id: int, *, schema: str = DEFAULT_SCHEMA
) -> list[ParentResult]:
    """Return the tasks ``task_id`` waits (or waited) for, in id order, with their results.

    A handler reads what its parents produced with ``parent_results(pool, ctx.task_id)``.

    Raises:
        QueueTypeError: ``task_id`` is not an int.
        QueueConfigurationError: ``task_id`` outside 1..2**63-1, an invalid schema name.
    """
    sql = queue_sql(schema)
    rows = await _driver.fetch(conn, sql.parent_results, check_task_id(task_id))
    return [
        ParentResult(int(r[0]), r[1], TaskState(r[2]), None if r[3] is None else json.loads(r[3]))
        for r in rows
    ]
