"""pyproject.toml lists every package of the source tree: a package left out installs with an
editable install (which maps folders) but not with `pip install .` (a wheel ships only the
listed ones: the CLI, the server's protocol, the jobs and more were missing once)."""

from __future__ import annotations

import pathlib

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+
ROOT = pathlib.Path(__file__).resolve().parents[1]


def _packages_on_disk(package_dir: dict[str, str]) -> set[str]:
    """Every folder with an __init__.py, named as the package-dir mapping imports it."""
    out = set()
    for name, folder in package_dir.items():
        base = ROOT / folder
        for init in base.rglob("__init__.py"):
            parts = init.parent.relative_to(base).parts
            # A mapped folder seen through a link inside jaxserve/ (a worktree's) is its own.
            if name == "jaxserve" and parts and f"jaxserve.{parts[0]}" in package_dir:
                continue
            out.add(".".join((name, *parts)))
    return out


def test_every_package_is_in_the_wheel():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    missing = _packages_on_disk(setuptools["package-dir"]) - set(setuptools["packages"])
    assert missing == set(), f"missing from [tool.setuptools] packages: {sorted(missing)}"
