"""The soak, three minutes long, as one test (``-m soak`` selects it, ``-m "not soak"`` skips
it); ``nox -s soak`` runs it for an hour and draws the plot. See :mod:`soak`. The recurring
relays publish into the machine's Redis (``STEEPLE_TEST_REDIS``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from soak import soak

pytestmark = [pytest.mark.postgres, pytest.mark.slow, pytest.mark.soak]


@pytest.mark.timeout(900)
async def test_three_minute_soak_keeps_memory_fds_and_tasks_bounded_and_loses_nothing(
    tmp_path: Path, redis_url: str
) -> None:
    summary = await soak(tmp_path, 180.0, redis_url=redis_url)
    print(json.dumps(summary, indent=2))
    assert summary["kills"] >= 2, summary
    assert summary["resets"] >= 2, summary
    assert summary["restarts"] >= 2, summary
    # Sixteen definitions, most due every minute, two minutes of backlog: the checker ran
    # over dozens of occurrences, each in the stream once.
    assert summary["recurring_published"] >= 50, summary
    assert summary["stream_entries"] >= summary["recurring_published"], summary
    assert not summary["problems"], summary["problems"]
