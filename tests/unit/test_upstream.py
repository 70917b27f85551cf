"""``make upstream`` (bench/upstream.py): JUnit files read into per-test outcomes and per-file tables,
summary.json, bad input refused in one line before anything starts, a run past its wall limit
interrupted and reported with what it wrote. Fake commands stand in for torchrun (the unit tier starts
no pytest session); small synthetic JUnit files stand in for upstream's."""

from __future__ import annotations

import json
import os
import signal
import sys
import textwrap
import time
from pathlib import Path

import pytest

from bench import upstream

MFSDP = "tests/unit_tests/distributed/mfsdp_v1"
PKG = "tests.unit_tests.distributed.mfsdp_v1"


def case(classname: str, name: str, file: str, seconds: float, inner: str = "") -> str:
    """A testcase as pytest writes it with junit_family=xunit1 (the runs' flag)."""
    return (
        f'<testcase classname="{classname}" name="{name}" file="{MFSDP}/{file}" time="{seconds}">'
        f"{inner}</testcase>"
    )


TE_SKIP = "GPU-only: Transformer Engine"
XFAIL = '<skipped type="pytest.xfail" message="upstream bug"/>'
MODULE_SKIP = f"('{MFSDP}/test_te_module.py', 1, '{TE_SKIP}')"
SETUP_ERROR = '<error message="failed on setup with &quot;E&quot;">tb</error>'
#: a test after a rank that never came back, as a torchrun-mode rank 0 reports it: a setup error
NOT_RUN = (
    '<error message="failed on setup with &quot;not run: the session ended after '
    f'{MFSDP}/test_b.py::test_hangs timed out on rank 1&quot;">not run</error>'
)
#: a JUnit file with every outcome once, a test reported twice and both kinds of a module's own entry
JUNIT = "\n".join(
    [
        '<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="9">',
        case(f"{PKG}.test_a.TestA", "test_ok[1.5-x]", "test_a.py", 1.25),
        case(
            f"{PKG}.test_a.TestA.TestInner", "test_fails", "test_a.py", 2.5,
            '<failure message="AssertionError: boom">tb</failure>'
            '<error message="failed on teardown with &quot;x&quot;">tb</error>',
        ),
        case(
            f"{PKG}.test_a", "test_te", "test_a.py", 0.5,
            f'<skipped type="pytest.skip" message="{TE_SKIP}">{MFSDP}/test_a.py:31: {TE_SKIP}</skipped>',
        ),
        case(
            f"{PKG}.test_a", "test_8_gpus", "test_a.py", 0.01,
            '<skipped type="pytest.skip" message="Requires 8 GPUs">test_a.py:41: 8 GPUs</skipped>',
        ),
        case(f"{PKG}.test_a", "test_known", "test_a.py", 0.75, XFAIL),
        case(f"{PKG}.test_b", "test_setup", "test_b.py", 0.25, SETUP_ERROR),
        case(f"{PKG}.test_b", "test_setup", "test_b.py", 0.25, SETUP_ERROR),
        case(f"{PKG}.test_b", "test_after_the_hang", "test_b.py", 0.0, NOT_RUN),
        case(
            "", f"{PKG}.test_te_module", "test_te_module.py", 0.0,
            f'<skipped message="collection skipped">{MODULE_SKIP}</skipped>',
        ),
        case("", f"{PKG}.test_broken", "test_broken.py", 0, '<error message="collection failure">E</error>'),
        "</testsuite></testsuites>",
    ]
)  # fmt: skip


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.fixture
def parsed(tmp_path: Path) -> upstream.JunitResults:
    return upstream.read_junit(write(tmp_path / "ws2.xml", JUNIT))


def test_every_outcome_of_a_junit_file_by_node_id(parsed: upstream.JunitResults) -> None:
    a, b = f"{MFSDP}/test_a.py", f"{MFSDP}/test_b.py"
    got = {nodeid: (test.file, test.outcome, test.reason) for nodeid, test in parsed.tests.items()}
    assert got == {
        f"{a}::TestA::test_ok[1.5-x]": (a, "passed", None),
        f"{a}::TestA::TestInner::test_fails": (a, "failed", "AssertionError: boom"),  # failure before error
        f"{a}::test_te": (a, "gpu-only", "GPU-only: Transformer Engine"),
        f"{a}::test_8_gpus": (a, "skipped", "Requires 8 GPUs"),
        f"{a}::test_known": (a, "xfailed", "upstream bug"),
        f"{b}::test_setup": (b, "error", 'failed on setup with "E"'),  # reported twice, counted once
        f"{b}::test_after_the_hang": (  # never a skip: a column of its own
            b,
            "not-run",
            f'failed on setup with "not run: the session ended after {b}::test_hangs timed out on rank 1"',
        ),
        f"{MFSDP}/test_te_module.py": (
            f"{MFSDP}/test_te_module.py",
            "gpu-only",
            "GPU-only: Transformer Engine",
        ),
        f"{MFSDP}/test_broken.py": (f"{MFSDP}/test_broken.py", "error", "collection failure"),
    }
    assert parsed.problem is None


def test_the_per_file_counts_and_the_table(parsed: upstream.JunitResults) -> None:
    files = upstream.per_file(parsed.tests)
    assert list(files) == [
        f"{MFSDP}/{name}.py" for name in ("test_a", "test_b", "test_te_module", "test_broken")
    ]
    assert files[f"{MFSDP}/test_a.py"] == {
        "passed": 1, "gpu-only": 1, "skipped": 1, "xfailed": 1, "failed": 1, "error": 0, "not-run": 0,
        "time_s": 5.01,
    }  # fmt: skip
    assert files[f"{MFSDP}/test_b.py"]["not-run"] == 1
    lines = upstream.table(files)
    header = "| file | passed | GPU-only skips | other skips | xfailed | failed | errors | not run | time |"
    assert lines[0] == header
    assert lines[2] == f"| {MFSDP}/test_a.py | 1 | 1 | 1 | 1 | 1 | 0 | 0 | 5.0 s |"
    assert lines[-1] == "| **total** | 1 | 2 | 1 | 1 | 1 | 2 | 1 | 5.3 s |"
    assert len(lines) == 2 + 4 + 1


def test_a_junit_file_without_file_attributes_is_resolved_against_the_checkout(tmp_path: Path) -> None:
    root = tmp_path / "Megatron-LM"
    (root / "tests" / "unit").mkdir(parents=True)
    (root / "tests" / "unit" / "test_x.py").write_text("")
    junit = write(
        tmp_path / "xunit2.xml",
        '<testsuites><testsuite><testcase classname="tests.unit.test_x.TestC" name="test_y[a.b]"/>'
        '<testcase classname="tests.unit.test_x" name="test_z"/>'
        '<testcase classname="" name="tests.unit.test_x"><error message="collection failure"/></testcase>'
        "</testsuite></testsuites>",
    )
    assert list(upstream.read_junit(junit, root).tests) == [
        "tests/unit/test_x.py::TestC::test_y[a.b]",
        "tests/unit/test_x.py::test_z",
        "tests/unit/test_x.py",
    ]
    # without the checkout: the names before the first capitalised one (a class) make the file
    assert next(iter(upstream.read_junit(junit).tests)) == "tests/unit/test_x.py::TestC::test_y[a.b]"
    # which a capitalised directory defeats: only the checkout's files tell
    (root / "tests" / "Models").mkdir()
    (root / "tests" / "Models" / "test_m.py").write_text("")
    case = '<testcase classname="tests.Models.test_m" name="test_z"/>'
    capitalised = write(
        tmp_path / "capitalised.xml", f"<testsuites><testsuite>{case}</testsuite></testsuites>"
    )
    assert list(upstream.read_junit(capitalised, root).tests) == ["tests/Models/test_m.py::test_z"]


def test_no_file_or_a_file_cut_short_is_a_problem_not_a_crash(tmp_path: Path) -> None:
    assert upstream.read_junit(tmp_path / "none.xml").problem == "no JUnit file written"
    cut = upstream.read_junit(write(tmp_path / "cut.xml", JUNIT[: len(JUNIT) // 2]))
    assert cut.problem is not None
    assert cut.problem.startswith("JUnit file unreadable")


def _result(tmp_path: Path, name: str = "ws2", **kwargs: object) -> upstream.RunResult:
    run = upstream.Run(
        name, tmp_path, (MFSDP,), int(name[2:]) if name[2:].isdigit() else 2, markers="not flaky_in_dev"
    )
    fields: dict[str, object] = {"status": 1, "wall_s": 77.0, "limit_s": 3600.0} | kwargs
    return upstream.RunResult(run, tmp_path / f"{name}.xml", tmp_path / f"{name}.log", **fields)  # type: ignore[arg-type]


FACTS = {
    "checkouts": {
        "MEGATRON_LM": {"path": "/m", "git": {"commit": "d98e8a64dd" + "0" * 30, "date": "2026-08-22"}}
    },
    "python": "3.12.1",
    "packages": {"torch": "2.14.1", "megatron-core": "0.20.0"},
    "cpu": {"model": "Intel Xeon", "cores": 2, "flags": ["avx512_bf16", "amx_bf16"]},
}


def test_summary_json_has_each_test_its_outcome_reason_and_cause(tmp_path, parsed) -> None:
    result = _result(tmp_path, deselected=4)
    data = json.loads(json.dumps(upstream.summary([(result, parsed)], FACTS, "not flaky_in_dev")))
    assert data["markers"] == "not flaky_in_dev"
    run = data["runs"]["ws2"]
    assert (run["markers"], run["deselected"], run["command"]) == ("not flaky_in_dev", 4, "torchrun")
    assert "last_loss" not in run
    assert run["world_size"] == 2
    assert run["finished"] is True
    assert run["exit_status"] == 1
    assert run["totals"]["gpu-only"] == 2
    assert run["files"][f"{MFSDP}/test_b.py"]["error"] == 1
    assert run["tests"][f"{MFSDP}/test_a.py::test_te"] == {
        "file": f"{MFSDP}/test_a.py", "outcome": "gpu-only", "time_s": 0.5,
        "reason": "GPU-only: Transformer Engine", "cause": "Transformer Engine",
    }  # fmt: skip
    assert "cause" not in run["tests"][f"{MFSDP}/test_a.py::test_8_gpus"]
    assert data["stack"] == FACTS
    assert data["recorded"][:4].isdigit()


def test_the_report_says_which_run_did_not_finish_and_keeps_its_results(tmp_path, parsed) -> None:
    stopped = _result(
        tmp_path, "ws4", status=None, wall_s=3660.0, stopped="wall limit 3600 s reached: killed"
    )
    empty = upstream.JunitResults(problem="no JUnit file written")
    text = upstream.report(
        [(_result(tmp_path, deselected=4), parsed), (stopped, empty)], FACTS, "not flaky_in_dev"
    )
    lines = text.splitlines()
    assert lines[0] == (
        "stack: MEGATRON_LM=/m (d98e8a64dd of 2026-08-22), Python 3.12.1, torch 2.14.1, "
        "megatron-core 0.20.0, 2-core Intel Xeon (avx512_bf16, amx_bf16)"
    )
    assert lines[1] == (
        "Megatron-LM runs: -m 'not flaky_in_dev' (UPSTREAM_MARKERS; Megatron-LM's dev CI selects "
        "-m 'not flaky_in_dev' in tests/unit_tests/run_ci_test.sh; UPSTREAM_MARKERS= runs every test)"
    )
    assert (
        f"ws2: world size 2, -m 'not flaky_in_dev', {MFSDP}: finished in 77.0 s (wall limit 3600 s), "
        f"exit status 1; 4 deselected (log: {tmp_path}/ws2.log)"
    ) in lines
    assert (
        f"ws4: world size 4, -m 'not flaky_in_dev', {MFSDP}: DID NOT FINISH after 3660.0 s: wall limit "
        f"3600 s reached: killed; no JUnit file written; no deselected count logged (log: {tmp_path}/ws4.log)"
    ) in lines
    every = upstream.report([(_result(tmp_path), parsed)], FACTS, "")
    assert every.splitlines()[1].startswith("Megatron-LM runs: every test (UPSTREAM_MARKERS empty) (")
    runs = lines[lines.index("all runs:") + 2 :]
    assert runs[0].startswith("| run | passed |")
    assert runs[2:] == [
        "| ws2 | 1 | 2 | 1 | 1 | 1 | 2 | 1 | 5.3 s |",
        "| ws4 | 0 | 0 | 0 | 0 | 0 | 0 | 0 | 0.0 s |",
        "| **total** | 1 | 2 | 1 | 1 | 1 | 2 | 1 | 5.3 s |",
    ]
    assert not upstream.clean([(_result(tmp_path, status=0), upstream.JunitResults()), (stopped, empty)])


def test_a_failure_rank_0_did_not_report_is_named_and_not_clean(tmp_path: Path) -> None:
    passed = upstream.JunitResults({"t.py::a": upstream.TestResult("t.py", "passed", None, 1.0)})
    assert upstream.clean([(_result(tmp_path, status=0), passed)])
    assert not upstream.clean([(_result(tmp_path, status=1), passed)])
    assert "rank 0 reported no failure: another rank failed" in upstream.heading(_result(tmp_path), passed)


def test_each_run_is_torchrun_of_pytest_in_the_foreign_suite_mode(tmp_path: Path) -> None:
    command = upstream.Run("ws4", tmp_path, (MFSDP, "t.py::x"), 4).command(
        "/venv/python", tmp_path / "ws4.xml"
    )
    assert command[:5] == [
        "/venv/python",
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=4",
    ]
    assert command[5:7] == ["-m", "pytest"]
    for flag in (
        "--mfsdp-platform=cpu",
        "--mfsdp-foreign-suite=true",
        f"--junitxml={tmp_path}/ws4.xml",
        # the rank logs its failures name, next to the results (not in the run's scratch dir)
        f"--mfsdp-log-dir={tmp_path.resolve()}/ws4-logs",
    ):
        assert flag in command
    assert command[-2:] == [MFSDP, "t.py::x"]
    assert "no:randomly" in command  # upstream's own order
    assert "-m" not in command[7:]  # no markers: every test
    selected = upstream.Run("ws2", tmp_path, (MFSDP,), 2, markers="not flaky_in_dev").command(
        "p", tmp_path / "j"
    )
    assert selected[selected.index("-m", 7) : selected.index("-m", 7) + 2] == ["-m", "not flaky_in_dev"]


@pytest.mark.parametrize(
    ("log", "count"),
    [
        ("collected 120 items / 8 deselected / 112 selected\n...\n= 100 passed, 8 deselected in 9.1s =\n", 8),
        ("[W rank0] x\ncollected 77 items / 1 skipped / 3 deselected / 73 selected\nKeyboardInterrupt\n", 3),
        ("collected 77 items / 1 skipped\n==== 35 passed, 38 skipped in 31.29s ====\n", 0),
        ("test_x.py::test_3_deselected PASSED\n", None),  # a test's name is no count
        ("Traceback (most recent call last):\n", None),
    ],
)
def test_the_deselected_count_is_pytests_own_line(log: str, count: int | None) -> None:
    assert upstream.deselected(log) == count


# -- bad input --------------------------------------------------------------------------------------


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    root = tmp_path / "Megatron-LM"
    for part in (*upstream.MEGATRON_LM_LAYOUT, MFSDP):
        (root / part).mkdir(parents=True, exist_ok=True)
    return root


def _refused(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    def no_run(*args: object, **kwargs: object) -> None:
        raise AssertionError("a run started")

    monkeypatch.setattr(upstream, "execute", no_run)
    assert upstream.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err.rstrip("\n")


def test_bad_input_is_one_line_naming_the_variable_the_value_and_the_fix(
    tmp_path, checkout, monkeypatch, capsys
) -> None:
    results = tmp_path / "results"
    base = ["--megatron-lm", str(checkout), "--results", str(results)]
    assert _refused(monkeypatch, capsys, ["--results", str(results)]) == (
        "make upstream: MEGATRON_LM is not set: give the Megatron-LM checkout whose tests to run, "
        "e.g. make upstream MEGATRON_LM=/path/to/Megatron-LM"
    )
    assert _refused(monkeypatch, capsys, ["--megatron-lm", str(tmp_path / "gone")]).startswith(
        f"make upstream: MEGATRON_LM={tmp_path / 'gone'}: no such directory; "
        "give the Megatron-LM checkout's root"
    )
    assert _refused(monkeypatch, capsys, ["--megatron-lm", str(tmp_path)]) == (
        f"make upstream: MEGATRON_LM={tmp_path} is not a Megatron-LM checkout's root (no megatron/core or "
        "tests/unit_tests in it); give the directory that holds megatron/core and tests/unit_tests, "
        "e.g. make upstream MEGATRON_LM=/path/to/Megatron-LM"
    )
    assert _refused(monkeypatch, capsys, [*base, "--tests", f"{MFSDP} tests/nope.py::x"]) == (
        f"make upstream: UPSTREAM_TESTS: tests/nope.py::x is not in MEGATRON_LM={checkout}; give paths "
        f"relative to the checkout's root, e.g. UPSTREAM_TESTS={upstream.DEFAULT_TESTS[0]}"
    )
    # the default tests are checked too: this checkout has no transformer/ tests
    assert (
        "UPSTREAM_TESTS: tests/unit_tests/transformer/test_fsdp_dtensor_checkpoint.py is not in"
        in _refused(monkeypatch, capsys, base)
    )
    tests = ["--tests", MFSDP]
    assert _refused(monkeypatch, capsys, [*base, *tests, "--world-sizes", "2 four"]) == (
        "make upstream: UPSTREAM_WORLD_SIZES='2 four': 'four' is not a world size (a whole number of ranks, "
        'at least 1); e.g. UPSTREAM_WORLD_SIZES="2 4"'
    )
    assert "UPSTREAM_WORLD_SIZES='0'" in _refused(monkeypatch, capsys, [*base, *tests, "--world-sizes", "0"])
    assert _refused(monkeypatch, capsys, [*base, *tests, "--wall", "soon"]) == (
        "make upstream: UPSTREAM_WALL='soon': not a positive number of seconds; e.g. UPSTREAM_WALL=3600"
    )
    a_file = write(tmp_path / "a-file", "")
    assert _refused(monkeypatch, capsys, [*base, *tests, "--results", str(a_file)]).startswith(
        f"make upstream: UPSTREAM_RESULTS={a_file}: a file, not a directory"
    )
    assert not results.exists()  # nothing written either


BRIDGE_NODE = "tests/functional/test_fsdp.py::TestF::test_pretrain"


@pytest.fixture
def bridge(tmp_path: Path) -> Path:
    root = tmp_path / "Megatron-Bridge"
    for part in upstream.BRIDGE_LAYOUT:
        (root / part).mkdir(parents=True)
    (root / "tests" / "functional").mkdir()
    (root / "tests" / "functional" / "test_fsdp.py").write_text("")
    return root


def test_megatron_bridge_is_one_more_run_of_make_bridge_test(tmp_path, checkout, bridge) -> None:
    argv = [
        "--megatron-lm",
        str(checkout),
        "--tests",
        MFSDP,
        "--world-sizes",
        "2",
        "--megatron-bridge",
        str(bridge),
    ]
    bridge_args = ["--bridge-test", BRIDGE_NODE, "--bridge-venv", "/v/b", "--bridge-megatron-core", "-e /m"]
    runs = upstream.plan(upstream.parser().parse_args([*argv, *bridge_args]))
    assert [(run.name, run.checkout, run.tests, run.world_size) for run in runs] == [
        ("ws2", checkout, (MFSDP,), 2),
        ("bridge", bridge, (BRIDGE_NODE,), upstream.BRIDGE_WORLD_SIZE),
    ]
    assert runs[0].markers == upstream.DEFAULT_MARKERS  # upstream's dev-CI selection unless told
    results = tmp_path / "results"
    assert runs[1].command("/unused/python", results / "bridge.xml", make="/usr/bin/make") == [
        "/usr/bin/make", "--no-print-directory", "-C", str(upstream.REPO), "bridge-test", "STACK=bridge",
        f"MEGATRON_BRIDGE={bridge}", f"BRIDGE_TEST={BRIDGE_NODE}", "VENV=/v/b", "MEGATRON_CORE=-e /m",
        f"NPROC={upstream.BRIDGE_WORLD_SIZE}", f"JUNIT={results}/bridge.xml",
        f"BRIDGE_LOGS={results.resolve()}/bridge-logs",
    ]  # fmt: skip
    # the Makefile's own defaults where none are given
    plain = upstream.plan(
        upstream.parser().parse_args([*argv, "--bridge-test", BRIDGE_NODE, "--markers", " "])
    )
    assert not any(arg.startswith(("VENV=", "MEGATRON_CORE=")) for arg in plain[1].make_args)
    assert plain[0].markers == ""


def test_a_bad_megatron_bridge_or_bridge_test_is_one_line(
    tmp_path, checkout, bridge, monkeypatch, capsys
) -> None:
    argv = ["--megatron-lm", str(checkout), "--tests", MFSDP, "--bridge-test", BRIDGE_NODE]
    assert _refused(monkeypatch, capsys, [*argv, "--megatron-bridge", str(checkout)]) == (
        f"make upstream: MEGATRON_BRIDGE={checkout} is not a Megatron-Bridge checkout's root (no "
        "src/megatron/bridge in it); give the directory that holds src/megatron/bridge and tests, "
        "e.g. make upstream MEGATRON_BRIDGE=/path/to/Megatron-Bridge"
    )
    argv[-1] = "tests/functional/test_gone.py::test_x"
    assert _refused(monkeypatch, capsys, [*argv, "--megatron-bridge", str(bridge)]) == (
        "make upstream: BRIDGE_TEST: tests/functional/test_gone.py::test_x is not in "
        f"MEGATRON_BRIDGE={bridge}; "
        f"give paths relative to the checkout's root, e.g. BRIDGE_TEST={upstream.BRIDGE_EXAMPLE}"
    )
    argv[-1] = ""
    assert _refused(monkeypatch, capsys, [*argv, "--megatron-bridge", str(bridge)]).startswith(
        "make upstream: BRIDGE_TEST='': not one test; give one path or node id in the "
        "MEGATRON_BRIDGE checkout"
    )


def test_check_stops_after_the_input(tmp_path, checkout, monkeypatch) -> None:
    monkeypatch.setattr(upstream, "execute", lambda *a, **k: pytest.fail("a run started"))
    argv = ["--check", "--megatron-lm", str(checkout), "--tests", MFSDP, "--results", str(tmp_path / "r")]
    assert upstream.main(argv) == 0
    assert not (tmp_path / "r").exists()


# -- running: fake commands stand in for torchrun ---------------------------------------------------


def _fake(tmp_path: Path, body: str) -> list[str]:
    script = write(tmp_path / "fake_torchrun.py", textwrap.dedent(body))
    return [sys.executable, str(script)]


#: what pytest does on SIGINT: ends the session as interrupted and writes the JUnit of the tests so
#: far (the JUnit text from the file named first, into the file named second)
WRITES_JUNIT_ON_SIGINT = """
    import shutil, signal, sys, time
    def interrupted(signum, frame):
        shutil.copy(sys.argv[1], sys.argv[2])
        sys.exit(2)
    signal.signal(signal.SIGINT, interrupted)
    print("started", flush=True)
    time.sleep(60)
"""


def _junit_writer(tmp_path: Path, body: str, junit: Path) -> list[str]:
    return [*_fake(tmp_path, body), str(write(tmp_path / "source.xml", JUNIT)), str(junit)]


def test_a_run_past_its_wall_limit_is_interrupted_and_its_junit_kept(tmp_path: Path) -> None:
    results = tmp_path / "results"
    results.mkdir()
    run = upstream.Run("ws2", results, (MFSDP,), 2)  # cwd: the results dir, where the fake writes
    start = time.monotonic()
    command = _junit_writer(tmp_path, WRITES_JUNIT_ON_SIGINT, results / "ws2.xml")
    result = upstream.execute(run, command, results, wall_s=1.0, grace_s=10.0)
    assert time.monotonic() - start < 8
    assert not result.finished
    assert result.status is None
    assert result.stopped == "wall limit 1 s reached: interrupted (SIGINT), ended within 10 s"
    assert (results / "ws2.log").read_text() == "started\n"
    parsed = upstream.read_junit(result.junit)
    assert parsed.problem is None
    assert len(parsed.tests) == 9
    assert "DID NOT FINISH" in upstream.heading(result, parsed)


def test_the_test_an_interrupt_cut_short_is_left_out_and_said(tmp_path: Path) -> None:
    """pytest interrupted in a test writes a testcase with no name for it."""
    cut = JUNIT.replace("</testsuite>", '<testcase time="0.001"></testcase></testsuite>')
    parsed = upstream.read_junit(write(tmp_path / "ws2.xml", cut))
    assert len(parsed.tests) == 9
    assert parsed.unnamed == 1
    stopped = _result(tmp_path, status=None, stopped="wall limit 1 s reached")
    assert "; 1 testcase without a name (the test an interrupt cut short) left out" in upstream.heading(
        stopped, parsed
    )


def _gone(pid: int, within_s: float = 5.0) -> bool:
    """Whether ``pid`` is dead (or a zombie) within ``within_s``: SIGKILL takes effect asynchronously."""
    deadline = time.monotonic() + within_s
    while upstream._proc_stat(pid) is not None:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _deaf_agent(tmp_path: Path, rank_pid: Path) -> list[str]:
    """An agent that ignores SIGINT, with a rank in a session of its own (as torchrun starts them)."""
    return _fake(
        tmp_path,
        f"""
        import signal, subprocess, sys, time
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        sleep = [sys.executable, "-c", "import time; time.sleep(120)"]
        rank = subprocess.Popen(sleep, start_new_session=True)
        open({str(rank_pid)!r}, "w").write(str(rank.pid))
        time.sleep(120)
        """,
    )


def test_what_ignores_the_interrupt_is_killed_with_the_ranks_in_their_own_sessions(tmp_path: Path) -> None:
    """torchrun starts each rank in a session of its own: killing the agent's session alone would
    leave them running."""
    results = tmp_path / "results"
    results.mkdir()
    rank_pid = tmp_path / "rank.pid"
    command = _deaf_agent(tmp_path, rank_pid)
    run = upstream.Run("ws2", results, (MFSDP,), 2)
    start = time.monotonic()
    result = upstream.execute(run, command, results, wall_s=2.0, grace_s=1.0)
    assert time.monotonic() - start < 10
    assert (
        result.stopped
        == "wall limit 2 s reached: interrupted (SIGINT), still running after 1 s: killed (SIGKILL)"
    )
    assert _gone(int(rank_pid.read_text())), "the rank in its own session was left running"
    assert result.leftovers == 1  # the rank, killed after the agent: the run's heading says so
    assert upstream.read_junit(result.junit).problem == "no JUnit file written"


def test_an_interrupted_runner_leaves_no_run_behind(tmp_path: Path) -> None:
    """Ctrl-C (or SIGTERM, which main turns into the same) while a run goes: the run and its ranks
    are ended before the interrupt goes on."""
    results = tmp_path / "results"
    results.mkdir()
    rank_pid = tmp_path / "rank.pid"

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 1.5)
    try:
        with pytest.raises(KeyboardInterrupt):
            upstream.execute(
                upstream.Run("ws2", results, (MFSDP,), 2), _deaf_agent(tmp_path, rank_pid), results, 60.0, 1.0
            )
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert _gone(int(rank_pid.read_text())), "the rank in its own session was left running"
    assert not upstream.descendants(os.getpid())


def test_a_run_that_finishes_in_time_keeps_its_status_and_a_stale_junit_goes(tmp_path: Path) -> None:
    results = tmp_path / "results"
    results.mkdir()
    write(results / "ws2.xml", JUNIT)  # a previous run's
    run = upstream.Run("ws2", results, (MFSDP,), 2)
    result = upstream.execute(run, _fake(tmp_path, "import sys; sys.exit(3)"), results, wall_s=30.0)
    assert result.finished
    assert result.status == 3
    assert result.leftovers == 0
    assert upstream.read_junit(result.junit).problem == "no JUnit file written"


def test_main_writes_the_junit_table_and_summary_per_run(tmp_path, checkout, monkeypatch, capsys) -> None:
    results = tmp_path / "results"
    body = WRITES_JUNIT_ON_SIGINT.replace("time.sleep(60)", "interrupted(0, None)")

    def fake_command(self: upstream.Run, python: str, junit: Path) -> list[str]:
        return _junit_writer(tmp_path, body, junit)

    monkeypatch.setattr(upstream.Run, "command", fake_command)
    monkeypatch.setattr(upstream.signal, "signal", lambda *args: None)  # main's SIGTERM handler
    monkeypatch.setattr(upstream, "_become_subreaper", lambda: None)  # not for the test process
    monkeypatch.setattr(upstream, "rank_baseline", lambda python, root: (GIB // 2, GIB // 2))
    monkeypatch.setattr(upstream, "memory_available", lambda: 64 * GIB)
    argv = [
        "--megatron-lm",
        str(checkout),
        "--tests",
        MFSDP,
        "--world-sizes",
        "2 4",
        "--results",
        str(results),
    ]
    assert upstream.main(argv) == 1  # failures in the JUnit
    summary = json.loads((results / "summary.json").read_text())
    assert list(summary["runs"]) == ["ws2", "ws4"]
    assert summary["runs"]["ws4"]["world_size"] == 4
    assert summary["runs"]["ws4"]["tests_given"] == [MFSDP]
    assert summary["stack"]["checkouts"]["MEGATRON_LM"]["path"] == str(checkout)
    assert sorted(path.name for path in results.iterdir()) == [
        "summary.json", "table.md", "ws2.log", "ws2.xml", "ws4.log", "ws4.xml",
    ]  # fmt: skip
    out = capsys.readouterr().out
    assert (results / "table.md").read_text() in out
    assert out.count("| **total** | 1 | 2 | 1 | 1 | 1 | 2 | 1 | 5.3 s |") == 2  # ws2's table, ws4's
    assert "| **total** | 2 | 4 | 2 | 2 | 2 | 4 | 2 | 10.5 s |" in out


def test_main_adds_the_bridge_run_with_its_loss_line(tmp_path, checkout, bridge, monkeypatch, capsys) -> None:
    """The run named bridge: its JUnit in the same table and summary.json, its wall limit, the
    deselected count and the last-loss line ``make bridge-test`` printed into its log."""
    results = tmp_path / "results"
    loss = "last lm loss 8.34 at iteration 10, finite (/r/rank1.log)"
    body = (
        WRITES_JUNIT_ON_SIGINT.replace(
            'print("started", flush=True)', 'print("collected 1 item", flush=True)'
        )
        .replace("sys.exit(2)", f"print({bridge_loss_line(loss)!r}); sys.exit(0)")
        .replace("time.sleep(60)", "interrupted(0, None)")
    )

    def fake_command(self: upstream.Run, python: str, junit: Path) -> list[str]:
        return _junit_writer(tmp_path, body, junit)

    monkeypatch.setattr(upstream.Run, "command", fake_command)
    monkeypatch.setattr(upstream.signal, "signal", lambda *args: None)
    monkeypatch.setattr(upstream, "_become_subreaper", lambda: None)
    argv = ["--megatron-lm", str(checkout), "--tests", MFSDP, "--world-sizes", "2", "--results", str(results),
            "--megatron-bridge", str(bridge), "--bridge-test", BRIDGE_NODE, "--wall", "600"]  # fmt: skip
    assert upstream.main(argv) == 1  # failures in the (fake) JUnit
    summary = json.loads((results / "summary.json").read_text())
    assert list(summary["runs"]) == ["ws2", "bridge"]
    run = summary["runs"]["bridge"]
    assert run["last_loss"] == loss
    assert run["wall_limit_s"] == 600.0
    assert run["deselected"] == 0  # it logged its collection: nothing deselected
    assert run["markers"] is None  # upstream's markers select among the Megatron-LM runs only
    assert run["command"].startswith("make bridge-test STACK=bridge MEGATRON_BRIDGE=")
    assert summary["runs"]["ws2"]["markers"] == upstream.DEFAULT_MARKERS
    assert summary["stack"]["checkouts"]["MEGATRON_BRIDGE"]["path"] == str(bridge)
    out = capsys.readouterr().out
    heading = next(line for line in out.splitlines() if line.startswith("bridge: world size 2"))
    assert heading.startswith(f"bridge: world size 2, make bridge-test, {BRIDGE_NODE}: finished in ")
    assert heading.endswith(
        f"(wall limit 600 s), exit status 0; 0 deselected; {loss} (log: {results}/bridge.log)"
    )
    assert "| bridge | 1 | 2 | 1 | 1 | 1 | 2 | 1 | 5.3 s |" in out


def bridge_loss_line(line: str) -> str:
    from bench import bridge_loss

    return bridge_loss.PREFIX + line


#: a make that, like GNU make on SIGINT, waits for its recipe and does not pass the signal on; its
#: recipe writes the JUnit file on SIGINT (pytest under torchrun) and is in make's process group
MAKE_WITH_RECIPE = """
    import shutil, signal, subprocess, sys, time
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    recipe = (
        "import shutil, signal, sys, time\\n"
        "def interrupted(signum, frame):\\n"
        "    shutil.copy(sys.argv[1], sys.argv[2]); sys.exit(2)\\n"
        "signal.signal(signal.SIGINT, interrupted)\\n"
        "print('recipe started', flush=True)\\n"
        "time.sleep(60)\\n"
    )
    child = subprocess.Popen([sys.executable, "-c", recipe, sys.argv[1], sys.argv[2]])
    sys.exit(child.wait())
"""


def test_an_overrun_make_run_is_interrupted_as_ctrl_c_would_its_recipe_included(tmp_path: Path) -> None:
    results = tmp_path / "results"
    results.mkdir()
    run = upstream.Run("bridge", results, (MFSDP,), 2, make_args=("bridge-test",))
    command = _junit_writer(tmp_path, MAKE_WITH_RECIPE, results / "bridge.xml")
    result = upstream.execute(run, command, results, wall_s=2.0, grace_s=10.0)
    assert result.stopped == "wall limit 2 s reached: interrupted (SIGINT), ended within 10 s"
    assert result.status is None
    assert len(upstream.read_junit(result.junit).tests) == 9  # the recipe wrote its JUnit on SIGINT


def test_the_descendants_of_a_process_are_found_through_proc(tmp_path: Path) -> None:
    import subprocess

    child = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
         "'import time; time.sleep(30)']); time.sleep(30)"],
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 10
        while len(upstream.descendants(os.getpid())) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        (grandchild,) = upstream.descendants(child.pid)
        assert grandchild != child.pid
        assert child.pid in upstream.descendants(os.getpid())
        assert upstream.kill_all(upstream.descendants(child.pid)) == 1
        assert _gone(grandchild)  # dead (a zombie until its parent reaps it)
        assert upstream.kill_all({child.pid: "not its start time"}) == 0  # a reused pid is spared
        assert child.poll() is None
    finally:
        child.kill()
        child.wait()


GIB = upstream.GIB


def test_a_world_size_whose_ranks_would_not_fit_is_refused_before_any_run():
    # 8 ranks of 0.5 GiB measured + 1 GiB headroom each, 0.5 GiB shared, 1.5 kept: 14 GiB
    with pytest.raises(upstream.BadInput) as refused:
        upstream.memory_check([2, 4, 8], (GIB // 2, GIB // 2), 13 * GIB, "")
    line = str(refused.value)
    assert line.startswith("UPSTREAM_WORLD_SIZES='2 4 8': world size 8 needs about 14.0 GiB"), line
    assert "this machine has 13.0 GiB available" in line
    assert 'run UPSTREAM_WORLD_SIZES="2 4"' in line
    assert "\n" not in line


def test_world_sizes_that_fit_say_what_the_largest_needs():
    line = upstream.memory_check([2, 4, 8], (GIB // 2, GIB // 2), 14 * GIB, "2 4 8")
    assert line.startswith("memory: world size 8 needs about 14.0 GiB of 14.0 GiB free"), line


def test_the_baseline_is_measured_in_a_process_that_imported_what_a_rank_imports(tmp_path, monkeypatch):
    monkeypatch.setattr(upstream, "RANK_IMPORTS", "import json")  # what this venv has; no megatron needed
    private, shared = upstream.rank_baseline(sys.executable, tmp_path)
    assert 1 << 20 < private < 1 << 30
    assert 1 << 20 < shared < 1 << 30


# -- no network, nothing left outside ---------------------------------------------------------------


def test_a_megatron_lm_run_has_no_network_and_a_download_fails_at_once(tmp_path, checkout, monkeypatch):
    """Tests never download: a request from a run (upstream's test-data fixture) fails at once
    instead of waiting out a silent server, and the run's line says the fixture got no data."""
    results = tmp_path / "results"
    body = (
        "import time, urllib.request\n"
        "start = time.monotonic()\n"
        "try:\n"
        "    urllib.request.urlopen('https://github.com/NVIDIA/Megatron-LM/releases/x.zip', timeout=60)\n"
        "except OSError as exc:\n"
        "    took = round(time.monotonic() - start)\n"
        f"    print('{upstream.NO_TEST_DATA} datasets.zip:', type(exc).__name__, took, exc)\n"
    )

    def fake_command(self: upstream.Run, python: str, junit: Path) -> list[str]:
        return _fake(tmp_path, body)

    monkeypatch.setattr(upstream.Run, "command", fake_command)
    monkeypatch.setattr(upstream.signal, "signal", lambda *args: None)
    monkeypatch.setattr(upstream, "_become_subreaper", lambda: None)
    monkeypatch.setattr(upstream, "rank_baseline", lambda python, root: (GIB // 2, GIB // 2))
    monkeypatch.setattr(upstream, "memory_available", lambda: 64 * GIB)
    argv = ["--megatron-lm", str(checkout), "--tests", MFSDP, "--world-sizes", "2", "--results", str(results)]
    upstream.main(argv)
    log = (results / "ws2.log").read_text()
    assert log.startswith(f"{upstream.NO_TEST_DATA} datasets.zip: URLError 0"), log
    assert "Connection refused" in log  # by the closed proxy port, never a resolver or a server
    heading = (results / "table.md").read_text()
    assert (
        "upstream's ensure_test_data fixture could not download its test data (the runs have no network"
        in heading
    )


def test_what_the_runs_made_outside_the_checkout_goes_when_left_empty(tmp_path, monkeypatch):
    made_empty, made_full, was_there = tmp_path / "data", tmp_path / "shared", tmp_path / "mine"
    monkeypatch.setattr(upstream, "MADE_OUTSIDE", (made_empty, made_full, was_there))
    was_there.mkdir()
    existed = {path for path in upstream.MADE_OUTSIDE if path.exists()}
    made_empty.mkdir()
    made_full.mkdir()
    (made_full / "checkpoint").write_text("kept: not ours to judge")
    assert upstream.remove_made_outside(existed) == [made_empty]
    assert not made_empty.exists()
    assert made_full.exists()
    assert was_there.exists()


def test_a_runs_peak_memory_is_sampled_while_it_runs(tmp_path: Path) -> None:
    results = tmp_path / "results"
    results.mkdir()
    run = upstream.Run("ws2", results, (MFSDP,), 2)
    body = "import time\nheld = b'x' * (300 << 20)\ntime.sleep(3 * 2.0)\n"
    result = upstream.execute(run, _fake(tmp_path, body), results, wall_s=60.0)
    assert result.memory.process_rss >= 300 << 20
    assert result.memory.total_pss >= 300 << 20
    assert "peak memory 0.3 GiB (all processes' PSS)" in upstream.heading(
        result, upstream.read_junit(result.junit)
    )
