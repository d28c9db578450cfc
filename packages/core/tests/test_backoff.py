"""Exponential backoff: exact, capped, jitter from an injected draw, fast at any attempt."""

from __future__ import annotations

import re
import time
from datetime import timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from steeple.core import RELAY_BACKOFF, Backoff, ConfigurationError

S = timedelta(seconds=1)


def test_relay_backoff_sequence() -> None:
    delays = [RELAY_BACKOFF.delay(n) for n in range(1, 13)]
    assert delays == [S * s for s in (1, 2, 4, 8, 16, 32, 64, 128, 256, 300, 300, 300)]


@settings(max_examples=300, deadline=None)
@given(
    st.integers(1, 10_000_000),  # initial, microseconds
    st.integers(0, 10**12),  # extra room up to the cap, microseconds
    st.integers(1, 10),
    st.integers(1, 200),
)
def test_delay_matches_exact_integer_model(
    initial_us: int, extra_us: int, factor: int, attempt: int
) -> None:
    backoff = Backoff(
        initial=timedelta(microseconds=initial_us),
        maximum=timedelta(microseconds=initial_us + extra_us),
        factor=factor,
    )
    expected = min(initial_us * factor ** (attempt - 1), initial_us + extra_us)
    assert backoff.delay(attempt) == timedelta(microseconds=expected)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 10**12), st.floats(0, 1), st.floats(0, 1, exclude_max=True))
def test_jitter_only_shortens_within_its_fraction(attempt: int, jitter: float, draw: float) -> None:
    backoff = Backoff(initial=S, maximum=timedelta(minutes=5), jitter=jitter)
    full = Backoff(initial=S, maximum=timedelta(minutes=5)).delay(attempt)
    got = backoff.delay(attempt, draw)
    assert full * (1 - jitter) - timedelta(microseconds=1) <= got <= full


@pytest.mark.parametrize("attempt", [10**6, 10**9, 10**18, 2**200])
def test_huge_attempt_numbers_are_capped_fast(attempt: int) -> None:
    started = time.perf_counter()
    assert RELAY_BACKOFF.delay(attempt) == timedelta(minutes=5)
    assert Backoff(initial=S, maximum=7 * S, factor=1).delay(attempt) == S
    tiny = Backoff(initial=timedelta(microseconds=1), maximum=timedelta(days=7), factor=2)
    assert tiny.delay(attempt) == timedelta(days=7)
    assert time.perf_counter() - started < 0.05


def test_largest_cap_no_overflow() -> None:
    backoff = Backoff(initial=timedelta(days=1), maximum=timedelta.max, factor=10)
    assert backoff.delay(10**9) == timedelta.max
    assert backoff.delay(2) == timedelta(days=10)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"initial": timedelta(0)},
        {"initial": -S},
        {"initial": 1},
        {"initial": 10 * S, "maximum": S},
        {"maximum": "5m"},
        {"factor": 0},
        {"factor": 1.5},
        {"factor": True},
        {"jitter": -0.1},
        {"jitter": 1.1},
        {"jitter": float("nan")},
        {"jitter": "0.5"},
        {"jitter": True},
    ],
)
def test_bad_backoff_rejected(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigurationError, match="backoff"):
        Backoff(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("attempt", [0, -1, True, 1.0, "1", None])
def test_bad_attempt_rejected(attempt: object) -> None:
    with pytest.raises(ConfigurationError, match="attempt"):
        RELAY_BACKOFF.delay(attempt)  # type: ignore[arg-type]


def test_database_retry_starts_fast_and_is_capped() -> None:
    from steeple.core.backoff import DATABASE_RETRY

    ms = timedelta(milliseconds=1)
    delays = [DATABASE_RETRY.delay(n) for n in range(1, 10)]
    assert delays == [ms * m for m in (100, 200, 400, 800, 1600, 3200, 5000, 5000, 5000)]
    # Jitter takes off up to half, from the injected draw.
    assert DATABASE_RETRY.delay(1, 0.999999) > 50 * ms
    assert DATABASE_RETRY.delay(9, 0.5) == 3750 * ms
    assert DATABASE_RETRY.delay(10**9, 0.0) == 5 * S


def test_a_failure_streak_reports_its_start_then_one_summary_per_interval() -> None:
    from steeple.core.backoff import StreakReport, streak_failed

    streak, report = streak_failed(None, 100.0, 10.0)
    assert report is StreakReport.BEGAN
    assert (streak.since, streak.attempts, streak.reported_at) == (100.0, 1, 100.0)
    reports = []
    # 240 failed attempts 50 ms apart: 12 s of outage
    for n in range(1, 241):
        streak, report = streak_failed(streak, 100.0 + n * 0.05, 10.0)
        reports.append(report)
    assert reports.count(StreakReport.ONGOING) == 1
    assert reports.count(StreakReport.QUIET) == 239
    assert streak.attempts == 241
    assert streak.lasted(112.0) == 12.0
    assert streak.lasted(99.0) == 0.0  # never negative


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"initial": timedelta(0)}, "backoff initial delay must be a positive timedelta"),
        ({"initial": 10 * S, "maximum": S}, "backoff maximum must be a timedelta >= the initial"),
        ({"factor": 0}, "backoff factor must be between 1 and 2147483647; got 0"),
        ({"factor": 1.5}, "backoff factor must be an int, not float"),
        ({"jitter": 2.0}, "backoff jitter must be a number within [0, 1]"),
    ],
)
def test_a_bad_backoff_is_refused_with_what_to_fix(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigurationError, match="^" + re.escape(message)):
        Backoff(**{"initial": S, "maximum": 60 * S, **kwargs})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((0,), "attempt numbers start at 1; got 0"),
        ((1.0,), "attempt must be an int, not float"),
        ((1, float("nan")), "draw must be a finite float in [0, 1], not nan"),
    ],
)
def test_a_bad_attempt_or_draw_is_refused_with_what_to_fix(
    args: tuple[object, ...], message: str
) -> None:
    with pytest.raises(ConfigurationError, match="^" + re.escape(message)):
        RELAY_BACKOFF.delay(*args)  # type: ignore[arg-type]


def test_a_streak_summary_is_due_exactly_one_interval_after_the_last_report() -> None:
    from steeple.core.backoff import StreakReport, streak_failed

    streak, _ = streak_failed(None, 100.0, 10.0)
    _, early = streak_failed(streak, 109.5, 10.0)
    assert early is StreakReport.QUIET
    _, due = streak_failed(streak, 110.0, 10.0)
    assert due is StreakReport.ONGOING


def test_delays_are_exact_to_the_microsecond_at_any_size() -> None:
    """Integer microseconds: a delay past float precision (2**53 µs) is not rounded."""
    odd = timedelta.max - timedelta(microseconds=1)
    assert Backoff(initial=odd, maximum=timedelta.max).delay(1) == odd


def test_the_largest_factor_allowed_is_accepted() -> None:
    from steeple.core import limits

    assert Backoff(initial=S, maximum=60 * S, factor=limits.MAX_BACKOFF_FACTOR).delay(2) == 60 * S
