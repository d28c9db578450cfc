"""How a failed publication is classified, and the relay error that reports it.

A broker adapter may raise anything: the typed broker errors, a relay error, a driver's
exception it let escape, or a plain ``TypeError`` from a bug. :func:`classify_publication_failure`
turns every :class:`Exception` into a :class:`PublicationFailure` the engine can record
(retry with backoff, or dead letter), so nothing a broker does can leave an occurrence
leased or kill a relay loop. Exceptions that are not :class:`Exception` (cancellation,
``KeyboardInterrupt``, ``SystemExit``) are not failures of the publication: they propagate.
"""

from __future__ import annotations

import enum

import attrs

from steeple.core._validate import TypedEnumType, plain, shown
from steeple.core.errors import (
    BrokerError,
    ConfigurationTypeError,
    RecurringRelayError,
    RelayAcknowledgementError,
    RelayBrokerError,
    RelayBrokerTimeoutError,
)

__all__ = [
    "FailureKind",
    "PublicationFailure",
    "classify_publication_failure",
    "publication_error",
]

_MAX_ERROR = 200


class FailureKind(enum.Enum, metaclass=TypedEnumType):
    """What went wrong with a publication."""

    ACKNOWLEDGEMENT = "acknowledgement"
    """The broker accepted the message but its acknowledgement is uncertain."""
    REJECTED = "rejected"
    """The broker refused the message for good (permanent)."""
    TIMEOUT = "timeout"
    """No answer within the deadline (the broker may have accepted)."""
    BROKER = "broker"
    """A broker or connection failure; another attempt may succeed."""
    UNEXPECTED = "unexpected"
    """An exception the broker adapter did not type (a bug or an escaped driver error);
    retried like a broker failure, dead after the attempt limit."""


@attrs.frozen
class PublicationFailure:
    """A classified publication failure.

    Attributes:
        kind: what went wrong.
        permanent: retrying cannot help: the occurrence is dead at once.
        error: what the store records as the occurrence's last error: the exception's
            type name only (a broker's message may echo the topic or headers, which are
            sealed content).
    """

    kind: FailureKind
    permanent: bool
    error: str


def _permanent(exc: BaseException) -> bool:
    # ``is True``: an adapter's odd ``permanent`` value never makes a failure permanent.
    return getattr(exc, "permanent", False) is True


def classify_publication_failure(exc: BaseException) -> PublicationFailure | None:
    """Classify what ``MessageBroker.publish`` raised; ``None`` means "let it propagate".

    - :class:`RelayAcknowledgementError`: accepted, acknowledgement uncertain (retryable).
    - :class:`BrokerError` / :class:`RelayBrokerError`: permanent when the error says so;
      a timeout when it is also a :class:`TimeoutError`.
    - :class:`TimeoutError` (the relay's own deadline included): a retryable timeout.
    - :class:`ConnectionError`: a retryable broker failure.
    - any other :class:`Exception`: a retryable unexpected failure.
    - anything that is not an :class:`Exception` (``asyncio.CancelledError``,
      ``KeyboardInterrupt``, ``SystemExit``): ``None``.
    """
    if not isinstance(exc, Exception):
        return None
    error = type(exc).__name__[:_MAX_ERROR]
    if isinstance(exc, RelayAcknowledgementError):
        return PublicationFailure(FailureKind.ACKNOWLEDGEMENT, False, error)
    if isinstance(exc, BrokerError | RelayBrokerError):
        permanent = _permanent(exc)
        if isinstance(exc, TimeoutError):
            kind = FailureKind.TIMEOUT
        else:
            kind = FailureKind.REJECTED if permanent else FailureKind.BROKER
        return PublicationFailure(kind, permanent, error)
    if isinstance(exc, TimeoutError):
        return PublicationFailure(FailureKind.TIMEOUT, False, error)
    if isinstance(exc, ConnectionError):
        return PublicationFailure(FailureKind.BROKER, False, error)
    return PublicationFailure(FailureKind.UNEXPECTED, False, error)


def publication_error(
    failure: PublicationFailure, exc: BaseException, occurrence_id: str, outcome: str
) -> RecurringRelayError:
    """Return the relay error that reports ``failure`` (raise it ``from exc``).

    An acknowledgement error is returned as is: it carries the broker's receipt.

    Args:
        failure: the classification of ``exc``.
        exc: what the broker raised.
        occurrence_id: the occurrence whose publication failed.
        outcome: what the store recorded ("retry after ...", "dead letter (...)").

    Raises:
        ConfigurationTypeError: ``failure`` is not a :class:`PublicationFailure`.
    """
    if not isinstance(failure, PublicationFailure):
        raise ConfigurationTypeError(f"failure must be a PublicationFailure, not {shown(failure)}")
    # Shown safely: an id or outcome a caller got wrong must not make the report fail.
    occurrence_id, outcome = plain(occurrence_id), plain(outcome, 300)
    error = plain(failure.error, _MAX_ERROR)
    if failure.kind is FailureKind.ACKNOWLEDGEMENT and isinstance(exc, RelayAcknowledgementError):
        return exc
    if failure.kind is FailureKind.TIMEOUT:
        return RelayBrokerTimeoutError(
            f"publication of occurrence {occurrence_id} did not complete in time "
            f"({error}); {outcome}",
            permanent=failure.permanent,
        )
    return RelayBrokerError(
        f"publication of occurrence {occurrence_id} failed ({error}); {outcome}",
        permanent=failure.permanent,
    )
