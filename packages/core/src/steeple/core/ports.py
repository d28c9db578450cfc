"""Ports: the interfaces adapters implement, as structural protocols."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Protocol, runtime_checkable

from steeple.core.config import RecurringDefinition
from steeple.core.errors import RecurringConflictError
from steeple.core.messages import BrokerReceipt, ScheduledMessage
from steeple.core.records import (
    Lease,
    OccurrenceInfo,
    Page,
    RelayOutcome,
    ScheduleInfo,
    TickResult,
)

__all__ = ["Clock", "MessageBroker", "RandomSource", "RecurringStore", "Sealer"]


@runtime_checkable
class Clock(Protocol):
    """A source of the current instant (aware, UTC).

    A clock that runs on simulated time (a test's, a simulation's) sets a class attribute
    ``simulated = True``: stores that can read their database server's clock then do not
    refuse it for running ahead of the server (:func:`steeple.core.clock.is_simulated`).
    """

    def now(self) -> datetime:
        """Return the current instant."""
        ...


class RandomSource(Protocol):
    """A source of randomness for capabilities, generations and jitter."""

    def token_bytes(self, n: int) -> bytes:
        """Return ``n`` random bytes."""
        ...

    def random(self) -> float:
        """Return a float in [0, 1)."""
        ...


@runtime_checkable
class MessageBroker(Protocol):
    """Where the relay publishes occurrences.

    ``publish`` must deliver the same message under the same ``idempotency_key`` at most
    once to consumers for as long as the broker's dedup window lasts, and finish within
    ``timeout`` seconds. It raises ``steeple.core.errors.BrokerError`` subclasses on failure
    (``permanent`` ones must not be retried) and ``RelayAcknowledgementError`` (carrying the
    receipt) when the broker accepted the message but the acknowledgement is uncertain.

    A broker whose ``publish`` never suspends (a model of one) may say so with a
    ``publishes_in_place`` attribute that is ``True``: the relay then publishes a batch's
    messages one after the other, in the order it would start them concurrently, without
    a task or a deadline each (the results are the same, only cheaper).
    """

    async def publish(
        self, message: ScheduledMessage, *, idempotency_key: str, timeout: float
    ) -> BrokerReceipt:
        """Publish ``message`` under ``idempotency_key`` within ``timeout`` seconds."""
        ...


class Sealer(Protocol):
    """Authenticated encryption bound to a context (the keyring implements this)."""

    @property
    def primary_key_id(self) -> str:
        """The id of the key new seals use."""
        ...

    def seal(self, plaintext: bytes, *, namespace: str, purpose: str, identity: str) -> bytes:
        """Encrypt and authenticate ``plaintext`` for this exact context."""
        ...

    def open(self, sealed: bytes, *, namespace: str, purpose: str, identity: str) -> bytes:
        """Return the plaintext, or raise if tampered or moved to another context."""
        ...


class RecurringStore(Protocol):
    """The recurring-publication store contract; the conformance suite runs it."""

    async def create(self, definition: RecurringDefinition) -> ScheduleInfo:
        """Create an immutable definition, or replay an identical earlier creation."""
        ...

    async def create_many(
        self, definitions: Sequence[RecurringDefinition]
    ) -> list[ScheduleInfo | RecurringConflictError]:
        """Create up to 100 definitions at once: replay or conflict per entry, all or none."""
        ...

    async def tick(self, budget: int) -> TickResult:
        """Materialize due occurrences, at most ``budget`` (1-100), atomically."""
        ...

    async def claim(self, limit: int) -> list[Lease]:
        """Lease up to ``limit`` (1-100) publishable occurrences, fencing earlier holders."""
        ...

    async def relay(self, lease: Lease, broker: MessageBroker) -> BrokerReceipt:
        """Publish the leased occurrence and record the outcome."""
        ...

    async def relay_many(
        self, leases: Sequence[Lease], broker: MessageBroker, *, concurrency: int = ...
    ) -> list[RelayOutcome]:
        """Publish up to 100 leased occurrences concurrently; one outcome per lease, in order."""
        ...

    async def claim_and_relay(
        self, limit: int, broker: MessageBroker, *, concurrency: int = ...
    ) -> list[RelayOutcome]:
        """Claim up to ``limit`` occurrences and relay them (claim and check in one step)."""
        ...

    async def cancel(self, name: str) -> ScheduleInfo:
        """Cancel a definition permanently (its name stays reserved)."""
        ...

    async def retry_failed(self, occurrence_id: str) -> OccurrenceInfo:
        """Give a dead occurrence a fresh operator attempt budget inside its window."""
        ...

    async def schedules(self, after: str | None = None, limit: int = 100) -> Page[ScheduleInfo]:
        """List definitions' metadata after the exclusive cursor."""
        ...

    async def occurrences(self, after: str | None = None, limit: int = 100) -> Page[OccurrenceInfo]:
        """List occurrences' metadata after the exclusive cursor."""
        ...

    async def purge_terminal(self, older_than: datetime, limit: int = 100) -> int:
        """Remove at most ``limit`` terminal occurrences finished before the cutoff.

        The earliest finished go first (a tie: the earliest due first).
        """
        ...

    async def close(self) -> None:
        """Release this store's resources."""
        ...
