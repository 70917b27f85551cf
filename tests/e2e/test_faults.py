"""No fault hangs the run: each one ends as a clear failure of its own test, within its timeout.

One plain-pytest session (the plugin launches the rank sets) holds every fault, in order, and a
healthy test after them; then the process table and the temp dir are checked for leftovers.
"""

import json
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from hang_scenarios import RANK1_SKIPS_THE_BROADCAST

HANG_TIMEOUT_S = 6

FAULTS = f"""
import os, signal, time
import pytest
import torch
import torch.distributed as dist

two_ranks = pytest.mark.distributed(world_size=2)


@two_ranks
def test_rank1_raises(dist_env):
    if dist_env.rank == 1:
        raise RuntimeError("boom on rank 1")


@two_ranks
def test_rank1_raises_while_rank0_waits_in_a_collective(dist_env):
    if dist_env.rank == 1:
        raise RuntimeError("rank 1 gives up before the all_reduce")
    dist.all_reduce(torch.ones(1))  # released at once, not after the process-group timeout


@two_ranks
def test_collectives_work_again_after_that(dist_env):
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 2


@two_ranks
def test_rank1_exits(dist_env):
    if dist_env.rank == 1:
        os._exit(3)
    dist.barrier()  # rank 0 waits in a collective for a rank that is gone


@two_ranks
def test_rank1_is_sigkilled(dist_env):
    if dist_env.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


@two_ranks
def test_rank1_aborts(dist_env):
    if dist_env.rank == 1:
        os.abort()  # as a C++ std::terminate or a failed assert in native code would
    dist.barrier()


@pytest.mark.distributed(world_size=2, timeout={HANG_TIMEOUT_S})
def test_rank1_hangs(dist_env):
    if dist_env.rank == 1:
        time.sleep(3600)
    dist.barrier()  # rank 0 waits in a collective for a rank that never comes


@two_ranks
def test_rank0_fails_rank1_passes(dist_env):
    assert dist_env.rank != 0, "rank 0 disagrees"


@two_ranks
def test_skips_on_rank1_only(dist_env):
    if dist_env.rank == 1:
        pytest.skip("only rank 1 skips")


@two_ranks
def test_the_process_group_cannot_be_rebuilt_after_a_failure(dist_env):
    if dist_env.rank == 0:
        os.environ["BREAK_THE_NEXT_REBUILD"] = "1"  # see the conftest: a backend error in the rebuild
    raise RuntimeError("fails, so the process group is rebuilt after the test")


@two_ranks
@pytest.mark.xfail(strict=True, reason="known upstream bug")
def test_expected_failure_stays_an_xfail(dist_env):
    assert dist_env.rank == 99


@two_ranks
def test_healthy_after_all_that(dist_env):
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == dist_env.world_size
"""

# Records when each test started and ended in the parent session, to check the time bounds; in the
# ranks, makes the rebuild of the process group fail once where a test asks for it, as a backend
# error in torch's init_process_group would (that is the call the harness makes).
CONFTEST = """
import json, os, time

if "RANK" in os.environ:
    from pytest_megatron_fsdp.rank import session

    _init_process_group = session.RankSession._init_process_group

    def _failing_once(self):
        _init_process_group(self)
        if os.environ.pop("BREAK_THE_NEXT_REBUILD", None):
            raise RuntimeError("Connection closed by peer [127.0.0.1]:29500 (a stand-in for gloo's error)")

    session.RankSession._init_process_group = _failing_once

_times = {}
_parent = "RANK" not in os.environ  # the ranks load this conftest too; only the parent records
def pytest_runtest_logstart(nodeid):
    _times[nodeid] = [time.monotonic(), None]
def pytest_runtest_logfinish(nodeid):
    _times[nodeid][1] = time.monotonic()
def pytest_sessionfinish(session):
    if not _parent:
        return
    with open("times.json", "w") as f:
        json.dump({k.split("::")[-1]: v[1] - v[0] for k, v in _times.items()}, f)
"""


def test_every_fault_ends_as_its_own_failure_and_nothing_is_left(
    pytester, monkeypatch, isolated_tmp, leftover_processes, leftover_files
):
    monkeypatch.setenv("CI", "true")  # pytest's short summary then prints each message untrimmed
    pytester.makepyfile(test_faults=FAULTS)
    pytester.makeconftest(CONFTEST)
    started = time.monotonic()
    result = pytester.runpytest_subprocess("-rA", "--mfsdp-platform=cpu", "--junitxml=junit.xml", timeout=300)
    wall = time.monotonic() - started
    out = result.stdout.str()
    result.assert_outcomes(passed=2, failed=8, skipped=1, xfailed=1)

    result.stdout.fnmatch_lines(["*test_rank1_raises*", "*failed on rank 1 (passed on 0)*"])
    assert "RuntimeError: boom on rank 1" in out
    assert "failed on ranks 0, 1" in out
    assert "rank 1 gives up before the all_reduce" in out
    assert "rank 1 died (exit code 3)" in out
    assert "rank 1 died (signal SIGKILL)" in out
    # A fatal signal's report quotes the Python stack faulthandler wrote into that rank's log.
    aborted = out[out.index("test_rank1_aborts _") : out.index("test_rank1_hangs _")]
    assert "rank 1 died (signal SIGABRT)" in aborted
    rank1 = aborted[aborted.index("---------- rank 1") :]
    assert "Fatal Python error: Aborted" in rank1
    assert "in test_rank1_aborts" in rank1
    assert f"timed out: the test exceeded its {HANG_TIMEOUT_S} s timeout" in out
    # The hang's report carries every rank's stack: rank 1 sleeping in the test, rank 0 in barrier.
    hang = out[out.index("test_rank1_hangs _") :]
    assert "in test_rank1_hangs" in hang
    assert "---------- rank 1" in hang
    assert "---------- rank 0" in hang
    assert "failed on rank 0 (passed on 1)" in out
    assert "rank 0 disagrees" in out
    result.stdout.fnmatch_lines(["*SKIPPED*only rank 1 skips (skipped on rank 1 only; rank 0 did not skip)*"])
    result.stdout.fnmatch_lines(["PASSED*test_healthy_after_all_that*"])
    # A process group that cannot be rebuilt fails the test that preceded the rebuild, naming the
    # error; its rank set stops (no INTERNALERROR) and the later tests run in a fresh one.
    rebuild = "test_the_process_group_cannot_be_rebuilt_after_a_failure"
    assert "INTERNALERROR" not in out
    assert "fails, so the process group is rebuilt after the test" in out

    # Each test ends within its timeout + 10 s (the default timeout is 300 s, so the bound that
    # matters is the hang's), plus a rank set's start-up where it is the first test of a fresh one:
    # the hang follows rank 1's abort. The session's first test shows what a start-up takes under the
    # machine's present load (on 2 busy cores, 14 s instead of 3 s).
    times = json.loads((pytester.path / "times.json").read_text())
    assert times["test_rank1_hangs"] <= HANG_TIMEOUT_S + times["test_rank1_raises"] + 10, times
    # released by rank 1's failure, not by the 120 s process-group timeout
    assert times["test_rank1_raises_while_rank0_waits_in_a_collective"] < 15, times
    assert all(t < 60 for t in times.values()), times
    assert wall < 240, wall

    # The short summary and JUnit's message say each failure in its report's headline, one line.
    summary = out[out.index(" short test summary info ") :].splitlines()
    headlines = {
        "test_rank1_raises": "failed on rank 1 (passed on 0)",
        "test_rank1_exits": "rank 1 died (exit code 3)",
        "test_rank1_is_sigkilled": "rank 1 died (signal SIGKILL)",
        # hung (or, at 6 s and looks a second apart, possibly too slow: the verdict is
        # test_hang_or_slow's subject), for as long as the ranks' last look found
        "test_rank1_hangs": re.compile(
            rf"timed out: the test exceeded its {HANG_TIMEOUT_S} s timeout "
            r"\((hung: no progress on any rank for|too slow: still progressing, last progress) "
            r"\d+ s( ago)?\); "
            "every rank's stacks were dumped and the rank set was killed"
        ),
        rebuild: "megatron-fsdp: the process group could not be rebuilt after the test (generation 3): "
        "RuntimeError: Connection closed by peer [127.0.0.1]:29500 (a stand-in for gloo's error); this rank "
        "set stops; the later tests run in a fresh one",
    }
    cases = ET.parse(pytester.path / "junit.xml").getroot().iter("testcase")
    messages = {c.get("name"): f.get("message") for c in cases for f in c.iter("failure")}
    for name, headline in headlines.items():
        if isinstance(headline, re.Pattern):
            prefix = f"FAILED test_faults.py::{name} - "
            assert any(headline.fullmatch(line.removeprefix(prefix)) for line in summary), summary
            assert headline.fullmatch(messages[name] or ""), messages[name]
        else:
            assert f"FAILED test_faults.py::{name} - {headline}" in summary, summary
            assert messages[name] == headline, messages[name]

    # JUnit XML sees the same node ids and outcomes.
    junit = (pytester.path / "junit.xml").read_text()
    result.stdout.fnmatch_lines(["XFAIL*test_expected_failure_stays_an_xfail*known upstream bug*"])
    assert junit.count("<testcase") == 12
    assert 'name="test_rank1_exits"' in junit

    # Nothing left running, nothing left in the temp dir.
    assert leftover_processes(pytester.path) == []
    assert leftover_files(isolated_tmp) == []


def test_ranks_must_collect_the_same_tests(pytester, isolated_tmp, leftover_processes, torchrun_pytest):
    pytester.makepyfile(
        test_two="""
import pytest
@pytest.mark.distributed(world_size=2)
def test_a(dist_env): pass
@pytest.mark.distributed(world_size=2)
def test_b(dist_env): pass
"""
    )
    # rank 1 runs its tests in another order: a usage error on every rank, before any test runs
    pytester.makeconftest(
        "import os\n"
        "def pytest_collection_modifyitems(items):\n"
        "    if os.environ.get('RANK') == '1':\n"
        "        items.reverse()\n"
    )
    started = time.monotonic()
    result = pytester.run(
        *torchrun_pytest(),
        "-p",
        "no:cacheprovider",
        "--mfsdp-platform=cpu",
        timeout=120,
    )
    assert time.monotonic() - started < 60
    assert result.ret != 0
    text = result.stdout.str() + result.stderr.str()
    assert (
        text.count(
            "ranks collected different tests: at position 0 rank 0 has 'test_two.py::test_a' "
            "but rank 1 has 'test_two.py::test_b'"
        )
        == 2
    ), text  # said by both ranks
    assert "PASSED" not in text
    assert " passed" not in text
    assert leftover_processes(pytester.path) == []


def test_torchrun_mode_agrees_on_outcomes_and_only_rank0_prints(pytester, isolated_tmp, torchrun_pytest):
    pytester.makepyfile(
        test_agree="""
import pytest
@pytest.mark.distributed(world_size=2)
def test_fails_on_rank1(dist_env):
    print("captured on rank", dist_env.rank)
    assert dist_env.rank == 0, "rank 1 says no"
@pytest.mark.distributed(world_size=2)
def test_fine(dist_env):
    pass
"""
    )
    result = pytester.run(
        *torchrun_pytest(),
        "--mfsdp-platform=cpu",
        "-rA",
        timeout=120,
    )
    text = result.stdout.str()
    # one report: rank 0's, which carries rank 1's traceback and captured output
    assert text.count("test session starts") == 1, text
    assert text.count("1 failed, 1 passed") == 1, text
    assert "failed on rank 1 (passed on 0)" in text
    assert "rank 1 says no" in text
    assert "Captured stdout call (rank 1)" in text
    assert "captured on rank 1" in text
    log = pytester.path / ".pytest_cache/d/mfsdp-logs/torchrun/rank1.log"
    assert "rank 1 says no" in log.read_text()  # logged by rank 1 the moment it failed
    assert str(log) in text  # and the report points at it


def test_a_hang_report_names_who_is_missing_from_which_collective(pytester, isolated_tmp, leftover_processes):
    """The c10d flight recorder, aligned across ranks: the timeout report says which rank never
    entered the collective another waits in, and which collectives differ across ranks."""
    pytester.makepyfile(
        test_stuck=RANK1_SKIPS_THE_BROADCAST
        + """
@pytest.mark.distributed(world_size=2, timeout=6)
def test_ranks_disagree_on_the_collective(dist_env):
    if dist_env.rank == 0:
        dist.broadcast(torch.ones(3), src=0)
    else:
        dist.all_reduce(torch.ones(5))
"""
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--mfsdp-platform=cpu", timeout=180)
    result.assert_outcomes(failed=2)
    out = result.stdout.str()
    skipped = out[
        out.index("test_rank1_skips_the_broadcast _") : out.index("test_ranks_disagree_on_the_collective _")
    ]
    assert "collectives (c10d flight recorder" in skipped
    assert "rank 0: last completed #1 (all_reduce, default_pg, sizes [[2]]); in #2 (broadcast" in skipped
    assert (
        "rank 1 never entered collective #2 (broadcast, default_pg) that rank 0 has waited in for" in skipped
    )
    disagree = out[out.index("test_ranks_disagree_on_the_collective _") :]
    for failure in (skipped, disagree):
        # the first rank to expire waits for the other's flight record and stacks
        assert "timeout on rank 0" in failure, failure
        assert "timeout on rank 1" in failure, failure
    assert (
        "collective #1 in default_pg differs across ranks: rank 0 broadcast [[3]], rank 1 all_reduce [[5]]"
        in disagree
    )
    assert leftover_processes(pytester.path) == []


def test_sigterm_mid_test_kills_the_ranks_and_writes_junit(pytester, isolated_tmp, leftover_processes):
    """A CI cancel: SIGTERM to the plain pytest session while a distributed test runs. The ranks
    and torchrun are killed, the running test fails as interrupted, the finished one keeps its
    result, the next one is named not run (as under torchrun), and the JUnit XML is written; pytest
    exits non-zero."""
    import signal

    pytester.makepyfile(
        test_cancel="""
import time
import pytest

@pytest.mark.distributed(world_size=2)
def test_done(dist_env):
    pass  # finishes before the cancel: keeps its result

@pytest.mark.distributed(world_size=2)
def test_long(dist_env):
    print("long test running", flush=True)
    time.sleep(600)

def test_after():
    pass  # never starts: reported "not run"
"""
    )
    logs = pytester.path / "logs"
    proc = _session_to_cancel(pytester.path, logs)
    _wait_for_start(proc, logs / "batch1-world2" / "rank0.log", "test_cancel.py::test_long")
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=60)[0]
    assert time.monotonic() - started < 30, out
    assert proc.returncode != 0, out
    assert leftover_processes(pytester.path) == [], out
    cases = _junit_cases(pytester.path / "junit.xml")
    assert set(cases) == {"test_done", "test_long", "test_after"}, out
    assert len(cases["test_done"]) == 0  # passed: no failure/skip child
    failure = cases["test_long"].find("failure")
    assert failure is not None, out
    assert "interrupted" in (failure.get("message", "") + (failure.text or "")), out
    not_run = cases["test_after"].find("error")
    assert not_run is not None, out
    assert "not run: the session was interrupted (signal SIGTERM) during test_cancel.py::test_long" in (
        not_run.get("message", "") + (not_run.text or "")
    ), out
    assert "megatron-fsdp: 1 test not run" in out, out


def test_sigterm_to_an_xdist_session_writes_junit_and_leaves_nothing(
    pytester, isolated_tmp, leftover_processes
):
    """The same cancel under ``-n 2``: the controller takes SIGTERM as Ctrl-C, pytest-xdist ends its
    workers (each killing its rank sets) and writes the finished test's result."""
    import signal

    pytester.makepyfile(
        test_cancel="""
import time
import pytest

def test_done():
    pass

@pytest.mark.distributed(world_size=2)
def test_long(dist_env):
    time.sleep(600)
"""
    )
    logs = pytester.path / "logs"
    proc = _session_to_cancel(pytester.path, logs, "-n", "2")
    # each worker has a log directory of its own: the rank set under whichever took the test
    _wait_for_start(proc, logs, "test_cancel.py::test_long")
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode != 0, out
    assert "KeyboardInterrupt" in out, out
    assert leftover_processes(pytester.path) == [], out
    cases = _junit_cases(pytester.path / "junit.xml")
    assert "test_done" in cases, out
    assert len(cases["test_done"]) == 0, out


def _junit_cases(path: Path) -> dict[str | None, ET.Element]:
    """A JUnit file's test cases by name."""
    return {case.get("name"): case for case in ET.parse(path).getroot().iter("testcase")}


def _session_to_cancel(path: Path, logs: Path, *args: str) -> subprocess.Popen[str]:
    """A plain pytest session in ``path`` (rank logs under ``logs``, a JUnit file), for a signal to end."""
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pytest",
            *args,
            "-p",
            "no:cacheprovider",
            "--mfsdp-platform=cpu",
            f"--mfsdp-log-dir={logs}",
            "--junitxml=junit.xml",
        ],
        cwd=path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _wait_for_start(proc: subprocess.Popen[str], rank_log: Path, nodeid: str) -> None:
    """Until ``nodeid`` has run for a second on rank 0 (its START line in the rank's log; ``rank_log``
    a directory: in any rank 0's log under it)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        logs = list(rank_log.rglob("rank0.log")) if rank_log.is_dir() else [rank_log]
        if any(log.exists() and f"START {nodeid}" in log.read_text() for log in logs):
            break
        time.sleep(0.2)
    else:
        proc.kill()
        raise AssertionError(f"{nodeid} never started: {proc.communicate()[0]}")
    time.sleep(1.0)


#: the test a CI cancel interrupts, by where rank 0's main thread is when SIGTERM comes
CANCELLED_TEST = {
    # in Python between collectives: each rank takes the signal there
    "in_python": """
    for _ in range(600):
        t = torch.ones(1)
        dist.all_reduce(t)
        time.sleep(0.5)
""",
    # rank 0 in a collective that rank 1 never enters, on a group something still holds (as a
    # model holds Megatron's data-parallel groups), so rank 1's release of the process group does
    # not end the wait: rank 0's main thread never takes the signal
    "stuck_in_a_collective": """
    global HELD
    HELD = dist.new_group([0, 1])
    if dist_env.rank == 0:
        dist.all_reduce(torch.ones(1), group=HELD)
    else:
        time.sleep(600)
""",
}


@pytest.mark.parametrize("where", sorted(CANCELLED_TEST))
def test_sigterm_to_torchrun_mid_test_reports_every_test_and_leaves_nothing(
    pytester, isolated_tmp, leftover_processes, torchrun_pytest, where, leftover_files
):
    """A CI cancel of your own torchrun: SIGTERM to torchrun's agent while a test runs collectives.
    The agent passes it on to the ranks; rank 0's JUnit file names every test (the finished one
    passed, the running one failed as interrupted, the next one reported not run: a JUnit error,
    never a skip), the ranks' temp trees go, and nothing is left running; also when rank 0's main
    thread is stuck in a collective and never takes the signal (its watcher thread reports the
    session)."""
    import signal

    pytester.makepyfile(
        test_cancel=f"""
import time
import pytest
import torch
import torch.distributed as dist

HELD = None

@pytest.mark.distributed(world_size=2)
def test_done(dist_env):
    pass  # finishes before the cancel: reported passed

@pytest.mark.distributed(world_size=2)
def test_long(dist_env):
{CANCELLED_TEST[where]}

@pytest.mark.distributed(world_size=2)
def test_after(dist_env):
    pass  # never starts: reported "not run"
"""
    )
    logs = pytester.path / "logs"
    proc = subprocess.Popen(
        torchrun_pytest(
            "-p", "no:cacheprovider", "-p", "no:randomly", f"--mfsdp-log-dir={logs}", "--junitxml=junit.xml"
        ),
        cwd=pytester.path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    _wait_for_start(proc, logs / "torchrun" / "rank0.log", "test_cancel.py::test_long")
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=90)[0]
    # well within torchrun's 30 s between its SIGTERM and its SIGKILL to the ranks
    assert time.monotonic() - started < 20, out
    assert proc.returncode != 0, out
    assert leftover_processes(pytester.path) == [], out
    cases = _junit_cases(pytester.path / "junit.xml")
    assert set(cases) == {"test_done", "test_long", "test_after"}, out
    assert len(cases["test_done"]) == 0, out  # passed: no failure/skip child
    failure = cases["test_long"].find("failure")
    assert failure is not None, out
    assert "interrupted (signal SIGTERM) on rank 0 during test_cancel.py::test_long" in failure.get(
        "message", ""
    ), out
    not_run = cases["test_after"].find("error")  # never a skip
    assert not_run is not None, out
    assert "not run: the session was interrupted (signal SIGTERM) during test_cancel.py::test_long" in (
        not_run.get("message", "")
    ), out
    assert "megatron-fsdp: 1 test not run" in out, out
    if where == "stuck_in_a_collective":
        stuck = "rank 0 did not take the signal within 6 s during test_cancel.py::test_long"
        assert stuck in (failure.text or ""), out
    # the ranks' private temp trees and the session's shared dir are gone (torchrun's own
    # torchelastic_* dir stays: it never removes it)
    left = leftover_files(isolated_tmp, ignore=("torchelastic_",))
    inside = [str(p.relative_to(isolated_tmp)) for name in left for p in (isolated_tmp / name).rglob("*")]
    assert left == [], f"left in $TMPDIR: {left}, holding {inside}\n{out}"
