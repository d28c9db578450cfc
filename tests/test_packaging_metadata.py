"""Every distribution of packages/ carries complete metadata and all share one version.

Read from the pyproject files (no build; ``nox -s wheels`` builds and installs them):
license, licence file, readme, classifiers, one version, steeple packages pinned to it,
and the ``steeple`` distribution's extras installing the rest.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = sorted(p.parent for p in ROOT.glob("packages/*/pyproject.toml"))
EXTRAS = {"queue", "recurring", "brokers", "admin", "all"}


def project(directory: Path) -> dict[str, Any]:
    with (directory / "pyproject.toml").open("rb") as f:
        table: dict[str, Any] = tomllib.load(f)
    return table


def requirements(table: dict[str, Any]) -> list[Requirement]:
    listed = list(table["project"].get("dependencies", []))
    for extra in table["project"].get("optional-dependencies", {}).values():
        listed += extra
    return [Requirement(r) for r in listed]


def names() -> set[str]:
    return {canonicalize_name(project(p)["project"]["name"]) for p in PACKAGES}


def test_the_meta_distribution_is_a_package_of_the_workspace() -> None:
    assert "steeple" in names()
    root = project(ROOT)
    assert root["tool"]["uv"]["workspace"]["members"] == ["packages/*"]
    assert set(root["tool"]["uv"]["sources"]) == names()


@pytest.mark.parametrize("directory", PACKAGES, ids=lambda p: p.name)
def test_each_distribution_has_complete_metadata(directory: Path) -> None:
    meta = project(directory)["project"]
    for field in ("name", "version", "description", "requires-python", "keywords"):
        assert meta.get(field), f"{directory.name}: no {field}"
    assert meta["name"] == "steeple" or meta["name"] == f"steeple-{directory.name}"
    assert meta["requires-python"] == ">=3.11"
    assert meta["license"] == "Apache-2.0"  # an SPDX expression (core metadata 2.4)
    assert meta["license-files"] == ["LICENSE"]
    assert (directory / "LICENSE").read_bytes() == (ROOT / "LICENSE").read_bytes()
    assert meta["readme"] == "README.md"
    assert (directory / "README.md").read_text(encoding="utf-8").startswith(f"# {meta['name']}")
    classifiers = meta["classifiers"]
    assert "Programming Language :: Python :: 3 :: Only" in classifiers
    assert any(c.startswith("Development Status :: ") for c in classifiers)
    # A license expression and a license classifier together are refused by PyPI.
    assert not [c for c in classifiers if c.startswith("License :: ")]
    build = project(directory)["build-system"]
    assert build["build-backend"] == "hatchling.build"
    assert "hatchling>=1.27" in build["requires"]  # the first with PEP 639 license files


def test_one_version_and_every_steeple_requirement_pinned_to_it() -> None:
    versions = {project(p)["project"]["version"] for p in PACKAGES}
    assert len(versions) == 1, versions
    (version,) = versions
    ours = names()
    for directory in PACKAGES:
        for req in requirements(project(directory)):
            if canonicalize_name(req.name) in ours:
                assert str(req.specifier) == f"=={version}", f"{directory.name}: {req}"


def test_the_steeple_extras_install_the_rest() -> None:
    meta = project(ROOT / "packages" / "steeple")["project"]
    extras: dict[str, list[str]] = meta["optional-dependencies"]
    assert set(extras) >= EXTRAS
    # [all] is every other distribution with every extra it offers.
    wanted = {
        canonicalize_name(project(p)["project"]["name"]): set(
            project(p)["project"].get("optional-dependencies", {})
        )
        for p in PACKAGES
        if p.name != "steeple"
    }
    got = {canonicalize_name(r.name): set(r.extras) for r in map(Requirement, extras["all"])}
    assert got == wanted
    by_extra = {e: {canonicalize_name(Requirement(r).name) for r in rs} for e, rs in extras.items()}
    assert {"steeple-postgres", "steeple-admin"} <= by_extra["queue"]  # the tour and command
    assert {"steeple-postgres", "steeple-sqlite", "steeple-keyring"} <= by_extra["recurring"]
    assert by_extra["brokers"] == {"steeple-brokers"}
    assert by_extra["admin"] == {"steeple-admin"}


def test_steeple_stays_a_namespace() -> None:
    """No distribution ships steeple/__init__.py: it would hide every other package's code."""
    assert not list(ROOT.glob("packages/*/src/steeple/__init__.py"))
    meta_wheel = project(ROOT / "packages" / "steeple")["tool"]["hatch"]["build"]["targets"]
    assert meta_wheel["wheel"] == {"bypass-selection": True}  # metadata only, no code
    for directory in PACKAGES:
        if directory.name != "steeple":
            wheel = project(directory)["tool"]["hatch"]["build"]["targets"]["wheel"]
            assert wheel["packages"] == ["src/steeple"]
