"""The recurring engine: every recurring-publication operation once, over a small persistence port.

- :class:`EngineStore`: the public face every recurring store shares (the operations and
  what they promise, once); a store subclasses it and adds its storage port and how it
  opens and closes. :mod:`steeple.engine.opening`: the open sequence
  (:func:`install_namespace`, :func:`open_namespace`) over a :class:`NamespaceOpening`.
- :class:`RecurringEngine`: create, cancel, tick, claim, relay, retry_failed, schedules,
  occurrences, purge_terminal, over a :class:`~steeple.engine.ports.RecurringStorage`;
  its relay steps (check, publish, record) are :mod:`steeple.engine.relay_steps`.
- :mod:`steeple.engine.ports`: the port a storage adapter implements (a unit of work
  that locks the namespace's control row and yields a set-based repository of rows).
- :class:`RecurringRelay` (:mod:`steeple.engine.relay_loop`): the relay loop (tick,
  claim, relay) every worker runs, counting what it did in a :class:`RelayStatistics`.
- :mod:`steeple.engine.crashpoints`: the engine's crash points (registered with
  :mod:`steeple.runtime.crashpoints`).

It depends on :mod:`steeple.core` and :mod:`steeple.runtime` (crash points, the loop-lag
monitor its relay runs) only and never imports a driver; the PostgreSQL store, the SQLite
store, the in-memory reference store and any store you compose are adapters plus this
engine.
"""

from steeple.engine.binding import seal_binding, verify_binding
from steeple.engine.engine import PURPOSE_DEFINITION, PURPOSE_OCCURRENCE, RecurringEngine
from steeple.engine.opening import (
    check_parts,
    install_namespace,
    judge_clock,
    open_namespace,
    read_clock,
    recurring_errors,
)
from steeple.engine.ports import (
    DefinitionRow,
    DefinitionUpdate,
    NamespaceOpening,
    NamespaceState,
    OccurrenceChange,
    OccurrenceRow,
    RecurringRepository,
    RecurringStorage,
    RepositoryWork,
    ServerClockReading,
    StoredNamespace,
    apply_step,
)
from steeple.engine.relay_loop import RecurringRelay, RelayStatistics
from steeple.engine.store import EngineStore

__all__ = [
    "PURPOSE_DEFINITION",
    "PURPOSE_OCCURRENCE",
    "DefinitionRow",
    "DefinitionUpdate",
    "EngineStore",
    "NamespaceOpening",
    "NamespaceState",
    "OccurrenceChange",
    "OccurrenceRow",
    "RecurringEngine",
    "RecurringRelay",
    "RecurringRepository",
    "RecurringStorage",
    "RelayStatistics",
    "RepositoryWork",
    "ServerClockReading",
    "StoredNamespace",
    "apply_step",
    "check_parts",
    "install_namespace",
    "judge_clock",
    "open_namespace",
    "read_clock",
    "recurring_errors",
    "seal_binding",
    "verify_binding",
]
