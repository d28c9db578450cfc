"""An in-memory message broker with deduplication and fault injection.

It keeps every accepted ``(message, idempotency_key)`` in ``published``, deduplicates by key
for the life of the object and injects faults on demand. For tests and simulations:
nothing survives the process. It lives beside the engine, whose relay publishes through
the broker port, so that the broker adapters (``steeple.brokers.memory``) and the test kit
(``steeple.testing``) offer the same classes without depending on each other.
"""

from __future__ import annotations

import asyncio
import enum
from collections import deque

import attrs

from steeple.core.errors import (
    BrokerRejectedError,
    BrokerTimeoutError,
    BrokerUnavailableError,
    MessageTooLargeError,
    RelayAcknowledgementError,
)
from steeple.core.messages import (
    BrokerReceipt,
    ScheduledMessage,
    check_idempotency_key,
    check_publish_timeout,
)

__all__ = ["BrokerFault", "MemoryBroker"]


class BrokerFault(enum.Enum):
    """What :class:`MemoryBroker` does instead of a plain acceptance, for one publish call."""

    UNAVAILABLE = "unavailable"
    """Raise :class:`BrokerUnavailableError` (retryable); nothing accepted."""
    REJECTED = "rejected"
    """Raise :class:`BrokerRejectedError` (permanent); nothing accepted."""
    TIMEOUT = "timeout"
    """Raise :class:`BrokerTimeoutError`; nothing accepted."""
    TIMEOUT_AFTER_ACCEPT = "timeout_after_accept"
    """Accept the message, then raise :class:`BrokerTimeoutError`."""
    LOSE_ACK = "lose_ack"
    """Accept the message, then raise :class:`RelayAcknowledgementError` with the receipt."""


def _count(n: int) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive int; got {n!r}")
    return n


@attrs.define(repr=False)
class MemoryBroker:
    """A :class:`steeple.core.ports.MessageBroker` that keeps what it accepts in a list.

    It deduplicates by idempotency key forever (a replay returns a receipt with
    ``duplicate=True`` and stores nothing), and can be told to fail the next publish calls
    in the ways real brokers fail. Faults are queued and consumed one per publish call,
    in the order they were requested.

    Attributes:
        published: accepted ``(message, idempotency_key)`` pairs, in acceptance order.
        attempts: how many times ``publish`` was called (failures included).
        keys_attempted: the idempotency key of every publish call, in call order.
        max_payload: payload size limit in bytes (``None``: no limit beyond the message's).
        delay: seconds each publish waits before answering; a publish whose ``timeout``
            is shorter raises :class:`BrokerTimeoutError` without accepting.
        name: the ``broker`` field of receipts.
    """

    max_payload: int | None = None
    delay: float = 0.0
    name: str = "memory"
    published: list[tuple[ScheduledMessage, str]] = attrs.field(factory=list, init=False)
    attempts: int = attrs.field(default=0, init=False)
    keys_attempted: list[str] = attrs.field(factory=list, init=False)
    _receipts: dict[str, BrokerReceipt] = attrs.field(factory=dict, init=False)
    _faults: deque[BrokerFault] = attrs.field(factory=deque, init=False)

    # --- fault injection ----------------------------------------------------------------

    def fail_next(self, n: int = 1, *, permanent: bool = False) -> None:
        """Make the next ``n`` publish calls fail without accepting anything.

        Args:
            n: how many calls fail.
            permanent: raise :class:`BrokerRejectedError` (permanent) instead of
                :class:`BrokerUnavailableError` (retryable).

        Raises:
            ValueError: ``n`` is not a positive int.
        """
        fault = BrokerFault.REJECTED if permanent else BrokerFault.UNAVAILABLE
        self._faults.extend([fault] * _count(n))

    def timeout_next(self, n: int = 1, *, accept: bool = False) -> None:
        """Make the next ``n`` publish calls raise :class:`BrokerTimeoutError`.

        Args:
            n: how many calls time out.
            accept: accept (and deduplicate) the message before timing out, as a broker
                that stored it but whose answer never arrived.

        Raises:
            ValueError: ``n`` is not a positive int.
        """
        fault = BrokerFault.TIMEOUT_AFTER_ACCEPT if accept else BrokerFault.TIMEOUT
        self._faults.extend([fault] * _count(n))

    def lose_ack_next(self, n: int = 1) -> None:
        """Make the next ``n`` publish calls accept, then lose the acknowledgement.

        They raise :class:`RelayAcknowledgementError` carrying the receipt.

        Raises:
            ValueError: ``n`` is not a positive int.
        """
        self._faults.extend([BrokerFault.LOSE_ACK] * _count(n))

    def inject(self, *faults: BrokerFault) -> None:
        """Queue faults for the next publish calls, one per call, in order."""
        self._faults.extend(faults)

    @property
    def pending_faults(self) -> tuple[BrokerFault, ...]:
        """The faults still queued, next first."""
        return tuple(self._faults)

    def clear_faults(self) -> None:
        """Drop every queued fault."""
        self._faults.clear()

    # --- the port ------------------------------------------------------------------------

    async def publish(
        self, message: ScheduledMessage, *, idempotency_key: str, timeout: float
    ) -> BrokerReceipt:
        """Accept ``message`` under ``idempotency_key`` (once per key), or fail as told.

        Raises:
            MessageTooLargeError: the payload exceeds ``max_payload`` (permanent).
            BrokerUnavailableError: an injected retryable failure.
            BrokerRejectedError: an injected permanent failure.
            BrokerTimeoutError: an injected timeout, or ``delay`` longer than ``timeout``.
            ConfigurationError: a ``timeout`` that is not a positive finite number, or an
                idempotency key that is not 1-200 printable ASCII characters without
                spaces (as every broker adapter refuses them); nothing accepted.
            RelayAcknowledgementError: an injected lost acknowledgement (after acceptance).
        """
        self.attempts += 1
        self.keys_attempted.append(idempotency_key)
        timeout = check_publish_timeout(timeout)
        check_idempotency_key(idempotency_key)
        if self.max_payload is not None and len(message.payload) > self.max_payload:
            raise MessageTooLargeError(
                f"payload of {len(message.payload)} bytes exceeds the broker's limit of "
                f"{self.max_payload} bytes",
                size=len(message.payload),
                limit=self.max_payload,
            )
        fault = self._faults.popleft() if self._faults else None
        if self.delay > 0:
            try:
                async with asyncio.timeout(timeout):
                    await asyncio.sleep(self.delay)
            except TimeoutError:
                raise BrokerTimeoutError(f"no answer within {timeout} s", timeout=timeout) from None
        if fault is BrokerFault.UNAVAILABLE:
            raise BrokerUnavailableError("injected: broker unavailable")
        if fault is BrokerFault.REJECTED:
            raise BrokerRejectedError("injected: broker rejected the message")
        if fault is BrokerFault.TIMEOUT:
            raise BrokerTimeoutError("injected: broker timed out", timeout=timeout)
        receipt = self._accept(message, idempotency_key)
        if fault is BrokerFault.TIMEOUT_AFTER_ACCEPT:
            raise BrokerTimeoutError("injected: timed out after acceptance", timeout=timeout)
        if fault is BrokerFault.LOSE_ACK:
            raise RelayAcknowledgementError(receipt, "the injected acknowledgement was lost")
        return receipt

    def _accept(self, message: ScheduledMessage, key: str) -> BrokerReceipt:
        earlier = self._receipts.get(key)
        if earlier is not None:
            return attrs.evolve(earlier, duplicate=True)
        receipt = BrokerReceipt(
            broker=self.name, idempotency_key=key, location=str(len(self.published))
        )
        self._receipts[key] = receipt
        self.published.append((message, key))
        return receipt

    # --- the consumer side ----------------------------------------------------------------

    async def read_all(self) -> list[tuple[bytes, str]]:
        """Return every accepted ``(payload, idempotency_key)``, in order (a consumer's view)."""
        return [(message.payload, key) for message, key in self.published]

    def keys(self) -> list[str]:
        """Return the idempotency keys of accepted messages, in order."""
        return [key for _, key in self.published]

    def __repr__(self) -> str:
        # Never the payloads or headers: only counts.
        return (
            f"MemoryBroker(name={self.name!r}, published=<{len(self.published)} messages>, "
            f"attempts={self.attempts}, pending_faults={len(self._faults)})"
        )
