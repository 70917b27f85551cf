"""pytest-xdist on a GPU node: each worker's rank sets get a disjoint slice of the GPUs."""

import time
from pathlib import Path

import pytest

from pytest_megatron_fsdp.parent.launcher import RankSet

# An 8-GPU node, faked: every worker's pytest sees 8 devices; instead of launching rank sets (there
# are no GPUs to run them), each worker writes down the slice its rank sets would get, and its tests
# are skipped.
FAKE_GPU_NODE = """
import os
from pathlib import Path
import pytest
from pytest_megatron_fsdp.parent import controller as controller_module
from pytest_megatron_fsdp.wire import platform
from pytest_megatron_fsdp.parent.controller import UNHOSTABLE

platform.visible_gpu_count = lambda fast=False: 8

class RecordedRankSet:
    # what the worker would launch torchrun with (its environment), instead of launching it
    def __init__(self, world_size, log_dir, cwd, env=None):
        Path(f"launch-{log_dir.name}.txt").write_text(repr(env))
    def close(self):
        pass

@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session):
    controller = session.config.pluginmanager.get_plugin("mfsdp-controller").controller
    worker = session.config.workerinput["workerid"]
    Path(f"slice-{worker}.txt").write_text(str(controller.gpu_slice))
    if controller.gpu_slice is not None:
        controller_module.RankSet = RecordedRankSet
        controller._launch(2)
        controller.close_all()
    for item in session.items:  # no rank set: there is no GPU here
        item.stash[UNHOSTABLE] = "faked GPUs"
        item.add_marker(pytest.mark.skip(reason="faked GPUs"))
"""

TESTS = """
import pytest
@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("n", range(8))
def test_two(n): pass
@pytest.mark.distributed(world_size=1)
def test_one(): pass
"""


@pytest.mark.parametrize(
    ("visible", "expected"),
    [
        (None, {"gw0": "0,1", "gw1": "2,3", "gw2": "4,5", "gw3": "6,7"}),
        ("7,6,5,4,3,2,1,0", {"gw0": "7,6", "gw1": "5,4", "gw2": "3,2", "gw3": "1,0"}),
    ],
)
def test_each_xdist_worker_takes_its_slice(pytester, monkeypatch, visible, expected):
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    pytester.makeconftest(FAKE_GPU_NODE)
    pytester.makepyfile(TESTS)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-n", "4", timeout=120)
    result.assert_outcomes(skipped=9)
    found = {p.stem.removeprefix("slice-"): p.read_text() for p in pytester.path.glob("slice-*.txt")}
    assert found == expected
    # ... and its rank sets are launched with it
    launched = {p.stem.removeprefix("launch-"): p.read_text() for p in pytester.path.glob("launch-*.txt")}
    env = {worker: repr({"CUDA_VISIBLE_DEVICES": devices}) for worker, devices in expected.items()}
    assert launched == {f"{worker}-batch1-world2": text for worker, text in env.items()}


def test_too_few_gpus_for_the_workers_is_one_usage_line(pytester, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    pytester.makeconftest(FAKE_GPU_NODE)
    pytester.makepyfile(TESTS)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-n", "5", timeout=120)
    assert result.ret != 0
    lines = result.stdout.lines + result.stderr.lines
    line = (
        "-n 5 workers x world_size=2 need 10 GPUs, 8 visible (all devices); use -n 4 or fewer, "
        "or --mfsdp-platform=cpu"
    )
    # said once, not once per worker (pytest's summary may repeat it after "ERROR  - ")
    assert lines.count(line) == 1, "\n".join(lines)
    result.stdout.fnmatch_lines(["5 workers [[]0 items[]]", "*= 1 error in *"])
    # no worker got GPUs, so none launched anything
    assert {p.read_text() for p in pytester.path.glob("slice-*.txt")} == {"None"}


def test_cpu_rank_sets_under_xdist_keep_the_callers_devices(pytester, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    pytester.makepyfile(
        """
import os
import pytest
@pytest.mark.distributed(world_size=2, timeout=60)
@pytest.mark.parametrize("n", range(2))
def test_env(dist_env, n):
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
"""
    )
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--mfsdp-platform=cpu", "-n", "2", timeout=240
    )
    result.assert_outcomes(passed=2)


def test_a_rank_set_is_launched_with_the_given_devices(tmp_path):
    rank_set = RankSet(2, tmp_path / "logs", tmp_path, {"CUDA_VISIBLE_DEVICES": "4,5"})
    proc = Path(f"/proc/{rank_set.proc.pid}")
    try:
        deadline = time.monotonic() + 30
        # until the child has exec'd torchrun, /proc shows the environment it was forked with
        while b"torch.distributed.run" not in (proc / "cmdline").read_bytes():
            assert time.monotonic() < deadline, "torchrun did not start"
            time.sleep(0.01)
        environ = (proc / "environ").read_bytes().split(b"\0")
    finally:
        rank_set.close()
    assert b"CUDA_VISIBLE_DEVICES=4,5" in environ
