"""The admin ASGI app (Starlette): a JSON API and an HTML dashboard for operators.

The dashboard (``/ui/{namespace}``: overview, tasks, one task, recurring jobs,
publications) is rendered by the app and refreshed in place by its own ``admin.js``
(polling the page's ``?live=1`` JSON); no CDN, no inline script or style. It serves the
work queue alone (queue-only mode: no keys, no recurring namespace) or beside a
namespace's recurring publications. A refused page request gets an HTML error page.

Mount it in any ASGI host. The host owns authentication: every request goes through the
``authorize(request, action, namespace)`` callback, and without one the app refuses
everything. Namespaces and names in a request select what to act on; they are never
authorization. State-changing routes take only ``application/json`` bodies plus the
``X-Steeple-CSRF`` header token, so a cross-site form or simple request cannot reach them.
Every response carries restrictive security headers.

Every malformed request is answered 4xx with a one-line JSON reason, before anything
reaches storage: 400 for a body that is not JSON (or not an object, too deeply nested, or
with a field of the wrong type or an unknown field), 404 for an unknown namespace, route
or thing, 413 for a body over 16 KiB (counted while it streams in), 415 for a body that is
not ``application/json``, 422 for a value no store could hold or a listing never returned
(names, ids, cursors, limits, states, ages).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection, Sequence
from datetime import UTC, datetime

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from steeple.admin._routes import jobs, overview, publications, queues
from steeple.admin._routes import tasks as task_routes
from steeple.admin._routes.context import AdminContext, Handler
from steeple.admin._routes.http import (
    BULK_LIMIT,
    CSRF_HEADER,
    MAX_BODY_BYTES,
    html_error,
    http_error,
)
from steeple.admin._routes.publications import occurrence_json, schedule_json
from steeple.admin.tasks import TaskAdmin
from steeple.core.errors import ConfigurationError
from steeple.core.ports import RecurringStore

__all__ = [
    "ACTIONS",
    "BULK_LIMIT",
    "CSRF_HEADER",
    "MAX_BODY_BYTES",
    "SECURITY_HEADERS",
    "Authorize",
    "StoreProvider",
    "TaskProvider",
    "create_admin_app",
    "occurrence_json",
    "schedule_json",
]

Authorize = Callable[[Request, str, str], Awaitable[bool]]
"""``authorize(request, action, namespace) -> allowed``: the host's decision, per request."""
StoreProvider = Callable[[str], Awaitable[RecurringStore]]
"""Return the (host-owned, long-lived) recurring store of a namespace; LookupError if none."""
TaskProvider = Callable[[str], Awaitable[TaskAdmin]]
"""Return the task access of a namespace; LookupError if none."""

ACTIONS = (
    "schedules.read",
    "schedules.cancel",
    "occurrences.read",
    "occurrences.retry",
    "occurrences.purge",
    "tasks.read",
    "tasks.cancel",
    "tasks.retry",
    "tasks.purge",
    "tasks.args",
    "tasks.results",
    "jobs.read",
    "jobs.create",
    "jobs.pause",
    "jobs.resume",
    "jobs.reschedule",
    "jobs.delete",
    "queues.read",
    "queues.pause",
    "queues.resume",
    "dashboard.read",
    "static.read",
)
"""Every action the app asks ``authorize`` about.

A dashboard page asks ``dashboard.read`` and then what the API route that returns the
same data asks (``tasks.read`` for the task pages, ``jobs.read``, ``schedules.read`` and
``occurrences.read``, ``queues.read``); a part the caller may not read is left out. A
task's result (what its handler returned) is shown, by the page and the API alike, only
to who is also allowed ``tasks.results``.
"""

SECURITY_HEADERS: tuple[tuple[bytes, bytes], ...] = (
    (
        b"content-security-policy",
        b"default-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'",
    ),
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"no-referrer"),
    (b"cache-control", b"no-store"),
    (b"cross-origin-opener-policy", b"same-origin"),
    (b"cross-origin-resource-policy", b"same-origin"),
)
"""Headers set on every response, whatever route (or error) produced it."""


class _SecurityHeaders:
    """ASGI middleware: replace any same-named headers with :data:`SECURITY_HEADERS`."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        names = {name for name, _ in SECURITY_HEADERS}

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() not in names]
                headers.extend(SECURITY_HEADERS)
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_headers)


def create_admin_app(
    *,
    authorize: Authorize | None,
    stores: StoreProvider | None = None,
    tasks: TaskProvider | None = None,
    csrf_token: str | None = None,
    now: Callable[[], datetime] | None = None,
    reveal_args: Collection[str] | Callable[[str], bool] = (),
    namespaces: Sequence[str] = (),
    refresh_seconds: float = 5.0,
) -> Starlette:
    """Build the admin app.

    Args:
        authorize: the host's ``authorize(request, action, namespace)``; ``None`` (or any
            answer but ``True``) refuses with 403. ``action`` is one of :data:`ACTIONS`.
        stores: returns the recurring store of a namespace (the host opens and closes it;
            the app never closes it). ``None``: recurring routes answer 404 and the
            dashboard serves the work queue alone (queue-only mode).
        tasks: returns the task access of a namespace. ``None``: task routes answer 404.
        csrf_token: the value state-changing requests must send in ``X-Steeple-CSRF``
            (at least 16 characters). ``None``: every state-changing request is refused
            and the dashboard shows no action buttons.
        now: the clock for purge cutoffs (defaults to the system clock).
        reveal_args: the task names whose args the task page may show (on request, and
            only to who ``authorize`` allows ``tasks.args``), or a predicate over the
            name. Args can hold secrets: by default no task's args are ever shown.
        namespaces: namespaces to link to from error pages (e.g. an unknown namespace).
        refresh_seconds: how often an open dashboard page refreshes its live parts.

    Raises:
        ConfigurationError: a ``csrf_token`` shorter than 16 characters, or a refresh
            period outside 1..3600 seconds.
    """
    if csrf_token is not None and len(csrf_token) < 16:
        raise ConfigurationError("csrf_token must be at least 16 characters of random text")
    if (
        isinstance(refresh_seconds, bool)
        or not isinstance(refresh_seconds, int | float)
        or not 1 <= refresh_seconds <= 3600
    ):
        raise ConfigurationError("refresh_seconds must be a number from 1 to 3600")
    revealable: Callable[[str], bool] = (
        reveal_args if callable(reveal_args) else frozenset(reveal_args).__contains__
    )
    ctx = AdminContext(
        authorize=authorize,
        stores=stores,
        tasks=tasks,
        csrf_token=csrf_token,
        clock=now or (lambda: datetime.now(UTC)),
        revealable=revealable,
        homes=tuple(namespaces),
        refresh_seconds=refresh_seconds,
    )

    async def not_found(request: Request, exc: Exception) -> Response:
        if request.url.path.startswith("/ui/") and request.query_params.get("live") != "1":
            status = exc.status_code if isinstance(exc, HTTPException) else 500
            detail = "no such page" if status == 404 else "this page cannot answer that"
            return html_error(request, status, "", detail, homes=ctx.homes)
        return await http_error(request, exc)

    app = Starlette(routes=_routes(ctx), exception_handlers={HTTPException: not_found})
    app.router.redirect_slashes = False  # "/tasks/" names no task: 404, not a redirect
    app.add_middleware(_SecurityHeaders)
    return app


def _routes(ctx: AdminContext) -> list[Route]:
    """Return the app's routes, each behind its gate (in matching order)."""
    home = overview.home(ctx)

    def get(path: str, action: str, handler: Handler, page: bool = False) -> Route:
        return Route(path, ctx.endpoint(action, handler, page=page))

    def post(path: str, action: str, handler: Handler) -> Route:
        return Route(f"/api/{{namespace}}/{path}", ctx.endpoint(action, handler), methods=["POST"])

    return [
        Route("/", home),
        Route("/ui", home),
        Route("/ui/", home),
        get("/api/{namespace}/schedules", "schedules.read", publications.list_schedules),
        get("/api/{namespace}/occurrences", "occurrences.read", publications.list_occurrences),
        get("/api/{namespace}/tasks", "tasks.read", task_routes.list_tasks),
        get("/api/{namespace}/overview", "tasks.read", queues.overview_json),
        get("/api/{namespace}/jobs", "jobs.read", jobs.list_jobs),
        get("/api/{namespace}/queues", "queues.read", queues.list_queues),
        post("schedules/cancel", "schedules.cancel", publications.cancel_schedule),
        post("occurrences/retry", "occurrences.retry", publications.retry_occurrence),
        post("occurrences/purge", "occurrences.purge", publications.purge_occurrences),
        post("tasks/cancel", "tasks.cancel", task_routes.cancel_task),
        post("tasks/retry", "tasks.retry", task_routes.retry_task),
        post("tasks/purge", "tasks.purge", task_routes.purge_tasks),
        post("tasks/bulk-cancel", "tasks.cancel", task_routes.bulk("cancel")),
        post("tasks/bulk-retry", "tasks.retry", task_routes.bulk("retry")),
        post("jobs/create", "jobs.create", jobs.create_job),
        post("queues/pause", "queues.pause", queues.pause_queue(True)),
        post("queues/resume", "queues.resume", queues.pause_queue(False)),
        post("jobs/pause", "jobs.pause", jobs.change_job("pause")),
        post("jobs/resume", "jobs.resume", jobs.change_job("resume")),
        post("jobs/reschedule", "jobs.reschedule", jobs.change_job("reschedule")),
        post("jobs/delete", "jobs.delete", jobs.change_job("delete")),
        get("/api/{namespace}/tasks/{task_id}", "tasks.read", task_routes.show_task),
        get("/api/{namespace}/tasks/{task_id}/attempts", "tasks.read", task_routes.task_attempts),
        get("/api/{namespace}/tasks/{task_id}/args", "tasks.args", task_routes.task_args),
        get("/ui/{namespace}", "dashboard.read", overview.overview_page, page=True),
        get("/ui/{namespace}/tasks", "dashboard.read", task_routes.tasks_page, page=True),
        get("/ui/{namespace}/tasks/{task_id}", "dashboard.read", task_routes.task_page, page=True),
        get(
            "/ui/{namespace}/workflows/{task_id}",
            "dashboard.read",
            task_routes.workflow_page,
            page=True,
        ),
        get("/ui/{namespace}/jobs", "dashboard.read", jobs.jobs_page, page=True),
        get("/ui/{namespace}/schedules", "dashboard.read", publications.schedules_page, page=True),
        get("/static/admin.css", "static.read", overview.stylesheet),
        get("/static/admin.js", "static.read", overview.script),
    ]
