"""Plain mode starts its rank set while it still collects, and a rank set nobody needs is reaped.

The first distributed test collected launches torchrun (its ranks import torch while the parent
collects the rest and decides the platform); the batch follows when the session reaches it. Processes
are looked for in ``/proc``: a rank set is the parent's ``torch.distributed.run`` child and its ranks
(``pytest_megatron_fsdp.harness.rank_entry``, whose command line names the batch's directory).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from pytest_megatron_fsdp.harness import rank_entry
from pytest_megatron_fsdp.harness.launcher import RankSet

#: the parent records, when its collection is over (before the plugin plans the batches), which
#: torchrun children it has; the ranks record when they started
RECORDING_CONFTEST = """
import json, os, time

def _children(pid):
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\\0", b" ").decode()
        except OSError:
            continue
        if ppid == pid:
            found.append(cmdline)
    return found

def pytest_collection_modifyitems(config, items):
    if "RANK" not in os.environ:
        with open("parent.json", "w") as f:
            json.dump({"collected_at": time.time(), "children": _children(os.getpid())}, f)
"""

DISTRIBUTED = """
import pytest
import torch
import torch.distributed as dist

@pytest.mark.distributed(world_size=2)
def test_all_reduce(dist_env):
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 2
"""

PLAIN = """
import json, os
from conftest import _children

def test_plain():
    # runs in the parent session, after collection: a rank set nobody needs is gone by now
    with open("plain.json", "w") as f:
        json.dump(_children(os.getpid()), f)
"""


def test_the_rank_set_is_launched_while_the_parent_still_collects(pytester, isolated_tmp, leftover_processes):
    pytester.makeconftest(RECORDING_CONFTEST)
    pytester.makepyfile(test_a_distributed=DISTRIBUTED, test_b_plain=PLAIN)
    result = pytester.runpytest_subprocess("--mfsdp-platform=cpu", timeout=300)
    result.assert_outcomes(passed=2)
    parent = json.loads((pytester.path / "parent.json").read_text())
    launched = [c for c in parent["children"] if "torch.distributed.run" in c]
    assert len(launched) == 1, parent["children"]
    assert "--nproc_per_node=2" in launched[0] and "pytest_megatron_fsdp.harness.rank_entry" in launched[0]
    assert leftover_processes(pytester.path) == []
    assert list(isolated_tmp.iterdir()) == []


@pytest.mark.parametrize("how", [["-k", "plain"], ["--collect-only"]])
def test_a_rank_set_no_test_needs_is_reaped_or_never_launched(
    pytester, isolated_tmp, how, leftover_processes
):
    pytester.makeconftest(RECORDING_CONFTEST)
    pytester.makepyfile(test_a_distributed=DISTRIBUTED, test_b_plain=PLAIN)
    started = time.monotonic()
    result = pytester.runpytest_subprocess("--mfsdp-platform=cpu", *how, timeout=120)
    elapsed = time.monotonic() - started
    children = json.loads((pytester.path / "parent.json").read_text())["children"]
    launched = any("torch.distributed.run" in c for c in children)
    if how[0] == "-k":
        result.assert_outcomes(passed=1, deselected=1)
        assert launched, children  # at collection (the deselection comes after), closed at its end
        plain = json.loads((pytester.path / "plain.json").read_text())
        assert not any("torch.distributed.run" in c for c in plain), plain
    else:
        assert "<Function test_all_reduce>" in result.stdout.str()
        assert not launched, children  # --collect-only runs nothing: no rank set at all
    assert result.ret == 0
    assert elapsed < 60, elapsed  # not waiting for ranks that have nothing to run
    assert leftover_processes(pytester.path) == []
    assert list(isolated_tmp.iterdir()) == []


def test_a_waiting_rank_gets_its_command_line_or_gives_up_when_the_parent_is_gone(tmp_path):
    argv = tmp_path / "argv.json"
    argv.write_text(json.dumps(["test_x.py", "-q"]))
    assert rank_entry.wait_for_argv(argv, os.getpid(), limit_s=5) == ["test_x.py", "-q"]

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    started = time.monotonic()
    assert rank_entry.wait_for_argv(tmp_path / "never.json", gone.pid, limit_s=30) is None
    assert time.monotonic() - started < 5  # noticed the parent is gone, did not wait out the limit

    started = time.monotonic()
    assert rank_entry.wait_for_argv(tmp_path / "never.json", os.getpid(), limit_s=0.3) is None
    assert 0.3 <= time.monotonic() - started < 5


def _rank_set_without_launch(tmp_path, world_size: int = 2) -> RankSet:
    """A RankSet whose 'torchrun' is a sleeping process (a slow shutdown), its ranks played by hand."""
    rank_set = RankSet.__new__(RankSet)
    rank_set.world_size = world_size
    rank_set.log_dir = tmp_path / "logs"
    rank_set.log_dir.mkdir()
    rank_set.work_dir = tmp_path / "work"
    rank_set.work_dir.mkdir()
    rank_set._argv_path = rank_set.work_dir / "argv.json"
    rank_set.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    return rank_set


def test_a_rank_set_is_done_when_its_ranks_are_not_when_torchrun_has_shut_down(tmp_path):
    rank_set = _rank_set_without_launch(tmp_path)
    try:
        # rank 1 still runs (its command line names the batch's argv file): not done
        rank1 = subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(60)", str(rank_set._argv_path)]
        )
        (rank_set.log_dir / "rank1.pid").write_text(str(rank1.pid))
        rank_entry.exit_status_path(rank_set._argv_path, 0).write_text("0")
        assert rank_set.wait(0.3) is None
        rank_entry.exit_status_path(rank_set._argv_path, 1).write_text("1")
        assert rank_set.wait(0.3) is None  # its status is there, but the process is not gone yet
        rank1.kill()
        rank1.wait()
        started = time.monotonic()
        assert rank_set.wait(30) == 1  # pytest's status on rank 1; torchrun still 'shutting down'
        assert time.monotonic() - started < 5
        assert rank_set.proc.poll() is None
    finally:
        rank_set.proc.kill()
        rank_set.proc.wait()


def test_a_rank_that_died_without_a_status_is_waited_for_through_torchrun(tmp_path):
    rank_set = _rank_set_without_launch(tmp_path)
    try:
        rank_entry.exit_status_path(rank_set._argv_path, 0).write_text("0")
        assert rank_set.wait(0.3) is None  # rank 1 left no status: torchrun's summary will say why
        rank_set.proc.kill()
        assert rank_set.wait(5) == rank_set.proc.returncode != 0
    finally:
        rank_set.proc.kill()
        rank_set.proc.wait()


ORDER_CONFTEST = """
import os, pathlib
if "RANK" in os.environ:  # a rank's pytest has started: it received its batch
    pathlib.Path("rank-pytest-started").touch()
"""

PLAIN_FIRST = """
import json, os, pathlib, time
import pytest

def test_a_plain_runs_first():
    # the rank set was launched at collection; its batch must wait until the session gets there
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not pathlib.Path("rank-pytest-started").exists():
        time.sleep(0.1)
    assert not pathlib.Path("rank-pytest-started").exists(), "the ranks ran ahead of the session"

@pytest.mark.distributed(world_size=2)
def test_b_distributed(dist_env):
    assert dist_env.world_size == 2
"""


def test_a_prestarted_rank_set_waits_for_the_session_to_reach_its_tests(
    pytester, isolated_tmp, leftover_processes
):
    pytester.makeconftest(ORDER_CONFTEST)
    pytester.makepyfile(test_order=PLAIN_FIRST)
    result = pytester.runpytest_subprocess("--mfsdp-platform=cpu", timeout=300)
    result.assert_outcomes(passed=2)
    assert leftover_processes(pytester.path) == []
