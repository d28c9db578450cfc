"""Windows, lease arithmetic, fencing, shared-time adoption and relay failure decisions."""

from __future__ import annotations

import ast
import hmac
import inspect
import time
from datetime import UTC, datetime, timedelta, timezone
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import steeple.core.leases as leases_module
from steeple.core import (
    RELAY_BACKOFF,
    Backoff,
    ConfigurationError,
    ConfigurationTypeError,
    OccurrenceState,
    RecurringClockError,
    RecurringError,
)
from steeple.core.leases import (
    CAPABILITY_BYTES,
    GENERATION_BYTES,
    FailureDecision,
    adopt_time,
    after_publish_failure,
    capability_digest,
    capability_matches,
    check_server_clock,
    holds_granted_lease,
    holds_lease,
    is_claimable,
    is_live,
    lease_expiry,
    new_capability,
    new_generation,
    new_occurrence_id,
    occurrence_id_for,
    window_end,
)

T0 = datetime(2033, 3, 3, 3, 3, 3, 333000, tzinfo=UTC)
S = timedelta(seconds=1)


# --- windows and lease arithmetic ----------------------------------------------------------


def test_window_end_is_fixed_from_creation() -> None:
    assert window_end(T0, timedelta(days=1)) == T0 + timedelta(days=1)
    assert window_end(T0, timedelta(days=7)) == T0 + timedelta(days=7)


@pytest.mark.parametrize("window", [timedelta(0), -S, 5, None])
def test_window_end_rejects_bad_windows(window: object) -> None:
    with pytest.raises(ConfigurationError, match="delivery_window"):
        window_end(T0, window)  # type: ignore[arg-type]


def test_lease_in_the_middle_of_the_window_is_full_length() -> None:
    assert lease_expiry(T0, 60 * S, T0 + timedelta(hours=1)) == T0 + 60 * S


def test_lease_near_window_end_is_shortened_to_it() -> None:
    end = T0 + 20 * S
    assert lease_expiry(T0, 60 * S, end) == end
    assert lease_expiry(T0, 20 * S, end) == end


def test_expired_lease_is_not_handed_out() -> None:
    end = T0
    assert lease_expiry(T0, 60 * S, end) is None  # window ends right now
    assert lease_expiry(T0, 60 * S, end - S) is None  # window already over


@settings(max_examples=300, deadline=None)
@given(
    st.timedeltas(min_value=timedelta(milliseconds=1), max_value=timedelta(seconds=300)),
    st.timedeltas(min_value=-timedelta(days=8), max_value=timedelta(days=8)),
)
def test_lease_expiry_property(lease: timedelta, until_end: timedelta) -> None:
    end = T0 + until_end
    got = lease_expiry(T0, lease, end)
    if until_end <= timedelta(0):
        assert got is None
    else:
        assert got is not None
        assert T0 < got <= T0 + lease
        assert got <= end
        assert got == (T0 + lease if lease <= until_end else end)
        assert is_live(got, T0)
        assert not is_live(got, got)


@pytest.mark.parametrize("lease", [timedelta(0), -S, 60, None])
def test_lease_expiry_rejects_bad_durations(lease: object) -> None:
    with pytest.raises(ConfigurationError, match="lease_duration"):
        lease_expiry(T0, lease, T0 + timedelta(days=1))  # type: ignore[arg-type]


def test_is_live_boundary() -> None:
    assert is_live(T0 + timedelta(microseconds=1), T0)
    assert not is_live(T0, T0)
    assert not is_live(T0 - S, T0)
    other_zone = (T0 + S).astimezone(timezone(timedelta(hours=9)))
    assert is_live(other_zone, T0)


def test_naive_instants_rejected_everywhere() -> None:
    naive = datetime(2033, 1, 1)
    with pytest.raises(ValueError, match="timezone-aware"):
        window_end(naive, timedelta(days=1))
    with pytest.raises(ValueError, match="timezone-aware"):
        lease_expiry(naive, S, T0)
    with pytest.raises(ValueError, match="window_ends_at must be timezone-aware"):
        lease_expiry(T0, S, naive)
    with pytest.raises(ValueError, match="timezone-aware"):
        is_live(naive, T0)
    with pytest.raises(ValueError, match="timezone-aware"):
        adopt_time(naive, T0)
    with pytest.raises(ValueError, match="timezone-aware"):
        after_publish_failure(1, naive, T0, permanent=False)
    with pytest.raises(TypeError):
        is_live("2033-01-01T00:00Z", T0)  # type: ignore[arg-type]


# --- fencing -------------------------------------------------------------------------------


def test_capability_comparison() -> None:
    secret = bytes(range(16))
    assert capability_matches(secret, bytes(range(16)))
    assert capability_matches(secret, bytearray(range(16)))  # type: ignore[arg-type]
    assert not capability_matches(secret, bytes(range(1, 17)))
    assert not capability_matches(secret, secret[:-1])
    assert not capability_matches(secret, secret + b"\0")
    assert not capability_matches(secret, b"")
    flipped = bytearray(secret)
    flipped[15] ^= 1
    assert not capability_matches(secret, bytes(flipped))
    with pytest.raises(TypeError):
        capability_matches(secret, secret.hex())  # type: ignore[arg-type]


def test_capability_comparison_is_constant_time() -> None:
    """The comparison goes through hmac.compare_digest (and nothing short-circuits it)."""
    assert leases_module.hmac is hmac  # type: ignore[attr-defined]
    with mock.patch.object(hmac, "compare_digest", wraps=hmac.compare_digest) as spy:
        assert not capability_matches(b"a" * 16, b"b" * 16)
        assert capability_matches(b"a" * 16, b"a" * 16)
    assert spy.call_count == 2
    # And the source uses no == on the secrets.
    tree = ast.parse(inspect.getsource(capability_matches))
    assert not [n for n in ast.walk(tree) if isinstance(n, ast.Compare)]


class _Fixed:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.asked: list[int] = []

    def token_bytes(self, n: int) -> bytes:
        self.asked.append(n)
        return self.data[:n]

    def random(self) -> float:
        return 0.0


def test_fresh_capability_and_generation_come_from_the_injected_source() -> None:
    source = _Fixed(bytes(range(32)))
    assert new_capability(source) == bytes(range(16))
    assert new_generation(source) == bytes(range(16))
    assert source.asked == [CAPABILITY_BYTES, GENERATION_BYTES] == [16, 16]
    with pytest.raises(ConfigurationError, match="capability"):
        new_capability(_Fixed(b"short"))
    with pytest.raises(ConfigurationError, match="generation"):
        new_generation(_Fixed(b""))


def test_a_lease_the_caller_granted_is_held_exactly_when_its_capability_would_be() -> None:
    capability = bytes(range(16))
    digest = capability_digest(capability)
    for stored, stored_revision, revision, held in [
        (digest, 3, 3, True),
        (digest, 3, 2, False),  # an older revision
        (capability_digest(bytes(16)), 3, 3, False),  # another lease's capability
        (None, 3, 3, False),  # a spent lease
    ]:
        assert holds_granted_lease(stored, stored_revision, digest, revision) is held
        assert holds_lease(stored, stored_revision, capability, revision) is held
    # Never held, never an error: a bool is not a revision (True would equal 1), and a
    # revision or a capability or digest of another type is refused.
    assert holds_granted_lease(digest, 1, digest, 1)
    assert holds_granted_lease(digest, 1, digest, True) is False
    assert holds_granted_lease(digest, 3, digest, "3") is False  # type: ignore[arg-type]
    assert holds_granted_lease(digest, 3, bytearray(digest), 3) is False  # type: ignore[arg-type]
    assert holds_lease(digest, 1, capability, 1)
    assert holds_lease(digest, 1, capability, True) is False
    assert holds_lease(digest, 3, capability, "3") is False
    assert holds_lease(digest, 3, "not bytes", 3) is False
    assert holds_lease(None, 3, "not bytes", 3) is False


def test_a_fresh_occurrence_id_is_the_id_of_one_generation_drawn_from_the_source() -> None:
    source = _Fixed(bytes([0xAB, 0x0C] * 16))
    fresh = new_occurrence_id(source)
    assert fresh == occurrence_id_for(bytes([0xAB, 0x0C] * 8)) == "ab0c" * 8
    assert source.asked == [GENERATION_BYTES]  # one draw of a generation's length
    with pytest.raises(
        ConfigurationError, match=r"^the random source returned a bad generation \(need 16 bytes\)$"
    ):
        new_occurrence_id(_Fixed(b"\x00" * 15))
    with pytest.raises(
        ConfigurationTypeError,
        match=r"^random must be a RandomSource \(with token_bytes\), not object$",
    ):
        new_occurrence_id(object())  # type: ignore[arg-type]


def test_occurrence_id_is_32_lowercase_hex() -> None:
    generation = bytes([0xAB] * 16)
    assert occurrence_id_for(generation) == "ab" * 16
    with pytest.raises(ValueError, match="16 bytes"):
        occurrence_id_for(b"\x00" * 15)
    with pytest.raises(TypeError):
        occurrence_id_for("ab" * 16)  # type: ignore[arg-type]


# --- shared time adoption ------------------------------------------------------------------


def test_clock_trailing_by_4_9_s_adopts_recorded_time() -> None:
    recorded = T0
    assert adopt_time(recorded, T0 - timedelta(seconds=4.9)) == recorded


def test_clock_trailing_by_exactly_the_tolerance_adopts() -> None:
    assert adopt_time(T0, T0 - timedelta(seconds=5)) == T0


def test_clock_trailing_by_5_1_s_is_a_clock_error() -> None:
    with pytest.raises(RecurringClockError, match="trails") as info:
        adopt_time(T0, T0 - timedelta(seconds=5.1))
    assert isinstance(info.value, RecurringError)
    assert isinstance(info.value, RecurringError.Clock)


# --- the host's clock against the database server's ----------------------------------------

NO_TRIP = timedelta(0)


def test_clock_ahead_of_the_server_by_4_9_s_or_exactly_5_s_passes() -> None:
    check_server_clock(T0 + timedelta(seconds=4.9), T0, NO_TRIP)
    check_server_clock(T0 + timedelta(seconds=5), T0, NO_TRIP)
    check_server_clock(T0 - timedelta(hours=1), T0, NO_TRIP)  # trailing: adopt_time's judgement


def test_clock_ahead_of_the_server_by_5_1_s_is_a_clock_error_naming_the_skew() -> None:
    with pytest.raises(RecurringClockError, match=r"ahead of the database server's clock") as info:
        check_server_clock(T0 + timedelta(seconds=5.1), T0, NO_TRIP)
    assert "by 0:00:05 (5.100 s at least" in str(info.value)
    assert info.value.skew == timedelta(seconds=5.1)
    assert info.value.server_time == T0
    assert info.value.local_time == T0 + timedelta(seconds=5.1)


def test_the_round_trip_counts_in_the_hosts_favour() -> None:
    check_server_clock(T0 + timedelta(seconds=5.9), T0, timedelta(seconds=1))
    with pytest.raises(RecurringClockError, match="allowing for the 1000 ms round trip"):
        check_server_clock(T0 + timedelta(seconds=6.1), T0, timedelta(seconds=1))


def test_server_clock_judgement_refuses_bad_inputs() -> None:
    with pytest.raises(ConfigurationError):
        check_server_clock(T0, T0, timedelta(seconds=-1))
    with pytest.raises(ConfigurationError):
        check_server_clock(T0.replace(tzinfo=None), T0, NO_TRIP)


def test_clock_ahead_is_used_and_no_record_means_local() -> None:
    assert adopt_time(T0, T0 + timedelta(hours=1)) == T0 + timedelta(hours=1)
    assert adopt_time(None, T0) == T0


def test_custom_tolerance() -> None:
    assert adopt_time(T0, T0 - 30 * S, tolerance=timedelta(minutes=1)) == T0
    with pytest.raises(RecurringClockError):
        adopt_time(T0, T0 - timedelta(microseconds=1), tolerance=timedelta(0))
    with pytest.raises(ConfigurationError):
        adopt_time(T0, T0, tolerance=-S)


@settings(max_examples=300, deadline=None)
@given(st.timedeltas(min_value=-timedelta(hours=1), max_value=timedelta(hours=1)))
def test_shared_time_never_moves_backwards(skew: timedelta) -> None:
    local = T0 + skew
    if skew < -timedelta(seconds=5):
        with pytest.raises(RecurringClockError):
            adopt_time(T0, local)
    else:
        adopted = adopt_time(T0, local)
        assert adopted >= T0
        assert adopted == max(T0, local)


# --- relay failure decisions -------------------------------------------------------------------

DAY_END = T0 + timedelta(days=1)


def test_retryable_failure_backs_off() -> None:
    decision = after_publish_failure(1, T0, DAY_END, permanent=False)
    assert decision == FailureDecision(OccurrenceState.RETRY_WAIT, T0 + S)
    assert after_publish_failure(3, T0, DAY_END, False).next_attempt_at == T0 + 4 * S


def test_relay_failure_after_ten_attempts_is_dead() -> None:
    assert after_publish_failure(9, T0, DAY_END, False).state is OccurrenceState.RETRY_WAIT
    decision = after_publish_failure(10, T0, DAY_END, False)
    assert decision == FailureDecision(OccurrenceState.DEAD, None, "attempts")
    assert after_publish_failure(11, T0, DAY_END, False).state is OccurrenceState.DEAD


def test_permanent_failure_is_dead_at_once() -> None:
    decision = after_publish_failure(1, T0, DAY_END, permanent=True)
    assert decision == FailureDecision(OccurrenceState.DEAD, None, "permanent")


def test_failure_at_window_expiry_is_dead() -> None:
    assert after_publish_failure(1, T0, T0, False).reason == "window"
    assert after_publish_failure(1, T0, T0 - S, False).state is OccurrenceState.DEAD


def test_retry_that_would_land_at_or_after_window_end_is_dead() -> None:
    # Attempt 4 waits 8 s (1, 2, 4, 8...).
    assert after_publish_failure(4, T0, T0 + 8 * S, False).state is OccurrenceState.DEAD
    ok = after_publish_failure(4, T0, T0 + 8 * S + timedelta(microseconds=1), False)
    assert ok == FailureDecision(OccurrenceState.RETRY_WAIT, T0 + 8 * S)


def test_custom_backoff_and_attempts_and_jitter() -> None:
    backoff = Backoff(initial=10 * S, maximum=10 * S, jitter=1.0)
    d = after_publish_failure(1, T0, DAY_END, False, backoff, 2, draw=0.25)
    assert d == FailureDecision(OccurrenceState.RETRY_WAIT, T0 + 7.5 * S)
    assert after_publish_failure(2, T0, DAY_END, False, backoff, 2).state is OccurrenceState.DEAD


@settings(max_examples=300, deadline=None)
@given(
    st.integers(1, 10**9),
    st.booleans(),
    st.timedeltas(min_value=-timedelta(days=1), max_value=timedelta(days=8)),
)
def test_failure_decision_model(attempts: int, permanent: bool, left: timedelta) -> None:
    end = T0 + left
    decision = after_publish_failure(attempts, T0, end, permanent)
    # Independent model of RELAY_BACKOFF: 1 s doubling, capped at 300 s.
    wait = timedelta(seconds=300 if attempts > 9 else min(300, 2 ** (attempts - 1)))
    dead = permanent or attempts >= 10 or T0 + wait >= end
    if dead:
        assert decision.state is OccurrenceState.DEAD
        assert decision.next_attempt_at is None
        assert decision.reason in {"permanent", "attempts", "window"}
    else:
        assert decision == FailureDecision(OccurrenceState.RETRY_WAIT, T0 + wait)
        assert decision.next_attempt_at is not None
        assert decision.next_attempt_at < end


@pytest.mark.parametrize(("attempts", "max_attempts"), [(0, 10), (-3, 10), (1, 0), (True, 10)])
def test_failure_decision_rejects_bad_counts(attempts: int, max_attempts: int) -> None:
    with pytest.raises(ConfigurationError):
        after_publish_failure(attempts, T0, DAY_END, False, max_attempts=max_attempts)


def test_huge_attempt_numbers_are_capped_and_fast() -> None:
    started = time.perf_counter()
    assert RELAY_BACKOFF.delay(10**9) == timedelta(minutes=5)
    decision = after_publish_failure(10**9, T0, DAY_END, False, max_attempts=10**9 + 1)
    assert decision == FailureDecision(OccurrenceState.RETRY_WAIT, T0 + timedelta(minutes=5))
    assert time.perf_counter() - started < 0.1


def test_huge_backoff_cap_near_the_end_of_time_does_not_overflow() -> None:
    backoff = Backoff(initial=timedelta(days=1), maximum=timedelta(days=999_999_999))
    late = datetime(9999, 12, 1, tzinfo=UTC)
    decision = after_publish_failure(
        50, late, datetime(9999, 12, 31, tzinfo=UTC), False, backoff, 100
    )
    assert decision.state is OccurrenceState.DEAD
    assert decision.reason == "window"


# --- claimability ------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(OccurrenceState),
    st.timedeltas(min_value=-timedelta(hours=2), max_value=timedelta(hours=2)),
    st.none() | st.timedeltas(min_value=-timedelta(hours=1), max_value=timedelta(hours=1)),
    st.none() | st.timedeltas(min_value=-timedelta(hours=1), max_value=timedelta(hours=1)),
)
def test_is_claimable_model(
    state: OccurrenceState,
    window_left: timedelta,
    lease_left: timedelta | None,
    wait_left: timedelta | None,
) -> None:
    lease_at = None if lease_left is None else T0 + lease_left
    wait_at = None if wait_left is None else T0 + wait_left
    got = is_claimable(
        state,
        T0,
        window_ends_at=T0 + window_left,
        lease_expires_at=lease_at,
        next_attempt_at=wait_at,
    )
    open_window = window_left > timedelta(0)
    if state.value == "pending":
        want = open_window
    elif state.value == "retry_wait":
        want = open_window and (wait_left is None or wait_left <= timedelta(0))
    elif state.value == "leased":
        want = open_window and (lease_left is None or lease_left <= timedelta(0))
    else:
        want = False
    assert got is want


def test_is_claimable_boundaries() -> None:
    end = T0 + timedelta(hours=1)
    assert is_claimable(OccurrenceState.LEASED, T0, window_ends_at=end, lease_expires_at=T0)
    assert not is_claimable(OccurrenceState.LEASED, T0, window_ends_at=end, lease_expires_at=T0 + S)
    assert is_claimable(OccurrenceState.RETRY_WAIT, T0, window_ends_at=end, next_attempt_at=T0)
    assert not is_claimable(OccurrenceState.PENDING, T0, window_ends_at=T0)
    for state in (
        OccurrenceState.PUBLISHED,
        OccurrenceState.DEAD,
        OccurrenceState.EXPIRED,
        OccurrenceState.CANCELLED,
    ):
        assert not is_claimable(state, T0, window_ends_at=end)
    with pytest.raises(ValueError, match="timezone-aware"):
        is_claimable(OccurrenceState.PENDING, datetime(2033, 1, 1), window_ends_at=end)


def test_lease_repr_never_shows_the_capability() -> None:
    from steeple.core import Lease

    capability = bytes.fromhex("deadbeefcafebabe0011223344556677")
    lease = Lease("ab" * 16, T0, 7, capability)
    for text in (repr(lease), str(lease)):
        assert "deadbeef" not in text
        assert "capability" not in text
        assert repr(capability) not in text
        assert "ab" * 16 in text
        assert "revision=7" in text


# --- refusals name what to fix -------------------------------------------------------------

NAIVE = datetime(2033, 1, 1)
HOUR = timedelta(hours=1)
_NAIVE_INSTANT_CALLS = [
    ("created_at", lambda: window_end(NAIVE, HOUR)),
    ("now", lambda: lease_expiry(NAIVE, HOUR, T0)),
    ("window_ends_at", lambda: lease_expiry(T0, HOUR, NAIVE)),
    ("now", lambda: is_live(T0, NAIVE)),
    ("expires_at", lambda: is_live(NAIVE, T0)),
    ("now", lambda: is_claimable(OccurrenceState.PENDING, NAIVE, window_ends_at=T0)),
    ("window_ends_at", lambda: is_claimable(OccurrenceState.PENDING, T0, window_ends_at=NAIVE)),
    (
        "next_attempt_at",
        lambda: is_claimable(
            OccurrenceState.RETRY_WAIT, T0, window_ends_at=T0 + HOUR, next_attempt_at=NAIVE
        ),
    ),
    ("local", lambda: adopt_time(None, NAIVE)),
    ("recorded", lambda: adopt_time(NAIVE, T0)),
    ("local", lambda: check_server_clock(NAIVE, T0, timedelta(0))),
    ("server", lambda: check_server_clock(T0, NAIVE, timedelta(0))),
    ("now", lambda: after_publish_failure(1, NAIVE, T0, False)),
    ("window_ends_at", lambda: after_publish_failure(1, T0, NAIVE, False)),
]


@pytest.mark.parametrize(("name", "call"), _NAIVE_INSTANT_CALLS)
def test_a_naive_instant_is_refused_by_its_parameters_name(name: str, call: object) -> None:
    assert callable(call)
    with pytest.raises(ConfigurationError) as refused:
        call()
    assert str(refused.value).startswith(f"{name} must be timezone-aware")


@pytest.mark.parametrize(
    ("name", "call"),
    [
        ("expected", lambda: capability_matches("ab", b"ab")),  # type: ignore[arg-type]
        ("presented", lambda: capability_matches(b"ab", "ab")),  # type: ignore[arg-type]
        ("capability", lambda: capability_digest("ab")),  # type: ignore[arg-type]
        ("generation", lambda: occurrence_id_for("ab")),  # type: ignore[arg-type]
        ("stored_digest", lambda: holds_lease("ab", 1, b"ab", 1)),  # type: ignore[arg-type]
    ],
)
def test_a_secret_that_is_not_bytes_is_refused_by_its_parameters_name(
    name: str, call: object
) -> None:
    assert callable(call)
    with pytest.raises(ConfigurationTypeError, match=f"^{name} must be bytes, not str$"):
        call()


def test_a_bad_duration_or_tolerance_is_refused_with_what_to_fix() -> None:
    with pytest.raises(
        ConfigurationTypeError, match=r"^delivery_window must be a datetime.timedelta, not str$"
    ):
        window_end(T0, "1h")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match=r"^lease_duration must be positive"):
        lease_expiry(T0, -S, T0 + HOUR)
    with pytest.raises(ConfigurationError, match=r"^tolerance must be a non-negative timedelta$"):
        adopt_time(T0, T0, -S)
    with pytest.raises(ConfigurationError, match=r"^round_trip must be a non-negative timedelta$"):
        check_server_clock(T0, T0, -S)
    with pytest.raises(
        ConfigurationError,
        match=r"^the delivery window of an occurrence created at .* would end after the year 9999$",
    ):
        window_end(datetime(9999, 12, 31, tzinfo=UTC), timedelta(days=2))


def test_a_claim_of_something_that_is_not_a_state_says_what_it_got() -> None:
    with pytest.raises(
        ConfigurationTypeError, match=r"^state must be an OccurrenceState, not 'pending'$"
    ):
        is_claimable("pending", T0, window_ends_at=T0 + HOUR)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"attempts": "3"}, ConfigurationTypeError, "^attempts must be an int >= 1; got '3'$"),
        ({"attempts": True}, ConfigurationTypeError, "^attempts must be an int >= 1; got True$"),
        ({"attempts": 0}, ConfigurationError, "^attempts must be an int >= 1; got 0$"),
        ({"max_attempts": 0}, ConfigurationError, "^max_attempts must be an int >= 1; got 0$"),
        ({"backoff": "fast"}, ConfigurationTypeError, "^backoff must be a Backoff, not str$"),
        ({"draw": float("nan")}, ConfigurationError, "^draw must be a finite float"),
    ],
)
def test_a_bad_failure_decision_input_is_refused_by_name(
    kwargs: dict[str, object], error: type[Exception], message: str
) -> None:
    arguments: dict[str, object] = {
        "attempts": 1,
        "now": T0,
        "window_ends_at": T0 + HOUR,
        "permanent": False,
    }
    with pytest.raises(error, match=message):
        after_publish_failure(**{**arguments, **kwargs})  # type: ignore[arg-type]


def test_a_random_source_is_refused_by_what_it_lacks_or_returns() -> None:
    with pytest.raises(
        ConfigurationTypeError,
        match=r"^random must be a RandomSource \(with token_bytes\), not object$",
    ):
        new_capability(object())  # type: ignore[arg-type]

    class Short:
        def token_bytes(self, n: int) -> bytes:
            return bytes(n - 1)

    with pytest.raises(
        ConfigurationError, match=r"^the random source returned a bad capability \(need 16 bytes\)$"
    ):
        new_capability(Short())  # type: ignore[arg-type]
    with pytest.raises(
        ConfigurationError, match=r"^the random source returned a bad generation \(need 16 bytes\)$"
    ):
        new_generation(Short())  # type: ignore[arg-type]


def test_clock_errors_carry_both_times_and_say_what_to_fix() -> None:
    with pytest.raises(RecurringClockError) as trailing:
        adopt_time(T0 + 6 * S, T0)
    assert trailing.value.recorded_time == T0 + 6 * S
    assert trailing.value.local_time == T0
    assert str(trailing.value).endswith(
        "more than the 0:00:05 tolerance; fix this host's clock synchronisation"
    )
    with pytest.raises(RecurringClockError) as ahead:
        check_server_clock(T0 + 6 * S, T0, timedelta(0))
    assert str(ahead.value).endswith(
        "more than the 0:00:05 bound; nothing was recorded. "
        "Fix this host's clock synchronisation (NTP)"
    )


# --- fencing at the edges ------------------------------------------------------------------


def test_the_longest_capability_accepted_is_held_and_one_byte_more_is_not() -> None:
    longest = bytes(range(256)) * 4
    assert holds_lease(capability_digest(longest), 1, longest, 1)
    assert not holds_lease(capability_digest(longest), 1, longest + b"\x00", 1)


def test_a_capability_presented_as_any_bytes_like_view_is_held() -> None:
    capability = bytes(range(16))
    digest = capability_digest(capability)
    # Every other byte of a buffer twice as long: a view that is not contiguous.
    strided = memoryview(
        bytes(b for pair in zip(capability, bytes(16), strict=True) for b in pair)
    )[::2]
    assert bytes(strided) == capability
    assert holds_lease(digest, 2, strided, 2)
    assert holds_lease(digest, 2, memoryview(capability), 2)
    assert holds_lease(digest, 2, bytearray(capability), 2)


def test_without_a_draw_the_retry_waits_the_whole_backoff_delay() -> None:
    backoff = Backoff(initial=10 * S, maximum=10 * S, jitter=1.0)
    decision = after_publish_failure(1, T0, T0 + HOUR, False, backoff)
    assert decision == FailureDecision(OccurrenceState.RETRY_WAIT, T0 + 10 * S)


@settings(max_examples=300, deadline=None)
@given(
    st.binary(min_size=1, max_size=64),
    st.integers(0, 5),
    st.binary(min_size=1, max_size=64) | st.none(),
    st.integers(0, 5),
)
def test_a_lease_is_held_only_with_both_its_capability_and_its_revision(
    capability: bytes, revision: int, presented: bytes | None, presented_revision: int
) -> None:
    # None: the holder presents the capability itself; else another one (a forgery, or
    # the capability of an older claim).
    shown = capability if presented is None else presented
    held = holds_lease(capability_digest(capability), revision, shown, presented_revision)
    assert held == (shown == capability and presented_revision == revision)
