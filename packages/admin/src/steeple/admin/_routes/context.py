"""What every admin route shares: the host's providers and decisions, the gate, the page frame.

One :class:`AdminContext` is built per app by ``create_admin_app`` and handed to every
route handler explicitly: the authorization gate, the CSRF-guarded JSON body, the
providers of a namespace's store and task access, and the page renderer.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import TYPE_CHECKING, Any

import attrs
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response

from steeple.admin import _pages
from steeple.admin._routes.http import (
    CSRF_HEADER,
    MAX_BODY_BYTES,
    Refusal,
    html_error,
    json_error,
    parse_json_object,
    read_body,
)
from steeple.admin.tasks import TaskAdmin, TaskFilter, TaskRecord
from steeple.core.config import validate_namespace
from steeple.core.errors import (
    ConfigurationError,
    RecurringInvalidStateError,
    RecurringStorageError,
    SteepleError,
)
from steeple.core.ports import RecurringStore

if TYPE_CHECKING:
    from steeple.admin.app import Authorize, StoreProvider, TaskProvider

__all__ = ["AdminContext", "Handler"]

_log = logging.getLogger("steeple.admin")


@attrs.frozen(repr=False)
class AdminContext:
    """The app's configuration as its routes use it (never shown: it holds the CSRF token)."""

    authorize: Authorize | None
    stores: StoreProvider | None
    tasks: TaskProvider | None
    csrf_token: str | None
    clock: Callable[[], datetime]
    revealable: Callable[[str], bool]
    homes: tuple[str, ...]
    refresh_seconds: float

    def __repr__(self) -> str:
        return "AdminContext(...)"

    @property
    def actions_enabled(self) -> bool:
        """Whether state-changing requests (and the dashboard's action buttons) exist."""
        return self.csrf_token is not None

    async def gate(self, request: Request, action: str, namespace: str) -> None:
        """Refuse unless ``authorize`` allows ``action`` on a valid ``namespace``."""
        # Refuse before looking at anything else: no callback means no access at all.
        if self.authorize is None:
            raise Refusal(403, "forbidden", "this admin app has no authorize callback")
        if action != "static.read":
            try:
                validate_namespace(namespace)
            except ConfigurationError:
                raise Refusal(404, "not_found", "no such namespace") from None
        allowed = await self.authorize(request, action, namespace)
        if allowed is not True:
            raise Refusal(403, "forbidden", f"not allowed: {action}")

    async def may(self, request: Request, action: str, namespace: str) -> bool:
        """Whether ``authorize`` allows ``action`` too (for a part of a page or answer)."""
        try:
            await self.gate(request, action, namespace)
        except Refusal:
            return False
        return True

    async def visible(self, request: Request, namespace: str, record: TaskRecord) -> TaskRecord:
        """Withhold ``record``'s result from a caller not allowed ``tasks.results``."""
        if record.result is None or await self.may(request, "tasks.results", namespace):
            return record
        return attrs.evolve(record, result=None)

    async def searchable(self, request: Request, namespace: str, where: TaskFilter) -> TaskFilter:
        """Refuse a search by args unless its task name is opted in and ``tasks.args`` allowed."""
        if where.args is None:
            return where
        if where.name is None or not self.revealable(where.name):
            raise Refusal(
                403,
                "forbidden",
                "a search by args needs a task name whose args this dashboard may show "
                "(the host opts names in: reveal_args, or steeple admin serve --show-args)",
            )
        await self.gate(request, "tasks.args", namespace)
        return where

    async def json_body(self, request: Request) -> dict[str, Any]:
        """Read a state-changing request's body: CSRF header first, then strict JSON."""
        if self.csrf_token is None:
            raise Refusal(403, "forbidden", "state-changing requests are disabled")
        presented = request.headers.get(CSRF_HEADER, "").encode("utf-8")
        if not hmac.compare_digest(presented, self.csrf_token.encode("utf-8")):
            raise Refusal(403, "csrf", f"missing or wrong {CSRF_HEADER} header")
        media = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if media != "application/json":
            raise Refusal(415, "unsupported_media_type", "send an application/json body")
        return parse_json_object(await read_body(request, MAX_BODY_BYTES))

    async def store_of(self, namespace: str) -> RecurringStore:
        """Return the recurring store of ``namespace``, or refuse with 404."""
        if self.stores is None:
            raise Refusal(404, "not_found", "recurring publications are not served here")
        try:
            return await self.stores(namespace)
        except LookupError:
            raise Refusal(404, "not_found", "no such namespace") from None

    async def tasks_of(self, namespace: str) -> TaskAdmin:
        """Return the task access of ``namespace``, or refuse with 404."""
        if self.tasks is None:
            raise Refusal(404, "not_found", "tasks are not served here")
        try:
            return await self.tasks(namespace)
        except LookupError:
            raise Refusal(404, "not_found", "no such namespace") from None

    async def known(self, namespace: str) -> None:
        """Refuse a namespace no provider serves (a page must not look empty instead)."""
        for provider in (self.stores, self.tasks):
            if provider is None:
                continue
            try:
                await provider(namespace)
            except LookupError:
                raise Refusal(404, "not_found", f"no such namespace: {namespace}") from None
            return
        raise Refusal(404, "not_found", "this app serves neither tasks nor publications")

    def endpoint(
        self, action: str, handler: Handler, page: bool = False
    ) -> Callable[[Request], Awaitable[Response]]:
        """Wrap ``handler``: gate on ``action``, then answer every refusal as JSON or a page."""

        async def run(request: Request) -> Response:
            namespace = str(request.path_params.get("namespace", ""))
            try:
                await self.gate(request, action, namespace)
                return await handler(self, request, namespace)
            except Exception as exc:  # every failure is answered: see _refusal
                refusal = _refusal(exc, action, namespace)
            if page and request.query_params.get("live") != "1":
                return html_error(request, *refusal, homes=self.homes)
            return json_error(*refusal)

        return run

    def links_of(self, request: Request, namespace: str) -> _pages.Links:
        """Return the dashboard's links for ``namespace`` under the app's mount point."""
        return _pages.Links(str(request.scope.get("root_path", "")).rstrip("/"), namespace)

    def render(
        self,
        request: Request,
        namespace: str,
        title: str,
        current: str,
        sections: list[_pages.Section],
    ) -> Response:
        """Answer a dashboard page: its HTML, or its live sections as JSON (``?live=1``)."""
        if request.query_params.get("live") == "1":
            return JSONResponse({**_pages.live_json(sections), "at": self.clock().isoformat()})
        modes = " + ".join(
            label
            for label, provider in (
                ("work queue", self.tasks),
                ("recurring publications", self.stores),
            )
            if provider is not None
        )
        if self.stores is None:
            modes += " (queue-only mode)"
        return HTMLResponse(
            _pages.page(
                self.links_of(request, namespace),
                title,
                current,
                sections,
                csrf_token=self.csrf_token,
                refresh_seconds=self.refresh_seconds,
                modes=modes,
            )
        )


Handler = Callable[[AdminContext, Request, str], Awaitable[Response]]
"""A route handler: ``handler(ctx, request, namespace)``, run after the route's gate."""


def _refusal(exc: Exception, action: str, namespace: str) -> tuple[int, str, str]:
    """Translate what a handler raised into ``(status, error, detail)``."""
    if isinstance(exc, Refusal):
        return (exc.status, exc.error, exc.detail)
    if isinstance(exc, RecurringInvalidStateError):
        return (409, "invalid_state", str(exc))
    if isinstance(exc, ConfigurationError):
        # The library's typed refusal of a value (the app validates first; a provider or
        # store may know more rules).
        return (422, "invalid", str(exc))
    if isinstance(exc, RecurringStorageError | OSError | TimeoutError):
        return (503, "unavailable", "storage is unavailable; try again")
    if isinstance(exc, SteepleError):
        # No such task, job, schedule or occurrence is a 404; the rest a refusal.
        found = not isinstance(exc, LookupError)
        return (409, "refused", str(exc)) if found else (404, "not_found", str(exc))
    # Answered here (not by Starlette's outer error handler) so that even a failure
    # carries the security headers; details go to the log only.
    _log.exception("admin %s on namespace %r failed", action, namespace)
    return (500, "internal", "internal error")
