"""A rank SIGKILLed while it writes its shard: the previous checkpoint stays the one that loads.

Plain mode only: the plugin launches the rank set, the test-only hook (``MFSDP_TEST_KILL_DURING_SAVE``)
makes rank 1 kill itself half-way through writing its shard of iteration 3, and the next test runs
in the fresh rank set the plugin starts after a death.
"""

KILLED = """
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from pytest_megatron_fsdp.checkpoint import (
    CheckpointError,
    assert_states_equal,
    load_checkpoint,
    read_tracker,
    save_checkpoint,
    state_snapshot,
)

ROOT = Path(os.environ["KILLED_ROOT"])
CHECKPOINTS = ROOT / "checkpoints"
two_ranks = pytest.mark.distributed(world_size=2)


@two_ranks
def test_rank1_is_killed_while_it_writes_its_shard(megatron_fsdp_run, run_config, dist_env):
    run = megatron_fsdp_run(run_config)
    run.train(2)
    save_checkpoint(run, CHECKPOINTS)  # iteration 2: complete
    torch.save(state_snapshot(run), ROOT / f"iteration2-rank{dist_env.rank}.pt")
    run.train(1)
    dist.barrier()
    save_checkpoint(run, CHECKPOINTS)  # iteration 3: rank 1 dies half-way through its shard
    raise AssertionError("unreachable: rank 1 was to be killed during the save")


@two_ranks
def test_a_fresh_rank_set_loads_the_previous_checkpoint_exactly(megatron_fsdp_run, run_config, dist_env):
    (partial,) = [p for p in CHECKPOINTS.iterdir() if p.name.startswith("iter_0000003.tmp-")]
    shard = partial / "__1_0.distcp"
    assert shard.is_file() and shard.stat().st_size > 0  # written half-way
    assert not (partial / ".metadata").exists()  # so DCP itself cannot read it either
    assert read_tracker(CHECKPOINTS) == 2

    other = run_config.copy()
    other.train.seed += 1
    run = megatron_fsdp_run(other)
    assert load_checkpoint(run, CHECKPOINTS) == 2
    assert_states_equal(torch.load(ROOT / f"iteration2-rank{dist_env.rank}.pt"), state_snapshot(run))
    with pytest.raises(CheckpointError, match=r"names iteration 3 but \\S+/iter_0000003 does not exist"):
        load_checkpoint(run, CHECKPOINTS, iteration=3)

    run.train(2)
    save_checkpoint(run, CHECKPOINTS)  # iteration 4: complete, and the killed save's leftovers go
    assert sorted(p.name for p in CHECKPOINTS.iterdir() if p.name.startswith("iter_")) == [
        "iter_0000002",
        "iter_0000004",
    ]
"""


def test_a_save_killed_mid_write_never_loads_and_the_previous_one_does(
    pytester, monkeypatch, isolated_tmp, leftover_processes, leftover_files
):
    root = pytester.path / "killed"
    root.mkdir()
    monkeypatch.setenv("KILLED_ROOT", str(root))
    monkeypatch.setenv("MFSDP_TEST_KILL_DURING_SAVE", "1@3")  # rank 1, at iteration 3
    pytester.makepyfile(test_killed=KILLED)
    result = pytester.runpytest_subprocess("--mfsdp-platform=cpu", "-rA", timeout=300)
    out = result.stdout.str()
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["FAILED test_killed.py::test_rank1_is_killed_while_it_writes_its_shard*"])
    assert "rank 1 died (signal SIGKILL)" in out
    assert "unreachable" not in out
    result.stdout.fnmatch_lines(
        ["PASSED test_killed.py::test_a_fresh_rank_set_loads_the_previous_checkpoint_exactly"]
    )
    assert leftover_processes(pytester.path) == []
    assert leftover_files(isolated_tmp) == []
