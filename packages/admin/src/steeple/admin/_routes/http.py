"""The admin app's request and answer rules: refusals, strict bodies, query and field parsing.

Every malformed request is refused here, before anything reaches storage, with a typed
:class:`Refusal` that the route wrapper answers as one line of JSON (or an error page).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, Final, TypeVar

from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import HTMLResponse, JSONResponse, Response

from steeple.admin import _pages
from steeple.admin.tasks import TaskFilter, validate_task_id, validate_task_state
from steeple.core.config import validate_definition_name
from steeple.core.errors import ConfigurationError
from steeple.core.names import check_name
from steeple.core.occurrences import OccurrenceState
from steeple.core.policies import validate_budget

CSRF_HEADER = "X-Steeple-CSRF"
"""Header that state-changing requests must carry, equal to the configured token."""

MAX_BODY_BYTES = 16 * 1024
"""The largest request body the app reads; a longer one is refused (413) as it streams in."""

_DIGITS = re.compile(r"[0-9]+\Z")
_MAX_AGE_SECONDS = 100 * 365 * 86400
_MAX_DETAIL = 300


class Refusal(Exception):
    """A request refused: answered with ``status`` and a one-line ``{"error", "detail"}``."""

    def __init__(self, status: int, error: str, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.error = error
        self.detail = detail


def json_error(status: int, error: str, detail: str) -> JSONResponse:
    # One line, bounded: a reason never echoes a hostile 10 KB value or a lone surrogate back.
    line = " ".join(detail.split()).encode("utf-8", "replace").decode("utf-8")
    if len(line) > _MAX_DETAIL:
        line = line[: _MAX_DETAIL - 3] + "..."
    return JSONResponse({"error": error, "detail": line}, status_code=status)


async def http_error(request: Request, exc: Exception) -> Response:
    # Starlette's own refusals (no such route, method not allowed) answer like the app's.
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    error = {404: "not_found", 405: "method_not_allowed"}.get(status, "bad_request")
    reason = {404: "no such route", 405: "method not allowed"}.get(status, "bad request")
    response = json_error(status, error, reason)
    if isinstance(exc, HTTPException) and exc.headers:
        response.headers.update(exc.headers)  # e.g. Allow on a 405
    return response


def bad_request(detail: str) -> Refusal:
    return Refusal(400, "bad_request", detail)


def invalid(detail: str) -> Refusal:
    return Refusal(422, "invalid", detail)


async def read_body(request: Request, limit: int) -> bytes:
    """Read at most ``limit`` bytes of the body; refuse a longer one without reading it all."""
    declared = request.headers.get("content-length")
    if declared is not None:
        declared = declared.strip()
        if not _DIGITS.match(declared):
            raise bad_request("the Content-Length header is not a whole number")
        if len(declared) > 12 or int(declared) > limit:
            raise Refusal(413, "too_large", f"the body is over {limit} bytes")
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise Refusal(413, "too_large", f"the body is over {limit} bytes")
    except ClientDisconnect:
        raise bad_request("the client went away before sending the whole body") from None
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


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """Parse a strict UTF-8 JSON object: no NaN/Infinity, no duplicate keys, bounded depth."""
    try:
        text = raw.decode("utf-8")
        body = json.loads(text, parse_constant=_refuse_constant, object_pairs_hook=_unique_keys)
    except RecursionError:
        raise bad_request("the body is nested too deeply") from None
    except ValueError:  # includes UnicodeDecodeError and JSONDecodeError
        raise bad_request("the body is not valid UTF-8 JSON") from None
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object")
    return body


def only_fields(body: dict[str, Any], allowed: tuple[str, ...]) -> None:
    unknown = sorted(set(body) - set(allowed))
    if unknown:
        shown = ", ".join(repr(k[:40]) for k in unknown[:3])
        raise bad_request(f"unknown field {shown}; this route takes {', '.join(allowed)}")


def string_field(body: dict[str, Any], name: str) -> str:
    value = body.get(name)
    if not isinstance(value, str):
        raise bad_request(f'give {{"{name}": "..."}} as a string')
    return value


def int_field(body: dict[str, Any], name: str, default: int) -> int:
    value = body.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"{name} must be a whole number")
    return value


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


def html_error(
    request: Request, status: int, error: str, detail: str, *, homes: Sequence[str]
) -> HTMLResponse:
    """Answer a browser's page request with a friendly error page, not the JSON refusal."""
    line = " ".join(detail.split()).encode("utf-8", "replace").decode("utf-8")[:_MAX_DETAIL]
    root = str(request.scope.get("root_path", "")).rstrip("/")
    title = _ERROR_TITLES.get(status, "Refused")
    return HTMLResponse(_pages.error_page(status, title, line, root, homes), status_code=status)


def valid(check: Callable[[Any], T], value: object, reason: str | None = None) -> T:
    """Run one of the library's validators; its typed refusal becomes a 422."""
    try:
        return check(value)
    except ConfigurationError as exc:
        raise invalid(reason or str(exc)) from None


def checked_name(value: str, what: str) -> str:
    """Require a valid name by the library's one rule, exactly as given; else a 422."""
    return valid(lambda v: check_name(v, what), value)


def flag(raw: str | None, name: str) -> bool:
    if raw in (None, "", "0", "false"):
        return False
    if raw in ("1", "true"):
        return True
    raise invalid(f"{name} is 1 or 0")


def instant(raw: str, name: str) -> datetime:
    """Parse an instant an operator typed; one without an offset is UTC (the page says so)."""
    text = raw.strip()
    if len(text) > _MAX_INSTANT_TEXT:
        raise invalid(f"{name} is too long for an instant (e.g. 2026-12-01 08:30)")
    try:
        value = datetime.fromisoformat(text.replace("Z", "+00:00"))
        # In UTC at once: an offset may carry an instant out of the calendar's range.
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
    except ValueError:
        raise invalid(f"{name} is not an instant: write it like 2026-12-01 08:30 (UTC)") from None
    except OverflowError:
        raise invalid(f"{name} is out of range: write it like 2026-12-01 08:30 (UTC)") from None


def task_filter(params: Mapping[str, Any], strict: Mapping[str, Any] | None = None) -> TaskFilter:
    """Read a task filter from query parameters (or a JSON body: ``strict`` checks types).

    Names are used exactly as given (never trimmed: a filter on ``" mail"`` must not act on
    ``"mail"``) and refused (422, one line) unless valid by the library's one name rule;
    an empty field (as an HTML form sends an unset filter) selects every task.
    """
    if strict is not None:
        for key in ("state", "name", "since", "until", "queue", "args"):
            if key in strict and not isinstance(strict[key], str):
                raise bad_request(f"{key} must be a string")
            if key in strict and not strict[key].strip():
                raise invalid(f"{key} is empty: leave it out to select every task")
    state = params.get("state") or None
    if state is not None:
        valid(validate_task_state, state)
    name = params.get("name") or None
    queue = params.get("queue") or None
    since = params.get("since") or None
    until = params.get("until") or None
    args = params.get("args") or None
    return TaskFilter(
        args=None if args is None or not args.strip() else args_pattern(args),
        state=state,
        name=None if name is None else checked_name(name, "name (a task name)"),
        queue=None if queue is None else checked_name(queue, "queue"),
        since=None if since is None or not since.strip() else instant(since, "since"),
        until=None if until is None or not until.strip() else instant(until, "until"),
    )


def args_pattern(raw: str) -> str:
    """Read an args search: a JSON object the args contain, as canonical JSON text."""
    if len(raw) > 2000:
        raise invalid("args is over 2000 characters")
    try:
        value = json.loads(raw, parse_constant=_refuse_constant)
    except (ValueError, RecursionError):
        raise invalid("""args is not JSON: write it like {"to": "ada@example.com"}""") from None
    if not isinstance(value, dict) or not value:
        raise invalid(
            """args is a JSON object of keys and values, like {"to": "ada@example.com"}"""
        )
    return json.dumps(value, sort_keys=True, ensure_ascii=False)


def occurrence_filter(params: Mapping[str, Any], now: datetime) -> _pages.OccurrenceFilter:
    """Read the publications page's filter: state, definition, due from (default: a day ago)."""
    state = (params.get("state") or "").strip() or None
    if state is not None and state not in {s.value for s in OccurrenceState}:
        states = ", ".join(s.value for s in OccurrenceState)
        raise invalid(f"state is one of {states}")
    name = (params.get("definition") or "").strip() or None
    if name is not None:
        valid(validate_definition_name, name)
    raw = params.get("from")
    if raw is None:
        since: datetime | None = now - timedelta(days=1)
    elif raw.strip():
        since = instant(raw, "from")
    else:
        since = None  # cleared: from the first occurrence
    return _pages.OccurrenceFilter(state=state, definition=name, since=since)


def task_ids_field(value: object) -> list[int]:
    if not isinstance(value, list) or not value:
        raise bad_request("task_ids must be a non-empty list of task ids")
    if len(value) > BULK_LIMIT:
        raise invalid(f"at most {BULK_LIMIT} task ids at a time")
    return sorted({valid(validate_task_id, v) for v in value})


def paging(request: Request) -> tuple[str | None, int]:
    after = request.query_params.get("after") or None
    raw = request.query_params.get("limit")
    if raw is None:
        return after, 100
    if not _DIGITS.match(raw):
        raise bad_request("limit must be a whole number from 1 to 100")
    # Never int() a long digit string: it is out of range whatever it says.
    return after, valid(validate_budget, int(raw) if len(raw) <= 3 else 0, "limit must be 1-100")


def path_task_id(raw: str) -> int:
    if not _DIGITS.match(raw):
        raise bad_request("a task id is a whole number")
    return valid(validate_task_id, int(raw) if len(raw) <= 19 else 0)


def purge_args(body: dict[str, Any], now: datetime) -> tuple[datetime, int]:
    only_fields(body, ("older_than_seconds", "older_than_days", "limit"))
    if "older_than_days" in body:
        if "older_than_seconds" in body:
            raise bad_request("give older_than_seconds or older_than_days, not both")
        days = body["older_than_days"]
        if isinstance(days, bool) or not isinstance(days, int):
            raise bad_request("older_than_days must be a whole number")
        if not 0 <= days <= _MAX_AGE_SECONDS // 86400:
            raise invalid(f"older_than_days must be from 0 to {_MAX_AGE_SECONDS // 86400}")
        seconds = days * 86400
    else:
        seconds = int_field(body, "older_than_seconds", 7 * 86400)
    limit = valid(validate_budget, int_field(body, "limit", 100))
    if not 0 <= seconds <= _MAX_AGE_SECONDS:
        raise invalid(f"older_than_seconds must be from 0 to {_MAX_AGE_SECONDS}")
    return now - timedelta(seconds=seconds), limit
