"""pytest-rerunfailures installed and used: ``--reruns``, ``@pytest.mark.flaky`` and its
``only_rerun=`` rerun a distributed test, each attempt in a fresh rank set, as ``--mfsdp-reruns``
does; ``--mfsdp-only-rerun`` (here the marker's ``only_rerun=``) reruns only the kinds of failure it
names. Under torchrun, where no rerun can happen, they are refused in one line.

One plain-mode session for every rerun case (tiny rank sets: world_size=1), one torchrun session.
"""

from __future__ import annotations

import subprocess

import pytest

pytest.importorskip("pytest_rerunfailures", reason="the dev extra's pytest-rerunfailures")

# The parent writes the test it is at into current.txt; a rank set running ahead of it waits there,
# so that each attempt the parent sees is one run of the test (a set that ran ahead is killed when
# an earlier test is rerun, and its run would count as an attempt the parent never saw).
CONFTEST = """
import os
from pathlib import Path


def pytest_runtest_logstart(nodeid, location):
    if "RANK" not in os.environ:  # the parent, not a rank
        (Path(__file__).parent / "current.txt").write_text(nodeid)
"""

# Each attempt appends its rank's pid to attempts-<name>.txt.
TESTS = """
import os
import time
from pathlib import Path

import pytest


def attempt(name):
    current = Path({root!r}) / "current.txt"
    while not current.exists() or not current.read_text().endswith("::test_" + name.partition(":")[2]):
        time.sleep(0.05)
    path = Path({root!r}) / f"attempts-{{name.partition(':')[0]}}.txt"
    with path.open("a") as f:
        f.write(f"{{os.getpid()}}\\n")
    return len(path.read_text().splitlines())


@pytest.mark.distributed(world_size=1)
@pytest.mark.flaky(reruns=1)
def test_flaky_marker():
    assert attempt("flaky:flaky_marker") > 1, "the first attempt fails"


@pytest.mark.distributed(world_size=1)
def test_reruns_option():
    assert attempt("option:reruns_option") > 1, "the first attempt fails"


@pytest.mark.distributed(world_size=1)
@pytest.mark.flaky(reruns=1, only_rerun="ConnectionError")
def test_not_matching():
    attempt("not_matching:not_matching")
    assert False, "an assertion: not rerun"


@pytest.mark.distributed(world_size=1)
@pytest.mark.flaky(reruns=1, only_rerun="ConnectionError")
def test_matching():
    if attempt("matching:matching") == 1:
        raise ConnectionError("the first attempt lost its peer")


@pytest.mark.distributed(world_size=1, reruns=1, only_rerun="rank-death")
def test_death_rerun():
    if attempt("death:death_rerun") == 1:
        os._exit(3)


@pytest.mark.distributed(world_size=1, reruns=1, only_rerun="rank-death")
def test_assertion_not_rerun():
    attempt("assertion:assertion_not_rerun")
    assert False, "a failure, not a rank death"
"""


def _pids(root, name) -> list[str]:
    return (root / f"attempts-{name}.txt").read_text().split()


def test_rerunfailures_reruns_distributed_tests_in_fresh_rank_sets(pytester, leftover_processes):
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_reruns=TESTS.format(root=str(pytester.path)))
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--mfsdp-platform=cpu", "--reruns=1", "-rRP", "-v", timeout=400
    )
    out = result.stdout.str()
    assert result.parseoutcomes() == {"passed": 4, "failed": 2, "rerun": 4}, out
    result.stdout.fnmatch_lines(
        [
            "*test_flaky_marker RERUN*",
            "*test_flaky_marker PASSED*",
            "*test_reruns_option RERUN*",
            "*test_reruns_option PASSED*",
            "*test_not_matching FAILED*",
            "*test_matching RERUN*",
            "*test_matching PASSED*",
            "*test_death_rerun RERUN*",
            "*test_death_rerun PASSED*",
            "*test_assertion_not_rerun FAILED*",
        ]
    )
    # each attempt in a fresh rank set: new processes
    for name, attempts in (
        ("flaky", 2),
        ("option", 2),
        ("not_matching", 1),
        ("matching", 2),
        ("death", 2),
        ("assertion", 1),
    ):
        pids = _pids(pytester.path, name)
        assert len(pids) == attempts, (name, pids)
        assert len(set(pids)) == attempts, (name, pids)
    # why a failure with attempts left was not rerun, in its report
    result.stdout.fnmatch_lines(
        [
            "*megatron-fsdp: not rerun*",
            "@pytest.mark.flaky(only_rerun=...): no pattern matches the failure",
        ]
    )
    assert "only rank-death is rerun (--mfsdp-only-rerun, the marker's only_rerun=); this is a failure" in out
    # pytest-rerunfailures' own summary lists the attempts, as for any test
    result.stdout.fnmatch_lines(["*rerun test summary info*", "RERUN test_reruns.py::test_flaky_marker"])
    assert "rank 0 died (exit code 3)" in out  # the death that was rerun stays visible (-rP)
    assert leftover_processes(pytester.path) == []


def test_rerunfailures_under_torchrun_is_refused_in_one_line(pytester, torchrun_pytest):
    pytester.makepyfile(test_x="import pytest\n@pytest.mark.distributed(world_size=1)\ndef test_x(): pass\n")
    command = torchrun_pytest("-p", "no:cacheprovider", "--reruns=1", "test_x.py", nproc=1)
    proc = subprocess.run(command, cwd=pytester.path, capture_output=True, text=True, timeout=180)
    assert proc.returncode != 0
    assert (
        "ERROR: pytest-rerunfailures' --reruns=1: not under torchrun: each attempt needs a fresh rank "
        "set, which only plain mode (pytest, not torchrun) launches"
    ) in proc.stderr, proc.stdout + proc.stderr
