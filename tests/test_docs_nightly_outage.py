"""docs/examples/nightly-outage.md never goes stale: its script, table and plot are regenerated.

When this fails after a change to the simulator, the table format or the plot, refresh the
page with ``.venv/bin/python docs/examples/nightly_outage.py --write`` and review the diff.
"""

from __future__ import annotations

import html
import json
import re
import runpy
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from steeple.admin.cli import app

EXAMPLES = Path(__file__).resolve().parents[1] / "docs" / "examples"
SCRIPT = EXAMPLES / "nightly_outage.py"
PAGE = EXAMPLES / "nightly-outage.md"
PLOT = EXAMPLES / "nightly-outage.svg"
REFRESH = "stale: run .venv/bin/python docs/examples/nightly_outage.py --write"


@pytest.fixture(scope="module")
def script() -> dict[str, Any]:
    """The page's script, run once for the module (simulating three days and rendering the
    plot take a while); its namespace gains ``rendered``: what ``render()`` returned."""
    namespace = runpy.run_path(str(SCRIPT))
    namespace["rendered"] = namespace["render"]()
    return namespace


def committed_table() -> str:
    text = PAGE.read_text()
    _, rest = text.split("<!-- table -->\n```\n", 1)
    table, _ = rest.split("\n```\n<!-- /table -->", 1)
    return table


def test_the_page_shows_the_script_as_it_is() -> None:
    assert f"```python\n{SCRIPT.read_text().rstrip()}\n```" in PAGE.read_text(), REFRESH


def test_the_table_and_the_plot_are_what_the_script_produces_now(script: dict[str, Any]) -> None:
    namespace = script
    table, svg = namespace["rendered"]
    assert table == committed_table(), REFRESH
    assert svg == PLOT.read_bytes(), REFRESH
    # The page's claims hold for this run.
    result = namespace["result"]
    assert result.overall.dead == result.overall.expired == result.overall.live == 0
    by_name = {d.name: d.stats for d in result.definitions}
    assert by_name["cache-warm"].materialized == 263
    assert 6 * 3600 <= by_name["hourly-sync"].lateness.max < 6 * 3600 + 1
    assert 2.5 * 3600 <= by_name["nightly-report"].lateness.max < 2.5 * 3600 + 1


def svg_texts(svg: bytes) -> list[str]:
    """The plot's texts: drawn as paths, matplotlib keeps each one in a comment."""
    return [html.unescape(t) for t in re.findall(r"<!-- (.*?) -->", svg.decode())]


def test_the_plot_tells_the_outage_story_in_its_own_words(script: dict[str, Any]) -> None:
    _, svg = script["rendered"]
    texts = svg_texts(svg)
    # The outage is shaded and named; each outcome has a legend entry with its count.
    assert "host down 22:00–04:00 (6 h)" in texts
    assert "zoom: around the host down 22:00–04:00 (6 h)" in texts
    for entry in (
        "on time (< 1 min late): 333",
        "published late (height: how late): 10",
        "coalesced away (folded into an earlier run): 24",
        "dead letter: 0",
        "expired (delivery window ended): 0",
        "not finished when the range ended: 0",
        "host down",
    ):
        assert entry in texts, entry
    # One caption per definition: the counts, then what the outage did to its runs.
    for caption in (
        "cache-warm (coalesce, */15 * * * *): 287 due runs: 263 published, 262 on time,"
        " 1 late (worst 6 h), 24 coalesced away",
        "24 runs due during the host outage → 1 publication at 04:00, 6 h late",
        "hourly-sync (catch-up, 0 * * * *): 71 due runs: 71 published, 65 on time,"
        " 6 late (worst 6 h)",
        "6 runs due during the host outage → 6 publications at 04:00, 1 h to 6 h late",
        "1 run due during the host outage → 1 publication at 04:00, 2 h 30 min late",
        "How late: 343 publications, 333 on time, 10 late (median of the late 3 h, worst 6 h)",
    ):
        assert caption in texts, caption
    # The zoomed panels say it without the captions: the six catch-up runs went out
    # together, the coalesced one carried the 24 runs after it.
    assert "6 runs due 22:00–03:00:" in texts
    assert "all published 04:00" in texts
    assert "+ 24 later runs coalesced into it" in texts


def test_the_command_line_version_gives_the_same_answer(script: dict[str, Any]) -> None:
    result = script["result"]
    args = [
        "simulate",
        "--definitions",
        str(EXAMPLES / "nightly-jobs.toml"),
        "--from",
        "2026-01-30T00:00Z",
        "--days",
        "3",
        "--host-outage",
        "2026-01-31T22:00Z/PT6H",
        "--workers",
        "2",
        "--rate",
        "20",
        "--seed",
        "1",
        "--json",
    ]
    ran = CliRunner().invoke(app, args, catch_exceptions=False)
    assert ran.exit_code == 0, ran.output
    data = json.loads(ran.stdout)
    assert data["overall"] == result.overall.to_json()
    assert data["definitions"] == [d.to_json() for d in result.definitions]
