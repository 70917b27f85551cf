"""What a failing batch reads like in plain-mode sessions: each failure at a glance, a note on its own
line for a rank set that ended abnormally, a strict xfail that passed headlined on its own line."""

FAILURES = """
import pytest

pytestmark = pytest.mark.distributed(world_size=2)


def test_same_everywhere(megatron_fsdp_run, run_config, dist_env):
    megatron_fsdp_run(run_config).train(1)  # Megatron-FSDP built: its device warning would be logged
    assert dist_env.world_size == 3, "every rank sees 2 ranks"


def test_differs_per_rank(dist_env):
    raise RuntimeError(f"rank {dist_env.rank} has its own reason")


def test_fine():
    pass
"""


def test_a_failing_batch_reads_at_a_glance(pytester, monkeypatch):
    # as on a CI service, where pytest's short summary prints each failure's message untrimmed
    monkeypatch.setenv("CI", "true")
    pytester.makepyfile(test_failures=FAILURES)
    result = pytester.runpytest_subprocess(
        "-q", "--mfsdp-platform=cpu", "--mfsdp-log-dir=logs", "-p", "no:cacheprovider", timeout=300
    )
    result.assert_outcomes(failed=2, passed=1)
    out = result.stdout.str()
    logs = pytester.path / "logs"

    same = out[out.index("_ test_same_everywhere _") : out.index("_ test_differs_per_rank _")]
    assert "failed on ranks 0, 1 (same error)" in same
    assert same.count("AssertionError: every rank sees 2 ranks") == 1
    assert "(logs: logs/batch1-world2/rank0.log, logs/batch1-world2/rank1.log)" in same

    differs = out[out.index("_ test_differs_per_rank _") : out.index(" short test summary info ")]
    assert "failed on ranks 0, 1\n" in differs
    assert "(same error)" not in differs
    assert "RuntimeError: rank 0 has its own reason" in differs
    assert "RuntimeError: rank 1 has its own reason" in differs

    # the short summary: one line per failure, its headline (not every rank's traceback again)
    summary = out[out.index(" short test summary info ") :].splitlines()[1:-1]
    assert summary == [
        "FAILED test_failures.py::test_same_everywhere - failed on ranks 0, 1 (same error)",
        "FAILED test_failures.py::test_differs_per_rank - failed on ranks 0, 1",
    ], out

    # the emulation's device warning is not in the report (nor in the ranks' logs)
    assert "instead of the current device" not in out
    assert "instead of the current device" not in (logs / "batch1-world2" / "rank1.log").read_text()
    # failed tests end their rank set normally (pytest exits 1): nothing more to say about it
    assert "rank set ended" not in out
    assert "exited with" not in out


def test_a_rank_set_that_ends_abnormally_gets_a_note_on_its_own_line(pytester):
    pytester.makeconftest(
        "import os\n"
        "def pytest_sessionfinish(session):\n"
        "    if os.environ.get('RANK') == '1':\n"
        "        os._exit(7)\n"
    )
    pytester.makepyfile("import pytest\n@pytest.mark.distributed(world_size=2)\ndef test_ok():\n    pass\n")
    result = pytester.runpytest_subprocess(
        "-q", "--mfsdp-platform=cpu", "-p", "no:cacheprovider", timeout=300
    )
    result.assert_outcomes(passed=1)
    notes = [line for line in result.stdout.lines if "rank set ended" in line]
    assert len(notes) == 1, result.stdout.lines
    # rank 1's exit makes torchrun stop rank 0 too; the note names both
    assert notes[0].startswith(
        "megatron-fsdp: the world_size=2 rank set ended abnormally after its last test ("
    )
    assert "rank 1: exit code 7" in notes[0]
