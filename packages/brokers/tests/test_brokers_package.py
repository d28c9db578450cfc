"""The package surface: lazy imports, shared helpers, reprs."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap

import pytest

from steeple.brokers._common import (
    Delivery,
    check_key,
    check_timeout,
    publish_guarded,
    redact_url,
)
from steeple.core.errors import (
    BrokerTimeoutError,
    BrokerUnavailableError,
    ConfigurationError,
    RelayAcknowledgementError,
)
from steeple.core.messages import BrokerReceipt, ScheduledMessage


def test_importing_the_package_loads_no_client_library() -> None:
    code = textwrap.dedent(
        """
        import sys
        import steeple.brokers as b
        assert b.Delivery is not None
        loaded = {m.split(".")[0] for m in sys.modules}
        bad = loaded & {"nats", "redis", "aio_pika", "aiormq", "aiosqlite", "asyncpg",
                        "steeple.postgres", "steeple.keyring"}
        bad |= {m for m in sys.modules if m.startswith(("steeple.postgres", "steeple.keyring"))}
        print(sorted(bad))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out == "[]"


def test_lazy_names_resolve_to_their_modules() -> None:
    import steeple.brokers as b
    from steeple.brokers.nats import JetStreamBroker
    from steeple.brokers.sqlite import SqliteJournalBroker
    from steeple.testing import MemoryBroker

    assert b.SqliteJournalBroker is SqliteJournalBroker
    assert b.JetStreamBroker is JetStreamBroker
    assert b.MemoryBroker is MemoryBroker
    assert "RedisStreamBroker" in dir(b)
    with pytest.raises(AttributeError):
        _ = b.NoSuchBroker


def test_redact_url_drops_credentials_and_query() -> None:
    assert redact_url("amqp://guest:pw@host:5672/vh?x=secret") == "amqp://host:5672/vh"
    assert redact_url("redis://:pw@127.0.0.1/0") == "redis://127.0.0.1/0"
    assert "pw" not in redact_url("nats://u:pw@[::1]:4222")


def test_delivery_repr_hides_payload_and_headers() -> None:
    msg = ScheduledMessage("t", "m", b"secret-payload", {"email": "a@b.c"})
    text = repr(Delivery("1", "k", msg))
    assert "secret-payload" not in text
    assert "a@b.c" not in text


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf"), True, "1"])
def test_bad_timeouts_are_refused(bad: object) -> None:
    with pytest.raises(ConfigurationError):
        check_timeout(bad)


@pytest.mark.parametrize("bad", ["", " ", "a b", "é", "x" * 201, None])
def test_bad_keys_are_refused(bad: object) -> None:
    with pytest.raises(ConfigurationError):
        check_key(bad)


async def test_guarded_publish_reports_acceptance_found_by_the_probe() -> None:
    receipt = BrokerReceipt("x", "k", duplicate=True, location="7")

    async def transmit() -> BrokerReceipt:
        await asyncio.sleep(10)
        raise AssertionError("unreachable")

    async def probe() -> BrokerReceipt | None:
        return receipt

    with pytest.raises(RelayAcknowledgementError) as info:
        await publish_guarded(broker="x", key="k", timeout=0.2, transmit=transmit, probe=probe)
    assert info.value.receipt is receipt


async def test_guarded_publish_timeout_and_unreachable_probe() -> None:
    async def transmit() -> BrokerReceipt:
        await asyncio.sleep(10)
        raise AssertionError("unreachable")

    async def nothing() -> BrokerReceipt | None:
        return None

    async def unreachable() -> BrokerReceipt | None:
        raise BrokerUnavailableError("down")

    async def hangs() -> BrokerReceipt | None:
        await asyncio.sleep(10)
        return None

    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(BrokerTimeoutError):
        await publish_guarded(broker="x", key="k", timeout=0.2, transmit=transmit, probe=nothing)
    with pytest.raises(BrokerTimeoutError):
        await publish_guarded(broker="x", key="k", timeout=0.2, transmit=transmit, probe=hangs)
    with pytest.raises(BrokerUnavailableError, match="may have accepted"):
        await publish_guarded(
            broker="x", key="k", timeout=0.2, transmit=transmit, probe=unreachable
        )
    assert loop.time() - started < 0.2 * 3 + 1.0  # each call kept its deadline

    async def slow_prepare() -> None:
        await asyncio.sleep(10)

    with pytest.raises(BrokerTimeoutError, match="nothing was sent"):
        await publish_guarded(
            broker="x",
            key="k",
            timeout=0.1,
            transmit=transmit,
            probe=nothing,
            prepare=slow_prepare,
        )
