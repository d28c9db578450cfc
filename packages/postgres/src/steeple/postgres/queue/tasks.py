"""Task definitions (a stable name tied to an args type) and enqueue options."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, Final, Generic, TypeVar, cast

import attrs

from steeple.core.backoff import Backoff
from steeple.postgres.queue._json import storable_json
from steeple.postgres.queue._validate import (
    DEFAULT_QUEUE,
    INT32,
    check_int,
    check_name,
    check_queue,
    check_text,
    check_timedelta,
)
from steeple.postgres.queue.errors import (
    MAX_RETRY_DELAY,
    ArgsEncodingError,
    QueueConfigurationError,
    QueueTypeError,
)

__all__ = [
    "MAX_ARGS_BYTES",
    "MAX_DELAY",
    "MAX_RETRY_DELAY",
    "EnqueueOptions",
    "EnqueuedTask",
    "RetryPolicy",
    "Task",
]

A = TypeVar("A")

MAX_ARGS_BYTES: Final = 1024 * 1024
"""Encoded task arguments are limited to 1 MiB of JSON (as the database stores it)."""
MAX_TASK_LEASE: Final = timedelta(hours=24)
MAX_DELAY: Final = timedelta(days=36_500)
"""The longest ``EnqueueOptions.after`` delay (about 100 years)."""


def _check_name(name: object, what: str) -> str:
    return check_name(name, what)


def _check_policy_attempts(_i: object, _a: object, value: Any) -> None:
    check_int(value, "RetryPolicy max_attempts", 1, 10_000)


def _check_policy_delay(_i: object, attribute: Any, value: Any) -> None:
    check_timedelta(
        value, f"RetryPolicy {attribute.name}", timedelta(microseconds=1), MAX_RETRY_DELAY
    )


def _check_policy_factor(_i: object, _a: object, value: Any) -> None:
    check_int(value, "RetryPolicy factor", 1, 1000)


def _check_policy_jitter(_i: object, _a: object, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise QueueTypeError(f"RetryPolicy jitter must be a number, not {type(value).__name__}")
    if not 0.0 <= value <= 1.0:  # NaN fails both comparisons
        raise QueueConfigurationError(
            f"RetryPolicy jitter must be a number within [0, 1], got {value!r}"
        )


@attrs.frozen(kw_only=True)
class RetryPolicy:
    """Opt-in retries of a task's plain exceptions, with exponential backoff.

    By default only ``JobError.retry(...)`` runs a task again: any other
    exception fails it for good. A task declared with a policy (``Task(..., retry=)`` or
    ``@app.task(retry=)``) treats every exception but ``JobError.permanent``/``JobError.msg``
    as retryable, and its enqueues snapshot the policy's attempts and backoff (unless the
    :class:`EnqueueOptions` of an enqueue set them).

    The delay before retry ``n`` is ``base_delay * factor**(n-1)``, capped at ``max_delay``,
    minus up to ``jitter`` of it at random (so failing tasks do not retry in lockstep).

    Attributes:
        max_attempts: attempts in all, the first included (1..10000; 1 never retries).
        base_delay: the delay before the first retry (a positive timedelta).
        max_delay: the longest delay (``base_delay`` .. 366 days).
        factor: the growth between retries (an int, 1..1000; 1 keeps the delay constant).
        jitter: the fraction of each delay taken off at random, within [0, 1].

    Raises:
        QueueConfigurationError: a value out of range (NaN jitter included), or
            ``max_delay`` below ``base_delay``.
        QueueTypeError: a value of the wrong type.
    """

    max_attempts: int = attrs.field(default=5, validator=_check_policy_attempts)
    base_delay: timedelta = attrs.field(default=timedelta(seconds=1), validator=_check_policy_delay)
    max_delay: timedelta = attrs.field(default=timedelta(minutes=5), validator=_check_policy_delay)
    factor: int = attrs.field(default=2, validator=_check_policy_factor)
    jitter: float = attrs.field(default=0.0, validator=_check_policy_jitter)

    def __attrs_post_init__(self) -> None:
        if self.max_delay < self.base_delay:
            raise QueueConfigurationError(
                f"RetryPolicy max_delay ({self.max_delay}) must be at least base_delay "
                f"({self.base_delay})"
            )

    @property
    def backoff(self) -> Backoff:
        """The policy's delays as the :class:`~steeple.core.backoff.Backoff` a task snapshots."""
        return Backoff(
            initial=self.base_delay,
            maximum=self.max_delay,
            factor=self.factor,
            jitter=float(self.jitter),
        )


def _check_task_attempts(_i: object, _a: object, value: Any) -> None:
    if value is not None:
        check_int(value, "max_attempts", 1, 10_000)


def _check_retry(_i: object, _a: object, value: Any) -> None:
    if value is not None and not isinstance(value, RetryPolicy):
        raise QueueTypeError(f"retry must be a RetryPolicy or None, not {type(value).__name__}")


@attrs.frozen
class Task(Generic[A]):
    """A kind of work: a stable name shared by producers and the worker, and its args type.

    ``args_type`` may be an attrs class, a dataclass (flat: fields are JSON values), or
    ``None`` for plain JSON values (dicts, lists, strings, numbers, booleans, null).
    ``retry`` (keyword) makes the handler's plain exceptions retryable (see
    :class:`RetryPolicy`); without it only ``JobError.retry`` retries. ``max_attempts``
    (keyword, 1..10000) is the attempt limit its enqueues snapshot when their options
    leave it unset (without either: 5).

    Raises:
        QueueConfigurationError: an empty or too long name, or one with a control character
            or lone surrogate.
        QueueTypeError: a name that is not a str; an args type that is neither an attrs
            class nor a dataclass; a ``retry`` that is not a RetryPolicy; a
            ``max_attempts`` that is not an int.
    """

    name: str
    args_type: type[A] | None = None
    retry: RetryPolicy | None = attrs.field(default=None, kw_only=True, validator=_check_retry)
    max_attempts: int | None = attrs.field(
        default=None, kw_only=True, validator=_check_task_attempts
    )

    def __attrs_post_init__(self) -> None:
        _check_name(self.name, "task name")
        retry = self.retry
        if (
            retry is not None
            and self.max_attempts is not None
            and retry.max_attempts != self.max_attempts
        ):
            raise QueueConfigurationError(
                f"task {self.name!r}: max_attempts={self.max_attempts} differs from its "
                f"retry policy's max_attempts={retry.max_attempts}; give it once"
            )
        kind = self.args_type
        if kind is not None and not (
            isinstance(kind, type) and (attrs.has(kind) or dataclasses.is_dataclass(kind))
        ):
            raise QueueTypeError(
                "args_type must be an attrs class, a dataclass or None, not "
                f"{type(kind).__name__ if not isinstance(kind, type) else kind.__name__}"
            )

    def encode(self, args: A) -> str:
        """Encode ``args`` to the JSON text stored on the task.

        What the handler receives is equal to ``args`` (numbers keep their value and type;
        tuples arrive as lists), or the args are refused.

        Raises:
            ArgsEncodingError: wrong type, a value JSON cannot represent (NaN, infinity, an
                int with more than 4300 digits, a cycle, a lone surrogate, a NUL), one that
                would not come back equal (``-0.0``, a non-str object key), nesting too
                deep, or over 1 MiB as stored.
        """
        kind = self.args_type
        value: Any = args
        if kind is not None:
            if not isinstance(args, kind):
                raise ArgsEncodingError(
                    f"task {self.name!r} takes {kind.__name__} args, not {type(args).__name__}"
                )
            try:
                value = (
                    attrs.asdict(cast(Any, args), recurse=True)
                    if attrs.has(kind)
                    else dataclasses.asdict(cast(Any, args))
                )
            except RecursionError:
                raise ArgsEncodingError(
                    f"args of task {self.name!r} nest too deeply to encode"
                ) from None
        return storable_json(
            value,
            ArgsEncodingError,
            f"the args of task {self.name!r}",
            MAX_ARGS_BYTES,
            "pass JSON values (dict, list, str, int, float, bool, None)",
        )

    def encode_all(self, args_list: Sequence[A]) -> str:
        """Encode a batch of args as one JSON array text (``enqueue_many``).

        Each element is what :meth:`encode` stores for its args. The batch goes through the
        checks once, as one value (one pass of the C encoder instead of one call per args).
        When that refuses it (one args is refused, or the whole is over the size limit of
        one args), each is checked alone, which names the one refused or joins the texts
        that pass: the outcome is the same either way.

        Raises:
            ArgsEncodingError: as :meth:`encode`, for the first args refused.
        """
        kind = self.args_type
        values: list[Any] | None = None
        if kind is None:
            values = list(args_list)
        elif all(isinstance(args, kind) for args in args_list):
            try:
                values = [
                    attrs.asdict(cast(Any, args), recurse=True)
                    if attrs.has(kind)
                    else dataclasses.asdict(cast(Any, args))
                    for args in args_list
                ]
            except RecursionError:
                values = None
        if values is not None:
            try:
                return storable_json(values, ArgsEncodingError, "", MAX_ARGS_BYTES, "")
            except ArgsEncodingError:
                pass  # checked one by one below: that names the args refused, and why
        return "[" + ", ".join([self.encode(args) for args in args_list]) + "]"

    def decode(self, text: str) -> A:
        """Decode stored JSON text back to the args type.

        Raises:
            ArgsEncodingError: malformed JSON, or fields that do not fit the args type.
        """
        try:
            value = json.loads(text)
        except RecursionError:
            raise ArgsEncodingError(
                f"stored args of task {self.name!r} nest too deeply to decode"
            ) from None
        except (TypeError, ValueError) as exc:
            raise ArgsEncodingError(
                f"stored args of task {self.name!r} are not JSON: {exc}"
            ) from None
        kind = self.args_type
        if kind is None:
            return cast(A, value)
        if not isinstance(value, dict):
            raise ArgsEncodingError(
                f"stored args of task {self.name!r} are not an object for {kind.__name__}"
            )
        try:
            return kind(**value)
        except (TypeError, ValueError) as exc:
            raise ArgsEncodingError(
                f"stored args of task {self.name!r} do not fit {kind.__name__}: {exc}"
            ) from None


def _check_priority(_i: object, _a: object, value: Any) -> None:
    check_int(value, "priority", -INT32, INT32)


def _check_lease(_i: object, _a: object, value: Any) -> None:
    check_timedelta(value, "lease_duration", timedelta(milliseconds=100), MAX_TASK_LEASE)


def _check_attempts(_i: object, _a: object, value: Any) -> None:
    if value is not None:
        check_int(value, "max_attempts", 1, 10_000)


def _to_utc(value: Any) -> Any:
    """Check ``run_at`` and hold it in UTC (as drivers send it); ``None`` means now."""
    if value is None:
        return None
    if not isinstance(value, datetime):
        raise QueueTypeError(
            f"run_at must be an aware datetime or None, not {type(value).__name__}"
        )
    try:
        offset = value.utcoffset()
    except (ValueError, TypeError, OverflowError):
        offset = None
    if value.tzinfo is None or offset is None:
        raise QueueConfigurationError(
            "run_at must be timezone-aware (naive datetimes are refused): use "
            "datetime(..., tzinfo=UTC)"
        )
    try:
        return value.astimezone(UTC)
    except OverflowError:
        raise QueueConfigurationError("run_at is out of range once converted to UTC") from None


def _check_delay(_i: object, _a: object, value: Any) -> None:
    if value is not None:
        check_timedelta(value, "delay", timedelta(0), MAX_DELAY)


def _check_dedup(_i: object, _a: object, value: Any) -> None:
    if value is not None:
        check_text(value, "dedup_key")


def _check_limit_key(_i: object, _a: object, value: Any) -> None:
    if value is not None:
        check_text(value, "limit_key")


def _check_backoff(_i: object, _a: object, value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, Backoff):
        raise QueueTypeError(
            f"backoff must be a steeple.core.backoff.Backoff or None, not {type(value).__name__}"
        )
    # Backoff checks its own shape; the queue stores microseconds as bigint and the factor
    # as integer, and a retry must land on a representable instant.
    if value.maximum > MAX_RETRY_DELAY:
        raise QueueConfigurationError(
            f"backoff maximum must be at most {MAX_RETRY_DELAY.days} days, got {value.maximum}"
        )
    check_int(value.factor, "backoff factor", 1, INT32)


_DEFAULT_ATTEMPTS: Final = 5
_DEFAULT_BACKOFF: Final = Backoff()


def _check_queue(_i: object, _a: object, value: Any) -> None:
    check_queue(value)


_OPTION_NAMES: Final = frozenset(
    {"priority", "lease_duration", "max_attempts", "backoff", "dedup_key", "queue", "limit_key"}
)


@attrs.frozen(kw_only=True)
class EnqueueOptions:
    """How and when one task runs; copied onto the task row when it is created.

    When it runs is judged by the database server's clock: ``run_at`` is an instant on it,
    ``delay`` counts from the server's time when the task is inserted (so a producer whose
    own clock is wrong still gets the delay it asked for).

    Attributes:
        run_at: when it becomes due (aware; held in UTC); ``None`` means now.
        delay: due this long after it is inserted, by the server's clock (0 .. ~100 years);
            exclusive with ``run_at``.
        priority: higher runs first among due tasks (32-bit int, default 0).
        lease_duration: how long a worker holds it between renewals (100 ms .. 24 h).
        max_attempts: attempts before a retryable failure becomes final (1..10000);
            ``None``: the task's :class:`RetryPolicy`'s, else 5.
        backoff: delay policy between retries (maximum at most 366 days); ``None``: the
            task's :class:`RetryPolicy`'s, else ``Backoff()`` (1 s doubling to 5 min).
        dedup_key: at most one live (pending or running) task per task name and key.
        queue: the named queue it waits in (1-200 chars, default ``"default"``); workers
            serve the queues they are given (see :class:`Scheduler`).
        limit_key: the key its queue's and its task name's per-key limits count it under
            (a customer, a tenant: 1-200 chars, no control characters); ``None``: no
            per-key limit applies to it (see :func:`limit_queue`).

    Raises:
        QueueConfigurationError: any value out of range; a naive ``run_at``; both
            ``run_at`` and ``delay``.
        QueueTypeError: a value of the wrong type.
    """

    run_at: datetime | None = attrs.field(default=None, converter=_to_utc)
    delay: timedelta | None = attrs.field(default=None, validator=_check_delay)
    priority: int = attrs.field(default=0, validator=_check_priority)
    lease_duration: timedelta = attrs.field(default=timedelta(seconds=60), validator=_check_lease)
    max_attempts: int | None = attrs.field(default=None, validator=_check_attempts)
    backoff: Backoff | None = attrs.field(default=None, validator=_check_backoff)
    dedup_key: str | None = attrs.field(default=None, validator=_check_dedup)
    queue: str = attrs.field(default=DEFAULT_QUEUE, validator=_check_queue)
    limit_key: str | None = attrs.field(default=None, validator=_check_limit_key)

    def __attrs_post_init__(self) -> None:
        if self.run_at is not None and self.delay is not None:
            raise QueueConfigurationError("give run_at or delay, not both")

    @classmethod
    def _build(cls, options: dict[str, Any], **when: Any) -> EnqueueOptions:
        unknown = sorted(set(options) - _OPTION_NAMES)
        if unknown:
            raise QueueTypeError(
                f"unknown enqueue options {unknown}; expected some of {sorted(_OPTION_NAMES)}"
            )
        return cls(**when, **options)

    @classmethod
    def immediate(cls, **options: Any) -> EnqueueOptions:
        """Options for work that is due now (other options as keywords).

        Raises:
            QueueConfigurationError: an option out of range.
            QueueTypeError: an unknown option, or a value of the wrong type.
        """
        return cls._build(options)

    @classmethod
    def at(cls, when: datetime, /, **options: Any) -> EnqueueOptions:
        """Options for delayed work due at the aware instant ``when`` (server clock).

        Raises:
            QueueConfigurationError: ``when`` is naive, or an option out of range.
            QueueTypeError: ``when`` is not a datetime, an unknown option, a wrong type.
        """
        if not isinstance(when, datetime):
            raise QueueTypeError(f"at() needs an aware datetime, not {type(when).__name__}")
        return cls._build(options, run_at=when)

    @classmethod
    def after(cls, delay: timedelta, /, **options: Any) -> EnqueueOptions:
        """Options for work due ``delay`` after it is inserted, by the server's clock.

        Raises:
            QueueConfigurationError: a negative or too long ``delay``, an option out of range.
            QueueTypeError: ``delay`` is not a timedelta, an unknown option, a wrong type.
        """
        check_timedelta(delay, "delay", timedelta(0), MAX_DELAY)
        return cls._build(options, delay=delay)

    def snapshot(self, task: object = None) -> tuple[int, int, timedelta, int, int, int, float]:
        """(priority, max_attempts, lease, backoff initial us, max us, factor, jitter).

        What these options leave unset (``None``) comes from ``task`` (a :class:`Task` or
        a function declared with ``@app.task``: its ``max_attempts``, its ``retry``
        policy), else the defaults (5 attempts, ``Backoff()``).

        Raises:
            QueueTypeError: ``task`` is neither ``None``, a Task nor an ``@app.task`` function.
        """
        if task is not None:
            task = declared_task(task)[0]
        retry = None if task is None else task.retry
        if self.max_attempts is not None:
            max_attempts = self.max_attempts
        elif task is not None and task.max_attempts is not None:
            max_attempts = task.max_attempts
        else:
            max_attempts = _DEFAULT_ATTEMPTS if retry is None else retry.max_attempts
        if self.backoff is not None:
            b = self.backoff
        else:
            b = _DEFAULT_BACKOFF if retry is None else retry.backoff
        return (
            self.priority,
            max_attempts,
            self.lease_duration,
            b.initial // timedelta(microseconds=1),
            b.maximum // timedelta(microseconds=1),
            b.factor,
            float(b.jitter),
        )


@attrs.frozen
class EnqueuedTask:
    """The outcome of an enqueue: the task id, and whether a live duplicate was returned."""

    id: int
    deduplicated: bool = False


def declared_task(task: object) -> tuple[Task[Any], str | None]:
    """Return the :class:`Task` behind ``task`` and the queue it was declared in, if any.

    ``task`` is a :class:`Task` (no declared queue) or a function declared with
    ``@app.task`` (a ``TaskFunction``: its task and its ``queue=``).

    Raises:
        QueueTypeError: anything else.
    """
    if isinstance(task, Task):
        return task, None
    # The decorator API is built on this module: import it only when it is in use.
    from steeple.postgres.queue._app import TaskFunction

    if isinstance(task, TaskFunction):
        return task.task, task.queue
    raise QueueTypeError(
        f"task must be a steeple Task or an @app.task function, not {type(task).__name__}"
    )


def with_declared_queue(options: EnqueueOptions, declared: str | None) -> EnqueueOptions:
    """Send ``options`` to a task's declared queue unless they name another than the default."""
    if declared is None or options.queue != DEFAULT_QUEUE or declared == DEFAULT_QUEUE:
        return options
    return attrs.evolve(options, queue=declared)
