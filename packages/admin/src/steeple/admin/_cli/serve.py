"""``steeple admin serve``: the admin app for one namespace (or the work queue alone)."""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from steeple.admin._cli import output
from steeple.admin._cli.options import Typer, Where, where_options
from steeple.admin._cli.output import fail, guard, say
from steeple.admin.settings import CliError, ExitCode

if TYPE_CHECKING:
    from steeple.keyring import Keyring

__all__ = ["admin_tokens", "checked_token", "register"]

admin_app = Typer(help="The admin web app.", no_args_is_help=True, rich_markup_mode=None)

TOKEN_ENV = "STEEPLE_ADMIN_TOKEN"  # noqa: S105 - the name of a variable, not a secret
CSRF_ENV = "STEEPLE_ADMIN_CSRF_TOKEN"


def register(app: typer.Typer) -> None:
    """Add the ``admin`` commands to ``app``."""
    app.add_typer(admin_app, name="admin")


def admin_tokens() -> tuple[str, str | None]:
    """Return the sign-in token and the CSRF token from the environment.

    Raises:
        CliError: (config) no sign-in token, or a sign-in or CSRF token with less than
            128 bits of entropy (the hint prints a fresh random one).
    """
    token = os.environ.get(TOKEN_ENV, "")
    if not token:
        raise CliError(
            f"{TOKEN_ENV} is not set",
            code=ExitCode.CONFIG,
            hint=f"export {TOKEN_ENV}={secrets.token_urlsafe(32)}",
        )
    checked_token(token, TOKEN_ENV)
    csrf = os.environ.get(CSRF_ENV) or None
    if csrf is not None:
        checked_token(csrf, CSRF_ENV)
    return token, csrf


def checked_token(token: str, variable: str) -> str:
    """Return ``token`` if strong enough to guard the admin app.

    Raises:
        CliError: (config) less than 128 bits of entropy; the hint prints a fresh random one.
    """
    from steeple.admin.serve import check_token
    from steeple.core.errors import ConfigurationError

    try:
        return check_token(token, variable)
    except ConfigurationError as exc:
        raise CliError(
            str(exc),
            code=ExitCode.CONFIG,
            hint=f"export {variable}={secrets.token_urlsafe(32)}",
        ) from None


@admin_app.command("serve")
@where_options(queue=True)
def admin_serve(
    where: Where,
    host: Annotated[
        str,
        typer.Option(
            "--host",
            help="Interface to listen on. Any address other machines can reach needs "
            "--certfile and --keyfile (HTTPS), or --insecure.",
        ),
    ] = "127.0.0.1",
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
    certfile: Annotated[
        Path | None,
        typer.Option("--certfile", help="Serve HTTPS with this PEM certificate (chain)."),
    ] = None,
    keyfile: Annotated[
        Path | None,
        typer.Option("--keyfile", help="The PEM private key of --certfile."),
    ] = None,
    insecure: Annotated[
        bool,
        typer.Option(
            "--insecure",
            help="Allow plain HTTP on an address other machines can reach (the token "
            "then crosses the network in clear text).",
        ),
    ] = False,
) -> None:
    """Serve the admin app for one namespace (sign in with STEEPLE_ADMIN_TOKEN).

    STEEPLE_ADMIN_TOKEN must be random, at least 128 bits (e.g. the output of
    python3 -c 'import secrets; print(secrets.token_urlsafe(32))'). Sign in with any user
    name and the token as the password, or send the header "Authorization: Bearer TOKEN".
    An address that sends wrong tokens is refused for a while (429), longer after each
    further failure; failures are logged with the address. State-changing API calls also
    need the X-Steeple-CSRF header equal to STEEPLE_ADMIN_CSRF_TOKEN (as random; without
    it they are disabled). Without storage keys (or an initialized namespace) it serves
    the work queue's tasks alone. Ctrl-C or SIGTERM stops it.
    """
    from steeple.admin.serve import bind, check_exposure, serve

    token, csrf = guard(admin_tokens)
    if (certfile is None) != (keyfile is None):
        raise fail(CliError("--certfile and --keyfile go together", code=ExitCode.USAGE))
    for given in (certfile, keyfile):
        if given is not None and not given.is_file():
            raise fail(CliError(f"no such file: {given}", code=ExitCode.CONFIG))
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
    try:
        warning = check_exposure(sock, tls=certfile is not None, insecure=insecure)
    except CliError as exc:
        sock.close()
        raise fail(exc) from None
    if warning is not None:
        say(warning, stderr=True)
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
                certfile=None if certfile is None else str(certfile),
                keyfile=None if keyfile is None else str(keyfile),
            ),
            target,
        )
    finally:
        sock.close()
