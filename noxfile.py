"""nox sessions for steeple: lint, typecheck, tests, stress, soak, failover, core
(driverless), isolated, wheels, bench, bench-compare, bloat, backlog, scale, pgbouncer,
mutants, mutmut-core, demo, docs.

Sessions reuse uv for speed and never download an interpreter.

``nox -s isolated`` installs each package of ``packages/`` alone, as a user would, and
imports every module it ships (see :func:`isolated`); ``nox -s wheels`` builds every sdist
and wheel and installs ``steeple[all]`` from them with pip, as a user would (see :func:`wheels`).
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
    session.run("lint-imports", "--no-cache")  # the arrows between the packages


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
        "packages/runtime",
        "-e",
        "packages/engine",
        "-e",
        "packages/brokers",
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
BEHIND_EXTRA: dict[str, str] = {
    # The simulator's plots import the simulator (steeple-testing): both extras bring it.
    "steeple.admin.simulate_plot": "simulate",
}

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
    "runtime": """
import sys
from steeple.runtime import CRASH_POINTS, crash_point, register_crash_points
register_crash_points({"smoke.step": "smoke: a registered step"})
crash_point("smoke.step")  # unarmed: nothing happens
assert dict(CRASH_POINTS) == {"smoke.step": "smoke: a registered step"}
assert not {"steeple.engine", "steeple.postgres"} & set(sys.modules)
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
# The test kit is not a dependency of the command: `steeple simulate` names its extra.
import importlib.util
assert importlib.util.find_spec("hypothesis") is None, "steeple-admin installed hypothesis"
done = subprocess.run(
    [steeple, "simulate", "--cron", "* * * * *", "--days", "1"],
    capture_output=True, text=True, timeout=60,
)
assert done.returncode == 3 and "steeple-admin[simulate]" in done.stderr, (
    done.returncode, done.stdout + done.stderr
)
""",
    # The meta-distribution: the domain alone, then what its extras promise.
    "steeple": """
import importlib.util
import steeple.core
assert importlib.util.find_spec("steeple.postgres") is None, "steeple alone installed postgres"
""",
    "steeple[queue]": """
import shutil, subprocess
from steeple.admin.embedded import database_url
from steeple.postgres.queue import App
steeple = shutil.which("steeple")
assert steeple, "no steeple command"
for args in (["--help"], ["worker", "--help"], ["migrate", "--help"]):
    done = subprocess.run([steeple, *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
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
    {
        "name": str,
        "version": str,
        "dependencies": list[str],
        "optional-dependencies": dict[str, list[str]],
    },
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


def _has_code(package: str) -> bool:
    """Whether a package ships modules (``steeple``, the meta-distribution, ships none)."""
    return (ROOT / "packages" / package / "src").is_dir()


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


def _skipped_modules(package: str, extras: set[str]) -> list[str]:
    """Modules not imported where ``package[extras]`` is installed: other extras' and hosted."""
    root = _module_root(package)
    behind = {f"{root}.{e}": e for e in _extras(package)}
    behind.update({m: e for m, e in BEHIND_EXTRA.items() if m.startswith(root + ".")})
    skipped = [m for m, e in behind.items() if e not in extras]
    return skipped + [m for m in HOSTED if m.startswith(root + ".")]


def _imported_roots(package: str, extra: str | None) -> list[tuple[str, list[str]]]:
    """The module trees to import in ``package[extra]``'s environment, each with its skips.

    A package's own code; for the meta-distribution, which has none, the code of every
    workspace package its extra installs (with the extras it installs them with).
    """
    if _has_code(package):
        return [
            (_module_root(package), _skipped_modules(package, set() if extra is None else {extra}))
        ]
    closure = _workspace_closure(package, extra)
    return [
        (_module_root(sibling), _skipped_modules(sibling, extras))
        for sibling, extras in sorted(closure.items())
        if _has_code(sibling)
    ]


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
    problems: list[str] = []
    for root, skipped in _imported_roots(package, extra):
        out = session.run(
            env_python, "-I", "-c", _IMPORT_ALL, root, json.dumps(skipped),
            external=True, silent=True, env=clean, include_outer_env=False, log=False,
        )  # fmt: skip
        lines = [line for line in str(out).splitlines() if line.startswith('{"imported"')]
        if not lines:
            problems.append(f"importing {root}'s modules crashed:\n{out}")
            continue
        report = json.loads(lines[-1])
        problems += [f"import {name}: {why}" for name, why in sorted(report["failures"].items())]
        session.log(f"  imported {len(report['imported'])} modules of {root}")
    for module, host in HOSTED.items():
        if extra is None and _has_code(package) and module.startswith(_module_root(package) + "."):
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


# --- the distributions as a user installs them ------------------------------------------------

# The README's work-queue tour (the README holds this file verbatim; the tests run it too).
QUEUE_TOUR = ROOT / "packages" / "admin" / "tests" / "readme_snippets" / "queue_tour.py"

# Run in the fresh environment: every steeple distribution installed there, by name, with its
# METADATA text (compared with the built wheels': nothing may come from anywhere else), and
# where the steeple namespace and the command's code were imported from.
_INSTALLED = """
import json, importlib.metadata as md
import steeple, steeple.admin
dists = {}
for dist in md.distributions():
    name = dist.metadata["Name"]
    if name == "steeple" or name.startswith("steeple-"):
        dists[name] = dist.read_text("METADATA")
print(json.dumps({"dists": dists, "namespace": list(steeple.__path__),
                  "init": getattr(steeple, "__file__", None), "admin": steeple.admin.__file__}))
"""

# Run in the fresh environment when STEEPLE_TEST_DSN is set: drop the tour's schema.
_DROP_SCHEMA = """
import asyncio, sys, asyncpg
async def main(dsn, schema):
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    finally:
        await conn.close()
asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


def _check_built(dist: Path) -> list[str]:
    """Each package's sdist and wheel exist and carry their metadata and licence."""
    import email.parser
    import tarfile
    import zipfile

    problems = []
    for package in PACKAGES:
        meta = _project(package)
        stem = f"{canonicalize_name(meta['name']).replace('-', '_')}-{meta['version']}"
        wheel, sdist = dist / f"{stem}-py3-none-any.whl", dist / f"{stem}.tar.gz"
        if not wheel.exists() or not sdist.exists():
            problems.append(f"{package}: no {wheel.name} or no {sdist.name}")
            continue
        with zipfile.ZipFile(wheel) as archive:
            files = archive.namelist()
            info = email.parser.Parser().parsestr(
                archive.read(f"{stem}.dist-info/METADATA").decode()
            )
        if "steeple/__init__.py" in files:
            problems.append(f"{wheel.name} ships steeple/__init__.py (steeple is a namespace)")
        if f"{stem}.dist-info/licenses/LICENSE" not in files:
            problems.append(f"{wheel.name}: no licenses/LICENSE")
        if info["License-Expression"] != "Apache-2.0" or info["License-File"] != "LICENSE":
            problems.append(f"{wheel.name}: license metadata {info['License-Expression']!r}")
        if info["Description-Content-Type"] != "text/markdown" or not info.get_payload():
            problems.append(f"{wheel.name}: no readme in its metadata")
        if not info.get_all("Classifier"):
            problems.append(f"{wheel.name}: no classifiers")
        with tarfile.open(sdist) as archive:
            names = set(archive.getnames())
        missing = {f"{stem}/{f}" for f in ("LICENSE", "README.md", "pyproject.toml", "PKG-INFO")}
        if missing - names:
            problems.append(f"{sdist.name}: missing {sorted(missing - names)}")
    return problems


@nox.session(venv_backend="none")
def wheels(session: nox.Session) -> None:
    """Every package built (sdist and wheel), installed with plain pip away from the checkout.

    ``uv build --all-packages`` builds each package's sdist, then its wheel from that sdist,
    into a temporary directory, and their metadata is checked (licence expression and file,
    readme, classifiers; no ``steeple/__init__.py``). A fresh virtual environment of the
    machine's Python (``STEEPLE_WHEELS_PYTHON``, else ``python3`` on PATH) gets
    ``pip install --find-links DIR "steeple[all]"`` (third-party dependencies come from the
    index): every steeple distribution must be installed, each from these wheels, and
    ``pip check`` must pass. Then, from a temporary directory, ``steeple --help`` and the
    README's queue tour run (on ``STEEPLE_TEST_DSN`` in a schema of their own, dropped
    afterwards; without it on the embedded PostgreSQL). ``nox -s isolated`` checks each
    extra of ``steeple`` alone.
    """
    beside = Path(sys.executable).parent / "uv"
    uv = str(beside) if beside.exists() else shutil.which("uv")
    python = os.environ.get("STEEPLE_WHEELS_PYTHON") or shutil.which("python3")
    if uv is None or python is None:
        session.error("needs uv (python3 dev.py lint puts it in .venv/bin) and python3")
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="steeple-wheels-"))
    if work.resolve().is_relative_to(ROOT):
        session.error(f"the temporary directory {work} is inside the checkout")
    dist, env_dir, cwd = work / "dist", work / "venv", work / "cwd"
    cwd.mkdir()
    bin_dir = env_dir / ("Scripts" if os.name == "nt" else "bin")
    env_python = str(bin_dir / "python")
    # Nothing of the outer environment steers the install or the tour: no virtualenv, no
    # PYTHONPATH, no STEEPLE_* setting but the ones given below.
    clean = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PYTHON", "VIRTUAL_ENV", "STEEPLE_"))
    }
    clean["PATH"] = f"{bin_dir}{os.pathsep}{clean.get('PATH', '')}"
    pip = [env_python, "-m", "pip", "install", "--quiet", "--find-links", str(dist)]

    def run(*args: str, **kw: Any) -> str:
        out = session.run(*args, external=True, env=clean, include_outer_env=False, **kw)
        return str(out)

    dsn = os.environ.get("STEEPLE_TEST_DSN")
    schema = f"steeple_wheels_{os.getpid()}"
    try:
        session.chdir(ROOT)
        session.run(uv, "build", "--quiet", "--all-packages", "--out-dir", str(dist), external=True)
        problems = _check_built(dist)
        if problems:
            session.error("the built distributions are incomplete:\n  " + "\n  ".join(problems))
        built = time.monotonic()
        session.chdir(cwd)  # nothing of the checkout is importable from here
        run(python, "-m", "venv", str(env_dir))
        run(*pip, "steeple[all]")
        run(env_python, "-m", "pip", "check")
        installed = time.monotonic()
        report = json.loads(run(env_python, "-I", "-c", _INSTALLED, silent=True).splitlines()[-1])
        problems = _check_installed(dist, env_dir, report)
        if problems:
            session.error("steeple[all] is not what was built:\n  " + "\n  ".join(problems))
        run(str(bin_dir / "steeple"), "--help", silent=True)
        shutil.copy(QUEUE_TOUR, cwd / QUEUE_TOUR.name)
        tour_env = dict(clean)
        if dsn:
            tour_env.update(STEEPLE_DATABASE_URL=dsn, STEEPLE_QUEUE_SCHEMA=schema)
        out = session.run(
            env_python, "-I", QUEUE_TOUR.name,
            external=True, env=tour_env, include_outer_env=False, silent=True,
        )  # fmt: skip
        lines = str(out).splitlines()
        if "succeeded" not in lines[-1:] or not any("{'width': 256}" in x for x in lines):
            session.error(f"the queue tour did not print what the README shows:\n{out}")
    finally:
        if dsn and (bin_dir / "python").exists():
            session.run(
                env_python, "-I", "-c", _DROP_SCHEMA, dsn, schema,
                external=True, env=clean, include_outer_env=False, success_codes=[0, 1],
            )  # fmt: skip
        session.chdir(ROOT)
        shutil.rmtree(work, ignore_errors=True)
    session.log(
        f"wheels: built and checked in {built - started:.1f} s, steeple[all] installed in "
        f"{installed - built:.1f} s, checked and toured in {time.monotonic() - installed:.1f} s"
    )


def _check_installed(dist: Path, env_dir: Path, report: dict[str, Any]) -> list[str]:
    """Every distribution is installed, from the wheel built here; steeple is a namespace."""
    import zipfile

    problems = []
    for package in PACKAGES:
        meta = _project(package)
        name = meta["name"]
        stem = f"{canonicalize_name(name).replace('-', '_')}-{meta['version']}"
        with zipfile.ZipFile(dist / f"{stem}-py3-none-any.whl") as archive:
            built = archive.read(f"{stem}.dist-info/METADATA").decode()
        installed = report["dists"].get(name)
        if installed is None:
            problems.append(f"{name} is not installed")
        elif installed != built:
            problems.append(f"{name} was installed from elsewhere, not the wheel built here")
    if report["init"] is not None:
        problems.append(f"steeple is a regular package ({report['init']}), not a namespace")
    if not Path(report["admin"]).resolve().is_relative_to(env_dir.resolve()):
        problems.append(f"steeple.admin was imported from {report['admin']}")
    return problems


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
def failover(session: nox.Session) -> None:
    """The failover tests with long load phases (``STEEPLE_FAILOVER_SECONDS``, default 30).

    A synchronous standby promoted under load, the old primary back as a stale node, and
    an asynchronous standby's lost tail re-run and republished; the suite runs the same
    tests with 2-second phases. Needs pgserver (private clusters) only.
    """
    _sync(session)
    session.run(
        "pytest",
        "-p",
        "no:cacheprovider",
        "tests/test_failover.py",
        *session.posargs,
        env={"STEEPLE_FAILOVER_SECONDS": os.environ.get("STEEPLE_FAILOVER_SECONDS", "30")},
    )


@nox.session
def pgbouncer(session: nox.Session) -> None:
    """steeple through a real PgBouncer in transaction mode, with 10 pooler restarts.

    The test suite runs the same tests with one restart. Needs PostgreSQL
    (``STEEPLE_TEST_DSN``) and Debian's ``pgbouncer``.
    """
    _sync(session)
    session.run(
        "pytest",
        "-p",
        "no:cacheprovider",
        "tests/test_pgbouncer.py",
        *session.posargs,
        env={"STEEPLE_PGBOUNCER_RESTARTS": os.environ.get("STEEPLE_PGBOUNCER_RESTARTS", "10")},
    )


@nox.session
def soak(session: nox.Session) -> None:
    """Hours of uptime: ``steeple worker`` processes under load, resets, restarts and kills.

    ``nox -s soak -- --minutes 60 --out DIR [--seed S] [--plot docs/images/soak.png]
    [--redis-url URL]`` (defaults: 60 minutes, ``DIR`` = ``soak-results/``, the machine's
    Redis for the recurring relays): a private cluster (pgserver's binaries, initdb'd for
    the run) is restarted immediately every few minutes, every queue and recurring
    session ended in between, worker processes SIGKILLed and restarted; DIR gets
    ``samples.csv``, ``events.csv``, ``summary.json`` and ``soak.png`` (matplotlib, the
    ``plot`` extra of steeple-admin that the sync installs). It fails when the queue or
    recurring checker or a bound fails (see ``tests/soak.py``). The test suite runs three
    minutes of it (``tests/test_soak.py``, marked ``soak``).
    """
    _sync(session)
    args = list(session.posargs)
    if "--out" not in args:
        args += ["--out", "soak-results"]
    session.run("python", "tests/soak.py", *args)


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


@nox.session
def bloat(session: nox.Session) -> None:
    """The vacuum horizon held under steady load (``benchmarks/bench_bloat.py``).

    ``nox -s bloat`` holds each of three horizon holders 10 minutes (about 45 minutes in
    all, on a private server the benchmark starts); ``nox -s bloat -- --short`` 90 s each.
    """
    _sync(session)
    session.run("python", "benchmarks/bench_bloat.py", *session.posargs)


@nox.session
def backlog(session: nox.Session) -> None:
    """A backlog of millions (``benchmarks/bench_backlog.py``): the claim, operator calls
    and the dashboard beside a small queue; ``-- --big 1000000 --others 100000`` for a
    shorter run."""
    _sync(session)
    session.run("python", "benchmarks/bench_backlog.py", *session.posargs)


@nox.session
def scale(session: nox.Session) -> None:
    """N worker processes against one primary, N = 1, 2, 4, 8 (``benchmarks/bench_scale.py``):
    the same backlog drained at each N, on a private server the benchmark starts;
    ``-- --tasks 5000 --workers 1,2`` for a shorter run, ``-- --dsn ...`` for a given server."""
    _sync(session)
    session.run("python", "benchmarks/bench_scale.py", *session.posargs)


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
    for a replayable sample, ``--only NAME``, ``--area AREA``, ``--results FILE``, ``--list``,
    ``--jobs N`` (N mutants at once), ``--record-killers`` (keep what killed each one; those
    tests run first next time, and a mutant is still killed only by a test that fails).
    A surviving mutant, a canary that survives or an anchor text that is missing or occurs
    more than once fails the session.
    """
    _sync(session)
    session.env.setdefault("STEEPLE_TEST_DSN", "postgresql://postgres@127.0.0.1:5432/test")
    session.run("python", "mutants/run.py", *session.posargs)


@nox.session(name="mutmut-core")
def mutmut_core(session: nox.Session) -> None:
    """Mutation testing of steeple.core with mutmut over core's own tests; score >= 90 %.

    Arguments after ``--`` go to ``mutants/core_mutmut.py``: module names (default: the
    modules that hold decisions), ``--max-children N``, ``--work DIR``, ``--report-only DIR``.
    No steeple package is installed here: mutmut's mutated copy of core is what the tests
    import.
    """
    session.install(
        "mutmut==3.8.1", "attrs>=24.2", "pytest", "pytest-asyncio", "pytest-timeout", "hypothesis"
    )
    session.run("python", "mutants/core_mutmut.py", *session.posargs)


@nox.session
def demo(session: nox.Session) -> None:
    _sync(session)
    session.run("steeple", "demo", *session.posargs)


# --- documentation site -------------------------------------------------------------------
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
