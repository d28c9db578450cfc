"""The dashboard's overview page, its root redirect and its static files."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from importlib import resources

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from steeple.admin import _pages
from steeple.admin._routes.context import AdminContext
from steeple.admin._routes.http import html_error
from steeple.core.errors import SteepleError


async def overview_page(ctx: AdminContext, request: Request, namespace: str) -> Response:
    await ctx.known(namespace)
    links = ctx.links_of(request, namespace)
    sections: list[_pages.Section] = []
    if ctx.tasks is not None and not await ctx.may(request, "tasks.read", namespace):
        sections.append(_pages.Section("counts", _pages.withheld("Tasks", "tasks.read"), True))
    elif ctx.tasks is not None:
        try:
            overview = await (await ctx.tasks_of(namespace)).overview()
        except SteepleError as exc:
            # e.g. the queue schema is not migrated: the rest of the page still helps.
            sections.append(
                _pages.Section("counts", _pages.unavailable("Tasks", str(exc)), live=True)
            )
        else:
            sections.append(
                _pages.Section("counts", _pages.counts_section(links, overview), live=True)
            )
            sections.append(_pages.Section("chart", _pages.chart_section(overview), live=True))
            if await ctx.may(request, "queues.read", namespace):
                queues = _pages.queues_section(links, overview.queues, ctx.actions_enabled)
            else:
                queues = _pages.withheld("Queues", "queues.read")
            sections.append(_pages.Section("queues", queues, live=True))
    if ctx.stores is not None and not await ctx.may(request, "schedules.read", namespace):
        withheld = _pages.withheld("Publications", "schedules.read")
        sections.append(_pages.Section("schedules", withheld, live=True))
    elif ctx.stores is not None:
        store = await ctx.store_of(namespace)
        schedules = (await store.schedules(limit=100)).items
        sections.append(
            _pages.Section(
                "schedules", _pages.schedules_table(schedules, ctx.actions_enabled), live=True
            )
        )
    return ctx.render(request, namespace, "Overview", "overview", sections)


async def stylesheet(ctx: AdminContext, request: Request, namespace: str) -> Response:
    css = resources.files("steeple.admin").joinpath("static/admin.css").read_text("utf-8")
    return Response(css, media_type="text/css")


async def script(ctx: AdminContext, request: Request, namespace: str) -> Response:
    js = resources.files("steeple.admin").joinpath("static/admin.js").read_text("utf-8")
    return Response(js, media_type="text/javascript")


def home(ctx: AdminContext) -> Callable[[Request], Awaitable[Response]]:
    """Answer the app's root: a person opening it wants the dashboard, not a JSON refusal."""

    async def run(request: Request) -> Response:
        root = str(request.scope.get("root_path", "")).rstrip("/")
        if ctx.homes:
            return RedirectResponse(f"{root}/ui/{ctx.homes[0]}", status_code=307)
        return html_error(
            request, 404, "", "open /ui/NAMESPACE for a namespace's dashboard", homes=ctx.homes
        )

    return run
