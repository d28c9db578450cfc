"""The recurring engine: every recurring-publication operation once, over a small persistence port.

- :class:`RecurringEngine`: create, cancel, tick, claim, relay, retry_failed, schedules,
  occurrences, purge_terminal, over a :class:`~steeple.engine.ports.RecurringStorage`.
- :mod:`steeple.engine.ports`: the port a storage adapter implements (a unit of work
  that locks the namespace's control row and yields a set-based repository of rows).
- :class:`RecurringRelay`: the relay loop (tick, claim, relay) every worker runs, counting
  what it did in a :class:`RelayStatistics`.
- :mod:`steeple.engine.crashpoints`: the engine's crash points (registered with
  :mod:`steeple.runtime.crashpoints`).

It depends on :mod:`steeple.core` and :mod:`steeple.runtime` (crash points, the loop-lag
monitor its relay runs) only and never imports a driver; the PostgreSQL store,
the in-memory reference store and any store you compose are adapters plus this engine.
"""

from steeple.engine.binding import seal_binding, verify_binding
from steeple.engine.engine import PURPOSE_DEFINITION, PURPOSE_OCCURRENCE, RecurringEngine
from steeple.engine.opening import read_clock, recurring_errors
from steeple.engine.ports import (
    DefinitionRow,
    DefinitionUpdate,
    NamespaceState,
    OccurrenceChange,
    OccurrenceRow,
    RecurringRepository,
    RecurringStorage,
    apply_step,
)
from steeple.engine.relay import RecurringRelay, RelayStatistics

__all__ = [
    "PURPOSE_DEFINITION",
    "PURPOSE_OCCURRENCE",
    "DefinitionRow",
    "DefinitionUpdate",
    "NamespaceState",
    "OccurrenceChange",
    "OccurrenceRow",
    "RecurringEngine",
    "RecurringRelay",
    "RecurringRepository",
    "RecurringStorage",
    "RelayStatistics",
    "apply_step",
    "read_clock",
    "recurring_errors",
    "seal_binding",
    "verify_binding",
]
