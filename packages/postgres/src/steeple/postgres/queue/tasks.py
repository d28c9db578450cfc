"""Task definitions (a stable name tied to an args type) and enqueue options."""

from __future__ import annotations

import dataclasses
import json
import re
from datetime import datetime, timedelta
from typing import Any, Final, Generic, TypeVar, cast

import attrs

from steeple.core.backoff import Backoff
from steeple.core.limits import MAX_NAME_LENGTH
from steeple.postgres.queue.errors import ArgsEncodingError, QueueConfigurationError

__all__ = ["MAX_ARGS_BYTES", "EnqueueOptions", "EnqueuedTask", "Task"]

A = TypeVar("A")

MAX_ARGS_BYTES: Final = 1024 * 1024
"""Encoded task arguments are limited to 1 MiB of JSON."""
_INT32 = 2**31 - 1
# An escaped NUL (an odd run of backslashes before u0000): PostgreSQL's jsonb refuses it.
_JSON_NUL: Final = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")
MAX_TASK_LEASE: Final = timedelta(hours=24)


def _check_name(name: object, what: str) -> str:
    if not isinstance(name, str) or not 1 <= len(name) <= MAX_NAME_LENGTH:
        raise QueueConfigurationError(f"{what} must be a str of 1..{MAX_NAME_LENGTH} characters")
    if any(ord(ch) < 32 or ord(ch) == 127 for ch in name):
        raise QueueConfigurationError(f"{what} must not contain control characters")
    return name


@attrs.frozen
class Task(Generic[A]):
    """A kind of work: a stable name shared by producers and the worker, and its args type.

    ``args_type`` may be an attrs class, a dataclass (flat: fields are JSON values), or
    ``None`` for plain JSON values (dicts, lists, strings, numbers, booleans, null).

    Raises:
        QueueConfigurationError: empty, too long or control-character name; an args type
            that is neither attrs nor a dataclass.
    """

    name: str
    args_type: type[A] | None = None

    def __attrs_post_init__(self) -> None:
        _check_name(self.name, "task name")
        kind = self.args_type
        if kind is not None and not (attrs.has(kind) or dataclasses.is_dataclass(kind)):
            raise QueueConfigurationError(
                f"args_type must be an attrs class, a dataclass or None, not {kind!r}"
            )

    def encode(self, args: A) -> str:
        """Encode ``args`` to the JSON text stored on the task.

        Raises:
            ArgsEncodingError: wrong type, or a value JSON cannot represent, or over 1 MiB.
        """
        kind = self.args_type
        value: Any = args
        if kind is not None:
            if not isinstance(args, kind):
                raise ArgsEncodingError(
                    f"task {self.name!r} takes {kind.__name__} args, not {type(args).__name__}"
                )
            value = (
                attrs.asdict(cast(Any, args), recurse=True)
                if attrs.has(kind)
                else dataclasses.asdict(cast(Any, args))
            )
        try:
            text = json.dumps(value, separators=(",", ":"), allow_nan=False, ensure_ascii=False)
        except (TypeError, ValueError) as exc:
            raise ArgsEncodingError(
                f"args of task {self.name!r} cannot be encoded as JSON: {exc}"
            ) from None
        if "\\u0000" in text and _JSON_NUL.search(text):
            raise ArgsEncodingError(f"args of task {self.name!r} contain a NUL character")
        if len(text.encode("utf-8")) > MAX_ARGS_BYTES:
            raise ArgsEncodingError(
                f"args of task {self.name!r} exceed {MAX_ARGS_BYTES} bytes of JSON"
            )
        return text

    def decode(self, text: str) -> A:
        """Decode stored JSON text back to the args type.

        Raises:
            ArgsEncodingError: malformed JSON, or fields that do not fit the args type.
        """
        try:
            value = json.loads(text)
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
    if isinstance(value, bool) or not isinstance(value, int) or not -_INT32 <= value <= _INT32:
        raise QueueConfigurationError("priority must be an int within 32 bits")


def _check_lease(_i: object, _a: object, value: Any) -> None:
    if not isinstance(value, timedelta) or not (
        timedelta(milliseconds=100) <= value <= MAX_TASK_LEASE
    ):
        raise QueueConfigurationError("lease_duration must be a timedelta of 100 ms .. 24 h")


def _check_attempts(_i: object, _a: object, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 10_000:
        raise QueueConfigurationError("max_attempts must be an int of 1..10000")


def _check_run_at(_i: object, _a: object, value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, datetime):
        raise QueueConfigurationError("run_at must be a datetime or None")
    if value.tzinfo is None or value.utcoffset() is None:
        raise QueueConfigurationError("run_at must be timezone-aware (naive datetimes are refused)")


def _check_dedup(_i: object, _a: object, value: Any) -> None:
    if value is not None:
        _check_name(value, "dedup_key")


def _check_backoff(_i: object, _a: object, value: Any) -> None:
    if not isinstance(value, Backoff):
        raise QueueConfigurationError("backoff must be a steeple.core.backoff.Backoff")


@attrs.frozen(kw_only=True)
class EnqueueOptions:
    """How and when one task runs; copied onto the task row when it is created.

    Attributes:
        run_at: when it becomes due (aware); ``None`` means now.
        priority: higher runs first among due tasks (32-bit int, default 0).
        lease_duration: how long a worker holds it between renewals (100 ms .. 24 h).
        max_attempts: attempts before a retryable failure becomes final (1..10000).
        backoff: delay policy between retries.
        dedup_key: at most one live (pending or running) task per task name and key.

    Raises:
        QueueConfigurationError: any value out of range; a naive ``run_at``.
    """

    run_at: datetime | None = attrs.field(default=None, validator=_check_run_at)
    priority: int = attrs.field(default=0, validator=_check_priority)
    lease_duration: timedelta = attrs.field(default=timedelta(seconds=60), validator=_check_lease)
    max_attempts: int = attrs.field(default=5, validator=_check_attempts)
    backoff: Backoff = attrs.field(factory=Backoff, validator=_check_backoff)
    dedup_key: str | None = attrs.field(default=None, validator=_check_dedup)

    @classmethod
    def immediate(cls, **options: Any) -> EnqueueOptions:
        """Options for work that is due now (other options as keywords)."""
        return cls(run_at=None, **options)

    @classmethod
    def at(cls, when: datetime, **options: Any) -> EnqueueOptions:
        """Options for delayed work due at the aware instant ``when``.

        Raises:
            QueueConfigurationError: ``when`` is naive or not a datetime.
        """
        if when is None:
            raise QueueConfigurationError("at() needs a datetime")
        return cls(run_at=when, **options)

    def snapshot(self) -> tuple[int, int, timedelta, int, int, int, float]:
        """(priority, max_attempts, lease, backoff initial us, max us, factor, jitter)."""
        b = self.backoff
        return (
            self.priority,
            self.max_attempts,
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
