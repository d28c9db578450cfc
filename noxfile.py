"""nox sessions for steeple: lint, typecheck, tests, core (driverless), bench, demo.

Sessions reuse uv for speed and never download an interpreter.
"""

from __future__ import annotations

import os

import nox

nox.options.default_venv_backend = "uv"
nox.options.sessions = ["lint", "typecheck", "tests"]
os.environ.setdefault("UV_PYTHON_DOWNLOADS", "never")

PACKAGES = ["core", "keyring", "postgres", "brokers", "testing", "admin"]


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
    session.run("ruff", "check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    _sync(session)
    session.run("mypy")


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
        "packages/testing",
        "pytest",
        "pytest-asyncio",
        "pytest-timeout",
        "hypothesis",
    )
    session.run("pytest", "-p", "no:cacheprovider", "packages/core/tests", *session.posargs)


@nox.session
def bench(session: nox.Session) -> None:
    _sync(session)
    for script in (
        "bench_calendar.py",
        "bench_zoned.py",
        "bench_queue.py",
        "bench_recurring.py",
        "bench_simulate.py",
    ):
        if os.path.exists(f"benchmarks/{script}"):
            session.run("python", f"benchmarks/{script}", *session.posargs)


@nox.session
def demo(session: nox.Session) -> None:
    _sync(session)
    session.run("steeple", "demo", *session.posargs)
