"""Runtime pieces both products use: crash points, the loop-lag monitor, SQLite lock waits.

- :mod:`steeple.runtime.crashpoints`: named crash points, a test-only hook at every step
  where a crash could lose or repeat work; each product registers its own step names.
- :mod:`steeple.runtime.looplag`: event-loop lag detection (:class:`LoopLagMonitor`),
  which names the code that blocks a worker's event loop.
- :mod:`steeple.runtime.sqlitelock`: the wait for a locked SQLite file, shared by the
  SQLite store and the SQLite journal.

They do I/O the pure core may not (signals, files, a watchdog thread, the monotonic
clock), so they live here: the recurring engine and the work queue import this package,
never each other. It depends on :mod:`steeple.core` and ``attrs`` only.
"""

from steeple.runtime.crashpoints import (
    CRASH_POINTS,
    arm,
    crash_point,
    disarm,
    register_crash_points,
)
from steeple.runtime.looplag import (
    DEFAULT_LOOP_LAG_THRESHOLD,
    LoopLagMonitor,
    LoopLagStatistics,
    LoopStall,
    check_loop_lag_threshold,
    watching_event_loop,
)

__all__ = [
    "CRASH_POINTS",
    "DEFAULT_LOOP_LAG_THRESHOLD",
    "LoopLagMonitor",
    "LoopLagStatistics",
    "LoopStall",
    "arm",
    "check_loop_lag_threshold",
    "crash_point",
    "disarm",
    "register_crash_points",
    "watching_event_loop",
]
