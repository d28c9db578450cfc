"""The arrows between the packages are enforced: ``lint-imports`` keeps every contract.

The contracts (``[tool.importlinter]`` in pyproject.toml) say who may import whom, as
DESIGN's arrows do; ``python3 dev.py lint`` runs them too. import-linter reads the
``steeple`` namespace's packages as roots of their own, and counts imports inside
functions, so a lazy import is an arrow like any other.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _config() -> dict[str, object]:
    with (ROOT / "pyproject.toml").open("rb") as f:
        table: dict[str, object] = tomllib.load(f)["tool"]["importlinter"]
    return table


def test_every_package_is_a_root_of_the_contracts() -> None:
    found = {
        f"steeple.{p.name}"
        for p in ROOT.glob("packages/*/src/steeple/*")
        if (p / "__init__.py").exists()
    }
    assert set(_config()["root_packages"]) == found  # type: ignore[call-overload]


def test_every_contract_is_kept() -> None:
    lint_imports = Path(sys.executable).parent / "lint-imports"
    done = subprocess.run(
        [str(lint_imports), "--no-cache"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout, done.stdout
