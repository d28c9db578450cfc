"""``steeple demo``: both products end to end on the embedded default."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from steeple.admin._cli import output
from steeple.admin._cli.options import remember_dsn
from steeple.admin._cli.output import fail, guard
from steeple.admin.settings import DSN_ENV, CliError, ExitCode, resolve_dsn

__all__ = ["register"]


def register(app: typer.Typer) -> None:
    """Add ``demo`` to ``app``."""
    app.command()(demo)


def demo(
    dsn: Annotated[
        str | None,
        typer.Option(
            "--dsn",
            envvar=DSN_ENV,
            show_envvar=True,
            show_default=False,
            help="PostgreSQL URL (default: a private PostgreSQL in --data-dir).",
        ),
    ] = None,
    schema: Annotated[
        str,
        typer.Option("--schema", envvar="STEEPLE_SCHEMA", help="PostgreSQL schema of the demo."),
    ] = "steeple_demo",
    namespace: Annotated[
        str,
        typer.Option(
            "--namespace", "-n", envvar="STEEPLE_NAMESPACE", help="Namespace of the demo."
        ),
    ] = "demo",
    data_dir: Annotated[
        Path,
        typer.Option(
            "--data-dir",
            help="Where the demo keeps its PostgreSQL cluster, key, journal and settings "
            "file (kept between runs).",
        ),
    ] = Path(".steeple/demo"),
    fresh: Annotated[
        bool,
        typer.Option(
            "--fresh",
            help="Start over: delete the data directory (with --dsn: drop the demo's schemas).",
        ),
    ] = False,
    duration: Annotated[float, typer.Option("--duration", help="Seconds to run (1-55).")] = 20.0,
    speed: Annotated[
        float, typer.Option("--speed", help="Clock speed-up for recurring schedules (1-600).")
    ] = 60.0,
    lose_every: Annotated[
        int,
        typer.Option(
            "--lose-ack-every",
            help="Lose the broker acknowledgement of every "
            "n-th publication, to show deduplication (0: never).",
        ),
    ] = 7,
    serve: Annotated[
        bool,
        typer.Option(
            "--serve",
            help="Then keep the database up and serve the dashboard on it until Ctrl-C.",
        ),
    ] = False,
    host: Annotated[
        str, typer.Option("--host", help="With --serve: the interface to listen on.")
    ] = "127.0.0.1",
    port: Annotated[
        int,
        typer.Option("--port", min=0, max=65535, help="With --serve: the TCP port (0: any)."),
    ] = 8520,
    insecure: Annotated[
        bool,
        typer.Option(
            "--insecure",
            help="With --serve: allow an address other machines can reach (plain HTTP: the "
            "password crosses the network in clear text).",
        ),
    ] = False,
) -> None:
    """Run both products end to end on the embedded default, with live progress.

    A private PostgreSQL, the SQLite journal broker, recurring publications on an
    accelerated clock, and work-queue tasks; a summary at the end, then the commands that
    show what it stored (the demo writes their settings to steeple.toml in --data-dir).
    Without --dsn (or STEEPLE_DATABASE_URL) it starts a private PostgreSQL in --data-dir.
    """
    from steeple.admin.demo import DemoOptions, run_demo

    if not 1 <= duration <= 55:
        raise fail(CliError("--duration must be between 1 and 55 seconds", code=ExitCode.USAGE))
    if lose_every < 0:
        raise fail(CliError("--lose-ack-every must be 0 or more", code=ExitCode.USAGE))
    if not 1 <= speed <= 600:
        raise fail(CliError("--speed must be between 1 and 600", code=ExitCode.USAGE))
    remember_dsn(dsn or os.environ.get(DSN_ENV))
    chosen = guard(lambda: resolve_dsn(dsn, required=False))
    options = DemoOptions(
        dsn=chosen,
        schema=schema,
        namespace=namespace,
        data_dir=data_dir.absolute(),
        fresh=fresh,
        duration=duration,
        speed=speed,
        lose_every=lose_every,
        serve=serve,
    )
    sock = None
    token = os.environ.get("STEEPLE_ADMIN_TOKEN") or None
    if serve:
        from steeple.admin._cli.serve import checked_token
        from steeple.admin.serve import bind, check_exposure

        if token is not None:
            guard(lambda: checked_token(token, "STEEPLE_ADMIN_TOKEN"))
        # Bound first: a busy port is refused before the demo runs.
        sock = guard(lambda: bind(host, port))
        try:
            warning = check_exposure(sock, tls=False, insecure=insecure)
        except CliError as exc:
            sock.close()
            raise fail(exc) from None
        if warning is not None:
            output.say(warning, stderr=True)
    try:
        output.run(lambda: run_demo(options, output.out(), dashboard=sock, token=token))
    finally:
        if sock is not None:
            sock.close()
