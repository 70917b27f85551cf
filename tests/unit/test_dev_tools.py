"""The dev extra (what make installs) and the dev dependency group list the same tools."""

from __future__ import annotations

from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[2]


def test_the_dev_extra_and_the_dev_group_list_the_same_tools() -> None:
    """`pip install -e '.[dev]'` (what make installs) and `pip install --group dev` give the same tools."""
    tomllib = pytest.importorskip("tomllib", reason="Python 3.10 has no tomllib")
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    extra = project["project"]["optional-dependencies"]["dev"]
    group = project["dependency-groups"]["dev"]
    assert sorted(map(str, map(Requirement, extra))) == sorted(map(str, map(Requirement, group)))
    # the Makefile's `wheel` target and tests/e2e/test_wheel.py's build need these
    assert {"build", "twine", "setuptools"} <= {Requirement(r).name for r in group}
