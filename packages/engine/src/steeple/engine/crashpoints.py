"""The recurring engine's crash points, registered with :mod:`steeple.runtime.crashpoints`.

Each step of the engine's transactions (tick, claim, the relay's check and record) has a
``.begin``, ``.written`` and ``.committed`` point, and the relay has points around the
broker call. The engine's modules import :func:`crash_point` from here, so the names are
registered before any of them is reached.
"""

from __future__ import annotations

from typing import Final

from steeple.runtime.crashpoints import crash_point, register_crash_points

__all__ = ["ENGINE_CRASH_POINTS", "crash_point"]

_STEPS: Final = ("begin", "written", "committed")

ENGINE_CRASH_POINTS: Final[dict[str, str]] = {
    # each step of a transaction (see RecurringEngine._run)
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
}
"""The recurring engine's crash points and what has happened when each is reached."""

register_crash_points(ENGINE_CRASH_POINTS)
