"""Under the user's own torchrun, a timed-out test's failure says who is stuck where, as the
plain-mode report does: rank 0 aligns every rank's c10d flight record into it, and the session goes
on with the next test."""

import time

HANG_TIMEOUT_S = 6

STUCK = f"""
import time
import pytest
import torch
import torch.distributed as dist

@pytest.mark.distributed(world_size=2, timeout={HANG_TIMEOUT_S})
def test_rank1_skips_the_broadcast(dist_env):
    dist.all_reduce(torch.ones(2))
    if dist_env.rank == 1:
        time.sleep(3600)
    dist.broadcast(torch.ones(3), src=0)

@pytest.mark.distributed(world_size=2)
def test_after_the_hang(dist_env):
    t = torch.ones(2)
    dist.all_reduce(t)
    assert t.tolist() == [2.0, 2.0]
"""


def test_a_torchrun_hang_names_who_never_entered_which_collective(
    pytester, leftover_processes, isolated_tmp, torchrun_pytest, leftover_files
):
    pytester.makepyfile(test_stuck=STUCK)
    logs = pytester.path / "logs"
    # an earlier session's records in the same log dir must not be taken for this one's
    (logs / "torchrun").mkdir(parents=True)
    for rank in range(2):
        (logs / "torchrun" / f"rank{rank}.expired").write_text(
            "test_stuck.py::test_rank1_skips_the_broadcast"
        )
        (logs / "torchrun" / f"flight_recorder_rank_{rank}").write_bytes(b"stale")
        (logs / "torchrun" / f"rank{rank}.fr").write_bytes(b"stale")  # the dumps' earlier name
    started = time.monotonic()
    result = pytester.run(
        *torchrun_pytest(),
        "-p",
        "no:cacheprovider",
        "--mfsdp-platform=cpu",
        f"--mfsdp-log-dir={logs}",
        timeout=180,
    )
    text = result.stdout.str() + result.stderr.str()
    assert result.ret == 1, text  # tests failed: the session ended as pytest ends one
    assert "1 failed, 1 passed" in result.stdout.str(), text  # the next test ran, on a rebuilt group
    assert text.count("collectives (c10d flight recorder") == 1, text  # rank 0's, once
    assert "rank 0: last completed #1 (all_reduce, default_pg, sizes [[2]]); in #2 (broadcast" in text, text
    assert "rank 1 never entered collective #2 (broadcast, default_pg) that rank 0 has waited in for" in text
    # and how to read the dumps again: this package's summary and torch's analyser
    assert f"python -m pytest_megatron_fsdp collectives {logs / 'torchrun'}" in text, text
    assert f"torchfrtrace {logs / 'torchrun'} -p flight_recorder_rank_" in text, text
    # both ranks dumped their stacks into their failure, merged into the report
    assert "timeout on rank 0" in text, text
    assert "timeout on rank 1" in text, text
    assert "collectives (c10d flight recorder" in (logs / "torchrun" / "rank0.log").read_text()
    assert time.monotonic() - started < HANG_TIMEOUT_S + 60, text  # start-up, timeout, dumps
    assert leftover_processes(pytester.path) == []
    # the ranks removed their private temp trees at the session's end; torchrun's own stays
    assert leftover_files(isolated_tmp, ignore=("torchelastic_",)) == []
