"""steeple's PostgreSQL work queue: immediate, delayed and recurring work as durable task rows.

Declare tasks with their handlers on an :class:`App` (``@app.task``), produce with
``await my_task.enqueue(conn, args)`` on your own connection (asyncpg or psycopg, in your
own transaction), run them with ``app.scheduler(...)``. The explicit API stays: a
:class:`Task`, :func:`enqueue`, a :class:`Scheduler` and its ``register``. Declare
recurring work with :mod:`.jobs`. Install the schema explicitly with :func:`install`
first. Tasks wait in named queues; :func:`pause_queue`, :func:`resume_queue`,
:func:`limit_queue` and :func:`limit_task` set what every worker obeys. Operators list,
count and retry tasks and list jobs and queues with :mod:`.admin`. A task enqueued
``after=[...]`` others waits until they succeeded; a :class:`Workflow` enqueues a whole
graph at once (:func:`enqueue_workflow`, read back with :func:`workflow_state`).
"""

from __future__ import annotations

from steeple.postgres.queue import admin, jobs
from steeple.postgres.queue._app import (
    PERIODIC_PREFIX,
    App,
    PeriodicJob,
    PeriodicReport,
    TaskFunction,
)
from steeple.postgres.queue._cluster import ClusterGuard
from steeple.postgres.queue._enqueue import enqueue, enqueue_many, enqueue_many_sync, enqueue_sync
from steeple.postgres.queue._ops import (
    Progress,
    TaskAttempt,
    TaskRun,
    cancel,
    prune_terminal,
    run_state,
)
from steeple.postgres.queue._queues import (
    QueueInfo,
    TaskLimits,
    limit_queue,
    limit_task,
    list_queues,
    pause_queue,
    resume_queue,
)
from steeple.postgres.queue._schema import (
    DEFAULT_SCHEMA,
    LIBRARY_SCHEMA_VERSION,
    check_schema,
    install,
    schema_version,
)
from steeple.postgres.queue._worker import Handler, Health, JobContext, Scheduler, WorkerStats
from steeple.postgres.queue._workflows import (
    ParentResult,
    Step,
    Workflow,
    WorkflowHandle,
    WorkflowState,
    WorkflowTask,
    enqueue_workflow,
    enqueue_workflow_sync,
    parent_results,
    workflow_state,
)
from steeple.postgres.queue.errors import (
    ArgsEncodingError,
    JobError,
    JobExistsError,
    JobNotFoundError,
    LeaseLostError,
    QueueClusterError,
    QueueConfigurationError,
    QueueDeadlineError,
    QueueError,
    QueueTypeError,
    QueueUnavailableError,
    ResultEncodingError,
    SchemaVersionMismatchError,
    TaskNotFoundError,
    TaskStateError,
    UnfitDatabaseError,
    UnknownTaskError,
    UnsupportedConnectionError,
    WorkflowCycleError,
)
from steeple.postgres.queue.tasks import EnqueuedTask, EnqueueOptions, RetryPolicy, Task

__all__ = [
    "DEFAULT_SCHEMA",
    "LIBRARY_SCHEMA_VERSION",
    "PERIODIC_PREFIX",
    "App",
    "ArgsEncodingError",
    "ClusterGuard",
    "EnqueueOptions",
    "EnqueuedTask",
    "Handler",
    "Health",
    "JobContext",
    "JobError",
    "JobExistsError",
    "JobNotFoundError",
    "LeaseLostError",
    "ParentResult",
    "PeriodicJob",
    "PeriodicReport",
    "Progress",
    "QueueClusterError",
    "QueueConfigurationError",
    "QueueDeadlineError",
    "QueueError",
    "QueueInfo",
    "QueueTypeError",
    "QueueUnavailableError",
    "ResultEncodingError",
    "RetryPolicy",
    "Scheduler",
    "SchemaVersionMismatchError",
    "Step",
    "Task",
    "TaskAttempt",
    "TaskFunction",
    "TaskLimits",
    "TaskNotFoundError",
    "TaskRun",
    "TaskStateError",
    "UnfitDatabaseError",
    "UnknownTaskError",
    "UnsupportedConnectionError",
    "WorkerStats",
    "Workflow",
    "WorkflowCycleError",
    "WorkflowHandle",
    "WorkflowState",
    "WorkflowTask",
    "admin",
    "cancel",
    "check_schema",
    "enqueue",
    "enqueue_many",
    "enqueue_many_sync",
    "enqueue_sync",
    "enqueue_workflow",
    "enqueue_workflow_sync",
    "install",
    "jobs",
    "limit_queue",
    "limit_task",
    "list_queues",
    "parent_results",
    "pause_queue",
    "prune_terminal",
    "resume_queue",
    "run_state",
    "schema_version",
    "workflow_state",
]
