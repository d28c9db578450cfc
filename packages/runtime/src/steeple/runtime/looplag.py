"""Event-loop lag detection: name the code that blocks a worker's event loop.

A handler or broker that calls blocking code inside ``async def`` (``time.sleep``, a
synchronous HTTP client, a long computation) stops every coroutine of its event loop:
lease renewals, heartbeats, the relay's other publications. Past a lease, the work is
taken over by another worker and the blocked one's late outcome is fenced -- correct, but
silent. The monitor makes it loud.

It has two halves, standard library only:

- a periodic task on the loop sleeps ``interval`` seconds and measures how late it wakes
  (the scheduling lag); a lag over ``threshold`` is a *stall*: counted, logged as a
  warning when the loop runs again, and passed to listeners (the work queue records it as
  a metric);
- a watchdog thread notices a stall while it is happening (the loop's last wake-up is
  older than ``threshold``) and samples, once per stall, the asyncio task the loop is
  running and the innermost frames of the loop's thread: the blocking code, named. It
  logs right away, so a loop that never comes back is still reported.

One monitor runs per event loop: :func:`watching_event_loop` starts it for the first
caller and shares it with later ones (the work-queue worker and the recurring relay of one
``steeple worker`` process).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import os
import sys
import sysconfig
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable
from types import FrameType
from typing import Final

import attrs

from steeple.core.errors import ConfigurationError, ConfigurationTypeError

__all__ = [
    "DEFAULT_LOOP_LAG_THRESHOLD",
    "LoopLagMonitor",
    "LoopLagStatistics",
    "LoopStall",
    "check_loop_lag_threshold",
    "watching_event_loop",
]

_log = logging.getLogger("steeple.runtime.looplag")

DEFAULT_LOOP_LAG_THRESHOLD: Final = 0.5
"""Seconds of lag that count as a stall unless configured otherwise."""

_MIN_THRESHOLD, _MAX_THRESHOLD = 0.01, 3600.0
_FRAMES_SHOWN: Final = 3
_FRAMES_SEARCHED: Final = 200
# Frames of the event loop's own machinery are not the culprit: skipped when naming it.
_MACHINERY: Final = (
    os.path.dirname(asyncio.__file__) + os.sep,
    os.path.join(os.path.dirname(os.__file__), "selectors.py"),
    os.path.join(os.path.dirname(os.__file__), "contextvars.py"),
)


@attrs.frozen
class LoopStall:
    """One stall of the event loop, reported once the loop runs again.

    Attributes:
        lag: seconds the monitor's wake-up ran late (the loop ran nothing else meanwhile).
        task: the name of the asyncio task the loop was running when the stall was seen,
            ``None`` if the stall ended before the watchdog sampled it.
        where: the innermost frames of the code running then, innermost first
            (``function (file:line) <- caller (file:line)``), or ``None``.
    """

    lag: float
    task: str | None = None
    where: str | None = None

    def describe(self) -> str:
        """Describe the culprit in words (for a log line)."""
        if self.task is None and self.where is None:
            return "by code that returned before it could be sampled"
        who = f"task {self.task!r}" if self.task is not None else "code outside any task"
        return f"by {who}" + (f": {self.where}" if self.where else "")


@attrs.define
class LoopLagStatistics:
    """What a :class:`LoopLagMonitor` has measured so far.

    Attributes:
        checks: wake-ups measured.
        stalls: wake-ups later than the threshold.
        last_lag: the latest lag measured, in seconds.
        max_lag: the largest lag measured, in seconds.
    """

    checks: int = 0
    stalls: int = 0
    last_lag: float = 0.0
    max_lag: float = 0.0


def check_loop_lag_threshold(value: object) -> float:
    """Return ``value`` as a loop-lag threshold in seconds.

    Raises:
        ConfigurationError: NaN, infinite, or outside 0.01 .. 3600 s.
        ConfigurationTypeError: not a number.
    """
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigurationTypeError(
            f"loop_lag_threshold must be seconds (a number) or None, not {type(value).__name__}"
        )
    try:
        seconds = float(value)
    except OverflowError:  # an int beyond any float
        seconds = math.inf
    if not (math.isfinite(seconds) and _MIN_THRESHOLD <= seconds <= _MAX_THRESHOLD):
        raise ConfigurationError(
            f"loop_lag_threshold must be between {_MIN_THRESHOLD} and {_MAX_THRESHOLD:g} "
            "seconds (or None to turn loop-lag detection off)"
        )
    return seconds


class LoopLagMonitor:
    """Measures the lag of the running event loop and names the code that stalls it.

    Args:
        threshold: seconds of lag that count as a stall (0.01 .. 3600).
        interval: seconds between measurements (default: a fifth of the threshold,
            at most 0.25 s); the watchdog thread samples as often.

    Raises:
        ConfigurationError: a threshold or interval that is NaN, infinite, out of range,
            or an interval not below the threshold.
        ConfigurationTypeError: a threshold or interval that is not a number.
    """

    def __init__(
        self, threshold: float = DEFAULT_LOOP_LAG_THRESHOLD, *, interval: float | None = None
    ):
        self.threshold = check_loop_lag_threshold(threshold)
        if interval is None:
            interval = min(0.25, self.threshold / 5)
        elif isinstance(interval, bool) or not isinstance(interval, int | float):
            raise ConfigurationTypeError(f"interval must be seconds, not {type(interval).__name__}")
        if not (math.isfinite(interval) and 0.001 <= interval < self.threshold):
            raise ConfigurationError("interval must be at least 0.001 s and below the threshold")
        self.interval = float(interval)
        self.statistics = LoopLagStatistics()
        self._listeners: list[Callable[[LoopStall], None]] = []
        self._beat = time.monotonic()
        # (the wake-up a stall followed, the task, the frames): written by the watchdog.
        self._sample: tuple[float, str | None, str | None] | None = None

    def __repr__(self) -> str:
        return f"LoopLagMonitor(threshold={self.threshold:g})"

    def add_listener(self, listener: Callable[[LoopStall], None]) -> None:
        """Call ``listener(stall)`` on the loop after each stall (it must not block)."""
        self._listeners.append(listener)

    def remove_listener(self, listener: Callable[[LoopStall], None]) -> None:
        """Stop calling ``listener`` (no error if it was not added)."""
        with contextlib.suppress(ValueError):
            self._listeners.remove(listener)

    async def run(self) -> None:
        """Measure until cancelled (start it as a task of the loop to watch)."""
        loop = asyncio.get_running_loop()
        stop = threading.Event()
        watchdog = threading.Thread(
            target=self._watch,
            args=(loop, threading.get_ident(), stop),
            name="steeple loop-lag watchdog",
            daemon=True,
        )
        self._beat = time.monotonic()
        watchdog.start()
        try:
            while True:
                before = self._beat
                await asyncio.sleep(self.interval)
                now = time.monotonic()
                self._beat = now
                self._measured(max(0.0, now - before - self.interval), before)
        finally:
            stop.set()
            watchdog.join(timeout=1.0)

    def _measured(self, lag: float, before: float) -> None:
        stats = self.statistics
        stats.checks += 1
        stats.last_lag = lag
        stats.max_lag = max(stats.max_lag, lag)
        if lag <= self.threshold:
            return
        stats.stalls += 1
        sample = self._sample
        if sample is not None and sample[0] == before:
            stall = LoopStall(lag, sample[1], sample[2])
        else:
            stall = LoopStall(lag)
        _log.warning(
            "the event loop stalled for %.2f s (loop-lag threshold %.2f s) %s; nothing else "
            "on this loop ran meanwhile (lease renewals, heartbeats, other handlers)",
            lag,
            self.threshold,
            stall.describe(),
        )
        for listener in list(self._listeners):
            listener(stall)

    def _watch(
        self, loop: asyncio.AbstractEventLoop, thread_id: int, stop: threading.Event
    ) -> None:
        """Run the watchdog thread: sample the culprit of each stall while it lasts."""
        sampled: float | None = None
        while not stop.wait(self.interval):
            beat = self._beat
            blocked = time.monotonic() - beat - self.interval
            if blocked <= self.threshold or beat == sampled:
                continue
            sampled = beat
            task, where = _culprit(loop, thread_id)
            self._sample = (beat, task, where)
            stall = LoopStall(blocked, task, where)
            _log.warning(
                "the event loop has been blocked for %.2f s so far (loop-lag threshold %.2f s) %s",
                blocked,
                self.threshold,
                stall.describe(),
            )


def _library(filename: str) -> bool:
    return any(f"{os.sep}{d}{os.sep}" in filename for d in ("site-packages", "dist-packages"))


@functools.cache
def _stdlib_dir() -> str:
    return sysconfig.get_paths()["stdlib"] + os.sep


def _stdlib(filename: str) -> bool:
    return filename.startswith(_stdlib_dir()) and not _library(filename)


def _culprit(loop: asyncio.AbstractEventLoop, thread_id: int) -> tuple[str | None, str | None]:
    """Return the task ``loop`` is running and the code its thread is in, in words.

    The code is named by its innermost application frames (neither the standard library
    nor an installed package, when there are any), innermost first, and by the call that
    blocks when that is elsewhere (``..., blocked in Condition.wait (threading.py:331)``).
    """
    task_name: str | None = None
    try:
        current = asyncio.current_task(loop)
    except RuntimeError:  # the loop is closing
        current = None
    if current is not None:
        task_name = current.get_name()
    frame: FrameType | None = sys._current_frames().get(thread_id)
    frames: list[tuple[str, str]] = []  # (file name, "function (file:line)")
    try:
        while frame is not None and len(frames) < _FRAMES_SEARCHED:
            code = frame.f_code
            if not code.co_filename.startswith(_MACHINERY):
                name = getattr(code, "co_qualname", code.co_name)
                where = f"{name} ({os.path.basename(code.co_filename)}:{frame.f_lineno})"
                frames.append((code.co_filename, where))
            frame = frame.f_back
    finally:
        del frame
    if not frames:
        return task_name, None
    shown = (
        [w for f, w in frames if not _stdlib(f) and not _library(f)]
        or [w for f, w in frames if not _stdlib(f)]
        or [w for _, w in frames]
    )[:_FRAMES_SHOWN]
    text = " <- ".join(shown)
    if frames[0][1] != shown[0]:
        text += f", blocked in {frames[0][1]}"
    return task_name, text


@attrs.define(eq=False)
class _Shared:
    """The monitor of one loop, its task, and how many callers use it."""

    monitor: LoopLagMonitor
    task: asyncio.Task[None]
    users: int = 0


_running: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Shared]
_running = weakref.WeakKeyDictionary()


@contextlib.asynccontextmanager
async def watching_event_loop(
    threshold: float | None = DEFAULT_LOOP_LAG_THRESHOLD,
    *,
    on_stall: Callable[[LoopStall], None] | None = None,
) -> AsyncIterator[LoopLagMonitor | None]:
    """Watch the running event loop for stalls while the block runs.

    The first caller on a loop starts a :class:`LoopLagMonitor` with its ``threshold``;
    callers that come while it runs share it (and its threshold); the last one to leave
    stops it. ``on_stall`` is called on the loop after each stall while the block runs.

    Args:
        threshold: seconds of lag that count as a stall, or ``None`` to watch nothing
            (the block then gets ``None``).
        on_stall: called with each :class:`LoopStall` (it must not block).

    Raises:
        ConfigurationError: a threshold that is NaN, infinite, or outside 0.01 .. 3600 s.
        ConfigurationTypeError: a threshold that is not a number.
    """
    if threshold is None:
        yield None
        return
    check_loop_lag_threshold(threshold)
    loop = asyncio.get_running_loop()
    shared = _running.get(loop)
    if shared is None:
        monitor = LoopLagMonitor(threshold)
        task = loop.create_task(monitor.run(), name="steeple loop-lag monitor")
        shared = _running[loop] = _Shared(monitor, task)
    shared.users += 1
    monitor = shared.monitor
    if on_stall is not None:
        monitor.add_listener(on_stall)
    try:
        yield monitor
    finally:
        if on_stall is not None:
            monitor.remove_listener(on_stall)
        shared.users -= 1
        if shared.users == 0:
            if _running.get(loop) is shared:
                del _running[loop]
            shared.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await shared.task
