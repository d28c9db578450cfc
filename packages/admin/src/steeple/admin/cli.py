"""The ``steeple`` command: demo, deployment, workers, inspection and operator actions.

Exit codes: 0 success; 1 the operation was refused or failed (not found, wrong state, not
confirmed); 2 usage (bad options or arguments, a destructive command without --yes and no
terminal to ask on); 3 configuration (DSN, database, user or password the server refuses,
TLS settings, keys, namespace settings, settings file); 4 unavailable (PostgreSQL, the
broker, a port or the embedded server cannot be reached). Errors are one line on stderr,
followed by what to do.

The commands live in ``steeple.admin._cli`` (one module per group); this module assembles
them. ``--help`` imports no driver, server or table library.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from typing import Annotated, Any

import typer

from steeple.admin import simulate_cli
from steeple.admin._cli import demo, keys, queue, recurring, serve, worker
from steeple.admin._cli.options import GroupedGroup, Typer
from steeple.admin._cli.output import LineFormatter

__all__ = ["app", "main"]

_EXIT_CODES_HELP = (
    "Exit codes: 0 ok, 1 refused or failed, 2 usage, 3 configuration, 4 unavailable. "
    "Settings: flags, then environment variables, then steeple.toml (or --config)."
)
# typer builds on click (vendored in recent releases): find its exception classes by name.
_CLICK_ERRORS = tuple(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")


class _SteepleGroup(GroupedGroup):
    """The root group: usage errors as one line (like every other error), servers stopped."""

    def main(
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        windows_expand_args: bool = True,
        **extra: Any,
    ) -> Any:
        def run() -> Any:
            return super(_SteepleGroup, self).main(
                args, prog_name, complete_var, False, windows_expand_args, **extra
            )

        if not standalone_mode:
            return run()
        from steeple.admin._cli.options import given_dsns, stop_embedded
        from steeple.admin._cli.output import one_line

        # The DSNs to scrub are this invocation's: an earlier one in the same process (an
        # embedding program, a test runner) must not mask hosts that are not secrets now.
        given_dsns.clear()
        try:
            code = run()
        except Exception as exc:
            if not isinstance(exc, _CLICK_ERRORS):
                if type(exc).__name__ == "Abort":
                    sys.stderr.write("steeple: aborted\n")
                    sys.exit(1)
                raise
            message = exc.format_message()  # type: ignore[attr-defined]
            sys.stderr.write(one_line(f"steeple: error: {message}") + "\n")
            context = getattr(exc, "ctx", None)
            if context is not None:
                sys.stderr.write(f"  what to do: see {context.command_path} --help\n")
            sys.exit(int(getattr(exc, "exit_code", 2)))
        finally:
            stop_embedded()
        sys.exit(code if isinstance(code, int) else 0)


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            shown = version("steeple-admin")
        except PackageNotFoundError:
            shown = "unknown (not installed)"
        sys.stdout.write(f"steeple {shown}\n")
        raise typer.Exit(0)


app = Typer(
    name="steeple",
    cls=_SteepleGroup,
    help="steeple: durable scheduled work on PostgreSQL.\n\n" + _EXIT_CODES_HELP,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option(
            "--version",
            callback=_version,
            is_eager=True,
            help="Print steeple's version and exit.",
        ),
    ] = False,
) -> None:
    """steeple: durable scheduled work on PostgreSQL."""


for _group in (recurring, queue, keys, worker, serve, demo):
    _group.register(app)
app.command(name="simulate")(simulate_cli.simulate)


def main() -> None:
    """Run the ``steeple`` command."""
    # Library warnings (e.g. a superuser runtime role) go to stderr as one line each.
    # Their messages may quote stored text (a handler's error): escaped as every output is.
    handler = logging.StreamHandler()
    handler.setFormatter(LineFormatter("steeple: warning: %(message)s"))
    logging.basicConfig(level=logging.WARNING, handlers=[handler])
    app(prog_name="steeple")
