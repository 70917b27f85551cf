"""pytest-randomly installed and on (``-p randomly``; this suite turns it off elsewhere): its seed,
given or chosen, reaches every rank, so each rank reseeds a test exactly as the parent would and
runs the tests in the parent's order; under torchrun every rank takes the same seed and shuffles
alike, and where ranks do shuffle apart, the same-collection check names pytest-randomly.
"""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
import zlib

import pytest

pytest.importorskip("pytest_randomly", reason="the dev extra's pytest-randomly")

# Every rank of each test records the seed it got, its first random number and the test's position.
TESTS = """
import json
import random
from pathlib import Path

import pytest


def record(request, rank):
    path = Path({root!r}) / f"rank{{rank}}.jsonl"
    value = random.random()  # first draw after pytest-randomly reseeded the test's call
    seed = request.config.getoption("randomly_seed")
    line = {{"nodeid": request.node.nodeid, "seed": seed, "random": value}}
    with path.open("a") as f:
        f.write(json.dumps(line) + "\\n")

{tests}
"""

DISTRIBUTED = """
@pytest.mark.distributed(world_size=2)
def test_{name}(request, dist_env):
    record(request, dist_env.rank)
"""

LOCAL = """
def test_{name}():
    pass
"""


def _tests(root, distributed: list[str], local: list[str]) -> str:
    body = "".join(DISTRIBUTED.format(name=n) for n in distributed)
    body += "".join(LOCAL.format(name=n) for n in local)
    return TESTS.format(root=str(root), tests=body)


def _records(root, rank: int) -> list[dict]:
    return [json.loads(line) for line in (root / f"rank{rank}.jsonl").read_text().splitlines()]


def _as_the_parent_would(seed: int, nodeid: str) -> float:
    """pytest-randomly's reseed before a test's call: random.seed(seed + crc32(node id))."""
    return random.Random(seed + zlib.crc32(nodeid.encode())).random()


@pytest.fixture
def randomly_on(monkeypatch):
    monkeypatch.delenv("PYTEST_ADDOPTS", raising=False)  # (the suite's -p no:randomly)
    return ["-p", "randomly"]


def test_the_seed_pytest_randomly_chose_reaches_every_launched_rank(pytester, randomly_on):
    names = ["alpha", "bravo", "charlie", "delta"]
    pytester.makepyfile(test_order=_tests(pytester.path, names, ["local_one", "local_two"]))
    result = pytester.runpytest_subprocess(
        *randomly_on, "-p", "no:cacheprovider", "--mfsdp-platform=cpu", "-v", timeout=300
    )
    out = result.stdout.str()
    assert result.parseoutcomes() == {"passed": 6}, out
    seed = int(re.search(r"Using --randomly-seed=(\d+)", out).group(1))
    parent_order = re.findall(r"^test_order\.py::test_(\w+) PASSED", out, re.MULTILINE)
    distributed_order = [n for n in parent_order if n in names]
    for rank in (0, 1):
        records = _records(pytester.path, rank)
        # the parent's order (shuffled by its seed), the parent's seed, the parent's reseed
        assert [r["nodeid"].rpartition("test_")[2] for r in records] == distributed_order
        assert {r["seed"] for r in records} == {seed}
        for record in records:
            assert record["random"] == _as_the_parent_would(seed, record["nodeid"]), record


def test_torchrun_ranks_shuffle_alike_without_a_seed_given(pytester, randomly_on, torchrun_pytest):
    names = [f"t{i}" for i in range(6)]
    pytester.makepyfile(test_order=_tests(pytester.path, names, []))
    command = torchrun_pytest(
        *randomly_on, "-p", "no:cacheprovider", "--mfsdp-platform=cpu", "-v", "test_order.py"
    )
    proc = subprocess.run(command, cwd=pytester.path, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    seed = int(re.search(r"Using --randomly-seed=(\d+)", proc.stdout).group(1))
    rank0, rank1 = _records(pytester.path, 0), _records(pytester.path, 1)
    assert rank0 == rank1  # same order, same seed, same draws
    assert {r["seed"] for r in rank0} == {seed}
    assert all(r["random"] == _as_the_parent_would(seed, r["nodeid"]) for r in rank0)


def test_ranks_shuffling_apart_are_told_pytest_randomly_is_the_cause(pytester, randomly_on, torchrun_pytest):
    names = [f"t{i}" for i in range(6)]
    pytester.makepyfile(test_order=_tests(pytester.path, names, []))
    # a conftest giving each rank a seed of its own, after pytest-randomly chose one
    pytester.makeconftest(
        "import os\nimport pytest\n\n@pytest.hookimpl(trylast=True)\ndef pytest_configure(config):\n"
        "    config.option.randomly_seed = 1000 + int(os.environ['RANK'])\n"
    )
    command = torchrun_pytest(*randomly_on, "-p", "no:cacheprovider", "--mfsdp-platform=cpu", "test_order.py")
    proc = subprocess.run(command, cwd=pytester.path, capture_output=True, text=True, timeout=240)
    assert proc.returncode != 0
    assert "ERROR: ranks collected their tests in different orders (at position " in proc.stderr, (
        proc.stdout[-3000:] + proc.stderr[-3000:]
    )
    assert (
        "pytest-randomly shuffled them with --randomly-seed=1000 on rank 0 and --randomly-seed=1001 on "
        "rank 1; give every rank the same seed (--randomly-seed=N on the command line) or disable it "
        "(-p no:randomly)"
    ) in proc.stderr


PARAMETRIZED = """
@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("n", range(6))
def test_p(request, n, dist_env):
    record(request, dist_env.rank)
"""


def test_a_torchrun_session_without_plugin_options_shuffles_alike_and_anew_each_run(
    pytester, randomly_on, free_port
):
    """`torchrun --nproc_per_node=2 -m pytest` as a new user types it: no option of the plugin, no
    --standalone (so the run id is "none" and the port the same on every run)."""
    pytester.makepyfile(test_order=TESTS.format(root=str(pytester.path), tests=PARAMETRIZED))
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master-port={free_port}",
        "-m", "pytest", *randomly_on, "-p", "no:cacheprovider", "-v", "test_order.py",
    ]  # fmt: skip
    seeds = []
    for _ in range(2):
        for rank in (0, 1):
            (pytester.path / f"rank{rank}.jsonl").unlink(missing_ok=True)
        proc = subprocess.run(command, cwd=pytester.path, capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert "6 passed" in proc.stdout, proc.stdout[-3000:]
        seed = int(re.search(r"Using --randomly-seed=(\d+)", proc.stdout).group(1))
        rank0, rank1 = _records(pytester.path, 0), _records(pytester.path, 1)
        assert rank0 == rank1  # same order, same seed, same draws
        assert {r["seed"] for r in rank0} == {seed}
        order = [r["nodeid"] for r in rank0]
        assert sorted(order) == [f"test_order.py::test_p[{n}]" for n in range(6)]
        seeds.append((seed, order))
    assert seeds[0][0] != seeds[1][0], seeds  # a new seed per run, as pytest-randomly's own default
