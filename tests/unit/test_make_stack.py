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
