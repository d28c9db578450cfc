"""The work queue's queues and counts: the overview and queues API, pausing a queue."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from steeple.admin._routes.context import AdminContext, Handler
from steeple.admin._routes.http import checked_name, only_fields, string_field


async def overview_json(ctx: AdminContext, request: Request, namespace: str) -> Response:
    return JSONResponse((await (await ctx.tasks_of(namespace)).overview()).to_json())


async def list_queues(ctx: AdminContext, request: Request, namespace: str) -> Response:
    overview = await (await ctx.tasks_of(namespace)).overview()
    return JSONResponse({"items": [q.to_json() for q in overview.queues]})


def pause_queue(paused: bool) -> Handler:
    async def handler(ctx: AdminContext, request: Request, namespace: str) -> Response:
        body = await ctx.json_body(request)
        only_fields(body, ("queue",))
        name = checked_name(string_field(body, "queue"), "queue")
        record = await (await ctx.tasks_of(namespace)).pause_queue(name, paused)
        return JSONResponse(record.to_json())

    return handler
