"""A setting of pytest-timeout or pytest-rerunfailures that a distributed test cannot honour ends the
session with a usage error of one line on stderr, as a user's pytest prints it: a pytest session in
a subprocess each, so the integration tier's (the settings themselves, read in process:
tests/unit/test_coexist_settings.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("pytest_timeout", reason="the dev extra's pytest-timeout")
pytest.importorskip("pytest_rerunfailures", reason="the dev extra's pytest-rerunfailures")


def test_a_bad_pytest_timeout_marker_is_one_line(inner_session):
    files = {
        "test_a_bad_pytest_timeout_marker_is_one_line.py": (
            "import pytest\n@pytest.mark.distributed(world_size=1)\n@pytest.mark.timeout('soon')\n"
            "def test_x(): pass\n"
        )
    }
    result = inner_session(files, "--mfsdp-platform=cpu", timeout=60).result
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert result.stderr.lines[0] == (
        "ERROR: test_a_bad_pytest_timeout_marker_is_one_line.py::test_x: @pytest.mark.timeout: invalid "
        "timeout 'soon': must be a number of seconds (pytest-timeout's setting)"
    ), result.stderr.lines


def test_a_bad_only_rerun_kind_is_one_line(inner_session):
    files = {"test_a_bad_only_rerun_kind_is_one_line.py": "def test_nothing(): pass\n"}
    result = inner_session(files, "--mfsdp-only-rerun=assertion", timeout=60).result
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert result.stderr.lines[0] == (
        "ERROR: --mfsdp-only-rerun: invalid value 'assertion' for --mfsdp-only-rerun: choose one of: "
        "timeout, rank-death, failure"
    ), result.stderr.lines


def test_a_flaky_condition_that_needs_the_exception_is_refused_in_one_line(inner_session):
    files = {
        "test_a_flaky_condition_that_needs_the_exception_is_refused_in_one_line.py": (
            "import pytest\n"
            "@pytest.mark.distributed(world_size=1)\n"
            "@pytest.mark.flaky(reruns=1, condition='error is not None')\ndef test_x(): pass\n"
            "@pytest.mark.distributed(world_size=1)\n"
            "@pytest.mark.flaky(reruns=1, condition=True)\ndef test_bool(): pass\n"
        )
    }
    result = inner_session(files, "--mfsdp-platform=cpu", timeout=60).result
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    line = result.stderr.lines[0]
    assert line.startswith(
        "ERROR: test_a_flaky_condition_that_needs_the_exception_is_refused_in_one_line.py::test_x: "
        "@pytest.mark.flaky(condition='error is not None') on a distributed test: only a bool condition "
        "is supported"
    ), result.stderr.lines
    assert "test_bool" not in result.stderr.str()


# -- which failures are rerun ---------------------------------------------------------------------
