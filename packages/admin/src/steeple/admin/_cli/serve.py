"""``steeple admin serve``: the admin app for one namespace (or the work queue alone)."""

from __future__ import annotations

import os
import secrets
from typing import TYPE_CHECKING, Annotated

import typer

from steeple.admin._cli import output
from steeple.admin._cli.options import Where, where_options
from steeple.admin._cli.output import fail, guard, say
from steeple.admin.settings import CliError, ExitCode

if TYPE_CHECKING:
    from steeple.keyring import Keyring

__all__ = ["admin_tokens", "register"]

admin_app = typer.Typer(help="The admin web app.", no_args_is_help=True, rich_markup_mode=None)

TOKEN_ENV = "STEEPLE_ADMIN_TOKEN"  # noqa: S105 - the name of a variable, not a secret
CSRF_ENV = "STEEPLE_ADMIN_CSRF_TOKEN"


def register(app: typer.Typer) -> None:
    """Add the ``admin`` commands to ``app``."""
    app.add_typer(admin_app, name="admin")


def admin_tokens() -> tuple[str, str | None]:
    """Return the sign-in token and the CSRF token from the environment.

    Raises:
        CliError: (config) no sign-in token or one shorter than 16 characters; a CSRF token
            shorter than 16 characters.
    """
    token = os.environ.get(TOKEN_ENV, "")
    if len(token) < 16:
        raise CliError(
            f"{TOKEN_ENV} is not set (or shorter than 16 characters)",
            code=ExitCode.CONFIG,
            hint=f"export {TOKEN_ENV}={secrets.token_urlsafe(24)}",
        )
    csrf = os.environ.get(CSRF_ENV) or None
    if csrf is not None and len(csrf) < 16:
        raise CliError(f"{CSRF_ENV} must be at least 16 characters", code=ExitCode.CONFIG)
    return token, csrf


@admin_app.command("serve")
@where_options(queue=True)
def admin_serve(
    where: Where,
    host: Annotated[str, typer.Option("--host", help="Interface to listen on.")] = "127.0.0.1",
    port: Annotated[
        int, typer.Option("--port", min=0, max=65535, help="TCP port (0: any free port).")
    ] = 8520,
    queue_only: Annotated[
        bool,
        typer.Option(
            "--queue-only",
            help="Serve the work queue's tasks only (no keys or recurring namespace needed).",
        ),
    ] = False,
    show_args: Annotated[
        list[str] | None,
        typer.Option(
            "--show-args",
            metavar="TASK",
            help="Let the task page show the args of tasks named TASK (repeatable; args "
            "can hold secrets, so none are shown by default).",
        ),
    ] = None,
) -> None:
    """Serve the admin app for one namespace (sign in with STEEPLE_ADMIN_TOKEN).

    Sign in with any user name and the token as the password, or send the header
    "Authorization: Bearer TOKEN". State-changing API calls also need the X-Steeple-CSRF
    header equal to STEEPLE_ADMIN_CSRF_TOKEN (without it they are disabled). Without
    storage keys (or an initialized namespace) it serves the work queue's tasks alone.
    Ctrl-C or SIGTERM stops it.
    """
    from steeple.admin.serve import bind, serve

    token, csrf = guard(admin_tokens)
    target = guard(where.target)
    keyring: Keyring | None = None
    note = None
    if not queue_only:
        try:
            keyring = target.keyring()
        except CliError as exc:
            if "no storage keys given" not in str(exc):
                raise fail(exc) from None
            note = "recurring publications not served: no storage keys given (tasks only)"
    # Bound before anything is announced: a busy port is refused with nothing printed first.
    sock = guard(lambda: bind(host, port))
    if note is not None:
        say(note, stderr=True)
    try:
        output.run(
            lambda: serve(
                target,
                keyring,
                token=token,
                csrf_token=csrf,
                sock=sock,
                announce=lambda line: say(line, stderr=True),
                reveal_args=tuple(show_args or ()),
            ),
            target,
        )
    finally:
        sock.close()
