"""A torchrun session's test whose timeout lands in pytest's own code (a slow hook of another
plugin), not in the test: the interruption leaves pytest's run of the test, the plugin tears the
fixtures down and fails the test; a fixture whose teardown fails too is logged, not an
INTERNALERROR, and the next test runs."""

from __future__ import annotations

CONFTEST = """
import time
import pytest

@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if call.when == "call" and item.name == "test_1_its_report_is_slow":
        time.sleep(120)  # the test's timeout lands here, between pytest's phases
    return report
"""

TESTS = """
import pytest
import torch
import torch.distributed as dist

@pytest.fixture
def fails_its_teardown():
    yield
    pytest.fail("this fixture's teardown fails")

@pytest.mark.distributed(world_size=2)
def test_1_its_report_is_slow(dist_env, fails_its_teardown):
    pass  # the test itself passes: its slowness is the conftest's makereport hook

@pytest.mark.distributed(world_size=2)
def test_2_runs_after_it(dist_env):
    t = torch.ones(2)
    dist.all_reduce(t)
    assert t.tolist() == [2.0, 2.0]
"""


def test_a_timeout_between_phases_fails_the_test_and_the_session_goes_on(inner_session):
    session = inner_session(
        {"conftest.py": CONFTEST, "test_between.py": TESTS},
        "--mfsdp-timeout=4",
        "--mfsdp-log-dir=logs",
        "-p",
        "no:randomly",
        torchrun=True,
    )
    assert session.result.ret == 1, session.out
    session.result.assert_outcomes(passed=1, failed=1)
    timed_out = "MFSDP-TIMEOUT: test_between.py::test_1_its_report_is_slow exceeded its 4 s timeout"
    assert timed_out in session.out, session.out
    log = (session.path / "logs" / "torchrun" / "rank0.log").read_text()
    assert "its fixtures' teardown after the interruption: this fixture's teardown fails" in log, log
