"""The dashboard's HTML: escaped text only, no inline script or style (the CSP forbids both).

Every page is a list of :class:`Section`; the live ones are also answered as JSON (the
page's own ``?live=1``), so ``admin.js`` refreshes them without reloading and rows are
rendered (and escaped) in one place only. Times are shown in UTC and labelled so.
"""

from __future__ import annotations

import html
import json
import re
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode

import attrs

from steeple.admin.tasks import (
    Overview,
    TaskFilter,
    TaskRecord,
)
from steeple.core.occurrences import OccurrenceState
from steeple.core.records import OccurrenceInfo, ScheduleInfo, occurrence_cursor
from steeple.core.tasks import TaskState

if TYPE_CHECKING:
    from steeple.admin.tasks import AttemptRecord, JobRecord, QueueRecord

__all__ = ["Button", "Links", "Section", "error_page", "page"]

_MAX_ERROR_CELL = 160
_MAX_RESULT_SHOWN = 20_000
LIVE_TASK_STATES = ("pending", "running")
"""Task states a cancel applies to."""
TASK_STATES = tuple(s.value for s in TaskState)


def esc(value: object) -> str:
    """Escape any value for HTML text or a double-quoted attribute."""
    return html.escape(str(value), quote=True)


def stamp(value: datetime | None) -> str:
    """Render an instant for a table cell: month, day and time (UTC); the year on hover."""
    if value is None:
        return '<span class="none">-</span>'
    full = utc(value)
    return (
        f'<time datetime="{esc(value.isoformat())}" title="{esc(full)} UTC">{esc(full[5:])}</time>'
    )


def utc(value: datetime | None) -> str:
    """Format an instant in UTC (``-`` for none); the page labels its times UTC."""
    if value is None:
        return "-"
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")


@attrs.frozen
class Links:
    """The URLs of one namespace's pages and API, under the app's mount point."""

    root: str
    namespace: str

    @property
    def ui(self) -> str:
        """The overview page."""
        return f"{self.root}/ui/{self.namespace}"

    @property
    def api(self) -> str:
        """The JSON API of the namespace."""
        return f"{self.root}/api/{self.namespace}"

    def tasks(self, where: TaskFilter | None = None, after: str | None = None) -> str:
        """Return the task list's URL, filtered and paged."""
        query = filter_query(where or TaskFilter())
        if after is not None:
            query["after"] = after
        return f"{self.ui}/tasks" + (f"?{urlencode(query)}" if query else "")

    def task(self, task_id: int) -> str:
        """One task's page."""
        return f"{self.ui}/tasks/{task_id}"

    def workflow(self, task_id: int) -> str:
        """Return the page of the workflow a task belongs to."""
        return f"{self.ui}/workflows/{task_id}"


def filter_query(where: TaskFilter) -> dict[str, str]:
    """Return the query parameters that select ``where`` on the task list."""
    query: dict[str, str] = {}
    if where.state:
        query["state"] = where.state
    if where.name:
        query["name"] = where.name
    if where.since:
        query["since"] = utc(where.since)
    if where.until:
        query["until"] = utc(where.until)
    if where.queue:
        query["queue"] = where.queue
    if where.args:
        query["args"] = where.args
    return query


def filter_body(where: TaskFilter) -> dict[str, str]:
    """Return the JSON body fields that select ``where`` in a bulk action."""
    return filter_query(where)


@attrs.frozen
class Button:
    """An operator action (wired by ``admin.js``: confirm, then a JSON POST).

    ``fields`` asks the operator for values in the confirmation (``name: label``);
    ``preview`` first posts the body as is and confirms the ids the answer lists. ``done``
    is what the page says once it worked; ``noun`` names what a purge counts.
    """

    action: str
    body: Mapping[str, Any]
    label: str
    confirm: str
    fields: Mapping[str, str] = attrs.field(factory=dict)
    preview: bool = False
    danger: bool = False
    done: str = ""
    noun: str = ""

    def render(self) -> str:
        """Render the ``<button>`` element."""
        extra = ""
        if self.fields:
            extra += f' data-fields="{esc(json.dumps(dict(self.fields)))}"'
        if self.preview:
            extra += ' data-preview="1"'
        if self.done:
            extra += f' data-done="{esc(self.done)}"'
        if self.noun:
            extra += f' data-noun="{esc(self.noun)}"'
        kind = "act danger" if self.danger else "act"
        return (
            f'<button type="button" class="{kind}" data-action="{esc(self.action)}" '
            f'data-body="{esc(json.dumps(dict(self.body)))}" '
            f'data-confirm="{esc(self.confirm)}"{extra}>{esc(self.label)}</button>'
        )


@attrs.frozen
class Section:
    """A part of a page; a live one is refreshed in place by ``admin.js``."""

    id: str
    html: str
    live: bool = False

    def render(self) -> str:
        """Render the section element."""
        live = " data-live" if self.live else ""
        return f'<section id="{esc(self.id)}"{live}>{self.html}</section>'


def badge(state: str) -> str:
    """Render a state, coloured by its stylesheet class."""
    return f'<span class="state state-{esc(state)}">{esc(state)}</span>'


def _clip(text: str | None) -> str:
    """Render an error on one line: cut (with an ellipsis) to its cell, whole on hover."""
    if text is None:
        return '<span class="none">-</span>'
    line = " ".join(text.split())
    if len(line) > _MAX_ERROR_CELL:
        line = line[: _MAX_ERROR_CELL - 1] + "…"
    return f'<span class="error clip" title="{esc(text[:2000])}">{esc(line)}</span>'


def _column(heading: str) -> str:
    """Return the class of a column's cells (``col-last-error``): the stylesheet sizes each."""
    return "col-" + "-".join(re.findall(r"[a-z0-9]+", heading.lower()))


def table(kind: str, headings: Sequence[str], rows: Sequence[Sequence[str]], actions: bool) -> str:
    """Render a table of cells; with ``actions`` the last column is the action column.

    Every row is one line: long text is cut to its cell (``_clip``), never wrapped.
    """
    heads = list(headings) + (["action"] if actions else [])
    head = "".join(
        f'<th class="actions">{esc(h)}</th>'
        if actions and i == len(heads) - 1
        else f'<th class="{_column(h)}">{esc(h)}</th>'
        for i, h in enumerate(heads)
    )
    if rows:
        lines = []
        for row in rows:
            cells = [
                f'<td class="{_column(h)}">{c}</td>'
                for h, c in zip(headings, row[: len(headings)], strict=True)
            ]
            if actions:
                cells.append(f'<td class="actions">{"".join(row[len(headings) :])}</td>')
            lines.append(f'<tr class="row {esc(kind)}">' + "".join(cells) + "</tr>")
        body = "".join(lines)
    else:
        body = f'<tr><td class="empty" colspan="{len(heads)}">none</td></tr>'
    return (
        f'<div class="table-wrap"><table class="{esc(kind)}s"><thead><tr>{head}</tr></thead>'
        f"<tbody>{body}</tbody></table></div>"
    )


def heading(title: str, count: int | None = None, note: str = "") -> str:
    """Render a section heading with an optional count bubble and a note."""
    bubble = "" if count is None else f' <span class="count">{count}</span>'
    extra = f' <span class="note">{esc(note)}</span>' if note else ""
    return f"<h2>{esc(title)}{bubble}{extra}</h2>"


# --- tasks --------------------------------------------------------------------------------


def task_buttons(task: TaskRecord) -> list[str]:
    """Render the actions a task's state allows."""
    if task.state in LIVE_TASK_STATES:
        return [
            Button(
                "tasks/cancel",
                {"task_id": task.task_id},
                "cancel",
                f"Cancel task {task.task_id}?",
                done=f"task {task.task_id} ({task.name}) cancelled",
            ).render()
        ]
    if task.state == "failed":
        return [
            Button(
                "tasks/retry",
                {"task_id": task.task_id},
                "retry",
                f"Retry failed task {task.task_id} now?",
                done=f"task {task.task_id} ({task.name}) is pending again: it runs next",
            ).render()
        ]
    return []


def progress_cell(task: TaskRecord) -> str:
    """Render a task's latest reported progress: a bar, the percentage and its message."""
    if task.progress is None:
        return '<span class="none">-</span>'
    shown = f"{task.progress:.0%}"
    message = f" {esc(task.progress_message)}" if task.progress_message else ""
    return (
        f'<progress max="1" value="{task.progress:.4f}">{shown}</progress> '
        f'<span class="progress">{shown}{message}</span>'
    )


def tasks_table(links: Links, items: Sequence[TaskRecord], actions: bool) -> str:
    """Render the task list's table (state colours, links to each task's page)."""
    rows = [
        [
            f'<a href="{esc(links.task(t.task_id))}">{t.task_id}</a>',
            f'<span class="name" title="{esc(t.name)}">{esc(t.name)}</span>',
            esc(t.queue),
            badge(t.state),
            esc(t.attempts_shown),
            progress_cell(t),
            stamp(t.created_at),
            stamp(t.run_at),
            stamp(t.finished_at),
            _clip(t.last_error),
            *(task_buttons(t) if actions else []),
        ]
        for t in items
    ]
    return table(
        "task",
        [
            "id",
            "name",
            "queue",
            "state",
            "attempts",
            "progress",
            "created",
            "run at",
            "finished",
            "last error",
        ],
        rows,
        actions,
    )


def filter_form(links: Links, where: TaskFilter) -> str:
    """Render the task list's filters (a GET form) and the search by id."""
    options = "".join(
        f'<option value="{s}"{" selected" if where.state == s else ""}>{s}</option>'
        for s in ("", *TASK_STATES)
    ).replace('<option value="">', '<option value="">any state')
    since = utc(where.since) if where.since else ""
    until = utc(where.until) if where.until else ""
    return (
        f'<form class="filters" method="get" action="{esc(links.ui)}/tasks">'
        f'<label>state <select name="state">{options}</select></label>'
        f'<label>task name <input name="name" value="{esc(where.name or "")}" '
        'maxlength="200" autocomplete="off"></label>'
        f'<label>queue <input name="queue" value="{esc(where.queue or "")}" '
        'maxlength="200" autocomplete="off"></label>'
        f'<label>created from (UTC) <input name="since" value="{esc(since)}" '
        'placeholder="2026-12-01 00:00" maxlength="40"></label>'
        f'<label>to (UTC) <input name="until" value="{esc(until)}" '
        'placeholder="2026-12-02 00:00" maxlength="40"></label>'
        '<label title="only for a task name whose args this dashboard may show">'
        f'args contain (JSON) <input name="args" value="{esc(where.args or "")}" '
        """placeholder='{"to": "ada@example.com"}' maxlength="2000" autocomplete="off">"""
        "</label>"
        '<button type="submit" id="apply-filters">filter</button>'
        f'<a class="reset" href="{esc(links.ui)}/tasks">reset</a></form>'
        f'<form class="search" method="get" action="{esc(links.ui)}/tasks">'
        '<label>task id <input name="id" inputmode="numeric" maxlength="19" '
        'autocomplete="off"></label><button type="submit" id="search-id">open</button></form>'
    )


def bulk_bar(where: TaskFilter, bound: int) -> str:
    """Bulk cancel/retry of the filtered set: previewed, confirmed, at most ``bound``."""
    body = filter_body(where)
    buttons = []
    if where.state in (None, *LIVE_TASK_STATES):
        buttons.append(
            Button(
                "tasks/bulk-cancel", body, "cancel all matching", "Cancel", preview=True
            ).render()
        )
    if where.state in (None, "failed"):
        buttons.append(
            Button(
                "tasks/bulk-retry", body, "retry all failed matching", "Retry", preview=True
            ).render()
        )
    buttons.append(
        Button(
            "tasks/purge",
            {},
            "purge finished",
            "Delete finished tasks (and their attempt history) older than this many days "
            f"(at most {bound} per click)?",
            fields={"older_than_days": "days"},
            danger=True,
            noun="task",
        ).render()
    )
    return (
        f'<div class="bulk"><span class="note">at most {bound} tasks per action, listed '
        f"before you confirm</span> {''.join(buttons)}</div>"
    )


def pager(links: Links, where: TaskFilter, after: str | None, next_cursor: str | None) -> str:
    """Keyset pagination: newest first, then older pages by cursor."""
    parts = []
    if after is not None:
        parts.append(f'<a class="page" href="{esc(links.tasks(where))}">« newest</a>')
    if next_cursor is not None:
        parts.append(
            f'<a class="page" id="older" href="{esc(links.tasks(where, next_cursor))}">older »</a>'
        )
    return f'<nav class="pager">{" ".join(parts)}</nav>'


def _attempts_detail(task: TaskRecord) -> str:
    """Render the attempts row of a task's page: the count, and whether more can come."""
    unused = task.max_attempts - task.attempts
    if task.state == "failed" and unused > 0:
        return f"{task.attempts_shown} ({unused} of its {task.max_attempts} attempts unused)"
    return task.attempts_shown


def task_detail(links: Links, task: TaskRecord, actions: bool) -> str:
    """Render the task's metadata and timings, its limit key and a link to its workflow."""
    waited = _span(task.run_at, task.started_at)
    ran = _span(task.started_at, task.finished_at)
    rows = [
        ("state", badge(task.state)),
        ("task name", esc(task.name)),
        ("queue", esc(task.queue)),
        ("limit key", esc(task.limit_key or "-")),
        ("workflow", _workflow_link(links, task)),
        ("attempts", esc(_attempts_detail(task))),
        ("priority", esc(task.priority)),
        ("created (UTC)", esc(utc(task.created_at))),
        ("due (UTC)", esc(utc(task.run_at))),
        ("last started (UTC)", esc(utc(task.started_at))),
        ("finished (UTC)", esc(utc(task.finished_at))),
        ("waited for a worker", esc(waited)),
        ("last run took", esc(ran)),
        ("worker", esc(task.worker_id or "-")),
        ("run id", f"<code>{esc(task.run_id or '-')}</code>"),
        ("last error", _clip(task.last_error)),
    ]
    if task.job_id is not None:
        rows.append(("recurring occurrence of (UTC)", esc(utc(task.scheduled_for))))
    dl = "".join(f"<dt>{esc(k)}</dt><dd>{v}</dd>" for k, v in rows)
    buttons = "".join(task_buttons(task)) if actions else ""
    return (
        f'{heading("Details")}<dl class="detail">{dl}</dl><div class="task-actions">{buttons}</div>'
    )


def _workflow_link(links: Links, task: TaskRecord) -> str:
    if task.workflow_id is None:
        return "-"
    return f'<a href="{esc(links.workflow(task.task_id))}">{task.workflow_id}</a>'


def workflow_section(links: Links, graph: Mapping[str, Any]) -> str:
    """Render a workflow: its graph (data ``admin.js`` draws as SVG) and a table of its tasks."""
    tasks = list(graph["tasks"])
    counts: dict[str, int] = {}
    for task in tasks:
        counts[task["state"]] = counts.get(task["state"], 0) + 1
    drawn = {"tasks": [{k: t[k] for k in ("id", "name", "state", "after")} for t in tasks]}
    rows = [
        [
            f'<a href="{esc(links.task(t["id"]))}">{t["id"]}</a>',
            esc(t["name"]),
            badge(t["state"]),
            esc(", ".join(str(i) for i in t["after"]) or "-"),
            esc("-" if t["waiting_on"] is None else t["waiting_on"]),
            esc(t["on_parent_failure"] or "-"),
            _clip(t["last_error"]),
        ]
        for t in tasks
    ]
    return (
        heading(
            f"Workflow {graph['workflow_id']}", len(tasks), "each task after those it waits for"
        )
        + f'<figure class="graph" id="workflow-graph" data-graph="{esc(json.dumps(drawn))}">'
        '<div class="plot"></div><figcaption class="legend">'
        + "".join(
            f'<span class="key state-{esc(s)}">{esc(s)} {n}</span>' for s, n in counts.items()
        )
        + "</figcaption></figure>"
        + table(
            "workflow-task",
            ("id", "name", "state", "after", "waiting on", "if a parent fails", "last error"),
            rows,
            False,
        )
    )


def _span(start: datetime | None, end: datetime | None) -> str:
    if start is None or end is None:
        return "-"
    seconds = (end - start).total_seconds()
    if seconds < 0:
        return "-"
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 120:
        return f"{seconds:.2f} s"
    return f"{seconds / 60:.1f} min"


def _attempt_error(attempt: AttemptRecord) -> str:
    if not attempt.error:
        return '<span class="none">-</span>'
    text = f'<span class="error">{esc(attempt.error)}</span>'
    if attempt.traceback:
        kind = f" ({esc(attempt.error_type)})" if attempt.error_type else ""
        text += (
            f'<details class="trace"><summary>traceback{kind}</summary>'
            f'<pre class="trace">{esc(attempt.traceback)}</pre></details>'
        )
    return text


def attempts_table(attempts: Sequence[AttemptRecord]) -> str:
    """Render the attempt history, newest first, each error in full (tracebacks too)."""
    rows = [
        [
            esc(a.attempt),
            badge(a.outcome),
            esc(a.worker_id or "-"),
            esc(utc(a.started_at)),
            esc(utc(a.finished_at)),
            esc(_span(a.started_at, a.finished_at)),
            _attempt_error(a),
        ]
        for a in attempts
    ]
    return heading("Attempts", len(attempts), "newest first; times UTC") + table(
        "attempt",
        ["#", "outcome", "worker", "started", "finished", "took", "error"],
        rows,
        False,
    )


def args_section(task: TaskRecord, revealable: bool) -> str:
    """Render the args: hidden by default, revealed on request for task names opted in."""
    if not revealable:
        return (
            heading("Args")
            + '<p class="note" id="args-hidden">hidden: args can hold secrets, and this '
            f"dashboard does not show the args of {esc(task.name)} tasks (the host opts "
            "task names in: <code>reveal_args</code>, or "
            "<code>steeple admin serve --show-args NAME</code>)</p>"
        )
    return (
        heading("Args")
        + f'<button type="button" class="act" id="reveal-args" data-reveal="{task.task_id}">'
        'show args</button><pre class="args" id="args-text" hidden></pre>'
    )


def result_section(task: TaskRecord, *, withheld: bool = False) -> str:
    """Render the task's progress and, once it succeeded, the JSON value it returned.

    ``withheld``: the caller may not read results (``tasks.results``); the page says so.
    """
    if withheld:
        result = (
            '<p class="note" id="result-withheld">the result is not shown: '
            "not allowed (tasks.results)</p>"
        )
    elif task.state == "succeeded":
        text = json.dumps(task.result, indent=2, ensure_ascii=False)
        if len(text) > _MAX_RESULT_SHOWN:
            text = text[:_MAX_RESULT_SHOWN] + "\n... (cut here; the API has all of it)"
        result = f'<pre class="result" id="result-text">{esc(text)}</pre>'
    else:
        result = f'<p class="note">none yet: the task is {esc(task.state)}</p>'
    return heading("Progress and result") + f'<p id="progress">{progress_cell(task)}</p>' + result


# --- overview ------------------------------------------------------------------------------


def about(n: int) -> str:
    """Say an estimate as people do: ``about 10 M``, ``about 120 k``."""
    for size, unit in ((1_000_000_000, "G"), (1_000_000, "M"), (1_000, "k")):
        if n >= size:
            return f"about {n / size:.3g} {unit}"
    return f"about {n}"


def bounded(n: int, bound: str | None) -> str:
    """Show a count: exact, ``10,000+`` (counting stopped) or ``about 10 M``."""
    if bound == "at_least":
        return f"{n:,}+"
    if bound == "about":
        return about(n)
    return str(n)


def counts_section(links: Links, overview: Overview) -> str:
    """Render the counts per state, each a link to the filtered task list."""
    total = sum(overview.counts.values())
    cards = "".join(
        f'<a class="card state-{esc(s)}" href="{esc(links.tasks(TaskFilter(state=s)))}">'
        f'<span class="n">{esc(bounded(overview.counts.get(s, 0), overview.bounds.get(s)))}'
        f'</span><span class="label">{esc(s)}</span></a>'
        for s in TASK_STATES
    )
    note = (
        "counts stop at 10,000 per state; larger ones are estimates from the table's statistics"
        if overview.bounds
        else ""
    )
    shown = None if overview.bounds else total
    return heading("Tasks by state", shown, note) + f'<div class="cards">{cards}</div>'


def queues_section(links: Links, queues: Sequence[QueueRecord], actions: bool) -> str:
    """Render the named queues: live tasks per queue, limits, pause and resume."""
    rows = []
    for q in queues:
        limits = []
        if q.max_running is not None:
            limits.append(f"at most {q.max_running} running")
        if q.rate_limit is not None and q.rate_period is not None:
            limits.append(f"{q.rate_limit} starts per {q.rate_period.total_seconds():g} s")
        if q.max_running_per_key is not None:
            limits.append(f"at most {q.max_running_per_key} running per key")
        if q.rate_limit_per_key is not None and q.rate_period_per_key is not None:
            limits.append(
                f"{q.rate_limit_per_key} starts per key per "
                f"{q.rate_period_per_key.total_seconds():g} s"
            )
        state = badge("paused" if q.paused else "active")
        if q.unserved:
            # Judged from the tasks (workers do not register): say what was seen.
            state += (
                f' <span class="state state-failed unserved" title="due work has waited since '
                f"{esc(utc(q.due_since))} UTC and none of its tasks runs: no live worker seems "
                f'to serve this queue (or its workers lack the task)">unserved</span>'
            )
        row = [
            f'<a href="{esc(links.tasks(TaskFilter(queue=q.name)))}">{esc(q.name)}</a>',
            state,
            esc(bounded(q.pending, "at_least" if q.pending_capped else None)),
            esc(bounded(q.running, "at_least" if q.running_capped else None)),
            esc(", ".join(limits) or "-"),
        ]
        if actions:
            button = (
                Button(
                    "queues/resume",
                    {"queue": q.name},
                    "resume",
                    f"Resume queue {q.name}?",
                    done=f"queue {q.name} resumed: workers claim from it again",
                )
                if q.paused
                else Button(
                    "queues/pause",
                    {"queue": q.name},
                    "pause",
                    f"Pause queue {q.name}? No worker starts its tasks until it is resumed "
                    "(running ones finish).",
                    done=f"queue {q.name} paused: no worker starts its tasks",
                )
            )
            row.append(button.render())
        rows.append(row)
    unserved = [q.name for q in queues if q.unserved]
    warning = (
        '<p class="unavailable" id="unserved-queues">'
        f"no worker seems to serve {esc(', '.join(unserved))}: due work has waited there for "
        "minutes and none of its tasks runs (start a worker that serves it: "
        "<code>Scheduler(queues=[...])</code>, or <code>App.scheduler()</code> for an "
        "app that declares tasks in it)</p>"
        if unserved
        else ""
    )
    return (
        heading("Queues", len(queues), "with live tasks or settings")
        + warning
        + table("queue", ["queue", "state", "pending", "running", "limits"], rows, actions)
    )


def chart_section(overview: Overview) -> str:
    """Throughput over the last hour: data for ``admin.js`` to draw (an SVG bar chart)."""
    series = {
        "ends_at": overview.ends_at.astimezone(UTC).isoformat(),
        "bucket_seconds": overview.bucket_seconds,
        "finished": {k: list(v) for k, v in overview.finished.items()},
    }
    done = sum(sum(v) for v in overview.finished.values())
    minutes = round(len(next(iter(overview.finished.values()), ())) * overview.bucket_seconds / 60)
    return (
        heading(
            "Finished in the last hour",
            done,
            f"tasks per minute (y) over the last {minutes} minutes (x), until "
            f"{utc(overview.ends_at)} UTC",
        )
        + f'<figure class="chart" id="throughput" data-series="{esc(json.dumps(series))}">'
        '<div class="plot"></div><figcaption class="legend">'
        + "".join(
            f'<span class="key state-{esc(s)}">{esc(s)} {sum(v)}</span>'
            for s, v in overview.finished.items()
        )
        + "</figcaption></figure>"
        + queue_throughput(overview)
    )


def queue_throughput(overview: Overview) -> str:
    """Render what each named queue finished over the chart's window, per terminal state."""
    states = list(overview.finished)
    rows = [
        [esc(name), *(esc(per.get(s, 0)) for s in states), esc(sum(per.values()))]
        for name, per in overview.finished_by_queue.items()
    ]
    return (
        '<div class="by-queue">'
        + table("queue-throughput", ["queue", *states, "total"], rows, False)
        + "</div>"
    )


def withheld(title: str, action: str) -> str:
    """Render a section the caller may not read (``authorize`` refused ``action``)."""
    return heading(title) + f'<p class="unavailable">not allowed: {esc(action)}</p>'


def unavailable(title: str, reason: str) -> str:
    """Render a section that could not be read (e.g. the queue is not migrated yet)."""
    return heading(title) + f'<p class="unavailable">unavailable: {esc(reason)}</p>'


# --- recurring jobs of the queue -------------------------------------------------------------


def jobs_table(links: Links, items: Sequence[JobRecord], actions: bool) -> str:
    """Render the queue's recurring jobs with pause/resume/reschedule/delete."""
    rows = []
    for j in items:
        row = [
            esc(j.name),
            esc(j.task_name),
            f"<code>{esc(j.cron)}</code>",
            esc(j.timezone),
            f'<a href="{esc(links.tasks(TaskFilter(queue=j.queue)))}">{esc(j.queue)}</a>',
            badge("paused" if j.paused else "active"),
            esc(utc(j.next_run_at)),
        ]
        if actions:
            toggle = (
                Button(
                    "jobs/resume",
                    {"name": j.name},
                    "resume",
                    f"Resume job {j.name} from now?",
                    done=f"job {j.name} resumed",
                )
                if j.paused
                else Button(
                    "jobs/pause",
                    {"name": j.name},
                    "pause",
                    f"Pause job {j.name}?",
                    done=f"job {j.name} paused",
                )
            )
            row += [
                toggle.render(),
                Button(
                    "jobs/reschedule",
                    {"name": j.name},
                    "reschedule",
                    f"New schedule for job {j.name} (its next run is the first after now):",
                    fields={"cron": "cron expression", "timezone": "time zone"},
                    done=f"job {j.name} rescheduled",
                ).render(),
                Button(
                    "jobs/delete",
                    {"name": j.name},
                    "delete",
                    f"Delete job {j.name}? Tasks it already made stay.",
                    danger=True,
                    done=f"job {j.name} deleted",
                ).render(),
            ]
        rows.append(row)
    return heading("Recurring jobs", len(items), "next run in UTC") + table(
        "job", ["name", "task", "cron", "zone", "queue", "state", "next run"], rows, actions
    )


def job_form() -> str:
    """Create a recurring job (``admin.js`` posts it as JSON)."""
    return (
        heading("New recurring job")
        + '<form class="create" id="job-create" data-action="jobs/create">'
        '<label>name <input name="name" required maxlength="200"></label>'
        '<label>task name <input name="task" required maxlength="200"></label>'
        '<label>cron <input name="cron" required placeholder="*/5 * * * *" maxlength="200">'
        "</label>"
        '<label>time zone <input name="timezone" value="UTC" maxlength="128"></label>'
        '<label>queue <input name="queue" value="default" required maxlength="200"></label>'
        '<label class="wide">args (JSON) <textarea name="args" rows="2">{}</textarea></label>'
        '<button type="submit" id="job-create-submit">create</button></form>'
    )


# --- recurring publications ----------------------------------------------------------------------


def schedules_table(
    items: Sequence[ScheduleInfo], actions: bool, title: str = "Recurring publications"
) -> str:
    """Render the namespace's recurring publications (their definitions)."""
    rows = [
        [
            esc(s.name),
            f"<code>{esc(s.cron)}</code>",
            esc(s.policy.value),
            badge(s.state),
            esc(s.topic),
            esc(utc(s.next_due_at)),
            *(
                [
                    Button(
                        "schedules/cancel",
                        {"name": s.name},
                        "cancel",
                        f"Cancel {s.name} for good? Its name stays reserved.",
                        danger=True,
                        done=f"publication {s.name} cancelled for good",
                    ).render()
                ]
                if actions and s.state == "active"
                else []
            ),
        ]
        for s in items
    ]
    return heading(title, len(items), "next due in UTC") + table(
        "schedule", ["name", "cron", "policy", "state", "topic", "next due"], rows, actions
    )


@attrs.frozen
class OccurrenceFilter:
    """Which occurrences the publications page lists: a state, a definition, due from when."""

    state: str | None = None
    definition: str | None = None
    since: datetime | None = None

    def cursor(self) -> str | None:
        """Return the listing cursor just before ``since`` (``None``: from the first)."""
        if self.since is None:
            return None
        return occurrence_cursor(self.since - timedelta(milliseconds=1), "f" * 32)

    def matches(self, info: OccurrenceInfo) -> bool:
        """Return whether ``info`` is listed."""
        return (self.state is None or info.state.value == self.state) and (
            self.definition is None or info.definition_name == self.definition
        )

    def query(self) -> dict[str, str]:
        """Return the query parameters that select this filter."""
        query = {"from": utc(self.since) if self.since else ""}
        if self.state:
            query["state"] = self.state
        if self.definition:
            query["definition"] = self.definition
        return query


def occurrence_filter_form(links: Links, where: OccurrenceFilter) -> str:
    """Render the publications page's filters (a GET form)."""
    states = [s.value for s in OccurrenceState]
    options = "".join(
        f'<option value="{s}"{" selected" if where.state == s else ""}>{s or "any state"}</option>'
        for s in ("", *states)
    )
    since = utc(where.since) if where.since else ""
    return (
        f'<form class="filters" method="get" action="{esc(links.ui)}/schedules">'
        f'<label>state <select name="state">{options}</select></label>'
        f'<label>definition <input name="definition" value="{esc(where.definition or "")}" '
        'maxlength="200" autocomplete="off"></label>'
        f'<label>due from (UTC; empty: the first) <input name="from" value="{esc(since)}" '
        'placeholder="2026-12-01 00:00" maxlength="40"></label>'
        '<button type="submit" id="apply-occurrence-filters">filter</button>'
        f'<a class="reset" href="{esc(links.ui)}/schedules">reset</a></form>'
    )


def occurrence_pager(
    links: Links, where: OccurrenceFilter, after: str | None, next_cursor: str | None
) -> str:
    """Keyset pages through the occurrences in due order."""
    base = f"{links.ui}/schedules"
    parts = []
    if after is not None:
        parts.append(
            f'<a class="page" href="{esc(base)}?{esc(urlencode(where.query()))}">« first</a>'
        )
    if next_cursor is not None:
        query = urlencode({**where.query(), "after": next_cursor})
        parts.append(f'<a class="page" id="later" href="{esc(base)}?{esc(query)}">later »</a>')
    return f'<nav class="pager">{" ".join(parts)}</nav>'


def occurrences_table(
    items: Sequence[OccurrenceInfo],
    actions: bool,
    bound: int,
    where: OccurrenceFilter | None = None,
) -> str:
    """Render a page of the namespace's occurrences, with retry of dead ones and a purge."""
    rows = [
        [
            f"<code>{esc(o.occurrence_id)}</code>",
            esc(o.definition_name),
            esc(utc(o.due_at)),
            badge(o.state.value),
            esc(o.attempts),
            _clip(o.last_error),
            *(
                [
                    Button(
                        "occurrences/retry",
                        {"occurrence_id": o.occurrence_id},
                        "retry",
                        f"Retry dead occurrence {o.occurrence_id}?",
                        done=f"occurrence {o.occurrence_id} of {o.definition_name} retries next",
                    ).render()
                ]
                if actions and o.state.value == "dead"
                else []
            ),
        ]
        for o in items
    ]
    purge = (
        Button(
            "occurrences/purge",
            {},
            "purge finished",
            f"Delete finished occurrences older than this many days (at most {bound} per click)?",
            fields={"older_than_days": "days"},
            danger=True,
            noun="occurrence",
        ).render()
        if actions
        else ""
    )
    since = where.since if where is not None else None
    note = f"due from {utc(since)} UTC, in due order" if since else "in due order (UTC)"
    return (
        heading("Occurrences", len(items), note)
        + f'<div class="bulk">{purge}</div>'
        + table(
            "occurrence",
            ["id", "definition", "due", "state", "attempts", "last error"],
            rows,
            actions,
        )
    )


# --- the page -------------------------------------------------------------------------------


NAV = (("overview", ""), ("tasks", "/tasks"), ("jobs", "/jobs"), ("publications", "/schedules"))


def page(
    links: Links,
    title: str,
    current: str,
    sections: Sequence[Section],
    *,
    csrf_token: str | None,
    refresh_seconds: float,
    modes: str,
) -> str:
    """Render the page: header, navigation, flash area, confirmation dialog, sections."""
    ns = esc(links.namespace)
    meta = "" if csrf_token is None else f'<meta name="steeple-csrf" content="{esc(csrf_token)}">'
    here = ' class="here"'
    nav = "".join(
        f'<a href="{esc(links.ui + suffix)}"{here if name == current else ""}>{esc(name)}</a>'
        for name, suffix in NAV
    )
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        f"<title>{esc(title)} · steeple · {ns}</title>"
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f'<link rel="stylesheet" href="{esc(links.root)}/static/admin.css">{meta}'
        f'<script src="{esc(links.root)}/static/admin.js" defer></script></head>'
        f'<body data-namespace="{ns}" data-api="{esc(links.api)}" '
        f'data-refresh="{refresh_seconds:g}">'
        f'<header><h1><a href="{esc(links.ui)}">steeple</a></h1>'
        f'<p>namespace <strong>{ns}</strong> · <span class="modes">{esc(modes)}</span> · '
        "all times UTC</p>"
        f'<nav class="tabs">{nav}</nav>'
        '<p class="live"><label><input type="checkbox" id="live-toggle" checked> live</label> '
        '<span id="updated"></span></p></header>'
        '<div id="flash" role="status" aria-live="polite"></div>'
        '<dialog id="confirm"><form method="dialog"><p id="confirm-text"></p>'
        '<div id="confirm-fields"></div><menu><button value="cancel" id="confirm-cancel">back'
        '</button><button value="ok" id="confirm-ok">confirm</button></menu></form></dialog>'
        f'<main><h2 class="title">{esc(title)}</h2>'
        + "".join(s.render() for s in sections)
        + "</main></body></html>"
    )


def live_json(sections: Sequence[Section]) -> dict[str, Any]:
    """Return what ``?live=1`` answers: the inner HTML of each live section by id."""
    return {"live": {s.id: s.html for s in sections if s.live}}


def error_page(status: int, title: str, detail: str, root: str, homes: Sequence[str]) -> str:
    """Render a friendly error page (no script; links to the namespaces served)."""
    links = "".join(
        f'<li><a href="{esc(root)}/ui/{esc(n)}">namespace {esc(n)}</a></li>' for n in homes
    )
    where = f"<p>This dashboard serves:</p><ul>{links}</ul>" if links else ""
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        f"<title>{status} {esc(title)} · steeple</title>"
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f'<link rel="stylesheet" href="{esc(root)}/static/admin.css"></head>'
        f'<body class="error-page"><header><h1>steeple</h1></header><main>'
        f'<h2 class="title">{status} · {esc(title)}</h2><p class="detail">{esc(detail)}</p>'
        f"{where}</main></body></html>"
    )
