"""The complexity limits hold the packages' sources, every function of them, no exceptions.

``pyproject.toml`` selects ruff's McCabe complexity (C901) and pylint's too-many-returns,
-branches and -statements rules (PLR0911, PLR0912, PLR0915) for ``packages/*/src``. No
source file is exempt from them, by a per-file ignore or a ``noqa`` comment: a function
over a limit is split, not excused.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RULES = frozenset({"C901", "PLR0911", "PLR0912", "PLR0915"})


def _lint_config() -> dict[str, object]:
    with (ROOT / "pyproject.toml").open("rb") as f:
        lint: dict[str, object] = tomllib.load(f)["tool"]["ruff"]["lint"]
    return lint


def test_the_limits_are_selected_for_the_sources_only() -> None:
    lint = _lint_config()
    assert set(lint["select"]) >= RULES  # type: ignore[call-overload]
    assert lint["mccabe"] == {"max-complexity": 12}
    ignores = lint["per-file-ignores"]
    assert isinstance(ignores, dict)
    assert set(ignores["!packages/*/src/**"]) == RULES


def test_no_source_file_is_exempt_from_the_limits() -> None:
    ignores = _lint_config()["per-file-ignores"]
    assert isinstance(ignores, dict)
    exempt = {
        pattern: sorted(set(codes) & RULES)
        for pattern, codes in ignores.items()
        if pattern != "!packages/*/src/**" and set(codes) & RULES
    }
    assert not exempt, f"split the functions instead of exempting them: {exempt}"


def test_every_source_function_is_within_the_limits() -> None:
    # Without the per-file ignores and the noqa comments: what the sources really are.
    ruff = Path(sys.executable).parent / "ruff"
    done = subprocess.run(
        [
            str(ruff),
            "check",
            "--no-cache",
            "--exit-zero",
            "--ignore-noqa",
            "--output-format=json",
            "--config=lint.per-file-ignores = {}",
            f"--select={','.join(sorted(RULES))}",
            *sorted(str(src.relative_to(ROOT)) for src in ROOT.glob("packages/*/src")),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    over = sorted(
        f"{Path(d['filename']).resolve().relative_to(ROOT).as_posix()}:"
        f"{d['location']['row']} {d['code']} {d['message']}"
        for d in json.loads(done.stdout)
    )
    assert not over, "functions over the complexity limits:\n" + "\n".join(over)
