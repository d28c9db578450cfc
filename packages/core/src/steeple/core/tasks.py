"""The work-queue task lifecycle: ONE transition table, a pure ``transition()``, retry decisions."""

from __future__ import annotations

import enum
import re
import warnings
from collections.abc import Mapping
from datetime import datetime
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Final

import attrs

from steeple.core._validate import TypedEnumType, aware_utc, shown, unit_float
from steeple.core.backoff import Backoff
from steeple.core.errors import ConfigurationError, ConfigurationTypeError, InvalidTransitionError

__all__ = [
    "MAX_TASK_ID",
    "TASK_TRANSITIONS",
    "TERMINAL_TASK_STATES",
    "FailureOutcome",
    "FailureVerdict",
    "RetryDecision",
    "TaskEvent",
    "TaskFailureKind",
    "TaskState",
    "attempts_exhausted",
    "attempts_outlook",
    "check_task_id",
    "failure_outcome",
    "lease_expiry_event",
    "parse_task_cursor",
    "retry_decision",
    "transition",
]


class TaskState(enum.Enum, metaclass=TypedEnumType):
    """Where a queued task is in its life."""

    WAITING = "waiting"
    """It waits for the tasks it was enqueued ``after`` (a workflow); no claim takes it."""
    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


class TaskEvent(enum.Enum, metaclass=TypedEnumType):
    """What can happen to a task (inputs of the state table)."""

    CLAIM = "claim"
    """A worker claimed it and holds a token-fenced lease."""
    SUCCEED = "succeed"
    """The handler returned."""
    FAIL_RETRYABLE = "fail_retryable"
    """The handler failed and attempts remain: back to pending, run again later."""
    FAIL_PERMANENT = "fail_permanent"
    """The handler failed for good, or attempts are used up."""
    LEASE_EXPIRED = "lease_expired"
    """The worker died or stalled past its lease with attempts left: recovered to pending."""
    LEASE_EXPIRED_FINAL = "lease_expired_final"
    """The lease lapsed on the last allowed attempt: the task fails for good, so a task
    that kills (or stalls) every worker running it stops being retried."""
    RELEASE = "release"
    """Its worker handed it back unfinished at shutdown (the attempt is refunded)."""
    CANCEL = "cancel"
    """An operator or the application cancelled it."""
    DEPENDENCIES_MET = "dependencies_met"
    """The last task it waited for finished as its dependency policy asks (succeeded, or
    ended in any way for a task that runs anyway): it becomes claimable."""
    DEPENDENCY_FAILED = "dependency_failed"
    """A task it waited for failed for good or was cancelled, and it runs only after
    successes (the default): it is cancelled, and so, transitively, are its dependents."""
    RETRY = "retry"
    """An operator sent a failed task back to pending, to run again (it keeps its id and
    ``run_id``; the store grants at least one more attempt)."""


_S = TaskState
_E = TaskEvent

TASK_TRANSITIONS: Final[Mapping[tuple[TaskState, TaskEvent], TaskState]] = MappingProxyType(
    {
        (_S.WAITING, _E.DEPENDENCIES_MET): _S.PENDING,
        (_S.WAITING, _E.DEPENDENCY_FAILED): _S.CANCELLED,
        (_S.WAITING, _E.CANCEL): _S.CANCELLED,
        (_S.PENDING, _E.CLAIM): _S.RUNNING,
        (_S.PENDING, _E.CANCEL): _S.CANCELLED,
        (_S.RUNNING, _E.SUCCEED): _S.SUCCEEDED,
        # The store sets run_at from retry_decision(); the state itself returns to pending.
        (_S.RUNNING, _E.FAIL_RETRYABLE): _S.PENDING,
        (_S.RUNNING, _E.FAIL_PERMANENT): _S.FAILED,
        (_S.RUNNING, _E.LEASE_EXPIRED): _S.PENDING,
        (_S.RUNNING, _E.LEASE_EXPIRED_FINAL): _S.FAILED,
        (_S.RUNNING, _E.RELEASE): _S.PENDING,
        (_S.RUNNING, _E.CANCEL): _S.CANCELLED,
        # Only an operator's retry leaves a terminal state, and only a failed one: a task
        # that succeeded or was cancelled is done for good.
        (_S.FAILED, _E.RETRY): _S.PENDING,
    }
)
"""The whole task lifecycle: ``(state, event) -> next state``."""

TERMINAL_TASK_STATES: Final[frozenset[TaskState]] = frozenset(
    {_S.SUCCEEDED, _S.FAILED, _S.CANCELLED}
)
"""States in which a task is finished: it has a ``finished_at`` and ``prune_terminal`` may
remove it. Nothing moves a task out of them but an operator's ``RETRY`` of a failed one."""


def transition(state: TaskState, event: TaskEvent) -> TaskState:
    """Return the state that ``event`` moves a task in ``state`` to.

    Raises:
        InvalidTransitionError: ``(state, event)`` is not in the table (including values
            that are not a :class:`TaskState` / :class:`TaskEvent`).
    """
    # Only members are looked up: hashing a foreign object could fail in any way.
    if isinstance(state, TaskState) and isinstance(event, TaskEvent):
        found = TASK_TRANSITIONS.get((state, event))
        if found is not None:
            return found
    raise InvalidTransitionError("task", state, event)


@attrs.frozen
class RetryDecision:
    """What to do after a retryable handler failure.

    Attributes:
        retry: whether the task runs again (``FAIL_RETRYABLE``) or fails for good.
        run_at: when it runs again; ``None`` when it does not.
    """

    retry: bool
    run_at: datetime | None

    @property
    def event(self) -> TaskEvent:
        """The table event this decision amounts to."""
        return TaskEvent.FAIL_RETRYABLE if self.retry else TaskEvent.FAIL_PERMANENT


def _positive_int(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigurationTypeError(f"{what} must be an int, not {type(value).__name__}")
    if value < 1:
        raise ConfigurationError(f"{what} must be at least 1; got {shown(value)}")
    return value


def attempts_exhausted(attempt: int, max_attempts: int) -> bool:
    """Whether attempt number ``attempt`` (1-based) was the last one ``max_attempts`` allows.

    Raises:
        ConfigurationError: ``attempt`` or ``max_attempts`` is not a positive int
            (a ``ConfigurationTypeError`` when it is not an int at all).
    """
    return _positive_int(attempt, "attempt") >= _positive_int(max_attempts, "max_attempts")


def lease_expiry_event(attempt: int, max_attempts: int) -> TaskEvent:
    """Return the event an expired lease of a task on attempt ``attempt`` amounts to.

    ``LEASE_EXPIRED`` (back to pending, run again) while attempts remain;
    ``LEASE_EXPIRED_FINAL`` (failed for good) once :func:`attempts_exhausted`.

    Raises:
        ConfigurationError: ``attempt`` or ``max_attempts`` is not a positive int
            (a ``ConfigurationTypeError`` when it is not an int at all).
    """
    if attempts_exhausted(attempt, max_attempts):
        return TaskEvent.LEASE_EXPIRED_FINAL
    return TaskEvent.LEASE_EXPIRED


def retry_decision(
    attempt: int, max_attempts: int, backoff: Backoff, now: datetime, draw: float = 0.0
) -> RetryDecision:
    """Decide whether a task that failed retryably runs again, and when.

    A retryable failure with attempts used up becomes a permanent one.

    Args:
        attempt: how many attempts have run, the failed one included (1-based).
        max_attempts: the task's snapshotted attempt limit (>= 1).
        backoff: the task's snapshotted backoff policy.
        now: the current instant (aware).
        draw: a random float in [0, 1) for jitter, injected by the caller.

    Raises:
        ConfigurationError: ``attempt`` or ``max_attempts`` is not a positive int,
            ``backoff`` is not a :class:`Backoff`, or ``draw`` is NaN, infinite or not a
            number.
        ConfigurationError: ``now`` is naive (a ``ValueError``).
        ConfigurationTypeError: ``now`` is not a datetime (a ``TypeError``).
    """
    exhausted = attempts_exhausted(attempt, max_attempts)
    if not isinstance(backoff, Backoff):
        raise ConfigurationTypeError(f"backoff must be a Backoff, not {type(backoff).__name__}")
    draw = unit_float(draw, "draw")
    instant = aware_utc(now, "now")
    if exhausted:
        return RetryDecision(retry=False, run_at=None)
    delay = backoff.delay(attempt, draw)
    try:
        run_at = instant + delay
    except OverflowError:
        # A cap of centuries past year 9999: "never sooner than the end of time".
        run_at = datetime.max.replace(tzinfo=instant.tzinfo)
    return RetryDecision(retry=True, run_at=run_at)


class TaskFailureKind(enum.Enum, metaclass=TypedEnumType):
    """What a failed attempt was, as the worker saw it (the input of :func:`failure_outcome`).

    Not to be confused with :class:`steeple.core.publication.FailureKind`, what went wrong
    with a recurring publication.
    """

    RETRY_ASKED = "retry_asked"
    """The handler asked to run again (``JobError.retry``)."""
    VERDICT = "verdict"
    """Running again cannot help: the handler said so (``JobError.permanent``), or its
    stored args no longer decode, or its result cannot be stored."""
    UNEXPECTED = "unexpected"
    """Any other exception the handler raised."""


class FailureVerdict(enum.Enum, metaclass=TypedEnumType):
    """What becomes of a task after a failed attempt, and why."""

    RETRIED = "retried"
    """It runs again later."""
    EXHAUSTED = "exhausted"
    """It would have run again, but that was its last allowed attempt."""
    VERDICT = "verdict"
    """It failed for good: running again cannot help (the handler's own verdict)."""
    UNEXPECTED = "unexpected"
    """It failed for good: an unexpected exception, and its task retries none."""


@attrs.frozen
class FailureOutcome:
    """The decision taken on a failed attempt.

    Attributes:
        verdict: whether it runs again, and if not why.
        run_at: when it runs again (``None`` unless ``verdict`` is ``RETRIED``).
    """

    verdict: FailureVerdict
    run_at: datetime | None

    @property
    def retry(self) -> bool:
        """Whether the task runs again."""
        return self.verdict is FailureVerdict.RETRIED

    @property
    def event(self) -> TaskEvent:
        """The table event this decision amounts to."""
        return TaskEvent.FAIL_RETRYABLE if self.retry else TaskEvent.FAIL_PERMANENT


def failure_outcome(
    kind: TaskFailureKind,
    *,
    retries_unexpected: bool,
    attempt: int,
    max_attempts: int,
    backoff: Backoff,
    now: datetime,
    draw: float = 0.0,
) -> FailureOutcome:
    """Decide what becomes of a task whose attempt failed: run again (when), or fail, and why.

    An unexpected exception fails the task for good unless its task retries them (a retry
    policy); a retry asked for, or allowed, runs again until the attempts are used up.

    Args:
        kind: what the failure was.
        retries_unexpected: whether the task retries unexpected exceptions.
        attempt: how many attempts have run, the failed one included (1-based).
        max_attempts: the task's snapshotted attempt limit (>= 1).
        backoff: the task's snapshotted backoff policy.
        now: the current instant (aware).
        draw: a random float in [0, 1) for jitter, injected by the caller.

    Raises:
        ConfigurationError: as :func:`retry_decision`.
        ConfigurationTypeError: ``kind`` is not a :class:`TaskFailureKind`; as
            :func:`retry_decision`.
    """
    if not isinstance(kind, TaskFailureKind):
        raise ConfigurationTypeError(f"kind must be a TaskFailureKind, not {type(kind).__name__}")
    if kind is TaskFailureKind.VERDICT:
        return FailureOutcome(FailureVerdict.VERDICT, None)
    if kind is TaskFailureKind.UNEXPECTED and not retries_unexpected:
        return FailureOutcome(FailureVerdict.UNEXPECTED, None)
    decision = retry_decision(attempt, max_attempts, backoff, now, draw)
    if decision.retry:
        return FailureOutcome(FailureVerdict.RETRIED, decision.run_at)
    return FailureOutcome(FailureVerdict.EXHAUSTED, None)


def attempts_outlook(state: TaskState, attempts: int, max_attempts: int) -> str:
    """How a task's attempts read to an operator: ``n/max`` only while retries can happen.

    A live task (pending, running) that may still be retried reads ``"1/5"``; a failed
    one says whether it was retried until its attempts were used up (``"5/5, attempts
    exhausted"``) or failed at once (``"1, not retried"``: its failure was terminal, so
    the four attempts it had left never come). A task that succeeded or was cancelled,
    or that allows one attempt only, reads as the count.

    Raises:
        ConfigurationError: ``attempts`` is negative or ``max_attempts`` is not a positive
            int (a ``ConfigurationTypeError`` when not an int at all).
        ConfigurationTypeError: ``state`` is not a :class:`TaskState`.
    """
    if not isinstance(state, TaskState):
        raise ConfigurationTypeError(f"state must be a TaskState, not {type(state).__name__}")
    limit = _positive_int(max_attempts, "max_attempts")
    if isinstance(attempts, bool) or not isinstance(attempts, int):
        raise ConfigurationTypeError(f"attempts must be an int, not {type(attempts).__name__}")
    if attempts < 0:
        raise ConfigurationError(f"attempts must be at least 0; got {shown(attempts)}")
    count = attempts
    if state is TaskState.FAILED:
        if limit > 1 and count >= limit:
            return f"{count}/{limit}, attempts exhausted"
        return f"{count}, not retried"
    if state in (TaskState.PENDING, TaskState.RUNNING) and limit > 1:
        return f"{count}/{limit}"
    if state in (TaskState.PENDING, TaskState.RUNNING):
        return f"{count}, no retries"
    return str(count)


# --- task ids ------------------------------------------------------------------------------

MAX_TASK_ID: Final = 2**63 - 1
"""Task ids are PostgreSQL bigints, handed out from 1: 1 .. 2**63 - 1."""
_DIGITS: Final = re.compile(r"[0-9]{1,19}\Z")


def check_task_id(
    value: object,
    *,
    what: str = "a task id",
    error: type[ValueError] = ConfigurationError,
    type_error: type[ValueError] | None = None,
) -> int:
    """Return ``value`` if it is a task id: an int (not a bool) in 1 .. :data:`MAX_TASK_ID`.

    The one rule for every task id the library takes (the queue's operations, its in-memory
    double, workflows' parents, the dashboard and the CLI). ``error`` and ``type_error`` are
    the caller's typed errors, as for :func:`~steeple.core.names.check_name`.

    Raises:
        type_error: not an int (default: ``error``, or
            :class:`~steeple.core.errors.ConfigurationTypeError` for a plain
            ``ConfigurationError``).
        error: out of range (0, negative, beyond a bigint).
    """
    if isinstance(value, bool) or not isinstance(value, int):
        kind = type_error or (ConfigurationTypeError if error is ConfigurationError else error)
        raise kind(f"{what} is a whole number from 1 to {MAX_TASK_ID}, not {type(value).__name__}")
    if not 1 <= value <= MAX_TASK_ID:
        raise error(f"{what} is a whole number from 1 to {MAX_TASK_ID}")
    return value


def parse_task_cursor(
    after: object,
    *,
    error: type[ValueError] = ConfigurationError,
    type_error: type[ValueError] | None = None,
) -> int:
    """Return the task id a listing cursor names (``0``, before every task, for ``None``).

    A task listing's cursor is the decimal id of the last task on the previous page (its
    ``next_cursor``). ``error`` and ``type_error`` as for :func:`check_task_id`.

    Raises:
        type_error: neither ``None`` nor a str.
        error: not 1-19 ASCII digits up to :data:`MAX_TASK_ID`.
    """
    if after is None:
        return 0
    if not isinstance(after, str):
        kind = type_error or (ConfigurationTypeError if error is ConfigurationError else error)
        raise kind(
            "the cursor of a task listing is a task id in decimal (a str), "
            f"not {type(after).__name__}"
        )
    if not _DIGITS.match(after) or int(after) > MAX_TASK_ID:
        raise error("the cursor of a task listing is a task id in decimal (its next_cursor)")
    return int(after)


# The name this enum had before: still importable, with a DeprecationWarning, so that code
# written against it keeps working for a release. Static tools see a plain alias.
if TYPE_CHECKING:
    FailureKind = TaskFailureKind
else:

    def __getattr__(name: str) -> Any:
        if name == "FailureKind":
            warnings.warn(
                "steeple.core.tasks.FailureKind is deprecated: import TaskFailureKind",
                DeprecationWarning,
                stacklevel=2,
            )
            return TaskFailureKind
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
