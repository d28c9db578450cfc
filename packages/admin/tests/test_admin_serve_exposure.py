"""`steeple admin serve` exposed: token strength, throttling, plain HTTP off loopback."""

from __future__ import annotations

import logging
import secrets
import socket
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from steeple.admin.cli import app
from steeple.admin.serve import (
    MIN_TOKEN_BITS,
    TOKEN_RECIPE,
    Throttle,
    check_exposure,
    check_token,
    token_app,
    token_bits,
)
from steeple.admin.settings import CliError, ExitCode
from steeple.core.errors import ConfigurationError

pytestmark = pytest.mark.usefixtures("clean_env")

WEAK = (
    "aaaaaaaaaaaaaaaa",
    "t" * 40,
    "abcdefghijklmnopqrstuvwxyz0123456789",
    "process-token-0123456789",
    "password1234password1234password1234",
    "correct horse battery staple",
    secrets.token_hex(8),
)


@pytest.mark.parametrize("token", WEAK)
def test_guessable_tokens_are_refused_and_the_message_says_how_to_make_one(token: str) -> None:
    assert token_bits(token) < MIN_TOKEN_BITS
    with pytest.raises(ConfigurationError) as refused:
        check_token(token)
    assert TOKEN_RECIPE in str(refused.value)
    assert token not in str(refused.value)
    with pytest.raises(ConfigurationError):
        token_app(token=token, namespace="ops", stores=None, tasks=None, csrf_token=None)


def test_random_tokens_of_the_recipe_pass() -> None:
    for _ in range(2000):
        token = secrets.token_urlsafe(32)
        assert check_token(token) == token
    assert check_token(secrets.token_hex(32))


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def client_from(app: Any, address: str) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=app, client=(address, 40000))
    return httpx.AsyncClient(transport=transport, base_url="http://admin")


async def test_repeated_wrong_tokens_are_throttled_per_address_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    token = secrets.token_urlsafe(32)
    clock = Clock()
    app = token_app(
        token=token,
        namespace="ops",
        stores=None,
        tasks=None,
        csrf_token=None,
        throttle=Throttle(allowed=5, window=600, base=1, longest=900, clock=clock),
    )
    right = {"authorization": f"Bearer {token}"}
    caplog.set_level(logging.WARNING, logger="steeple.admin")
    async with client_from(app, "203.0.113.7") as attacker:
        codes = []
        for attempt in range(150):
            wrong = {"authorization": f"Bearer guess-{attempt:04d}-{'x' * 20}"}
            codes.append((await attacker.get("/static/admin.css", headers=wrong)).status_code)
        assert codes[:5] == [401] * 5
        assert codes[5] == 401  # the sixth failure starts the block...
        assert set(codes[6:]) == {429}  # ...and then nothing is even checked
        refused = await attacker.get("/static/admin.css", headers=right)
        assert refused.status_code == 429  # the right token too, while blocked
        assert refused.headers["retry-after"] == "1"
        # Each failure after the block doubles it: 1 s, 2 s, 4 s ...
        for expected in (2, 4, 8):
            clock.now += expected / 2
            assert (
                await attacker.get("/static/admin.css", headers={"authorization": "Bearer x"})
            ).status_code == 401
            blocked = await attacker.get("/static/admin.css", headers=right)
            assert blocked.headers["retry-after"] == str(expected)
        clock.now += 8
        assert (await attacker.get("/static/admin.css", headers=right)).status_code == 200
    async with client_from(app, "198.51.100.2") as operator:
        assert (await operator.get("/static/admin.css", headers=right)).status_code == 200
    failures = [r for r in caplog.records if "wrong token" in r.getMessage()]
    assert len(failures) == 6 + 3
    assert all("203.0.113.7" in r.getMessage() for r in failures)
    assert all("guess-" not in r.getMessage() for r in failures)
    assert "refused for 1 s" in failures[5].getMessage()


def test_the_throttle_forgets_old_failures_and_bounds_its_memory() -> None:
    clock = Clock()
    throttle = Throttle(allowed=2, window=60, clients=3, clock=clock)
    assert throttle.failed("a") == 0
    clock.now += 61  # outside the window: counting starts over
    assert throttle.failed("a") == 0
    assert throttle.failed("a") == 0
    assert throttle.failed("a") == 1
    for address in ("b", "c", "d"):
        throttle.failed(address)
    assert throttle.blocked_for("a") == 0  # forgotten: at most three addresses kept


def _listener(host: str) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, 0), family=family)


def test_plain_http_off_loopback_is_refused_unless_insecure() -> None:
    with _listener("127.0.0.1") as local:
        assert check_exposure(local, tls=False, insecure=False) is None
    with _listener("0.0.0.0") as everywhere:
        with pytest.raises(CliError) as refused:
            check_exposure(everywhere, tls=False, insecure=False)
        assert refused.value.code == ExitCode.CONFIG
        assert "--certfile" in (refused.value.hint or "")
        assert check_exposure(everywhere, tls=True, insecure=False) is None
        warning = check_exposure(everywhere, tls=False, insecure=True)
        assert warning is not None
        assert "plain HTTP" in warning


def test_the_command_refuses_a_weak_token_and_plain_http_on_every_interface() -> None:
    runner = CliRunner()
    dsn = "postgresql://x@127.0.0.1:1/db"
    weak = runner.invoke(
        app,
        ["admin", "serve", "--queue-only", "--dsn", dsn, "--port", "0"],
        env={"STEEPLE_ADMIN_TOKEN": "aaaaaaaaaaaaaaaa"},
    )
    assert weak.exit_code == ExitCode.CONFIG
    assert "128" in weak.stderr
    assert "export STEEPLE_ADMIN_TOKEN=" in weak.stderr
    assert "aaaaaaaaaaaaaaaa" not in weak.stderr
    weak_csrf = runner.invoke(
        app,
        ["admin", "serve", "--queue-only", "--dsn", dsn, "--port", "0"],
        env={
            "STEEPLE_ADMIN_TOKEN": secrets.token_urlsafe(32),
            "STEEPLE_ADMIN_CSRF_TOKEN": "csrf-token-0123456789",
        },
    )
    assert weak_csrf.exit_code == ExitCode.CONFIG
    assert "STEEPLE_ADMIN_CSRF_TOKEN" in weak_csrf.stderr
    strong = {"STEEPLE_ADMIN_TOKEN": secrets.token_urlsafe(32)}
    exposed = runner.invoke(
        app,
        ["admin", "serve", "--queue-only", "--dsn", dsn, "--host", "0.0.0.0", "--port", "0"],
        env=strong,
    )
    assert exposed.exit_code == ExitCode.CONFIG
    assert "plain HTTP" in exposed.stderr
    insecure = runner.invoke(
        app,
        [
            "admin",
            "serve",
            "--queue-only",
            "--dsn",
            dsn,
            "--host",
            "0.0.0.0",
            "--port",
            "0",
            "--insecure",
        ],
        env=strong,
    )
    # It warns, then goes on (and here fails to reach the database that is not there).
    assert "warning: serving plain HTTP" in insecure.stderr
    assert insecure.exit_code == ExitCode.UNAVAILABLE
