"""``steeple demo``: both products end to end on the embedded default, in under a minute.

A private PostgreSQL (pgserver) in a data directory kept between runs, a demo storage key
kept beside it, recurring publications relayed into the SQLite journal broker (a file in
the same directory) and consumed from it, and work-queue tasks run by the task worker. The
recurring schedules run on an accelerated clock (60x by default: minutes pass in seconds)
that starts in the past and never passes real time, so the namespace it leaves behind is
usable by every other command on the same database; the work queue runs on PostgreSQL's
own clock. The recurring work is done by :class:`steeple.postgres.RecurringRelay`, the
same loop ``steeple worker`` runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import time
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.table import Table

from steeple.admin._backend import Target, initialize_store, quiet_role_warnings
from steeple.admin.embedded import EmbeddedPostgres
from steeple.admin.settings import (
    SETTINGS_FILE,
    CliError,
    ExitCode,
    NamespaceSettings,
    format_duration,
    redact_dsn,
)
from steeple.core.clock import SystemClock, is_simulated
from steeple.core.config import RecurringDefinition
from steeple.core.errors import BrokerError, RecurringClockError, RelayAcknowledgementError
from steeple.core.limits import CLOCK_TOLERANCE
from steeple.core.messages import BrokerReceipt, ScheduledMessage
from steeple.core.policies import MissedRunPolicy
from steeple.core.ports import Clock, MessageBroker
from steeple.postgres.recurring import RelayStatistics

if TYPE_CHECKING:
    from steeple.keyring import Keyring
    from steeple.postgres import PostgresRecurringStore

__all__ = [
    "AcceleratedClock",
    "DemoOptions",
    "DemoSummary",
    "demo_settings",
    "print_inspect_commands",
    "run_demo",
    "write_settings_file",
]

DEMO_KEY_ID = "demo-key"
DEMO_BACKDATE = timedelta(hours=6)
"""How far before real time a new demo namespace's accelerated clock starts."""
_KEY_FILE = "demo.key"
_JOURNAL_FILE = "journal.sqlite3"
_SETTINGS_FILE = SETTINGS_FILE


class AcceleratedClock:
    """A clock that runs ``speed`` times faster than real time and never goes backwards.

    It reads the monotonic clock (immune to wall-clock steps) and scales the elapsed time.
    With a ``ceiling`` (e.g. the system clock) it never reads later than the ceiling: once
    the accelerated time meets real time it follows real time. (If the ceiling steps back,
    this clock holds still rather than go backwards.)

    Raises:
        ValueError: ``speed`` is not a positive finite number, or ``start`` is naive.
    """

    def __init__(
        self,
        start: datetime,
        speed: float,
        *,
        monotonic: Any = time.monotonic,
        ceiling: Clock | None = None,
    ) -> None:
        if not isinstance(start, datetime) or start.tzinfo is None:
            raise ValueError("start must be a timezone-aware datetime (UTC)")
        if not (isinstance(speed, int | float) and 0 < speed < float("inf")):
            raise ValueError("speed must be a positive finite number")
        self._start = start.astimezone(UTC)
        self._speed = float(speed)
        self._monotonic = monotonic
        self._ceiling = ceiling
        self._origin = monotonic()
        self._last: datetime | None = None

    @property
    def speed(self) -> float:
        """How many simulated seconds pass per real second."""
        return self._speed

    @property
    def simulated(self) -> bool:
        """Whether it runs on simulated time: with no ceiling, or under a simulated one.

        Capped by the host's wall clock it never reads later than that clock, so the
        stores judge it as they judge the host's clock (see
        :func:`steeple.core.clock.is_simulated`).
        """
        return self._ceiling is None or is_simulated(self._ceiling)

    def now(self) -> datetime:
        """Return the accelerated instant (aware UTC, never earlier than the last one)."""
        elapsed = max(0.0, self._monotonic() - self._origin) * self._speed
        instant = self._start + timedelta(seconds=elapsed)
        if self._ceiling is not None:
            instant = min(instant, self._ceiling.now().astimezone(UTC))
        if self._last is not None and instant < self._last:
            instant = self._last
        self._last = instant
        return instant

    def __repr__(self) -> str:
        capped = ", capped at real time" if self._ceiling is not None else ""
        return f"AcceleratedClock(speed={self._speed:g}{capped})"


@attrs.frozen
class DemoOptions:
    """What ``steeple demo`` was asked to do (its repr shows the DSN redacted)."""

    dsn: str | None = attrs.field(repr=lambda dsn: "None" if dsn is None else repr(redact_dsn(dsn)))
    schema: str
    namespace: str
    data_dir: Path
    fresh: bool = False
    duration: float = 20.0
    speed: float = 60.0
    lose_every: int = 7
    """Drop the broker's acknowledgement of every n-th publication (0: never)."""
    serve: bool = False
    """After the run, keep the database up and serve the dashboard until Ctrl-C."""


@attrs.define
class DemoSummary:
    """Counts of one demo run."""

    recurring: RelayStatistics = attrs.field(factory=RelayStatistics)
    """What the recurring relay did (the counters :class:`RecurringRelay` keeps)."""
    deliveries: int = 0
    redeliveries: int = 0
    lost_acks: int = 0
    tasks_enqueued: int = 0
    tasks_materialized: int = 0
    tasks_done: int = 0
    tasks_retried: int = 0
    tasks_failed: int = 0
    purged: int = 0
    by_topic: Counter[str] = attrs.field(factory=Counter)
    elapsed: float = 0.0
    simulated: timedelta = timedelta(0)

    def line(self) -> str:
        """Return the one-line, machine-readable summary."""
        r = self.recurring
        return (
            f"summary: ticks={r.ticks} materialized={r.materialized} "
            f"claims={r.claimed} relays={r.published} duplicates={r.duplicates} "
            f"relay_failures={r.relay_failures} lost_acks={self.lost_acks} "
            f"deliveries={self.deliveries} "
            f"tasks_enqueued={self.tasks_enqueued + self.tasks_materialized} "
            f"tasks_done={self.tasks_done} "
            f"tasks_retried={self.tasks_retried} tasks_failed={self.tasks_failed} "
            f"elapsed={self.elapsed:.1f}s simulated={int(self.simulated.total_seconds())}s"
        )


# --- the demo's data directory -----------------------------------------------------------------


def _demo_keyring(data_dir: Path) -> tuple[Keyring, bool]:
    """Load the demo key kept in the data directory, or create it (mode 600)."""
    from steeple.admin.settings import load_keyring, write_key_file
    from steeple.keyring import StorageKey

    path = data_dir / _KEY_FILE
    created = not path.exists()
    if created:
        write_key_file(path, StorageKey.generate(DEMO_KEY_ID))
    return load_keyring(path), created


def demo_settings(namespace: str) -> NamespaceSettings:
    """Return the demo namespace's settings (a 5-minute lease: its clock runs 60x)."""
    return NamespaceSettings(
        namespace,
        max_definitions=100,
        max_occurrences=100_000,
        delivery_window=timedelta(days=1),
        lease_duration=timedelta(seconds=300),
    )


def _toml_string(value: str) -> str:
    # A TOML basic string: JSON's escapes, plus DEL, which TOML wants escaped too.
    return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")


def write_settings_file(options: DemoOptions) -> Path:
    """Write ``steeple.toml`` into the data directory: the demo namespace's settings.

    Every command given ``--config`` with it works on what the demo stored; with the
    embedded server, each starts it for its own run.
    """
    settings = demo_settings(options.namespace)
    lines = [
        "# Written by steeple demo: the settings of the demo's namespace. Every steeple",
        "# command given --config with this file works on what the demo stored.",
    ]
    if options.dsn is None:
        lines.append('embedded = "."  # the embedded PostgreSQL in this directory (pgdata/)')
    else:
        lines.append("# the database: --dsn or STEEPLE_DATABASE_URL, as for the demo")
    lines += [
        f"schema = {_toml_string(options.schema)}",
        f"namespace = {_toml_string(options.namespace)}",
        f"keys_file = {_toml_string(_KEY_FILE)}",
        f"max_definitions = {settings.max_definitions}",
        f"max_occurrences = {settings.max_occurrences}",
        f"delivery_window = {_toml_string(format_duration(settings.delivery_window))}",
        f"lease = {_toml_string(format_duration(settings.lease_duration))}",
        "",
    ]
    path = options.data_dir / _SETTINGS_FILE
    path.write_text("\n".join(lines), encoding="utf-8")
    return path


def _shown_path(path: Path) -> str:
    import shlex

    try:
        relative = os.path.relpath(path)
    except ValueError:
        relative = str(path)
    return shlex.quote(str(path) if relative.startswith("..") else relative)


def print_inspect_commands(options: DemoOptions, config: Path, dsn: str, console: Console) -> None:
    """Print the commands that show what the demo stored (each one exactly as typed)."""
    shown = _shown_path(config)
    if options.dsn is None:
        console.print(
            "inspect what the demo stored (each command starts the embedded PostgreSQL in "
            f"{_shown_path(options.data_dir)} for its run):",
            markup=False,
        )
    else:
        console.print(
            "inspect what the demo stored (with --dsn or STEEPLE_DATABASE_URL naming its "
            f"database, {redact_dsn(dsn)}):",
            markup=False,
        )
    for command in ("schedules", "occurrences", "tasks", "jobs", "keys show"):
        console.print(f"  steeple {command} --config {shown}", markup=False)
    from steeple.admin.serve import TOKEN_RECIPE  # the admin app, only once it is needed

    console.print(
        f"  STEEPLE_ADMIN_TOKEN=$({TOKEN_RECIPE}) steeple admin serve --config {shown}",
        markup=False,
    )
    console.print(
        "or run the demo and keep its dashboard open until Ctrl-C: steeple demo --serve",
        markup=False,
    )


def _definitions(start: datetime) -> list[RecurringDefinition]:
    """Return the demo's recurring publications: both policies, with missed runs."""

    def message(topic: str, kind: str, body: dict[str, Any]) -> ScheduledMessage:
        return ScheduledMessage(topic, kind, json.dumps(body).encode(), {"source": "demo"})

    return [
        RecurringDefinition(
            "heartbeat",
            "* * * * *",
            start - timedelta(minutes=5),
            MissedRunPolicy.CATCH_UP,
            message("demo.heartbeat", "Heartbeat", {"service": "billing"}),
        ),
        RecurringDefinition(
            "digest",
            "*/5 * * * *",
            start - timedelta(minutes=30),
            MissedRunPolicy.COALESCE,
            message("demo.digest", "DigestDue", {"list": "weekly-news"}),
        ),
        RecurringDefinition(
            "cache-refresh",
            "*/2 * * * *",
            start - timedelta(minutes=1),
            MissedRunPolicy.COALESCE,
            message("demo.cache", "RefreshCache", {"cache": "prices"}),
        ),
    ]


# --- the run -----------------------------------------------------------------------------------


def _progress(
    summary: DemoSummary, clock: AcceleratedClock, started: float, duration: float
) -> Panel:
    table = Table.grid(padding=(0, 2))
    table.add_column(justify="right", style="bold")
    table.add_column()
    elapsed = time.monotonic() - started
    table.add_row("demo clock", f"{clock.now():%Y-%m-%d %H:%M:%S} UTC ({clock.speed:g}x)")
    table.add_row("elapsed", f"{min(elapsed, duration):.1f} s of {duration:g} s")
    r = summary.recurring
    table.add_row("ticks", f"{r.ticks} (materialized {r.materialized} occurrences)")
    table.add_row("claims", str(r.claimed))
    table.add_row(
        "relays",
        f"{r.published} ({r.duplicates} duplicates, "
        f"{r.relay_failures} failures, {summary.lost_acks} acknowledgements lost)",
    )
    table.add_row("deliveries", f"{summary.deliveries} consumed from the SQLite journal")
    table.add_row(
        "tasks",
        f"{summary.tasks_done} done, {summary.tasks_retried} retried, "
        f"{summary.tasks_failed} failed of {summary.tasks_enqueued} enqueued "
        f"+ {summary.tasks_materialized} from the recurring job",
    )
    return Panel(table, title="steeple demo", border_style="cyan")


async def run_demo(
    options: DemoOptions,
    console: Console,
    *,
    dashboard: socket.socket | None = None,
    token: str | None = None,
) -> DemoSummary:
    """Run the demo and print live progress, a summary and how to inspect what it stored.

    With ``options.serve``, then serve the dashboard on ``dashboard`` (a bound socket)
    behind ``token`` until SIGINT or SIGTERM, the database still up.

    Raises:
        CliError: the database, the key or the journal is unusable; or the run delivered
            nothing (exit code 1).
    """
    data_dir = options.data_dir
    embedded: EmbeddedPostgres | None = None
    if options.dsn is None:
        embedded = EmbeddedPostgres(data_dir, reset=options.fresh)
        console.print(f"starting the embedded PostgreSQL in {embedded.pgdata} ...", markup=False)
        dsn = await asyncio.to_thread(embedded.start)
    else:
        dsn = options.dsn
        data_dir.mkdir(parents=True, exist_ok=True)
    try:
        console.print(f"database: {redact_dsn(dsn)} (schema {options.schema!r})", markup=False)
        if options.fresh and options.dsn is not None:
            await _drop_schemas(dsn, options.schema)
        summary = await _run(options, dsn, console)
        config = write_settings_file(options)
        if options.serve and dashboard is not None:
            await _serve_dashboard(options, dsn, dashboard, token, console)
        else:
            print_inspect_commands(options, config, dsn, console)
        return summary
    finally:
        if embedded is not None:
            await asyncio.to_thread(embedded.stop)


async def _serve_dashboard(
    options: DemoOptions,
    dsn: str,
    sock: socket.socket,
    token: str | None,
    console: Console,
) -> None:
    import secrets

    from steeple.admin.serve import serve

    keyring, _ = _demo_keyring(options.data_dir)
    target = Target(dsn, options.schema, demo_settings(options.namespace))
    password = token or secrets.token_urlsafe(32)
    if token is None:
        console.print(
            f"dashboard sign-in: any user name, password {password} (made for this run; set "
            "STEEPLE_ADMIN_TOKEN to choose it)",
            markup=False,
        )
    else:
        console.print(
            "dashboard sign-in: any user name, password STEEPLE_ADMIN_TOKEN", markup=False
        )
    with quiet_role_warnings():
        await serve(
            target,
            keyring,
            token=password,
            csrf_token=secrets.token_urlsafe(24),
            sock=sock,
            announce=lambda line: _say(console, line),
        )
    console.print("steeple demo: dashboard stopped", markup=False)


def _say(console: Console, line: str) -> None:
    # Flushed: whoever waits for the dashboard's URL (a person, a script) sees it at once.
    console.print(line, markup=False)
    console.file.flush()


async def _drop_schemas(dsn: str, schema: str) -> None:
    import asyncpg

    from steeple.postgres.teardown import drop_schema

    conn = await asyncpg.connect(dsn, timeout=10)
    try:
        for name in (schema, f"{schema}_queue"):
            await drop_schema(conn, name)
    finally:
        await conn.close()


def _minutes(delta: timedelta) -> str:
    minutes = max(0, round(delta.total_seconds() / 60))
    return f"{minutes // 60} h {minutes % 60} min" if minutes >= 60 else f"{minutes} min"


async def _open_on_demo_time(
    target: Target, keyring: Keyring, speed: float, wall: Clock
) -> tuple[PostgresRecurringStore, AcceleratedClock]:
    """Open the demo namespace on an accelerated clock that never passes real time.

    A new namespace starts :data:`DEMO_BACKDATE` in the past, so runs have hours of schedule
    time to race through before they meet real time (then the clock follows real time). An
    existing namespace resumes at the time it recorded: the store refuses an earlier clock
    and says which time it recorded. That time lives in the namespace's own database and
    schema, so the embedded server and each ``--dsn``/``--schema`` keep their own.

    Raises:
        CliError: the store cannot be opened, or the recorded time is ahead of real time.
    """
    start = wall.now() - DEMO_BACKDATE
    for attempt in range(2):
        clock = AcceleratedClock(start, speed, ceiling=wall)
        try:
            return await initialize_store(target, clock=clock, keyring=keyring), clock
        except CliError as exc:
            cause = exc.__cause__
            recorded = getattr(cause, "recorded_time", None)
            if attempt or not isinstance(cause, RecurringClockError) or recorded is None:
                raise
        ahead = recorded - wall.now()
        if ahead > CLOCK_TOLERANCE:
            raise CliError(
                f"the demo namespace's recorded time is {_minutes(ahead)} ahead of this "
                "machine's clock (an earlier version of the demo ran ahead of real time)",
                code=ExitCode.FAILED,
                hint="run the demo again with --fresh to start over (it drops the demo's data)",
            )
        start = recorded
    raise AssertionError("unreachable: the second attempt returns or raises")


async def _run(options: DemoOptions, dsn: str, console: Console) -> DemoSummary:
    from steeple.brokers.sqlite import SqliteJournalBroker

    data_dir = options.data_dir
    keyring, created = _demo_keyring(data_dir)
    console.print(
        f"{'created' if created else 'using'} the DEMO key {DEMO_KEY_ID!r} in "
        f"{data_dir / _KEY_FILE} (a demo key: never use it for real data)",
        markup=False,
    )
    settings = demo_settings(options.namespace)
    target = Target(dsn, options.schema, settings)
    with quiet_role_warnings() as held:
        store, clock = await _open_on_demo_time(target, keyring, options.speed, SystemClock())
    if any("superuser" in message for message in held):
        console.print(
            "note: the demo connects as a superuser; production runs as a runtime role with "
            "only the grants in grants.sql",
            markup=False,
        )
    started_at = clock.now()
    behind = datetime.now(UTC) - started_at
    console.print(
        f"demo clock: starts at {started_at:%Y-%m-%d %H:%M:%S} UTC, "
        f"{_minutes(behind)} behind real time; runs {clock.speed:g}x and never passes it",
        markup=False,
    )
    summary = DemoSummary()
    try:
        created_names = await _ensure_definitions(store, clock.now())
        if created_names:
            console.print(
                f"created recurring publications: {', '.join(created_names)}", markup=False
            )
        else:
            console.print("recurring publications kept from an earlier run", markup=False)
        journal = SqliteJournalBroker(
            data_dir / _JOURNAL_FILE,
            keyring,
            namespace=options.namespace,
            required_window=settings.delivery_window,
            clock=SystemClock(),
        )
        async with journal:
            broker = _LosingAcknowledgements(journal, options.lose_every, summary)
            await _work(options, dsn, target, store, journal, broker, clock, summary, console)
            summary.purged = await store.purge_terminal(clock.now() - timedelta(hours=2), 100)
            with contextlib.suppress(BrokerError):
                await journal.purge()
    finally:
        await store.close()
    _print_summary(summary, console)
    if summary.deliveries == 0 or summary.tasks_done == 0:
        raise CliError(
            "the demo ran but delivered no messages or finished no tasks",
            code=ExitCode.FAILED,
            hint="run again with --fresh; if it persists, see the PostgreSQL log in the data dir",
        )
    return summary


class _LosingAcknowledgements:
    """Wrap the journal and lose the acknowledgement of every n-th publication, on purpose.

    The message IS stored; the relay only hears "acknowledgement uncertain", records a retry,
    and republishes later under the same idempotency key, which the journal recognises as a
    duplicate: consumers still see each occurrence once.
    """

    def __init__(self, journal: MessageBroker, every: int, summary: DemoSummary) -> None:
        self._journal = journal
        self._every = every
        self._summary = summary
        self._seen = 0
        self._lost: set[str] = set()

    async def publish(
        self, message: ScheduledMessage, *, idempotency_key: str, timeout: float
    ) -> BrokerReceipt:
        receipt = await self._journal.publish(
            message, idempotency_key=idempotency_key, timeout=timeout
        )
        if self._every and idempotency_key not in self._lost:
            self._seen += 1
            if self._seen % self._every == 0:
                self._lost.add(idempotency_key)
                self._summary.lost_acks += 1
                raise RelayAcknowledgementError(receipt, "the demo dropped its acknowledgement")
        return receipt


async def _ensure_definitions(store: Any, now: datetime) -> list[str]:
    existing: set[str] = set()
    cursor: str | None = None
    while True:
        page = await store.schedules(after=cursor, limit=100)
        existing.update(s.name for s in page.items)
        cursor = page.next_cursor
        if cursor is None:
            break
    created = []
    for definition in _definitions(now):
        if definition.name not in existing:
            await store.create(definition)
            created.append(definition.name)
    return created


async def _work(
    options: DemoOptions,
    dsn: str,
    target: Target,
    store: Any,
    journal: Any,
    broker: MessageBroker,
    clock: AcceleratedClock,
    summary: DemoSummary,
    console: Console,
) -> None:
    from steeple.admin import demo_tasks
    from steeple.postgres import RecurringRelay

    stop = asyncio.Event()
    started = time.monotonic()
    schedule_start = clock.now()
    queue = await demo_tasks.prepare(dsn, target.queue_schema, summary, options.duration)

    relayed = asyncio.Event()
    # The loop `steeple worker` runs; its statistics are the demo's recurring counters.
    recurring = RecurringRelay(
        store,
        broker,
        tick_budget=100,
        claim_limit=50,
        idle_interval=0.2,
        statistics=summary.recurring,
    )

    async def relay() -> None:
        try:
            await recurring.run(stop)
        finally:
            relayed.set()

    async def timer() -> None:
        await _sleep_until(stop, options.duration)
        stop.set()

    # The first Ctrl-C (or SIGTERM) ends the run early but gracefully, with the summary; the
    # handlers are then removed, so a second Ctrl-C interrupts at once.
    loop = asyncio.get_running_loop()
    signals: list[signal.Signals] = []

    def stop_early() -> None:
        stop.set()
        for signum in signals:
            loop.remove_signal_handler(signum)

    for signum in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(signum, stop_early)
            signals.append(signum)

    refresh = _progress(summary, clock, started, options.duration)
    with Live(refresh, console=console, refresh_per_second=4, transient=False) as live:

        async def painter() -> None:
            while not stop.is_set():
                summary.tasks_materialized = queue.materialized
                live.update(_progress(summary, clock, started, options.duration))
                await _sleep_until(stop, 0.25)

        async with asyncio.TaskGroup() as group:
            group.create_task(timer())
            group.create_task(relay())
            group.create_task(_consume(journal, summary, relayed))
            group.create_task(queue.run(stop))
            group.create_task(painter())
        for signum in signals:
            loop.remove_signal_handler(signum)
        summary.elapsed = time.monotonic() - started
        summary.simulated = clock.now() - schedule_start
        live.update(_progress(summary, clock, started, options.duration))
    console.print()


async def _consume(journal: Any, summary: DemoSummary, relayed: asyncio.Event) -> None:
    """Consume the journal until the relay has stopped and it is drained.

    So every message published in this run is also consumed in it.
    """
    seen: set[str] = set()
    while True:
        deliveries = await journal.fetch(100)
        for delivery in deliveries:
            if delivery.idempotency_key in seen:
                summary.redeliveries += 1  # consumers deduplicate on the key
            else:
                seen.add(delivery.idempotency_key)
                summary.deliveries += 1
                summary.by_topic[delivery.message.topic] += 1
            await journal.acknowledge(delivery.delivery_id)
        if relayed.is_set() and not deliveries:
            return
        if not deliveries:
            await _sleep_until(relayed, 0.2)


async def _sleep_until(stop: asyncio.Event, seconds: float) -> None:
    """Sleep ``seconds`` or until ``stop`` is set, whichever comes first."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            await stop.wait()


def _print_summary(summary: DemoSummary, console: Console) -> None:
    table = Table(title="summary", show_header=True)
    table.add_column("what")
    table.add_column("count", justify="right")
    r = summary.recurring
    rows = [
        ("ticks", r.ticks),
        ("occurrences materialized", r.materialized),
        ("leases claimed", r.claimed),
        ("relayed to the SQLite journal", r.published),
        ("  of which duplicates (deduplicated)", r.duplicates),
        ("relay failures (retried with backoff)", r.relay_failures),
        ("  of which acknowledgements lost on purpose", summary.lost_acks),
        ("deliveries consumed", summary.deliveries),
        ("tasks enqueued", summary.tasks_enqueued),
        ("tasks from the recurring job", summary.tasks_materialized),
        ("tasks done", summary.tasks_done),
        ("task attempts retried", summary.tasks_retried),
        ("tasks failed for good", summary.tasks_failed),
        ("terminal occurrences purged", summary.purged),
    ]
    for what, count in rows:
        table.add_row(what, str(count))
    topics = ", ".join(f"{topic}: {n}" for topic, n in sorted(summary.by_topic.items()))
    console.print(Group(table))
    if topics:
        console.print(f"deliveries by topic: {topics}", markup=False)
    console.print(
        f"ran {summary.elapsed:.1f} s of real time = "
        f"{summary.simulated.total_seconds() / 60:.0f} minutes of schedule time",
        markup=False,
    )
    console.print(summary.line(), markup=False)
