"""A small conformance suite for :class:`steeple.core.ports.MessageBroker` adapters.

Each check takes the broker under test and ``read_all``: an async function returning
every ``(payload, idempotency_key)`` a consumer can read from the topic so far (whatever
order). Checks use fresh random keys and payloads, so they can share one topic and run
in any order against a broker that already holds messages::

    suite = BrokerConformance(broker, read_all, topic="steeple-conformance")
    await suite.run_basic()                 # publish, dedup, distinct keys
    await suite.check_too_large(size=2048)  # broker configured with a smaller limit
    await check_timeout(hanging_broker)     # a broker that cannot answer in time

Raises ``AssertionError`` (with a message) when the broker breaks the contract.
"""

from __future__ import annotations

import os
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime

import attrs

from steeple.core import limits
from steeple.core.errors import BrokerError, BrokerTimeoutError, MessageTooLargeError
from steeple.core.idempotency import PUBLISH_PURPOSE, idempotency_key
from steeple.core.messages import BrokerReceipt, ScheduledMessage
from steeple.core.ports import MessageBroker

__all__ = [
    "BrokerConformance",
    "ReadAll",
    "check_distinct_keys",
    "check_publish",
    "check_publish_and_dedup",
    "check_timeout",
    "check_too_large",
    "fresh_key",
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
