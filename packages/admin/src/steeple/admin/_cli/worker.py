"""``steeple worker``: run an application's recurring relay and/or task worker."""

from __future__ import annotations

from typing import Annotated

import attrs
import typer

from steeple.admin._cli import output
from steeple.admin._cli.options import Where, remember_dsn, where_options
from steeple.admin._cli.output import guard, say
from steeple.admin.settings import resolve_dsn

__all__ = ["register"]


def register(app: typer.Typer) -> None:
    """Add ``worker`` to ``app``."""
    app.command()(worker)


@where_options(queue=True)
def worker(
    app_ref: Annotated[
        str,
        typer.Option(
            "--app",
            help="module:object giving a steeple.admin.WorkerApp or a "
            "steeple.postgres.queue.App (or a function returning one).",
        ),
    ],
    where: Where,
    remove_stale_periodic: Annotated[
        bool,
        typer.Option(
            "--remove-stale-periodic",
            help="Delete the periodic jobs a queue App declared earlier and no longer "
            "does (by default they are reported and keep running). Use it once every "
            "worker runs the same code.",
        ),
    ] = False,
    listen_dsn: Annotated[
        str | None,
        typer.Option(
            "--listen-dsn",
            envvar="STEEPLE_LISTEN_DSN",
            show_envvar=True,
            show_default=False,
            help="PostgreSQL URL or key=value DSN straight to the server (not through a "
            "transaction pooler) for the task worker's LISTEN/NOTIFY wake-ups (default: "
            "listen_dsn in steeple.toml). With --pooler transaction and no listen DSN the "
            "worker polls (it says so at start).",
        ),
    ] = None,
) -> None:
    """Run the recurring relay and/or the task worker of your application until stopped.

    SIGINT or SIGTERM stops it gracefully: in-flight work finishes, nothing new starts.
    A second signal (or the app's drain_timeout) stops it hard: running tasks are handed
    back, relay leases left to lapse, and the process exits even if a handler ignores
    being stopped (ended ten seconds after the hard stop, exit code 1, if need be).

    On glibc the process keeps its C heap from growing at every database outage: it fixes
    the mmap threshold at 128 KiB unless MALLOC_MMAP_THRESHOLD_ is set.
    """
    from steeple.admin._memory import pin_mmap_threshold
    from steeple.admin.worker import EXIT_AFTER_HARD_STOP, load_worker_app, run_worker

    pin_mmap_threshold()

    target = guard(where.target)
    if listen_dsn:
        remember_dsn(listen_dsn)
        checked = guard(
            lambda: resolve_dsn(listen_dsn, source="--listen-dsn or STEEPLE_LISTEN_DSN")
        )
        target = attrs.evolve(target, listen_dsn=remember_dsn(checked))
    spec = guard(lambda: load_worker_app(app_ref))

    async def body() -> None:
        await run_worker(
            spec,
            target,
            log=lambda line: say(line, stderr=True),
            exit_after_hard_stop=EXIT_AFTER_HARD_STOP,
            remove_stale_periodic=remove_stale_periodic,
        )

    output.run(body, target)
    say("steeple worker: stopped", stderr=True)
