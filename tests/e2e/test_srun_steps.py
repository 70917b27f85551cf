"""srun-launched ranks, for real but without Slurm: ``srun_sim.py`` starts a step's tasks with the
variables srun sets, each running pytest. One node with 2 tasks, two loopback "nodes" with 2 tasks
each, a task killed mid-test, and a step whose other task never runs pytest."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SIM = Path(__file__).parent.parent / "srun_sim.py"

STEP_TESTS = """
import os
import pytest
import torch
import torch.distributed as dist

WORLD = int(os.environ["SLURM_STEP_NUM_TASKS"])

@pytest.mark.distributed(world_size=WORLD)
def test_ranks_are_the_steps_tasks(dist_env):
    assert dist_env.rank == int(os.environ["SLURM_PROCID"])
    assert dist_env.world_size == WORLD
    assert dist_env.local_rank == int(os.environ["SLURM_LOCALID"])
    # exported as torchrun would have: code that reads them sees an srun rank alike
    assert os.environ["RANK"] == os.environ["SLURM_PROCID"]
    assert os.environ["LOCAL_WORLD_SIZE"] == os.environ["SLURM_STEP_TASKS_PER_NODE"].split("(")[0]
    assert os.environ["MASTER_ADDR"] == "127.0.0.1"
    t = torch.full((1,), float(dist_env.rank))
    dist.all_reduce(t)
    assert t.item() == sum(range(WORLD))

def test_plain():
    pass
"""

TRAINING_TEST = """
import pytest

@pytest.mark.distributed(world_size=2)
def test_trains(megatron_fsdp_run, run_config):
    megatron_fsdp_run(run_config).train(2)
"""


def _sim(
    path: Path, *args: str, job: int, timeout: float = 300, nodes: int = 1
) -> subprocess.CompletedProcess:
    env = dict(os.environ)  # plain: tests/unit/conftest.py removed torchrun and MFSDP_ variables
    return subprocess.run(
        [sys.executable, str(SIM), f"--job-id={job}", f"--timeout={timeout}", f"--nodes={nodes}", *args],
        cwd=path,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout + 60,
    )


def _pytest(*args: str) -> list[str]:
    return ["--", sys.executable, "-m", "pytest", "-rA", *args]  # rank logs in .pytest_cache


def test_two_tasks_on_one_node(pytester, isolated_tmp, leftover_processes, srun_job_id, leftover_files):
    """No option given: the first distributed test starts the plugin in each task (CPU ranks, the
    emulation), task 0 reports for both; Megatron-FSDP trains as under torchrun."""
    pytester.makepyfile(test_step=STEP_TESTS, test_training=TRAINING_TEST)
    done = _sim(pytester.path, "--ntasks-per-node=2", *_pytest(), job=srun_job_id(1))
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "0: " + "=" * 10 in out, out
    assert "3 passed" in out, out
    task1 = [line for line in out.splitlines() if line.startswith("1: ")]
    assert not any("passed" in line or "test session starts" in line for line in task1), out  # in its log
    assert "srun-sim: task 0: exit code 0" in out
    assert "srun-sim: task 1: exit code 0" in out
    assert "megatron-fsdp: platform=cpu" in out
    assert "world_size=2" in out
    assert leftover_files(isolated_tmp) == []
    assert leftover_processes(pytester.path) == []


def test_two_by_two_on_two_loopback_nodes(
    pytester, isolated_tmp, leftover_processes, srun_job_id, leftover_files
):
    """Nodes 127.0.0.1 and 127.0.0.2 (``SLURM_STEP_NODELIST=127.0.0.[1-2]``), 2 tasks each: four
    ranks, local ranks 0 and 1 on each node, the store on the first node's address."""
    pytester.makepyfile(test_step=STEP_TESTS)
    done = _sim(
        pytester.path, "--ntasks-per-node=2", *_pytest("--mfsdp-platform=cpu"), job=srun_job_id(2), nodes=2
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "2 passed" in out, out
    assert "world_size=4" in out, out
    assert [f"srun-sim: task {t}: exit code 0" in out for t in range(4)] == [True] * 4, out
    assert leftover_files(isolated_tmp) == []
    assert leftover_processes(pytester.path) == []


KILLED_TEST = """
import pathlib
import time
import pytest
import torch.distributed as dist

@pytest.mark.distributed(world_size=2, timeout=240)
def test_killed_mid_test(dist_env):
    pathlib.Path(f"started-{dist_env.rank}").write_text("x")
    if dist_env.rank == 1:
        time.sleep(600)  # srun_sim sends SIGKILL here
    dist.barrier()  # rank 0 waits in a collective for the killed rank

@pytest.mark.distributed(world_size=2)
def test_never_runs(dist_env):
    pass
"""


def test_a_task_killed_mid_test_ends_the_step_with_one_clear_report(
    pytester, isolated_tmp, leftover_processes, srun_job_id, leftover_files
):
    """srun (without -K) waits for the other tasks: rank 0 must notice by itself that rank 1 is gone
    (no heartbeat), fail the test saying so, stop the session, and leave nothing behind: no process,
    nothing in $TMPDIR (rank 1's private tree included, which it could not remove)."""
    pytester.makepyfile(test_killed=KILLED_TEST)
    done = _sim(
        pytester.path,
        "--ntasks-per-node=2",
        f"--kill=1:{pytester.path / 'started-1'}",
        *_pytest(),
        job=srun_job_id(1),
    )
    out = done.stdout + done.stderr
    assert "srun-sim: task 1: killed by SIGKILL" in out, out
    assert "srun-sim: task 0: exit code 2" in out, out  # interrupted: the session stopped
    assert "rank 1 gave no sign of life for 20 s while this rank waited for the outcome of " in out, out
    assert "test_killed.py::test_killed_mid_test" in out
    assert "the session stops (every later test needs all ranks)" in out
    assert "test_never_runs" not in out.split("short test summary info")[-1]
    assert leftover_files(isolated_tmp) == []
    assert leftover_processes(pytester.path) == []


def test_a_task_that_never_runs_pytest_is_one_line_not_a_hang(
    pytester, isolated_tmp, leftover_processes, srun_job_id, leftover_files
):
    """SLURM_STEP_NUM_TASKS=2 but task 1 runs something else: task 0 gives up at the rendezvous after
    --mfsdp-pg-timeout with one line naming the step."""
    pytester.makepyfile(test_step=STEP_TESTS)
    command = " ".join([sys.executable, "-m", "pytest", "--mfsdp-pg-timeout=5"])  # rank log in .pytest_cache
    done = _sim(
        pytester.path,
        "--ntasks-per-node=2",
        "--",
        "sh",
        "-c",
        f'if [ "$SLURM_PROCID" = 1 ]; then exit 0; fi; exec {command}',
        job=srun_job_id(1),
        timeout=120,
    )
    out = done.stdout + done.stderr
    assert "srun-sim: task 0: exit code 4" in out, out  # a usage error, not a hang
    errors = [line for line in out.splitlines() if "ERROR: megatron-fsdp: rank 0 of 2 could not meet" in line]
    assert len(errors) == 1, out
    assert "within 5 s (--mfsdp-pg-timeout)" in errors[0]
    assert "srun task 0 of 2" in errors[0]
    assert "every one of the step's 2 tasks must run pytest" in errors[0]
    assert leftover_files(isolated_tmp) == []
    assert leftover_processes(pytester.path) == []


def test_a_step_that_never_uses_the_plugin_runs_each_task_as_without_it(
    pytester, isolated_tmp, leftover_files
):
    """``srun -n2 pytest`` on a suite without distributed tests: two independent sessions, each
    printing its own report (inert until asked), no rendezvous, nothing in $TMPDIR."""
    pytester.makepyfile(
        test_plain="""
import os, signal

def test_task():
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    assert "RANK" not in os.environ  # nothing exported for a session that does not use the plugin
    print(f"TASK {os.environ['SLURM_PROCID']} RAN", flush=True)
"""
    )
    done = _sim(pytester.path, "--ntasks-per-node=2", *_pytest("-s", "-p", "no:cacheprovider"), job=4242)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    lines = out.splitlines()
    assert any(line.startswith("0: ") and "TASK 0 RAN" in line for line in lines), out
    assert any(line.startswith("1: ") and "TASK 1 RAN" in line for line in lines), out
    assert [line[:3] for line in lines if "1 passed" in line] == ["0: ", "1: "], out
    assert "megatron-fsdp:" not in out
    assert leftover_files(isolated_tmp) == []
