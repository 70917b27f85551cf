"""No lost exception: a rank that fails while its peer waits inside Megatron-FSDP's own collectives
is reported, with its traceback, within the process-group timeout, not the test's.

The scenario as a user writes it: rank 1 raises between two ``run.train`` calls, so rank 0 goes on
into the next iteration and waits in Megatron-FSDP's coalesced parameter all-gather
(optim_grads_params) or gradient reduce-scatter (optim_grads) on the data-parallel group, which
Megatron creates with its own 30-minute timeout.
"""

import time

PG_TIMEOUT_S = 5
#: the rank's own test timeout: far above the bound below, so only the process-group timeout can
#: meet that bound
TEST_TIMEOUT_S = 120
#: seconds from rank 1's raise to the failure's report in the parent session: the process-group
#: timeout, then the ranks' agreement, the group's rebuild and the report's trip to the parent
REPORT_BOUND_S = PG_TIMEOUT_S + 10

BOOM = f"""
import time

import pytest
import torch
import torch.distributed as dist


def boom_between_two_train_calls(run, rank, name):
    run.train(2)
    if rank == 1:
        with open(f"raised_at_{{name}}.txt", "w") as f:
            f.write(repr(time.time()))
        raise RuntimeError(f"boom on rank 1 in {{name}}")
    run.train(2)  # rank 0: into the next iteration's collectives, which rank 1 never enters


@pytest.mark.distributed(world_size=2, timeout={TEST_TIMEOUT_S})
def test_all_gather(megatron_fsdp_run, run_config, dist_env):
    # optim_grads_params: rank 0 waits in the parameter all-gather before its backward
    boom_between_two_train_calls(megatron_fsdp_run(run_config), dist_env.rank, "test_all_gather")


@pytest.mark.distributed(world_size=2, timeout={TEST_TIMEOUT_S})
def test_reduce_scatter(megatron_fsdp_run, run_config, dist_env):
    # optim_grads: no parameter all-gather; rank 0 waits in the gradient reduce-scatter
    run_config.ddp.data_parallel_sharding_strategy = "optim_grads"
    boom_between_two_train_calls(megatron_fsdp_run(run_config), dist_env.rank, "test_reduce_scatter")


@pytest.mark.distributed(world_size=2)
def test_collectives_work_again(dist_env):
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 2
"""

# The parent session notes when test_boom's failure reaches it (the ranks load this conftest too).
REPORT_TIME_CONFTEST = """
import os, time
def pytest_runtest_logreport(report):
    if "RANK" not in os.environ and report.failed:
        with open(f"reported_at_{report.nodeid.split('::')[-1]}.txt", "w") as f:
            f.write(repr(time.time()))
"""


def test_a_rank_failing_while_its_peer_waits_in_megatron_fsdp_collectives_is_reported_in_time(
    pytester, leftover_processes, isolated_tmp, leftover_files
):
    pytester.makepyfile(test_boom=BOOM)
    pytester.makeconftest(REPORT_TIME_CONFTEST)
    logs = pytester.path / "logs"
    started = time.monotonic()
    result = pytester.runpytest_subprocess(
        "-p",
        "no:cacheprovider",
        "--mfsdp-platform=cpu",
        f"--mfsdp-pg-timeout={PG_TIMEOUT_S}",
        f"--mfsdp-log-dir={logs}",
        timeout=TEST_TIMEOUT_S + 180,
    )
    wall = time.monotonic() - started
    out = result.stdout.str()
    result.assert_outcomes(failed=2, passed=1)

    for name, waited_in in (
        ("test_all_gather", "in all_gather_and_wait_parameters_ready"),
        ("test_reduce_scatter", "in _bucket_group_gradient_reduce"),
    ):
        # rank 1's exception and traceback are in the report, under rank 1; rank 0 got out of
        # Megatron-FSDP's collective
        report = out[out.index(f"_ {name} _") :]
        report = report[: report.index("Captured")]
        assert "failed on ranks 0, 1" in report, out
        rank0, rank1 = report.split("---------- rank 1 (log:")
        assert waited_in in rank0, out
        assert f"RuntimeError: boom on rank 1 in {name}" in rank1, out
        assert 'raise RuntimeError(f"boom on rank 1 in {name}")' in rank1, out
        assert "test_boom.py:13: RuntimeError" in rank1, out

        # in time: the process-group timeout (every group's, Megatron's included) let rank 0 out
        raised = float((pytester.path / f"raised_at_{name}.txt").read_text())
        reported = float((pytester.path / f"reported_at_{name}.txt").read_text())
        assert reported - raised <= REPORT_BOUND_S, (name, reported - raised, out)

        # rank 1's log had the failure as it happened, before the ranks agreed and rebuilt the group
        log = (logs / "batch1-world2" / "rank1.log").read_text()
        log = log[log.index(f"START test_boom.py::{name}") :]
        own = log.index(f"FAILED test_boom.py::{name} (call) on rank 1:")
        assert f"boom on rank 1 in {name}" in log[own:], log
        assert own < log.index("process group rebuilt"), log

    # a rank-set start-up (~10-30 s here), two model builds and the bound twice, with room for a
    # loaded machine
    assert wall < 150, wall
    assert leftover_processes(pytester.path) == []
    assert leftover_files(isolated_tmp) == []


#: the no-progress bound, below the process-group timeout: the test is reported hung first
HANG_AFTER_S = 8


def test_a_hang_after_a_rank_failed_on_its_own_names_that_rank_and_its_exception(
    pytester, leftover_processes, isolated_tmp, leftover_files
):
    """With the defaults (a 60 s no-progress bound, a 120 s process-group timeout) the peer's wait is
    ended as a hang: the report still says which rank failed first, and with what."""
    pytester.makepyfile(test_boom=BOOM)
    result = pytester.runpytest_subprocess(
        "-p",
        "no:cacheprovider",
        "--mfsdp-platform=cpu",
        f"--mfsdp-hang-after={HANG_AFTER_S}",
        "--mfsdp-pg-timeout=120",
        f"--mfsdp-log-dir={pytester.path / 'logs'}",
        "-k",
        "reduce_scatter or work_again",
        timeout=TEST_TIMEOUT_S + 180,
    )
    out = result.stdout.str()
    result.assert_outcomes(failed=1, passed=1)
    report = out[out.index("_ test_reduce_scatter _") :]
    assert "timed out: the test hung (no progress on any rank" in report, out
    headline = (
        "rank 1 had failed on its own before (its failure below): "
        "RuntimeError: boom on rank 1 in test_reduce_scatter"
    )
    assert headline in report, out
    # the failure itself, under rank 1, before its watchdog's banner
    rank1 = report[report.index("---------- rank 1 (log:") :]
    assert rank1.index("FAILED test_boom.py::test_reduce_scatter (call) on rank 1:") < rank1.index(
        "MFSDP-TIMEOUT"
    ), out
    assert leftover_processes(pytester.path) == []
    assert leftover_files(isolated_tmp) == []
