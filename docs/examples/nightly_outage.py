"""Nightly jobs and a six-hour database outage on the last day of the month.

What happens to our nightly jobs if the database is down for 6 hours on the last day of
the month? A notebook in a script: run it as it is (it prints the answer), cell by cell in an editor
that understands ``# %%``, or with ``--write`` to regenerate the page beside it
(nightly-outage.md and nightly-outage.svg; a test fails when they are stale).
"""

# %% The jobs: what runs, when, and what a missed run should do
from datetime import UTC, datetime, timedelta

from steeple.core import MissedRunPolicy, RecurringConfig, RecurringDefinition, ScheduledMessage
from steeple.testing.simulation import Interval, RelayCapacity, Scenario, run

START = datetime(2026, 1, 30, tzinfo=UTC)
CATCH_UP, COALESCE = MissedRunPolicy.CATCH_UP, MissedRunPolicy.COALESCE
JOBS = [
    # name,              cron,           policy: catch up every missed run, or run once
    ("nightly-billing", "0 2 * * *", CATCH_UP),
    ("nightly-report", "30 1 * * *", COALESCE),
    ("invoice-reminders", "0 23 * * *", CATCH_UP),
    ("hourly-sync", "0 * * * *", CATCH_UP),
    ("cache-warm", "*/15 * * * *", COALESCE),
]
definitions = [
    RecurringDefinition(name, cron, START, policy, ScheduledMessage("jobs", name, b"{}"))
    for name, cron, policy in JOBS
]

# %% The what-if: the database is down from 22:00 UTC on January 31st for six hours
outage = Interval.parse("2026-01-31T22:00Z/PT6H")
scenario = Scenario(
    # One namespace: a one-day delivery window, 60-second leases (steeple's defaults).
    RecurringConfig("billing", 100, 100_000),
    definitions,
    START,
    START + timedelta(days=3),
    relay=RelayCapacity(workers=2, rate=20.0),
    host_outages=[outage],
    sample_interval=timedelta(minutes=15),
)
# trace=True records each occurrence's end: the plot draws every due run.
result = run(scenario, seed=1, trace=True)

# %% The answer, definition by definition
for job in result.definitions:
    late = job.stats.lateness
    print(
        f"{job.name:18} {job.policy.value:9} published {job.stats.published:3} "
        f"of {job.stats.materialized:3}, worst {late.max / 60:6.1f} min late"
    )


# %% The table and the plot (what `steeple simulate` prints and draws)
def render() -> tuple[str, bytes]:
    """Return the summary table as text and the plot as SVG bytes."""
    import tempfile
    from pathlib import Path

    from steeple.admin.simulate_cli import render_hits, render_table, table_text
    from steeple.admin.simulate_plot import write_plot

    table = table_text(render_table(result)) + "\n\n" + render_hits(result)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "nightly-outage.svg"
        write_plot(result, path)
        return table, path.read_bytes()


if __name__ == "__main__":
    import sys
    from pathlib import Path

    table, svg = render()
    print(table)
    if "--write" in sys.argv:
        here = Path(__file__).parent
        (here / "nightly-outage.svg").write_bytes(svg)
        page = here / "nightly-outage.md"
        text = page.read_text()
        script = Path(__file__).read_text().rstrip("\n")
        for marker, body, kind in (("script", script, "python"), ("table", table, "")):
            head, rest = text.split(f"<!-- {marker} -->\n", 1)
            _, tail = rest.split(f"<!-- /{marker} -->\n", 1)
            text = f"{head}<!-- {marker} -->\n```{kind}\n{body}\n```\n<!-- /{marker} -->\n{tail}"
        page.write_text(text)
