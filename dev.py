#!/usr/bin/env python3
"""steeple's developer entry point: ``python3 dev.py test``, ``demo``, ``lint``, ``typecheck``.

It needs nothing but the machine's own Python 3.11+: it creates ``.venv`` with that
interpreter, installs uv into it from PyPI, syncs the locked workspace (never downloading
an interpreter), and runs the requested job.
"""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
CORE_VENV = ROOT / ".venv-core"
CORE_TESTS = "packages/core/tests"
CORE_TEST_WITH_DRIVERS = "test_core_purity.py"
UV_VERSION = "0.13.9"


def _bin(env: Path, name: str) -> Path:
    return env / ("Scripts" if os.name == "nt" else "bin") / name


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["UV_PYTHON_DOWNLOADS"] = "never"
    env["UV_PROJECT_ENVIRONMENT"] = str(VENV)
    env.pop("VIRTUAL_ENV", None)
    return env


def _run(*cmd: str | Path, env: dict[str, str] | None = None) -> int:
    print("+", " ".join(str(c) for c in cmd), flush=True)
    return subprocess.call([str(c) for c in cmd], cwd=ROOT, env=env or _env())


def bootstrap() -> Path:
    """Create .venv with this interpreter, put uv in it, and sync the locked workspace."""
    if sys.version_info < (3, 11):  # noqa: UP036 - dev.py may be run by an older python3
        sys.exit(f"steeple needs Python 3.11 or newer; this is {sys.version.split()[0]}")
    if not _bin(VENV, "python").exists():
        venv.EnvBuilder(with_pip=True).create(VENV)
    uv = _bin(VENV, "uv")
    if not uv.exists():
        rc = _run(_bin(VENV, "python"), "-m", "pip", "install", "-q", f"uv=={UV_VERSION}")
        if rc:
            sys.exit(rc)
    rc = _run(
        uv, "sync", "--frozen", "--all-packages", "--all-extras", "--python", _bin(VENV, "python")
    )
    if rc:
        sys.exit(rc)
    return uv


def core_only(uv: Path) -> int:
    """Run core's tests in an environment that has no driver installed at all."""
    env = _env()
    env["UV_PROJECT_ENVIRONMENT"] = str(CORE_VENV)
    if not _bin(CORE_VENV, "python").exists():
        rc = _run(uv, "venv", "--python", sys.executable, CORE_VENV, env=env)
        if rc:
            return rc
    env["VIRTUAL_ENV"] = str(CORE_VENV)
    rc = _run(
        uv,
        "pip",
        "install",
        "-q",
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
        env=env,
    )
    if rc:
        return rc
    return _run(
        _bin(CORE_VENV, "python"),
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "--durations=10",
        CORE_TESTS,
        env=env,
    )


def suite_paths() -> list[str]:
    """List what the full environment's run of the suite covers after :func:`core_only`.

    pyproject.toml's ``testpaths``, with core's directory narrowed to the test that core
    imports no driver: the only one of core's tests whose verdict changes once the drivers
    are installed. The others are pure and already ran (driverless) in :func:`core_only`.
    """
    import tomllib  # here: an older python3 must reach bootstrap()'s version message

    with (ROOT / "pyproject.toml").open("rb") as f:
        paths = tomllib.load(f)["tool"]["pytest"]["ini_options"]["testpaths"]
    return [f"{CORE_TESTS}/{CORE_TEST_WITH_DRIVERS}" if p == CORE_TESTS else p for p in paths]


def mypy_runs() -> list[list[str]]:
    """List the mypy invocations that together check all that pyproject.toml puts in scope.

    First mypy's configured ``files``; then each test directory on its ``mypy_path`` (where
    helper modules are imported by bare name) alone: its ``conftest.py`` is the module
    ``conftest`` there, like the root's and like the others', and one run cannot hold two
    modules of the same name.
    """
    import tomllib  # here: an older python3 must reach bootstrap()'s version message

    with (ROOT / "pyproject.toml").open("rb") as f:
        config = tomllib.load(f)["tool"]["mypy"]
    alone = [d for d in config["mypy_path"] if (ROOT / d / "conftest.py").exists()]
    return [[], *([d] for d in alone)]


def typecheck() -> int:
    """Run every mypy invocation of :func:`mypy_runs`; any failure fails."""
    failed = [" ".join(["mypy", *a]) for a in mypy_runs() if _run(_bin(VENV, "mypy"), *a)]
    if failed:
        print(f"typecheck failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def lint() -> int:
    """Run ruff format --check, ruff check, lint-imports and mypy --strict; any failure fails.

    ``lint-imports`` checks the arrows between the packages (the ``[tool.importlinter]``
    contracts of pyproject.toml).
    """
    failed = []
    for tool, *args in (
        ("ruff", "format", "--check", "."),
        ("ruff", "check", "."),
        ("lint-imports", "--no-cache"),
    ):
        if _run(_bin(VENV, tool), *args):
            failed.append(" ".join([tool, *args]))
    if typecheck():
        failed.append("mypy")
    if failed:
        print(f"lint failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str]) -> int:
    """Dispatch ``test`` or ``demo`` (and ``lint``), passing extra arguments through."""
    if not argv or argv[0] not in {"test", "demo", "lint", "typecheck"}:
        print(
            "usage: python3 dev.py test [pytest args] | demo [steeple demo args] | lint | typecheck"
        )
        return 2
    job, rest = argv[0], argv[1:]
    uv = bootstrap()
    if job == "demo":
        return _run(_bin(VENV, "steeple"), "demo", *rest)
    if job == "lint":
        return lint()
    if job == "typecheck":
        return typecheck()
    if not rest:
        # The whole suite: core's tests in the driverless environment, then the others
        # (see suite_paths), listing the slowest tests so a run shows where its time went.
        rc = core_only(uv)
        if rc:
            return rc
        rest = ["--durations=30", *suite_paths()]
    return _run(_bin(VENV, "python"), "-m", "pytest", *rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
