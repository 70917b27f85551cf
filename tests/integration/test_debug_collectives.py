"""``--mfsdp-debug-collectives``: ranks that call different collectives fail at once, each with
torch's mismatch message, instead of hanging until the test's timeout.

torch's TORCH_DISTRIBUTED_DEBUG=DETAIL wraps every process group (ProcessGroupWrapper): before each
collective the ranks compare op, shapes and dtypes through a helper gloo group.
"""

import time

TEST_TIMEOUT_S = 60
#: seconds from the mismatched collectives to the failure's report in the parent session (the
#: check itself takes milliseconds; the rest is the ranks' agreement and the group's rebuild)
REPORT_BOUND_S = 10

MISMATCH = f"""
import time

import pytest
import torch
import torch.distributed as dist


@pytest.mark.distributed(world_size=2, timeout={TEST_TIMEOUT_S})
def test_mismatched_collectives(dist_env):
    if dist_env.rank == 0:
        with open("entered_at.txt", "w") as f:
            f.write(repr(time.time()))
        dist.broadcast(torch.ones(3), src=0)
    else:
        dist.all_reduce(torch.ones(5))


@pytest.mark.distributed(world_size=2)
def test_collectives_work_again(dist_env):
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 2
"""

REPORT_TIME_CONFTEST = """
import os, time
def pytest_runtest_logreport(report):
    if "RANK" not in os.environ and report.failed:
        with open("reported_at.txt", "w") as f:
            f.write(repr(time.time()))
"""


def _assert_each_rank_names_the_mismatch(out: str) -> None:
    report = out[out.index("_ test_mismatched_collectives _") :]
    assert "failed on ranks 0, 1" in report, out
    rank0, rank1 = report.split("---------- rank 1 (log:")
    for text, me, peer in ((rank0, "Rank 0", "Rank 1"), (rank1, "Rank 1", "Rank 0")):
        assert "RuntimeError: Detected mismatch between collectives on ranks." in text, out
        assert f"{me} is running collective: CollectiveFingerPrint(" in text, out
        assert f"but {peer} is running collective: CollectiveFingerPrint(" in text, out
    assert "OpType=BROADCAST, TensorShape=[3]" in rank0, out
    assert "OpType=ALLREDUCE, TensorShape=[5]" in rank0, out


def test_mismatched_collectives_fail_at_once_on_every_rank(
    pytester, monkeypatch, leftover_processes, isolated_tmp, leftover_files
):
    monkeypatch.delenv("TORCH_DISTRIBUTED_DEBUG", raising=False)
    pytester.makepyfile(test_mismatch=MISMATCH)
    pytester.makeconftest(REPORT_TIME_CONFTEST)
    result = pytester.runpytest_subprocess(
        "--mfsdp-platform=cpu", "--mfsdp-debug-collectives=true", timeout=240
    )
    out = result.stdout.str()
    result.assert_outcomes(failed=1, passed=1)  # and the rebuilt group works: the check is per test
    _assert_each_rank_names_the_mismatch(out)
    entered = float((pytester.path / "entered_at.txt").read_text())
    reported = float((pytester.path / "reported_at.txt").read_text())
    assert reported - entered <= REPORT_BOUND_S, (reported - entered, out)
    assert leftover_processes(pytester.path) == []
    assert leftover_files(isolated_tmp) == []


def test_torchrun_mode_too(
    pytester, monkeypatch, leftover_processes, isolated_tmp, torchrun_pytest, leftover_files
):
    """The user's own torchrun: the option (here from the environment) takes effect in each rank's
    pytest before any conftest or test module runs."""
    monkeypatch.delenv("TORCH_DISTRIBUTED_DEBUG", raising=False)
    monkeypatch.setenv("MFSDP_DEBUG_COLLECTIVES", "true")
    pytester.makepyfile(test_mismatch=MISMATCH)
    result = pytester.run(
        *torchrun_pytest(),
        "-p",
        "no:cacheprovider",
        "--mfsdp-platform=cpu",
        "--mfsdp-log-dir=logs",
        timeout=180,
    )
    out = result.stdout.str()
    assert "1 failed, 1 passed" in out, out
    _assert_each_rank_names_the_mismatch(out)
    # from the collectives to the end of the whole torchrun session (the next test, every rank's
    # exit): far below the test's 60 s timeout, which it would otherwise have waited out
    entered = float((pytester.path / "entered_at.txt").read_text())
    assert time.time() - entered < TEST_TIMEOUT_S / 2, out
    assert leftover_processes(pytester.path) == []
    assert leftover_files(isolated_tmp, ignore=("torchelastic_",)) == []
