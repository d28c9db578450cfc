"""docs/examples/nightly-outage.md never goes stale: its script, table and plot are regenerated.

When this fails after a change to the simulator, the table format or the plot, refresh the
page with ``.venv/bin/python docs/examples/nightly_outage.py --write`` and review the diff.
"""

from __future__ import annotations

import json
import runpy
from pathlib import Path

from typer.testing import CliRunner

from steeple.admin.cli import app

EXAMPLES = Path(__file__).resolve().parents[1] / "docs" / "examples"
SCRIPT = EXAMPLES / "nightly_outage.py"
PAGE = EXAMPLES / "nightly-outage.md"
PLOT = EXAMPLES / "nightly-outage.svg"
REFRESH = "stale: run .venv/bin/python docs/examples/nightly_outage.py --write"


def committed_table() -> str:
    text = PAGE.read_text()
    _, rest = text.split("<!-- table -->\n```\n", 1)
    table, _ = rest.split("\n```\n<!-- /table -->", 1)
    return table


def test_the_page_shows_the_script_as_it_is() -> None:
    assert f"```python\n{SCRIPT.read_text().rstrip()}\n```" in PAGE.read_text(), REFRESH


def test_the_table_and_the_plot_are_what_the_script_produces_now() -> None:
    namespace = runpy.run_path(str(SCRIPT))
    table, svg = namespace["render"]()
    assert table == committed_table(), REFRESH
    assert svg == PLOT.read_bytes(), REFRESH
    # The page's claims hold for this run.
    result = namespace["result"]
    assert result.overall.dead == result.overall.expired == result.overall.live == 0
    by_name = {d.name: d.stats for d in result.definitions}
    assert by_name["cache-warm"].materialized == 263
    assert 6 * 3600 <= by_name["hourly-sync"].lateness.max < 6 * 3600 + 1
    assert 2.5 * 3600 <= by_name["nightly-report"].lateness.max < 2.5 * 3600 + 1


def test_the_command_line_version_gives_the_same_answer() -> None:
    namespace = runpy.run_path(str(SCRIPT))
    result = namespace["result"]
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
