"""``make upstream`` on a checkout-like tree this test makes, from a fresh venv, at world sizes 2, 4
and 8: the tree's conftest imports a package the venv lacks, declared in its PEP 735 ``test`` group
(``make upstream`` installs it); one test needs 8 ranks (upstream's own world size); one test fails
on a rank at 4 ranks while its peers go on into a barrier of the default group, as Megatron-LM's
tests end (``Utils.destroy_model_parallel()`` after their asserts): it fails alone and the tests
after it run. No Megatron-LM checkout is needed, so CI runs it.

The fresh venv is the floor stack's (the CPU torch wheel, on disk on these machines): the test is of
``make upstream`` itself, not of a stack.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
#: a package no venv of this project installs, which the tree's test group brings
MISSING = "click"

PYPROJECT = f"""
[project]
name = "checkout-like"
version = "0"

[dependency-groups]
test = ["{MISSING}", {{include-group = "gpu"}}]
gpu = ["transformer-engine[pytorch]"]
"""

CONFTEST = f"""
import {MISSING}  # as Megatron-LM's unit-test conftest imports it through its dataset helper
"""

TESTS = """
import os

import pytest
import torch
import torch.distributed as dist


@pytest.fixture(autouse=True)
def default_group():
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))


def test_an_all_reduce():
    tensor = torch.ones(2, device="cuda")
    dist.all_reduce(tensor)
    assert tensor.tolist() == [dist.get_world_size()] * 2


def test_needs_eight_ranks():
    if dist.get_world_size() != 8:
        pytest.skip("requires 8 GPUs")
    group = dist.new_group(list(range(4)), backend="nccl")
    tensor = torch.ones(1, device="cuda")
    if dist.get_rank() < 4:
        dist.all_reduce(tensor, group=group)
        assert tensor.item() == 4.0


def test_rank1_fails_while_the_others_go_on_to_a_barrier_at_four_ranks():
    if dist.get_world_size() == 4 and dist.get_rank() == 1:
        raise AssertionError("rank 1 found a wrong offset")
    try:  # as Utils.destroy_model_parallel() ends a test: a barrier whose error it swallows
        dist.barrier()
    except RuntimeError:
        pass


def test_after_it():
    tensor = torch.ones(2, device="cuda")
    dist.all_reduce(tensor)
    assert tensor.tolist() == [dist.get_world_size()] * 2
"""

FILE = "tests/unit_tests/distributed/test_tree.py"
#: the other path of make upstream's default tests
DTENSOR_FILE = "tests/unit_tests/transformer/test_fsdp_dtensor_checkpoint.py"
DTENSOR_TEST = """
def test_collected_from_the_default_paths():
    pass
"""


@pytest.fixture(scope="module")
def upstream_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    if shutil.which("make") is None:
        pytest.skip("no make on PATH")
    root = tmp_path_factory.mktemp("upstream")
    tree = root / "Megatron-LM"
    (tree / "megatron" / "core").mkdir(parents=True)  # a checkout's layout; the venv's megatron-core is used
    (tree / "tests" / "unit_tests" / "distributed").mkdir(parents=True)
    (tree / "pyproject.toml").write_text(textwrap.dedent(PYPROJECT))
    (tree / "tests" / "unit_tests" / "conftest.py").write_text(textwrap.dedent(CONFTEST))
    (tree / FILE).write_text(textwrap.dedent(TESTS))
    (tree / DTENSOR_FILE).parent.mkdir(parents=True)
    (tree / DTENSOR_FILE).write_text(textwrap.dedent(DTENSOR_TEST))
    tmpdir = root / "tmp"
    tmpdir.mkdir()
    env = {
        k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES")
    }
    env["TMPDIR"] = str(tmpdir)
    done = subprocess.run(
        [
            "make",
            "-C",
            str(REPO),
            "upstream",
            "STACK=floor",
            f"MEGATRON_LM={tree}",
            "MEGATRON_CORE=megatron-core==0.16.1",
            f"VENV={root / 'venv'}",
            f"UPSTREAM_RESULTS={root / 'results'}",
            "UPSTREAM_WALL=400",
        ],
        capture_output=True,
        text=True,
        timeout=1500,
        env=env,
    )
    return done, root


def _outcomes(root: Path, run: str) -> dict[str, str]:
    summary = json.loads((root / "results" / "summary.json").read_text())
    return {test.split("::")[-1]: data["outcome"] for test, data in summary["runs"][run]["tests"].items()}


def test_the_checkouts_test_group_is_installed_and_its_gpu_only_packages_left_out(upstream_run):
    done, root = upstream_run
    out = done.stdout + done.stderr
    assert "transformer-engine" in out, out[-3000:]
    assert "left out" in out, out[-3000:]
    venv_python = root / "venv" / "bin" / "python"
    assert subprocess.run([str(venv_python), "-c", f"import {MISSING}"], timeout=60).returncode == 0


def test_every_world_size_ran_every_test(upstream_run):
    done, root = upstream_run
    # bench/upstream.py's exit status 1 (the test failing at 4 ranks), not 2 (bad input); make's is 2
    assert "upstream] Error 1" in done.stderr, (done.stdout + done.stderr)[-3000:]
    assert _outcomes(root, "ws2") == {
        "test_an_all_reduce": "passed",
        "test_needs_eight_ranks": "skipped",
        "test_rank1_fails_while_the_others_go_on_to_a_barrier_at_four_ranks": "passed",
        "test_after_it": "passed",
        "test_collected_from_the_default_paths": "passed",
    }
    assert _outcomes(root, "ws8") == {
        "test_an_all_reduce": "passed",
        "test_needs_eight_ranks": "passed",
        "test_rank1_fails_while_the_others_go_on_to_a_barrier_at_four_ranks": "passed",
        "test_after_it": "passed",
        "test_collected_from_the_default_paths": "passed",
    }


def test_a_test_that_would_hang_at_four_ranks_fails_alone_and_the_session_goes_on(upstream_run):
    _, root = upstream_run
    assert _outcomes(root, "ws4") == {
        "test_an_all_reduce": "passed",
        "test_needs_eight_ranks": "skipped",
        "test_rank1_fails_while_the_others_go_on_to_a_barrier_at_four_ranks": "failed",
        "test_after_it": "passed",
        "test_collected_from_the_default_paths": "passed",
    }
    log = (root / "results" / "ws4.log").read_text()
    assert "failed on rank 1 (passed on 0, 2, 3)" in log, log[-3000:]
    assert "AssertionError: rank 1 found a wrong offset" in log
