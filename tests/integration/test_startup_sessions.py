"""Plain mode starts its rank set while it still collects, a rank set nobody needs is reaped, and a
prestarted rank set waits for the session to reach its tests (real sessions, processes looked for
in ``/proc``)."""

from __future__ import annotations

import json
import time

import pytest

#: the parent records, when its collection is over (before the plugin plans the batches), which
#: torchrun children it has; the ranks record when they started
RECORDING_CONFTEST = """
import json, os, time

def _cmdline(pid):
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\\0", b" ").decode()

def _children(pid):
    # A child between fork and exec shows an empty command line or its parent's: wait (bounded)
    # until each has its own, so that what is recorded is what the child runs.
    own = _cmdline(pid)
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != pid:
                continue
            deadline = time.monotonic() + 10
            cmdline = _cmdline(entry)
            while cmdline in ("", own) and time.monotonic() < deadline:
                time.sleep(0.05)
                cmdline = _cmdline(entry)
        except OSError:
            continue
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


def test_the_rank_set_is_launched_while_the_parent_still_collects(
    pytester, isolated_tmp, leftover_processes, leftover_files
):
    pytester.makeconftest(RECORDING_CONFTEST)
    pytester.makepyfile(test_a_distributed=DISTRIBUTED, test_b_plain=PLAIN)
    result = pytester.runpytest_subprocess("--mfsdp-platform=cpu", timeout=300)
    result.assert_outcomes(passed=2)
    parent = json.loads((pytester.path / "parent.json").read_text())
    launched = [c for c in parent["children"] if "torch.distributed.run" in c]
    assert len(launched) == 1, parent["children"]
    assert "--nproc_per_node=2" in launched[0]
    assert "pytest_megatron_fsdp.rank.entry" in launched[0]
    assert leftover_processes(pytester.path) == []
    assert leftover_files(isolated_tmp) == []


@pytest.mark.parametrize("how", [["-k", "plain"], ["--collect-only"]])
def test_a_rank_set_no_test_needs_is_reaped_or_never_launched(
    pytester, isolated_tmp, how, leftover_processes, leftover_files
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
    assert leftover_files(isolated_tmp) == []


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
