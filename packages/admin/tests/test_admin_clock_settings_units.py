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
    with pytest.raises(ValueError, match="positive"):
        AcceleratedClock(START, 0)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("90", 90),
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


@pytest.mark.parametrize("text", ["", "soon", "5 minutes", "1y", "-5s", "5s junk", "m5"])
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
