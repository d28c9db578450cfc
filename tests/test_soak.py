"""The soak, three minutes long, as one test (``-m soak`` selects it, ``-m "not soak"`` skips
it); ``nox -s soak`` runs it for an hour and draws the plot. See :mod:`soak`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from soak import soak

pytestmark = [pytest.mark.postgres, pytest.mark.slow, pytest.mark.soak]


@pytest.mark.timeout(900)
async def test_three_minute_soak_keeps_memory_fds_and_tasks_bounded_and_loses_nothing(
    tmp_path: Path,
) -> None:
    summary = await soak(tmp_path, 180.0)
    print(json.dumps(summary, indent=2))
    assert summary["kills"] >= 2, summary
    assert summary["resets"] >= 2, summary
    assert summary["restarts"] >= 2, summary
    assert not summary["problems"], summary["problems"]
