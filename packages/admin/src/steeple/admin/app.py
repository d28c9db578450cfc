"""The admin ASGI app (Starlette): a JSON API and a small HTML dashboard for operators.

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

import hmac
import html
import json
import logging
import re
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime, timedelta
from importlib import resources
from typing import Any, TypeVar

import attrs
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from steeple.admin.tasks import (
    TaskAdmin,
    TaskRecord,
    parse_task_cursor,
    validate_task_id,
    validate_task_state,
)
from steeple.core.config import validate_definition_name, validate_namespace
from steeple.core.errors import (
    ConfigurationError,
    RecurringInvalidStateError,
    RecurringNotFoundError,
    RecurringStorageError,
    SteepleError,
)
from steeple.core.policies import validate_budget
from steeple.core.ports import RecurringStore
from steeple.core.records import (
    OccurrenceInfo,
    ScheduleInfo,
    parse_occurrence_cursor,
    validate_occurrence_id,
)

__all__ = [
    "ACTIONS",
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

CSRF_HEADER = "X-Steeple-CSRF"
"""Header that state-changing requests must carry, equal to the configured token."""

ACTIONS = (
    "schedules.read",
    "schedules.cancel",
    "occurrences.read",
    "occurrences.retry",
    "occurrences.purge",
    "tasks.read",
    "tasks.cancel",
    "tasks.purge",
    "dashboard.read",
    "static.read",
)
"""Every action the app asks ``authorize`` about."""

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

MAX_BODY_BYTES = 16 * 1024
"""The largest request body the app reads; a longer one is refused (413) as it streams in."""

_log = logging.getLogger("steeple.admin")
_DIGITS = re.compile(r"[0-9]+\Z")
_MAX_AGE_SECONDS = 100 * 365 * 86400
_MAX_DETAIL = 300


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


class _Refusal(Exception):
    def __init__(self, status: int, error: str, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.error = error
        self.detail = detail


def _json_error(status: int, error: str, detail: str) -> JSONResponse:
    # One line, bounded: a reason never echoes a hostile 10 KB value or a lone surrogate back.
    line = " ".join(detail.split()).encode("utf-8", "replace").decode("utf-8")
    if len(line) > _MAX_DETAIL:
        line = line[: _MAX_DETAIL - 3] + "..."
    return JSONResponse({"error": error, "detail": line}, status_code=status)


async def _http_error(request: Request, exc: Exception) -> Response:
    # Starlette's own refusals (no such route, method not allowed) answer like the app's.
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    error = {404: "not_found", 405: "method_not_allowed"}.get(status, "bad_request")
    reason = {404: "no such route", 405: "method not allowed"}.get(status, "bad request")
    response = _json_error(status, error, reason)
    if isinstance(exc, HTTPException) and exc.headers:
        response.headers.update(exc.headers)  # e.g. Allow on a 405
    return response


def _bad_request(detail: str) -> _Refusal:
    return _Refusal(400, "bad_request", detail)


def _invalid(detail: str) -> _Refusal:
    return _Refusal(422, "invalid", detail)


async def _read_body(request: Request, limit: int) -> bytes:
    """Read at most ``limit`` bytes of the body; refuse a longer one without reading it all."""
    declared = request.headers.get("content-length")
    if declared is not None:
        declared = declared.strip()
        if not _DIGITS.match(declared):
            raise _bad_request("the Content-Length header is not a whole number")
        if len(declared) > 12 or int(declared) > limit:
            raise _Refusal(413, "too_large", f"the body is over {limit} bytes")
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise _Refusal(413, "too_large", f"the body is over {limit} bytes")
    except ClientDisconnect:
        raise _bad_request("the client went away before sending the whole body") from None
    return bytes(body)


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"duplicate key {key!r}")
        result[key] = value
    return result


def _parse_json_object(raw: bytes) -> dict[str, Any]:
    """Parse a strict UTF-8 JSON object: no NaN/Infinity, no duplicate keys, bounded depth."""
    try:
        text = raw.decode("utf-8")
        body = json.loads(text, parse_constant=_refuse_constant, object_pairs_hook=_unique_keys)
    except RecursionError:
        raise _bad_request("the body is nested too deeply") from None
    except ValueError:  # includes UnicodeDecodeError and JSONDecodeError
        raise _bad_request("the body is not valid UTF-8 JSON") from None
    if not isinstance(body, dict):
        raise _bad_request("the body must be a JSON object")
    return body


def _fields(body: dict[str, Any], allowed: tuple[str, ...]) -> None:
    unknown = sorted(set(body) - set(allowed))
    if unknown:
        shown = ", ".join(repr(k[:40]) for k in unknown[:3])
        raise _bad_request(f"unknown field {shown}; this route takes {', '.join(allowed)}")


def _string_field(body: dict[str, Any], name: str) -> str:
    value = body.get(name)
    if not isinstance(value, str):
        raise _bad_request(f'give {{"{name}": "..."}} as a string')
    return value


def _int_field(body: dict[str, Any], name: str, default: int) -> int:
    value = body.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad_request(f"{name} must be a whole number")
    return value


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


def create_admin_app(
    *,
    authorize: Authorize | None,
    stores: StoreProvider | None = None,
    tasks: TaskProvider | None = None,
    csrf_token: str | None = None,
    now: Callable[[], datetime] | None = None,
) -> Starlette:
    """Build the admin app.

    Args:
        authorize: the host's ``authorize(request, action, namespace)``; ``None`` (or any
            answer but ``True``) refuses with 403. ``action`` is one of :data:`ACTIONS`.
        stores: returns the recurring store of a namespace (the host opens and closes it;
            the app never closes it). ``None``: recurring routes answer 404.
        tasks: returns the task access of a namespace. ``None``: task routes answer 404.
        csrf_token: the value state-changing requests must send in ``X-Steeple-CSRF``
            (at least 16 characters). ``None``: every state-changing request is refused.
        now: the clock for purge cutoffs (defaults to the system clock).

    Raises:
        ConfigurationError: a ``csrf_token`` shorter than 16 characters.
    """
    if csrf_token is not None and len(csrf_token) < 16:
        raise ConfigurationError("csrf_token must be at least 16 characters of random text")
    clock = now or (lambda: datetime.now(UTC))
    expected_token = None if csrf_token is None else csrf_token.encode("utf-8")

    async def gate(request: Request, action: str, namespace: str) -> None:
        # Refuse before looking at anything else: no callback means no access at all.
        if authorize is None:
            raise _Refusal(403, "forbidden", "this admin app has no authorize callback")
        if action != "static.read":
            try:
                validate_namespace(namespace)
            except ConfigurationError:
                raise _Refusal(404, "not_found", "no such namespace") from None
        allowed = await authorize(request, action, namespace)
        if allowed is not True:
            raise _Refusal(403, "forbidden", f"not allowed: {action}")

    async def json_body(request: Request) -> dict[str, Any]:
        if expected_token is None:
            raise _Refusal(403, "forbidden", "state-changing requests are disabled")
        presented = request.headers.get(CSRF_HEADER, "").encode("utf-8")
        if not hmac.compare_digest(presented, expected_token):
            raise _Refusal(403, "csrf", f"missing or wrong {CSRF_HEADER} header")
        media = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if media != "application/json":
            raise _Refusal(415, "unsupported_media_type", "send an application/json body")
        return _parse_json_object(await _read_body(request, MAX_BODY_BYTES))

    async def store_of(namespace: str) -> RecurringStore:
        if stores is None:
            raise _Refusal(404, "not_found", "recurring publications are not served here")
        try:
            return await stores(namespace)
        except LookupError:
            raise _Refusal(404, "not_found", "no such namespace") from None

    async def tasks_of(namespace: str) -> TaskAdmin:
        if tasks is None:
            raise _Refusal(404, "not_found", "tasks are not served here")
        try:
            return await tasks(namespace)
        except LookupError:
            raise _Refusal(404, "not_found", "no such namespace") from None

    def endpoint(
        action: str, handler: Callable[[Request, str], Awaitable[Response]]
    ) -> Callable[[Request], Awaitable[Response]]:
        async def run(request: Request) -> Response:
            namespace = str(request.path_params.get("namespace", ""))
            try:
                await gate(request, action, namespace)
                return await handler(request, namespace)
            except _Refusal as refusal:
                return _json_error(refusal.status, refusal.error, refusal.detail)
            except RecurringNotFoundError as exc:
                return _json_error(404, "not_found", str(exc))
            except RecurringInvalidStateError as exc:
                return _json_error(409, "invalid_state", str(exc))
            except ConfigurationError as exc:
                # The library's typed refusal of a value (the app validates first; a
                # provider or store may know more rules).
                return _json_error(422, "invalid", str(exc))
            except (RecurringStorageError, OSError, TimeoutError):
                return _json_error(503, "unavailable", "storage is unavailable; try again")
            except SteepleError as exc:
                return _json_error(409, "refused", str(exc))
            except Exception:
                # Answered here (not by Starlette's outer error handler) so that even a
                # failure carries the security headers; details go to the log only.
                _log.exception("admin %s on namespace %r failed", action, namespace)
                return _json_error(500, "internal", "internal error")

        return run

    # --- reads -------------------------------------------------------------------------

    async def list_schedules(request: Request, namespace: str) -> Response:
        after, limit = _paging(request)
        if after is not None:
            _valid(validate_definition_name, after, "invalid schedules cursor")
        page = await (await store_of(namespace)).schedules(after=after, limit=limit)
        return JSONResponse(
            {"items": [schedule_json(s) for s in page.items], "next_cursor": page.next_cursor}
        )

    async def list_occurrences(request: Request, namespace: str) -> Response:
        after, limit = _paging(request)
        if after is not None:
            _valid(parse_occurrence_cursor, after)
        page = await (await store_of(namespace)).occurrences(after=after, limit=limit)
        return JSONResponse(
            {"items": [occurrence_json(o) for o in page.items], "next_cursor": page.next_cursor}
        )

    async def list_tasks(request: Request, namespace: str) -> Response:
        after, limit = _paging(request)
        _valid(parse_task_cursor, after)
        state = request.query_params.get("state") or None
        if state is not None:
            _valid(validate_task_state, state)
        page = await (await tasks_of(namespace)).tasks(after=after, limit=limit, state=state)
        return JSONResponse(
            {"items": [t.to_json() for t in page.items], "next_cursor": page.next_cursor}
        )

    async def show_task(request: Request, namespace: str) -> Response:
        task_id = _path_task_id(str(request.path_params.get("task_id", "")))
        record = await (await tasks_of(namespace)).task(task_id)
        if record is None:
            return _json_error(404, "not_found", "no such task")
        return JSONResponse(record.to_json())

    # --- changes -----------------------------------------------------------------------

    async def cancel_schedule(request: Request, namespace: str) -> Response:
        body = await json_body(request)
        _fields(body, ("name",))
        name = _valid(validate_definition_name, _string_field(body, "name"))
        info = await (await store_of(namespace)).cancel(name)
        return JSONResponse(schedule_json(info))

    async def retry_occurrence(request: Request, namespace: str) -> Response:
        body = await json_body(request)
        _fields(body, ("occurrence_id",))
        occurrence_id = _valid(validate_occurrence_id, _string_field(body, "occurrence_id"))
        info = await (await store_of(namespace)).retry_failed(occurrence_id)
        return JSONResponse(occurrence_json(info))

    async def purge_occurrences(request: Request, namespace: str) -> Response:
        body = await json_body(request)
        older_than, limit = _purge_args(body, clock())
        removed = await (await store_of(namespace)).purge_terminal(older_than, limit)
        return JSONResponse({"purged": removed})

    async def cancel_task(request: Request, namespace: str) -> Response:
        body = await json_body(request)
        _fields(body, ("task_id",))
        task_id = _valid(validate_task_id, _int_field(body, "task_id", 0))
        state = await (await tasks_of(namespace)).cancel(task_id)
        if state is None:
            return _json_error(404, "not_found", "no such task")
        if state != "cancelled":
            return _json_error(409, "invalid_state", f"the task already finished ({state})")
        return JSONResponse({"task_id": task_id, "state": state})

    async def purge_tasks(request: Request, namespace: str) -> Response:
        body = await json_body(request)
        older_than, limit = _purge_args(body, clock())
        removed = await (await tasks_of(namespace)).prune(older_than, limit)
        return JSONResponse({"purged": removed})

    # --- dashboard ---------------------------------------------------------------------

    async def dashboard(request: Request, namespace: str) -> Response:
        sections: list[str] = []
        actions = csrf_token is not None
        if stores is not None:
            store = await store_of(namespace)
            schedules = (await store.schedules(limit=100)).items
            occurrences = (await store.occurrences(limit=100)).items
            sections.append(_schedules_table(schedules, actions))
            sections.append(_occurrences_table(occurrences, actions))
        if tasks is not None:
            try:
                records = (await (await tasks_of(namespace)).tasks(limit=100)).items
            except SteepleError as exc:
                # e.g. the queue schema is not migrated: the rest of the page still helps.
                sections.append(
                    f'<section id="task"><h2>Tasks</h2><p class="unavailable">'
                    f"unavailable: {html.escape(str(exc))}</p></section>"
                )
            else:
                sections.append(_tasks_table(records, actions))
        return HTMLResponse(_page(namespace, sections, csrf_token))

    async def stylesheet(request: Request, namespace: str) -> Response:
        css = resources.files("steeple.admin").joinpath("static/admin.css").read_text("utf-8")
        return Response(css, media_type="text/css")

    async def script(request: Request, namespace: str) -> Response:
        js = resources.files("steeple.admin").joinpath("static/admin.js").read_text("utf-8")
        return Response(js, media_type="text/javascript")

    routes = [
        Route("/api/{namespace}/schedules", endpoint("schedules.read", list_schedules)),
        Route("/api/{namespace}/occurrences", endpoint("occurrences.read", list_occurrences)),
        Route("/api/{namespace}/tasks", endpoint("tasks.read", list_tasks)),
        Route("/api/{namespace}/tasks/{task_id}", endpoint("tasks.read", show_task)),
        Route(
            "/api/{namespace}/schedules/cancel",
            endpoint("schedules.cancel", cancel_schedule),
            methods=["POST"],
        ),
        Route(
            "/api/{namespace}/occurrences/retry",
            endpoint("occurrences.retry", retry_occurrence),
            methods=["POST"],
        ),
        Route(
            "/api/{namespace}/occurrences/purge",
            endpoint("occurrences.purge", purge_occurrences),
            methods=["POST"],
        ),
        Route(
            "/api/{namespace}/tasks/cancel", endpoint("tasks.cancel", cancel_task), methods=["POST"]
        ),
        Route(
            "/api/{namespace}/tasks/purge", endpoint("tasks.purge", purge_tasks), methods=["POST"]
        ),
        Route("/ui/{namespace}", endpoint("dashboard.read", dashboard)),
        Route("/static/admin.css", endpoint("static.read", stylesheet)),
        Route("/static/admin.js", endpoint("static.read", script)),
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: _http_error})
    app.router.redirect_slashes = False  # "/tasks/" names no task: 404, not a redirect
    app.add_middleware(_SecurityHeaders)
    return app


T = TypeVar("T")


def _valid(check: Callable[[Any], T], value: object, reason: str | None = None) -> T:
    """Run one of the library's validators; its typed refusal becomes a 422."""
    try:
        return check(value)
    except ConfigurationError as exc:
        raise _invalid(reason or str(exc)) from None


def _paging(request: Request) -> tuple[str | None, int]:
    after = request.query_params.get("after") or None
    raw = request.query_params.get("limit")
    if raw is None:
        return after, 100
    if not _DIGITS.match(raw):
        raise _bad_request("limit must be a whole number from 1 to 100")
    # Never int() a long digit string: it is out of range whatever it says.
    return after, _valid(validate_budget, int(raw) if len(raw) <= 3 else 0, "limit must be 1-100")


def _path_task_id(raw: str) -> int:
    if not _DIGITS.match(raw):
        raise _bad_request("a task id is a whole number")
    return _valid(validate_task_id, int(raw) if len(raw) <= 19 else 0)


def _purge_args(body: dict[str, Any], now: datetime) -> tuple[datetime, int]:
    _fields(body, ("older_than_seconds", "limit"))
    seconds = _int_field(body, "older_than_seconds", 7 * 86400)
    limit = _valid(validate_budget, _int_field(body, "limit", 100))
    if not 0 <= seconds <= _MAX_AGE_SECONDS:
        raise _invalid(f"older_than_seconds must be from 0 to {_MAX_AGE_SECONDS}")
    return now - timedelta(seconds=seconds), limit


# --- HTML (escaped text only; no inline script or style: the CSP forbids them) ------------


@attrs.frozen
class _Button:
    """An operator action in a dashboard row (wired by the app's own admin.js)."""

    action: str
    body: dict[str, Any]
    label: str
    confirm: str


def _cell(value: object) -> str:
    if isinstance(value, _Button):
        return (
            '<td><button type="button" class="act" '
            f'data-action="{html.escape(value.action)}" '
            f'data-body="{html.escape(json.dumps(value.body))}" '
            f'data-confirm="{html.escape(value.confirm)}">{html.escape(value.label)}</button>'
            "</td>"
        )
    if value is None:
        return '<td class="none">-</td>'
    if isinstance(value, datetime):
        value = value.strftime("%Y-%m-%d %H:%M:%S")
    return f"<td>{html.escape(str(value))}</td>"


def _table(title: str, kind: str, headings: Sequence[str], rows: list[list[object]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headings)
    if rows:
        body = "".join(
            f'<tr class="row {kind}">' + "".join(_cell(v) for v in row) + "</tr>" for row in rows
        )
    else:
        body = f'<tr><td class="empty" colspan="{len(headings)}">none</td></tr>'
    return (
        f'<section id="{kind}"><h2>{html.escape(title)} <span class="count">'
        f"{len(rows)}</span></h2><table><thead><tr>{head}</tr></thead>"
        f"<tbody>{body}</tbody></table></section>"
    )


def _with_actions(
    headings: list[str], rows: list[list[object]], buttons: list[_Button | None], enabled: bool
) -> tuple[list[str], list[list[object]]]:
    if not enabled:
        return headings, rows
    return [*headings, "action"], [
        [*row, button] for row, button in zip(rows, buttons, strict=True)
    ]


def _schedules_table(items: Sequence[ScheduleInfo], actions: bool = False) -> str:
    headings, rows = _with_actions(
        ["name", "cron", "policy", "state", "topic", "next due"],
        [[s.name, s.cron, s.policy.value, s.state, s.topic, s.next_due_at] for s in items],
        [
            _Button(
                "schedules/cancel",
                {"name": s.name},
                "cancel",
                f"Cancel {s.name} for good? Its name stays reserved.",
            )
            if s.state == "active"
            else None
            for s in items
        ],
        actions,
    )
    return _table("Recurring publications", "schedule", headings, rows)


def _occurrences_table(items: Sequence[OccurrenceInfo], actions: bool = False) -> str:
    headings, rows = _with_actions(
        ["id", "definition", "due", "state", "attempts", "last error"],
        [
            [o.occurrence_id, o.definition_name, o.due_at, o.state.value, o.attempts, o.last_error]
            for o in items
        ],
        [
            _Button(
                "occurrences/retry",
                {"occurrence_id": o.occurrence_id},
                "retry",
                f"Retry dead occurrence {o.occurrence_id}?",
            )
            if o.state.value == "dead"
            else None
            for o in items
        ],
        actions,
    )
    return _table("Occurrences", "occurrence", headings, rows)


def _progress(task: TaskRecord) -> str:
    if task.progress is None:
        return ""
    shown = f"{task.progress:.0%}"
    return shown if task.progress_message is None else f"{shown} {task.progress_message}"


def _tasks_table(items: Sequence[TaskRecord], actions: bool = False) -> str:
    headings, rows = _with_actions(
        ["id", "name", "state", "attempts", "progress", "run at", "last error"],
        [
            [
                t.task_id,
                t.name,
                t.state,
                f"{t.attempts}/{t.max_attempts}",
                _progress(t),
                t.run_at,
                t.last_error,
            ]
            for t in items
        ],
        [
            _Button("tasks/cancel", {"task_id": t.task_id}, "cancel", f"Cancel task {t.task_id}?")
            if t.state in ("pending", "running")
            else None
            for t in items
        ],
        actions,
    )
    return _table("Tasks", "task", headings, rows)


def _page(namespace: str, sections: list[str], csrf_token: str | None) -> str:
    ns = html.escape(namespace)
    # With state changes enabled, the page carries the CSRF token for its own script (the
    # synchronizer-token pattern); other origins cannot read the page, so cannot learn it.
    script = (
        ""
        if csrf_token is None
        else (
            f'<meta name="steeple-csrf" content="{html.escape(csrf_token)}">'
            '<script src="../static/admin.js" defer></script>'
        )
    )
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        f"<title>steeple · {ns}</title>"
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f'<link rel="stylesheet" href="../static/admin.css">{script}</head>'
        f'<body data-namespace="{ns}">'
        f"<header><h1>steeple</h1><p>namespace <strong>{ns}</strong></p></header><main>"
        + "".join(sections)
        + "</main></body></html>"
    )
