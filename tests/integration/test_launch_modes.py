"""The ways users launch the suite: pytest-xdist, multi-node torchrun, -x, and a local test after a
distributed one (timeout precedence and GPU counts, read in process: tests/unit/test_plugin.py)."""

import json
import os
import socket
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from pytest_megatron_fsdp.harness.launcher import Rendezvous, torchrun_command


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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_node_torchrun_ranks_know_global_and_local_rank(pytester):
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
    port = _free_port()
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
    assert list(shared.iterdir()) == []  # the session's private subdirectory is gone


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


REPO = Path(__file__).resolve().parents[2]


def test_the_functional_suite_under_xdist_runs_like_without_it(tmp_path, leftover_processes):
    """``pytest -n 2`` on the real checkpoint and strategy files: every test passes or is a strict
    xfail, as without ``-n`` (nothing fails, nothing errors, nothing is lost); each worker's rank
    sets log apart; nothing is left running.

    No rerun is allowed. Two rank sets training Megatron-FSDP at once on this 2-core machine used
    to lose a rank to heap corruption in 5 of 17 runs: torch's gloo with two worker threads per
    group and concurrent coalesced all-gathers (test_gloo_in_order.py); CPU ranks now give every
    gloo group one thread."""
    files = ["tests/functional/test_checkpoint.py", "tests/functional/test_strategies.py"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MFSDP_")}
    env["TMPDIR"] = str(tmp_path)
    logs = tmp_path / "logs"
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", *files, "--collect-only", "-q", "-p", "no:cacheprovider"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    count = sum(1 for line in collected.stdout.splitlines() if "::" in line)
    assert count > 20, collected.stdout
    junit = tmp_path / "junit.xml"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            *files,
            "-n",
            "2",
            "-p",
            "no:cacheprovider",
            "-q",
            f"--junitxml={junit}",
            f"--mfsdp-log-dir={logs}",
            "--mfsdp-platform=cpu",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    out = run.stdout + run.stderr
    assert "INTERNALERROR" not in out, out[-5000:]
    suite = ET.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite[0]
    assert int(suite.get("tests")) == count, out[-3000:]
    failed = [
        f"{case.get('classname')}::{case.get('name')}\n{problem.text}"
        for case in suite.iter("testcase")
        for problem in [*case.iter("failure"), *case.iter("error")]
    ]
    assert failed == [], "\n\n".join(failed)[-20000:]  # each failure's whole report, rank logs included
    assert run.returncode == 0, out[-3000:]
    workers = {p.name.split("-", 1)[0] for p in logs.iterdir()}
    assert workers <= {"gw0", "gw1"}, sorted(p.name for p in logs.iterdir())
    assert workers, sorted(p.name for p in logs.iterdir())
    assert leftover_processes(tmp_path) == []  # no rank, torchrun agent or worker outlives the session
