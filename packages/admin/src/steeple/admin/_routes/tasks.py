"""Tasks of the work queue: the tasks API, cancel, retry, purge, bulk actions, task pages."""

from __future__ import annotations

import json

import attrs
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response

from steeple.admin import _pages
from steeple.admin._routes.context import AdminContext, Handler
from steeple.admin._routes.http import (
    BULK_LIMIT,
    PAGE_SIZE,
    Refusal,
    bad_request,
    flag,
    int_field,
    json_error,
    only_fields,
    paging,
    path_task_id,
    purge_args,
    task_filter,
    task_ids_field,
    valid,
)
from steeple.admin.tasks import parse_task_cursor, validate_task_id
from steeple.core.errors import ConfigurationError, SteepleError


async def list_tasks(ctx: AdminContext, request: Request, namespace: str) -> Response:
    after, limit = paging(request)
    valid(parse_task_cursor, after)
    where = await ctx.searchable(request, namespace, task_filter(request.query_params))
    newest = flag(request.query_params.get("newest"), "newest")
    page = await (await ctx.tasks_of(namespace)).tasks(
        after=after, limit=limit, where=where, newest_first=newest
    )
    return JSONResponse(
        {"items": [t.to_json() for t in page.items], "next_cursor": page.next_cursor}
    )


async def show_task(ctx: AdminContext, request: Request, namespace: str) -> Response:
    task_id = path_task_id(str(request.path_params.get("task_id", "")))
    record = await (await ctx.tasks_of(namespace)).task(task_id)
    if record is None:
        return json_error(404, "not_found", "no such task")
    shown = await ctx.visible(request, namespace, record)
    return JSONResponse({**shown.to_json(), "result_withheld": shown is not record})


async def task_attempts(ctx: AdminContext, request: Request, namespace: str) -> Response:
    task_id = path_task_id(str(request.path_params.get("task_id", "")))
    admin = await ctx.tasks_of(namespace)
    if await admin.task(task_id) is None:
        return json_error(404, "not_found", "no such task")
    return JSONResponse({"items": [a.to_json() for a in await admin.attempts(task_id)]})


async def task_args(ctx: AdminContext, request: Request, namespace: str) -> Response:
    task_id = path_task_id(str(request.path_params.get("task_id", "")))
    admin = await ctx.tasks_of(namespace)
    record = await admin.task(task_id)
    if record is None:
        return json_error(404, "not_found", "no such task")
    if not ctx.revealable(record.name):
        raise Refusal(403, "forbidden", f"the args of {record.name} tasks are not shown")
    stored = await admin.args(task_id)
    if stored is None:
        return json_error(404, "not_found", "no such task")
    return JSONResponse({"task_id": task_id, "args": json.loads(stored)})


async def cancel_task(ctx: AdminContext, request: Request, namespace: str) -> Response:
    body = await ctx.json_body(request)
    only_fields(body, ("task_id",))
    task_id = valid(validate_task_id, int_field(body, "task_id", 0))
    state = await (await ctx.tasks_of(namespace)).cancel(task_id)
    if state is None:
        return json_error(404, "not_found", "no such task")
    if state != "cancelled":
        return json_error(409, "invalid_state", f"the task already finished ({state})")
    return JSONResponse({"task_id": task_id, "state": state})


async def retry_task(ctx: AdminContext, request: Request, namespace: str) -> Response:
    body = await ctx.json_body(request)
    only_fields(body, ("task_id",))
    task_id = valid(validate_task_id, int_field(body, "task_id", 0))
    record = await (await ctx.tasks_of(namespace)).retry(task_id)
    if record is None:
        return json_error(404, "not_found", "no such task")
    return JSONResponse(record.to_json())


async def purge_tasks(ctx: AdminContext, request: Request, namespace: str) -> Response:
    body = await ctx.json_body(request)
    older_than, limit = purge_args(body, ctx.clock())
    removed = await (await ctx.tasks_of(namespace)).prune(older_than, limit)
    return JSONResponse({"purged": removed})


def bulk(verb: str) -> Handler:
    # Two steps, so an operator confirms exactly what is acted on: without task_ids the
    # answer lists the matching tasks this action applies to (at most BULK_LIMIT) and
    # changes nothing; with task_ids it acts on those ids only (each still checked by
    # the queue: a task that finished or was retried meanwhile is reported, not forced).
    states = _pages.LIVE_TASK_STATES if verb == "cancel" else ("failed",)

    async def handler(ctx: AdminContext, request: Request, namespace: str) -> Response:
        body = await ctx.json_body(request)
        only_fields(body, ("state", "name", "since", "until", "queue", "args", "task_ids"))
        admin = await ctx.tasks_of(namespace)
        if "task_ids" not in body:
            where = task_filter({k: v for k, v in body.items() if isinstance(v, str)}, strict=body)
            where = await ctx.searchable(request, namespace, where)
            if where.state is not None and where.state not in states:
                return JSONResponse({"task_ids": [], "more": False})
            found: list[int] = []
            more = False
            for state in [where.state] if where.state else list(states):
                page = await admin.tasks(limit=BULK_LIMIT, where=attrs.evolve(where, state=state))
                found += [t.task_id for t in page.items]
                more = more or page.next_cursor is not None
            more = more or len(found) > BULK_LIMIT
            return JSONResponse({"task_ids": sorted(found)[:BULK_LIMIT], "more": more})
        if len(body) != 1:
            raise bad_request("send task_ids alone (the confirmed ids), or only a filter")
        chosen = task_ids_field(body["task_ids"])
        done: list[int] = []
        skipped: dict[str, str] = {}
        for task_id in chosen:
            try:
                if verb == "cancel":
                    after_cancel = await admin.cancel(task_id)
                    ok = after_cancel == "cancelled"
                    reason = f"it already {after_cancel}" if after_cancel else "no such task"
                else:
                    ok = await admin.retry(task_id) is not None
                    reason = "no such task"
            except SteepleError as exc:
                if isinstance(exc, ConfigurationError):
                    raise
                ok, reason = False, str(exc)
            if ok:
                done.append(task_id)
            else:
                skipped[str(task_id)] = reason
        key = "cancelled" if verb == "cancel" else "retried"
        return JSONResponse({key: done, "skipped": skipped})

    return handler


async def tasks_page(ctx: AdminContext, request: Request, namespace: str) -> Response:
    params = request.query_params
    links = ctx.links_of(request, namespace)
    raw_id = (params.get("id") or "").strip()
    if raw_id:
        return RedirectResponse(links.task(path_task_id(raw_id)), status_code=303)
    where = task_filter(params)
    after = params.get("after") or None
    valid(parse_task_cursor, after)
    await ctx.gate(request, "tasks.read", namespace)
    where = await ctx.searchable(request, namespace, where)
    admin = await ctx.tasks_of(namespace)
    try:
        page = await admin.tasks(after=after, limit=PAGE_SIZE, where=where, newest_first=True)
    except SteepleError as exc:
        if isinstance(exc, ConfigurationError):
            raise
        listing = _pages.Section("tasks", _pages.unavailable("Tasks", str(exc)), live=True)
        return ctx.render(request, namespace, "Tasks", "tasks", [listing])
    sections = [
        _pages.Section("filters", _pages.filter_form(links, where)),
        _pages.Section(
            "tasks",
            _pages.heading("Tasks", len(page.items), "newest first; times UTC")
            + (_pages.bulk_bar(where, BULK_LIMIT) if ctx.actions_enabled else "")
            + _pages.tasks_table(links, page.items, ctx.actions_enabled)
            + _pages.pager(links, where, after, page.next_cursor),
            live=True,
        ),
    ]
    return ctx.render(request, namespace, "Tasks", "tasks", sections)


async def task_page(ctx: AdminContext, request: Request, namespace: str) -> Response:
    task_id = path_task_id(str(request.path_params.get("task_id", "")))
    await ctx.gate(request, "tasks.read", namespace)
    admin = await ctx.tasks_of(namespace)
    record = await admin.task(task_id)
    if record is None:
        raise Refusal(404, "not_found", f"no task {task_id} (it may have been purged)")
    attempts = await admin.attempts(task_id)
    shown = await ctx.visible(request, namespace, record)
    result = _pages.result_section(shown, withheld=shown is not record)
    links = ctx.links_of(request, namespace)
    sections = [
        _pages.Section("task", _pages.task_detail(links, record, ctx.actions_enabled), live=True),
        _pages.Section("result", result, live=True),
        _pages.Section("attempts", _pages.attempts_table(attempts), live=True),
        _pages.Section("args", _pages.args_section(record, ctx.revealable(record.name))),
    ]
    return ctx.render(request, namespace, f"Task {task_id}", "tasks", sections)


async def workflow_page(ctx: AdminContext, request: Request, namespace: str) -> Response:
    task_id = path_task_id(str(request.path_params.get("task_id", "")))
    await ctx.gate(request, "tasks.read", namespace)
    admin = await ctx.tasks_of(namespace)
    # Only a task access that knows workflows (the PostgreSQL queue's) draws one.
    read = getattr(admin, "workflow", None)
    graph = None if read is None else await read(task_id)
    if graph is None:
        raise Refusal(404, "not_found", f"no task {task_id} (it may have been purged)")
    links = ctx.links_of(request, namespace)
    section = _pages.Section("workflow", _pages.workflow_section(links, graph), live=True)
    return ctx.render(request, namespace, f"Workflow {graph['workflow_id']}", "tasks", [section])
