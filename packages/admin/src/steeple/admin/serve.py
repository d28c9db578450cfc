"""``steeple admin serve``: the admin app for one namespace behind a token, under uvicorn."""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hmac
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from steeple.admin.app import SECURITY_HEADERS, create_admin_app
from steeple.core.ports import RecurringStore

if TYPE_CHECKING:
    from steeple.admin._backend import Target
    from steeple.admin.tasks import TaskAdmin
    from steeple.keyring import Keyring

__all__ = ["presented_token", "serve", "token_app"]


def presented_token(request: Request) -> str | None:
    """Return the token a request presents: ``Bearer <token>`` or the password of basic auth."""
    header = request.headers.get("authorization", "")
    scheme, _, value = header.partition(" ")
    if scheme.lower() == "bearer":
        return value.strip()
    if scheme.lower() == "basic":
        try:
            decoded = base64.b64decode(value.strip(), validate=True).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError):
            return None
        return decoded.partition(":")[2]
    return None


class _Challenge:
    """Answer 401 with a basic-auth challenge when no credentials were sent at all."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = dict(scope.get("headers", []))
            if b"authorization" not in headers:
                await send(
                    {
                        "type": "http.response.start",
                        "status": 401,
                        "headers": [
                            (b"www-authenticate", b'Basic realm="steeple admin", charset="UTF-8"'),
                            (b"content-type", b"application/json"),
                            *SECURITY_HEADERS,
                        ],
                    }
                )
                await send(
                    {
                        "type": "http.response.body",
                        "body": b'{"error":"unauthorized","detail":"sign in with the admin token"}',
                    }
                )
                return
        await self.app(scope, receive, send)


def token_app(
    *,
    token: str,
    namespace: str,
    stores: Any,
    tasks: Any,
    csrf_token: str | None,
) -> ASGIApp:
    """Build the admin app whose only grant is: this token, this one namespace."""
    expected = token.encode("utf-8")

    async def authorize(request: Request, action: str, requested: str) -> bool:
        presented = (presented_token(request) or "").encode("utf-8")
        if not hmac.compare_digest(presented, expected):
            return False
        return action == "static.read" or requested == namespace

    inner = create_admin_app(authorize=authorize, stores=stores, tasks=tasks, csrf_token=csrf_token)
    return _Challenge(inner)


async def serve(
    target: Target,
    keyring: Keyring,
    *,
    token: str,
    csrf_token: str | None,
    host: str,
    port: int,
) -> None:
    """Run the admin app under uvicorn until interrupted.

    Raises:
        CliError: the store cannot be opened (classified).
    """
    import uvicorn

    from steeple.admin._backend import connect_store
    from steeple.admin.queue_admin import PostgresTaskAdmin

    store = await connect_store(target, keyring=keyring)
    resources = contextlib.AsyncExitStack()
    opening = asyncio.Lock()
    task_admin: TaskAdmin | None = None

    async def stores(namespace: str) -> RecurringStore:
        if namespace != target.namespace:
            raise LookupError(namespace)
        return store

    async def tasks(namespace: str) -> TaskAdmin:
        # Opened on first use, so the dashboard works before `steeple migrate` was run.
        nonlocal task_admin
        if namespace != target.namespace:
            raise LookupError(namespace)
        async with opening:
            if task_admin is None:
                task_admin = await resources.enter_async_context(
                    PostgresTaskAdmin.open(target.dsn, schema=target.queue_schema)
                )
        return task_admin

    app = token_app(
        token=token, namespace=target.namespace, stores=stores, tasks=tasks, csrf_token=csrf_token
    )
    config = uvicorn.Config(
        app, host=host, port=port, log_level="info", lifespan="off", server_header=False
    )
    try:
        async with resources:
            await uvicorn.Server(config).serve()
    finally:
        await store.close()
