"""``steeple simulate``: what an outage or a schedule change will do, without a database.

Runs :mod:`steeple.testing.simulation` (the real store logic on a fake clock) over
definitions given as flags or in a definitions file, and prints a table, JSON, a plot
(matplotlib, ``steeple-admin[plot]``) or a plain terminal chart. The simulator is an
extra of the command (``steeple-admin[simulate]``): without it, ``steeple simulate``
says what to install and the other commands are unaffected.
"""

from __future__ import annotations

import io
import math
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Final

import typer

from steeple.admin.settings import CliError, ExitCode, NamespaceSettings, parse_duration
from steeple.core.errors import ConfigurationError

if TYPE_CHECKING:
    # Imported where used: the command's --help must load neither rich nor the simulator.
    from rich.console import Console
    from rich.table import Table

    from steeple.core.config import RecurringDefinition
    from steeple.testing.simulation import Scenario, SimulationResult, Stats

__all__ = [
    "SIMULATOR_EXTRA",
    "build_scenario",
    "render_hits",
    "render_table",
    "require_simulator",
    "simulate",
    "table_text",
]

MAX_DAYS: Final = 3660
"""The longest range ``steeple simulate`` accepts (ten years)."""
DEFAULT_ALLOWED: Final = 2_000_000
"""Due runs a ``steeple simulate`` run may materialize unless raised (minutes of work)."""
_SHOW_PROGRESS: Final = 20_000
"""Due runs above which a run takes more than a few seconds: a progress bar on a terminal."""
_TOPIC: Final = "simulated"
_NAMESPACE: Final = "simulation"


def _err() -> Console:
    from rich.console import Console

    return Console(stderr=True, highlight=False, soft_wrap=True)


def table_text(table: Table) -> str:
    """Return ``table`` as plain text at its natural width (no colours, no trailing spaces)."""
    from rich.console import Console

    sizing = Console(width=10_000, file=io.StringIO(), color_system=None)
    width = sizing.measure(table).maximum
    console = Console(width=width, file=io.StringIO(), color_system=None, highlight=False)
    console.print(table)
    text = console.file.getvalue()  # type: ignore[attr-defined]
    return "\n".join(line.rstrip() for line in text.splitlines()).strip("\n")


SIMULATOR_EXTRA: Final = "steeple-admin[simulate]"
"""What to install for ``steeple simulate``: the simulator lives in ``steeple-testing``."""


def require_simulator() -> None:
    """Check that the simulator (``steeple.testing.simulation``) can be imported.

    Raises:
        CliError: it is not installed (exit code 3), naming the extra that installs it.
    """
    try:
        import steeple.testing.simulation  # noqa: F401 - imported to see that it is there
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if not missing.startswith(("steeple.testing", "hypothesis")) and missing != "steeple":
            raise
        raise CliError(
            f"steeple simulate needs the simulator, which is not installed ({missing!r} "
            "is missing)",
            code=ExitCode.CONFIG,
            hint=f"install it with: pip install '{SIMULATOR_EXTRA}'",
        ) from None


def _usage(message: str, hint: str | None = None) -> CliError:
    return CliError(message, code=ExitCode.USAGE, hint=hint)


def _span(seconds: float | None) -> str:
    """Format a lateness for people: 0.05s, 12.3s, 3m 20s, 6h 00m, 2d 03h."""
    if seconds is None:
        return "-"
    if seconds < 1:
        return f"{seconds:.2f}s"
    if seconds < 60:
        return f"{seconds:.1f}s"
    whole = int(seconds)
    if whole < 3600:
        return f"{whole // 60}m {whole % 60:02d}s"
    if whole < 86400:
        return f"{whole // 3600}h {whole % 3600 // 60:02d}m"
    return f"{whole // 86400}d {whole % 86400 // 3600:02d}h"


def _cells(stats: Stats) -> list[str]:
    late = stats.lateness
    return [
        f"{stats.materialized:,}",
        f"{stats.published:,}",
        f"{stats.dead:,}",
        f"{stats.expired:,}",
        f"{stats.cancelled:,}",
        f"{stats.live:,}",
        _span(late.p50),
        _span(late.p99),
        _span(late.max),
    ]


def render_table(result: SimulationResult) -> Table:
    """Return the summary table: one row per definition, then per policy and overall.

    Lateness is from the due instant to the recorded publication; "open" counts what was
    still pending, leased or waiting to retry when the range ended.
    """
    from rich import box
    from rich.table import Table

    s = result.scenario
    # A stopped run's counts cover the range up to where it stopped.
    end = f"{s.end:%Y-%m-%d %H:%MZ}"
    if result.stopped_at is not None:
        end = f"{result.stopped_at:%Y-%m-%d %H:%M:%SZ} (stopped early)"
    table = Table(
        title=f"steeple simulate: {s.start:%Y-%m-%d %H:%MZ} to {end}, seed {result.seed}",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        padding=(0, 1),
    )
    show_cron = any(d.name != d.cron for d in result.definitions)
    longest = max((len(d.name) for d in result.definitions), default=10)
    table.add_column("definition", min_width=min(max(longest, 12), 40), overflow="ellipsis")
    table.add_column("policy", no_wrap=True)
    if show_cron:
        table.add_column("cron", no_wrap=True)
    for name in ("materialized", "published", "dead", "expired", "cancelled", "open"):
        table.add_column(name, justify="right", no_wrap=True)
    for name in ("late p50", "p99", "max"):
        table.add_column(name, justify="right", no_wrap=True)
    cron: tuple[str, ...]
    for definition in result.definitions:
        cron = (definition.cron,) if show_cron else ()
        table.add_row(definition.name, definition.policy.value, *cron, *_cells(definition.stats))
    table.add_section()
    blank = ("",) if show_cron else ()
    for policy, stats in result.policies.items():
        table.add_row(f"all {policy}", policy, *blank, *_cells(stats))
    table.add_row("all", "", *blank, *_cells(result.overall), style="bold")
    return table


def render_hits(result: SimulationResult) -> str:
    """Return one line of the limits and faults the run hit."""
    h = result.hits
    return (
        f"ticks {h.ticks:,} ({h.saturated_ticks:,} at full budget), "
        f"quota refusals {h.capacity_errors:,}, clock errors {h.clock_errors:,}, "
        f"broker failures {h.broker_failures:,}, lost acks {h.acknowledgements_lost:,} "
        f"({h.duplicates:,} deduplicated), leases lost {h.leases_lost:,}, "
        f"abandoned {h.leases_abandoned:,}"
    )


def _instant(text: str, what: str) -> datetime:
    from steeple.testing.simulation import parse_instant

    try:
        return parse_instant(text)
    except ConfigurationError as exc:
        raise _usage(f"{what}: {exc}") from None


def _parse_all(texts: list[str], parse: object, what: str) -> list[object]:
    values = []
    for text in texts:
        try:
            values.append(parse(text))  # type: ignore[operator]
        except ConfigurationError as exc:
            raise _usage(f"{what}: {exc}") from None
    return values


def _range(
    start_text: str | None, end_text: str | None, days: float | None
) -> tuple[datetime, datetime]:
    if start_text is not None:
        start = _instant(start_text, "--from")
    else:
        today = datetime.now(UTC)
        start = datetime(today.year, today.month, today.day, tzinfo=UTC)
    if end_text is not None and days is not None:
        raise _usage("give --to or --days, not both")
    if days is not None:
        if not math.isfinite(days) or not 0 < days <= MAX_DAYS:
            raise _usage(f"--days must be more than 0 and at most {MAX_DAYS}; got {days}")
        try:
            end = start + timedelta(days=days)
        except OverflowError:
            raise _usage("--days runs past the calendar's end (2100)") from None
    elif end_text is not None:
        end = _instant(end_text, "--to")
    else:
        end = start + timedelta(days=7)
    from steeple.testing.simulation import CALENDAR_END

    if end > CALENDAR_END:
        raise _usage(
            f"the range ends {end:%Y-%m-%d}, beyond the calendar's last year (2100)",
            hint="end the range by 2101-01-01T00:00Z",
        )
    if end - start > timedelta(days=MAX_DAYS):
        raise _usage(f"the range is longer than {MAX_DAYS} days (ten years)")
    return start, end


def _flag_definitions(
    crons: list[str], policies: list[str], names: list[str], start: datetime
) -> list[RecurringDefinition]:
    from steeple.admin.definitions_file import parse_policy
    from steeple.core.config import RecurringDefinition
    from steeple.core.messages import ScheduledMessage

    if policies and len(policies) not in (1, len(crons)):
        raise _usage("give one --policy for all --cron flags, or one per --cron")
    if names and len(names) != len(crons):
        raise _usage("give one --name per --cron, or none")
    chosen = [parse_policy(p) for p in policies] if policies else []
    definitions = []
    seen: dict[str, int] = {}
    for index, cron in enumerate(crons):
        policy = chosen[index if len(chosen) > 1 else 0] if chosen else parse_policy("catch_up")
        name = names[index] if names else cron.strip() or "?"
        if not names:
            seen[name] = seen.get(name, 0) + 1
            if seen[name] > 1:
                name = f"{name} #{seen[name]}"
        message = ScheduledMessage(_TOPIC, _TOPIC, b"")
        definitions.append(RecurringDefinition(name, cron, start, policy, message))
    return definitions


def build_scenario(
    *,
    definitions_file: Path | None,
    crons: list[str],
    policies: list[str],
    names: list[str],
    start_text: str | None,
    end_text: str | None,
    days: float | None,
    window: str,
    lease: str,
    max_occurrences: int,
    tick_interval: str,
    tick_budget: int,
    workers: int,
    rate: float | None,
    claim_limit: int,
    poll_interval: str,
    host_outages: list[str],
    broker_outages: list[str],
    failure_rate: float,
    ack_loss_rate: float,
    clock_regressions: list[str],
    sample_interval: str | None,
) -> Scenario:
    """Turn the command's options into a :class:`Scenario`.

    Raises:
        CliError: (usage) a bad option, definition, interval or rate; (config) a
            delivery window or lease outside steeple's limits.
    """
    from steeple.admin.definitions_file import DefinitionDefaults, load_definitions
    from steeple.testing.simulation import (
        BrokerModel,
        ClockRegression,
        Interval,
        RelayCapacity,
        Scenario,
        Ticking,
    )

    start, end = _range(start_text, end_text, days)
    try:
        definitions: list[RecurringDefinition] = []
        if definitions_file is not None:
            defaults = DefinitionDefaults(first_after=start, topic=_TOPIC, message_type=_TOPIC)
            definitions += load_definitions(definitions_file, defaults)
        definitions += _flag_definitions(crons, policies, names, start)
    except ConfigurationError as exc:
        raise _usage(str(exc)) from None
    if not definitions:
        raise _usage(
            "nothing to simulate",
            hint="give --cron '0 2 * * *' (repeatable) or --definitions FILE",
        )
    config = NamespaceSettings(
        namespace=_NAMESPACE,
        max_definitions=10_000,
        max_occurrences=max_occurrences,
        delivery_window=parse_duration(window, what="--window"),
        lease_duration=parse_duration(lease, what="--lease"),
    ).config()
    hosts = _parse_all(host_outages, Interval.parse, "--host-outage")
    brokers = _parse_all(broker_outages, Interval.parse, "--broker-outage")
    regressions = _parse_all(clock_regressions, ClockRegression.parse, "--clock-regression")
    try:
        return Scenario(
            config,
            definitions,
            start,
            end,
            ticking=Ticking(parse_duration(tick_interval, what="--tick-interval"), tick_budget),
            relay=RelayCapacity(
                workers=workers,
                rate=rate,
                claim_limit=claim_limit,
                poll_interval=parse_duration(poll_interval, what="--poll-interval"),
            ),
            broker=BrokerModel(brokers, failure_rate, ack_loss_rate),  # type: ignore[arg-type]
            host_outages=hosts,  # type: ignore[arg-type]
            clock_regressions=regressions,  # type: ignore[arg-type]
            sample_interval=(
                None
                if sample_interval is None
                else parse_duration(sample_interval, what="--sample-interval")
            ),
        )
    except ConfigurationError as exc:
        raise _usage(str(exc)) from None


def _run(scenario: Scenario, seed: int, *, trace: bool, estimate: int) -> SimulationResult:
    """Run ``scenario``: a progress bar on a terminal for a long run; Ctrl-C stops it cleanly.

    The first Ctrl-C asks the simulator to stop between two events, which returns the
    result so far; a second one interrupts at once (KeyboardInterrupt).
    """
    import signal
    import threading

    from steeple.testing.simulation import run

    asked = threading.Event()

    def on_interrupt(signum: int, frame: object) -> None:
        if asked.is_set():
            raise KeyboardInterrupt
        asked.set()

    try:
        previous = signal.signal(signal.SIGINT, on_interrupt)
    except ValueError:  # not the main thread: Ctrl-C is not ours to handle
        previous = None
    try:
        err = _err()
        if not err.is_terminal or estimate <= _SHOW_PROGRESS:
            return run(scenario, seed, trace=trace, progress=lambda _at, _done: not asked.is_set())
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

        columns = (
            TextColumn("simulated {task.description}"),
            BarColumn(),
            TextColumn("{task.percentage:>3.0f}%"),
            TimeRemainingColumn(),
        )
        with Progress(*columns, console=err, transient=True) as bar:
            task = bar.add_task(f"{scenario.start:%Y-%m-%d %H:%M}", total=1.0)

            def report(at: datetime, done: float) -> bool:
                bar.update(task, completed=done, description=f"{at:%Y-%m-%d %H:%M}")
                return not asked.is_set()

            return run(scenario, seed, trace=trace, progress=report)
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


def _fail(error: CliError) -> typer.Exit:
    _err().print(f"steeple: error: {error}", markup=False)
    if error.hint:
        _err().print(f"  what to do: {error.hint}", markup=False)
    return typer.Exit(int(error.code))


def simulate(
    cron: Annotated[
        list[str] | None,
        typer.Option("--cron", help="A definition's calendar (repeatable), e.g. '0 2 * * *'."),
    ] = None,
    policy: Annotated[
        list[str] | None,
        typer.Option(
            "--policy", help="catch_up or coalesce: once for all --cron, or once per --cron."
        ),
    ] = None,
    name: Annotated[
        list[str] | None, typer.Option("--name", help="One name per --cron (default: the cron).")
    ] = None,
    definitions: Annotated[
        Path | None,
        typer.Option(
            "--definitions",
            help="A JSON or TOML file of definitions (name, cron, policy, first_after, "
            "topic, message_type).",
        ),
    ] = None,
    start: Annotated[
        str | None,
        typer.Option("--from", help="Start, ISO 8601 (default: today 00:00Z)."),
    ] = None,
    end: Annotated[str | None, typer.Option("--to", help="End, ISO 8601.")] = None,
    days: Annotated[
        float | None, typer.Option("--days", help="Length in days instead of --to (default 7).")
    ] = None,
    window: Annotated[str, typer.Option("--window", help="Delivery window, e.g. 1d.")] = "1d",
    lease: Annotated[str, typer.Option("--lease", help="Lease duration, e.g. 60s.")] = "60s",
    max_occurrences: Annotated[
        int, typer.Option("--max-occurrences", help="Namespace quota of occurrences.")
    ] = 100_000,
    tick_interval: Annotated[
        str, typer.Option("--tick-interval", help="How often the ticker runs.")
    ] = "1s",
    tick_budget: Annotated[
        int, typer.Option("--tick-budget", help="Occurrences per tick (1-100).")
    ] = 100,
    workers: Annotated[int, typer.Option("--workers", help="Relay workers.")] = 1,
    rate: Annotated[
        float,
        typer.Option(
            "--rate",
            help="Publications per second of one publication in flight (1 / the broker's "
            "latency; 0: no time); a worker has up to 32 in flight, as steeple worker does.",
        ),
    ] = 50.0,
    claim_limit: Annotated[
        int, typer.Option("--claim-limit", help="Leases per claim (1-100).")
    ] = 100,
    poll_interval: Annotated[
        str, typer.Option("--poll-interval", help="How often an idle worker polls.")
    ] = "1s",
    host_outage: Annotated[
        list[str] | None,
        typer.Option(
            "--host-outage",
            help="Nothing ticks or relays: ISO 8601 interval, e.g. 2026-01-31T22:00Z/PT6H "
            "(repeatable).",
        ),
    ] = None,
    broker_outage: Annotated[
        list[str] | None,
        typer.Option("--broker-outage", help="Every publication fails: ISO 8601 interval."),
    ] = None,
    failure_rate: Annotated[
        float, typer.Option("--failure-rate", help="Share of publications that fail (0-1).")
    ] = 0.0,
    ack_loss_rate: Annotated[
        float,
        typer.Option("--ack-loss-rate", help="Share accepted whose acknowledgement is lost (0-1)."),
    ] = 0.0,
    clock_regression: Annotated[
        list[str] | None,
        typer.Option(
            "--clock-regression",
            help="The host clock steps back: instant/duration, e.g. 2026-02-01T03:00Z/PT3S.",
        ),
    ] = None,
    sample_interval: Annotated[
        str | None,
        typer.Option("--sample-interval", help="Backlog sample spacing (default: from the range)."),
    ] = None,
    allow_occurrences: Annotated[
        int,
        typer.Option(
            "--allow-occurrences",
            help="Refuse a run estimated (from the calendars) to materialize more due runs "
            f"than this (default {DEFAULT_ALLOWED:,}: minutes of work; about 10,000 a "
            "second). Not --max-occurrences, the namespace quota being simulated.",
        ),
    ] = DEFAULT_ALLOWED,
    seed: Annotated[int, typer.Option("--seed", help="Seed: same seed, same result.")] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
    plot: Annotated[
        Path | None,
        typer.Option(
            "--plot",
            help="Write a plot of what became of every due run, outages shaded (.png or "
            ".svg; needs the plot extra of steeple-admin, else a terminal chart is printed).",
        ),
    ] = None,
    chart: Annotated[
        bool, typer.Option("--chart", help="Also print a plain terminal chart.")
    ] = False,
) -> None:
    """Simulate recurring publications: what an outage or a schedule change will do.

    The real store logic runs on a fake clock (no database, no broker), jumping from one
    event to the next, so a year takes seconds. Same options and --seed: same result.
    A run estimated above --allow-occurrences due runs is refused before it starts;
    Ctrl-C stops a run and prints the result so far (exit code 130).
    """
    try:
        require_simulator()
    except CliError as error:
        raise _fail(error) from None
    from steeple.admin.simulate_plot import PLOT_FORMATS
    from steeple.testing.simulation import estimate_occurrences

    try:
        if not 1 <= allow_occurrences < 2**63:
            raise _usage(f"--allow-occurrences must be at least 1; got {allow_occurrences}")
        if not 0 <= seed < 2**63:
            raise _usage("--seed must be between 0 and 2**63 - 1")
        if plot is not None and plot.suffix.lower() not in PLOT_FORMATS:
            raise _usage(f"--plot must name a .png or .svg file, not {str(plot)[:60]!r}")
        if not math.isfinite(rate) or rate < 0:
            raise _usage(f"--rate must be 0 (no limit) or a positive number; got {rate}")
        scenario = build_scenario(
            definitions_file=definitions,
            crons=cron or [],
            policies=policy or [],
            names=name or [],
            start_text=start,
            end_text=end,
            days=days,
            window=window,
            lease=lease,
            max_occurrences=max_occurrences,
            tick_interval=tick_interval,
            tick_budget=tick_budget,
            workers=workers,
            rate=rate or None,
            claim_limit=claim_limit,
            poll_interval=poll_interval,
            host_outages=host_outage or [],
            broker_outages=broker_outage or [],
            failure_rate=failure_rate,
            ack_loss_rate=ack_loss_rate,
            clock_regressions=clock_regression or [],
            sample_interval=sample_interval,
        )
        # Counting stops past the limit, so a hostile run is refused at once.
        estimate = estimate_occurrences(scenario, stop_after=allow_occurrences)
        if estimate > allow_occurrences:
            raise _usage(
                f"this run would materialize about {estimate:,} due runs or more, beyond "
                f"the limit of {allow_occurrences:,} (about 10,000 a second); raise it "
                "with --allow-occurrences N, or shorten the range"
            )
    except CliError as exc:
        raise _fail(exc) from None
    try:
        # The plot draws every due run's end, which only a traced run records.
        result = _run(scenario, seed, trace=plot is not None, estimate=estimate)
    except KeyboardInterrupt:
        _err().print("steeple: interrupted")
        raise typer.Exit(130) from None
    _report(result, as_json=as_json, plot=plot, chart=chart)


def _report(result: SimulationResult, *, as_json: bool, plot: Path | None, chart: bool) -> None:
    """Print a finished run (table or JSON), then its plot or terminal chart."""
    from rich.console import Console

    from steeple.admin.simulate_plot import PlotUnavailableError, terminal_chart

    out = Console(highlight=False, soft_wrap=True)
    if as_json:
        sys.stdout.write(result.dumps() + "\n")
    else:
        if out.is_terminal:
            out.print(render_table(result))
        else:
            # A file or a pipe does not wrap: the whole table, one row per line.
            sys.stdout.write(table_text(render_table(result)) + "\n")
        out.print(render_hits(result), markup=False)
    if result.stopped_at is not None:
        _err().print(
            f"stopped at {result.stopped_at:%Y-%m-%d %H:%M:%SZ} by Ctrl-C: partial result",
            markup=False,
        )
        # A plot or chart of a partial run would show every later due run as missed.
        raise typer.Exit(130)
    text_chart = chart
    if plot is not None:
        from steeple.admin.simulate_plot import write_plot

        try:
            write_plot(result, plot)
        except PlotUnavailableError as exc:
            _err().print(f"steeple: {exc}; printing a terminal chart instead", markup=False)
            text_chart = True
        except OSError as exc:
            raise _fail(
                CliError(
                    f"cannot write the plot {str(plot)[:60]!r}: {exc.strerror or exc}",
                    code=ExitCode.FAILED,
                )
            ) from None
        else:
            if not as_json:
                out.print(f"plot written to {plot}", markup=False)
    if text_chart:
        (_err() if as_json else out).print(terminal_chart(result), markup=False)
