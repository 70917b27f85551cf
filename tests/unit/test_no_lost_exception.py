"""No lost exception: a rank that fails while its peer waits inside Megatron-FSDP's own collectives
is reported, with its traceback, within the process-group timeout, not the test's.

The scenario as a user writes it: rank 1 raises between two ``run.train`` calls, so rank 0 goes on
into the next iteration and waits in Megatron-FSDP's coalesced parameter all-gather on the
data-parallel group, which Megatron creates with its own 30-minute timeout.
"""

import os
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


@pytest.mark.distributed(world_size=2, timeout={TEST_TIMEOUT_S})
def test_boom(megatron_fsdp_run, run_config, dist_env):
    run = megatron_fsdp_run(run_config)
    run.train(2)
    if dist_env.rank == 1:
        with open("raised_at.txt", "w") as f:
            f.write(repr(time.time()))
        raise RuntimeError("boom on rank 1 between two train calls")
    run.train(2)  # rank 0: into the next iteration's collectives, which rank 1 never enters


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
    if "RANK" not in os.environ and report.nodeid.endswith("test_boom") and report.failed:
        with open("reported_at.txt", "w") as f:
            f.write(repr(time.time()))
"""


def _processes_mentioning(text: str) -> list[str]:
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            found.append(f"{pid}: {cmdline}")
    return found


def test_a_rank_failing_while_its_peer_waits_in_a_megatron_fsdp_collective_is_reported_in_time(
    pytester, monkeypatch
):
    tmp = pytester.path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
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
    result.assert_outcomes(failed=1, passed=1)

    # rank 1's exception and traceback are in the report, under rank 1
    assert "failed on ranks 0, 1" in out, out
    rank1 = out[out.index("---------- rank 1 (log:") :]
    assert "RuntimeError: boom on rank 1 between two train calls" in rank1, out
    assert 'raise RuntimeError("boom on rank 1 between two train calls")' in rank1, out
    assert "test_boom.py:15: RuntimeError" in rank1, out

    # in time: the process-group timeout (every group's, Megatron's included) let rank 0 out
    raised = float((pytester.path / "raised_at.txt").read_text())
    reported = float((pytester.path / "reported_at.txt").read_text())
    assert reported - raised <= REPORT_BOUND_S, (reported - raised, out)

    # rank 1's log had the failure as it happened, before the ranks agreed and rebuilt the group
    log = (logs / "batch1-world2" / "rank1.log").read_text()
    own = log.index("FAILED test_boom.py::test_boom (call) on rank 1:")
    assert "boom on rank 1" in log[own:] and own < log.index("process group rebuilt"), log

    # a rank-set start-up (~10-30 s here) plus the bound, with room for a loaded machine
    assert wall < 120, wall
    assert _processes_mentioning(str(pytester.path)) == []
    assert list(tmp.iterdir()) == []
