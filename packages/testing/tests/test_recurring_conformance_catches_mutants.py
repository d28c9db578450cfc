"""The conformance suite must fail stores that break the contract (it can fail at all)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import attrs
import pytest
from hypothesis import HealthCheck, Phase, settings

import steeple.testing.recurring as memory
from steeple.core.config import RecurringConfig, RecurringDefinition
from steeple.core.messages import BrokerReceipt, ScheduledMessage
from steeple.core.occurrences import OccurrenceState
from steeple.core.policies import MissedRunPolicy
from steeple.core.policies import plan_tick as real_plan_tick
from steeple.core.ports import Clock, MessageBroker, RecurringStore
from steeple.core.records import Lease, ScheduleInfo
from steeple.testing import InMemoryRecurringStore
from steeple.testing.conformance.recurring import run_recurring_conformance

HUNT = settings(
    max_examples=600,
    stateful_step_count=40,
    deadline=None,
    phases=[Phase.generate],
    report_multiple_bugs=False,
    database=None,
    suppress_health_check=list(HealthCheck),
)


class NoFencing(InMemoryRecurringStore):
    """Accepts any lease on a leased occurrence: stale holders can publish."""

    def _holds(self, occ: Any, lease: Lease) -> bool:
        return occ is not None and occ.capability is not None


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
        for occ in self._occurrences.values():
            if occ.state is OccurrenceState.RETRY_WAIT:
                occ.next_attempt_at = datetime.min.replace(tzinfo=occ.due_at.tzinfo)
        return await super().claim(limit)


def _factory(store_type: type[InMemoryRecurringStore]) -> Any:
    async def make(config: RecurringConfig, clock: Clock) -> RecurringStore:
        return store_type(config, clock)

    return make


@pytest.mark.parametrize(
    "store_type", [NoFencing, UnstableKey, ReplayRestamps, IgnoresBackoff], ids=lambda t: t.__name__
)
def test_suite_fails_a_broken_store(store_type: type[InMemoryRecurringStore]) -> None:
    with pytest.raises(AssertionError):
        run_recurring_conformance(_factory(store_type), settings=HUNT)


def _coalesce_as_catch_up(policy: MissedRunPolicy, *args: Any) -> Any:
    return real_plan_tick(MissedRunPolicy.CATCH_UP, *args)


@pytest.mark.parametrize(
    ("attribute", "replacement"),
    [
        # Coalescing definitions catch up every missed due time.
        ("plan_tick", _coalesce_as_catch_up),
        # Leased occurrences are neither cancelled nor expired.
        (
            "_LIVE_STATES",
            frozenset({OccurrenceState.PENDING, OccurrenceState.RETRY_WAIT, OccurrenceState.DEAD}),
        ),
        # Pending work is purged as if it were terminal.
        ("TERMINAL_STATES", frozenset(OccurrenceState)),
        # The local clock is trusted blindly: no adoption, no clock errors.
        ("adopt_time", lambda recorded, local: local),
    ],
    ids=["coalesce-catches-up", "leased-never-cancelled", "purges-pending", "no-shared-time"],
)
def test_suite_fails_a_store_with_a_broken_rule(
    monkeypatch: pytest.MonkeyPatch, attribute: str, replacement: object
) -> None:
    monkeypatch.setattr(memory, attribute, replacement)
    with pytest.raises(AssertionError):
        run_recurring_conformance(_factory(InMemoryRecurringStore), settings=HUNT)
