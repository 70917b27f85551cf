"""A real hang, read after the fact: the failure report names both readers of the flight-recorder
dumps, and both read them: ``python -m pytest_megatron_fsdp collectives`` (with torch unimportable)
and torch's own ``torchfrtrace``."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from hang_scenarios import RANK1_SKIPS_THE_BROADCAST

WITHOUT_TORCH = Path(__file__).parents[1] / "unit" / "postmortem_without_torch.py"


def _torchfrtrace() -> list[str]:
    """torch's console script beside this interpreter, else its module."""
    script = Path(sys.executable).with_name("torchfrtrace")
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace"]


def test_a_hangs_dumps_are_read_by_the_cli_and_by_torchfrtrace(pytester, isolated_tmp, leftover_processes):
    pytester.makepyfile(test_stuck=RANK1_SKIPS_THE_BROADCAST)
    logs = pytester.path / "logs"
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--mfsdp-platform=cpu", f"--mfsdp-log-dir={logs}", timeout=180
    )
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    run_dir = logs / "batch1-world2"
    # the failure report names both commands, for this rank set's log dir
    summary = f"summary again: python -m pytest_megatron_fsdp collectives {run_dir}"
    analyser = f"torch's analyser: torchfrtrace {run_dir} -p flight_recorder_rank_"
    assert summary in out, out
    assert analyser in out, out
    assert sorted(p.name for p in run_dir.glob("flight_recorder_rank_*")) == [
        "flight_recorder_rank_0",
        "flight_recorder_rank_1",
    ]

    cli = subprocess.run(
        [sys.executable, str(WITHOUT_TORCH), "collectives", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert cli.returncode == 0, cli.stderr
    assert "timed-out test: test_stuck.py::test_rank1_skips_the_broadcast" in cli.stdout, cli.stdout
    assert "  #1 (all_reduce, default_pg, sizes [[2]]) completed" in cli.stdout, cli.stdout
    assert re.search(
        r"first mismatch: rank 1 never entered collective #2 \(broadcast, default_pg\) that rank 0 has "
        r"waited in for \d+\.\d s",
        cli.stdout,
    ), cli.stdout

    # torch's analyser, as the report tells the user to run it
    command = analyser.split(": ", 1)[1].split()
    trace = subprocess.run(
        [*_torchfrtrace(), *command[1:]], capture_output=True, text=True, timeout=120, cwd=pytester.path
    )
    assert trace.returncode == 0, trace.stdout + trace.stderr
    said = trace.stdout + trace.stderr
    assert "Not all ranks joining collective, sequence number: 2" in said, said
    assert "collective: gloo:broadcast" in said, said
    assert "missing ranks: {1}" in said, said

    stacks = subprocess.run(
        [sys.executable, str(WITHOUT_TORCH), "stacks", str(logs)], capture_output=True, text=True, timeout=60
    )
    assert stacks.returncode == 0, stacks.stderr
    for rank in range(2):  # each rank's watchdog dumped its stacks, after the timeout banner
        assert re.search(rf"^rank {rank}: \d+ stack dumps? in ", stacks.stdout, re.M), stacks.stdout
    assert "MFSDP-TIMEOUT: test_stuck.py::test_rank1_skips_the_broadcast" in stacks.stdout
    assert re.search(r'test_stuck.py", line \d+ in test_rank1_skips_the_broadcast', stacks.stdout), (
        stacks.stdout
    )
    assert leftover_processes(pytester.path) == []
