"""Pictures of a simulation: a matplotlib figure (``steeple-admin[plot]``) or a terminal chart.

One panel per missed-run policy: occurrences materialized in each interval (grey bars)
and the live backlog left at its end (blue) on the left axis, the worst lateness of the
interval's publications (green) on the right, with host outages and broker outages shaded
and clock steps marked. Without matplotlib, :func:`terminal_chart` draws the same series
in plain ASCII.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Final

from steeple.admin._text import plural
from steeple.testing.simulation import Interval, SimulationResult

__all__ = ["PLOT_FORMATS", "PlotUnavailableError", "terminal_chart", "write_plot"]

PLOT_FORMATS: Final = (".png", ".svg")
_LEVELS: Final = " .:-=+*#%@"
_HOST_COLOR: Final = "#d62728"
_BROKER_COLOR: Final = "#ff7f0e"
_SVG_SALT: Final = "steeple-simulate"


class PlotUnavailableError(ImportError):
    """matplotlib is not installed (install ``steeple-admin[plot]``)."""


def _policies(result: SimulationResult) -> list[str]:
    return [k for k in result.series.backlog if k != "all"] or ["all"]


def _title(result: SimulationResult) -> str:
    s = result.scenario
    return (
        f"{s.start:%Y-%m-%d %H:%MZ} to {s.end:%Y-%m-%d %H:%MZ}, "
        f"{plural(len(result.definitions), 'definition')}, seed {result.seed}"
    )


def write_plot(result: SimulationResult, path: Path) -> None:
    """Draw ``result`` to ``path`` (``.png`` or ``.svg``), deterministically for SVG.

    SVG output is byte-for-byte repeatable: matplotlib's ids are salted with a constant,
    the date is left out and text is drawn as paths.

    Raises:
        PlotUnavailableError: matplotlib is not installed.
        ValueError: the suffix is neither ``.png`` nor ``.svg``.
        OSError: the file cannot be written.
    """
    suffix = path.suffix.lower()
    if suffix not in PLOT_FORMATS:
        raise ValueError(f"the plot must be a .png or .svg file, not {path.suffix or 'no suffix'}")
    try:
        import matplotlib
        from matplotlib.dates import AutoDateLocator, ConciseDateFormatter
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        raise PlotUnavailableError(
            "matplotlib is not installed: pip install 'steeple-admin[plot]'"
        ) from None
    series = result.series
    policies = _policies(result)
    fig = Figure(figsize=(10, 2.6 * len(policies) + 0.8), layout="constrained")
    axes = fig.subplots(len(policies), 1, sharex=True, squeeze=False)[:, 0]
    times = list(series.times)
    scenario = result.scenario
    for ax, policy in zip(axes, policies, strict=True):
        for outage in scenario.host_outages:
            ax.axvspan(outage.start, outage.end, color=_HOST_COLOR, alpha=0.15, lw=0)
        for outage in scenario.broker.outages:
            ax.axvspan(outage.start, outage.end, color=_BROKER_COLOR, alpha=0.15, lw=0)
        for regression in scenario.clock_regressions:
            ax.axvline(regression.at, color="0.4", lw=0.8, ls=":")
        # Each bucket's count belongs to the interval that ends at its time.
        starts = [scenario.start, *times[:-1]]
        ax.bar(
            starts,
            series.materialized[policy],
            width=[(b - a).total_seconds() / 86400 for a, b in zip(starts, times, strict=True)],
            align="edge",
            color="0.8",
            lw=0,
        )
        ax.step(times, series.backlog[policy], where="post", color="#1f77b4", lw=1.2)
        ax.set_ylabel("materialized (grey)\nbacklog (blue)", fontsize=8)
        ax.set_ylim(bottom=0)
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(policy.replace("_", "-"), loc="left", fontsize=10)
        late = ax.twinx()
        points = [
            (t, v / 60)
            for t, v in zip(times, series.max_lateness[policy], strict=True)
            if v is not None
        ]
        if points:
            late.plot([p[0] for p in points], [p[1] for p in points], "o", ms=2.5, color="#2ca02c")
        late.set_ylabel("worst lateness (min)", color="#2ca02c")
        late.set_ylim(bottom=0)
    locator = AutoDateLocator()  # type: ignore[no-untyped-call]
    axes[-1].xaxis.set_major_locator(locator)
    axes[-1].xaxis.set_major_formatter(ConciseDateFormatter(locator))  # type: ignore[no-untyped-call]
    axes[-1].set_xlim(scenario.start, scenario.end)
    fig.suptitle(_title(result), fontsize=10)
    legend: list[Any] = []
    labels: list[str] = []
    if scenario.host_outages:
        legend.append(_patch(_HOST_COLOR))
        labels.append("host down")
    if scenario.broker.outages:
        legend.append(_patch(_BROKER_COLOR))
        labels.append("broker down")
    if legend:
        fig.legend(legend, labels, loc="upper right", fontsize=8, frameon=False)
    metadata: dict[str, Any] = (
        {"Date": None, "Creator": None} if suffix == ".svg" else {"Software": None}
    )
    with matplotlib.rc_context({"svg.hashsalt": _SVG_SALT, "svg.fonttype": "path"}):
        fig.savefig(path, metadata=metadata)


def _patch(color: str) -> Any:
    from matplotlib.patches import Patch

    return Patch(color=color, alpha=0.3, lw=0)


def _downsample(values: Sequence[float | None], width: int) -> list[float | None]:
    """Return the largest value of each of ``width`` slices (``None`` if a slice has none)."""
    n = len(values)
    out: list[float | None] = []
    for column in range(width):
        lo, hi = column * n // width, max((column + 1) * n // width, column * n // width + 1)
        chunk = [v for v in values[lo:hi] if v is not None]
        out.append(max(chunk) if chunk else None)
    return out


def _row(values: Sequence[float | None]) -> str:
    top = max((v for v in values if v is not None), default=0) or 1
    cells = []
    for value in values:
        if value is None:
            cells.append(" ")
        elif value <= 0:
            cells.append("_")
        else:
            cells.append(_LEVELS[max(1, min(9, round(value / top * 9)))])
    return "".join(cells)


def _down_row(intervals: Sequence[Interval], times: Sequence[datetime], width: int) -> str:
    n = len(times)
    cells = []
    for column in range(width):
        lo, hi = column * n // width, max((column + 1) * n // width, column * n // width + 1)
        bucket = times[lo:hi]
        start = times[lo - 1] if lo else None
        hit = any(i.start < bucket[-1] and (start is None or i.end > start) for i in intervals)
        cells.append("#" if hit else " ")
    return "".join(cells)


def _span(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{seconds / 60:.1f}min"
    return f"{seconds / 3600:.1f}h"


def terminal_chart(result: SimulationResult, width: int = 72) -> str:
    """Return a plain-ASCII chart of backlog and worst lateness over time, per policy.

    Each column is a slice of the range showing the slice's largest value on a ten-level
    scale (``_`` zero, `` `` nothing published); ``#`` rows mark host and broker outages.
    """
    series = result.series
    times = series.times
    width = max(10, min(width, len(times)))
    label = 26
    lines = [_title(result)]
    scenario = result.scenario
    for policy in _policies(result):
        backlog = [float(v) for v in series.backlog[policy]]
        late = list(series.max_lateness[policy])
        peak = max(backlog, default=0.0)
        worst = max((v for v in late if v is not None), default=0.0)
        lines.append(f"{policy.replace('_', '-')}:")
        made = [float(v) for v in series.materialized[policy]]
        made_label = f"materialized (max {int(max(made, default=0))})"
        lines.append(f"  {made_label:<{label}}|{_row(_downsample(made, width))}|")
        backlog_label = f"backlog (peak {int(peak)})"
        lines.append(f"  {backlog_label:<{label}}|{_row(_downsample(backlog, width))}|")
        lines.append(
            f"  {'lateness (worst ' + _span(worst) + ')':<{label}}|"
            f"{_row(_downsample(late, width))}|"
        )
        if scenario.host_outages:
            lines.append(
                f"  {'host down':<{label}}|{_down_row(scenario.host_outages, times, width)}|"
            )
        if scenario.broker.outages:
            lines.append(
                f"  {'broker down':<{label}}|{_down_row(scenario.broker.outages, times, width)}|"
            )
    start = f"{scenario.start:%Y-%m-%d %H:%MZ}"
    end = f"{scenario.end:%Y-%m-%d %H:%MZ}"
    lines.append(f"  {'':<{label}} {start}{end:>{width - len(start)}}")
    return "\n".join(lines)
