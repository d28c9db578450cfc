"""steeple.core is sans-I/O: stdlib + attrs only; only clock.py/entropy.py read time/entropy."""

from __future__ import annotations

import ast
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

import steeple.core

CORE = Path(steeple.core.__file__).resolve().parent
SOURCES = sorted(CORE.rglob("*.py"))

ALLOWED_THIRD_PARTY = {"attrs", "attr"}
FORBIDDEN = {
    # drivers, clients, crypto
    "asyncpg",
    "psycopg",
    "psycopg2",
    "psycopg_pool",
    "cryptography",
    "nats",
    "redis",
    "aio_pika",
    "aiormq",
    "aiosqlite",
    "pgserver",
    "httpx",
    "opentelemetry",
    "starlette",
    "uvicorn",
    "typer",
    "rich",
    "hypothesis",
    "pytest",
    # stdlib I/O and concurrency the domain must not touch
    "sqlite3",
    "socket",
    "ssl",
    "asyncio",
    "selectors",
    "select",
    "subprocess",
    "multiprocessing",
    "threading",
    "http",
    "urllib",
    "shutil",
    "tempfile",
    "logging",
}
# Modules that read the wall clock or the OS's randomness: only the two adapters may.
TIME_AND_ENTROPY_MODULES = {"time", "random", "secrets", "uuid"}
ADAPTERS = {"clock.py", "entropy.py"}
WALL_CLOCK_CALLS = {"now", "utcnow", "today", "fromtimestamp", "utcfromtimestamp"}
FORBIDDEN_ATTRIBUTES = {
    "urandom",
    "getrandom",
    "uuid4",
    "uuid1",
    "time_ns",
    "monotonic",
    "perf_counter",
    "getrandbits",
}


def _imports(tree: ast.AST) -> list[tuple[str, int]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                found.append((f".{node.module or ''}", node.lineno))
            else:
                found.append((node.module or "", node.lineno))
    return found


def test_sources_found() -> None:
    names = {p.name for p in SOURCES}
    assert {
        "calendar.py",
        "occurrences.py",
        "tasks.py",
        "policies.py",
        "leases.py",
        "clock.py",
        "entropy.py",
    } <= names


def import_violations(tree: ast.AST, filename: str) -> list[tuple[str, int, str]]:
    bad = []
    for module, line in _imports(tree):
        top = module.split(".")[0]
        if module.startswith("."):
            continue
        if top in FORBIDDEN:
            bad.append((module, line, "forbidden"))
        elif top == "steeple" and module.split(".")[:2] != ["steeple", "core"]:
            bad.append((module, line, "core must not import other steeple packages"))
        elif top == "steeple" or top in ALLOWED_THIRD_PARTY:
            continue
        elif top not in sys.stdlib_module_names:
            bad.append((module, line, "not stdlib"))
        elif top in TIME_AND_ENTROPY_MODULES and filename not in ADAPTERS:
            bad.append((module, line, "time/entropy outside clock.py/entropy.py"))
    return bad


def clock_violations(tree: ast.AST) -> list[tuple[str, int]]:
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            base = node.value
            base_name = base.id if isinstance(base, ast.Name) else None
            if node.attr in WALL_CLOCK_CALLS and base_name in {"datetime", "date"}:
                bad.append((f"{base_name}.{node.attr}", node.lineno))
            if node.attr in FORBIDDEN_ATTRIBUTES:
                bad.append((node.attr, node.lineno))
            if base_name in {"time", "os"} and node.attr in {"time", "urandom"}:
                bad.append((f"{base_name}.{node.attr}", node.lineno))
        if isinstance(node, ast.Name) and node.id in {"uuid4", "urandom", "token_bytes"}:
            bad.append((node.id, node.lineno))
    return bad


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: p.name)
def test_core_imports_only_stdlib_attrs_and_itself(path: Path) -> None:
    tree = ast.parse(path.read_text(), filename=str(path))
    assert import_violations(tree, path.name) == []


@pytest.mark.parametrize(
    "path", [p for p in SOURCES if p.name not in ADAPTERS], ids=lambda p: p.name
)
def test_no_wall_clock_or_entropy_outside_adapters(path: Path) -> None:
    tree = ast.parse(path.read_text(), filename=str(path))
    assert clock_violations(tree) == []


def test_the_scanners_catch_offenders() -> None:
    """The scans above can fail: feed them a module that breaks every rule."""
    offender = ast.parse(
        "import asyncpg\nimport time\nfrom datetime import datetime, date\n"
        "import sqlite3\nfrom psycopg import sql\nimport croniter\n"
        "from steeple.postgres import store\nfrom secrets import token_bytes\n"
        "x = datetime.now()\ny = time.time()\nimport os\nz = os.urandom(4)\n"
        "w = date.today()\nv = token_bytes(3)\nimport uuid\nu = uuid.uuid4()\n"
    )
    flagged = {m for m, _, _ in import_violations(offender, "policies.py")}
    assert flagged == {
        "asyncpg",
        "time",
        "sqlite3",
        "psycopg",
        "croniter",
        "steeple.postgres",
        "secrets",
        "uuid",
    }
    # clock.py may import time; it may not import drivers.
    assert {m for m, _, _ in import_violations(offender, "clock.py")} == flagged - {
        "time",
        "secrets",
        "uuid",
    }
    calls = {name for name, _ in clock_violations(offender)}
    assert calls == {
        "datetime.now",
        "time.time",
        "urandom",
        "os.urandom",
        "date.today",
        "token_bytes",
        "uuid4",
    }
    clean = ast.parse("from datetime import datetime\ndef f(clock):\n    return clock.now()\n")
    assert clock_violations(clean) == []
    assert import_violations(clean, "leases.py") == []


def test_importing_core_loads_no_driver() -> None:
    code = (
        "import json, sys\n"
        "import steeple.core\n"
        "import steeple.core.leases, steeple.core.policies, steeple.core.tasks\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    loaded = set(json.loads(out.stdout))
    drivers = {
        "asyncpg",
        "psycopg",
        "psycopg_pool",
        "cryptography",
        "nats",
        "redis",
        "aio_pika",
        "aiosqlite",
        "sqlite3",
        "_sqlite3",
        "socket",
        "_socket",
        "ssl",
        "asyncio",
        "croniter",
        "pgserver",
        "httpx",
        "opentelemetry",
        "hypothesis",
    }
    assert loaded & drivers == set()
    assert "steeple.core" in loaded


def test_core_has_no_side_effects_at_import() -> None:
    code = "import threading, steeple.core\nprint(threading.active_count())\n"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "1"


CONTRACT = {
    "steeple.core.occurrences": [
        "OccurrenceEvent",
        "OccurrenceState",
        "PURGED",
        "OCCURRENCE_TRANSITIONS",
        "transition",
        "TERMINAL_STATES",
        "CLAIMABLE_STATES",
    ],
    "steeple.core.tasks": [
        "TaskEvent",
        "TaskState",
        "TASK_TRANSITIONS",
        "transition",
        "retry_decision",
        "RetryDecision",
        "TERMINAL_TASK_STATES",
    ],
    "steeple.core.policies": ["MissedRunPolicy", "TickPlan", "plan_tick", "validate_budget"],
    "steeple.core.leases": [
        "window_end",
        "lease_expiry",
        "is_live",
        "capability_matches",
        "CAPABILITY_BYTES",
        "GENERATION_BYTES",
        "adopt_time",
        "FailureDecision",
        "after_publish_failure",
    ],
}


@pytest.mark.parametrize("module", sorted(CONTRACT))
def test_contract_names_exist(module: str) -> None:
    loaded = importlib.import_module(module)
    for name in CONTRACT[module]:
        assert hasattr(loaded, name), f"{module}.{name}"
        assert name in loaded.__all__, f"{module}.__all__ lacks {name}"


def test_package_exports_resolve() -> None:
    for name in steeple.core.__all__:
        assert getattr(steeple.core, name) is not None
    assert len(set(steeple.core.__all__)) == len(steeple.core.__all__)
