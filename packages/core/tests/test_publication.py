"""Classification of whatever a broker raises, and the relay error that reports it."""

from __future__ import annotations

import asyncio
import builtins
import inspect

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from steeple.core.errors import (
    BrokerConfigurationError,
    BrokerError,
    BrokerRejectedError,
    BrokerTimeoutError,
    BrokerUnavailableError,
    MessageTooLargeError,
    RecurringRelayError,
    RelayAcknowledgementError,
    RelayBrokerError,
    RelayBrokerTimeoutError,
    RelayLeaseLostError,
)
from steeple.core.messages import BrokerReceipt
from steeple.core.publication import (
    FailureKind,
    PublicationFailure,
    classify_publication_failure,
    publication_error,
)

RECEIPT = BrokerReceipt("memory", "stp1-key")


def _builtin_exceptions() -> list[type[Exception]]:
    found = []
    for value in vars(builtins).values():
        if inspect.isclass(value) and issubclass(value, Exception):
            try:
                value("boom")
            except TypeError:
                continue  # needs other constructor arguments
            found.append(value)
    return found


BUILTIN_EXCEPTIONS = _builtin_exceptions()
TYPED_BROKER_ERRORS: list[Exception] = [
    BrokerError("x"),
    BrokerUnavailableError("x"),
    BrokerTimeoutError("x"),
    BrokerRejectedError("x"),
    MessageTooLargeError("x"),
    BrokerConfigurationError("x"),
    RelayBrokerError("x"),
    RelayBrokerError("x", permanent=True),
    RelayBrokerTimeoutError("x"),
    RelayAcknowledgementError(RECEIPT),
    RelayLeaseLostError("x"),
]


def model(exc: BaseException) -> tuple[FailureKind, bool] | None:
    """Independent expectation of the classification."""
    if not isinstance(exc, Exception):
        return None
    if isinstance(exc, RelayAcknowledgementError):
        return FailureKind.ACKNOWLEDGEMENT, False
    typed = isinstance(exc, BrokerError | RelayBrokerError)
    permanent = typed and getattr(exc, "permanent", False) is True
    if isinstance(exc, TimeoutError):
        return FailureKind.TIMEOUT, permanent
    if typed:
        return (FailureKind.REJECTED if permanent else FailureKind.BROKER), permanent
    if isinstance(exc, ConnectionError):
        return FailureKind.BROKER, False
    return FailureKind.UNEXPECTED, False


exceptions = st.one_of(
    st.sampled_from(BUILTIN_EXCEPTIONS).map(lambda cls: cls("boom")),
    st.sampled_from(TYPED_BROKER_ERRORS),
)


@settings(max_examples=500, deadline=None)
@given(exceptions)
def test_every_exception_is_classified_as_the_model_says(exc: Exception) -> None:
    failure = classify_publication_failure(exc)
    assert failure is not None
    assert (failure.kind, failure.permanent) == model(exc)
    # Only the type is recorded: a broker's message may echo sealed content.
    assert failure.error == type(exc).__name__


@pytest.mark.parametrize(
    "exc",
    [
        TypeError("a topic of 100 x '€' is 300 bytes"),
        RuntimeError("the client exploded"),
        UnicodeEncodeError("utf-8", "\ud800", 0, 1, "surrogates not allowed"),
        ValueError("bad header"),
        KeyError("x"),
        AttributeError("publish"),
        ZeroDivisionError(),
        RecursionError(),
        MemoryError(),
    ],
    ids=lambda e: type(e).__name__,
)
def test_untyped_exceptions_are_retryable_unexpected_failures(exc: Exception) -> None:
    assert classify_publication_failure(exc) == PublicationFailure(
        FailureKind.UNEXPECTED, False, type(exc).__name__
    )


@pytest.mark.parametrize(
    "exc",
    [asyncio.CancelledError(), KeyboardInterrupt(), SystemExit(1), GeneratorExit()],
    ids=lambda e: type(e).__name__,
)
def test_cancellation_and_interpreter_exit_are_not_failures(exc: BaseException) -> None:
    assert classify_publication_failure(exc) is None


def test_typed_broker_errors_keep_their_meaning() -> None:
    assert classify_publication_failure(MessageTooLargeError("big")) == PublicationFailure(
        FailureKind.REJECTED, True, "MessageTooLargeError"
    )
    assert classify_publication_failure(BrokerTimeoutError("slow")) == PublicationFailure(
        FailureKind.TIMEOUT, False, "BrokerTimeoutError"
    )
    assert classify_publication_failure(TimeoutError()) == PublicationFailure(
        FailureKind.TIMEOUT, False, "TimeoutError"
    )
    assert classify_publication_failure(ConnectionResetError()) == PublicationFailure(
        FailureKind.BROKER, False, "ConnectionResetError"
    )


@pytest.mark.parametrize("odd", ["yes", 1, object(), None])
def test_an_odd_permanent_value_is_not_permanent(odd: object) -> None:
    exc = BrokerError("x")
    exc.permanent = odd  # type: ignore[assignment]
    failure = classify_publication_failure(exc)
    assert failure is not None
    assert not failure.permanent


def test_an_acknowledgement_error_is_reported_as_is() -> None:
    exc = RelayAcknowledgementError(RECEIPT)
    failure = classify_publication_failure(exc)
    assert failure is not None
    assert publication_error(failure, exc, "occ", "retry later") is exc


@settings(max_examples=300, deadline=None)
@given(exceptions)
def test_the_relay_error_is_typed_and_never_echoes_the_broker_message(exc: Exception) -> None:
    failure = classify_publication_failure(exc)
    assert failure is not None
    error = publication_error(failure, exc, "0123abcd", "dead letter (permanent)")
    assert isinstance(error, RecurringRelayError)
    if failure.kind is FailureKind.ACKNOWLEDGEMENT:
        assert error is exc
        return
    assert isinstance(error, RelayBrokerError)
    assert error.permanent == failure.permanent
    assert isinstance(error, TimeoutError) == (failure.kind is FailureKind.TIMEOUT)
    assert "0123abcd" in str(error)
    assert "dead letter (permanent)" in str(error)
    assert "boom" not in str(error)


def test_an_adapters_error_that_never_said_permanent_is_retried() -> None:
    class Odd(RelayBrokerError):
        def __init__(self) -> None:
            Exception.__init__(self, "odd")  # skips RelayBrokerError's own __init__

    failure = classify_publication_failure(Odd())
    assert failure is not None
    assert not failure.permanent


def test_the_relay_error_names_the_occurrence_the_failure_and_the_outcome() -> None:
    failure = PublicationFailure(FailureKind.BROKER, True, "ConnectionError")
    error = publication_error(failure, ConnectionError("x"), "ab12", "dead letter (permanent)")
    assert type(error) is RelayBrokerError
    assert error.permanent
    assert str(error) == (
        "publication of occurrence ab12 failed (ConnectionError); dead letter (permanent)"
    )
    long = PublicationFailure(FailureKind.BROKER, False, "E" * 500)
    shortened = str(publication_error(long, ConnectionError(), "ab12", "o" * 1000))
    assert f"({'E' * 197}...); {'o' * 297}..." in shortened


def test_only_an_acknowledgement_error_is_returned_as_is() -> None:
    # A failure classified as an acknowledgement but raised as something else still
    # becomes a relay error, and an acknowledgement error classified otherwise too.
    odd = PublicationFailure(FailureKind.ACKNOWLEDGEMENT, False, "ConnectionError")
    assert isinstance(publication_error(odd, ConnectionError(), "ab12", "retry"), RelayBrokerError)
    uncertain = RelayAcknowledgementError(RECEIPT)
    broker = PublicationFailure(FailureKind.BROKER, False, "RelayAcknowledgementError")
    assert publication_error(broker, uncertain, "ab12", "retry") is not uncertain


def test_a_report_of_something_that_is_not_a_failure_says_what_it_got() -> None:
    with pytest.raises(TypeError, match=r"^failure must be a PublicationFailure, not 'broker'$"):
        publication_error("broker", ConnectionError(), "ab12", "retry")  # type: ignore[arg-type]


def test_a_permanent_timeout_is_reported_as_a_permanent_timeout() -> None:
    failure = PublicationFailure(FailureKind.TIMEOUT, True, "BrokerTimeoutError")
    error = publication_error(failure, TimeoutError(), "ab12", "dead letter (permanent)")
    assert type(error) is RelayBrokerTimeoutError
    assert error.permanent
    assert str(error) == (
        "publication of occurrence ab12 did not complete in time (BrokerTimeoutError); "
        "dead letter (permanent)"
    )
