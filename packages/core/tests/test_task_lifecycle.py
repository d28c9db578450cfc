"""The task lifecycle table and retry decisions, checked against independent expectations."""

from __future__ import annotations

import itertools
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from steeple.core import Backoff, ConfigurationError, InvalidTransitionError, tasks
from steeple.core.errors import ConfigurationTypeError
from steeple.core.publication import FailureKind as PublicationFailureKind
from steeple.core.tasks import (
    TASK_TRANSITIONS,
    TERMINAL_TASK_STATES,
    FailureVerdict,
    RetryDecision,
    TaskEvent,
    TaskFailureKind,
    TaskState,
    attempts_exhausted,
    attempts_outlook,
    failure_outcome,
    lease_expiry_event,
    retry_decision,
    transition,
)


def expected(state: str, event: str) -> str | None:
    """CORE_API.md's task table written as branches (shares nothing with the module)."""
    if state == "waiting":  # a task enqueued after others (a workflow)
        return {
            "dependencies_met": "pending",
            "dependency_failed": "cancelled",
            "cancel": "cancelled",
        }.get(event)
    if state == "pending":
        return {"claim": "running", "cancel": "cancelled"}.get(event)
    if state == "running":
        return {
            "succeed": "succeeded",
            "fail_retryable": "pending",
            "fail_permanent": "failed",
            "lease_expired": "pending",
            "lease_expired_final": "failed",
            "release": "pending",
            "cancel": "cancelled",
        }.get(event)
    if state == "failed":
        return {"retry": "pending"}.get(event)  # an operator's retry (issue 14)
    return None  # succeeded and cancelled accept nothing


def _check(state: TaskState, event: TaskEvent) -> None:
    want = expected(state.value, event.value)
    if want is None:
        with pytest.raises(InvalidTransitionError) as info:
            transition(state, event)
        assert info.value.lifecycle == "task"
        assert info.value.state is state
        assert info.value.event is event
    else:
        assert transition(state, event).value == want


def test_enums_are_exactly_the_contract() -> None:
    assert [s.value for s in TaskState] == [
        "waiting",
        "pending",
        "running",
        "succeeded",
        "failed",
        "cancelled",
    ]
    assert [e.name for e in TaskEvent] == [
        "CLAIM",
        "SUCCEED",
        "FAIL_RETRYABLE",
        "FAIL_PERMANENT",
        "LEASE_EXPIRED",
        "LEASE_EXPIRED_FINAL",
        "RELEASE",
        "CANCEL",
        "DEPENDENCIES_MET",
        "DEPENDENCY_FAILED",
        "RETRY",
    ]


@pytest.mark.parametrize(("state", "event"), list(itertools.product(TaskState, TaskEvent)))
def test_every_pair_exhaustively(state: TaskState, event: TaskEvent) -> None:
    _check(state, event)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(TaskState), st.sampled_from(TaskEvent))
def test_every_pair_property(state: TaskState, event: TaskEvent) -> None:
    _check(state, event)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(TaskState), st.lists(st.sampled_from(TaskEvent), max_size=30))
def test_sequences_and_unchanged_state_on_rejection(
    start: TaskState, events: list[TaskEvent]
) -> None:
    state, model = start, start.value
    for event in events:
        want = expected(model, event.value)
        if want is None:
            with pytest.raises(InvalidTransitionError):
                transition(state, event)
        else:
            state, model = transition(state, event), want
        assert state.value == model


def test_table_rows_and_terminal_states() -> None:
    rows = {(s.value, e.value) for s, e in TASK_TRANSITIONS}
    assert rows == {
        (s.value, e.value)
        for s, e in itertools.product(TaskState, TaskEvent)
        if expected(s.value, e.value) is not None
    }
    assert {s.value for s in TERMINAL_TASK_STATES} == {"succeeded", "failed", "cancelled"}
    # Terminal states accept nothing but an operator's retry of a failed task.
    assert {
        s
        for s in TaskState
        if all(expected(s.value, e.value) is None for e in TaskEvent if e is not TaskEvent.RETRY)
    } == TERMINAL_TASK_STATES
    assert {s for (s, e) in TASK_TRANSITIONS if e is TaskEvent.RETRY} == {TaskState.FAILED}
    with pytest.raises(TypeError):
        TASK_TRANSITIONS[(TaskState.FAILED, TaskEvent.CLAIM)] = TaskState.RUNNING  # type: ignore[index]


def test_non_members_rejected() -> None:
    with pytest.raises(InvalidTransitionError):
        transition("pending", TaskEvent.CLAIM)  # type: ignore[arg-type]
    with pytest.raises(InvalidTransitionError):
        transition(TaskState.PENDING, {})  # type: ignore[arg-type]


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 10**12), st.integers(1, 10**12))
def test_lease_expiry_event_model(attempt: int, max_attempts: int) -> None:
    # Independent model: the last allowed attempt fails for good; earlier ones run again.
    last = attempt >= max_attempts
    assert attempts_exhausted(attempt, max_attempts) is last
    event = lease_expiry_event(attempt, max_attempts)
    assert event is (TaskEvent.LEASE_EXPIRED_FINAL if last else TaskEvent.LEASE_EXPIRED)
    assert transition(TaskState.RUNNING, event).value == ("failed" if last else "pending")
    # Expiry and a retryable handler failure agree on when attempts are used up.
    assert retry_decision(attempt, max_attempts, BACKOFF, NOW).retry is not last


def test_lease_expiry_event_edges() -> None:
    assert lease_expiry_event(1, 1) is TaskEvent.LEASE_EXPIRED_FINAL
    assert lease_expiry_event(1, 2) is TaskEvent.LEASE_EXPIRED
    assert lease_expiry_event(2, 2) is TaskEvent.LEASE_EXPIRED_FINAL
    # A row whose attempt limit was lowered below its attempts: exhausted, not an error.
    assert lease_expiry_event(5, 2) is TaskEvent.LEASE_EXPIRED_FINAL


@pytest.mark.parametrize(
    ("attempt", "max_attempts"), [(0, 3), (-1, 3), (1, 0), (True, 3), (1.5, 3), (1, "3")]
)
def test_lease_expiry_event_rejects_bad_counts(attempt: object, max_attempts: object) -> None:
    with pytest.raises(ConfigurationError):
        lease_expiry_event(attempt, max_attempts)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError):
        attempts_exhausted(attempt, max_attempts)  # type: ignore[arg-type]


def test_every_move_out_of_running_is_one_of_the_outcomes_a_store_writes() -> None:
    # Each event a store records for a running task has exactly one row: nothing a worker
    # or a recovery writes is left to the store to decide.
    outcomes = {e for (s, e) in TASK_TRANSITIONS if s is TaskState.RUNNING}
    waiting_only = {TaskEvent.DEPENDENCIES_MET, TaskEvent.DEPENDENCY_FAILED}
    assert outcomes == set(TaskEvent) - {TaskEvent.CLAIM, TaskEvent.RETRY} - waiting_only


def test_only_the_end_of_the_tasks_it_waits_for_moves_a_waiting_task() -> None:
    moves = {e: t for (s, e), t in TASK_TRANSITIONS.items() if s is TaskState.WAITING}
    assert moves == {
        TaskEvent.DEPENDENCIES_MET: TaskState.PENDING,
        TaskEvent.DEPENDENCY_FAILED: TaskState.CANCELLED,
        TaskEvent.CANCEL: TaskState.CANCELLED,
    }
    # Nothing leads into waiting: a task is enqueued in it, never returned to it.
    assert TaskState.WAITING not in TASK_TRANSITIONS.values()


NOW = datetime(2031, 7, 9, 10, 11, 12, 345000, tzinfo=UTC)
BACKOFF = Backoff(initial=timedelta(seconds=2), maximum=timedelta(minutes=10), factor=3)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 10**9), st.integers(1, 10**9), st.floats(0, 1, exclude_max=True))
def test_retry_decision_model(attempt: int, max_attempts: int, draw: float) -> None:
    decision = retry_decision(attempt, max_attempts, BACKOFF, NOW, draw)
    if attempt >= max_attempts:
        assert decision == RetryDecision(retry=False, run_at=None)
        assert decision.event is TaskEvent.FAIL_PERMANENT
    else:
        # Independent model: 2 s * 3**(attempt-1), capped at 600 s, no jitter configured.
        seconds = 600 if attempt > 7 else min(600, 2 * 3 ** (attempt - 1))
        assert decision == RetryDecision(retry=True, run_at=NOW + timedelta(seconds=seconds))
        assert decision.event is TaskEvent.FAIL_RETRYABLE


def test_retry_decision_retryable_becomes_permanent_at_the_limit() -> None:
    assert retry_decision(2, 3, BACKOFF, NOW).retry is True
    assert retry_decision(3, 3, BACKOFF, NOW) == RetryDecision(False, None)
    assert retry_decision(1, 1, BACKOFF, NOW).retry is False


def test_retry_decision_jitter_uses_the_injected_draw() -> None:
    jittery = Backoff(initial=timedelta(seconds=10), maximum=timedelta(seconds=10), jitter=0.5)
    assert retry_decision(1, 5, jittery, NOW, 0.0).run_at == NOW + timedelta(seconds=10)
    assert retry_decision(1, 5, jittery, NOW, 0.5).run_at == NOW + timedelta(seconds=7.5)


def test_retry_decision_huge_attempt_is_fast_and_capped() -> None:
    started = time.perf_counter()
    decision = retry_decision(10**9, 10**9 + 1, BACKOFF, NOW)
    assert time.perf_counter() - started < 0.1
    assert decision.run_at == NOW + timedelta(minutes=10)


def test_retry_decision_overflowing_cap_saturates() -> None:
    huge = Backoff(initial=timedelta(days=1), maximum=timedelta(days=999_999_999))
    late = datetime(9999, 1, 1, tzinfo=UTC)
    decision = retry_decision(60, 100, huge, late)
    assert decision.retry is True
    assert decision.run_at == datetime.max.replace(tzinfo=UTC)


@pytest.mark.parametrize(
    ("attempt", "max_attempts"), [(0, 3), (-1, 3), (1, 0), (True, 3), (1.5, 3), (1, "3")]
)
def test_retry_decision_rejects_bad_counts(attempt: object, max_attempts: object) -> None:
    with pytest.raises(ConfigurationError):
        retry_decision(attempt, max_attempts, BACKOFF, NOW)  # type: ignore[arg-type]


def test_retry_decision_rejects_naive_now() -> None:
    with pytest.raises(ValueError, match="timezone-aware"):
        retry_decision(1, 3, BACKOFF, datetime(2030, 1, 1))
    with pytest.raises(TypeError):
        retry_decision(1, 3, BACKOFF, "2030-01-01")  # type: ignore[arg-type]


def test_retry_decision_normalizes_to_utc() -> None:
    from datetime import timezone

    eastern = NOW.astimezone(timezone(timedelta(hours=-5)))
    decision = retry_decision(1, 3, BACKOFF, eastern)
    assert decision.run_at == NOW + timedelta(seconds=2)
    assert decision.run_at is not None
    assert decision.run_at.utcoffset() == timedelta(0)


# --- what becomes of a failed attempt, and how its attempts read ------------------------------

_NOW = datetime(2031, 3, 4, 5, 6, 7, tzinfo=UTC)


@pytest.mark.parametrize(
    ("kind", "retries_unexpected", "attempt", "max_attempts", "verdict"),
    [
        (TaskFailureKind.UNEXPECTED, False, 1, 5, FailureVerdict.UNEXPECTED),
        (TaskFailureKind.UNEXPECTED, True, 1, 5, FailureVerdict.RETRIED),
        (TaskFailureKind.UNEXPECTED, True, 5, 5, FailureVerdict.EXHAUSTED),
        (TaskFailureKind.RETRY_ASKED, False, 1, 5, FailureVerdict.RETRIED),
        (TaskFailureKind.RETRY_ASKED, False, 1, 1, FailureVerdict.EXHAUSTED),
        (TaskFailureKind.VERDICT, True, 1, 5, FailureVerdict.VERDICT),
    ],
)
def test_failure_outcome_decides_retry_once(
    kind: TaskFailureKind,
    retries_unexpected: bool,
    attempt: int,
    max_attempts: int,
    verdict: FailureVerdict,
) -> None:
    outcome = failure_outcome(
        kind,
        retries_unexpected=retries_unexpected,
        attempt=attempt,
        max_attempts=max_attempts,
        backoff=Backoff(),
        now=_NOW,
    )
    assert outcome.verdict is verdict
    assert outcome.retry is (verdict is FailureVerdict.RETRIED)
    assert (outcome.run_at is not None) is outcome.retry
    expected = TaskEvent.FAIL_RETRYABLE if outcome.retry else TaskEvent.FAIL_PERMANENT
    assert outcome.event is expected
    assert transition(TaskState.RUNNING, outcome.event) in (TaskState.PENDING, TaskState.FAILED)


def test_the_task_failure_kind_is_named_apart_from_the_publication_one() -> None:
    assert TaskFailureKind.__name__ != PublicationFailureKind.__name__
    assert "FailureKind" not in tasks.__all__
    # The old name still imports, deprecated, as the same enum.
    with pytest.warns(DeprecationWarning, match="import TaskFailureKind"):
        old = tasks.FailureKind
    assert old is TaskFailureKind
    with pytest.raises(AttributeError):
        _ = tasks.NoSuchName  # type: ignore[attr-defined]


def test_failure_outcome_refuses_a_foreign_kind() -> None:
    with pytest.raises(ConfigurationTypeError, match="TaskFailureKind"):
        failure_outcome(
            PublicationFailureKind.UNEXPECTED,  # type: ignore[arg-type]
            retries_unexpected=False,
            attempt=1,
            max_attempts=5,
            backoff=Backoff(),
            now=_NOW,
        )


def test_failure_outcome_refuses_a_value_that_is_not_a_kind() -> None:
    with pytest.raises(ConfigurationTypeError):
        failure_outcome(
            "unexpected",  # type: ignore[arg-type]
            retries_unexpected=False,
            attempt=1,
            max_attempts=5,
            backoff=Backoff(),
            now=_NOW,
        )


@pytest.mark.parametrize(
    ("state", "attempts", "max_attempts", "shown"),
    [
        (TaskState.PENDING, 0, 5, "0/5"),
        (TaskState.RUNNING, 2, 5, "2/5"),
        (TaskState.PENDING, 0, 1, "0, no retries"),
        (TaskState.RUNNING, 1, 1, "1, no retries"),
        (TaskState.FAILED, 1, 5, "1, not retried"),  # a terminal failure: no "1/5"
        (TaskState.FAILED, 1, 1, "1, not retried"),
        (TaskState.FAILED, 5, 5, "5/5, attempts exhausted"),
        (TaskState.SUCCEEDED, 2, 5, "2"),
        (TaskState.CANCELLED, 0, 5, "0"),
    ],
)
def test_attempts_outlook_shows_n_of_max_only_while_retries_can_come(
    state: TaskState, attempts: int, max_attempts: int, shown: str
) -> None:
    assert attempts_outlook(state, attempts, max_attempts) == shown


@pytest.mark.parametrize(
    ("state", "attempts", "max_attempts", "error"),
    [
        ("failed", 1, 5, ConfigurationTypeError),
        (TaskState.FAILED, -1, 5, ConfigurationError),
        (TaskState.FAILED, True, 5, ConfigurationTypeError),
        (TaskState.FAILED, 1, 0, ConfigurationError),
        (TaskState.FAILED, 1, "5", ConfigurationTypeError),
    ],
)
def test_attempts_outlook_refuses_bad_input(
    state: Any, attempts: Any, max_attempts: Any, error: type[Exception]
) -> None:
    with pytest.raises(error):
        attempts_outlook(state, attempts, max_attempts)


_TASK_REFUSALS: list[tuple[Any, type[Exception], str]] = [
    (
        lambda: attempts_exhausted("1", 3),  # type: ignore[arg-type]
        ConfigurationTypeError,
        r"^attempt must be an int, not str$",
    ),
    (
        lambda: attempts_exhausted(1, True),
        ConfigurationTypeError,
        r"^max_attempts must be an int, not bool$",
    ),
    (lambda: attempts_exhausted(0, 3), ConfigurationError, r"^attempt must be at least 1; got 0$"),
    (
        lambda: attempts_exhausted(1, -2),
        ConfigurationError,
        r"^max_attempts must be at least 1; got -2$",
    ),
    (
        lambda: retry_decision(1, 3, "fast", NOW),  # type: ignore[arg-type]
        ConfigurationTypeError,
        r"^backoff must be a Backoff, not str$",
    ),
    (
        lambda: retry_decision(1, 3, BACKOFF, NOW, float("nan")),
        ConfigurationError,
        r"^draw must be a finite float",
    ),
    (
        lambda: retry_decision(1, 3, BACKOFF, datetime(2030, 1, 1)),
        ConfigurationError,
        r"^now must be timezone-aware",
    ),
    (
        lambda: failure_outcome(
            "verdict",  # type: ignore[arg-type]
            retries_unexpected=False,
            attempt=1,
            max_attempts=5,
            backoff=BACKOFF,
            now=NOW,
        ),
        ConfigurationTypeError,
        r"^kind must be a TaskFailureKind, not str$",
    ),
    (
        lambda: attempts_outlook("failed", 1, 5),  # type: ignore[arg-type]
        ConfigurationTypeError,
        r"^state must be a TaskState, not str$",
    ),
    (
        lambda: attempts_outlook(TaskState.FAILED, "1", 5),  # type: ignore[arg-type]
        ConfigurationTypeError,
        r"^attempts must be an int, not str$",
    ),
    (
        lambda: attempts_outlook(TaskState.FAILED, -1, 5),
        ConfigurationError,
        r"^attempts must be at least 0; got -1$",
    ),
    (
        lambda: attempts_outlook(TaskState.FAILED, 1, 0),
        ConfigurationError,
        r"^max_attempts must be at least 1; got 0$",
    ),
]


@pytest.mark.parametrize(("call", "error", "message"), _TASK_REFUSALS)
def test_each_refusal_names_the_input_to_fix_and_what_it_got(
    call: Any, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        call()


def test_without_a_draw_a_retry_waits_the_whole_backoff_delay() -> None:
    backoff = Backoff(initial=timedelta(seconds=10), maximum=timedelta(seconds=10), jitter=1.0)
    assert retry_decision(1, 3, backoff, NOW) == RetryDecision(True, NOW + timedelta(seconds=10))
    outcome = failure_outcome(
        TaskFailureKind.RETRY_ASKED,
        retries_unexpected=False,
        attempt=1,
        max_attempts=3,
        backoff=backoff,
        now=NOW,
    )
    assert outcome.run_at == NOW + timedelta(seconds=10)


def test_a_task_allowing_two_attempts_shows_its_one_retry() -> None:
    assert attempts_outlook(TaskState.PENDING, 1, 2) == "1/2"
    assert attempts_outlook(TaskState.RUNNING, 2, 2) == "2/2"
    assert attempts_outlook(TaskState.FAILED, 2, 2) == "2/2, attempts exhausted"


def test_a_retried_failure_takes_its_jitter_from_the_injected_draw() -> None:
    backoff = Backoff(initial=timedelta(seconds=10), maximum=timedelta(seconds=10), jitter=1.0)
    outcome = failure_outcome(
        TaskFailureKind.UNEXPECTED,
        retries_unexpected=True,
        attempt=1,
        max_attempts=3,
        backoff=backoff,
        now=NOW,
        draw=0.25,
    )
    assert outcome.verdict is FailureVerdict.RETRIED
    assert outcome.run_at == NOW + timedelta(seconds=7.5)
