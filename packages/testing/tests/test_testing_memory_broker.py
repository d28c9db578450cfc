from __future__ import annotations

import asyncio
import math

import pytest

from steeple.core.errors import (
    BrokerRejectedError,
    BrokerTimeoutError,
    BrokerUnavailableError,
    ConfigurationError,
    MessageTooLargeError,
    RelayAcknowledgementError,
)
from steeple.core.messages import BrokerReceipt, ScheduledMessage
from steeple.core.ports import MessageBroker
from steeple.testing import BrokerFault, MemoryBroker
from steeple.testing.conformance.brokers import (
    BROKER_CHECKS,
    BrokerConformance,
    Drained,
    check_publish,
    check_publish_and_dedup,
    check_timeout,
    check_too_large,
    conformance_message,
)

SECRET = b"top-secret-payload"


def message(payload: bytes = SECRET) -> ScheduledMessage:
    return ScheduledMessage("topic", "type", payload, {"x-tenant": "secret-tenant"})


async def test_publish_records_in_order_and_dedups_by_key() -> None:
    broker = MemoryBroker()
    assert isinstance(broker, MessageBroker)
    first = await broker.publish(message(b"1"), idempotency_key="k1", timeout=1)
    second = await broker.publish(message(b"2"), idempotency_key="k2", timeout=1)
    replay = await broker.publish(message(b"1"), idempotency_key="k1", timeout=1)
    assert first == BrokerReceipt(broker="memory", idempotency_key="k1", location="0")
    assert second.location == "1"
    assert not first.duplicate
    assert not second.duplicate
    assert replay.duplicate
    assert replay.location == "0"
    assert broker.published == [(message(b"1"), "k1"), (message(b"2"), "k2")]
    assert broker.attempts == 3
    assert broker.keys_attempted == ["k1", "k2", "k1"]
    assert await broker.read_all() == [(b"1", "k1"), (b"2", "k2")]


async def test_fail_next_retryable_then_permanent() -> None:
    broker = MemoryBroker()
    broker.fail_next(2)
    broker.fail_next(permanent=True)
    for _ in range(2):
        with pytest.raises(BrokerUnavailableError) as info:
            await broker.publish(message(), idempotency_key="k", timeout=1)
        assert not info.value.permanent
    with pytest.raises(BrokerRejectedError) as rejected:
        await broker.publish(message(), idempotency_key="k", timeout=1)
    assert rejected.value.permanent
    assert broker.published == []
    receipt = await broker.publish(message(), idempotency_key="k", timeout=1)
    assert not receipt.duplicate
    assert broker.attempts == 4


async def test_timeout_next_with_and_without_acceptance() -> None:
    broker = MemoryBroker()
    broker.timeout_next()
    broker.timeout_next(accept=True)
    with pytest.raises(BrokerTimeoutError):
        await broker.publish(message(), idempotency_key="a", timeout=1)
    assert broker.published == []
    with pytest.raises(BrokerTimeoutError):
        await broker.publish(message(), idempotency_key="a", timeout=1)
    assert broker.keys() == ["a"]
    replay = await broker.publish(message(), idempotency_key="a", timeout=1)
    assert replay.duplicate
    assert broker.keys() == ["a"]


async def test_lose_ack_accepts_and_raises_with_the_receipt() -> None:
    broker = MemoryBroker()
    broker.lose_ack_next()
    with pytest.raises(RelayAcknowledgementError) as info:
        await broker.publish(message(), idempotency_key="k", timeout=1)
    assert info.value.receipt.idempotency_key == "k"
    assert not info.value.receipt.duplicate
    assert broker.keys() == ["k"]
    assert (await broker.publish(message(), idempotency_key="k", timeout=1)).duplicate


async def test_faults_are_consumed_in_the_order_injected() -> None:
    broker = MemoryBroker()
    broker.inject(BrokerFault.LOSE_ACK, BrokerFault.UNAVAILABLE)
    queued = broker.pending_faults
    assert queued == (BrokerFault.LOSE_ACK, BrokerFault.UNAVAILABLE)
    with pytest.raises(RelayAcknowledgementError):
        await broker.publish(message(), idempotency_key="k", timeout=1)
    with pytest.raises(BrokerUnavailableError):
        await broker.publish(message(), idempotency_key="j", timeout=1)
    assert len(broker.pending_faults) == 0
    broker.fail_next(3)
    broker.clear_faults()
    await broker.publish(message(), idempotency_key="j", timeout=1)
    assert broker.keys() == ["k", "j"]


@pytest.mark.parametrize("n", [0, -1, True, 1.5])
def test_fault_counts_must_be_positive_ints(n: object) -> None:
    broker = MemoryBroker()
    with pytest.raises(ValueError, match="positive int"):
        broker.fail_next(n)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="positive int"):
        broker.timeout_next(n)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="positive int"):
        broker.lose_ack_next(n)  # type: ignore[arg-type]
    assert broker.pending_faults == ()


async def test_max_payload_is_a_permanent_rejection() -> None:
    broker = MemoryBroker(max_payload=4)
    await broker.publish(message(b"1234"), idempotency_key="ok", timeout=1)
    with pytest.raises(MessageTooLargeError) as info:
        await broker.publish(message(b"12345"), idempotency_key="big", timeout=1)
    assert info.value.permanent
    assert broker.keys() == ["ok"]


async def test_delay_longer_than_timeout_times_out_without_accepting() -> None:
    broker = MemoryBroker(delay=5.0)
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(BrokerTimeoutError):
        await broker.publish(message(), idempotency_key="slow", timeout=0.05)
    assert loop.time() - started < 2.0
    assert broker.published == []
    broker.delay = 0.01
    assert not (await broker.publish(message(), idempotency_key="slow", timeout=1)).duplicate


async def test_bad_timeouts_and_keys_are_refused_as_every_adapter_refuses_them() -> None:
    broker = MemoryBroker()
    for timeout in (0, -1.0, math.nan, math.inf):
        with pytest.raises(ConfigurationError, match="timeout"):
            await broker.publish(message(), idempotency_key="k", timeout=timeout)
    for key in ("", "has space", "x" * 201, "caf\u00e9"):
        with pytest.raises(ConfigurationError, match="idempotency_key"):
            await broker.publish(message(), idempotency_key=key, timeout=1)
    assert broker.published == []


async def test_repr_shows_counts_not_content() -> None:
    broker = MemoryBroker()
    await broker.publish(message(), idempotency_key="k", timeout=1)
    broker.fail_next()
    text = repr(broker)
    assert "1 messages" in text
    assert "pending_faults=1" in text
    assert "secret" not in text
    assert "k'" not in text


# --- the broker conformance suite, run against MemoryBroker ------------------------------------


async def test_memory_broker_passes_the_broker_conformance_suite() -> None:
    broker = MemoryBroker()
    suite = BrokerConformance(broker, broker.read_all)
    await suite.run_basic()
    assert len(broker.published) == 4  # publish 1 + dedup 1 + distinct keys 2
    small = MemoryBroker(max_payload=1024)
    error = await BrokerConformance(small, small.read_all).check_too_large(size=2048)
    assert error.permanent
    hanging = MemoryBroker(delay=30.0)
    timeout_error = await check_timeout(hanging, timeout=0.05)
    assert not timeout_error.permanent


class _NoDedupBroker:
    """A broken broker: stores every publication, even under a repeated key."""

    def __init__(self) -> None:
        self.items: list[tuple[bytes, str]] = []

    async def publish(
        self, message: ScheduledMessage, *, idempotency_key: str, timeout: float
    ) -> BrokerReceipt:
        self.items.append((message.payload, idempotency_key))
        return BrokerReceipt("broken", idempotency_key)

    async def read_all(self) -> list[tuple[bytes, str]]:
        return list(self.items)


async def test_broker_suite_catches_a_broker_without_dedup() -> None:
    broken = _NoDedupBroker()
    await check_publish(broken, broken.read_all)  # plain publication is fine
    with pytest.raises(AssertionError, match="duplicate"):
        await check_publish_and_dedup(broken, broken.read_all)
    with pytest.raises(AssertionError, match="copies"):
        await check_publish_and_dedup(broken, broken.read_all, reports_duplicates=False)


async def test_broker_suite_catches_missing_limits_and_timeouts() -> None:
    broker = MemoryBroker()
    with pytest.raises(AssertionError, match="accepted"):
        await check_too_large(broker, broker.read_all, size=2048)
    with pytest.raises(AssertionError, match="must not answer"):
        await check_timeout(broker, timeout=0.05)
    wrong = MemoryBroker()
    wrong.fail_next()
    with pytest.raises(AssertionError, match="BrokerUnavailableError"):
        await check_timeout(wrong, timeout=0.05)


# --- the full suite (BROKER_CHECKS), run against MemoryBroker through a harness ------------


class MemoryHarness:
    """The memory broker's harness: its "server" is the object itself."""

    name = "memory"
    deduplicates = True
    recognises_lost_acknowledgement = True

    def __init__(self, broker: MemoryBroker | None = None) -> None:
        self.broker = broker if broker is not None else MemoryBroker(max_payload=4096)
        self.read = 0

    async def make_broker(self) -> MemoryBroker:
        return self.broker

    async def drain(self) -> Drained:
        new = self.broker.published[self.read :]
        self.read = len(self.broker.published)
        return [(key, msg) for msg, key in new]

    def too_large(self) -> ScheduledMessage:
        return conformance_message(0, size=8000)

    async def stall(self) -> None:
        self.broker.delay = 30.0

    async def heal(self) -> None:
        self.broker.delay = 0.0

    async def restart(self, broker: MessageBroker) -> MessageBroker:
        return broker  # nothing to reconnect: the same object goes on

    def lose_next_acknowledgement(self, broker: MessageBroker) -> None:
        assert isinstance(broker, MemoryBroker)
        broker.lose_ack_next()

    def secrets_in_config(self) -> list[str]:
        return []


@pytest.mark.parametrize("check", sorted(BROKER_CHECKS))
async def test_memory_broker_passes_every_broker_check(check: str) -> None:
    await BROKER_CHECKS[check](MemoryHarness())


class _ContentDedupBroker(MemoryBroker):
    """A broken broker: deduplicates by content instead of by key."""

    async def publish(
        self, message: ScheduledMessage, *, idempotency_key: str, timeout: float
    ) -> BrokerReceipt:
        for earlier, key in self.published:
            if earlier == message:
                return BrokerReceipt(self.name, key, duplicate=True)
        return await super().publish(message, idempotency_key=idempotency_key, timeout=timeout)


class _ForgetfulBroker(MemoryBroker):
    """A broken broker: stores every publication, even under a repeated key."""

    def _accept(self, message: ScheduledMessage, key: str) -> BrokerReceipt:
        self.published.append((message, key))
        return BrokerReceipt(self.name, key, location=str(len(self.published) - 1))


class _LoosePublisher(MemoryBroker):
    """A broken broker: accepts any timeout and key (and shows a secret in its repr)."""

    async def publish(
        self, message: ScheduledMessage, *, idempotency_key: str, timeout: float
    ) -> BrokerReceipt:
        return self._accept(message, idempotency_key)

    def __repr__(self) -> str:
        return "LoosePublisher(password='hunter2')"


@pytest.mark.parametrize(
    ("broken", "check", "complaint"),
    [
        (_ContentDedupBroker(), "distinct_keys", "content"),
        (_ForgetfulBroker(), "replay_same_key", "duplicate"),
        (_ForgetfulBroker(), "lost_ack", "republication"),
        (_ForgetfulBroker(), "reconnect_after_restart", "restart"),
        (_LoosePublisher(), "bad_arguments", "timeout"),
        (MemoryBroker(), "too_large", "accepted"),
    ],
)
async def test_the_broker_checks_catch_broken_brokers(
    broken: MemoryBroker, check: str, complaint: str
) -> None:
    with pytest.raises(AssertionError, match=complaint):
        await BROKER_CHECKS[check](MemoryHarness(broken))


async def test_the_broker_checks_catch_a_leaked_secret_and_a_late_timeout() -> None:
    class Leaky(MemoryHarness):
        def secrets_in_config(self) -> list[str]:
            return [repr(self.broker).split("=")[0]]  # "MemoryBroker(name"

    with pytest.raises(AssertionError, match="repr"):
        await BROKER_CHECKS["bad_arguments"](Leaky())

    class NeverStalls(MemoryHarness):
        async def stall(self) -> None:
            pass

    with pytest.raises(AssertionError, match="did not time out"):
        await BROKER_CHECKS["timeout"](NeverStalls())
