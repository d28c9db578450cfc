"""The simulated broker: a deduplicating broker in front of which a seeded failure model runs."""

from __future__ import annotations

import random as _random
from typing import Final

import attrs

from steeple.core.errors import BrokerUnavailableError, RelayAcknowledgementError
from steeple.core.messages import BrokerReceipt, ScheduledMessage, trusted_receipt
from steeple.core.ports import MessageBroker
from steeple.testing.simulation._scenario import BrokerModel
from steeple.testing.simulation._timeline import to_us

__all__ = ["SimulatedBroker"]

_NAME: Final = "simulated"


@attrs.define(repr=False)
class SimulatedBroker:
    """A :class:`~steeple.core.ports.MessageBroker` whose failures follow a :class:`BrokerModel`.

    The simulator tells it when a batch starts (:meth:`begin`, microseconds since the
    epoch), how many publications run at once and how long each takes: the ``k``-th
    publication of the batch (in the order they are made) starts at
    ``start + (k // concurrency) * latency``, and the failure model judges it at that
    instant. In an outage every publication raises :class:`BrokerUnavailableError`;
    otherwise one seeded draw per publication decides between a failure, an accepted
    publication whose acknowledgement is lost (:class:`RelayAcknowledgementError` with the
    receipt) and a plain acceptance. Acceptance goes to ``inner`` when one is given (a
    :class:`~steeple.testing.MemoryBroker`, for instance); otherwise this broker
    deduplicates by idempotency key itself, keeping only the keys it was told are not
    settled yet (``settle``), so a simulated year does not hold a million keys.

    Attributes:
        model: outages and rates.
        seed: seeds the failure draws (independent of the store's random source).
        inner: the broker that accepts publications, if not this one.
        now_us: when the current publication starts (microseconds since the epoch).
        concurrency: publications of a batch in flight at once.
        latency_us: how long one publication takes (microseconds; 0: no time).
        slots: publications made in the current batch.
        accepted_at: when each accepted publication of the current batch ended (its
            acknowledgement arrived), by idempotency key.
        accepted: publications accepted (first copies).
        duplicates: publications recognised by their idempotency key.
    """

    model: BrokerModel
    seed: int
    inner: MessageBroker | None = None
    now_us: int = 0
    concurrency: int = 1
    latency_us: int = 0
    batch_start_us: int = attrs.field(default=0, init=False)
    slots: int = attrs.field(default=0, init=False)
    accepted_at: dict[str, int] = attrs.field(factory=dict, init=False)
    accepted: int = attrs.field(default=0, init=False)
    duplicates: int = attrs.field(default=0, init=False)
    _outages: tuple[tuple[int, int], ...] = attrs.field(default=(), init=False)
    _rng: _random.Random = attrs.field(init=False)
    _keys: dict[str, None] = attrs.field(factory=dict, init=False)
    """The accepted keys not settled yet."""

    def __attrs_post_init__(self) -> None:
        self._rng = _random.Random(f"steeple-broker:{self.seed}")  # noqa: S311 - a model, not secrets
        self._outages = tuple((to_us(o.start), to_us(o.end)) for o in self.model.outages)

    @property
    def publishes_in_place(self) -> bool:
        """Whether ``publish`` never waits: true without an inner broker.

        The relay then publishes a batch's messages one after the other, in order,
        without a task or a deadline each.
        """
        return self.inner is None

    def begin(self, start_us: int) -> None:
        """Start a batch at ``start_us``: its first publications start then."""
        self.batch_start_us = self.now_us = start_us
        self.slots = 0
        self.accepted_at.clear()

    def batch_end(self) -> int:
        """Return when the current batch's last publication ends (its start if it made none)."""
        waves = -(-self.slots // self.concurrency)
        return self.batch_start_us + waves * self.latency_us

    def down(self, at_us: int) -> bool:
        """Return whether the broker is in an outage at ``at_us``."""
        return any(start <= at_us < end for start, end in self._outages)

    async def publish(
        self, message: ScheduledMessage, *, idempotency_key: str, timeout: float
    ) -> BrokerReceipt:
        """Publish under the failure model.

        Raises:
            BrokerUnavailableError: an outage, or a drawn failure (retryable).
            RelayAcknowledgementError: accepted, but the acknowledgement was lost.
        """
        slot = self.slots
        self.slots = slot + 1
        self.now_us = now = self.batch_start_us + (slot // self.concurrency) * self.latency_us
        if self._outages and self.down(now):
            raise BrokerUnavailableError("simulated broker outage")
        model = self.model
        lose_ack = False
        if model.failure_rate or model.ack_loss_rate:
            draw = self._rng.random()
            if draw < model.failure_rate:
                raise BrokerUnavailableError("simulated broker failure")
            lose_ack = draw < model.failure_rate + model.ack_loss_rate
        if self.inner is not None:
            receipt = await self.inner.publish(
                message, idempotency_key=idempotency_key, timeout=timeout
            )
            if receipt.duplicate:
                self.duplicates += 1
            else:
                self.accepted += 1
        else:
            # The relay derived the key: receipts are built without checks.
            keys = self._keys
            if idempotency_key in keys:
                receipt = trusted_receipt(_NAME, idempotency_key, duplicate=True)
                self.duplicates += 1
            else:
                receipt = trusted_receipt(_NAME, idempotency_key)
                keys[idempotency_key] = None
                self.accepted += 1
        self.accepted_at[idempotency_key] = now + self.latency_us
        if lose_ack:
            raise RelayAcknowledgementError(receipt, "simulated lost acknowledgement")
        return receipt

    def settle(self, key: str) -> None:
        """Forget ``key``: its occurrence is published and no one republishes it."""
        self._keys.pop(key, None)

    def __repr__(self) -> str:
        return f"SimulatedBroker(accepted={self.accepted}, duplicates={self.duplicates})"
