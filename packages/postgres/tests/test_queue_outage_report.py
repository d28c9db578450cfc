"""The worker's report of an unreachable database, driven by a fake monotonic clock.

One line when the outage begins (with its cause), one summary per interval however many
attempts fail, one line when a statement succeeds again; failures the server answered are
left to their loop; ``health()`` names the outage meanwhile.
"""

from __future__ import annotations

import logging

import asyncpg
import pytest

from steeple.postgres.queue._outage import DatabaseReporter, Retry, unreachable
from steeple.postgres.queue._shared import Health, WorkerStatus

LOGGER = "steeple.postgres.queue"


class _Now:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class _Draws:
    def __init__(self, value: float) -> None:
        self.value = value

    def random(self) -> float:
        return self.value

    def token_bytes(self, n: int) -> bytes:
        return bytes(n)


def test_an_outage_is_logged_once_then_once_per_interval_then_once_when_over(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = _Now()
    reporter = DatabaseReporter(every=10.0, now=now)
    refused = ConnectionRefusedError(111, "Connect call failed ('10.0.0.1', 5432)")
    with caplog.at_level(logging.INFO, logger=LOGGER):
        # 356 claims and 356 listener attempts, 20 maintenance rounds, over 21 s
        for n in range(356):
            now.t = 1000.0 + n * 0.06
            assert reporter.failed("claims", refused)
            assert reporter.failed("wake-up listener", refused)
            if n % 18 == 0:
                assert reporter.failed("maintenance", refused)
        assert reporter.reason() is not None
        now.t = 1022.0
        reporter.succeeded()
        reporter.succeeded()  # nothing more to say
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(lines) == 4, lines
    assert lines[0].startswith("database connection failed (claims: ")
    assert lines[1].startswith("database unreachable for 10 s, ")
    assert lines[2].startswith("database unreachable for 20 s, ")
    assert lines[3] == "database reachable again after 22.0 s (732 failed attempts)"
    # The driver's text (which can name hosts) is not repeated; its kind is.
    assert "10.0.0.1" not in "\n".join(lines)
    assert "ConnectionRefusedError" in lines[0]
    assert reporter.reason() is None


def test_errors_the_server_answered_are_left_to_their_loop() -> None:
    reporter = DatabaseReporter(now=_Now())
    answered = asyncpg.exceptions.UndefinedFunctionError("function claim() does not exist")
    assert not unreachable(answered)
    assert not reporter.failed("claims", answered)
    assert reporter.reason() is None
    assert unreachable(TimeoutError())
    assert unreachable(asyncpg.exceptions.AdminShutdownError("terminating connection"))
    assert unreachable(asyncpg.exceptions.InternalClientError("cannot switch to state 15"))


def test_health_is_degraded_while_the_database_is_unreachable() -> None:
    status = WorkerStatus(listen=False)
    status.started()
    status.claimed_once = True
    assert status.health() is Health.HEALTHY
    status.database.failed("renewals", ConnectionResetError())
    assert status.health() is Health.DEGRADED
    (reason,) = status.reasons()
    assert reason.startswith("database unreachable for 0 s, 1 failed attempts (latest: renewals")
    status.database.succeeded()
    assert status.health() is Health.HEALTHY
    assert status.reasons() == ()


def test_each_loop_backs_off_from_its_own_failures_with_injected_jitter() -> None:
    retry = Retry(_Draws(0.0))
    assert [retry.failed() for _ in range(8)] == [0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0]
    retry.succeeded()
    assert retry.failed() == 0.1
    halved = Retry(_Draws(0.999999))
    assert 0.05 < halved.failed() < 0.0501
