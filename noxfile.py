"""nox sessions for steeple: lint, typecheck, tests, stress, core (driverless), isolated, bench,
mutants, demo.

Sessions reuse uv for speed and never download an interpreter.

``nox -s isolated`` installs each package of ``packages/`` alone, as a user would, and
imports every module it ships (see :func:`isolated`).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
import tomllib
from pathlib import Path
from typing import Any, TypedDict

import nox
import nox.command
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

nox.options.default_venv_backend = "uv"
nox.options.sessions = ["lint", "typecheck", "tests"]
os.environ.setdefault("UV_PYTHON_DOWNLOADS", "never")

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
from dev import mypy_runs  # noqa: E402 - one definition of mypy's runs, shared with dev.py

PACKAGES = sorted(p.parent.name for p in ROOT.glob("packages/*/pyproject.toml"))


def _sync(session: nox.Session) -> None:
    session.run_install(
        "uv",
        "sync",
        "--frozen",
        "--all-packages",
        "--all-extras",
        env={"UV_PROJECT_ENVIRONMENT": session.virtualenv.location},
    )


@nox.session
def lint(session: nox.Session) -> None:
    _sync(session)
    session.run("ruff", "format", "--check", ".")
    session.run("ruff", "check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    _sync(session)
    for args in mypy_runs():  # the configured files, then each helper test directory alone
        session.run("mypy", *args)


@nox.session
def tests(session: nox.Session) -> None:
    _sync(session)
    session.run("pytest", *session.posargs)


@nox.session
def core(session: nox.Session) -> None:
    """Core's tests in an environment with no driver installed."""
    session.install(
        "-e",
        "packages/core",
        "-e",
        "packages/engine",
        "-e",
        "packages/testing",
        "pytest",
        "pytest-asyncio",
        "pytest-timeout",
        "hypothesis",
    )
    session.run("pytest", "-p", "no:cacheprovider", "packages/core/tests", *session.posargs)


# --- each package installed alone --------------------------------------------------------------

# A module named like one of its package's extras (``steeple.brokers.nats`` for the ``nats``
# extra), with its submodules, is behind that extra; every other module must import with
# no extra at all. Modules that are not behind an extra of the same name are listed here.
BEHIND_EXTRA: dict[str, str] = {}

# Modules loaded by a host program that is not a dependency: a pytest plugin needs pytest.
# They are imported after the host alone is added to the package's environment.
HOSTED: dict[str, str] = {"steeple.testing.pytest_plugin": "pytest"}

# A short smoke test per package (and per ``package[extra]``): Python code run in its clean
# environment, whose bin directory is first on PATH.
SMOKE: dict[str, str] = {
    "core": """
from datetime import UTC, datetime
from steeple.core import CronCalendar, InvalidCronExpression
calendar = CronCalendar.parse("*/15 9-17 * * mon-fri")
after = calendar.next_after(datetime(2031, 3, 8, 12, 0, tzinfo=UTC))  # a Saturday
assert after == datetime(2031, 3, 10, 9, 0, tzinfo=UTC), after
try:
    CronCalendar.parse("61 * * * *")
except InvalidCronExpression:
    pass
else:
    raise AssertionError("minute 61 was accepted")
""",
    "engine": """
import sys
from steeple.engine import RecurringEngine, RecurringRelay, RelayStatistics
from steeple.engine.ports import RecurringStorage
clients = {"asyncpg", "psycopg", "nats", "redis", "aio_pika"} & set(sys.modules)
assert not clients, f"import steeple.engine loaded client libraries: {clients}"
assert RelayStatistics().published == 0
""",
    "keyring": """
from steeple.keyring import Keyring, StorageKey
keyring = Keyring(StorageKey.generate("k1"))
sealed = keyring.seal(b"payload", namespace="n", purpose="p", identity="i")
assert b"payload" not in sealed
assert keyring.open(sealed, namespace="n", purpose="p", identity="i") == b"payload"
""",
    "postgres": """
import sys
from steeple.postgres import PostgresRecurringStore
from steeple.postgres.queue import EnqueueOptions, Task
task = Task("send-report")
assert task.name == "send-report"
EnqueueOptions.immediate()
""",
    "brokers": """
import sys
import steeple.brokers
clients = {"nats", "redis", "aio_pika", "asyncpg", "psycopg"} & set(sys.modules)
assert not clients, f"import steeple.brokers loaded client libraries: {clients}"
""",
    "brokers[sqlite]": """
import asyncio, tempfile
from pathlib import Path
from steeple.brokers.sqlite import SqliteJournalBroker
from steeple.core import ScheduledMessage

class Sealer:  # the keyring is the caller's: steeple-brokers does not depend on it
    primary_key_id = "k1"
    def seal(self, plaintext, *, namespace, purpose, identity):
        return b"sealed:" + plaintext
    def open(self, sealed, *, namespace, purpose, identity):
        return sealed.removeprefix(b"sealed:")

async def main():
    path = Path(tempfile.mkdtemp()) / "journal.db"
    async with SqliteJournalBroker(path, Sealer()) as journal:
        message = ScheduledMessage("t", "m", b"p")
        first = await journal.publish(message, idempotency_key="k", timeout=10)
        again = await journal.publish(message, idempotency_key="k", timeout=10)
        assert not first.duplicate and again.duplicate

asyncio.run(main())
""",
    "sqlite": """
import asyncio, sys, tempfile
from datetime import UTC, datetime, timedelta
from pathlib import Path
from steeple.core import (
    MissedRunPolicy, RecurringConfig, RecurringDefinition, ScheduledMessage, SystemClock,
)
from steeple.sqlite import SqliteRecurringStore

class Sealer:  # the keyring is the caller's: steeple-sqlite does not depend on it
    primary_key_id = "k1"
    def seal(self, plaintext, *, namespace, purpose, identity):
        return b"sealed:" + plaintext
    def open(self, sealed, *, namespace, purpose, identity):
        return sealed.removeprefix(b"sealed:")

async def main():
    path = Path(tempfile.mkdtemp()) / "recurring.db"
    config = RecurringConfig("smoke", max_definitions=10, max_occurrences=100)
    async with await SqliteRecurringStore.initialize(path, config, Sealer(), SystemClock()) as s:
        await s.create(RecurringDefinition(
            "every-minute", "* * * * *", datetime.now(UTC) - timedelta(minutes=3),
            MissedRunPolicy.CATCH_UP, ScheduledMessage("t", "m", b"p"),
        ))
    async with await SqliteRecurringStore.connect(path, config, Sealer(), SystemClock()) as s:
        assert (await s.tick(100)).materialized == 3
    assert not {"asyncpg", "psycopg", "cryptography"} & set(sys.modules), sys.modules.keys()

asyncio.run(main())
""",
    "testing": """
from datetime import UTC, datetime, timedelta
from steeple.testing import FakeClock
clock = FakeClock(datetime(2031, 1, 1, tzinfo=UTC))
clock.advance(timedelta(minutes=5))
assert clock.now() == datetime(2031, 1, 1, 0, 5, tzinfo=UTC)
""",
    "admin": """
import shutil, socket, subprocess
steeple = shutil.which("steeple")
assert steeple, "no steeple command"
for args in (["--help"], ["migrate", "--help"]):
    done = subprocess.run([steeple, *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
# migrate runs the work queue's code up to connecting: a server that refuses the
# connection (a bound socket that never listens) must give exit 4, "connection refused".
with socket.socket() as refusing:
    refusing.bind(("127.0.0.1", 0))
    dsn = f"postgresql://postgres@127.0.0.1:{refusing.getsockname()[1]}/none"
    done = subprocess.run(
        [steeple, "migrate", "--dsn", dsn], capture_output=True, text=True, timeout=60
    )
assert done.returncode == 4 and "connection refused" in done.stderr, (
    done.returncode, done.stdout + done.stderr
)
""",
}

# Run inside each clean environment: import every module of the package (recursing into
# subpackages), except those listed as skipped; print one JSON line of failures.
_IMPORT_ALL = """
import importlib, json, pkgutil, sys, traceback
root, skipped = sys.argv[1], json.loads(sys.argv[2])
failures, imported = {}, []

def skip(name):
    return any(name == s or name.startswith(s + ".") for s in skipped)

def visit(name):
    if skip(name):
        return
    try:
        module = importlib.import_module(name)
    except BaseException as exc:
        failures[name] = traceback.format_exception_only(exc)[-1].strip()
        return
    imported.append(name)
    for info in pkgutil.iter_modules(getattr(module, "__path__", []), name + "."):
        visit(info.name)

visit(root)
print(json.dumps({"imported": imported, "failures": failures}))
"""


_Project = TypedDict(
    "_Project",
    {"name": str, "dependencies": list[str], "optional-dependencies": dict[str, list[str]]},
    total=False,
)


def _project(package: str) -> _Project:
    """The ``[project]`` table of ``packages/<package>/pyproject.toml``."""
    with (ROOT / "packages" / package / "pyproject.toml").open("rb") as f:
        table: dict[str, Any] = tomllib.load(f)
    project: _Project = table["project"]
    return project


def _extras(package: str) -> list[str]:
    return sorted(_project(package).get("optional-dependencies", {}))


def _module_root(package: str) -> str:
    """The import name of a package's code: ``steeple.<dir>`` under ``src/steeple``."""
    roots = [p for p in (ROOT / "packages" / package / "src" / "steeple").iterdir() if p.is_dir()]
    names = [p.name for p in roots if (p / "__init__.py").exists()]
    if len(names) != 1:
        raise RuntimeError(f"packages/{package}: expected one package under src/steeple/")
    return f"steeple.{names[0]}"


def _requirements(package: str, extra: str | None) -> list[Requirement]:
    project = _project(package)
    deps = list(project.get("dependencies", []))
    if extra is not None:
        deps += project.get("optional-dependencies", {})[extra]
    return [Requirement(d) for d in deps]


def _workspace_closure(package: str, extra: str | None) -> dict[str, set[str]]:
    """The workspace packages ``package[extra]`` needs (directory -> extras), itself too.

    They are not on PyPI, so each is installed from its own freshly built wheel.
    """
    by_name = {canonicalize_name(_project(p)["name"]): p for p in PACKAGES}
    needed: dict[str, set[str]] = {}
    seen: set[tuple[str, str | None]] = set()
    todo: list[tuple[str, str | None]] = [(package, extra)]
    while todo:
        current, current_extra = todo.pop()
        if (current, current_extra) in seen:
            continue
        seen.add((current, current_extra))
        extras = needed.setdefault(current, set())
        if current_extra is not None:
            extras.add(current_extra)
        for req in _requirements(current, current_extra):
            sibling = by_name.get(canonicalize_name(req.name))
            if sibling is not None:
                todo.append((sibling, None))
                todo.extend((sibling, e) for e in req.extras)
    return needed


def _skipped_modules(package: str, extra: str | None) -> list[str]:
    """Modules not imported in ``package[extra]``'s environment: other extras' and hosted."""
    root = _module_root(package)
    behind = {f"{root}.{e}": e for e in _extras(package)}
    behind.update({m: e for m, e in BEHIND_EXTRA.items() if m.startswith(root + ".")})
    skipped = [m for m, e in behind.items() if e != extra]
    return skipped + [m for m in HOSTED if m.startswith(root + ".")]


@nox.session(venv_backend="none")
def isolated(session: nox.Session) -> None:
    """Each package built and installed alone, with only what it declares, then imported.

    For every package under ``packages/`` (found afresh, so a new one is covered), and for
    its base install and then each extra separately: a clean uv virtualenv gets the
    package's freshly built wheel (``package[extra]``) plus the wheels of the workspace
    packages it depends on (they are not on PyPI); everything else comes from PyPI as
    its declared dependencies say. Then every module of the package is imported (modules
    behind an extra only when that extra is installed; see ``BEHIND_EXTRA``, ``HOSTED``)
    and its smoke test runs (``SMOKE``). Any failure fails the session, after all
    packages were tried. ``nox -s isolated -- core admin`` limits it to some packages.
    """
    beside = Path(sys.executable).parent / "uv"  # nox runs from .venv, where dev.py put uv
    uv = str(beside) if beside.exists() else shutil.which("uv")
    if uv is None:
        session.error("uv is needed (python3 dev.py lint puts it in .venv/bin)")
    chosen = session.posargs or PACKAGES
    unknown = sorted(set(chosen) - set(PACKAGES))
    if unknown:
        session.error(f"no such package under packages/: {', '.join(unknown)}")
    python = os.environ.get("STEEPLE_ISOLATED_PYTHON", sys.executable)
    work = Path(tempfile.mkdtemp(prefix="steeple-isolated-"))
    wheels: dict[str, Path] = {}
    started = time.monotonic()
    failed: list[str] = []
    try:
        # Every command runs from this directory: nothing of the source tree is importable.
        session.chdir(work)
        wheelhouse = work / "wheels"
        for package in PACKAGES:
            session.run(
                uv, "build", "--quiet", "--wheel", "--out-dir", str(wheelhouse / package),
                str(ROOT / "packages" / package), external=True,
            )  # fmt: skip
            (wheels[package],) = (wheelhouse / package).glob("*.whl")
        for package in chosen:
            for extra in [None, *_extras(package)]:
                label = package if extra is None else f"{package}[{extra}]"
                problems = _check_alone(session, uv, python, work, wheels, package, extra)
                if problems:
                    failed.append(label)
                    session.warn(f"{label}: FAILED\n  " + "\n  ".join(problems))
                else:
                    session.log(f"{label}: ok")
    finally:
        session.chdir(ROOT)
        shutil.rmtree(work, ignore_errors=True)
    session.log(f"isolated installs took {time.monotonic() - started:.1f} s")
    if failed:
        session.error(f"packages that do not work installed alone: {', '.join(failed)}")


def _check_alone(
    session: nox.Session,
    uv: str,
    python: str,
    work: Path,
    wheels: dict[str, Path],
    package: str,
    extra: str | None,
) -> list[str]:
    """Install ``package[extra]`` alone in a fresh venv, import everything, smoke-test it."""
    env_dir = work / (package if extra is None else f"{package}-{extra}")
    bin_dir = env_dir / ("Scripts" if os.name == "nt" else "bin")
    env_python = str(bin_dir / "python")
    session.run(uv, "venv", "--quiet", "--python", python, str(env_dir), external=True)
    specs = []
    for sibling, extras in sorted(_workspace_closure(package, extra).items()):
        name = _project(sibling)["name"]
        wanted = f"[{','.join(sorted(extras))}]" if extras else ""
        specs.append(f"{name}{wanted} @ {wheels[sibling].as_uri()}")
    session.run(
        uv, "pip", "install", "--quiet", "--python", env_python, *specs, external=True
    )  # fmt: skip
    # Python runs isolated (-I) from an empty directory: only what was installed is
    # importable; no STEEPLE_* setting points a smoke test at a real server.
    clean = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PYTHON", "VIRTUAL_ENV", "STEEPLE_"))
    }
    clean["PATH"] = f"{bin_dir}{os.pathsep}{clean.get('PATH', '')}"
    root = _module_root(package)
    out = session.run(
        env_python, "-I", "-c", _IMPORT_ALL, root, json.dumps(_skipped_modules(package, extra)),
        external=True, silent=True, env=clean, include_outer_env=False, log=False,
    )  # fmt: skip
    lines = [line for line in str(out).splitlines() if line.startswith('{"imported"')]
    if not lines:
        return [f"importing {_module_root(package)}'s modules crashed:\n{out}"]
    report = json.loads(lines[-1])
    problems = [f"import {name}: {why}" for name, why in sorted(report["failures"].items())]
    session.log(f"  imported {len(report['imported'])} modules of {root}")
    for module, host in HOSTED.items():
        if extra is None and module.startswith(root + "."):
            session.run(
                uv, "pip", "install", "--quiet", "--python", env_python, host, external=True
            )  # fmt: skip
            problems += _try(session, f"import {module}", env_python, clean)
    label = package if extra is None else f"{package}[{extra}]"
    if label in SMOKE:
        problems += _try(session, SMOKE[label], env_python, clean, what=f"smoke test of {label}")
    return problems


def _try(
    session: nox.Session, code: str, python: str, env: dict[str, str], *, what: str = ""
) -> list[str]:
    """Run Python ``code``; a failure is reported (nox shows its output), not raised."""
    what = what or code
    session.log(f"  {what}")
    try:
        session.run(
            python, "-I", "-c", code,
            external=True, silent=True, env=env, include_outer_env=False, log=False,
        )  # fmt: skip
    except nox.command.CommandFailed as exc:
        return [f"{what}: {exc.reason or 'failed'}"]
    return []


@nox.session
def stress(session: nox.Session) -> None:
    """The full relay stress run: 60 s of kills and broker connection cuts per broker.

    The test suite runs the same test for 10 s per broker; ``STEEPLE_RELAY_STRESS_SEED``
    replays a printed seed. Needs PostgreSQL (``STEEPLE_TEST_DSN``), NATS, Redis and
    RabbitMQ, like the suite.
    """
    _sync(session)
    session.run(
        "pytest",
        "-p",
        "no:cacheprovider",
        "-s",
        "packages/brokers/tests/test_relay_stress.py",
        *session.posargs,
        env={"STEEPLE_RELAY_STRESS_SECONDS": os.environ.get("STEEPLE_RELAY_STRESS_SECONDS", "60")},
    )


@nox.session
def bench(session: nox.Session) -> None:
    _sync(session)
    for script in (
        "bench_calendar.py",
        "bench_zoned.py",
        "bench_queue.py",
        "bench_recurring.py",
        "bench_recurring_pipeline.py",
        "bench_simulate.py",
    ):
        if os.path.exists(f"benchmarks/{script}"):
            session.run("python", f"benchmarks/{script}", *session.posargs)


@nox.session(name="bench-compare")
def bench_compare(session: nox.Session) -> None:
    """The work queue's speed at a base commit beside the work tree's, interleaved in one run.

    ``nox -s bench-compare -- BASE [--rounds 5] [--n 20000] [--threshold 0.10]``: BASE's
    tree is exported (``git archive``) into a scratch directory; it and the work tree are
    each synced into a scratch venv the same way; then ``benchmarks/bench_compare.py``
    alternates a measurement of BASE and one of the work tree, each in its own process,
    against ``STEEPLE_TEST_DSN`` (or a private pgserver cluster: ``--private``), prints the
    medians and their ratio, and fails when a median dropped by more than the threshold.
    """
    if not session.posargs or session.posargs[0].startswith("-"):
        session.error("usage: nox -s bench-compare -- BASE [--rounds R] [--n N] [--threshold T]")
    base, *options = session.posargs
    commit = str(
        session.run(
            "git", "rev-parse", "--verify", f"{base}^{{commit}}", external=True, silent=True
        )
    ).strip()
    _sync(session)
    scratch = Path(tempfile.mkdtemp(prefix="steeple-bench-base-"))
    try:
        tree = scratch / "tree"
        tree.mkdir()
        archive = scratch / "base.tar"
        session.run("git", "archive", "--output", str(archive), commit, external=True)
        shutil.unpack_archive(archive, tree)
        # Both sides are installed alike (the packages and their runtime dependencies, no
        # extras or dev tools), so a package on one side only makes no difference; this
        # session's own venv, which has them, only runs the comparison.
        venvs = {"base": scratch / "base-venv", "head": scratch / "head-venv"}
        for side, directory in (("base", tree), ("head", ROOT)):
            session.run_install(
                "uv", "sync", "--frozen", "--all-packages", "--no-dev",
                "--directory", str(directory),
                env={"UV_PROJECT_ENVIRONMENT": str(venvs[side])},
            )  # fmt: skip
        session.run(
            "python", "benchmarks/bench_compare.py",
            "--base-python", str(venvs["base"] / "bin" / "python"),
            "--head-python", str(venvs["head"] / "bin" / "python"),
            "--base-label", f"{base} ({commit[:12]})",
            *options,
        )  # fmt: skip
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


@nox.session
def crashmatrix(session: nox.Session) -> None:
    """Every crash point x (SIGKILL, immediate PostgreSQL restart), not the per-run sample.

    Needs ``STEEPLE_TEST_DSN`` (the SIGKILL half) and pgserver (private clusters for the
    restarts). ``STEEPLE_CRASH_SEED`` is irrelevant here: nothing is sampled.
    """
    _sync(session)
    session.run(
        "pytest",
        "-p",
        "no:cacheprovider",
        "tests/test_fault_crash_points.py",
        "tests/test_fault_crash_points_queue.py",
        "tests/test_crash_points_registry.py",
        *session.posargs,
        env={"STEEPLE_CRASH_MATRIX": "all"},
    )


@nox.session
def mutants(session: nox.Session) -> None:
    """Apply each mutant of ``mutants/catalogue.toml`` and require its tests to kill it.

    Arguments after ``--`` go to ``mutants/run.py``: ``--sample N --seed S --budget SECONDS``
    for a replayable sample, ``--only NAME``, ``--area AREA``, ``--results FILE``, ``--list``.
    A surviving mutant, a canary that survives or an anchor text that is missing or occurs
    more than once fails the session.
    """
    _sync(session)
    session.env.setdefault("STEEPLE_TEST_DSN", "postgresql://postgres@127.0.0.1:5432/test")
    session.run("python", "mutants/run.py", *session.posargs)


@nox.session
def demo(session: nox.Session) -> None:
    _sync(session)
    session.run("steeple", "demo", *session.posargs)


# --- documentation site (issue 14.4) ------------------------------------------------------
@nox.session
def docs(session: nox.Session) -> None:
    """Build the site (mkdocs.yml, docs/) with --strict: a broken reference, page or link fails."""
    session.run_install(
        "uv",
        "sync",
        "--frozen",
        "--all-packages",
        "--all-extras",
        "--group",
        "docs",
        env={"UV_PROJECT_ENVIRONMENT": session.virtualenv.location},
    )
    site = os.path.join(session.create_tmp(), "site")
    session.run(
        "mkdocs",
        "build",
        "--strict",
        "--site-dir",
        site,
        *session.posargs,
        env={"NO_MKDOCS_2_WARNING": "1"},
    )
