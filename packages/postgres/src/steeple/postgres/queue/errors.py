"""The work queue's errors, rooted in :class:`steeple.core.errors.SteepleError`."""

from __future__ import annotations

from datetime import timedelta
from typing import Final

from steeple.core.errors import ClusterIdentityError, ConfigurationError, SteepleError
from steeple.core.workflows import WorkflowCycleError as _CoreCycleError

__all__ = [
    "MAX_RETRY_DELAY",
    "ArgsEncodingError",
    "JobError",
    "JobExistsError",
    "JobNotFoundError",
    "LeaseLostError",
    "QueueClusterError",
    "QueueConfigurationError",
    "QueueDeadlineError",
    "QueueError",
    "QueueTypeError",
    "QueueUnavailableError",
    "ResultEncodingError",
    "SchemaVersionMismatchError",
    "TaskNotFoundError",
    "TaskStateError",
    "UnfitDatabaseError",
    "UnknownTaskError",
    "UnsupportedConnectionError",
    "WorkflowCycleError",
]


MAX_RETRY_DELAY: Final = timedelta(days=366)
"""The longest delay between attempts: a backoff's maximum, or ``JobError.retry(delay=)``."""


class QueueError(SteepleError):
    """Base of the work queue's errors."""


class QueueConfigurationError(QueueError, ConfigurationError):
    """Invalid options, names or settings; nothing was stored."""


class WorkflowCycleError(QueueConfigurationError, _CoreCycleError):
    """A workflow's dependencies form a cycle; nothing was stored.

    Attributes:
        cycle: the positions (in the order the steps were added) of the steps on the cycle,
            the first repeated at the end.
    """

    def __init__(self, cycle: tuple[int, ...]) -> None:
        _CoreCycleError.__init__(self, cycle)


class QueueTypeError(QueueConfigurationError, TypeError):
    """A value of the wrong type was given; nothing was stored.

    Both a :class:`QueueConfigurationError` (a ``ValueError``) and a ``TypeError``, so
    either ``except`` catches it.
    """


class SchemaVersionMismatchError(QueueError):
    """The database's queue schema version differs from the one this library ships.

    Attributes:
        schema: the PostgreSQL schema that was checked.
        database_version: the version recorded there (0 when not installed).
        library_version: the version this library expects.
    """

    def __init__(self, schema: str, database_version: int, library_version: int) -> None:
        if database_version == 0:
            hint = "the queue schema is not installed; run install() (or `steeple migrate`)"
        elif database_version < library_version:
            hint = "the database is older than the library; run install() to migrate it"
        else:
            hint = "the database is newer than the library; upgrade steeple-postgres"
        super().__init__(
            f"queue schema {schema!r} is at version {database_version}, this library needs "
            f"version {library_version}: {hint}"
        )
        self.schema = schema
        self.database_version = database_version
        self.library_version = library_version


class QueueUnavailableError(QueueError, ConnectionError):
    """The database could not be reached or its connection was lost.

    Raised when a worker cannot start, and by every queue function run on a caller's
    connection when that connection is lost mid-call (terminated by an administrator, a
    server shutdown, a cut network). The driver's error is the ``__cause__``.
    """


class QueueClusterError(QueueUnavailableError, ClusterIdentityError):
    """The worker refused a new connection: another cluster, or a stale node after a failover.

    The node's system identifier differs from the one the worker first worked on, or its
    timeline is older than the newest the worker has seen (an old primary restarted after
    its standby was promoted). Nothing is claimed or finalized there; the worker logs it,
    backs off and tries again, like any lost connection (see
    :class:`~steeple.core.errors.ClusterIdentityError` for ``known`` and ``seen``).
    """


class QueueDeadlineError(QueueUnavailableError, TimeoutError):
    """The database did not answer in time.

    A lock wait passed ``lock_timeout``, a statement passed ``statement_timeout`` (or was
    cancelled), or no answer came before a deadline. The server rolled back a statement it
    cancelled; after a deadline with no answer the outcome of a write is unknown (read it
    back).
    """


class UnfitDatabaseError(QueueError):
    """The server or schema could lose acknowledged work, or cannot be written to.

    Raised when a worker starts (the checks name the setting), and by ``install`` and the
    ``enqueue`` functions when the server refuses the write (a read-only standby, a full
    disk); nothing was stored.

    Attributes:
        setting: what is at fault (``fsync``, ``synchronous_commit``, ``relpersistence``,
            ``pg_is_in_recovery``, ``default_transaction_read_only``...; for a refused write
            ``read_only``, ``disk_full`` or ``insufficient_resources``).
    """

    def __init__(self, message: str, *, setting: str) -> None:
        super().__init__(message)
        self.setting = setting


class TaskNotFoundError(QueueError, LookupError):
    """No task with that id (never existed, or pruned)."""

    def __init__(self, task_id: int) -> None:
        super().__init__(f"no task with id {task_id}")
        self.task_id = task_id


class TaskStateError(QueueError):
    """The task is not in a state the operation applies to (nothing was changed).

    Attributes:
        task_id: the task.
        state: its current state's value (``"pending"``, ``"succeeded"``...).
    """

    def __init__(self, task_id: int, state: str, message: str) -> None:
        super().__init__(message)
        self.task_id = task_id
        self.state = state


class JobNotFoundError(QueueError, LookupError):
    """No recurring job with that name."""

    def __init__(self, name: str) -> None:
        super().__init__(f"no recurring job named {name!r}")
        self.name = name


class JobExistsError(QueueError):
    """A recurring job with that name already exists (use ``ensure_job`` to declare)."""

    def __init__(self, name: str) -> None:
        super().__init__(f"a recurring job named {name!r} already exists")
        self.name = name


class LeaseLostError(QueueError):
    """The worker no longer holds the task's lease (expired, re-claimed or cancelled)."""


class ArgsEncodingError(QueueError, ValueError):
    """Task arguments that cannot be encoded to JSON, or stored JSON that cannot be decoded."""


class ResultEncodingError(QueueError, ValueError):
    """A handler returned a value that cannot be stored as the task's result.

    Not JSON-encodable (a set, an object, NaN, a cycle, a lone surrogate, a NUL...), not
    coming back equal (``-0.0``, a non-str object key), over 64 KiB of JSON as the database
    stores it, or refused by the database when written. The task fails with this error (its
    attempt history says which); the other outcomes written with it are not affected.
    """


class UnknownTaskError(QueueError, LookupError):
    """A task name with no registered handler, or a registration conflict."""


class UnsupportedConnectionError(QueueError, TypeError):
    """The connection object is not an asyncpg or psycopg connection."""


class JobError(QueueError):
    """Raised by a handler to say how its attempt failed.

    Build it with :meth:`retry` (run again after the task's snapshotted backoff, or after
    ``delay``, until ``max_attempts`` is used up), :meth:`permanent` or :meth:`msg` (fail
    for good, with a message). Any other exception from a handler is a permanent failure
    too, unless its task declares a :class:`~steeple.postgres.queue.RetryPolicy`.

    Attributes:
        retryable: whether the task should run again.
        delay: an explicit delay before the retry, overriding the backoff.
    """

    def __init__(self, message: str, *, retryable: bool, delay: timedelta | None = None) -> None:
        super().__init__(message)
        if delay is not None:
            if not isinstance(delay, timedelta):
                raise QueueTypeError(
                    f"a retry delay must be a timedelta or None, not {type(delay).__name__}"
                )
            if not timedelta(0) <= delay <= MAX_RETRY_DELAY:
                raise QueueConfigurationError(
                    f"a retry delay must be a timedelta of 0 .. {MAX_RETRY_DELAY.days} days"
                )
        self.message = message
        self.retryable = retryable
        self.delay = delay

    @classmethod
    def retry(cls, message: str, delay: timedelta | None = None) -> JobError:
        """Build a retryable failure: run again after ``delay`` or the task's backoff.

        Raises:
            QueueConfigurationError: a negative ``delay``, or one over 366 days.
            QueueTypeError: a ``delay`` that is not a timedelta.
        """
        return cls(message, retryable=True, delay=delay)

    @classmethod
    def permanent(cls, message: str) -> JobError:
        """Build a terminal failure: the task fails now, whatever attempts remain."""
        return cls(message, retryable=False)

    @classmethod
    def msg(cls, message: str) -> JobError:
        """Build a terminal failure from a message.

        Terminal like :meth:`permanent`, even when the task's retry policy retries other
        exceptions: raise it for a failure that running again cannot fix, and say why
        (the message is recorded on the task and its attempt history).
        """
        return cls(message, retryable=False)
