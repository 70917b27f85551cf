"""A failing distributed test reads as one failure: no teardown echo, no torch.distributed log noise.

Plain-pytest sessions (the plugin launches the rank sets), checked from the outside.
"""

import pytest

FAILING = """
import logging
import time

import pytest
import torch
import torch.distributed as dist

from pytest_megatron_fsdp.checkpoint import load_checkpoint, save_checkpoint

two_ranks = pytest.mark.distributed(world_size=2)


@two_ranks
def test_checkpoint_then_rank1_fails(megatron_fsdp_run, run_config, checkpoint_dir, dist_env):
    run = megatron_fsdp_run(run_config)
    run.train(1)
    save_checkpoint(run, checkpoint_dir)
    load_checkpoint(run, checkpoint_dir)
    logging.getLogger("user").warning("the user's own log line")
    assert dist_env.rank == 0, "rank 1 disagrees after the checkpoint"


@two_ranks
def test_checkpoint_then_both_ranks_fail(megatron_fsdp_run, run_config, checkpoint_dir, dist_env):
    run = megatron_fsdp_run(run_config)
    run.train(1)
    save_checkpoint(run, checkpoint_dir)
    raise AssertionError(f"rank {dist_env.rank} fails too")


@pytest.fixture
def barrier_at_teardown(dist_env):
    yield
    dist.barrier()  # a user's fixture: a collective in its teardown, no guard


@two_ranks
def test_rank0_fails_and_a_fixture_tears_down_with_a_collective(barrier_at_teardown, dist_env):
    assert dist_env.rank == 1, "rank 0 disagrees"


@two_ranks
def test_rank1_fails_while_rank0_already_waits_in_the_teardown_collective(barrier_at_teardown, dist_env):
    if dist_env.rank == 1:
        time.sleep(2)  # rank 0 passed and is inside the teardown's barrier by now
        raise AssertionError("rank 1 fails late")


@pytest.fixture
def buggy_teardown(dist_env):
    yield
    raise RuntimeError("a teardown bug of its own")


@two_ranks
def test_a_teardown_bug_of_its_own_is_still_reported(buggy_teardown, dist_env):
    assert dist_env.rank == 1, "rank 0 disagrees"


@two_ranks
def test_collectives_work_after_all_that(dist_env):
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 2
"""

DCP_EVENT = "c10d-NullHandler-dcp_logger"


@pytest.fixture
def session(pytester, isolated_tmp):
    pytester.makepyfile(test_failing=FAILING)
    return pytester


def test_each_failure_is_reported_once_and_without_torch_distributed_noise(session):
    result = session.runpytest_subprocess("-p", "no:cacheprovider", "--mfsdp-platform=cpu", timeout=300)
    out = result.stdout.str()
    # Four failures, and the one real teardown bug is an error of its own; nothing else.
    result.assert_outcomes(passed=1, failed=5, errors=1)
    result.stdout.fnmatch_lines(
        [
            "ERROR test_failing.py::test_a_teardown_bug_of_its_own_is_still_reported*",
        ]
    )
    assert out.count("ERROR at teardown") == 1, out
    assert "RuntimeError: a teardown bug of its own" in out
    # The teardowns' collectives after the release are named in a report section, not as errors.
    echo = "Default process group has not been initialized"
    assert out.count(echo) == out.count(
        f"the process group was released after the failure: ValueError: {echo}"
    )
    assert "teardown collective skipped" in out
    assert "rank 1 disagrees after the checkpoint" in out
    assert "rank 1 fails late" in out
    # The failing checkpoint test's report carries its captured logs, without DCP's event log.
    checkpoint_report = out[out.index("test_checkpoint_then_rank1_fails _") :]
    checkpoint_report = checkpoint_report[: checkpoint_report.index("\n___")]
    assert "Captured log call" in checkpoint_report
    assert "the user's own log line" in checkpoint_report
    assert DCP_EVENT not in out
    # Both ranks released the group themselves before the teardown: checkpoint_dir skips its
    # barrier on its own, nothing to report.
    both = out[out.index("test_checkpoint_then_both_ranks_fail _") :]
    both = both[: both.index("\n___")]
    assert "rank 1 fails too" in both
    assert "teardown collective skipped" not in both


def test_an_option_brings_torch_distributed_logs_back(session):
    result = session.runpytest_subprocess(
        "-p",
        "no:cacheprovider",
        "--mfsdp-platform=cpu",
        "--mfsdp-distributed-logs=true",
        "-k",
        "test_checkpoint_then_rank1_fails",
        timeout=300,
    )
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([f"DEBUG    {DCP_EVENT}:*'func_name': 'save'*"])
