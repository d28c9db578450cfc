"""The conformance suite for :class:`steeple.core.ports.MessageBroker` adapters.

Two ways in. The full suite, :data:`BROKER_CHECKS`, runs against a real server through a
:class:`BrokerHarness` (what your tests provide: a broker, a consumer, a way to make the
server stop answering and to restart it). Run every check, one fresh harness each::

    @pytest.mark.parametrize("check", sorted(BROKER_CHECKS))
    async def test_conforms(check: str, harness: MyHarness) -> None:
        await BROKER_CHECKS[check](harness)

It asserts the relay's promise: a publication is delivered once, with its idempotency
key and exact content; a replay under the same key delivers one copy; the same content
under two keys is two messages; an acknowledgement lost after the broker accepted
surfaces as ``RelayAcknowledgementError`` carrying the receipt (or ``BrokerTimeoutError``
where the adapter cannot look the key up) and the republication delivers no second copy;
an unresponsive broker raises a retryable ``BrokerTimeoutError`` within the deadline; an
oversized message is a permanent ``MessageTooLargeError``; after a server restart the
adapter reconnects; bad timeouts and keys are ``ConfigurationError``; no secret of the
configuration appears in the broker's repr.

The single checks over a consumer view (``read_all``: every ``(payload,
idempotency_key)`` a consumer can read so far) need no harness; they use fresh random
keys and payloads, so they can share one topic with other traffic::

    suite = BrokerConformance(broker, read_all, topic="steeple-conformance")
    await suite.run_basic()                 # publish, dedup, distinct keys
    await suite.check_too_large(size=2048)  # broker configured with a smaller limit
    await check_timeout(hanging_broker)     # a broker that cannot answer in time

Every check raises ``AssertionError`` (with a message) when the broker breaks the contract.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from datetime import UTC, datetime
from typing import Protocol

import attrs

from steeple.core import limits
from steeple.core.errors import (
    BrokerError,
    BrokerTimeoutError,
    BrokerUnavailableError,
    ConfigurationError,
    MessageTooLargeError,
    RelayAcknowledgementError,
)
from steeple.core.idempotency import PUBLISH_PURPOSE, idempotency_key
from steeple.core.messages import BrokerReceipt, ScheduledMessage
from steeple.core.ports import MessageBroker

__all__ = [
    "BROKER_CHECKS",
    "BrokerConformance",
    "BrokerHarness",
    "Drained",
    "ReadAll",
    "check_distinct_keys",
    "check_publish",
    "check_publish_and_dedup",
    "check_timeout",
    "check_too_large",
    "conformance_message",
    "fresh_key",
    "publish_retrying",
]

ReadAll = Callable[[], Awaitable[list[tuple[bytes, str]]]]
"""Returns every ``(payload, idempotency_key)`` a consumer can read so far."""

DEFAULT_TOPIC = "steeple-conformance"
_TIMEOUT = 5.0


def fresh_key() -> str:
    """Return a new idempotency key in steeple's format, unique to this call."""
    return idempotency_key(
        purpose=PUBLISH_PURPOSE,
        namespace="conformance",
        definition_name="broker-suite",
        due_at=datetime.now(UTC),
        generation=os.urandom(16),
    )


def _message(topic: str, size: int | None = None) -> ScheduledMessage:
    payload = os.urandom(8).hex().encode() if size is None else os.urandom(size)
    return ScheduledMessage(topic, "conformance.check", payload, {"x-steeple-check": "conformance"})


def _copies(delivered: list[tuple[bytes, str]], key: str) -> list[bytes]:
    return [payload for payload, k in delivered if k == key]


async def check_publish(
    broker: MessageBroker, read_all: ReadAll, *, topic: str = DEFAULT_TOPIC
) -> BrokerReceipt:
    """Check that one message is accepted under its key and delivered exactly once.

    Returns:
        The broker's receipt.

    Raises:
        AssertionError: the receipt or the delivered messages are wrong.
    """
    key = fresh_key()
    message = _message(topic)
    receipt = await broker.publish(message, idempotency_key=key, timeout=_TIMEOUT)
    assert isinstance(receipt, BrokerReceipt), f"publish returned {type(receipt).__name__}"
    assert receipt.idempotency_key == key, "the receipt names another idempotency key"
    assert not receipt.duplicate, "a first publication was reported as a duplicate"
    copies = _copies(await read_all(), key)
    assert copies == [message.payload], (
        f"expected exactly one delivered copy with the published payload, got {len(copies)}"
    )
    return receipt


async def check_publish_and_dedup(
    broker: MessageBroker,
    read_all: ReadAll,
    *,
    topic: str = DEFAULT_TOPIC,
    reports_duplicates: bool = True,
) -> None:
    """Check that the same message published twice under one key is delivered once.

    Args:
        broker: the broker under test.
        read_all: the consumer view.
        topic: where to publish.
        reports_duplicates: require the replay's receipt to say ``duplicate=True``
            (brokers that cannot tell may pass ``False``; one copy is still required).

    Raises:
        AssertionError: a second copy was delivered, or the replay was not reported.
    """
    key = fresh_key()
    message = _message(topic)
    first = await broker.publish(message, idempotency_key=key, timeout=_TIMEOUT)
    second = await broker.publish(message, idempotency_key=key, timeout=_TIMEOUT)
    assert not first.duplicate, "a first publication was reported as a duplicate"
    assert second.idempotency_key == key, "the replay's receipt names another key"
    if reports_duplicates:
        assert second.duplicate, "a replay of the same key was not reported as a duplicate"
    copies = _copies(await read_all(), key)
    assert len(copies) == 1, f"a replayed key delivered {len(copies)} copies, not one"


async def check_distinct_keys(
    broker: MessageBroker, read_all: ReadAll, *, topic: str = DEFAULT_TOPIC
) -> None:
    """Check that two messages under different keys (same content) are both delivered.

    Raises:
        AssertionError: deduplication was by content instead of by key.
    """
    message = _message(topic)
    keys = [fresh_key(), fresh_key()]
    for key in keys:
        receipt = await broker.publish(message, idempotency_key=key, timeout=_TIMEOUT)
        assert not receipt.duplicate, "a new key was reported as a duplicate"
    delivered = await read_all()
    for key in keys:
        assert len(_copies(delivered, key)) == 1, "a message under a new key was not delivered"


async def check_too_large(
    broker: MessageBroker,
    read_all: ReadAll,
    *,
    size: int = limits.MAX_PAYLOAD_BYTES,
    topic: str = DEFAULT_TOPIC,
) -> MessageTooLargeError:
    """Check that a payload over the broker's limit fails permanently, delivering nothing.

    Configure the broker under test with a size limit below ``size``.

    Returns:
        The error raised (for further checks).

    Raises:
        AssertionError: it was accepted, or failed in another (or a retryable) way.
    """
    key = fresh_key()
    error: MessageTooLargeError | None = None
    try:
        await broker.publish(_message(topic, size), idempotency_key=key, timeout=_TIMEOUT)
    except MessageTooLargeError as exc:
        error = exc
    except BrokerError as exc:
        raise AssertionError(
            f"a too-large payload raised {type(exc).__name__}, not MessageTooLargeError"
        ) from exc
    if error is None:
        raise AssertionError(f"a {size}-byte payload was accepted; expected MessageTooLargeError")
    assert error.permanent, "MessageTooLargeError must be permanent"
    assert not _copies(await read_all(), key), "a rejected message was delivered"
    return error


async def check_timeout(
    broker: MessageBroker,
    *,
    timeout: float = 0.2,
    grace: float = 2.0,
    topic: str = DEFAULT_TOPIC,
) -> BrokerTimeoutError:
    """Check that a broker unable to answer in time raises BrokerTimeoutError promptly.

    Pass a broker that cannot answer (a blackholed connection, a paused server).

    Returns:
        The error raised.

    Raises:
        AssertionError: it did not time out, raised something else, or overran
            ``timeout + grace`` seconds.
    """
    key = fresh_key()
    started = time.monotonic()
    error: BrokerTimeoutError | None = None
    try:
        await broker.publish(_message(topic), idempotency_key=key, timeout=timeout)
    except BrokerTimeoutError as exc:
        error = exc
    except BrokerError as exc:
        raise AssertionError(
            f"a publish that could not finish raised {type(exc).__name__}, not BrokerTimeoutError"
        ) from exc
    elapsed = time.monotonic() - started
    if error is None:
        raise AssertionError("publish succeeded; the broker under test must not answer in time")
    assert elapsed <= timeout + grace, (
        f"the timeout of {timeout} s was only enforced after {elapsed:.2f} s"
    )
    assert not error.permanent, "a timeout must not be permanent (it may have been accepted)"
    return error


@attrs.define
class BrokerConformance:
    """The broker checks bound to one broker and its consumer view.

    Attributes:
        broker: the broker under test.
        read_all: the consumer view (every ``(payload, key)`` readable so far).
        topic: where checks publish.
        reports_duplicates: whether replays must come back with ``duplicate=True``.
    """

    broker: MessageBroker
    read_all: ReadAll
    topic: str = DEFAULT_TOPIC
    reports_duplicates: bool = True

    async def check_publish(self) -> BrokerReceipt:
        """See :func:`check_publish`."""
        return await check_publish(self.broker, self.read_all, topic=self.topic)

    async def check_dedup(self) -> None:
        """See :func:`check_publish_and_dedup`."""
        await check_publish_and_dedup(
            self.broker,
            self.read_all,
            topic=self.topic,
            reports_duplicates=self.reports_duplicates,
        )

    async def check_distinct_keys(self) -> None:
        """See :func:`check_distinct_keys`."""
        await check_distinct_keys(self.broker, self.read_all, topic=self.topic)

    async def check_too_large(self, size: int = limits.MAX_PAYLOAD_BYTES) -> MessageTooLargeError:
        """See :func:`check_too_large` (the broker must have a limit below ``size``)."""
        return await check_too_large(self.broker, self.read_all, size=size, topic=self.topic)

    async def run_basic(self) -> None:
        """Run the checks every broker passes without special configuration.

        Raises:
            AssertionError: the first check that fails.
        """
        await self.check_publish()
        await self.check_dedup()
        await self.check_distinct_keys()


# --- the full suite, through a harness over a real server ---------------------------------

Drained = list[tuple[str, ScheduledMessage]]
"""What a consumer read: ``(idempotency_key, message)`` in delivery order."""

_STALLED_TIMEOUT = 0.8
_TIMEOUT_SLACK = 1.0  # a loaded machine answers late


class BrokerHarness(Protocol):
    """What an adapter's tests provide to :data:`BROKER_CHECKS`; one harness per check.

    Attributes:
        name: the receipts' ``broker`` field.
        deduplicates: the broker itself refuses a second copy under a key (a replay's
            receipt says ``duplicate=True``); ``False`` when the consumer deduplicates
            (then :meth:`drain` applies that consumer-side dedup).
        recognises_lost_acknowledgement: a lost acknowledgement is recognised by looking
            the key up (``RelayAcknowledgementError``); ``False`` when the adapter can only
            say it timed out (``BrokerTimeoutError``).
    """

    name: str
    deduplicates: bool
    recognises_lost_acknowledgement: bool

    async def make_broker(self) -> MessageBroker:
        """Return a started broker publishing where :meth:`drain` reads; close it at teardown."""
        ...

    async def drain(self) -> Drained:
        """Consume and acknowledge everything available, in order, applying consumer dedup."""
        ...

    def too_large(self) -> ScheduledMessage:
        """Return a message over the broker's configured size limit."""
        ...

    async def stall(self) -> None:
        """Make the server stop answering (connections held, nothing forwarded)."""
        ...

    async def heal(self) -> None:
        """Undo :meth:`stall`."""
        ...

    async def restart(self, broker: MessageBroker) -> MessageBroker:
        """Restart the server (or cut every connection, as a restart would).

        Returns the broker to go on with: the same one, or (for an embedded broker whose
        server is the process) a new one over the same storage.
        """
        ...

    def lose_next_acknowledgement(self, broker: MessageBroker) -> None:
        """Let the broker's next publication reach the server, then lose its reply."""
        ...

    def secrets_in_config(self) -> list[str]:
        """Return strings (passwords, full URLs) that must never appear in the repr."""
        ...


def conformance_message(i: int = 0, size: int = 32) -> ScheduledMessage:
    """Return the ``i``-th message the suite publishes (``size`` payload bytes, 2 headers)."""
    body = (f"payload-{i}-".encode() * (size // 8 + 1))[:size]
    return ScheduledMessage(
        "reminders", "reminder.requested", body, {"tenant": "t1", "seq": str(i)}
    )


async def publish_retrying(
    broker: MessageBroker, message: ScheduledMessage, key: str, *, attempts: int = 20
) -> BrokerReceipt:
    """Republish ``message`` under ``key`` until accepted, as a relay does.

    Returns:
        The receipt (from a ``RelayAcknowledgementError`` too).

    Raises:
        AssertionError: never accepted in ``attempts`` tries.
    """
    last: BaseException | None = None
    for _ in range(attempts):
        try:
            return await broker.publish(message, idempotency_key=key, timeout=3.0)
        except RelayAcknowledgementError as exc:
            return exc.receipt
        except (BrokerTimeoutError, BrokerUnavailableError) as exc:
            last = exc
            await asyncio.sleep(0.25)  # a relay's retry pause, not a synchronisation
    raise AssertionError(f"never accepted after {attempts} attempts: {last!r}")


async def _publish_and_consume(h: BrokerHarness) -> None:
    broker = await h.make_broker()
    keys = [fresh_key() for _ in range(3)]
    for i, key in enumerate(keys):
        receipt = await broker.publish(
            conformance_message(i), idempotency_key=key, timeout=_TIMEOUT
        )
        assert isinstance(receipt, BrokerReceipt), f"publish returned {type(receipt).__name__}"
        assert receipt.broker == h.name, f"the receipt names broker {receipt.broker!r}"
        assert receipt.idempotency_key == key, "the receipt names another idempotency key"
        assert receipt.duplicate is False, "a first publication was reported as a duplicate"
    got = await h.drain()
    assert [k for k, _ in got] == keys, "not every publication was delivered once, in order"
    assert [m for _, m in got] == [conformance_message(i) for i in range(3)], (
        "a delivered message differs from the published one"
    )
    assert dict(got[0][1].headers) == {"tenant": "t1", "seq": "0"}, "headers were altered"
    assert await h.drain() == [], "a consumed message was delivered again"


async def _replay_same_key(h: BrokerHarness) -> None:
    broker = await h.make_broker()
    key = fresh_key()
    first = await broker.publish(conformance_message(1), idempotency_key=key, timeout=_TIMEOUT)
    second = await broker.publish(conformance_message(1), idempotency_key=key, timeout=_TIMEOUT)
    assert first.duplicate is False, "a first publication was reported as a duplicate"
    assert second.duplicate is h.deduplicates, (
        f"a replay's receipt says duplicate={second.duplicate}; expected {h.deduplicates}"
    )
    assert second.idempotency_key == key, "the replay's receipt names another key"
    got = await h.drain()
    assert got == [(key, conformance_message(1))], f"a replayed key delivered {len(got)} copies"


async def _distinct_keys(h: BrokerHarness) -> None:
    broker = await h.make_broker()
    keys = [fresh_key(), fresh_key()]
    for key in keys:
        receipt = await broker.publish(
            conformance_message(7), idempotency_key=key, timeout=_TIMEOUT
        )
        assert not receipt.duplicate, "a new key with known content was reported as a duplicate"
    got = await h.drain()
    assert got == [(key, conformance_message(7)) for key in keys], (
        "the same content under two keys was not delivered twice (dedup by content, not key)"
    )


async def _lost_ack(h: BrokerHarness) -> None:
    broker = await h.make_broker()
    key = fresh_key()
    h.lose_next_acknowledgement(broker)
    expected: type[RelayAcknowledgementError | BrokerTimeoutError] = (
        RelayAcknowledgementError if h.recognises_lost_acknowledgement else BrokerTimeoutError
    )
    caught: RelayAcknowledgementError | BrokerTimeoutError | None = None
    try:
        await broker.publish(conformance_message(2), idempotency_key=key, timeout=3.0)
    except expected as exc:
        caught = exc
    if caught is None:
        raise AssertionError("a lost acknowledgement was reported as a success")
    if isinstance(caught, RelayAcknowledgementError):
        assert caught.receipt.idempotency_key == key, "the uncertain receipt names another key"
        assert caught.receipt.broker == h.name, "the uncertain receipt names another broker"
    again = await broker.publish(conformance_message(2), idempotency_key=key, timeout=_TIMEOUT)
    assert again.duplicate is h.deduplicates, "the republication's receipt is wrong"
    got = await h.drain()
    assert got == [(key, conformance_message(2))], (
        f"a republication after a lost acknowledgement delivered {len(got)} copies"
    )


async def _timeout(h: BrokerHarness) -> None:
    broker = await h.make_broker()
    warm = fresh_key()
    await broker.publish(conformance_message(3), idempotency_key=warm, timeout=_TIMEOUT)
    await h.stall()
    key = fresh_key()
    started = time.monotonic()
    try:
        await broker.publish(conformance_message(4), idempotency_key=key, timeout=_STALLED_TIMEOUT)
    except BrokerTimeoutError as exc:
        if exc.permanent:
            raise AssertionError("a timeout must not be permanent (it may be accepted)") from exc
    except RelayAcknowledgementError:
        pass  # accepted before the stall: recovery republishes, as for a timeout
    else:
        raise AssertionError("a broker that could not answer did not time out")
    finally:
        await h.heal()
    elapsed = time.monotonic() - started
    assert elapsed < _STALLED_TIMEOUT + _TIMEOUT_SLACK, (
        f"the timeout of {_STALLED_TIMEOUT} s was only enforced after {elapsed:.2f} s"
    )
    await publish_retrying(broker, conformance_message(4), key)
    got = await h.drain()
    assert got == [(warm, conformance_message(3)), (key, conformance_message(4))], (
        "after a timeout and its republication, delivery is not once per key"
    )


async def _too_large(h: BrokerHarness) -> None:
    broker = await h.make_broker()
    error: MessageTooLargeError | None = None
    try:
        await broker.publish(h.too_large(), idempotency_key=fresh_key(), timeout=_TIMEOUT)
    except MessageTooLargeError as exc:
        error = exc
    if error is None:
        raise AssertionError("an oversized message was accepted")
    assert error.permanent is True, "MessageTooLargeError must be permanent"
    assert await h.drain() == [], "a rejected message was delivered"


async def _reconnect_after_restart(h: BrokerHarness) -> None:
    broker = await h.make_broker()
    before, after = fresh_key(), fresh_key()
    await broker.publish(conformance_message(5), idempotency_key=before, timeout=_TIMEOUT)
    broker = await h.restart(broker)
    await publish_retrying(broker, conformance_message(6), after)
    again = await publish_retrying(broker, conformance_message(6), after)
    assert again.duplicate is h.deduplicates, "a replay after a restart was not recognised"
    got = await h.drain()
    assert got == [(before, conformance_message(5)), (after, conformance_message(6))], (
        "after a restart, delivery is not once per key"
    )


async def _bad_arguments(h: BrokerHarness) -> None:
    broker = await h.make_broker()
    for timeout in (0, -1.0, math.nan, math.inf):
        try:
            await broker.publish(
                conformance_message(), idempotency_key=fresh_key(), timeout=timeout
            )
        except ConfigurationError:
            pass
        else:
            raise AssertionError(f"timeout {timeout!r} was accepted")
    for key in ("", "has space", "x" * (limits.MAX_NAME_LENGTH + 1), "caf\u00e9"):
        try:
            await broker.publish(conformance_message(), idempotency_key=key, timeout=1.0)
        except ConfigurationError:
            pass
        else:
            raise AssertionError(f"idempotency key {key!r} was accepted")
    text = repr(broker)
    for secret in h.secrets_in_config():
        assert secret not in text, "a secret of the configuration leaked into the repr"
    assert await h.drain() == [], "a refused publication was delivered"


BROKER_CHECKS: Mapping[str, Callable[[BrokerHarness], Awaitable[None]]] = {
    "publish_and_consume": _publish_and_consume,
    "replay_same_key": _replay_same_key,
    "distinct_keys": _distinct_keys,
    "lost_ack": _lost_ack,
    "timeout": _timeout,
    "too_large": _too_large,
    "reconnect_after_restart": _reconnect_after_restart,
    "bad_arguments": _bad_arguments,
}
"""Every check of the full suite by name; each takes a fresh :class:`BrokerHarness`."""
