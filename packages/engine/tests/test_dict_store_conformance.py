"""A new store over a plain dict: its storage port and open/close, all else EngineStore's."""

from collections.abc import Sequence
from datetime import datetime
from typing import Any, Self, TypeVar

import attrs

from steeple.core.config import RecurringConfig
from steeple.core.errors import RecurringStorageError
from steeple.core.leases import ClaimRule
from steeple.core.occurrences import OccurrenceState
from steeple.core.ports import Clock, RecurringStore, Sealer
from steeple.engine import EngineStore, RecurringEngine, ports
from steeple.engine.opening import check_parts, install_namespace, open_namespace
from steeple.keyring import Keyring, StorageKey
from steeple.testing.conformance.recurring import run_recurring_conformance

T = TypeVar("T")
States = frozenset[OccurrenceState]
Rows = Sequence[ports.OccurrenceRow]


class _Repository:
    def __init__(self, data: dict[str, Any]) -> None:
        self.data, self.occs = data, data["occurrences"]
        self.defs: dict[str, ports.DefinitionRow] = data["definitions"]
        self.namespace = ports.NamespaceState(
            data["recorded"], len(self.defs), len(self.occs), data["binding"], data["key_id"]
        )

    async def record_namespace(self, recorded: datetime, _defs: int, _occs: int) -> None:
        self.data["recorded"] = recorded  # the counters are the dicts' sizes

    async def reseal_binding(self, binding: bytes, key_id: str) -> None:
        self.data["binding"], self.data["key_id"] = binding, key_id

    async def definition(self, name: str) -> ports.DefinitionRow | None:
        return self.defs.get(name)

    async def definitions(self, after: str | None, limit: int) -> Sequence[ports.DefinitionRow]:
        return [self.defs[n] for n in sorted(self.defs) if after is None or n > after][:limit]

    async def due_definitions(self, due_by: datetime, limit: int) -> Sequence[ports.DefinitionRow]:
        due = [d for d in self.defs.values() if d.next_due_at and d.next_due_at <= due_by]
        return sorted(due, key=lambda d: (d.next_due_at, d.name))[:limit]

    async def definitions_named(self, names: Sequence[str]) -> Sequence[ports.DefinitionRow]:
        return [self.defs[n] for n in dict.fromkeys(names) if n in self.defs]

    async def insert_definitions(self, rows: Sequence[ports.DefinitionRow]) -> None:
        self.defs.update((row.name, row) for row in rows)

    async def update_definitions(self, updates: Sequence[ports.DefinitionUpdate]) -> None:
        for u in updates:  # an update's fields are the row's: name, state, cursor, ...
            self.defs[u.name] = attrs.evolve(self.defs[u.name], **attrs.asdict(u, recurse=False))

    async def occurrences(self, ids: Sequence[str]) -> Rows:
        return [self.occs[i] for i in dict.fromkeys(ids) if i in self.occs]

    async def occurrence_page(self, after: tuple[datetime, str] | None, limit: int) -> Rows:
        rows = sorted(self.occs.values(), key=lambda o: (o.due_at, o.occurrence_id))
        return [o for o in rows if after is None or (o.due_at, o.occurrence_id) > after][:limit]

    async def claimable(self, rule: ClaimRule, now: datetime, limit: int) -> Rows:
        ready = [o for o in self.occs.values() if o.state in rule.states and rule.admits(
            o.state, now, window_ends_at=o.window_ends_at, lease_expires_at=o.lease_expires_at,
            next_attempt_at=o.next_attempt_at)]  # fmt: skip
        return sorted(ready, key=lambda o: (o.due_at, o.definition_name, o.occurrence_id))[:limit]

    async def insert_occurrences(self, rows: Sequence[ports.OccurrenceRow]) -> None:
        self.occs.update((row.occurrence_id, row) for row in rows)

    async def update_occurrences(self, changes: Sequence[ports.OccurrenceChange]) -> None:
        for c in changes:
            self.occs[c.occurrence_id] = c.applied_to(self.occs[c.occurrence_id])

    async def window_ended(self, states: States, ended_by: datetime) -> Rows:
        return [o for o in self.occs.values() if o.state in states and o.window_ends_at <= ended_by]

    async def occurrences_of(self, name: str, states: States) -> Rows:
        return [o for o in self.occs.values() if o.state in states and o.definition_name == name]

    async def delete_occurrences(self, states: States, before: datetime, limit: int) -> int:
        doomed = sorted(
            (o.finished_at, o.due_at, o.definition_name, o.occurrence_id)
            for o in self.occs.values()
            if o.state in states and o.finished_at is not None and o.finished_at < before
        )[:limit]
        for *_, occurrence_id in doomed:
            del self.occs[occurrence_id]
        return len(doomed)


@attrs.define
class _Storage:
    data: dict[str, Any]
    closed: bool = False
    schema: str = "a dict"
    schema_version: int = 1

    async def transaction(self, what: str, work: ports.RepositoryWork[T]) -> T:
        if self.closed:
            raise RecurringStorageError(f"{what}: the store is closed")
        # The work never suspends: one at a time. It runs on a copy, kept if it returns.
        copy = {k: dict(v) if isinstance(v, dict) else v for k, v in self.data.items()}
        result = await work(_Repository(copy))
        self.data.update(copy)
        return result

    async def stored_version(self) -> object:
        return self.data.get("version")

    async def namespace(self) -> ports.StoredNamespace | None:
        d = self.data
        return ports.StoredNamespace(d["binding"], d["recorded"]) if "binding" in d else None

    async def insert_namespace(self, binding: bytes, key_id: str, now: datetime) -> None:
        self.data.update(binding=binding, key_id=key_id, recorded=now)

    async def server_clock(self) -> None:
        return None


class DictRecurringStore(EngineStore):
    def __init__(self, storage: _Storage, config: RecurringConfig, sealer: Sealer, clock: Clock):
        self._storage, self._engine = storage, RecurringEngine(storage, config, sealer, clock)

    @classmethod
    async def initialize(cls, data: dict[str, Any], *parts: Any) -> Self:
        check_parts(*parts, sealer_is="keyring")
        data.update({"version": 1, "definitions": {}, "occurrences": {}} | data)
        await install_namespace(_Storage(data), *parts)
        return await cls.connect(data, *parts)

    @classmethod
    async def connect(cls, data: dict[str, Any], *parts: Any) -> Self:
        check_parts(*parts, sealer_is="keyring")
        await open_namespace(storage := _Storage(data), *parts)
        return cls(storage, *parts)

    async def close(self) -> None:
        self._storage.closed = True


async def make_store(config: RecurringConfig, clock: Clock) -> RecurringStore:
    keyring = Keyring(StorageKey("k1", bytes(range(32))))
    return await DictRecurringStore.initialize({}, config, keyring, clock)


def test_a_store_over_a_plain_dict_passes_the_recurring_conformance_machine() -> None:
    run_recurring_conformance(make_store)
