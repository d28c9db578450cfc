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

import hmac
import json
import logging
import re
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from importlib import resources
from typing import Any, Final, TypeVar

import attrs
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from steeple.admin import _pages
from steeple.admin.tasks import (
    TaskAdmin,
    TaskFilter,
    TaskRecord,
    parse_task_cursor,
    validate_task_id,
    validate_task_state,
)
from steeple.core.config import validate_definition_name, validate_namespace
from steeple.core.errors import (
    ConfigurationError,
    RecurringInvalidStateError,
    RecurringStorageError,
    SteepleError,
)
from steeple.core.names import check_name
from steeple.core.occurrences import OccurrenceState
from steeple.core.policies import validate_budget
from steeple.core.ports import RecurringStore
from steeple.core.records import (
    OccurrenceInfo,
    ScheduleInfo,
    occurrence_cursor,
    parse_occurrence_cursor,
    validate_occurrence_id,
)

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
    clock = now or (lambda: datetime.now(UTC))
    expected_token = None if csrf_token is None else csrf_token.encode("utf-8")
    revealable: Callable[[str], bool] = (
        reveal_args if callable(reveal_args) else frozenset(reveal_args).__contains__
    )
    homes = tuple(namespaces)
    actions_enabled = csrf_token is not None

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

    async def may(request: Request, action: str, namespace: str) -> bool:
        """Whether ``authorize`` allows ``action`` too (for a part of a page or answer)."""
        try:
            await gate(request, action, namespace)
        except _Refusal:
            return False
        return True

    async def visible(request: Request, namespace: str, record: TaskRecord) -> TaskRecord:
        """Withhold ``record``'s result from a caller not allowed ``tasks.results``."""
        if record.result is None or await may(request, "tasks.results", namespace):
            return record
        return attrs.evolve(record, result=None)

    async def searchable(request: Request, namespace: str, where: TaskFilter) -> TaskFilter:
        """Refuse a search by args unless its task name is opted in and ``tasks.args`` allowed."""
        if where.args is None:
            return where
        if where.name is None or not revealable(where.name):
            raise _Refusal(
                403,
                "forbidden",
                "a search by args needs a task name whose args this dashboard may show "
                "(the host opts names in: reveal_args, or steeple admin serve --show-args)",
            )
        await gate(request, "tasks.args", namespace)
        return where

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

    async def known(namespace: str) -> None:
        """Refuse a namespace no provider serves (a page must not look empty instead)."""
        for provider in (stores, tasks):
            if provider is None:
                continue
            try:
                await provider(namespace)
            except LookupError:
                raise _Refusal(404, "not_found", f"no such namespace: {namespace}") from None
            return
        raise _Refusal(404, "not_found", "this app serves neither tasks nor publications")

    def endpoint(
        action: str, handler: Callable[[Request, str], Awaitable[Response]], page: bool = False
    ) -> Callable[[Request], Awaitable[Response]]:
        async def run(request: Request) -> Response:
            namespace = str(request.path_params.get("namespace", ""))
            refusal: tuple[int, str, str]
            try:
                await gate(request, action, namespace)
                return await handler(request, namespace)
            except _Refusal as exc:
                refusal = (exc.status, exc.error, exc.detail)
            except RecurringInvalidStateError as exc:
                refusal = (409, "invalid_state", str(exc))
            except ConfigurationError as exc:
                # The library's typed refusal of a value (the app validates first; a
                # provider or store may know more rules).
                refusal = (422, "invalid", str(exc))
            except (RecurringStorageError, OSError, TimeoutError):
                refusal = (503, "unavailable", "storage is unavailable; try again")
            except SteepleError as exc:
                # No such task, job, schedule or occurrence is a 404; the rest a refusal.
                found = not isinstance(exc, LookupError)
                refusal = (409, "refused", str(exc)) if found else (404, "not_found", str(exc))
            except Exception:
                # Answered here (not by Starlette's outer error handler) so that even a
                # failure carries the security headers; details go to the log only.
                _log.exception("admin %s on namespace %r failed", action, namespace)
                refusal = (500, "internal", "internal error")
            if page and request.query_params.get("live") != "1":
                return _html_error(request, *refusal, homes=homes)
            return _json_error(*refusal)

        return run

    def links_of(request: Request, namespace: str) -> _pages.Links:
        return _pages.Links(str(request.scope.get("root_path", "")).rstrip("/"), namespace)

    def render(
        request: Request,
        namespace: str,
        title: str,
        current: str,
        sections: list[_pages.Section],
    ) -> Response:
        if request.query_params.get("live") == "1":
            return JSONResponse({**_pages.live_json(sections), "at": clock().isoformat()})
        modes = " + ".join(
            label
            for label, provider in (("work queue", tasks), ("recurring publications", stores))
            if provider is not None
        )
        if stores is None:
            modes += " (queue-only mode)"
        return HTMLResponse(
            _pages.page(
                links_of(request, namespace),
                title,
                current,
                sections,
                csrf_token=csrf_token,
                refresh_seconds=refresh_seconds,
                modes=modes,
            )
        )

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
        where = await searchable(request, namespace, _task_filter(request.query_params))
        newest = _flag(request.query_params.get("newest"), "newest")
        page = await (await tasks_of(namespace)).tasks(
            after=after, limit=limit, where=where, newest_first=newest
        )
        return JSONResponse(
            {"items": [t.to_json() for t in page.items], "next_cursor": page.next_cursor}
        )

    async def show_task(request: Request, namespace: str) -> Response:
        task_id = _path_task_id(str(request.path_params.get("task_id", "")))
        record = await (await tasks_of(namespace)).task(task_id)
        if record is None:
            return _json_error(404, "not_found", "no such task")
        shown = await visible(request, namespace, record)
        return JSONResponse({**shown.to_json(), "result_withheld": shown is not record})

    async def task_attempts(request: Request, namespace: str) -> Response:
        task_id = _path_task_id(str(request.path_params.get("task_id", "")))
        admin = await tasks_of(namespace)
        if await admin.task(task_id) is None:
            return _json_error(404, "not_found", "no such task")
        return JSONResponse({"items": [a.to_json() for a in await admin.attempts(task_id)]})

    async def task_args(request: Request, namespace: str) -> Response:
        task_id = _path_task_id(str(request.path_params.get("task_id", "")))
        admin = await tasks_of(namespace)
        record = await admin.task(task_id)
        if record is None:
            return _json_error(404, "not_found", "no such task")
        if not revealable(record.name):
            raise _Refusal(403, "forbidden", f"the args of {record.name} tasks are not shown")
        stored = await admin.args(task_id)
        if stored is None:
            return _json_error(404, "not_found", "no such task")
        return JSONResponse({"task_id": task_id, "args": json.loads(stored)})

    async def overview_json(request: Request, namespace: str) -> Response:
        return JSONResponse((await (await tasks_of(namespace)).overview()).to_json())

    async def list_queues(request: Request, namespace: str) -> Response:
        overview = await (await tasks_of(namespace)).overview()
        return JSONResponse({"items": [q.to_json() for q in overview.queues]})

    def pause_queue(paused: bool) -> Callable[[Request, str], Awaitable[Response]]:
        async def handler(request: Request, namespace: str) -> Response:
            body = await json_body(request)
            _fields(body, ("queue",))
            name = _name(_string_field(body, "queue"), "queue")
            record = await (await tasks_of(namespace)).pause_queue(name, paused)
            return JSONResponse(record.to_json())

        return handler

    async def list_jobs(request: Request, namespace: str) -> Response:
        after, limit = _paging(request)
        page = await (await tasks_of(namespace)).jobs(after=after, limit=limit)
        return JSONResponse(
            {"items": [j.to_json() for j in page.items], "next_cursor": page.next_cursor}
        )

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

    async def retry_task(request: Request, namespace: str) -> Response:
        body = await json_body(request)
        _fields(body, ("task_id",))
        task_id = _valid(validate_task_id, _int_field(body, "task_id", 0))
        record = await (await tasks_of(namespace)).retry(task_id)
        if record is None:
            return _json_error(404, "not_found", "no such task")
        return JSONResponse(record.to_json())

    async def purge_tasks(request: Request, namespace: str) -> Response:
        body = await json_body(request)
        older_than, limit = _purge_args(body, clock())
        removed = await (await tasks_of(namespace)).prune(older_than, limit)
        return JSONResponse({"purged": removed})

    def bulk(verb: str) -> Callable[[Request, str], Awaitable[Response]]:
        # Two steps, so an operator confirms exactly what is acted on: without task_ids the
        # answer lists the matching tasks this action applies to (at most BULK_LIMIT) and
        # changes nothing; with task_ids it acts on those ids only (each still checked by
        # the queue: a task that finished or was retried meanwhile is reported, not forced).
        states = _pages.LIVE_TASK_STATES if verb == "cancel" else ("failed",)

        async def handler(request: Request, namespace: str) -> Response:
            body = await json_body(request)
            _fields(body, ("state", "name", "since", "until", "queue", "args", "task_ids"))
            admin = await tasks_of(namespace)
            if "task_ids" not in body:
                where = _task_filter(
                    {k: v for k, v in body.items() if isinstance(v, str)}, strict=body
                )
                where = await searchable(request, namespace, where)
                if where.state is not None and where.state not in states:
                    return JSONResponse({"task_ids": [], "more": False})
                found: list[int] = []
                more = False
                for state in [where.state] if where.state else list(states):
                    page = await admin.tasks(
                        limit=BULK_LIMIT, where=attrs.evolve(where, state=state)
                    )
                    found += [t.task_id for t in page.items]
                    more = more or page.next_cursor is not None
                more = more or len(found) > BULK_LIMIT
                return JSONResponse({"task_ids": sorted(found)[:BULK_LIMIT], "more": more})
            if len(body) != 1:
                raise _bad_request("send task_ids alone (the confirmed ids), or only a filter")
            chosen = _task_ids(body["task_ids"])
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

    async def create_job(request: Request, namespace: str) -> Response:
        body = await json_body(request)
        _fields(body, ("name", "task", "cron", "timezone", "args", "queue"))
        if "args" not in body:
            raise _bad_request('give the job\'s "args" (any JSON value, e.g. {})')
        timezone = body.get("timezone", "UTC")
        if not isinstance(timezone, str):
            raise _bad_request("timezone must be a string (an IANA name such as UTC)")
        queue = body.get("queue", "default")
        if not isinstance(queue, str):
            raise _bad_request("queue must be a string (the named queue its runs wait in)")
        job = await (await tasks_of(namespace)).create_job(
            _name(_string_field(body, "name"), "job name"),
            _name(_string_field(body, "task"), "task"),
            _string_field(body, "cron"),
            body["args"],
            timezone or "UTC",
            queue or "default",
        )
        return JSONResponse(job.to_json())

    def change_job(verb: str) -> Callable[[Request, str], Awaitable[Response]]:
        async def handler(request: Request, namespace: str) -> Response:
            body = await json_body(request)
            allowed = ("name", "cron", "timezone") if verb == "reschedule" else ("name",)
            _fields(body, allowed)
            cron = _string_field(body, "cron") if verb == "reschedule" else None
            timezone = body.get("timezone") or None
            if timezone is not None and not isinstance(timezone, str):
                raise _bad_request("timezone must be a string (an IANA name such as UTC)")
            job = await (await tasks_of(namespace)).change_job(
                verb, _name(_string_field(body, "name"), "job name"), cron, timezone
            )
            return JSONResponse({"deleted": True} if job is None else job.to_json())

        return handler

    # --- dashboard ---------------------------------------------------------------------

    async def overview_page(request: Request, namespace: str) -> Response:
        await known(namespace)
        links = links_of(request, namespace)
        sections: list[_pages.Section] = []
        if tasks is not None and not await may(request, "tasks.read", namespace):
            sections.append(_pages.Section("counts", _pages.withheld("Tasks", "tasks.read"), True))
        elif tasks is not None:
            try:
                overview = await (await tasks_of(namespace)).overview()
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
                if await may(request, "queues.read", namespace):
                    queues = _pages.queues_section(links, overview.queues, actions_enabled)
                else:
                    queues = _pages.withheld("Queues", "queues.read")
                sections.append(_pages.Section("queues", queues, live=True))
        if stores is not None and not await may(request, "schedules.read", namespace):
            withheld = _pages.withheld("Publications", "schedules.read")
            sections.append(_pages.Section("schedules", withheld, live=True))
        elif stores is not None:
            store = await store_of(namespace)
            schedules = (await store.schedules(limit=100)).items
            sections.append(
                _pages.Section(
                    "schedules", _pages.schedules_table(schedules, actions_enabled), live=True
                )
            )
        return render(request, namespace, "Overview", "overview", sections)

    async def tasks_page(request: Request, namespace: str) -> Response:
        params = request.query_params
        links = links_of(request, namespace)
        raw_id = (params.get("id") or "").strip()
        if raw_id:
            return RedirectResponse(links.task(_path_task_id(raw_id)), status_code=303)
        where = _task_filter(params)
        after = params.get("after") or None
        _valid(parse_task_cursor, after)
        await gate(request, "tasks.read", namespace)
        where = await searchable(request, namespace, where)
        admin = await tasks_of(namespace)
        try:
            page = await admin.tasks(after=after, limit=PAGE_SIZE, where=where, newest_first=True)
        except SteepleError as exc:
            if isinstance(exc, ConfigurationError):
                raise
            listing = _pages.Section("tasks", _pages.unavailable("Tasks", str(exc)), live=True)
            return render(request, namespace, "Tasks", "tasks", [listing])
        sections = [
            _pages.Section("filters", _pages.filter_form(links, where)),
            _pages.Section(
                "tasks",
                _pages.heading("Tasks", len(page.items), "newest first; times UTC")
                + (_pages.bulk_bar(where, BULK_LIMIT) if actions_enabled else "")
                + _pages.tasks_table(links, page.items, actions_enabled)
                + _pages.pager(links, where, after, page.next_cursor),
                live=True,
            ),
        ]
        return render(request, namespace, "Tasks", "tasks", sections)

    async def task_page(request: Request, namespace: str) -> Response:
        task_id = _path_task_id(str(request.path_params.get("task_id", "")))
        await gate(request, "tasks.read", namespace)
        admin = await tasks_of(namespace)
        record = await admin.task(task_id)
        if record is None:
            raise _Refusal(404, "not_found", f"no task {task_id} (it may have been purged)")
        attempts = await admin.attempts(task_id)
        shown = await visible(request, namespace, record)
        result = _pages.result_section(shown, withheld=shown is not record)
        sections = [
            _pages.Section("task", _pages.task_detail(record, actions_enabled), live=True),
            _pages.Section("result", result, live=True),
            _pages.Section("attempts", _pages.attempts_table(attempts), live=True),
            _pages.Section("args", _pages.args_section(record, revealable(record.name))),
        ]
        return render(request, namespace, f"Task {task_id}", "tasks", sections)

    async def jobs_page(request: Request, namespace: str) -> Response:
        await gate(request, "jobs.read", namespace)
        admin = await tasks_of(namespace)
        try:
            jobs = (await admin.jobs(limit=100)).items
        except SteepleError as exc:
            listing = _pages.Section("jobs", _pages.unavailable("Recurring jobs", str(exc)), True)
            return render(request, namespace, "Recurring jobs", "jobs", [listing])
        links = links_of(request, namespace)
        table = _pages.jobs_table(links, jobs, actions_enabled)
        sections = [_pages.Section("jobs", table, live=True)]
        if actions_enabled:
            sections.append(_pages.Section("new-job", _pages.job_form()))
        return render(request, namespace, "Recurring jobs", "jobs", sections)

    async def schedules_page(request: Request, namespace: str) -> Response:
        if stores is None:
            await known(namespace)
            note = (
                '<p class="note" id="queue-only">queue-only mode: recurring publications are '
                "not served here (start <code>steeple admin serve</code> with storage keys "
                "for an initialized namespace)</p>"
            )
            sections = [_pages.Section("schedules", _pages.heading("Publications") + note)]
            return render(request, namespace, "Recurring publications", "publications", sections)
        await gate(request, "schedules.read", namespace)
        await gate(request, "occurrences.read", namespace)
        store = await store_of(namespace)
        params = request.query_params
        shown = _occurrence_filter(params, clock())
        after = params.get("after") or None
        if after is not None:
            _valid(parse_occurrence_cursor, after)
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
        links = links_of(request, namespace)
        sections = [
            _pages.Section(
                "schedules",
                _pages.schedules_table(schedules, actions_enabled, title="Definitions"),
                live=True,
            ),
            _pages.Section("occurrence-filters", _pages.occurrence_filter_form(links, shown)),
            _pages.Section(
                "occurrences",
                _pages.occurrences_table(found, actions_enabled, BULK_LIMIT, shown)
                + _pages.occurrence_pager(links, shown, after, position),
                live=True,
            ),
        ]
        return render(request, namespace, "Recurring publications", "publications", sections)

    async def stylesheet(request: Request, namespace: str) -> Response:
        css = resources.files("steeple.admin").joinpath("static/admin.css").read_text("utf-8")
        return Response(css, media_type="text/css")

    async def script(request: Request, namespace: str) -> Response:
        js = resources.files("steeple.admin").joinpath("static/admin.js").read_text("utf-8")
        return Response(js, media_type="text/javascript")

    async def home(request: Request) -> Response:
        # A person opening the app's root wants the dashboard, not a JSON refusal.
        root = str(request.scope.get("root_path", "")).rstrip("/")
        if homes:
            return RedirectResponse(f"{root}/ui/{homes[0]}", status_code=307)
        return _html_error(
            request, 404, "", "open /ui/NAMESPACE for a namespace's dashboard", homes=homes
        )

    def post(
        path: str, action: str, handler: Callable[[Request, str], Awaitable[Response]]
    ) -> Route:
        return Route(f"/api/{{namespace}}/{path}", endpoint(action, handler), methods=["POST"])

    routes = [
        Route("/", home),
        Route("/ui", home),
        Route("/ui/", home),
        Route("/api/{namespace}/schedules", endpoint("schedules.read", list_schedules)),
        Route("/api/{namespace}/occurrences", endpoint("occurrences.read", list_occurrences)),
        Route("/api/{namespace}/tasks", endpoint("tasks.read", list_tasks)),
        Route("/api/{namespace}/overview", endpoint("tasks.read", overview_json)),
        Route("/api/{namespace}/jobs", endpoint("jobs.read", list_jobs)),
        Route("/api/{namespace}/queues", endpoint("queues.read", list_queues)),
        post("schedules/cancel", "schedules.cancel", cancel_schedule),
        post("occurrences/retry", "occurrences.retry", retry_occurrence),
        post("occurrences/purge", "occurrences.purge", purge_occurrences),
        post("tasks/cancel", "tasks.cancel", cancel_task),
        post("tasks/retry", "tasks.retry", retry_task),
        post("tasks/purge", "tasks.purge", purge_tasks),
        post("tasks/bulk-cancel", "tasks.cancel", bulk("cancel")),
        post("tasks/bulk-retry", "tasks.retry", bulk("retry")),
        post("jobs/create", "jobs.create", create_job),
        post("queues/pause", "queues.pause", pause_queue(True)),
        post("queues/resume", "queues.resume", pause_queue(False)),
        post("jobs/pause", "jobs.pause", change_job("pause")),
        post("jobs/resume", "jobs.resume", change_job("resume")),
        post("jobs/reschedule", "jobs.reschedule", change_job("reschedule")),
        post("jobs/delete", "jobs.delete", change_job("delete")),
        Route("/api/{namespace}/tasks/{task_id}", endpoint("tasks.read", show_task)),
        Route("/api/{namespace}/tasks/{task_id}/attempts", endpoint("tasks.read", task_attempts)),
        Route("/api/{namespace}/tasks/{task_id}/args", endpoint("tasks.args", task_args)),
        Route("/ui/{namespace}", endpoint("dashboard.read", overview_page, page=True)),
        Route("/ui/{namespace}/tasks", endpoint("dashboard.read", tasks_page, page=True)),
        Route("/ui/{namespace}/tasks/{task_id}", endpoint("dashboard.read", task_page, page=True)),
        Route("/ui/{namespace}/jobs", endpoint("dashboard.read", jobs_page, page=True)),
        Route("/ui/{namespace}/schedules", endpoint("dashboard.read", schedules_page, page=True)),
        Route("/static/admin.css", endpoint("static.read", stylesheet)),
        Route("/static/admin.js", endpoint("static.read", script)),
    ]

    async def not_found(request: Request, exc: Exception) -> Response:
        if request.url.path.startswith("/ui/") and request.query_params.get("live") != "1":
            status = exc.status_code if isinstance(exc, HTTPException) else 500
            detail = "no such page" if status == 404 else "this page cannot answer that"
            return _html_error(request, status, "", detail, homes=homes)
        return await _http_error(request, exc)

    app = Starlette(routes=routes, exception_handlers={HTTPException: not_found})
    app.router.redirect_slashes = False  # "/tasks/" names no task: 404, not a redirect
    app.add_middleware(_SecurityHeaders)
    return app


T = TypeVar("T")

PAGE_SIZE: Final = 50
"""Tasks per page of the dashboard's task list."""
OCCURRENCE_SCAN: Final = 1000
"""The most occurrences the publications page reads for one filtered page."""
BULK_LIMIT: Final = 100
"""The most tasks one bulk cancel or retry acts on (the operator confirms each batch)."""
_ERROR_TITLES: Final = {
    400: "Bad request",
    401: "Sign in first",
    403: "Not allowed",
    404: "Not found",
    405: "Not allowed",
    409: "Refused",
    413: "Too large",
    415: "Unsupported",
    422: "Invalid request",
    500: "Something went wrong",
    503: "Storage unavailable",
}
_MAX_INSTANT_TEXT: Final = 40


def _html_error(
    request: Request, status: int, error: str, detail: str, *, homes: Sequence[str]
) -> HTMLResponse:
    """Answer a browser's page request with a friendly error page, not the JSON refusal."""
    line = " ".join(detail.split()).encode("utf-8", "replace").decode("utf-8")[:_MAX_DETAIL]
    root = str(request.scope.get("root_path", "")).rstrip("/")
    title = _ERROR_TITLES.get(status, "Refused")
    return HTMLResponse(_pages.error_page(status, title, line, root, homes), status_code=status)


def _valid(check: Callable[[Any], T], value: object, reason: str | None = None) -> T:
    """Run one of the library's validators; its typed refusal becomes a 422."""
    try:
        return check(value)
    except ConfigurationError as exc:
        raise _invalid(reason or str(exc)) from None


def _name(value: str, what: str) -> str:
    """Require a valid name by the library's one rule, exactly as given; else a 422."""
    return _valid(lambda v: check_name(v, what), value)


def _flag(raw: str | None, name: str) -> bool:
    if raw in (None, "", "0", "false"):
        return False
    if raw in ("1", "true"):
        return True
    raise _invalid(f"{name} is 1 or 0")


def _instant(raw: str, name: str) -> datetime:
    """Parse an instant an operator typed; one without an offset is UTC (the page says so)."""
    text = raw.strip()
    if len(text) > _MAX_INSTANT_TEXT:
        raise _invalid(f"{name} is too long for an instant (e.g. 2026-12-01 08:30)")
    try:
        value = datetime.fromisoformat(text.replace("Z", "+00:00"))
        # In UTC at once: an offset may carry an instant out of the calendar's range.
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
    except ValueError:
        raise _invalid(f"{name} is not an instant: write it like 2026-12-01 08:30 (UTC)") from None
    except OverflowError:
        raise _invalid(f"{name} is out of range: write it like 2026-12-01 08:30 (UTC)") from None


def _task_filter(params: Mapping[str, Any], strict: Mapping[str, Any] | None = None) -> TaskFilter:
    """Read a task filter from query parameters (or a JSON body: ``strict`` checks types).

    Names are used exactly as given (never trimmed: a filter on ``" mail"`` must not act on
    ``"mail"``) and refused (422, one line) unless valid by the library's one name rule;
    an empty field (as an HTML form sends an unset filter) selects every task.
    """
    if strict is not None:
        for key in ("state", "name", "since", "until", "queue", "args"):
            if key in strict and not isinstance(strict[key], str):
                raise _bad_request(f"{key} must be a string")
            if key in strict and not strict[key].strip():
                raise _invalid(f"{key} is empty: leave it out to select every task")
    state = params.get("state") or None
    if state is not None:
        _valid(validate_task_state, state)
    name = params.get("name") or None
    queue = params.get("queue") or None
    since = params.get("since") or None
    until = params.get("until") or None
    args = params.get("args") or None
    return TaskFilter(
        args=None if args is None or not args.strip() else _args_pattern(args),
        state=state,
        name=None if name is None else _name(name, "name (a task name)"),
        queue=None if queue is None else _name(queue, "queue"),
        since=None if since is None or not since.strip() else _instant(since, "since"),
        until=None if until is None or not until.strip() else _instant(until, "until"),
    )


def _args_pattern(raw: str) -> str:
    """Read an args search: a JSON object the args contain, as canonical JSON text."""
    if len(raw) > 2000:
        raise _invalid("args is over 2000 characters")
    try:
        value = json.loads(raw, parse_constant=_refuse_constant)
    except (ValueError, RecursionError):
        raise _invalid("""args is not JSON: write it like {"to": "ada@example.com"}""") from None
    if not isinstance(value, dict) or not value:
        raise _invalid(
            """args is a JSON object of keys and values, like {"to": "ada@example.com"}"""
        )
    return json.dumps(value, sort_keys=True, ensure_ascii=False)


def _occurrence_filter(params: Mapping[str, Any], now: datetime) -> _pages.OccurrenceFilter:
    """Read the publications page's filter: state, definition, due from (default: a day ago)."""
    state = (params.get("state") or "").strip() or None
    if state is not None and state not in {s.value for s in OccurrenceState}:
        states = ", ".join(s.value for s in OccurrenceState)
        raise _invalid(f"state is one of {states}")
    name = (params.get("definition") or "").strip() or None
    if name is not None:
        _valid(validate_definition_name, name)
    raw = params.get("from")
    if raw is None:
        since: datetime | None = now - timedelta(days=1)
    elif raw.strip():
        since = _instant(raw, "from")
    else:
        since = None  # cleared: from the first occurrence
    return _pages.OccurrenceFilter(state=state, definition=name, since=since)


def _task_ids(value: object) -> list[int]:
    if not isinstance(value, list) or not value:
        raise _bad_request("task_ids must be a non-empty list of task ids")
    if len(value) > BULK_LIMIT:
        raise _invalid(f"at most {BULK_LIMIT} task ids at a time")
    return sorted({_valid(validate_task_id, v) for v in value})


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
    _fields(body, ("older_than_seconds", "older_than_days", "limit"))
    if "older_than_days" in body:
        if "older_than_seconds" in body:
            raise _bad_request("give older_than_seconds or older_than_days, not both")
        days = body["older_than_days"]
        if isinstance(days, bool) or not isinstance(days, int):
            raise _bad_request("older_than_days must be a whole number")
        if not 0 <= days <= _MAX_AGE_SECONDS // 86400:
            raise _invalid(f"older_than_days must be from 0 to {_MAX_AGE_SECONDS // 86400}")
        seconds = days * 86400
    else:
        seconds = _int_field(body, "older_than_seconds", 7 * 86400)
    limit = _valid(validate_budget, _int_field(body, "limit", 100))
    if not 0 <= seconds <= _MAX_AGE_SECONDS:
        raise _invalid(f"older_than_seconds must be from 0 to {_MAX_AGE_SECONDS}")
    return now - timedelta(seconds=seconds), limit
