"""What is recorded of a failed attempt: the exception's type, message and traceback, bounded.

Only what the handler's exception itself says is kept (its type, ``str()`` and the
traceback's frames and source lines, no local variables), with the worker's own connection
secrets masked (a handler that fails with its DSN in the message must not store or log the
password: the failure is shown by the admin dashboard, its API and the CLI), made storable
(NUL and lone surrogates escaped) and bounded in UTF-8 bytes, cut at character boundaries.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Iterable, Mapping
from typing import Any, Final

import attrs

from steeple.core.dsn import MASK, dsn_secrets
from steeple.core.tasks import FailureVerdict
from steeple.postgres.queue._validate import storable_text

__all__ = [
    "MAX_ERROR_TEXT",
    "MAX_TRACEBACK_BYTES",
    "Failure",
    "bounded_utf8",
    "connection_secrets",
    "describe",
    "log_failure",
    "noted",
    "scrub_secrets",
    "summary",
    "verdict_note",
]

MAX_ERROR_TEXT: Final = 2000
"""The most characters of the ``"Type: message"`` summary kept (``last_error``, ``error``)."""
MAX_TRACEBACK_BYTES: Final = 16 * 1024
"""The most UTF-8 bytes of a traceback kept: its start and its end, the middle elided."""
_MAX_TYPE_NAME: Final = 200
_ELIDED: Final = "\n... [{} bytes of the traceback elided] ...\n"


@attrs.frozen
class Failure:
    """One failed attempt as recorded.

    Attributes:
        summary: ``"Type: message"`` (at most 2000 characters).
        error_type: the exception's class, module-qualified unless a builtin.
        traceback: the formatted traceback (chained causes included), at most 16 KiB.
    """

    summary: str
    error_type: str
    traceback: str


def bounded_utf8(text: str, limit: int) -> str:
    """Return ``text`` if its UTF-8 form fits ``limit`` bytes, else its start and end.

    The cut falls between characters (never inside a multi-byte sequence), and a marker
    says how many bytes were left out; the result's UTF-8 form is at most ``limit`` bytes.
    ``text`` must be encodable (see :func:`storable_text`).
    """
    data = text.encode("utf-8")
    if len(data) <= limit:
        return text
    marker_room = len(_ELIDED.format(len(data)).encode("utf-8"))
    room = max(limit - marker_room, 0)
    # The end of a traceback (the innermost frames, the exception) matters most.
    head_room = room // 4
    head = data[:head_room].decode("utf-8", "ignore")
    tail = data[len(data) - (room - head_room) :].decode("utf-8", "ignore")
    elided = len(data) - len(head.encode("utf-8")) - len(tail.encode("utf-8"))
    return head + _ELIDED.format(elided) + tail


def connection_secrets(source: object) -> tuple[str, ...]:
    """Every secret a worker's connection source holds, longest first (for :func:`scrub_secrets`).

    ``source`` is a DSN (either libpq form: see :func:`steeple.core.dsn.dsn_secrets`), an
    asyncpg pool (its DSN and ``password`` connect arguments) or a psycopg_pool pool (its
    ``conninfo`` and ``password`` keyword). Anything else holds none. Never raises.
    """
    found: set[str] = set()
    dsns: list[object] = []
    passwords: list[object] = []
    if isinstance(source, str):
        dsns.append(source)
    else:
        # asyncpg's Pool keeps what it connects with in these (create_pool(dsn, **kwargs)).
        args = getattr(source, "_connect_args", None)
        kwargs = getattr(source, "_connect_kwargs", None)
        # psycopg_pool's AsyncConnectionPool: conninfo (either libpq form) and kwargs.
        conninfo = getattr(source, "conninfo", None)
        pool_kwargs = getattr(source, "kwargs", None)
        if isinstance(args, tuple | list):
            dsns.extend(args)
        for extra in (kwargs, pool_kwargs):
            if isinstance(extra, Mapping):
                dsns.append(extra.get("dsn"))
                dsns.append(extra.get("conninfo"))
                passwords.append(extra.get("password"))
        dsns.append(conninfo)
    for dsn in dsns:
        found.update(dsn_secrets(dsn))
    found.update(p for p in passwords if isinstance(p, str) and p)
    return tuple(sorted(found, key=len, reverse=True))


def scrub_secrets(text: str, secrets: Iterable[str]) -> str:
    """Return ``text`` with every one of ``secrets`` (longest first) masked."""
    for secret in secrets:
        if secret:
            text = text.replace(secret, MASK)
    return text


def _type_name(exc: BaseException) -> str:
    kind = type(exc)
    module = getattr(kind, "__module__", None)
    name = getattr(kind, "__qualname__", None) or kind.__name__
    text = name if module in (None, "builtins") else f"{module}.{name}"
    return storable_text(str(text))[:_MAX_TYPE_NAME]


def _message(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception:  # a handler's exception whose __str__ fails is still a failure
        return "<the exception's message could not be read>"


def _traceback(exc: BaseException, secrets: tuple[str, ...]) -> str:
    try:
        text = "".join(traceback.format_exception(exc))
    except Exception:  # __str__ failing again, a broken __traceback__...
        text = f"{type(exc).__name__} (its traceback could not be formatted)"
    # Masked before the cut: a secret split by the elision would escape the mask.
    return bounded_utf8(storable_text(scrub_secrets(text, secrets)), MAX_TRACEBACK_BYTES)


def summary(exc: BaseException, secrets: Iterable[str] = ()) -> str:
    """Return ``"Type: message"`` for ``exc``: ``secrets`` masked, bounded, storable."""
    text = scrub_secrets(f"{type(exc).__name__}: {_message(exc)}", secrets)
    if len(text) > MAX_ERROR_TEXT:
        text = text[: MAX_ERROR_TEXT - 3] + "..."
    # Handlers' messages may hold NUL or lone surrogates, which PostgreSQL text cannot.
    return storable_text(text)


_UNEXPECTED_NOTE: Final = (
    "not retried (plain exceptions are terminal: raise JobError.retry(...) or give the "
    "task a RetryPolicy to retry them)"
)


def verdict_note(verdict: FailureVerdict, attempt: int, max_attempts: int) -> str | None:
    """Return what a failed task's recorded error starts with to say why it was not retried.

    ``None`` when the failure speaks for itself: the task runs again, or the handler gave
    its own verdict (``JobError.permanent``, args or a result that cannot be used).
    """
    if verdict is FailureVerdict.EXHAUSTED:
        return f"attempts exhausted ({attempt}/{max_attempts})"
    if verdict is FailureVerdict.UNEXPECTED:
        return _UNEXPECTED_NOTE
    return None


def noted(failure: Failure, note: str | None) -> Failure:
    """Return ``failure`` with ``note`` before its summary (kept within its bound)."""
    if note is None:
        return failure
    text = f"{note}: {failure.summary}"
    if len(text) > MAX_ERROR_TEXT:
        text = text[: MAX_ERROR_TEXT - 3] + "..."
    return attrs.evolve(failure, summary=text)


def describe(exc: BaseException, secrets: Iterable[str] = ()) -> Failure:
    """Return what is recorded of ``exc``, a handler's exception, with ``secrets`` masked.

    ``secrets`` are the worker's own (see :func:`connection_secrets`): they are masked in
    the summary and the traceback (chained causes included) before either is bounded.
    """
    hidden = tuple(secrets)
    return Failure(
        summary=summary(exc, hidden),
        error_type=_type_name(exc),
        traceback=_traceback(exc, hidden),
    )


def log_failure(
    logger: logging.Logger,
    level: int,
    message: str,
    args: tuple[object, ...],
    failure: Failure,
    *,
    with_traceback: bool,
    extra: Mapping[str, Any],
) -> None:
    """Log a failed attempt with the recorded (scrubbed) traceback, never the live exception.

    A record's ``exc_info`` would be formatted by the handler from the exception itself,
    secrets included; the record carries the scrubbed text as ``exc_text`` instead, which
    :class:`logging.Formatter` prints where it prints a traceback.
    """
    if not logger.isEnabledFor(level):
        return
    try:
        path, line, function, _ = logger.findCaller(stacklevel=2)
    except ValueError:
        path, line, function = "(unknown file)", 0, "(unknown function)"
    record = logger.makeRecord(
        logger.name, level, path, line, message, args, None, function, dict(extra)
    )
    if with_traceback:
        record.exc_text = failure.traceback.rstrip("\n")
    logger.handle(record)
