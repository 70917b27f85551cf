"""Under the user's own torchrun, a test's timeout fails that test and the session goes on: the
watchdog interrupts the main thread where it is in Python (a rank waiting in a collective comes back
when its peer, interrupted, releases the process group), every rank fails the test, the process
group is rebuilt and the next test runs. A rank that never comes back (stuck in C with the signal
blocked) ends the session within the timeout plus 30 s, the JUnit file and the summary naming every
result and every test not run."""

from __future__ import annotations

import functools
import shlex
import socket
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

TIMEOUT_S = 15
#: what the watchdog gives a rank to come back from a timeout, and the report after it
WITHIN_S = TIMEOUT_S + 30
#: each rank starts a test (and its timeout's clock) on its own, a moment after or before its peer:
#: a rank freed by its peer's timeout reports at most this much less than the timeout
START_SKEW_S = 2

TESTS = """
import time
import pytest
import torch
import torch.distributed as dist

@pytest.mark.distributed(world_size=2)
def test_1_passes(dist_env):
    dist.all_reduce(torch.ones(2))

@pytest.mark.distributed(world_size=2)
def test_2_sleeps_past_its_timeout(dist_env):
    time.sleep(600)

@pytest.mark.distributed(world_size=2)
def test_3_rank1_never_joins_the_all_reduce(dist_env):
    if dist_env.rank == 1:
        time.sleep(600)
    dist.all_reduce(torch.ones(2))

@pytest.mark.distributed(world_size=2)
def test_4_passes_after_the_timeouts(dist_env):
    t = torch.ones(2)
    dist.all_reduce(t)
    assert t.tolist() == [2.0, 2.0]
"""

#: rank {stuck} blocks the watchdog's signal and sleeps in C: it never comes back to Python
STUCK = """
import ctypes
import signal
import time
import pytest
import torch
import torch.distributed as dist

@pytest.mark.distributed(world_size=2)
def test_1_passes(dist_env):
    dist.all_reduce(torch.ones(2))

@pytest.mark.distributed(world_size=2)
def test_2_stuck_in_c(dist_env):
    if dist_env.rank == 0:
        open("stuck_started", "w").write(repr(time.time()))
    if dist_env.rank == {stuck}:
        signal.pthread_sigmask(signal.SIG_BLOCK, {{signal.SIGALRM}})
        ctypes.CDLL(None).sleep(600)
    dist.all_reduce(torch.ones(2))

@pytest.mark.distributed(world_size=2)
def test_3_never_runs(dist_env):
    pass

def test_4_local_never_runs():
    pass
"""


#: both ranks wait in C for the other (each in a receive the other never sends): no interruption
#: reaches them and no release closes a connection with work in flight; the group's own timeout
#: ({pg} s, past the timeout plus the 20 s the watchdog gives a rank outside a collective) ends both
MUTUAL = """
import pytest
import torch
import torch.distributed as dist

@pytest.mark.distributed(world_size=2)
def test_1_both_ranks_receive_from_each_other(dist_env):
    dist.recv(torch.zeros(2), src=1 - dist_env.rank)

@pytest.mark.distributed(world_size=2)
def test_2_runs_after_it(dist_env):
    t = torch.ones(2)
    dist.all_reduce(t)
    assert t.tolist() == [2.0, 2.0]
"""
MUTUAL_PG_TIMEOUT_S = TIMEOUT_S + 25


def _cases(junit: ET.Element) -> dict[str, ET.Element]:
    return {case.get("name", ""): case for case in junit.iter("testcase")}


@pytest.fixture(scope="module")
def timeouts_session(run_scenario):
    started = time.monotonic()
    scenario = run_scenario(
        "timeouts",
        {"test_timeouts.py": TESTS},
        f"--mfsdp-timeout={TIMEOUT_S}",
        "--junitxml=junit.xml",
        "--mfsdp-platform=cpu",
        "--mfsdp-log-dir=logs",
        torchrun=True,
        timeout=400,
    )
    return scenario, time.monotonic() - started


def test_a_timeout_fails_the_test_and_the_session_goes_on(timeouts_session):
    scenario, _ = timeouts_session
    out = scenario.out + scenario.result.stderr.str()
    assert scenario.result.ret != 0, out
    cases = _cases(scenario.junit)
    assert list(cases) == [
        "test_1_passes",
        "test_2_sleeps_past_its_timeout",
        "test_3_rank1_never_joins_the_all_reduce",
        "test_4_passes_after_the_timeouts",
    ], out
    for passed in ("test_1_passes", "test_4_passes_after_the_timeouts"):
        assert list(cases[passed]) == [], ET.tostring(cases[passed]).decode()
    for name in ("test_2_sleeps_past_its_timeout", "test_3_rank1_never_joins_the_all_reduce"):
        failures = cases[name].findall("failure")
        assert len(failures) == 1, ET.tostring(cases[name]).decode()
        text = failures[0].get("message", "") + (failures[0].text or "")
        assert f"MFSDP-TIMEOUT: test_timeouts.py::{name} exceeded its {TIMEOUT_S} s timeout" in text, text
    assert "2 failed, 2 passed" in scenario.out, out


def test_each_rank_interrupted_says_so_and_rank0_aligns_the_collectives(timeouts_session):
    scenario, _ = timeouts_session
    junit_text = ET.tostring(_cases(scenario.junit)["test_3_rank1_never_joins_the_all_reduce"]).decode()
    # rank 1 was interrupted in its sleep; its release of the group brought rank 0 back from the
    # all_reduce it waited in, where the interruption failed it too
    assert "timeout on rank 1" in junit_text, junit_text
    assert "timeout on rank 0" in junit_text, junit_text
    assert "collectives (c10d flight recorder" in junit_text, junit_text
    assert "rank 1 never entered collective" in junit_text, junit_text
    assert (
        "process group rebuilt after test_timeouts.py::test_3"
        in (scenario.logs / "torchrun" / "rank0.log").read_text()
    )


def test_each_timeout_costs_its_timeout_not_more(timeouts_session):
    scenario, _ = timeouts_session
    times = {case.get("name"): float(case.get("time", "0")) for case in scenario.junit.iter("testcase")}
    for name in ("test_2_sleeps_past_its_timeout", "test_3_rank1_never_joins_the_all_reduce"):
        assert TIMEOUT_S - START_SKEW_S <= times[name] < TIMEOUT_S + 10, times


def test_nothing_is_left_running_or_behind(timeouts_session):
    scenario, _ = timeouts_session
    assert scenario.leftovers == []
    # the ranks' private temp trees and the session's shared dir are gone; torchrun's own stays
    assert [name for name in scenario.tmp_left if not name.startswith("torchelastic_")] == []


@pytest.mark.parametrize("stuck", [0, 1])
def test_a_rank_stuck_in_c_ends_the_session_with_every_result_reported(inner_session, stuck):
    scenario = inner_session(
        {"test_stuck.py": STUCK.format(stuck=stuck)},
        f"--mfsdp-timeout={TIMEOUT_S}",
        "--junitxml=junit.xml",
        "--mfsdp-platform=cpu",
        "--mfsdp-log-dir=logs",
        torchrun=True,
        timeout=300,
    )
    out = scenario.out + scenario.result.stderr.str()
    assert scenario.result.ret != 0, out
    # the session's own end: not the checks after it for what it left (asserted below), which wait
    assert scenario.ended - float((scenario.path / "stuck_started").read_text()) < WITHIN_S, out
    cases = _cases(scenario.junit)
    assert list(cases) == [
        "test_1_passes",
        "test_2_stuck_in_c",
        "test_3_never_runs",
        "test_4_local_never_runs",
    ]
    assert list(cases["test_1_passes"]) == []
    failure = cases["test_2_stuck_in_c"].find("failure")
    assert failure is not None, ET.tostring(cases["test_2_stuck_in_c"]).decode()
    reason = f"not run: the session ended after test_stuck.py::test_2_stuck_in_c timed out on rank {stuck}"
    for name in ("test_3_never_runs", "test_4_local_never_runs"):
        not_run = cases[name].find("error")  # never a skip
        assert not_run is not None, ET.tostring(cases[name]).decode()
        assert reason in not_run.get("message", ""), ET.tostring(cases[name]).decode()
    # the summary: the stuck rank's story, the counts, the tests not run by name
    assert f"rank {stuck} did not come back from the timeout of test_stuck.py::test_2_stuck_in_c" in out, out
    assert "1 failed, 1 passed, 2 not run" in scenario.out, out
    assert "megatron-fsdp: 2 tests not run" in scenario.out, out
    assert "test_stuck.py::test_3_never_runs\n" in scenario.out + "\n", out
    assert scenario.leftovers == []


def test_ranks_stuck_in_a_collective_with_each_other_come_back_at_its_timeout(inner_session):
    scenario = inner_session(
        {"test_mutual.py": MUTUAL},
        f"--mfsdp-timeout={TIMEOUT_S}",
        f"--mfsdp-pg-timeout={MUTUAL_PG_TIMEOUT_S}",
        "--junitxml=junit.xml",
        "--mfsdp-platform=cpu",
        "--mfsdp-log-dir=logs",
        torchrun=True,
        timeout=300,
    )
    out = scenario.out + scenario.result.stderr.str()
    cases = _cases(scenario.junit)
    assert list(cases) == ["test_1_both_ranks_receive_from_each_other", "test_2_runs_after_it"], out
    failure = cases["test_1_both_ranks_receive_from_each_other"].find("failure")
    assert failure is not None, ET.tostring(cases["test_1_both_ranks_receive_from_each_other"]).decode()
    assert list(cases["test_2_runs_after_it"]) == [], out  # passed: the session went on
    assert "1 failed, 1 passed" in scenario.out, out
    assert "not run" not in scenario.out, out
    assert scenario.leftovers == []


def _srun_step(job_id: int, pytest_args: list[str]) -> list[str]:
    """One srun step of 2 tasks on one node (tests/srun_sim.py)."""
    sim = Path(__file__).parent.parent / "srun_sim.py"
    job = f"--job-id={job_id}"
    return [
        sys.executable,
        str(sim),
        job,
        "--timeout=300",
        "--ntasks-per-node=2",
        "--",
        sys.executable,
        "-m",
        "pytest",
        *pytest_args,
    ]


def _two_torchrun_agents(pytest_args: list[str]) -> list[str]:
    """Two torchrun agents on loopback, one rank each (``--nnodes=2``), as on two nodes; the
    command exits with the higher of their exit codes."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    def agent(node: int) -> str:
        return shlex.join(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                f"--node_rank={node}",
                "--nproc_per_node=1",
                "--master_addr=127.0.0.1",
                f"--master_port={port}",
                "-m",
                "pytest",
                *pytest_args,
            ]
        )

    script = (
        f"{agent(0)} & first=$!; {agent(1)}; second=$?; wait $first; first=$?; "
        "exit $(( first > second ? first : second ))"
    )
    return ["bash", "-c", script]


@pytest.mark.parametrize("launcher", ["srun", "torchrun-2-nodes", "plain"])
def test_the_scenario_under_every_launcher(run_scenario, srun_job_id, launcher):
    """The same four tests in an srun step, under two torchrun agents (``--nnodes=2`` on loopback)
    and in plain mode: both timed-out tests fail with their reasons, the tests after them run and
    the last one passes, the JUnit file and the summary say so, nothing is left."""
    launch = {
        "srun": functools.partial(_srun_step, srun_job_id(1)),
        "torchrun-2-nodes": _two_torchrun_agents,
        "plain": None,
    }[launcher]
    scenario = run_scenario(
        f"timeouts-{launcher}",
        {"test_timeouts.py": TESTS},
        f"--mfsdp-timeout={TIMEOUT_S}",
        "--junitxml=junit.xml",
        "--mfsdp-platform=cpu",
        "--mfsdp-log-dir=logs",
        launch=launch,
        timeout=400,
    )
    out = scenario.out + scenario.result.stderr.str()
    assert scenario.result.ret != 0, out
    cases = _cases(scenario.junit)
    assert list(cases) == [
        "test_1_passes",
        "test_2_sleeps_past_its_timeout",
        "test_3_rank1_never_joins_the_all_reduce",
        "test_4_passes_after_the_timeouts",
    ], out
    for passed in ("test_1_passes", "test_4_passes_after_the_timeouts"):
        assert list(cases[passed]) == [], ET.tostring(cases[passed]).decode()
    for name in ("test_2_sleeps_past_its_timeout", "test_3_rank1_never_joins_the_all_reduce"):
        failures = cases[name].findall("failure")
        assert len(failures) == 1, ET.tostring(cases[name]).decode()
        text = failures[0].get("message", "") + (failures[0].text or "")
        assert f"exceeded its {TIMEOUT_S} s timeout" in text, text
        assert "hung: no progress on any rank for" in text, text
    assert "2 failed, 2 passed" in out, out
    assert scenario.leftovers == []
    assert [name for name in scenario.tmp_left if not name.startswith("torchelastic_")] == []
