"""Recurring publications: the schedules and occurrences API and the publications page."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from steeple.admin import _pages
from steeple.admin._routes.context import AdminContext
from steeple.admin._routes.http import (
    BULK_LIMIT,
    OCCURRENCE_SCAN,
    PAGE_SIZE,
    occurrence_filter,
    only_fields,
    paging,
    purge_args,
    string_field,
    valid,
)
from steeple.core.config import validate_definition_name
from steeple.core.records import (
    OccurrenceInfo,
    ScheduleInfo,
    occurrence_cursor,
    parse_occurrence_cursor,
    validate_occurrence_id,
)


def _iso(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat()


def schedule_json(info: ScheduleInfo) -> dict[str, Any]:
    """Return a schedule's metadata as a JSON-ready dict (no payload, no headers)."""
    return {
        "name": info.name,
        "cron": info.cron,
        "policy": info.policy.value,
        "first_after": _iso(info.first_after),
        "topic": info.topic,
        "message_type": info.message_type,
        "state": info.state,
        "next_due_at": _iso(info.next_due_at),
        "created_at": _iso(info.created_at),
        "cancelled_at": _iso(info.cancelled_at),
    }


def occurrence_json(info: OccurrenceInfo) -> dict[str, Any]:
    """Return an occurrence's metadata as a JSON-ready dict (no payload, no lease)."""
    return {
        "occurrence_id": info.occurrence_id,
        "definition_name": info.definition_name,
        "due_at": _iso(info.due_at),
        "state": info.state.value,
        "attempts": info.attempts,
        "window_ends_at": _iso(info.window_ends_at),
        "created_at": _iso(info.created_at),
        "next_attempt_at": _iso(info.next_attempt_at),
        "last_error": info.last_error,
    }


async def list_schedules(ctx: AdminContext, request: Request, namespace: str) -> Response:
    after, limit = paging(request)
    if after is not None:
        valid(validate_definition_name, after, "invalid schedules cursor")
    page = await (await ctx.store_of(namespace)).schedules(after=after, limit=limit)
    return JSONResponse(
        {"items": [schedule_json(s) for s in page.items], "next_cursor": page.next_cursor}
    )


async def list_occurrences(ctx: AdminContext, request: Request, namespace: str) -> Response:
    after, limit = paging(request)
    if after is not None:
        valid(parse_occurrence_cursor, after)
    page = await (await ctx.store_of(namespace)).occurrences(after=after, limit=limit)
    return JSONResponse(
        {"items": [occurrence_json(o) for o in page.items], "next_cursor": page.next_cursor}
    )


async def cancel_schedule(ctx: AdminContext, request: Request, namespace: str) -> Response:
    body = await ctx.json_body(request)
    only_fields(body, ("name",))
    name = valid(validate_definition_name, string_field(body, "name"))
    info = await (await ctx.store_of(namespace)).cancel(name)
    return JSONResponse(schedule_json(info))


async def retry_occurrence(ctx: AdminContext, request: Request, namespace: str) -> Response:
    body = await ctx.json_body(request)
    only_fields(body, ("occurrence_id",))
    occurrence_id = valid(validate_occurrence_id, string_field(body, "occurrence_id"))
    info = await (await ctx.store_of(namespace)).retry_failed(occurrence_id)
    return JSONResponse(occurrence_json(info))


async def purge_occurrences(ctx: AdminContext, request: Request, namespace: str) -> Response:
    body = await ctx.json_body(request)
    older_than, limit = purge_args(body, ctx.clock())
    removed = await (await ctx.store_of(namespace)).purge_terminal(older_than, limit)
    return JSONResponse({"purged": removed})


async def schedules_page(ctx: AdminContext, request: Request, namespace: str) -> Response:
    if ctx.stores is None:
        await ctx.known(namespace)
        note = (
            '<p class="note" id="queue-only">queue-only mode: recurring publications are '
            "not served here (start <code>steeple admin serve</code> with storage keys "
            "for an initialized namespace)</p>"
        )
        sections = [_pages.Section("schedules", _pages.heading("Publications") + note)]
        return ctx.render(request, namespace, "Recurring publications", "publications", sections)
    await ctx.gate(request, "schedules.read", namespace)
    await ctx.gate(request, "occurrences.read", namespace)
    store = await ctx.store_of(namespace)
    params = request.query_params
    shown = occurrence_filter(params, ctx.clock())
    after = params.get("after") or None
    if after is not None:
        valid(parse_occurrence_cursor, after)
    schedules = (await store.schedules(limit=100)).items
    # The store lists by due time; a filter is applied while paging through it, reading
    # at most OCCURRENCE_SCAN occurrences per page shown (the pager continues there).
    position = after or shown.cursor()
    found: list[OccurrenceInfo] = []
    scanned = 0
    while len(found) < PAGE_SIZE and scanned < OCCURRENCE_SCAN:
        page = await store.occurrences(after=position, limit=100)
        for info in page.items:
            scanned += 1
            if shown.matches(info):
                found.append(info)
            if len(found) == PAGE_SIZE:
                position = occurrence_cursor(info.due_at, info.occurrence_id)
                break
        else:
            position = page.next_cursor
        if position is None or len(found) == PAGE_SIZE:
            break
    links = ctx.links_of(request, namespace)
    sections = [
        _pages.Section(
            "schedules",
            _pages.schedules_table(schedules, ctx.actions_enabled, title="Definitions"),
            live=True,
        ),
        _pages.Section("occurrence-filters", _pages.occurrence_filter_form(links, shown)),
        _pages.Section(
            "occurrences",
            _pages.occurrences_table(found, ctx.actions_enabled, BULK_LIMIT, shown)
            + _pages.occurrence_pager(links, shown, after, position),
            live=True,
        ),
    ]
    return ctx.render(request, namespace, "Recurring publications", "publications", sections)
