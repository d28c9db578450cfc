"""RemoteClockEstimate: a lower bound of a server's clock from its answers and a monotonic clock."""

from __future__ import annotations

import math
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from steeple.core.remote_clock import RemoteClockEstimate

seconds = st.floats(min_value=0, max_value=1e6, allow_nan=False)
epochs = st.floats(min_value=0, max_value=4e9, allow_nan=False)


def _known(estimate: RemoteClockEstimate) -> bool:
    # Read through a call: mypy would otherwise keep the property narrowed to False.
    return estimate.known


def test_nothing_known_before_the_first_reading() -> None:
    estimate = RemoteClockEstimate()
    assert not estimate.known
    with pytest.raises(ValueError, match="no remote clock reading"):
        estimate.at_least(1.0)
    estimate.observe(1_000.0, received=5.0)
    assert _known(estimate)
    assert estimate.at_least(7.5) == 1_002.5
    assert estimate.until(1_010.0, 7.5) == 7.5


@given(
    remote_at_send=epochs,
    request=seconds,
    reply=seconds,
    later=seconds,
)
def test_the_bound_never_exceeds_the_true_remote_time(
    remote_at_send: float, request: float, reply: float, later: float
) -> None:
    """Whatever the request and reply delays, the true remote time is at least the bound.

    The remote clock runs at the local monotonic rate: local time t maps to remote time
    ``remote_at_send + (t - sent)``; the reading is taken when the request arrives.
    """
    sent = 100.0
    reading = remote_at_send + request
    received = sent + request + reply
    estimate = RemoteClockEstimate()
    estimate.observe(reading, received)
    local = received + later
    true_remote = remote_at_send + (local - sent)
    assert estimate.at_least(local) <= true_remote + 1e-6 * max(1.0, abs(true_remote))
    # ...and it is short of the truth by at most the reply's delay.
    assert true_remote - estimate.at_least(local) <= reply + 1e-6 * max(1.0, abs(true_remote))


@given(step=st.floats(min_value=-1e5, max_value=1e5, allow_nan=False), gap=seconds)
def test_a_step_of_the_remote_clock_is_forgotten_after_one_answer(step: float, gap: float) -> None:
    estimate = RemoteClockEstimate()
    estimate.observe(1_000.0, 10.0)
    # The remote clock is stepped; its next answer carries the new time.
    estimate.observe(1_000.0 + gap + step, 10.0 + gap)
    assert math.isclose(estimate.at_least(20.0 + gap), 1_010.0 + gap + step, abs_tol=1e-6)


def _refused(what: str) -> str:
    """The start of the message that refuses a bad time: it names which one is wrong."""
    return "^" + re.escape(f"{what} must be a finite number of seconds, not ")


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, True, "1"])
def test_non_finite_or_non_numeric_times_are_refused(bad: object) -> None:
    estimate = RemoteClockEstimate()
    with pytest.raises(ValueError, match=_refused("a remote clock reading")):
        estimate.observe(bad, 1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=_refused("a local monotonic time")):
        estimate.observe(1.0, bad)  # type: ignore[arg-type]
    # A refused observation keeps nothing (no reading anchored on a local time of zero).
    assert not _known(estimate)
    with pytest.raises(ValueError, match=r"^no remote clock reading was observed yet$"):
        estimate.until(1.0, 1.0)
    estimate.observe(1.0, 1.0)
    with pytest.raises(ValueError, match=_refused("a local monotonic time")):
        estimate.at_least(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=_refused("a remote instant")):
        estimate.until(bad, 1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=_refused("a local monotonic time")):
        estimate.until(1.0, bad)  # type: ignore[arg-type]
