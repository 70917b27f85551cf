"""``pytest --cov=PKG`` (pytest-cov 7) in a project with no coverage configuration at all: the code
the launched ranks run is counted. pytest-cov 7 no longer hands its measurement to subprocesses
(coverage's ``patch = ["subprocess"]`` does, where a project sets it: tests/integration/test_coverage.py);
the plugin hands the running measurement to the rank sets it launches itself.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("pytest_cov", reason="the dev extra's pytest-cov")

RANKS_ONLY = """
def work(rank):
    if rank == 0:
        return "zero"
    return "other"
"""

TESTS = """
import pytest


@pytest.mark.distributed(world_size=2)
def test_on_the_ranks(dist_env):
    import ranks_only

    assert ranks_only.work(dist_env.rank) == ("zero" if dist_env.rank == 0 else "other")
"""


def test_pytest_cov_counts_the_ranks_without_any_coverage_configuration(pytester, isolated_tmp):
    # imported by the parent too (its def line runs there): there is data even without the ranks'
    pytester.makeconftest("import ranks_only  # noqa: F401")
    pytester.makepyfile(ranks_only=RANKS_ONLY, test_on_ranks=TESTS)
    assert not list(pytester.path.glob("*.toml"))
    assert not list(pytester.path.glob(".coveragerc"))
    result = pytester.runpytest_subprocess(
        "-p",
        "no:cacheprovider",
        "--mfsdp-platform=cpu",
        "--cov=ranks_only",
        "--cov-report=json:cov.json",
        timeout=300,
    )
    result.assert_outcomes(passed=1)
    measured = json.loads((pytester.path / "cov.json").read_text())["files"]["ranks_only.py"]
    source = (pytester.path / "ranks_only.py").read_text().splitlines()
    line = {text.strip(): n for n, text in enumerate(source, 1) if text.strip()}
    # both ranks' data, combined with the parent's: rank 0 took the if, rank 1 fell through
    assert line['return "zero"'] in measured["executed_lines"], measured
    assert line['return "other"'] in measured["executed_lines"], measured
    assert measured["missing_lines"] == []
    # the ranks' data files were combined away, none left beside the parent's report
    assert not list(pytester.path.glob(".coverage.*"))
