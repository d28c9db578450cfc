"""The event-loop lag monitor: a blocked loop is measured, and the code that blocked it named.

The blocking code here waits (synchronously, blocking the loop) until the watchdog thread
has reported the stall, so no test depends on how long anything takes.
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from steeple.core.errors import (
    ConfigurationError,
    ConfigurationTypeError,
    RecurringConfigurationError,
)
from steeple.engine import RecurringRelay
from steeple.runtime.looplag import LoopLagMonitor, LoopStall, watching_event_loop
from steeple.testing import MemoryBroker

WATCHDOG = "steeple loop-lag watchdog"


class _Seen(logging.Handler):
    """Collects the monitor's records; ``blocked`` is set by the watchdog's first report."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []
        self.blocked = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        self.messages.append(message)
        if "has been blocked" in message:
            self.blocked.set()


@pytest.fixture
def seen() -> Iterator[_Seen]:
    handler = _Seen()
    logger = logging.getLogger("steeple.runtime.looplag")
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)


def careless_wait(seen: _Seen) -> None:
    """Block the calling thread (the event loop's) until the watchdog has seen it."""
    assert seen.blocked.wait(30), "the watchdog never reported the blocked loop"


async def blocking_handler(seen: _Seen) -> str:
    await asyncio.sleep(0)
    careless_wait(seen)  # a synchronous wait inside async code
    return "done"


async def until(condition: Callable[[], bool]) -> None:
    """Wait until ``condition()`` holds (polling; a hang fails the test's timeout)."""
    while not condition():  # noqa: ASYNC110 - the state polled is not an event
        await asyncio.sleep(0.01)


async def _watchdogs() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == WATCHDOG]


async def test_a_blocked_loop_is_reported_naming_the_task_and_the_code(seen: _Seen) -> None:
    stalls: list[LoopStall] = []
    async with watching_event_loop(0.05, on_stall=stalls.append) as monitor:
        assert monitor is not None
        await asyncio.sleep(monitor.interval * 3)  # the monitor measures before the block
        task = asyncio.create_task(blocking_handler(seen), name="steeple task 'report' #7")
        assert await task == "done"
        await until(lambda: bool(stalls))  # reported at the monitor's next wake-up
    [stall] = stalls
    assert stall.task == "steeple task 'report' #7"
    assert stall.where is not None
    assert stall.where.startswith("careless_wait (test_loop_lag_monitor.py:")
    assert "<- blocking_handler (test_loop_lag_monitor.py:" in stall.where
    # ... and the call that blocks, in the standard library
    assert re.search(r", blocked in Condition\.wait \(threading\.py:\d+\)$", stall.where)
    assert stall.lag > 0.05
    assert monitor.statistics.stalls == 1
    assert monitor.statistics.max_lag == pytest.approx(stall.lag)
    assert monitor.statistics.checks >= 2
    during, after = [m for m in seen.messages if "blocked" in m or "stalled" in m]
    assert "has been blocked for" in during
    assert "careless_wait" in during
    assert "stalled for" in after
    assert "task \"steeple task 'report' #7\"" in after
    assert "careless_wait" in after
    assert "blocking_handler" in after
    assert await _watchdogs() == []  # the thread ended with the monitor


async def test_a_loop_that_is_not_blocked_reports_nothing(seen: _Seen) -> None:
    async with watching_event_loop(5.0) as monitor:
        assert monitor is not None
        await until(lambda: monitor.statistics.checks >= 3)
    assert monitor.statistics.stalls == 0
    assert monitor.statistics.max_lag < 5.0
    assert seen.messages == []


async def test_one_monitor_per_loop_shared_until_the_last_user_leaves() -> None:
    first_stalls: list[LoopStall] = []
    async with watching_event_loop(0.2, on_stall=first_stalls.append) as first:
        async with watching_event_loop(1.0) as second:
            assert second is first
            assert first is not None
            assert first.threshold == 0.2  # the first caller's
            await until(lambda: first.statistics.checks > 0)
            assert len(await _watchdogs()) == 1
        # the first user still runs it
        assert len(await _watchdogs()) == 1
        checks = first.statistics.checks
        await until(lambda: first.statistics.checks > checks)
    assert await _watchdogs() == []
    async with watching_event_loop(0.3) as fresh:
        assert fresh is not first
        assert fresh is not None
        assert fresh.threshold == 0.3


async def test_none_turns_detection_off() -> None:
    async with watching_event_loop(None) as monitor:
        assert monitor is None
        assert await _watchdogs() == []


def test_a_stall_the_watchdog_missed_says_so() -> None:
    assert LoopStall(1.5).describe() == "by code that returned before it could be sampled"
    assert LoopStall(1.5, "t", None).describe() == "by task 't'"
    assert LoopStall(1.5, None, "f (a.py:1)").describe() == "by code outside any task: f (a.py:1)"


def test_a_listener_removed_is_not_called() -> None:
    monitor = LoopLagMonitor(0.1)
    calls: list[LoopStall] = []
    monitor.add_listener(calls.append)
    monitor.remove_listener(calls.append)
    monitor.remove_listener(calls.append)  # twice: no error
    before = time.monotonic()
    monitor._measured(0.5, before)
    assert calls == []
    assert monitor.statistics.stalls == 1


BAD_THRESHOLDS: list[tuple[Any, type[Exception]]] = [
    (float("nan"), ConfigurationError),
    (float("inf"), ConfigurationError),
    (-1.0, ConfigurationError),
    (0, ConfigurationError),
    (0.001, ConfigurationError),
    (10**400, ConfigurationError),
    (3601, ConfigurationError),
    ("0.5", ConfigurationTypeError),
    (True, ConfigurationTypeError),
    (b"1", ConfigurationTypeError),
]


@pytest.mark.parametrize(("value", "error"), BAD_THRESHOLDS)
async def test_hostile_thresholds_are_refused(value: Any, error: type[Exception]) -> None:
    with pytest.raises(error, match="loop_lag_threshold"):
        LoopLagMonitor(value)
    with pytest.raises(error, match="loop_lag_threshold"):
        async with watching_event_loop(value):
            pass
    with pytest.raises(RecurringConfigurationError, match="loop_lag_threshold"):
        RecurringRelay(object(), MemoryBroker(), loop_lag_threshold=value)  # type: ignore[arg-type]


@pytest.mark.parametrize("interval", [0.0, 0.5, 1.0, float("nan"), "x", True])
def test_an_interval_not_below_the_threshold_is_refused(interval: Any) -> None:
    with pytest.raises(ConfigurationError, match="interval"):
        LoopLagMonitor(0.5, interval=interval)
