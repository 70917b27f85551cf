"""The ways users launch the suite: pytest-xdist, multi-node torchrun, -x, and a local test after a
distributed one (timeout precedence and GPU counts, read in process: tests/unit/test_plugin.py; the
functional suite's files under ``pytest -n 2``: tests/e2e/test_functional_under_xdist.py)."""

import json
import os
import subprocess

import pytest

from pytest_megatron_fsdp.parent.launcher import Rendezvous, torchrun_command


def test_under_xdist_each_worker_launches_its_own_rank_sets(pytester):
    pytester.makepyfile(
        test_mixed="""
import os
import pytest
import torch
import torch.distributed as dist

@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("value", [1, 2])
def test_collective(dist_env, value):
    t = torch.full((1,), float(value))
    dist.all_reduce(t)
    assert t.item() == 2 * value

@pytest.mark.parametrize("n", range(2))
def test_plain(n):
    assert "RANK" not in os.environ  # plain tests stay in the xdist worker

@pytest.mark.distributed(world_size=2)
def test_trains(megatron_fsdp_run, run_config):
    megatron_fsdp_run(run_config).train(2)
"""
    )
    result = pytester.runpytest_subprocess(
        "-n",
        "2",
        "-p",
        "no:cacheprovider",
        "--mfsdp-platform=cpu",
        "--mfsdp-report-json=report.json",
        timeout=240,
    )
    result.assert_outcomes(passed=5)
    # the worker's training-run record reaches the controller's summary and JSON report
    result.stdout.fnmatch_lines(["*megatron-fsdp training runs*", "test_mixed.py::test_trains"])
    runs = json.loads((pytester.path / "report.json").read_text())["runs"]
    assert [r["nodeid"] for r in runs] == ["test_mixed.py::test_trains"]
    assert len(runs[0]["losses"]) == 2


def test_two_node_torchrun_ranks_know_global_and_local_rank(pytester, free_port, leftover_files):
    shared = pytester.path / "shared"
    shared.mkdir()
    pytester.makepyfile(
        test_nodes="""
import os
import pytest
import torch.distributed as dist

@pytest.mark.distributed(world_size=2)
def test_ranks_and_shared_dir(dist_env):
    assert dist_env.world_size == 2
    assert dist_env.rank == int(os.environ["GROUP_RANK"])  # one rank per node
    assert dist_env.local_rank == 0                        # ... so each is local rank 0
    assert dist_env.shared_dir.parent == __import__("pathlib").Path(os.environ["SHARED"])
    (dist_env.shared_dir / f"from{dist_env.rank}").write_text("hi")
    dist.barrier()
    assert (dist_env.shared_dir / f"from{1 - dist_env.rank}").read_text() == "hi"
"""
    )
    port = free_port
    env = dict(os.environ)  # plain: tests/conftest.py's plain_environment removed torchrun variables
    env["SHARED"] = str(shared)
    agents = [
        subprocess.Popen(
            [
                *torchrun_command(1, rendezvous=Rendezvous(2, node, f"127.0.0.1:{port}", "mfsdp-two-nodes")),
                "--max-restarts=0",
                "-m",
                "pytest",
                "-p",
                "no:cacheprovider",
                "--mfsdp-platform=cpu",
                f"--mfsdp-shared-dir={shared}",
                "-rA",
            ],
            cwd=pytester.path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in (0, 1)
    ]
    outputs = []
    for agent in agents:
        try:
            outputs.append(agent.communicate(timeout=180)[0])
        finally:
            agent.kill()
    assert [a.returncode for a in agents] == [0, 0], "\n".join(outputs)
    assert "1 passed" in outputs[0]
    assert leftover_files(shared) == []  # the session's private subdirectory is gone


#: a module fixture torn down when the session moves on past a distributed test, and a local test
#: in the next module; then (test_x.py) a batch that -x stops at its first test
LOCAL_AFTER_DISTRIBUTED = {
    "test_a.py": """
import pytest
@pytest.fixture(scope="module")
def mod():
    yield 1
    print("TORN DOWN mod")
def test_local(mod):
    assert mod == 1
@pytest.mark.distributed(world_size=2)
def test_dist(dist_env):
    assert dist_env.world_size == 2
""",
    "test_b.py": "def test_after():\n    pass\n",
    "test_x.py": """
import pytest
@pytest.mark.distributed(world_size=2)
def test_first_fails(dist_env):
    assert False, "stop here"
@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("i", range(3))
def test_never_reached(dist_env, i):
    pass
""",
}


@pytest.fixture(scope="module")
def exitfirst_session(run_scenario):
    return run_scenario("exitfirst", LOCAL_AFTER_DISTRIBUTED, "-x", "-s", "--mfsdp-platform=cpu", timeout=120)


def test_exitfirst_stops_the_batch_and_leaves_no_rank_behind(exitfirst_session):
    # test_a.py and test_b.py pass; test_x.py's batch stops at its first test
    exitfirst_session.result.assert_outcomes(passed=3, failed=1)
    assert "test_never_reached" not in exitfirst_session.out
    assert exitfirst_session.leftovers == []  # the rank set that was still running the batch is gone
    # only the rank logs stay (kept on purpose: failure reports point at them; no cache dir here)
    assert {name.split("/")[0] for name in exitfirst_session.tmp_left} == {"mfsdp-logs"}


def test_a_local_test_after_a_distributed_one_in_another_module_runs(exitfirst_session):
    """The parent's setup state moves on past a distributed test (whose teardown ran in its ranks):
    the module fixture of the local test before it is torn down, and the next module's test runs."""
    exitfirst_session.result.stdout.fnmatch_lines(["*TORN DOWN mod*"])
    # test_a.py's two tests and test_b.py's (test_x.py's first test fails)
    exitfirst_session.result.assert_outcomes(passed=3, failed=1)
