"""``make upstream`` installs what a checkout's own tests need (bench/upstream_deps.py): its PEP 735
``test`` group, include-groups resolved, GPU-only packages left out with their reason, bad input in
one line, nothing installed twice. pip is replaced by a recorder (the unit tier installs nothing)."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from bench import upstream_deps

PYPROJECT = textwrap.dedent(
    """
    [project]
    name = "checkout"
    [dependency-groups]
    base = ["click>=8", "wrapt"]
    test = [
        {include-group = "base"},
        "pytest-mock",
        "transformer-engine[pytorch]>=2.0",
        "mamba-ssm",
        "only-on-windows; sys_platform == 'win32'",
        "wrapt",
    ]
    """
)


def checkout(tmp_path: Path, text: str = PYPROJECT) -> Path:
    (tmp_path / "pyproject.toml").write_text(text)
    return tmp_path


def test_the_group_with_its_included_groups_and_what_is_left_out(tmp_path):
    requirements = upstream_deps.dependency_group(checkout(tmp_path) / "pyproject.toml")
    install, left_out = upstream_deps.split(requirements)
    assert install == ["click>=8", "wrapt", "pytest-mock"]
    assert [text for text, _ in left_out] == [
        "transformer-engine[pytorch]>=2.0",
        "mamba-ssm",
        "only-on-windows; sys_platform == 'win32'",
    ]
    assert left_out[0][1].startswith("GPU-only: Transformer Engine")
    assert "environment marker" in left_out[2][1]


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("[project]\nname = 'x'\n", "no dependency group 'test' (groups: none)"),
        (
            "[dependency-groups]\ntest = [{include-group = 'test'}]\n",
            "dependency group 'test' includes itself",
        ),
        ("[dependency-groups]\ntest = [3]\n", "dependency group 'test' holds 3"),
        ("[dependency-groups\n", "cannot read [dependency-groups]"),
    ],
)
def test_a_bad_group_is_one_line(tmp_path, capsys, text, says):
    assert upstream_deps.main(["--checkout", str(checkout(tmp_path, text))]) == 2
    err = capsys.readouterr().err
    assert says in err
    assert len(err.splitlines()) == 1


def test_pip_installs_the_group_once_and_says_what_it_left_out(tmp_path, monkeypatch, capsys):
    calls = []

    class Done:
        returncode = 0

    monkeypatch.setattr(upstream_deps.subprocess, "run", lambda argv, check: calls.append(argv) or Done())
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "venv"))
    (tmp_path / "venv").mkdir()
    root = checkout(tmp_path)
    assert upstream_deps.main(["--checkout", str(root)]) == 0
    assert calls == [[sys.executable, "-m", "pip", "install", "-q", "click>=8", "wrapt", "pytest-mock"]]
    out = capsys.readouterr().out
    assert "left out of" in out
    assert "mamba-ssm (GPU-only: CUDA kernels" in out
    assert upstream_deps.main(["--checkout", str(root)]) == 0  # the stamp: nothing to install again
    assert len(calls) == 1
