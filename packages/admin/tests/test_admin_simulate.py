"""``steeple simulate``: flags and definitions files, table/JSON/plot/chart, hostile input."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from steeple.admin.cli import app
from steeple.admin.definitions_file import (
    DefinitionDefaults,
    DefinitionsFileError,
    load_definitions,
)
from steeple.admin.settings import ExitCode
from steeple.admin.simulate_plot import plot_figure, write_plot
from steeple.core import MissedRunPolicy, RecurringConfig, RecurringDefinition, ScheduledMessage
from steeple.testing.simulation import BrokerModel, Interval, Scenario, run

runner = CliRunner()

RANGE = ["--from", "2026-01-30T00:00Z", "--days", "3"]
FLAGS = [
    "--cron",
    "0 2 * * *",
    "--cron",
    "30 1 * * *",
    "--cron",
    "0 * * * *",
    "--policy",
    "catch_up",
    "--policy",
    "coalesce",
    "--policy",
    "catch_up",
    "--name",
    "nightly-billing",
    "--name",
    "nightly-report",
    "--name",
    "hourly-sync",
    *RANGE,
    "--host-outage",
    "2026-01-31T22:00Z/PT6H",
    "--broker-outage",
    "2026-01-30T10:00Z/2026-01-30T10:20Z",
    "--ack-loss-rate",
    "0.02",
    "--clock-regression",
    "2026-01-30T12:00:00.5Z/PT3S",
    "--seed",
    "4",
]

TOML = """
[[definitions]]
name = "nightly-billing"
cron = "0 2 * * *"
policy = "catch_up"

[[definitions]]
name = "nightly-report"
cron = "30 1 * * *"
policy = "coalesce"
topic = "reports"
message_type = "report.build"
payload = '{"kind": "nightly"}'
headers = { team = "finance" }

[[definitions]]
name = "hourly-sync"
cron = "0 * * * *"
first_after = "2026-01-30T00:00:00Z"
"""


def invoke(args: list[str]) -> Any:
    return runner.invoke(app, ["simulate", *args], catch_exceptions=False)


def test_flags_give_a_table_of_every_definition_and_the_totals() -> None:
    result = invoke(FLAGS)
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "steeple simulate: 2026-01-30 00:00Z to 2026-02-02 00:00Z, seed 4" in out
    for name in ("nightly-billing", "nightly-report", "hourly-sync", "all catch_up", "all"):
        assert name in out
    # The hourly catch-up definition missed six runs in the outage: worst lateness 6 h.
    hourly = next(line for line in out.splitlines() if line.strip().startswith("hourly-sync"))
    assert hourly.split()[-2:] == ["6h", "00m"]
    assert "broker failures" in out
    assert "lost acks" in out


def test_json_is_the_api_result_and_repeats_exactly() -> None:
    first = invoke([*FLAGS, "--json"])
    assert first.exit_code == 0, first.output
    again = invoke([*FLAGS, "--json"])
    assert first.stdout == again.stdout
    data = json.loads(first.stdout)
    assert data["seed"] == 4
    assert [d["name"] for d in data["definitions"]] == [
        "nightly-billing",
        "nightly-report",
        "hourly-sync",
    ]
    overall = data["overall"]
    assert overall["materialized"] == 77
    assert overall["materialized"] == sum(
        overall[k] for k in ("published", "dead", "expired", "cancelled", "live")
    )
    assert data["scenario"]["host_outages"] == ["2026-01-31T22:00:00Z/2026-02-01T04:00:00Z"]
    assert data["scenario"]["clock_regressions"] == [
        {"at": "2026-01-30T12:00:00.500000Z", "by_s": 3.0}
    ]
    other_seed = invoke([*FLAGS[:-1], "5", "--json"])
    assert json.loads(other_seed.stdout)["seed"] == 5


@pytest.mark.parametrize("suffix", [".toml", ".json"])
def test_a_definitions_file_gives_the_same_run_as_the_flags(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"defs{suffix}"
    if suffix == ".toml":
        path.write_text(TOML)
    else:
        import tomllib

        path.write_text(json.dumps(tomllib.loads(TOML)["definitions"]))
    from_file = invoke(["--definitions", str(path), *FLAGS[18:], "--json"])
    from_flags = invoke([*FLAGS, "--json"])
    assert from_file.exit_code == 0, from_file.output
    file_data, flag_data = json.loads(from_file.stdout), json.loads(from_flags.stdout)
    assert file_data["overall"] == flag_data["overall"]
    assert file_data["series"] == flag_data["series"]
    report = file_data["scenario"]["definitions"][1]
    assert report["topic"] == "reports"
    assert report["message_type"] == "report.build"


def test_the_definitions_file_format_is_read_in_one_place(tmp_path: Path) -> None:
    path = tmp_path / "defs.toml"
    path.write_text(TOML)
    from datetime import UTC, datetime

    start = datetime(2026, 1, 1, tzinfo=UTC)
    loaded = load_definitions(path, DefinitionDefaults(start, "t", "m"))
    assert [d.name for d in loaded] == ["nightly-billing", "nightly-report", "hourly-sync"]
    assert loaded[1].message.payload == b'{"kind": "nightly"}'
    assert dict(loaded[1].message.headers) == {"team": "finance"}
    assert loaded[0].first_after == start
    assert loaded[2].first_after == datetime(2026, 1, 30, tzinfo=UTC)
    # Without defaults, topic and message type are required (as `schedules create` will
    # require them).
    with pytest.raises(DefinitionsFileError, match="'topic' is required"):
        load_definitions(path, DefinitionDefaults(first_after=start))


def test_a_plot_is_written_as_png_or_deterministic_svg(tmp_path: Path) -> None:
    png, svg, svg2 = tmp_path / "a.png", tmp_path / "a.svg", tmp_path / "b.svg"
    assert invoke([*FLAGS, "--plot", str(png)]).exit_code == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert invoke([*FLAGS, "--plot", str(svg)]).exit_code == 0
    assert invoke([*FLAGS, "--plot", str(svg2)]).exit_code == 0
    text = svg.read_text()
    assert text.startswith("<?xml")
    assert "<dc:date>" not in text
    assert svg.read_bytes() == svg2.read_bytes()


def figure_texts(figure: Any) -> list[str]:
    from matplotlib.text import Text

    return [t.get_text() for t in figure.findobj(Text) if t.get_text()]


def test_the_plot_marks_dead_letters_and_broker_outages_and_needs_a_traced_run(
    tmp_path: Path,
) -> None:
    start = datetime(2026, 1, 30, tzinfo=UTC)
    message = ScheduledMessage("jobs", "job", b"{}")
    scenario = Scenario(
        RecurringConfig("plot", 10, 1000, delivery_window=timedelta(hours=1)),
        [RecurringDefinition("every-10", "*/10 * * * *", start, MissedRunPolicy.CATCH_UP, message)],
        start,
        start + timedelta(hours=6),
        # Every publication fails for two hours: runs due then exhaust their window.
        broker=BrokerModel(
            outages=[Interval(start + timedelta(hours=1), start + timedelta(hours=3))]
        ),
    )
    result = run(scenario, seed=1, trace=True)
    stats = result.definitions[0].stats
    lost = stats.dead + stats.expired
    assert lost > 0
    texts = figure_texts(plot_figure(result))
    assert "broker down" in texts
    assert "broker down 01:00–03:00 (2 h)" in texts
    assert f"dead letter: {stats.dead}" in texts
    assert f"expired (delivery window ended): {stats.expired}" in texts
    caption = next(t for t in texts if t.startswith("every-10 (catch-up, */10 * * * *): "))
    assert f"{stats.published} published" in caption
    # Every run due while the broker was down went to the dead letters.
    assert stats.dead == 12
    assert caption.endswith("\n12 runs due during the broker outage → no publication (12 dead)")
    # An untraced run does not know its due runs: a clear error, no file.
    with pytest.raises(ValueError, match="trace=True"):
        write_plot(run(scenario, seed=1), tmp_path / "untraced.svg")
    assert not (tmp_path / "untraced.svg").exists()


def test_many_definitions_are_drawn_one_row_per_policy() -> None:
    start = datetime(2026, 1, 30, tzinfo=UTC)
    message = ScheduledMessage("jobs", "job", b"{}")
    policies = [MissedRunPolicy.CATCH_UP, MissedRunPolicy.COALESCE]
    definitions = [
        RecurringDefinition(f"job-{k}", f"{k} * * * *", start, policies[k % 2], message)
        for k in range(12)
    ]
    scenario = Scenario(
        RecurringConfig("plot", 20, 1000), definitions, start, start + timedelta(hours=3)
    )
    texts = figure_texts(plot_figure(run(scenario, seed=1, trace=True)))
    assert any(t.startswith("6 definitions with policy catch-up: 17 due runs") for t in texts)
    assert any(t.startswith("6 definitions with policy coalesce: 18 due runs") for t in texts)
    assert not any(t.startswith("job-") for t in texts)


def test_the_terminal_chart_shows_backlog_lateness_and_outages() -> None:
    result = invoke([*FLAGS, "--chart"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    chart = lines[next(i for i, line in enumerate(lines) if line.startswith("catch-up:")) :]
    assert chart[1].lstrip().startswith("materialized (max ")
    assert chart[2].lstrip().startswith("backlog (peak ")
    assert chart[3].lstrip().startswith("lateness (worst 6.0h)")
    assert "#" in chart[4]
    assert chart[4].lstrip().startswith("host down")
    assert "coalesce:" in result.stdout


def test_without_matplotlib_a_plot_request_prints_a_terminal_chart(tmp_path: Path) -> None:
    # A real process in which importing matplotlib fails, as on an install without the
    # [plot] extra.
    script = (
        "import sys\n"
        "sys.modules['matplotlib'] = None\n"
        "from steeple.admin.cli import main\n"
        "sys.argv = ['steeple', 'simulate', *sys.argv[1:]]\n"
        "main()\n"
    )
    target = tmp_path / "never.svg"
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEEPLE_")}
    done = subprocess.run(
        [sys.executable, "-c", script, *FLAGS, "--plot", str(target)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "matplotlib is not installed" in done.stderr
    assert "steeple-admin[plot]" in done.stderr
    assert "backlog (peak " in done.stdout
    assert "host down" in done.stdout
    assert not target.exists()


def test_without_the_simulator_the_command_names_its_extra_and_others_still_work() -> None:
    # A real process in which the test kit cannot be imported, as on an install of
    # steeple-admin without the [simulate] extra: the CLI loads, --help works, the other
    # commands do not need it, and simulate says what to install.
    script = (
        "import sys\n"
        "sys.modules['steeple.testing'] = None\n"
        "sys.modules['hypothesis'] = None\n"
        "from steeple.admin.cli import main\n"
        "sys.argv = ['steeple', *sys.argv[1:]]\n"
        "main()\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEEPLE_")}

    def steeple(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-c", script, *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
            check=False,
        )

    for args in (["--help"], ["simulate", "--help"], ["migrate", "--help"]):
        done = steeple(*args)
        assert done.returncode == 0, done.stderr
    done = steeple("simulate", *FLAGS)
    assert done.returncode == ExitCode.CONFIG, done.stderr
    assert "needs the simulator" in done.stderr
    assert "pip install 'steeple-admin[simulate]'" in done.stderr
    assert "Traceback" not in done.stderr


def test_simulate_is_listed_in_the_command_help() -> None:
    result = runner.invoke(app, ["--help"])
    assert "simulate" in result.stdout
    assert runner.invoke(app, ["simulate", "--help"]).exit_code == 0


BIG = "x" * 10_000


@pytest.mark.parametrize(
    ("args", "code", "says"),
    [
        (["--cron", "61 * * * *", *RANGE], ExitCode.USAGE, "minute"),
        (["--cron", "0 0 * * 0", *RANGE], ExitCode.USAGE, "weekday"),
        (["--cron", BIG, *RANGE], ExitCode.USAGE, "cron"),
        (["--cron", "0 0 30 2 *", *RANGE], ExitCode.USAGE, "never"),
        (["--cron", "* * * * *", "--name", BIG, *RANGE], ExitCode.USAGE, "a name is 1..200"),
        (["--cron", "* * * * *", "--name", "a\x00b", *RANGE], ExitCode.USAGE, "control"),
        (["--cron", "* * * * *", "--policy", "sometimes", *RANGE], ExitCode.USAGE, "policy"),
        (
            [
                "--cron",
                "* * * * *",
                "--cron",
                "1 * * * *",
                "--policy",
                "coalesce",
                "--policy",
                "catch_up",
                "--policy",
                "coalesce",
                *RANGE,
            ],
            ExitCode.USAGE,
            "--policy",
        ),
        (["--cron", "* * * * *", "--failure-rate", "nan", *RANGE], ExitCode.USAGE, "rate"),
        (["--cron", "* * * * *", "--ack-loss-rate", "inf", *RANGE], ExitCode.USAGE, "rate"),
        (["--cron", "* * * * *", "--failure-rate", "-0.5", *RANGE], ExitCode.USAGE, "rate"),
        (["--cron", "* * * * *", "--rate", "nan", *RANGE], ExitCode.USAGE, "--rate"),
        (["--cron", "* * * * *", "--workers", "0", *RANGE], ExitCode.USAGE, "workers"),
        (["--cron", "* * * * *", "--tick-budget", "0", *RANGE], ExitCode.USAGE, "budget"),
        (["--cron", "* * * * *", "--claim-limit", "1000", *RANGE], ExitCode.USAGE, "limit"),
        (["--cron", "* * * * *", "--tick-interval", "0s", *RANGE], ExitCode.USAGE, "interval"),
        (
            ["--cron", "* * * * *", "--tick-interval", "9" * 30 + "d", *RANGE],
            ExitCode.USAGE,
            "--tick-interval",
        ),
        (
            ["--cron", "* * * * *", "--host-outage", "2026-02-01T04:00Z/2026-01-31T22:00Z", *RANGE],
            ExitCode.USAGE,
            "reversed",
        ),
        (
            ["--cron", "* * * * *", "--host-outage", "2026-01-31T22:00/PT6H", *RANGE],
            ExitCode.USAGE,
            "time zone",
        ),
        (["--cron", "* * * * *", "--host-outage", BIG, *RANGE], ExitCode.USAGE, "interval"),
        (
            ["--cron", "* * * * *", "--broker-outage", "2026-01-31T22:00Z/P1M", *RANGE],
            ExitCode.USAGE,
            "duration",
        ),
        (
            ["--cron", "* * * * *", "--clock-regression", "2026-01-30T12:00Z", *RANGE],
            ExitCode.USAGE,
            "instant/duration",
        ),
        (
            ["--cron", "* * * * *", "--clock-regression", "2026-01-30T12:00Z/P30D", *RANGE],
            ExitCode.USAGE,
            "at most",
        ),
        (["--cron", "* * * * *", "--from", BIG, "--days", "1"], ExitCode.USAGE, "--from"),
        (
            ["--cron", "* * * * *", "--from", "2026-01-30", "--days", "1"],
            ExitCode.USAGE,
            "time zone",
        ),
        (
            ["--cron", "* * * * *", "--from", "2100-12-01T00:00Z", "--days", "60"],
            ExitCode.USAGE,
            "2100",
        ),
        (
            ["--cron", "* * * * *", "--from", "2026-01-01T00:00Z", "--to", "2150-01-01T00:00Z"],
            ExitCode.USAGE,
            "2100",
        ),
        (
            ["--cron", "* * * * *", "--from", "2026-01-01T00:00Z", "--to", "2025-01-01T00:00Z"],
            ExitCode.USAGE,
            "reversed",
        ),
        (
            ["--cron", "* * * * *", "--from", "2026-01-01T00:00Z", "--days", "1e9"],
            ExitCode.USAGE,
            "--days",
        ),
        (
            ["--cron", "* * * * *", "--from", "2026-01-01T00:00Z", "--days", "nan"],
            ExitCode.USAGE,
            "--days",
        ),
        (["--cron", "* * * * *", *RANGE, "--to", "2026-02-01T00:00Z"], ExitCode.USAGE, "not both"),
        (["--cron", "* * * * *", *RANGE, "--seed", "-1"], ExitCode.USAGE, "--seed"),
        (["--cron", "* * * * *", *RANGE, "--seed", str(2**70)], ExitCode.USAGE, "--seed"),
        (["--cron", "* * * * *", *RANGE, "--plot", "out.gif"], ExitCode.USAGE, ".png or .svg"),
        (["--cron", "* * * * *", *RANGE, "--window", "0s"], ExitCode.CONFIG, "window"),
        (["--cron", "* * * * *", *RANGE, "--lease", "1h"], ExitCode.CONFIG, "lease"),
        (
            ["--cron", "* * * * *", *RANGE, "--max-occurrences", "0"],
            ExitCode.CONFIG,
            "max_occurrences",
        ),
        (
            ["--cron", "* * * * *", *RANGE, "--sample-interval", "1ms"],
            ExitCode.USAGE,
            "sample interval",
        ),
        ([*RANGE], ExitCode.USAGE, "nothing to simulate"),
    ],
)
def test_hostile_input_gets_one_line_and_the_usage_or_config_code(
    args: list[str], code: ExitCode, says: str
) -> None:
    result = invoke(args)
    assert result.exit_code == code, result.output
    lines = result.stderr.splitlines()
    assert lines[0].startswith("steeple: error: ")
    assert says in lines[0]
    assert len(lines) <= 2
    assert all(len(line) < 400 for line in lines)
    assert "Traceback" not in result.output
    assert result.stdout == ""


@pytest.mark.parametrize(
    ("content", "says"),
    [
        ("{", "not valid JSON"),
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
        ("[]", "no definitions"),
        ('{"defs": []}', "unknown top-level key"),
        ('[{"name": "a", "cron": "* * * * *", "when": 1}]', "unknown field 'when'"),
        ('[{"cron": "* * * * *"}]', "'name' is required"),
        ('[{"name": "a", "cron": "* * * * *", "first_after": ' + "9" * 5000 + "}]", "digits"),
        ('[{"name": 5, "cron": "* * * * *"}]', "must be a string"),
        ('[{"name": "a", "cron": "* * * * *", "policy": "never"}]', "policy"),
        ('[{"name": "a", "cron": "* * * * *", "first_after": "2026-01-01"}]', "time zone"),
        ('[{"name": "a", "cron": "* * * * *", "payload_base64": "%%"}]', "base64"),
        ('[{"name": "a", "cron": "* * * * *", "payload": "' + "x" * 20_000 + '"}]', "16 KiB"),
        ('[{"name": "a", "cron": "* * * * *", "headers": {"k": "v\\nx"}}]', "control"),
        ('[{"name": "a", "cron": "* * * * *"}, {"name": "a", "cron": "1 * * * *"}]', "twice"),
        ('[{"name": "\\ud800", "cron": "* * * * *"}]', "control"),
        ("5", "list of definitions"),
    ],
)
def test_bad_definitions_files_are_refused(tmp_path: Path, content: str, says: str) -> None:
    path = tmp_path / "defs.json"
    path.write_text(content, encoding="utf-8", errors="surrogatepass")
    result = invoke(["--definitions", str(path), *RANGE])
    assert result.exit_code == ExitCode.USAGE, result.output
    first = result.stderr.splitlines()[0]
    assert first.startswith("steeple: error: ")
    assert says in first
    assert len(first) < 400


def test_unreadable_huge_and_binary_definitions_files_are_refused(tmp_path: Path) -> None:
    missing = invoke(["--definitions", str(tmp_path / "nope.toml"), *RANGE])
    assert missing.exit_code == ExitCode.USAGE
    assert "cannot read" in missing.stderr
    huge = tmp_path / "huge.json"
    huge.write_bytes(b" " * (5 * 1024 * 1024))
    assert "larger than 4 MiB" in invoke(["--definitions", str(huge), *RANGE]).stderr
    binary = tmp_path / "bin.toml"
    binary.write_bytes(b"\xff\xfe\x00")
    assert "not UTF-8" in invoke(["--definitions", str(binary), *RANGE]).stderr
    bad_toml = tmp_path / "bad.toml"
    bad_toml.write_text("[[definitions]\nname=")
    assert "not valid TOML" in invoke(["--definitions", str(bad_toml), *RANGE]).stderr


def test_a_plot_that_cannot_be_written_fails_with_one_line(tmp_path: Path) -> None:
    result = invoke([*FLAGS, "--plot", str(tmp_path / "missing-dir" / "out.svg")])
    assert result.exit_code == ExitCode.FAILED
    assert "cannot write the plot" in result.stderr


def test_the_readme_simulation_tour_prints_what_the_readme_says() -> None:
    snippet = Path(__file__).parent / "readme_snippets" / "simulation_tour.py"
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEEPLE_")}
    done = subprocess.run(
        [sys.executable, str(snippet)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "hourly-sync: 71/71 published, 21600 s late",
        "cache-warm: 263/263 published, 21600 s late",
    ]
    page = (Path(__file__).parents[3] / "docs" / "simulation.md").read_text()
    for line in done.stdout.splitlines():
        assert f"`{line}" in page.replace("\n", " ")


@pytest.mark.parametrize(
    "content",
    [
        'name = "a"\n' + "x = " + "9" * 5000 + "\n",  # Python refuses to read it
        '[[definitions]]\nname = "a"\ncron = "* * * * *"\npolicy = 0x' + "f" * 5000 + "\n",
    ],
)
def test_a_toml_integer_of_thousands_of_digits_is_one_usage_error(
    tmp_path: Path, content: str
) -> None:
    path = tmp_path / "defs.toml"
    path.write_text(content, encoding="utf-8")
    result = invoke(["--definitions", str(path), *RANGE])
    assert result.exit_code == ExitCode.USAGE, result.output
    lines = result.stderr.splitlines()
    assert lines[0].startswith("steeple: error: ")
    assert len(lines) <= 2
    assert all(len(line) < 400 for line in lines)
    assert "Traceback" not in result.output


def test_a_run_beyond_the_work_limit_is_refused_in_one_line() -> None:
    hostile = [
        *[arg for i in range(50) for arg in ("--cron", "* * * * *", "--name", f"every-{i}")],
        "--from",
        "2026-01-01T00:00Z",
        "--days",
        "3660",
    ]
    done = invoke(hostile)
    assert done.exit_code == ExitCode.USAGE
    assert done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1
    assert "about 5,270,400 due runs or more" in lines[0]
    assert "beyond the limit of 2,000,000" in lines[0]
    assert "--allow-occurrences N" in lines[0]


def test_the_work_limit_is_raised_or_lowered_by_its_own_flag() -> None:
    hourly = ["--cron", "0 * * * *", *RANGE]  # 71 due runs: after the start, before the end
    refused = invoke([*hourly, "--allow-occurrences", "70"])
    assert refused.exit_code == ExitCode.USAGE
    assert "about 71 due runs or more, beyond the limit of 70" in refused.stderr
    allowed = invoke([*hourly, "--allow-occurrences", "71", "--json"])
    assert allowed.exit_code == 0, allowed.stderr
    assert json.loads(allowed.stdout)["overall"]["materialized"] == 71
    # --max-occurrences stays the simulated namespace's quota, not the work limit.
    outage = ["--host-outage", "2026-01-30T06:00Z/P1D", "--broker-outage", "2026-01-31T06:00Z/PT6H"]
    quota = invoke(
        [*hourly, *outage, "--max-occurrences", "5", "--allow-occurrences", "71", "--json"]
    )
    assert quota.exit_code == 0, quota.stderr
    assert json.loads(quota.stdout)["hits"]["capacity_errors"] > 0


@pytest.mark.parametrize("value", ["0", "-5", str(2**63)])
def test_a_bad_work_limit_is_a_usage_error(value: str) -> None:
    done = invoke(["--cron", "0 * * * *", *RANGE, "--allow-occurrences", value])
    assert done.exit_code == ExitCode.USAGE
    assert "--allow-occurrences must be at least 1" in done.stderr


def test_ctrl_c_stops_a_long_run_with_its_partial_result(tmp_path: Path) -> None:
    # Announces the run's first progress report, so the test signals a run under way.
    script = (
        "import sys\n"
        "import steeple.testing.simulation as simulation\n"
        "from steeple.admin.cli import main\n"
        "real = simulation.run\n"
        "def run(scenario, seed, *, trace, progress):\n"
        "    announced = []\n"
        "    def report(at, done):\n"
        "        if not announced:\n"
        "            announced.append(at)\n"
        "            sys.stderr.write('running\\n')\n"
        "            sys.stderr.flush()\n"
        "        return progress(at, done)\n"
        "    return real(scenario, seed, trace=trace, progress=report)\n"
        "simulation.run = run\n"
        "sys.argv = ['steeple', 'simulate', *sys.argv[1:]]\n"
        "main()\n"
    )
    # Days of simulated work: it only ends by the signal.
    crons = [arg for i in range(20) for arg in ("--cron", "* * * * *", "--name", f"m{i}")]
    args = [*crons, "--from", "2026-01-01T00:00Z", "--days", "3000"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEEPLE_")}
    process = subprocess.Popen(
        [sys.executable, "-c", script, *args, "--allow-occurrences", "100000000", "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert process.stderr is not None
        assert process.stderr.readline() == "running\n"
        process.send_signal(signal.SIGINT)
        stdout, stderr = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 130, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("stopped at 2026-01-")
    assert lines[0].endswith("by Ctrl-C: partial result")
    result = json.loads(stdout)
    assert result["stopped_at"].startswith("2026-01-")
    assert (
        lines[0] == f"stopped at {result['stopped_at'].replace('T', ' ')} by Ctrl-C: partial result"
    )
    assert result["overall"]["materialized"] > 0


def test_ctrl_c_prints_the_partial_table_and_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    import steeple.testing.simulation as simulation

    real = simulation.run

    def interrupted(scenario: Scenario, seed: int, *, trace: bool, progress: Any) -> Any:
        def report(at: datetime, done: float) -> bool:
            if done > 0.5:
                raise KeyboardInterrupt
            return bool(progress(at, done))

        return real(scenario, seed, trace=trace, progress=report)

    monkeypatch.setattr(simulation, "run", interrupted)
    done = invoke([*FLAGS, "--plot", "never.svg"])
    assert done.exit_code == 130
    assert "nightly-billing" in done.stdout
    assert "to 2026-01-31 " in done.stdout
    assert "(stopped early), seed 4" in done.stdout
    assert "stopped at 2026-01-31 " in done.stderr
    assert done.stderr.strip().endswith("by Ctrl-C: partial result")
    assert not Path("never.svg").exists()
