"""Pictures of a simulation: a matplotlib figure (``steeple-admin[plot]``) or a terminal chart.

The figure answers what an operator asks after a what-if: for each definition (each
missed-run policy when there are many), what became of every due run (published on
time, published late and by how much, coalesced away into another run, dead-lettered,
expired, not finished), drawn as due time against lateness, with outages shaded and
labelled and, when there were outages, a second panel zoomed on the longest one. Each
panel has a one-line caption with the counts; a last panel shows the lateness
distribution. The figure needs a traced run (:meth:`SimulationResult.due_runs`).

Without matplotlib, :func:`terminal_chart` draws backlog and lateness over time in plain
ASCII.
"""

from __future__ import annotations

import io
import re
from collections.abc import Sequence
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, Final

import attrs

from steeple.admin._text import plural
from steeple.core.occurrences import OccurrenceState
from steeple.testing.simulation import DueRun, Interval, SimulationResult

__all__ = ["PLOT_FORMATS", "PlotUnavailableError", "plot_figure", "terminal_chart", "write_plot"]

PLOT_FORMATS: Final = (".png", ".svg")
_LEVELS: Final = " .:-=+*#%@"
_HOST_COLOR: Final = "#d62728"
_BROKER_COLOR: Final = "#ff7f0e"
_SVG_SALT: Final = "steeple-simulate"
ON_TIME_S: Final = 60.0
"""A publication at most this late (seconds) counts as on time in the figure."""
_MAX_ROWS: Final = 10
"""More definitions than this: one row per missed-run policy instead of per definition."""
_RASTER_ABOVE: Final = 20_000
"""Draw a panel's markers as an image above this many, or SVG files grow without bound."""

# Outcome: (legend label, marker, colour, filled). The order is the legend's.
_OUTCOMES: Final = {
    "on_time": ("on time (< 1 min late)", "o", "#2ca02c", True),
    "late": ("published late (height: how late)", "o", "#ff7f0e", True),
    "coalesced": ("coalesced away (folded into an earlier run)", "x", "0.45", True),
    "dead": ("dead letter", "X", "#d62728", True),
    "expired": ("expired (delivery window ended)", "v", "#9467bd", True),
    "open": ("not finished when the range ended", "s", "#1f77b4", False),
    "cancelled": ("cancelled with its definition", "_", "0.2", True),
}


_FATES: Final = {
    "coalesced": "coalesced away",
    "dead": "dead",
    "expired": "expired",
    "open": "not finished",
    "cancelled": "cancelled",
}
"""What a caption calls each outcome but a publication."""


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


def _outcome(run: DueRun) -> str:
    state = run.state
    if state is None:
        return "coalesced" if run.coalesced_into is not None else "open"
    if state is OccurrenceState.PUBLISHED:
        return "on_time" if (run.lateness or 0.0) <= ON_TIME_S else "late"
    if state is OccurrenceState.DEAD:
        return "dead"
    if state is OccurrenceState.EXPIRED:
        return "expired"
    if state is OccurrenceState.CANCELLED:
        return "cancelled"
    return "open"


def _human(seconds: float) -> str:
    """Format a duration for a caption: 12 s, 45 min, 6 h, 2 h 30 min, 3 d 4 h."""
    whole = round(seconds)
    if whole < 60:
        return f"{seconds:.0f} s" if seconds >= 1 else f"{seconds:.2f} s"
    if whole < 3600:
        return f"{whole // 60} min"
    if whole < 86400:
        hours, minutes = whole // 3600, whole % 3600 // 60
        return f"{hours} h {minutes} min" if minutes else f"{hours} h"
    days, hours = whole // 86400, whole % 86400 // 3600
    return f"{days} d {hours} h" if hours else f"{days} d"


@attrs.frozen
class _Incident:
    kind: str
    interval: Interval

    def label(self, short: bool) -> str:
        i = self.interval
        fmt = "%H:%M" if short else "%b %d %H:%M"
        return f"{self.kind} down {i.start:{fmt}}–{i.end:{fmt}} ({_human(_seconds(i))})"


def _seconds(interval: Interval) -> float:
    return (interval.end - interval.start).total_seconds()


def _incidents(result: SimulationResult) -> list[_Incident]:
    scenario = result.scenario
    found = [_Incident("host", i) for i in scenario.host_outages]
    found += [_Incident("broker", i) for i in scenario.broker.outages]
    return sorted(found, key=lambda x: (x.interval.start, x.kind))


def _when(instant: datetime, short: bool) -> str:
    return f"{instant:%H:%M}" if short else f"{instant:%b %d %H:%M}"


def _during(runs: Sequence[DueRun], incident: _Incident, short: bool) -> str | None:
    """``24 due during the host outage → 1 publication at 04:00, 6 h late``, or None."""
    i = incident.interval
    inside = [r for r in runs if i.start <= r.due_at < i.end]
    if not inside:
        return None
    by_due = {(r.definition_name, r.due_at): r for r in runs}
    carriers: dict[tuple[str, datetime], DueRun] = {}
    for run in inside:
        key = (run.definition_name, run.coalesced_into or run.due_at)
        carriers[key] = by_due.get(key, run)
    published = [c for c in carriers.values() if c.published_at is not None]
    text = f"{plural(len(inside), 'run')} due during the {incident.kind} outage → "
    unpublished: dict[str, int] = {}
    for carrier in carriers.values():
        if carrier.published_at is None:
            word = _FATES[_outcome(carrier)]
            unpublished[word] = unpublished.get(word, 0) + 1
    fates = ", ".join(f"{n:,} {word}" for word, n in unpublished.items())
    if not published:
        return text + f"no publication ({fates})"
    times = sorted(c.published_at for c in published if c.published_at is not None)
    late = sorted(c.lateness or 0.0 for c in published)
    at = _when(times[0], short)
    if times[-1] - times[0] >= timedelta(minutes=1):
        at += f"–{_when(times[-1], short)}"
    how = (
        _human(late[-1]) if late[-1] - late[0] < 60 else f"{_human(late[0])} to {_human(late[-1])}"
    )
    text += f"{plural(len(published), 'publication')} at {at}, {how} late"
    if fates:
        text += f"; {fates}"
    return text


def _caption(name: str, runs: Sequence[DueRun], incidents: Sequence[_Incident], short: bool) -> str:
    counts = {k: 0 for k in _OUTCOMES}
    for run in runs:
        counts[_outcome(run)] += 1
    published = counts["on_time"] + counts["late"]
    parts = [
        f"{plural(len(runs), 'due run')}: {published:,} published, {counts['on_time']:,} on time"
    ]
    if counts["late"]:
        worst = max(r.lateness or 0.0 for r in runs if _outcome(r) == "late")
        parts.append(f"{counts['late']:,} late (worst {_human(worst)})")
    for key, word in _FATES.items():
        if counts[key]:
            parts.append(f"{counts[key]:,} {word}")
    text = f"{name}: " + ", ".join(parts)
    stories = [s for s in (_during(runs, x, short) for x in incidents) if s]
    if len(stories) == 1:
        text += f"\n{stories[0]}"
    elif stories:
        text += f"\n{stories[0]} (and {len(stories) - 1} more outages)"
    return text


def _zoom(
    result: SimulationResult, runs: Sequence[DueRun], incident: _Incident
) -> tuple[datetime, datetime]:
    """Return the zoom's range: the outage, padded, to the last publication of its runs."""
    i = incident.interval
    pad = max(timedelta(hours=1), (i.end - i.start) / 3)
    last = i.end
    for run in runs:
        if i.start <= run.due_at < i.end and run.published_at is not None:
            last = max(last, run.published_at)
    scenario = result.scenario
    return max(scenario.start, i.start - pad), min(scenario.end, last + pad)


def _unit(worst: float) -> tuple[float, str]:
    if worst >= 2 * 3600:
        return 3600.0, "h"
    if worst >= 120:
        return 60.0, "min"
    return 1.0, "s"


def plot_figure(result: SimulationResult) -> Any:
    """Return the figure of a traced run (a ``matplotlib.figure.Figure``), not yet saved.

    Raises:
        PlotUnavailableError: matplotlib is not installed.
        ValueError: the run was not traced (run it with ``trace=True``).
    """
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise PlotUnavailableError(
            "matplotlib is not installed: pip install 'steeple-admin[plot]'"
        ) from None
    runs = result.due_runs()
    scenario = result.scenario
    incidents = _incidents(result)
    short = scenario.end - scenario.start <= timedelta(days=7)
    rows = _rows(result, runs)
    longest = max(incidents, key=lambda x: _seconds(x.interval), default=None)
    fig = Figure(figsize=(12, 1.75 * len(rows) + 4.0), layout="constrained")
    grid = fig.subfigures(
        len(rows) + 2, 1, squeeze=False, height_ratios=[0.45] + [1.0] * len(rows) + [1.5]
    )
    header, *subfigs = grid[:, 0]
    columns = 2 if longest is not None else 1
    for row, (subfig, (name, row_runs)) in enumerate(zip(subfigs[:-1], rows, strict=True)):
        axes = subfig.subplots(
            1,
            columns,
            sharey=True,
            squeeze=False,
            width_ratios=[2.2, 1.0] if columns == 2 else [1.0],
        )[0]
        subfig.suptitle(
            _caption(name, row_runs, incidents, short), x=0.005, ha="left", fontsize=8.5
        )
        late = [r.lateness or 0.0 for r in row_runs if r.lateness is not None]
        scale, unit = _unit(max(late, default=0.0))
        top = max(max(late, default=0.0) / scale, 1.0)
        spans = [(scenario.start, scenario.end)]
        if longest is not None:
            spans.append(_zoom(result, row_runs, longest))
        for column, (ax, (lo, hi)) in enumerate(zip(axes, spans, strict=True)):
            _shade(ax, result, incidents, short, named=row == 0 and column == 0)
            shown = [r for r in row_runs if lo <= r.due_at <= hi]
            _plot_runs(ax, shown, scale, column)
            _frame(ax, lo, hi, top)
            if column == 1:
                _annotate(ax, shown, scale, short)
        axes[0].set_ylabel(f"late ({unit})", fontsize=8)
        if row == 0 and longest is not None:
            axes[1].set_title(f"zoom: around the {longest.label(short)}", fontsize=8, loc="left")
            axes[0].set_title(
                "the whole range (across: when each run was due)", fontsize=8, loc="left"
            )
    _distribution(subfigs[-1], rows, runs)
    handles, labels = _legend(runs, incidents)
    fig.suptitle(f"What became of every due run: {_title(result)}", fontsize=10)
    header.legend(handles, labels, loc="center", ncols=4, fontsize=7.5, frameon=False)
    return fig


def _rows(result: SimulationResult, runs: Sequence[DueRun]) -> list[tuple[str, list[DueRun]]]:
    """One row a definition; past the most rows a figure holds, one row a policy."""
    if len(result.definitions) <= _MAX_ROWS:
        return [
            (
                f"{d.name} ({d.policy.value.replace('_', '-')}, {d.cron})",
                [r for r in runs if r.definition_name == d.name],
            )
            for d in result.definitions
        ]
    policy_of = {d.name: d.policy.value for d in result.definitions}
    rows = []
    for policy in _policies(result):
        names = [d.name for d in result.definitions if d.policy.value == policy]
        rows.append(
            (
                f"{plural(len(names), 'definition')} with policy {policy.replace('_', '-')}",
                [r for r in runs if policy_of.get(r.definition_name) == policy],
            )
        )
    return rows


def _shade(
    ax: Any, result: SimulationResult, incidents: Sequence[_Incident], short: bool, *, named: bool
) -> None:
    """Shade each outage (named on the top-left panel) and mark each clock regression."""
    from matplotlib.dates import date2num

    scenario = result.scenario
    for incident in incidents:
        color = _HOST_COLOR if incident.kind == "host" else _BROKER_COLOR
        ax.axvspan(incident.interval.start, incident.interval.end, color=color, alpha=0.13, lw=0)
        if named:
            # Named inside the top of the top panel (late runs stay below 77 % of
            # its height), reading away from the nearer edge.
            span = incident.interval
            early = span.start - scenario.start < (scenario.end - scenario.start) * 0.7
            ax.annotate(
                incident.label(short),
                (date2num(span.start if early else span.end), 0.96),  # type: ignore[no-untyped-call]
                xycoords=ax.get_xaxis_transform(),
                xytext=(3 if early else -3, 0),
                textcoords="offset points",
                va="top",
                ha="left" if early else "right",
                fontsize=7.5,
                color=color,
            )
    for regression in scenario.clock_regressions:
        ax.axvline(regression.at, color="0.4", lw=0.8, ls=":")


def _plot_runs(ax: Any, shown: Sequence[DueRun], scale: float, column: int) -> None:
    """Mark each run by its outcome; a late one stands as high as it was late."""
    raster = len(shown) > _RASTER_ABOVE
    for key, (_, marker, color, filled) in _OUTCOMES.items():
        picked = [r for r in shown if _outcome(r) == key]
        if not picked:
            continue
        ys = [(r.lateness or 0.0) / scale if key == "late" else 0.0 for r in picked]
        if key == "late":
            ax.vlines(
                [r.due_at for r in picked],
                0,
                ys,
                color=color,
                lw=0.8,
                alpha=0.6,
                rasterized=raster,
            )
        ax.scatter(
            [r.due_at for r in picked],
            ys,
            marker=marker,
            s=16 if column else 10,
            color=color if filled else "none",
            edgecolors=color if not filled else None,
            linewidths=0.9,
            zorder=3,
            rasterized=raster,
        )


def _frame(ax: Any, lo: datetime, hi: datetime, top: float) -> None:
    """Set a panel's range and its date ticks."""
    from matplotlib.dates import AutoDateLocator, ConciseDateFormatter

    ax.set_xlim(lo, hi)
    ax.set_ylim(-0.12 * top, top * 1.3)
    ax.tick_params(labelsize=7.5)
    locator = AutoDateLocator()  # type: ignore[no-untyped-call]
    ax.xaxis.set_major_locator(locator)
    # The year and day are in the title and the tick labels: no offset text.
    ax.xaxis.set_major_formatter(
        ConciseDateFormatter(locator, offset_formats=[""] * 6)  # type: ignore[no-untyped-call]
    )


def _legend(runs: Sequence[DueRun], incidents: Sequence[_Incident]) -> tuple[list[Any], list[str]]:
    """Return the legend: each outcome with its count, and the kinds of outage shown."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles: list[Any] = []
    labels: list[str] = []
    totals = {k: 0 for k in _OUTCOMES}
    for run in runs:
        totals[_outcome(run)] += 1
    for key, (label, marker, color, filled) in _OUTCOMES.items():
        if key == "cancelled" and not totals[key]:
            continue
        handles.append(
            Line2D(
                [],
                [],
                ls="",
                marker=marker,
                markersize=6,
                color=color,
                markerfacecolor=color if filled else "none",
            )
        )
        labels.append(f"{label}: {totals[key]:,}")
    for kind, color in (("host", _HOST_COLOR), ("broker", _BROKER_COLOR)):
        if any(x.kind == kind for x in incidents):
            handles.append(Patch(color=color, alpha=0.3, lw=0))
            labels.append(f"{kind} down")
    return handles, labels


def _annotate(ax: Any, shown: Sequence[DueRun], scale: float, short: bool) -> None:
    """Point at the latest run of the zoom: when the late runs went out, what they carried."""
    late = [r for r in shown if _outcome(r) == "late"]
    if not late:
        return
    worst = max(late, key=lambda r: (r.lateness or 0.0, r.due_at))
    times = sorted(r.published_at for r in late if r.published_at is not None)
    at = _when(times[0], short)
    if times[-1] - times[0] >= timedelta(minutes=1):
        at += f"–{_when(times[-1], short)}"
    first, last = min(r.due_at for r in late), max(r.due_at for r in late)
    due = _when(first, short) + ("" if first == last else f"–{_when(last, short)}")
    if len(late) == 1:
        text = f"due {due}, published {at}"
    else:
        text = f"{len(late)} runs due {due}:\nall published {at}"
    carriers = {(r.definition_name, r.due_at) for r in late}
    folded = sum(
        1
        for r in shown
        if r.coalesced_into is not None and (r.definition_name, r.coalesced_into) in carriers
    )
    if folded:
        text += f"\n+ {folded} later runs coalesced into {'it' if len(late) == 1 else 'them'}"
    ax.annotate(
        text,
        (worst.due_at, (worst.lateness or 0.0) / scale),
        xytext=(0.98, 0.94),
        textcoords="axes fraction",
        fontsize=7,
        va="top",
        ha="right",
        arrowprops={"arrowstyle": "-|>", "color": "0.3", "lw": 0.7, "shrinkB": 4},
    )


_BINS: Final = (
    ("on time\n< 1 min", 60.0),
    ("1–15 min", 900.0),
    ("15 min–1 h", 3600.0),
    ("1–3 h", 3 * 3600.0),
    ("3–12 h", 12 * 3600.0),
    ("12 h–1 d", 86400.0),
    ("> 1 day", float("inf")),
)


def _distribution(
    subfig: Any, rows: Sequence[tuple[str, list[DueRun]]], runs: Sequence[DueRun]
) -> None:
    ax = subfig.subplots()
    latenesses = [r.lateness for r in runs if r.lateness is not None]
    n = len(rows)
    width = 0.8 / max(n, 1)
    colors = [
        "#1f77b4",
        "#8c564b",
        "#e377c2",
        "#17becf",
        "#bcbd22",
        "#7f7f7f",
        "#9467bd",
        "#2ca02c",
        "#d62728",
        "#ff7f0e",
    ]
    for k, (name, row_runs) in enumerate(rows):
        counts = [0] * len(_BINS)
        for run in row_runs:
            if run.lateness is None:
                continue
            counts[next(j for j, (_, up) in enumerate(_BINS) if run.lateness <= up)] += 1
        xs = [j - 0.4 + width * (k + 0.5) for j in range(len(_BINS))]
        bars = ax.bar(
            xs, counts, width=width * 0.92, color=colors[k % len(colors)], label=name.split(" (")[0]
        )
        ax.bar_label(bars, labels=[f"{c:,}" if c else "" for c in counts], fontsize=6.5, padding=1)
    ax.set_yscale("log")
    ax.set_ylim(0.7, max([1, *[len(r) for _, r in rows]]) * 3)
    ax.set_xticks(range(len(_BINS)), [label for label, _ in _BINS], fontsize=7.5)
    ax.set_ylabel("publications\n(log scale)", fontsize=8)
    ax.tick_params(axis="y", labelsize=7.5)
    ax.legend(fontsize=7, frameon=False, ncols=min(n, 5), loc="upper right")
    on_time = sum(1 for v in latenesses if v <= ON_TIME_S)
    text = f"How late: {plural(len(latenesses), 'publication')}, {on_time:,} on time"
    late = [v for v in latenesses if v > ON_TIME_S]
    if late:
        median = sorted(late)[(len(late) - 1) // 2]
        text += (
            f", {len(late):,} late (median of the late {_human(median)}, worst {_human(max(late))})"
        )
    subfig.suptitle(text, x=0.005, ha="left", fontsize=8.5)


def write_plot(result: SimulationResult, path: Path) -> None:
    """Draw a traced ``result`` to ``path`` (``.png`` or ``.svg``), deterministically for SVG.

    SVG output is byte-for-byte repeatable: matplotlib's ids are salted with a constant,
    the date is left out and text is drawn as paths.

    Raises:
        PlotUnavailableError: matplotlib is not installed.
        ValueError: the suffix is neither ``.png`` nor ``.svg``, or the run was not traced.
        OSError: the file cannot be written.
    """
    suffix = path.suffix.lower()
    if suffix not in PLOT_FORMATS:
        raise ValueError(f"the plot must be a .png or .svg file, not {path.suffix or 'no suffix'}")
    fig = plot_figure(result)
    import matplotlib

    metadata: dict[str, Any] = (
        {"Date": None, "Creator": None} if suffix == ".svg" else {"Software": None}
    )
    with matplotlib.rc_context({"svg.hashsalt": _SVG_SALT, "svg.fonttype": "path"}):
        if suffix != ".svg":
            fig.savefig(path, metadata=metadata)
            return
        buffer = io.BytesIO()
        fig.savefig(buffer, format="svg", metadata=metadata)
    path.write_bytes(_renumber_clips(buffer.getvalue()))


_CLIP_ID: Final = re.compile(rb'(?<=id=")p[0-9a-f]{10}(?=")|(?<=url\(#)p[0-9a-f]{10}(?=\))')


def _renumber_clips(svg: bytes) -> bytes:
    """Name clip paths by order of appearance.

    matplotlib names a clip rectangle by a hash of its exact coordinates, and the
    constrained layout of subfigures can differ in the last bits of a float from one run
    to the next (the printed coordinates are the same): without this, equal figures
    would give different files.
    """
    names: dict[bytes, bytes] = {}

    def name(match: re.Match[bytes]) -> bytes:
        return names.setdefault(match.group(0), b"clip%d" % (len(names) + 1))

    return _CLIP_ID.sub(name, svg)


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
