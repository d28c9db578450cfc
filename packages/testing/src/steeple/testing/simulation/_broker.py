"""The simulated broker: a deduplicating broker in front of which a seeded failure model runs."""

from __future__ import annotations

import random as _random
from typing import Final

import attrs

from steeple.core.errors import BrokerUnavailableError, RelayAcknowledgementError
from steeple.core.messages import BrokerReceipt, ScheduledMessage
from steeple.core.ports import MessageBroker
from steeple.testing.simulation._scenario import BrokerModel
from steeple.testing.simulation._timeline import to_us

__all__ = ["SimulatedBroker"]

_NAME: Final = "simulated"


@attrs.define(repr=False)
class SimulatedBroker:
    """A :class:`~steeple.core.ports.MessageBroker` whose failures follow a :class:`BrokerModel`.

    The simulator tells it the current instant (as microseconds since the epoch) before
    each relay. In an outage every publication raises :class:`BrokerUnavailableError`;
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
        now_us: the current instant (microseconds since the epoch), set by the simulator.
        accepted: publications accepted (first copies).
        duplicates: publications recognised by their idempotency key.
    """

    model: BrokerModel
    seed: int
    inner: MessageBroker | None = None
    now_us: int = 0
    accepted: int = attrs.field(default=0, init=False)
    duplicates: int = attrs.field(default=0, init=False)
    _outages: tuple[tuple[int, int], ...] = attrs.field(default=(), init=False)
    _rng: _random.Random = attrs.field(init=False)
    _keys: dict[str, BrokerReceipt] = attrs.field(factory=dict, init=False)

    def __attrs_post_init__(self) -> None:
        self._rng = _random.Random(f"steeple-broker:{self.seed}")  # noqa: S311 - a model, not secrets
        self._outages = tuple((to_us(o.start), to_us(o.end)) for o in self.model.outages)

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
        if self._outages and self.down(self.now_us):
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
        else:
            receipt = self._accept(idempotency_key)
        if receipt.duplicate:
            self.duplicates += 1
        else:
            self.accepted += 1
        if lose_ack:
            raise RelayAcknowledgementError(receipt, "simulated lost acknowledgement")
        return receipt

    def _accept(self, key: str) -> BrokerReceipt:
        earlier = self._keys.get(key)
        if earlier is not None:
            return attrs.evolve(earlier, duplicate=True)
        receipt = BrokerReceipt(broker=_NAME, idempotency_key=key)
        self._keys[key] = receipt
        return receipt

    def settle(self, key: str) -> None:
        """Forget ``key``: its occurrence is published and no one republishes it."""
        self._keys.pop(key, None)

    def __repr__(self) -> str:
        return f"SimulatedBroker(accepted={self.accepted}, duplicates={self.duplicates})"
