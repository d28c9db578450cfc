"""Recurring jobs of the work queue: the jobs API, creating and changing a job, the jobs page."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from steeple.admin import _pages
from steeple.admin._routes.context import AdminContext, Handler
from steeple.admin._routes.http import bad_request, checked_name, only_fields, paging, string_field
from steeple.core.errors import SteepleError


async def list_jobs(ctx: AdminContext, request: Request, namespace: str) -> Response:
    after, limit = paging(request)
    page = await (await ctx.tasks_of(namespace)).jobs(after=after, limit=limit)
    return JSONResponse(
        {"items": [j.to_json() for j in page.items], "next_cursor": page.next_cursor}
    )


async def create_job(ctx: AdminContext, request: Request, namespace: str) -> Response:
    body = await ctx.json_body(request)
    only_fields(body, ("name", "task", "cron", "timezone", "args", "queue"))
    if "args" not in body:
        raise bad_request('give the job\'s "args" (any JSON value, e.g. {})')
    timezone = body.get("timezone", "UTC")
    if not isinstance(timezone, str):
        raise bad_request("timezone must be a string (an IANA name such as UTC)")
    queue = body.get("queue", "default")
    if not isinstance(queue, str):
        raise bad_request("queue must be a string (the named queue its runs wait in)")
    job = await (await ctx.tasks_of(namespace)).create_job(
        checked_name(string_field(body, "name"), "job name"),
        checked_name(string_field(body, "task"), "task"),
        string_field(body, "cron"),
        body["args"],
        timezone or "UTC",
        queue or "default",
    )
    return JSONResponse(job.to_json())


def change_job(verb: str) -> Handler:
    async def handler(ctx: AdminContext, request: Request, namespace: str) -> Response:
        body = await ctx.json_body(request)
        allowed = ("name", "cron", "timezone") if verb == "reschedule" else ("name",)
        only_fields(body, allowed)
        cron = string_field(body, "cron") if verb == "reschedule" else None
        timezone = body.get("timezone") or None
        if timezone is not None and not isinstance(timezone, str):
            raise bad_request("timezone must be a string (an IANA name such as UTC)")
        job = await (await ctx.tasks_of(namespace)).change_job(
            verb, checked_name(string_field(body, "name"), "job name"), cron, timezone
        )
        return JSONResponse({"deleted": True} if job is None else job.to_json())

    return handler


async def jobs_page(ctx: AdminContext, request: Request, namespace: str) -> Response:
    await ctx.gate(request, "jobs.read", namespace)
    admin = await ctx.tasks_of(namespace)
    try:
        jobs = (await admin.jobs(limit=100)).items
    except SteepleError as exc:
        listing = _pages.Section("jobs", _pages.unavailable("Recurring jobs", str(exc)), True)
        return ctx.render(request, namespace, "Recurring jobs", "jobs", [listing])
    links = ctx.links_of(request, namespace)
    table = _pages.jobs_table(links, jobs, ctx.actions_enabled)
    sections = [_pages.Section("jobs", table, live=True)]
    if ctx.actions_enabled:
        sections.append(_pages.Section("new-job", _pages.job_form()))
    return ctx.render(request, namespace, "Recurring jobs", "jobs", sections)
