"""NATS JetStream against the machine's server and a private nats-server (rows 26-28)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import nats
import nats.js.errors
import pytest
from nats.js.api import StreamConfig

from broker_support import (
    BROKER_CHECKS,
    ProxiedHarness,
    TcpProxy,
    drain_deliveries,
    eventually,
    message,
    new_key,
    publish_retrying,
    running_proxy,
    start_kept,
)
from nats_support import PrivateNats
from steeple.brokers.nats import JetStreamBroker, JetStreamConsumer
from steeple.core.errors import (
    BrokerConfigurationError,
    BrokerTimeoutError,
    BrokerUnavailableError,
    MessageTooLargeError,
    RelayAcknowledgementError,
)
from steeple.core.messages import ScheduledMessage

pytestmark = pytest.mark.broker


def _names() -> tuple[str, str]:
    tag = uuid.uuid4().hex[:10]
    return f"STP_{tag}", f"steeple.test.{tag}"


async def _delete_stream(url: str, stream: str) -> None:
    nc = await nats.connect(url, connect_timeout=3, max_reconnect_attempts=1)
    try:
        await nc.jetstream().delete_stream(stream)
    except nats.js.errors.NotFoundError:
        pass
    finally:
        await nc.close()


class NatsHarness(ProxiedHarness):
    name = "nats"
    deduplicates = True
    recognises_lost_acknowledgement = True

    def __init__(
        self,
        url: str,
        proxy: TcpProxy,
        *,
        server: PrivateNats | None = None,
        max_message_bytes: int | None = 4096,
    ) -> None:
        super().__init__(proxy)
        self.url = url
        self.server = server
        self.stream, self.subject = _names()
        self.max_bytes = max_message_bytes
        self.consumer: JetStreamConsumer | None = None

    async def make_broker(self) -> JetStreamBroker:
        b = JetStreamBroker(
            self.proxy.url("nats"),
            stream=self.stream,
            subject=self.subject,
            manage_stream=True,
            max_message_bytes=self.max_bytes,
        )
        return await start_kept(self.brokers, b)

    async def drain(self) -> list[tuple[str, ScheduledMessage]]:
        if self.consumer is None:
            self.consumer = JetStreamConsumer(
                self.url, stream=self.stream, durable="verify", ack_wait=timedelta(seconds=30)
            )
        consumer = self.consumer
        return await drain_deliveries(
            lambda: consumer.fetch(100, wait=0.5), lambda d: consumer.acknowledge(d.delivery_id)
        )

    async def restart(self, broker: Any) -> Any:
        if self.server is None:
            return await super().restart(broker)
        self.server.kill()
        self.server.start()
        self.proxy.reset_all()
        return broker

    def secrets_in_config(self) -> list[str]:
        return []

    async def close(self) -> None:
        await super().close()
        if self.consumer is not None:
            await self.consumer.close()
        if self.server is None or self.server.proc is not None:
            await _delete_stream(self.url, self.stream)


@pytest.fixture
async def proxy_to_shared(nats_url: str) -> AsyncIterator[TcpProxy]:
    async with running_proxy("127.0.0.1", 4222) as proxy:
        yield proxy


@pytest.fixture
def private_nats(tmp_path: Path) -> Iterator[PrivateNats]:
    server = PrivateNats(tmp_path)
    server.start()
    try:
        yield server
    finally:
        if server.proc is not None:
            server.thaw()
        server.kill()


@pytest.fixture
async def private_proxy(private_nats: PrivateNats) -> AsyncIterator[TcpProxy]:
    async with running_proxy("127.0.0.1", private_nats.port) as proxy:
        yield proxy


@pytest.mark.parametrize("check", sorted(BROKER_CHECKS))
async def test_nats_conformance_on_the_shared_server(
    check: str, nats_url: str, proxy_to_shared: TcpProxy
) -> None:
    async with NatsHarness(nats_url, proxy_to_shared) as h:
        await BROKER_CHECKS[check](h)


@pytest.mark.parametrize("check", ["reconnect_after_restart", "too_large", "lost_ack"])
async def test_nats_conformance_on_a_private_server(
    check: str, private_nats: PrivateNats, private_proxy: TcpProxy
) -> None:
    # No adapter-side limit: "too large" is the server's own max_payload (4096 here), and
    # "restart" is a real SIGKILL and restart of the server process.
    async with NatsHarness(
        private_nats.url, private_proxy, server=private_nats, max_message_bytes=None
    ) as h:
        await BROKER_CHECKS[check](h)


async def test_server_killed_between_publish_and_puback_then_republish_is_a_duplicate(
    private_nats: PrivateNats, private_proxy: TcpProxy
) -> None:
    """Row 26: the server stores the message, the PubAck never arrives, the server dies."""
    h = NatsHarness(private_nats.url, private_proxy, server=private_nats)
    try:
        broker = await h.make_broker()
        first = new_key()
        await broker.publish(message(1), idempotency_key=first, timeout=5)
        key = new_key()
        private_proxy.drop_replies()  # the PUB reaches the server; its PubAck is lost
        with pytest.raises((BrokerTimeoutError, RelayAcknowledgementError)):
            await broker.publish(message(2), idempotency_key=key, timeout=1.5)

        async def stored_both() -> bool:
            nc = await nats.connect(private_nats.url, connect_timeout=2)
            try:
                info = await nc.jetstream().stream_info(h.stream)
                return bool(info.state.messages == 2)
            finally:
                await nc.close()

        await eventually(stored_both)  # the server accepted it before dying
        private_nats.kill()
        private_nats.start()
        private_proxy.reset_all()
        receipt = await publish_retrying(broker, message(2), key)
        assert receipt.duplicate is True
        assert await h.drain() == [(first, message(1)), (key, message(2))]
    finally:
        await h.close()


async def test_frozen_server_times_out_within_the_deadline(
    private_nats: PrivateNats,
) -> None:
    h = NatsHarness(private_nats.url, TcpProxy("127.0.0.1", private_nats.port))
    await h.proxy.start()
    try:
        broker = await h.make_broker()
        await broker.publish(message(1), idempotency_key=new_key(), timeout=5)
        private_nats.freeze()
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            with pytest.raises(BrokerTimeoutError):
                await broker.publish(message(2), idempotency_key=new_key(), timeout=0.7)
        finally:
            private_nats.thaw()
        assert loop.time() - started < 0.7 + 1.0
    finally:
        await h.close()
        await h.proxy.close()


async def test_short_duplicate_window_is_refused_or_raised(nats_url: str) -> None:
    """Row 27: a stream keeping ids for two minutes cannot protect a one-day window."""
    stream, subject = _names()
    nc = await nats.connect(nats_url)
    try:
        await nc.jetstream().add_stream(
            StreamConfig(name=stream, subjects=[subject], duplicate_window=120)
        )
        strict = JetStreamBroker(nats_url, stream=stream, subject=subject)
        with pytest.raises(BrokerConfigurationError, match="duplicate_window") as info:
            await strict.start()
        assert info.value.permanent
        assert "0:02:00" in str(info.value)
        await strict.close()
        managed = JetStreamBroker(
            nats_url,
            stream=stream,
            subject=subject,
            manage_stream=True,
            required_window=timedelta(days=2),
        )
        async with managed:
            assert managed.duplicate_window == timedelta(days=2)
        info2 = await nc.jetstream().stream_info(stream)
        assert info2.config.duplicate_window == 2 * 86400
    finally:
        await nc.jetstream().delete_stream(stream)
        await nc.close()


async def test_missing_stream_is_a_configuration_error(nats_url: str) -> None:
    stream, subject = _names()
    broker = JetStreamBroker(nats_url, stream=stream, subject=subject)
    with pytest.raises(BrokerConfigurationError, match="does not exist"):
        await broker.publish(message(), idempotency_key=new_key(), timeout=2)
    await broker.close()


async def test_server_max_payload_is_a_permanent_failure(private_nats: PrivateNats) -> None:
    stream, subject = _names()
    async with JetStreamBroker(
        private_nats.url, stream=stream, subject=subject, manage_stream=True
    ) as broker:
        ok = await broker.publish(message(1, size=3000), idempotency_key=new_key(), timeout=5)
        assert ok.duplicate is False
        with pytest.raises(MessageTooLargeError, match="4096"):
            await broker.publish(message(2, size=5000), idempotency_key=new_key(), timeout=5)


async def test_unreachable_server_is_unavailable_and_repr_hides_credentials() -> None:
    from nats_support import free_port

    url = f"nats://steeple:hunter2@127.0.0.1:{free_port()}"
    broker = JetStreamBroker(url, stream="S", subject="s.x", connect_timeout=1.0)
    assert "hunter2" not in repr(broker)
    assert "steeple" not in repr(broker).replace("steeple.", "").replace("JetStream", "")
    with pytest.raises((BrokerUnavailableError, BrokerTimeoutError)):
        await broker.publish(message(), idempotency_key=new_key(), timeout=2)
    await broker.close()


async def test_durable_consumer_redelivers_after_ack_wait(nats_url: str) -> None:
    stream, subject = _names()
    try:
        async with JetStreamBroker(
            nats_url, stream=stream, subject=subject, manage_stream=True
        ) as broker:
            key = new_key()
            await broker.publish(message(1), idempotency_key=key, timeout=5)
        async with JetStreamConsumer(
            nats_url, stream=stream, durable="slow", ack_wait=timedelta(seconds=1)
        ) as c:
            [first] = await c.fetch(10)
            assert first.delivery_count == 1
            await asyncio.sleep(1.3)
            [again] = await c.fetch(10, wait=2)
            assert again.idempotency_key == key
            assert again.delivery_count == 2
            assert await c.acknowledge(again.delivery_id)
            assert await c.acknowledge("1.99") is False  # never handed out
            assert await c.fetch(10, wait=1.5) == []
    finally:
        await _delete_stream(nats_url, stream)
