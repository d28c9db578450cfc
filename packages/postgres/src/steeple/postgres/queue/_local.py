"""Where the queue's entry points hand work to a queue that is not a database connection.

The in-memory queue (:mod:`steeple.postgres.queue.testing`) subclasses :class:`LocalQueue`
and is passed where user code passes its connection: ``await task.enqueue(queue, args)``.
The enqueue functions check the task, options and args exactly as for a database (the same
JSON rule, the same option snapshot), then call :meth:`LocalQueue.store` with the encoded
args instead of running SQL; ``run_state`` and ``cancel`` check their arguments, then ask
it. Nothing here imports a driver.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from steeple.core.tasks import TaskState
from steeple.postgres.queue.errors import QueueConfigurationError
from steeple.postgres.queue.tasks import EnqueuedTask, EnqueueOptions, Task

if TYPE_CHECKING:
    from steeple.postgres.queue._ops import TaskRun

__all__ = ["LocalQueue", "local_queue"]


class LocalQueue(abc.ABC):
    """A queue held in this process, accepted by every enqueue function in place of ``conn``."""

    schema: str

    @abc.abstractmethod
    def store(self, task: Task[Any], args_text: str, options: EnqueueOptions) -> EnqueuedTask:
        """Store one checked task whose args are already encoded (``args_text``)."""

    @abc.abstractmethod
    def store_many(
        self, task: Task[Any], args_texts: Sequence[str], options: EnqueueOptions
    ) -> list[int]:
        """Store checked tasks (no dedup key) whose args are already encoded."""

    @abc.abstractmethod
    def run_state(self, task_id: int, *, history: int = 50) -> TaskRun:
        """Return a task as :func:`~steeple.postgres.queue.run_state` does."""

    @abc.abstractmethod
    def cancel(self, task_id: int) -> TaskState:
        """Cancel a task as :func:`~steeple.postgres.queue.cancel` does."""


def local_queue(conn: object, schema: str) -> LocalQueue | None:
    """Return ``conn`` if it is a :class:`LocalQueue` holding ``schema``'s tasks, else ``None``.

    Raises:
        QueueConfigurationError: a local queue of another schema (its tasks would go where
            no worker of this schema looks).
    """
    if not isinstance(conn, LocalQueue):
        return None
    if conn.schema != schema:
        raise QueueConfigurationError(
            f"this in-memory queue holds the tasks of schema {conn.schema!r}, not {schema!r}"
        )
    return conn
