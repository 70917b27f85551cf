"""The known-bug registry in a real session: a strict xfail that passes fails, saying the bug no longer
reproduces and what to change in the registry."""

from __future__ import annotations

from pytest_megatron_fsdp.fsdp import versions

XPASSING = """
import pytest

from pytest_megatron_fsdp.fsdp import versions

BUG = versions.GLOO_CONCURRENT_COALESCED_ALL_GATHERS  # torch's, no fixed version: present everywhere


@pytest.mark.distributed(world_size=2)
def test_on_two_ranks(known_bug, dist_env):
    known_bug(BUG)


def test_in_process(known_bug):
    known_bug(BUG)


def test_failing_as_expected(known_bug):
    known_bug(BUG, raises=ZeroDivisionError)
    1 / 0
"""


def test_a_passing_strict_xfail_fails_saying_the_bug_no_longer_reproduces(pytester, monkeypatch):
    """The functional suite's ``known_bug`` (tests/functional/conftest.py) on a bug that does not
    reproduce: the failure's first line is the registry's message, on 2 ranks as in one process."""
    from pathlib import Path

    monkeypatch.setenv("CI", "true")  # the short summary prints each failure's message untrimmed
    pytester.makeconftest((Path(__file__).parents[1] / "functional" / "conftest.py").read_text())
    pytester.makepyfile(test_xpass=XPASSING)
    result = pytester.runpytest_subprocess(
        "-q", "--mfsdp-platform=cpu", "-p", "no:cacheprovider", timeout=300
    )
    result.assert_outcomes(failed=2, xfailed=1)
    expected = (
        f"[XPASS(strict)] {versions.no_longer_reproduces(versions.GLOO_CONCURRENT_COALESCED_ALL_GATHERS)}"
    )
    assert expected.startswith(
        f"[XPASS(strict)] known bug gloo_concurrent_coalesced_all_gathers no longer reproduces with torch "
        f"{versions.package_version('torch')}"
    )
    out = result.stdout.str()
    summary = out[out.index(" short test summary info ") :].splitlines()
    assert (
        f"FAILED test_xpass.py::test_on_two_ranks - {expected} (failed on ranks 0, 1 (same error))" in summary
    )
    in_process = out[out.index("_ test_in_process _") : out.index(" short test summary info ")]
    assert in_process.splitlines()[1] == expected, in_process
