"""Named crash points: a test-only hook at every step where a crash could lose or repeat work.

The engine and the adapters call :func:`crash_point` with a registered name at each step
of tick, claim, relay, and the work queue's claim, renewal, completion and recurring-job
materialization. In production it is a no-op costing one module-level ``None`` check: the
hook is armed only by environment variables read once, when this module is first imported
(or by :func:`arm` in a test's own process).

``STEEPLE_CRASH_AT=name[:nth]``
    The process kills itself with ``SIGKILL`` the ``nth`` time (default the first) it
    reaches ``name``: no ``finally`` block, no ``atexit``, no flush runs, as in a power cut.
``STEEPLE_CRASH_PAUSE=name[:nth]`` with ``STEEPLE_CRASH_DIR=dir``
    The process writes ``dir/paused`` (holding the name) and then blocks, event loop and
    all, until something writes to the FIFO ``dir/release`` (which the test creates): the
    test restarts PostgreSQL under a process frozen mid-step, then lets it go on.
``STEEPLE_CRASH_TRACE=path``
    Appends each name to ``path`` the first time it is reached (the registry test reads it
    to prove every registered point is reached by some scenario).

Only the standard library's ``os`` and ``signal`` are used: no clock, no threads. It lives in the
engine, beside the core, because it does I/O (signals, files) and the core does none.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from typing import Final

__all__ = ["CRASH_POINTS", "arm", "crash_point", "disarm"]

_STEPS: Final = ("begin", "written", "committed")

CRASH_POINTS: Final[dict[str, str]] = {
    # the recurring engine: each step of a transaction (see RecurringEngine._run)
    **{
        f"{operation}.{step}": f"{operation}: {meaning}"
        for operation in ("tick", "claim", "relay.check", "relay.record")
        for step, meaning in zip(
            _STEPS,
            (
                "before the transaction starts",
                "after every write, before COMMIT is sent",
                "after COMMIT returned, before the result is used",
            ),
            strict=True,
        )
    },
    "tick.inserted": "tick: occurrences inserted, definitions' cursors not yet advanced",
    "relay.before_publish": "relay: the lease checked and committed, before the broker call",
    "relay.broker_accepted": (
        "relay: the broker stored the publication but has not confirmed it (reached by "
        "brokers that call it: the test brokers)"
    ),
    "relay.after_confirm": "relay: the broker confirmed, before the outcome is recorded",
    # the work queue: each statement commits on its own
    "queue.claim.before": "queue claim: before the claim statement is sent",
    "queue.claim.committed": "queue claim: tasks leased, before any handler starts",
    "queue.renew.before": "queue renewal: before the renewal statement is sent",
    "queue.renew.committed": "queue renewal: leases extended, before the worker knows",
    "queue.complete.before": "queue completion: handler done, before the completion is sent",
    "queue.complete.committed": "queue completion: committed (acknowledged), before counted",
    "queue.retry.before": "queue failure: before the retry is recorded",
    "queue.retry.committed": "queue failure: retry recorded, before the worker knows",
    "queue.recover.before": "lease recovery: before expired leases are taken back",
    "queue.recover.committed": "lease recovery: expired tasks made pending, before the wake-up",
    "queue.materialize.begin": "recurring jobs: before the materializing transaction",
    "queue.materialize.inserted": "recurring jobs: a task inserted, the job's cursor not advanced",
    "queue.materialize.committed": "recurring jobs: tasks and cursors committed",
}
"""Every crash point's name and what has happened when it is reached."""

_hook: Callable[[str], None] | None = None


def crash_point(name: str) -> None:
    """Mark a named step; does nothing unless a test armed the hook."""
    if _hook is not None:
        _hook(name)


def arm(hook: Callable[[str], None]) -> None:
    """Call ``hook(name)`` at every crash point from now on (in-process tests)."""
    global _hook
    _hook = hook


def disarm() -> None:
    """Make every crash point a no-op again."""
    global _hook
    _hook = None


def _target(spec: str) -> tuple[str, int]:
    name, _, nth = spec.partition(":")
    if name not in CRASH_POINTS:
        raise ValueError(f"unknown crash point {name!r} (see steeple.engine.crashpoints)")
    count = int(nth) if nth else 1
    if count < 1:
        raise ValueError(f"crash point {spec!r}: the count must be 1 or more")
    return name, count


def _from_environment(env: dict[str, str]) -> Callable[[str], None] | None:
    kill_at = env.get("STEEPLE_CRASH_AT")
    pause_at = env.get("STEEPLE_CRASH_PAUSE")
    trace = env.get("STEEPLE_CRASH_TRACE")
    if not (kill_at or pause_at or trace):
        return None
    target = _target(kill_at or pause_at or "") if (kill_at or pause_at) else None
    directory = env.get("STEEPLE_CRASH_DIR", "")
    if pause_at and not directory:
        raise ValueError("STEEPLE_CRASH_PAUSE needs STEEPLE_CRASH_DIR")
    seen: dict[str, int] = {}

    def hook(name: str) -> None:
        if name not in CRASH_POINTS:
            raise AssertionError(f"crash point {name!r} is not registered")
        count = seen.get(name, 0) + 1
        seen[name] = count
        if trace and count == 1:
            with open(trace, "a", encoding="utf-8") as out:
                out.write(name + "\n")
        if target is None or (name, count) != target:
            return
        if kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        # Paused: say where, then block until the test writes to the release FIFO.
        paused = os.path.join(directory, "paused")
        with open(paused + ".tmp", "w", encoding="utf-8") as out:
            out.write(name)
        os.replace(paused + ".tmp", paused)
        with open(os.path.join(directory, "release"), encoding="utf-8") as fifo:
            fifo.read()

    return hook


_hook = _from_environment(dict(os.environ))
