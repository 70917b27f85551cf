"""pytest-timeout installed and set (ini ``timeout``, both methods): for a distributed test it is one
more source of the timeout, which the controller owns. Its timer runs neither around the
controller's wait (its SIGALRM would end the session, its timer thread's ``os._exit`` would leave
the rank set running) nor inside the launched ranks, which read the same ini file. Non-distributed
tests keep pytest-timeout as it is. A failure the controller makes (a timeout, a rank death) carries
its real duration into JUnit XML and ``--durations``.

One session per method, tiny rank sets (world_size=1).
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

import pytest

pytest.importorskip("pytest_timeout", reason="the dev extra's pytest-timeout")

TESTS = """
import os
import time

import pytest


@pytest.mark.distributed(world_size=1, timeout=60)
def test_slower_than_the_ini_timeout():
    time.sleep(6)  # the ini says 3 s, its own marker 60 s: no pytest-timeout timer may end it


@pytest.mark.distributed(world_size=1)
def test_hangs():
    time.sleep(600)  # its timeout: pytest-timeout's ini 3 s, enforced by the plugin


@pytest.mark.distributed(world_size=1)
def test_after_the_hang():
    pass


@pytest.mark.distributed(world_size=1, timeout=60)
def test_rank_dies():
    time.sleep(2)
    os._exit(3)


@pytest.mark.timeout(1)
def test_local_still_timed_by_pytest_timeout():
    time.sleep(30)
"""


def _junit_times(path) -> dict[str, float]:
    return {case.get("name"): float(case.get("time")) for case in ET.parse(path).getroot().iter("testcase")}


@pytest.mark.parametrize("method", ["signal", "thread"])
def test_pytest_timeout_sets_the_timeout_and_the_controller_enforces_it(pytester, method, leftover_processes):
    pytester.makeini(f"[pytest]\ntimeout = 3\ntimeout_method = {method}\n")
    pytester.makepyfile(test_timeouts=TESTS)
    # the thread method ends the whole process on a local test's timeout (pytest-timeout's own way)
    local = [] if method == "signal" else ["-k", "not local"]
    result = pytester.runpytest_subprocess(
        "-p",
        "no:cacheprovider",
        "--mfsdp-platform=cpu",
        "--junitxml=junit.xml",
        "--durations=0",
        "-v",
        *local,
        timeout=300,
    )
    out = result.stdout.str()
    outcomes = result.parseoutcomes()
    assert outcomes.get("passed") == 2, out
    assert outcomes.get("failed") == (3 if method == "signal" else 2), out
    result.stdout.fnmatch_lines(
        [
            "*test_slower_than_the_ini_timeout PASSED*",
            "*test_hangs FAILED*",
            "*test_after_the_hang PASSED*",  # the session went on, in a fresh rank set
            "*test_rank_dies FAILED*",
        ]
    )
    # the plugin's timeout, at pytest-timeout's figure, with the ranks' stacks
    result.stdout.fnmatch_lines(
        [
            # hung or too slow: at 3 s, looks a second apart tell them apart only roughly
            "*timed out: the test exceeded its 3 s timeout (*); every rank's stacks*",
            "timeout 3 s (from pytest-timeout ini timeout)",  # where the figure came from
        ]
    )
    assert "MFSDP-TIMEOUT: test_timeouts.py::test_hangs exceeded its 3 s timeout on rank 0" in out
    # no pytest-timeout timer around a distributed test, here or in its ranks
    assert "Timeout (>3.0s) from pytest-timeout" not in out
    if method == "signal":
        result.stdout.fnmatch_lines(["*test_local_still_timed_by_pytest_timeout FAILED*"])
        assert "Timeout (>1.0s) from pytest-timeout" in out
    # the controller's failures carry the time they took: JUnit's time=, --durations
    times = _junit_times(pytester.path / "junit.xml")
    assert times["test_hangs"] >= 3.0, times
    assert times["test_rank_dies"] >= 2.0, times
    durations = {
        name: float(seconds)
        for seconds, name in re.findall(r"^(\d+\.\d+)s call +test_timeouts\.py::(\w+)$", out, re.MULTILINE)
    }
    assert durations["test_hangs"] >= 3.0, durations
    assert durations["test_rank_dies"] >= 2.0, durations
    assert leftover_processes(pytester.path) == []
