"""The Makefile's stack: one variable (MEGATRON_CORE) naming a Megatron-LM checkout gates it whole,
megatron-core and the standalone megatron-fsdp from the same checkout; MEGATRON_FSDP overrides it.
Read from ``make -n venv`` (what make would run), so nothing is installed."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _planned(tmp_path: Path, *assignments: str) -> dict[str, str]:
    """The requirement lines ``make venv`` would write for megatron-core and megatron-fsdp, and the
    SPEC it would record (its change rebuilds the venv)."""
    if shutil.which("make") is None:
        pytest.fail("make is not installed")
    venv = tmp_path / "venv"
    done = subprocess.run(
        ["make", "-n", "-C", str(REPO), "venv", "PYTHON=python3", f"VENV={venv}", *assignments],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    lines = {
        name: re.search(rf"echo '([^']*)' > {re.escape(str(venv))}/{name}\.txt", done.stdout).group(1)
        for name in ("megatron-core", "megatron-fsdp")
    }
    lines["spec"] = re.search(rf"echo '([^']*)' > {re.escape(str(venv))}/\.installed", done.stdout).group(1)
    return lines


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """A Megatron-LM checkout's layout: the standalone megatron-fsdp with its own pyproject.toml."""
    root = tmp_path / "Megatron-LM"
    src = root / "megatron" / "core" / "distributed" / "fsdp" / "src"
    src.mkdir(parents=True)
    (src / "pyproject.toml").write_text("[project]\nname = 'megatron-fsdp'\n")
    return root


@pytest.mark.parametrize("editable", ["-e ", "--editable ", ""])
def test_a_checkout_brings_its_own_megatron_fsdp(tmp_path, checkout, editable):
    planned = _planned(tmp_path, f"MEGATRON_CORE={editable}{checkout}/")
    fsdp = f"{editable}{checkout}/megatron/core/distributed/fsdp/src"
    assert planned["megatron-core"] == f"{editable}{checkout}/"
    assert planned["megatron-fsdp"] == fsdp
    assert f"megatron-fsdp={fsdp} " in planned["spec"]  # a change of it rebuilds the venv


def test_megatron_fsdp_overrides_the_checkouts_and_takes_any_requirement(tmp_path, checkout):
    planned = _planned(tmp_path, f"MEGATRON_CORE=-e {checkout}", "MEGATRON_FSDP=megatron-fsdp==0.6.1")
    assert planned["megatron-fsdp"] == "megatron-fsdp==0.6.1"
    assert "megatron-fsdp=megatron-fsdp==0.6.1 " in planned["spec"]
    assert _planned(tmp_path, f"MEGATRON_CORE=-e {checkout}", "MEGATRON_FSDP=")["megatron-fsdp"] == ""


def test_a_release_or_a_directory_without_megatron_fsdp_leaves_it_to_the_extras(tmp_path):
    assert _planned(tmp_path, "MEGATRON_CORE=megatron-core==0.19.2")["megatron-fsdp"] == ""
    (tmp_path / "not-a-checkout").mkdir()
    assert _planned(tmp_path, f"MEGATRON_CORE=-e {tmp_path / 'not-a-checkout'}")["megatron-fsdp"] == ""


def _upstream_plan(tmp_path: Path, *assignments: str) -> str:
    """What ``make -n upstream`` would run (the venv's sub-make dry-runs too)."""
    done = subprocess.run(
        ["make", "-n", "--no-print-directory", "-C", str(REPO), "upstream", "PYTHON=python3", *assignments],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_make_upstream_runs_the_checkouts_tests_against_its_own_megatron_core(tmp_path, checkout):
    """MEGATRON_LM alone: megatron-core and megatron-fsdp from that checkout, in a venv of its own (the
    stack's usual venv is not rebuilt); the input is checked before that venv is built."""
    plan = _upstream_plan(tmp_path, "STACK=newest", f"MEGATRON_LM={checkout}/")
    spec = re.search(r"echo '([^']*)' > \.venv-newest-upstream/\.installed", plan)
    assert spec is not None, plan
    assert (
        f"megatron-core=-e {checkout} megatron-fsdp=-e {checkout}/megatron/core/distributed/fsdp/src"
        in spec[1]
    )
    check = plan.index(f"python3 -m bench.upstream --check --megatron-lm='{checkout}/'")
    assert check < plan.index(".venv-newest-upstream/.installed")
    assert f".venv-newest-upstream/bin/python -m bench.upstream --megatron-lm='{checkout}/'" in plan


def test_make_upstream_keeps_a_given_venv_and_megatron_core(tmp_path, checkout):
    venv = tmp_path / "venv"
    plan = _upstream_plan(
        tmp_path, f"MEGATRON_LM={checkout}", f"VENV={venv}", "MEGATRON_CORE=megatron-core==0.19.2"
    )
    assert "megatron-core=megatron-core==0.19.2 " in plan
    assert f"{venv}/bin/python -m bench.upstream" in plan
    # and the other targets ignore MEGATRON_LM: `make smoke` keeps the stack's pins and venv
    smoke = _planned(tmp_path, "STACK=newest", f"MEGATRON_LM={checkout}")
    assert smoke["megatron-core"] == "megatron-core==0.19.2"
