"""The soak's resource bounds judge what a leak looks like, not the pools' coming and going.

The soak itself (``tests/test_soak.py``) only ever sees a healthy worker; these feed the
judge made-up summaries and the sampler a real socket its peer closed, so that a bound
that cannot fail, or one that fails on a healthy worker's drift, is caught here.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import Any

from soak import APP_MODULE, HALF_CLOSED_LIMIT_S, problems_of


def healthy(**changes: Any) -> dict[str, Any]:
    # The figures of a healthy three-minute run whose pools held 13 sockets after the
    # warm-up and 18 at the end: all fds drift upwards, the other fds do not.
    summary: dict[str, Any] = {
        "rss_kb_per_10_min": 1447.6,
        "in_use_kb_per_10_min": 298.1,
        "rss_limit_kb_per_10_min": 10240.0,
        "fds_max": 21,
        "fds_per_10_min": 29.91,
        "other_fds_per_10_min": 0.0,
        "half_closed_s_max": 2.0,
        "asyncio_tasks_max": 22,
        "asyncio_tasks_per_10_min": 0.0,
        "exit_codes": {"soak0-1": 0},
    }
    return {**summary, **changes}


def test_sockets_drifting_over_a_short_run_pass() -> None:
    assert problems_of(healthy(), long_run=False) == []


def test_all_fds_growing_over_a_long_run_fail() -> None:
    problems = problems_of(healthy(), long_run=True)
    assert len(problems) == 1
    assert problems[0].startswith("file descriptors grow")
    assert problems_of(healthy(fds_per_10_min=0.5), long_run=True) == []


def test_fds_that_are_not_sockets_growing_fail_on_any_run() -> None:
    for long_run in (False, True):
        problems = problems_of(healthy(other_fds_per_10_min=1.0), long_run=long_run)
        assert len(problems) == 1
        assert problems[0].startswith("file descriptors not bounded")


def test_too_many_fds_fail() -> None:
    problems = problems_of(healthy(fds_max=65), long_run=False)
    assert len(problems) == 1
    assert problems[0].startswith("file descriptors not bounded")


def test_a_socket_left_half_closed_fails() -> None:
    assert problems_of(healthy(half_closed_s_max=HALF_CLOSED_LIMIT_S), long_run=False) == []
    problems = problems_of(healthy(half_closed_s_max=HALF_CLOSED_LIMIT_S + 0.1), long_run=False)
    assert len(problems) == 1
    assert "stayed open 60.1 s" in problems[0]


def sampler() -> Callable[[dict[str, float]], dict[str, Any]]:
    # The worker's app module is text the soak writes out; its sampler is taken from it.
    namespace: dict[str, Any] = {}
    exec(compile(APP_MODULE, "soak_app", "exec"), namespace)
    fds: Callable[[dict[str, float]], dict[str, Any]] = namespace["_fds"]
    return fds


def test_the_sampler_times_a_socket_whose_peer_closed_it_until_it_is_closed_here() -> None:
    fds = sampler()
    half_closed: dict[str, float] = {}
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        accepted, _ = server.accept()
        try:
            first = fds(half_closed)
            assert first["half_closed_s"] == 0.0
            assert half_closed == {}
            assert first["sockets"] >= 3
            assert first["fds"] > first["sockets"]
            accepted.close()  # the peer closes; the client's socket waits in CLOSE_WAIT
            deadline = time.monotonic() + 10
            while not half_closed:
                assert time.monotonic() < deadline, "the peer's close never arrived"
                fds(half_closed)
            (inode,) = half_closed
            half_closed[inode] -= 90  # as if first seen a minute and a half ago
            assert fds(half_closed)["half_closed_s"] >= 90
        finally:
            client.close()
        assert fds(half_closed)["half_closed_s"] == 0.0
        assert half_closed == {}
