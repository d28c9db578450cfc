"""Named crash points: a test-only hook at every step where a crash could lose or repeat work.

Each product registers the names of its steps (:func:`register_crash_points`) and calls
:func:`crash_point` with one of them at each step: the recurring engine at tick, claim and
relay, the work queue at its claim, renewal, completion and recurring-job
materialization. In production it is a no-op costing one module-level ``None`` check: the
hook is armed only by environment variables read once, when this module is first imported
(or by :func:`arm` in a test's own process). An armed target's name is checked when the
first point is reached, once the products have registered theirs.

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

Only the standard library's ``os`` and ``signal`` are used: no clock, no threads. It lives in
``steeple.runtime``, beside the core, because it does I/O (signals, files) and the core does
none; both products import it, and neither imports the other for it.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Final

__all__ = ["CRASH_POINTS", "arm", "crash_point", "disarm", "register_crash_points"]

_registered: dict[str, str] = {}

CRASH_POINTS: Final[Mapping[str, str]] = MappingProxyType(_registered)
"""Every registered crash point's name and what has happened when it is reached (read-only).

Empty until the products that define points are imported: the recurring engine registers
its own (:mod:`steeple.engine.crashpoints`), the work queue its own.
"""


def register_crash_points(points: Mapping[str, str]) -> None:
    """Register a product's crash points: each name with what has happened when it is reached.

    Registering a name again with the same meaning does nothing (a module imported twice);
    with another meaning it is refused.

    Raises:
        ValueError: a name that is empty or already registered with another meaning.
    """
    for name, meaning in points.items():
        if not name or not isinstance(name, str):
            raise ValueError(f"a crash point needs a non-empty name, not {name!r}")
        known = _registered.get(name)
        if known is not None and known != meaning:
            raise ValueError(f"crash point {name!r} is already registered as {known!r}")
    _registered.update(points)


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
    if not name:
        raise ValueError(f"crash point {spec!r}: no name")
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
        # The target is checked when a point is first reached: by then the product that
        # reaches it has registered its names (it may be imported after this module).
        if target is not None and target[0] not in CRASH_POINTS:
            raise ValueError(
                f"unknown crash point {target[0]!r} (registered: {', '.join(sorted(CRASH_POINTS))})"
            )
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
