"""What commands print: one-line errors, JSON, tables, confirmations; running a command body.

Errors go to stderr as one line (``steeple: error: ...``) and, when there is one, a second
line saying what to do; the exit code says what kind of failure it was
(:class:`~steeple.admin.settings.ExitCode`). Every line is scrubbed of the DSNs' secrets.
Rich (tables) is imported only when a table is printed.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import sys
import unicodedata
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Final, TypeVar

import typer

from steeple.admin._cli.options import given_dsns
from steeple.admin._text import plural
from steeple.admin.settings import DSN_ENV, CliError, ExitCode

if TYPE_CHECKING:
    from rich.console import Console

    from steeple.admin._backend import Target
    from steeple.core.records import Page
    from steeple.postgres import PostgresRecurringStore

__all__ = [
    "LineFormatter",
    "check_limit",
    "confirm",
    "err",
    "fail",
    "guard",
    "on_queue",
    "on_store",
    "one_line",
    "out",
    "plural",
    "print_json",
    "print_page",
    "run",
    "say",
    "short_when",
    "typed",
    "when",
]

T = TypeVar("T")
_MAX_LINE = 1000


def out() -> Console:
    """Return a console of results (stdout), as wide as the terminal is now."""
    from rich.console import Console

    return Console(highlight=False, soft_wrap=True)


@functools.cache
def err() -> Console:
    """Return the console of errors, notes and progress (stderr)."""
    from rich.console import Console

    return Console(stderr=True, highlight=False, soft_wrap=True)


# Control characters (ESC, DEL, C1...), format characters (bidi overrides and isolates,
# zero-width ones) and line/paragraph separators: from stored text -- a handler's error
# message, a task's name or result -- they would steer the terminal or disguise what is
# shown, so they are printed escaped.
_HIDDEN: Final = frozenset({"Cc", "Cf", "Zl", "Zp"})
_SUSPECT: Final = re.compile("[^\x20-\x7e]")


def _escape_hidden(match: re.Match[str]) -> str:
    ch = match.group()
    if unicodedata.category(ch) not in _HIDDEN:
        return ch
    code = ord(ch)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def one_line(text: str, *, keep_spacing: bool = False) -> str:
    r"""Return ``text`` as the command prints it: one bounded line, safe on a terminal.

    The one escaping every output path uses (plain lines, errors, table cells): any given
    DSN's secrets masked, line breaks and tabs made spaces, runs of spaces collapsed unless
    ``keep_spacing`` (a traceback line keeps its indentation, an aligned field its column),
    control, format (bidi) and separator characters escaped as ``\xNN``/``\uNNNN``, lone
    surrogates escaped, at most 1000 characters.
    """
    text = _scrubbed(text)
    if keep_spacing:
        return _escaped(" ".join(text.expandtabs(4).splitlines()))
    return _escaped(" ".join(text.split()))


def _scrubbed(text: str) -> str:
    from steeple.core.dsn import scrub

    for dsn in (*given_dsns, os.environ.get(DSN_ENV)):
        if dsn:
            text = scrub(text, dsn)
    return text


def _escaped(line: str) -> str:
    line = _SUSPECT.sub(_escape_hidden, line)
    # Lone surrogates (from undecodable arguments) cannot be written to stdout/stderr.
    line = line.encode("utf-8", "backslashreplace").decode("utf-8")
    return line if len(line) <= _MAX_LINE else line[: _MAX_LINE - 3] + "..."


class LineFormatter(logging.Formatter):
    """Formats log records (a traceback included) as :func:`one_line` does each line.

    Indentation is kept; every other control, format or separator character is escaped
    and the DSNs' secrets are masked: a worker's log carries handlers' error messages.
    """

    def format(self, record: logging.LogRecord) -> str:
        """Return the record formatted, each line scrubbed and escaped."""
        return "\n".join(_escaped(line) for line in _scrubbed(super().format(record)).split("\n"))


def say(text: str, *, stderr: bool = False, keep_spacing: bool = False) -> None:
    """Print one plain line (scrubbed, escaped: :func:`one_line`), to stdout or stderr."""
    stream = sys.stderr if stderr else sys.stdout
    stream.write(one_line(text, keep_spacing=keep_spacing) + "\n")
    stream.flush()


def fail(error: CliError) -> typer.Exit:
    """Print ``error`` (and what to do) on stderr; return the exit to raise."""
    say(f"steeple: error: {error}", stderr=True)
    if error.hint:
        sys.stderr.write(f"  what to do: {one_line(error.hint)}\n")
    return typer.Exit(int(error.code))


def run(body: Callable[[], Coroutine[Any, Any, T]], target: Target | None = None) -> T:
    """Run an async command body; turn every failure into one line and an exit code."""
    import asyncio

    from steeple.admin._backend import classify

    try:
        return asyncio.run(body())
    except typer.Exit:
        raise
    except KeyboardInterrupt:
        say("steeple: interrupted", stderr=True)
        raise typer.Exit(130) from None
    except Exception as exc:
        if os.environ.get("STEEPLE_DEBUG"):
            raise
        raise fail(classify(exc, target)) from None


def on_store(target: Target, op: Callable[[PostgresRecurringStore], Awaitable[T]]) -> T:
    """Connect to the target's recurring store, run ``op`` on it, close it (as :func:`run`)."""
    from steeple.admin._backend import connect_store

    async def body() -> T:
        store = await connect_store(target)
        try:
            return await op(store)
        finally:
            await store.close()

    return run(body, target)


def on_queue(target: Target, op: Callable[[Any], Awaitable[T]]) -> T:
    """Run ``op(connection)`` on the target's work queue (failures as :func:`run`).

    The connection is an asyncpg connection to a database whose queue schema is this
    library's version (else: a configuration error saying to run steeple migrate).
    """

    async def body() -> T:

        from steeple.postgres.queue import check_schema

        conn = await target.connect()
        try:
            await check_schema(conn, target.queue_schema)
            return await op(conn)
        finally:
            await conn.close()

    return run(body, target)


def guard(fn: Callable[[], T]) -> T:
    """Run ``fn``; a :class:`CliError` ends the command with its line and exit code."""
    try:
        return fn()
    except CliError as exc:
        raise fail(exc) from None


def typed(fn: Callable[[], T], *, code: ExitCode = ExitCode.CONFIG) -> T:
    """Run ``fn``; a library configuration error becomes a :class:`CliError` of ``code``."""
    from steeple.core.errors import ConfigurationError

    try:
        return fn()
    except ConfigurationError as exc:
        raise CliError(str(exc), code=code) from None


def check_limit(limit: int) -> None:
    """Refuse a page size outside 1..100 (usage)."""
    if not 1 <= limit <= 100:
        raise fail(CliError("--limit must be between 1 and 100", code=ExitCode.USAGE))


def confirm(question: str, *, yes: bool, what: str) -> None:
    """Ask ``question`` on the terminal unless ``yes``; refuse without a terminal to ask on.

    Raises:
        typer.Exit: (usage, 2) no terminal and no ``--yes``; (failed, 1) the answer was no.
    """
    if yes:
        return
    if not (sys.stdin.isatty() and sys.stderr.isatty()):
        raise fail(
            CliError(
                f"refusing to {what} without confirmation (no terminal to ask on)",
                code=ExitCode.USAGE,
                hint="pass --yes to confirm",
            )
        )
    sys.stderr.write(one_line(question) + " [y/N] ")
    sys.stderr.flush()
    answer = sys.stdin.readline().strip().lower()
    if answer not in {"y", "yes"}:
        raise fail(CliError(f"not confirmed: nothing was done ({what})", code=ExitCode.FAILED))


def when(value: datetime | None) -> str:
    """Write an instant as ``YYYY-MM-DD HH:MM:SS`` in UTC, or ``-``."""
    return "-" if value is None else value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")


def short_when(value: datetime | None) -> str:
    """Write an instant as ``MM-DD HH:MM:SS`` in UTC, or ``-`` (a table column; --json: all)."""
    return "-" if value is None else value.astimezone(UTC).strftime("%m-%d %H:%M:%S")


def print_json(data: Any) -> None:
    """Print ``data`` as indented JSON on stdout."""
    sys.stdout.write(json.dumps(data, indent=2) + "\n")


def print_table(
    title: str,
    columns: Iterable[str],
    rows: Iterable[Sequence[str]],
    *,
    elastic: str | None = None,
) -> None:
    """Print a table on stdout, one line per row (cells are text, never markup).

    Every cell is escaped as :func:`one_line` escapes. The ``elastic`` column (a long
    free text such as the last error) takes the room the others leave and is cut with an
    ellipsis; the others keep their full width (a name is never cut to make room for it).
    Without one, cells wrap as the terminal's width requires.
    """
    from rich import box
    from rich.table import Table
    from rich.text import Text

    names = list(columns)
    # A rule under the headings and no frame: the columns get the room borders would take.
    table = Table(
        title=Text(one_line(title)),
        title_justify="left",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        padding=(0, 1, 0, 0),
    )
    for column in names:
        if elastic is None:
            table.add_column(Text(one_line(column)))
        elif column == elastic:
            header = Text(one_line(column), no_wrap=True, overflow="ellipsis")
            table.add_column(header, no_wrap=False, min_width=4)
        else:
            table.add_column(Text(one_line(column)), no_wrap=True)
    for row in rows:
        cells = [one_line(cell, keep_spacing=True) for cell in row]
        table.add_row(
            *(
                Text(cell, no_wrap=True, overflow="ellipsis")
                if elastic is not None and name == elastic
                else Text(cell)
                for name, cell in zip(names, cells, strict=True)
            )
        )
    out().print(table)


def print_page(
    page: Page[T],
    *,
    as_json: bool,
    to_json: Callable[[T], Any],
    title: str,
    columns: Iterable[str],
    row: Callable[[T], Sequence[str]],
    elastic: str | None = None,
) -> None:
    """Print one page of a listing as JSON or as a table, with the next page's cursor."""
    if as_json:
        print_json({"items": [to_json(i) for i in page.items], "next_cursor": page.next_cursor})
        return
    print_table(title, columns, (row(item) for item in page.items), elastic=elastic)
    if page.next_cursor:
        say(f"more: --after {page.next_cursor}")
