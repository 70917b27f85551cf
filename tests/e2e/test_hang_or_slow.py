"""A hang is told from slowness, beside two CPU hogs on the machine: a collective one rank never
joins is reported hung once no rank has made progress for ``--mfsdp-hang-after`` seconds, long
before the timeout; a test that keeps computing (one C call after another, no collective, its
Python stack still) runs to its timeout and is reported too slow, still progressing, and so is a
loop of collectives, which the interruption leaves cleanly. Under torchrun
(the session goes on after each) and in plain mode (a fresh rank set after each)."""

from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Iterator

import pytest

HANG_AFTER_S = 8
#: the timeout of the test that keeps computing: past the no-progress bound, so that a rank whose
#: computing did not count as progress would be reported hung at the bound instead
SLOW_TIMEOUT_S = 20
#: the timeout of the test that keeps all-reducing (interrupted between two collectives of a loop)
TRAINS_TIMEOUT_S = 12
#: every other test's: far past the bound, so only the bound can end the hung test in time
TIMEOUT_S = 120
#: each rank starts a test (and its clocks) on its own, a moment after or before its peer: a rank
#: freed by its peer's interruption reports at most this much less than the bound it ended at
START_SKEW_S = 2

TESTS = f"""
import hashlib
import time
import pytest
import torch
import torch.distributed as dist

@pytest.mark.distributed(world_size=2)
def test_1_passes(dist_env):
    dist.all_reduce(torch.ones(2))

@pytest.mark.distributed(world_size=2)
def test_2_rank1_never_joins_the_all_reduce(dist_env):
    if dist_env.rank == 1:
        time.sleep(600)
    dist.all_reduce(torch.ones(2))

@pytest.mark.distributed(world_size=2, timeout={SLOW_TIMEOUT_S})
def test_3_computes_past_its_timeout(dist_env):
    # one C call after another with the GIL released: the stack stands still, no collective
    end = time.monotonic() + 600
    while time.monotonic() < end:
        hashlib.pbkdf2_hmac("sha256", b"x", b"salt", 200_000)

@pytest.mark.distributed(world_size=2, timeout={TRAINS_TIMEOUT_S})
def test_3b_all_reduces_past_its_timeout(dist_env):
    # a training loop's shape: compute, then a collective, again and again
    a = torch.randn(256, 256)
    end = time.monotonic() + 600
    while time.monotonic() < end:
        a = torch.tanh(a @ a)
        dist.all_reduce(a)

@pytest.mark.distributed(world_size=2)
def test_4_passes(dist_env):
    t = torch.ones(2)
    dist.all_reduce(t)
    assert t.tolist() == [2.0, 2.0]
"""


@pytest.fixture(scope="module")
def two_cpu_hogs() -> Iterator[None]:
    """Two busy loops, one per core of the 2-core machine, for as long as the module runs."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


@pytest.fixture(scope="module", params=["torchrun", "plain"])
def beside_hogs(request, run_scenario, two_cpu_hogs):
    scenario = run_scenario(
        f"hang-or-slow-{request.param}",
        {"test_hang_or_slow.py": TESTS},
        f"--mfsdp-hang-after={HANG_AFTER_S}",
        f"--mfsdp-timeout={TIMEOUT_S}",
        "--mfsdp-platform=cpu",
        "--mfsdp-log-dir=logs",
        "--junitxml=junit.xml",
        torchrun=request.param == "torchrun",
        timeout=400,
    )
    return scenario


def _failure(case: ET.Element) -> str:
    failures = case.findall("failure")
    assert len(failures) == 1, ET.tostring(case).decode()
    return failures[0].get("message", "") + (failures[0].text or "")


def test_the_hung_collective_is_reported_hung_at_the_bound(beside_hogs):
    case = beside_hogs.junit_case("test_2_rank1_never_joins_the_all_reduce")
    text = _failure(case)
    assert f"no progress on any rank for {HANG_AFTER_S} s, the --mfsdp-hang-after bound" in text, text
    # torchrun: each rank's banner; plain mode: the parent's headline
    hung_name = "test_hang_or_slow.py::test_2_rank1_never_joins_the_all_reduce hung on rank"
    assert hung_name in text or "timed out: the test hung (" in text, text
    assert "rank 1 never entered collective" in text, text
    # the bound, a look's lag and the report; not the test's 120 s timeout
    assert HANG_AFTER_S - START_SKEW_S <= float(case.get("time", "0")) < HANG_AFTER_S + 15, ET.tostring(
        case
    ).decode()


def test_the_test_that_keeps_computing_is_too_slow_not_hung(beside_hogs):
    case = beside_hogs.junit_case("test_3_computes_past_its_timeout")
    text = _failure(case)
    assert f"exceeded its {SLOW_TIMEOUT_S} s timeout" in text, text
    assert "too slow: still progressing" in text, text
    assert "hung" not in text.split("stacks")[0], text
    assert SLOW_TIMEOUT_S - START_SKEW_S <= float(case.get("time", "0")) < SLOW_TIMEOUT_S + 15, ET.tostring(
        case
    ).decode()


def test_a_loop_of_collectives_is_too_slow_and_interrupted_cleanly(beside_hogs):
    """Interrupted between two collectives, one rank may leave its peer waiting in the next one: the
    group is aborted (a failed test's traceback still holds it, so destroying it would not close
    its connections), the peer fails at once, and the session goes on."""
    case = beside_hogs.junit_case("test_3b_all_reduces_past_its_timeout")
    text = _failure(case)
    assert f"exceeded its {TRAINS_TIMEOUT_S} s timeout" in text, text
    assert "too slow: still progressing" in text, text
    assert "did not come back from the timeout" not in beside_hogs.out, beside_hogs.out
    assert TRAINS_TIMEOUT_S - START_SKEW_S <= float(case.get("time", "0")) < TRAINS_TIMEOUT_S + 15, (
        ET.tostring(case).decode()
    )


def test_the_other_tests_pass_and_nothing_is_left(beside_hogs):
    for name in ("test_1_passes", "test_4_passes"):
        assert list(beside_hogs.junit_case(name)) == [], ET.tostring(beside_hogs.junit_case(name)).decode()
    assert "3 failed, 2 passed" in beside_hogs.out, beside_hogs.out
    assert beside_hogs.leftovers == []
    assert [name for name in beside_hogs.tmp_left if not name.startswith("torchelastic_")] == []
