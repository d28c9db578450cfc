from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest

from steeple.core.ports import Clock, RandomSource
from steeple.testing import DeterministicRandom, FakeClock
from steeple.testing.pytest_plugin import FAKE_EPOCH

START = datetime(2031, 5, 17, 3, 14, 15, 926000, tzinfo=UTC)


def test_fake_clock_returns_start_and_implements_the_clock_port() -> None:
    clock = FakeClock(START)
    assert clock.now() == START
    assert clock.now() == START  # reading does not move time
    assert isinstance(clock, Clock)


def test_fake_clock_normalizes_other_offsets_to_utc() -> None:
    plus_two = timezone(timedelta(hours=2))
    clock = FakeClock(datetime(2031, 5, 17, 5, 14, tzinfo=plus_two))
    assert clock.now() == datetime(2031, 5, 17, 3, 14, tzinfo=UTC)
    assert clock.now().utcoffset() == timedelta(0)


def test_fake_clock_rejects_naive_instants() -> None:
    with pytest.raises(ValueError, match="timezone-aware"):
        FakeClock(datetime(2031, 1, 1))
    clock = FakeClock(START)
    with pytest.raises(ValueError, match="timezone-aware"):
        clock.set(datetime(2031, 1, 1))
    with pytest.raises(TypeError):
        FakeClock("2031-01-01")  # type: ignore[arg-type]


def test_advance_moves_forward_and_refuses_to_go_back() -> None:
    clock = FakeClock(START)
    assert clock.advance(timedelta(seconds=90)) == START + timedelta(seconds=90)
    assert clock.advance(timedelta(0)) == START + timedelta(seconds=90)
    with pytest.raises(ValueError, match="set"):
        clock.advance(timedelta(microseconds=-1))
    assert clock.now() == START + timedelta(seconds=90)
    with pytest.raises(TypeError):
        clock.advance(5)  # type: ignore[arg-type]


def test_set_jumps_anywhere_including_backwards() -> None:
    clock = FakeClock(START)
    clock.set(START - timedelta(days=3))
    assert clock.now() == START - timedelta(days=3)
    clock.set(START + timedelta(days=3))
    assert clock.now() == START + timedelta(days=3)
    assert "FakeClock(" in repr(clock)


def test_deterministic_random_repeats_per_seed() -> None:
    a, b, c = DeterministicRandom(3), DeterministicRandom(3), DeterministicRandom(4)
    draws_a = (a.token_bytes(16), a.random(), a.token_bytes(5))
    draws_b = (b.token_bytes(16), b.random(), b.token_bytes(5))
    assert draws_a == draws_b
    assert c.token_bytes(16) != draws_a[0]
    assert len(draws_a[0]) == 16
    assert len(draws_a[2]) == 5
    assert 0.0 <= draws_a[1] < 1.0
    assert DeterministicRandom().token_bytes(0) == b""
    source: RandomSource = a
    assert isinstance(source.token_bytes(2), bytes)


def test_deterministic_random_rejects_negative_sizes() -> None:
    with pytest.raises(ValueError, match="n must be"):
        DeterministicRandom().token_bytes(-1)


def test_plugin_fixtures(
    fake_clock: FakeClock, deterministic_random: DeterministicRandom, memory_broker: object
) -> None:
    assert fake_clock.now() == FAKE_EPOCH == START
    assert deterministic_random.token_bytes(4) == DeterministicRandom(0).token_bytes(4)
    assert type(memory_broker).__name__ == "MemoryBroker"
