"""Small pure pieces: the demo's accelerated clock, durations, DSN redaction, --app loading."""

from __future__ import annotations

import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from steeple.admin.demo import AcceleratedClock
from steeple.admin.settings import CliError, ExitCode, parse_duration, redact_dsn
from steeple.admin.worker import WorkerApp, _resolve, load_worker_app
from steeple.testing import FakeClock

START = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


class Monotonic:
    def __init__(self) -> None:
        self.value = 100.0

    def __call__(self) -> float:
        return self.value


def test_accelerated_clock_scales_elapsed_time() -> None:
    mono = Monotonic()
    clock = AcceleratedClock(START, 60, monotonic=mono)
    assert clock.now() == START
    mono.value += 1.5
    assert clock.now() == START + timedelta(seconds=90)
    assert clock.now().tzinfo is not None


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.floats(min_value=-50, max_value=50, allow_nan=False), max_size=40),
    st.floats(min_value=0.5, max_value=600),
)
def test_accelerated_clock_never_goes_backwards(steps: list[float], speed: float) -> None:
    mono = Monotonic()
    clock = AcceleratedClock(START, speed, monotonic=mono)
    last = clock.now()
    for step in steps:
        mono.value += step  # even a misbehaving source that steps back
        now = clock.now()
        assert now >= last
        assert now >= START
        last = now


def test_accelerated_clock_refuses_bad_input() -> None:
    with pytest.raises(ValueError, match="aware"):
        AcceleratedClock(datetime(2026, 1, 1), 60)
    for speed in (0, -1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="positive"):
            AcceleratedClock(START, speed)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.floats(min_value=-5, max_value=50, allow_nan=False),
            st.floats(min_value=-120, max_value=600, allow_nan=False),
        ),
        max_size=40,
    ),
    st.floats(min_value=1, max_value=600),
    st.integers(min_value=-7200, max_value=60),
)
def test_accelerated_clock_never_passes_its_ceiling(
    steps: list[tuple[float, float]], speed: float, start_offset: int
) -> None:
    """Capped at real time (issue 10 item 8): never later than the ceiling, never backwards.

    The ceiling (a wall clock) may even step back; then the clock holds still.
    """
    mono = Monotonic()
    wall = FakeClock(START)
    clock = AcceleratedClock(
        START + timedelta(seconds=start_offset), speed, monotonic=mono, ceiling=wall
    )
    last = clock.now()
    assert last <= wall.now()
    highest_wall = wall.now()
    for real, wall_step in steps:
        mono.value += real
        wall.set(wall.now() + timedelta(seconds=wall_step))
        highest_wall = max(highest_wall, wall.now())
        now = clock.now()
        assert now >= last
        assert now <= highest_wall
        assert now <= wall.now() or now == last  # above the wall only by holding still
        last = now


def test_accelerated_clock_follows_real_time_once_it_meets_it() -> None:
    mono = Monotonic()
    wall = FakeClock(START)
    clock = AcceleratedClock(START - timedelta(minutes=10), 60, monotonic=mono, ceiling=wall)
    assert clock.now() == START - timedelta(minutes=10)
    mono.value += 5  # five minutes of schedule time in five seconds
    wall.advance(timedelta(seconds=5))
    assert clock.now() == START - timedelta(minutes=5)
    mono.value += 60  # would be 55 minutes past START: capped at the wall clock
    wall.advance(timedelta(seconds=60))
    assert clock.now() == wall.now()
    mono.value += 1
    wall.advance(timedelta(seconds=1))
    assert clock.now() == wall.now()
    assert "capped" in repr(clock)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("90s", 90),
        ("30s", 30),
        ("5m", 300),
        ("2h", 7200),
        ("7d", 604800),
        ("1h30m", 5400),
        ("250ms", 0.25),
        ("0s", 0),
    ],
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text, what="x") == timedelta(seconds=seconds)


@pytest.mark.parametrize(
    "text", ["", "soon", "5 minutes", "1y", "-5s", "5s junk", "m5", "90", "9" * 200]
)
def test_parse_duration_refuses(text: str) -> None:
    with pytest.raises(CliError) as caught:
        parse_duration(text, what="--older-than")
    assert caught.value.code == ExitCode.USAGE


def test_redact_dsn_hides_passwords_only() -> None:
    assert redact_dsn("postgresql://u:hunter2@h:5432/db") == "postgresql://u:***@h:5432/db"
    assert redact_dsn("postgresql://u@h/db") == "postgresql://u@h/db"
    assert redact_dsn("postgresql://postgres:@/postgres?host=/tmp") == (
        "postgresql://postgres:@/postgres?host=/tmp"
    )


async def test_worker_app_loading(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "apps_for_test.py").write_text(
        "from steeple.admin import WorkerApp\n"
        "from steeple.testing import MemoryBroker\n"
        "ready = WorkerApp(broker=MemoryBroker())\n"
        "async def factory():\n    return WorkerApp(broker=MemoryBroker())\n"
        "empty = WorkerApp()\n"
        "wrong = 42\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    assert isinstance(await _resolve(load_worker_app("apps_for_test:ready")), WorkerApp)
    assert isinstance(await _resolve(load_worker_app("apps_for_test:factory")), WorkerApp)
    for reference, code in (
        ("apps_for_test:missing", ExitCode.CONFIG),
        ("apps_for_test", ExitCode.USAGE),
    ):
        with pytest.raises(CliError) as caught:
            load_worker_app(reference)
        assert caught.value.code == code
    for name in ("empty", "wrong"):
        with pytest.raises(CliError) as caught:
            await _resolve(load_worker_app(f"apps_for_test:{name}"))
        assert caught.value.code == ExitCode.CONFIG
    sys.modules.pop("apps_for_test", None)
