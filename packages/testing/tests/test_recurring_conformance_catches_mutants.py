"""The conformance suite must fail stores that break the contract (it can fail at all)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

import attrs
import pytest
from hypothesis import HealthCheck, Phase, settings

import steeple.core.policies as policies
import steeple.engine.engine as engine
import steeple.engine.namespace_work as namespace_work
import steeple.engine.relay_steps as relay_steps
from steeple.core.config import RecurringConfig, RecurringDefinition
from steeple.core.messages import BrokerReceipt, ScheduledMessage
from steeple.core.occurrences import OccurrenceEvent, OccurrenceState, Step, states_for
from steeple.core.policies import MissedRunPolicy
from steeple.core.policies import _plan_checked as real_plan_checked
from steeple.core.ports import Clock, MessageBroker, RecurringStore
from steeple.core.records import Lease, RelayOutcome, ScheduleInfo
from steeple.testing import InMemoryRecurringStore
from steeple.testing.conformance.recurring import run_recurring_conformance

HUNT = settings(
    max_examples=600,
    derandomize=True,  # a fixed search: the same verdict on every run
    stateful_step_count=40,
    deadline=None,
    phases=[Phase.generate],
    report_multiple_bugs=False,
    database=None,
    suppress_health_check=list(HealthCheck),
)


class _KeyPerAttempt:
    def __init__(self, inner: MessageBroker) -> None:
        self.inner = inner
        self.calls = 0

    async def publish(
        self, message: ScheduledMessage, *, idempotency_key: str, timeout: float
    ) -> BrokerReceipt:
        self.calls += 1
        key = idempotency_key if self.calls == 1 else f"{idempotency_key}-{self.calls}"
        return await self.inner.publish(message, idempotency_key=key, timeout=timeout)


class UnstableKey(InMemoryRecurringStore):
    """Derives a new idempotency key on each relay after the first."""

    _wrappers: dict[int, _KeyPerAttempt]

    async def relay(self, lease: Lease, broker: MessageBroker) -> BrokerReceipt:
        if not hasattr(self, "_wrappers"):
            self._wrappers = {}
        wrapper = self._wrappers.setdefault(id(broker), _KeyPerAttempt(broker))
        return await super().relay(lease, wrapper)


class ReplayRestamps(InMemoryRecurringStore):
    """Replays return fresh metadata instead of the original."""

    async def create(self, definition: RecurringDefinition) -> ScheduleInfo:
        info = await super().create(definition)
        return attrs.evolve(info, created_at=self._clock.now())


class IgnoresBackoff(InMemoryRecurringStore):
    """Claims retry_wait occurrences before their next attempt is due."""

    async def claim(self, limit: int) -> list[Lease]:
        occurrences = self._occurrences
        for key, occ in occurrences.items():
            if occ.state is OccurrenceState.RETRY_WAIT:
                occurrences[key] = attrs.evolve(
                    occ, next_attempt_at=datetime.min.replace(tzinfo=occ.due_at.tzinfo)
                )
        return await super().claim(limit)


class BatchOutOfOrder(InMemoryRecurringStore):
    """Returns a batched relay's outcomes in reverse order."""

    async def relay_many(
        self, leases: Sequence[Lease], broker: MessageBroker, *, concurrency: int = 32
    ) -> list[RelayOutcome]:
        return list(reversed(await super().relay_many(leases, broker, concurrency=concurrency)))


def _factory(store_type: type[InMemoryRecurringStore]) -> Any:
    async def make(config: RecurringConfig, clock: Clock) -> RecurringStore:
        return store_type(config, clock)

    return make


@pytest.mark.parametrize(
    "store_type",
    [UnstableKey, ReplayRestamps, IgnoresBackoff, BatchOutOfOrder],
    ids=lambda t: t.__name__,
)
def test_suite_fails_a_broken_store(store_type: type[InMemoryRecurringStore]) -> None:
    with pytest.raises(AssertionError):
        run_recurring_conformance(_factory(store_type), settings=HUNT)


def _coalesce_as_catch_up(policy: MissedRunPolicy, *args: Any) -> Any:
    return real_plan_checked(MissedRunPolicy.CATCH_UP, *args)


def _never_cancel_leased(event: OccurrenceEvent) -> dict[Step, frozenset[OccurrenceState]]:
    groups = states_for(event)
    if event is not OccurrenceEvent.CANCEL:
        return groups
    return {row: states - {OccurrenceState.LEASED} for row, states in groups.items()}


# The rules live once, in the engine and the core: each mutant breaks one of them there,
# and the in-memory store (the engine over dicts) must then fail the suite.
@pytest.mark.parametrize(
    ("module", "attribute", "replacement"),
    [
        # Coalescing definitions catch up every missed due time (the rule every tick plans
        # with, after its arguments were checked: a namespace tick calls it directly).
        (policies, "_plan_checked", _coalesce_as_catch_up),
        # Leased occurrences are not cancelled.
        (engine, "states_for", _never_cancel_leased),
        # Only published occurrences are ever purged (dead, expired, cancelled pile up).
        (engine, "_PURGEABLE", frozenset({OccurrenceState.PUBLISHED})),
        # The local clock is trusted blindly: no adoption, no clock errors.
        (namespace_work, "adopt_time", lambda recorded, local: local),
        # No fencing: any capability and revision hold a leased occurrence's lease.
        (
            relay_steps,
            "holds_lease",
            lambda digest, revision, capability, presented: digest is not None,
        ),
    ],
    ids=[
        "coalesce-catches-up",
        "leased-never-cancelled",
        "purges-only-published",
        "no-shared-time",
        "no-fencing",
    ],
)
def test_suite_fails_a_store_with_a_broken_rule(
    monkeypatch: pytest.MonkeyPatch, module: object, attribute: str, replacement: object
) -> None:
    monkeypatch.setattr(module, attribute, replacement)
    with pytest.raises(AssertionError):
        run_recurring_conformance(_factory(InMemoryRecurringStore), settings=HUNT)
