"""Coverage counts what the launched ranks run: a user's ``pytest --cov=...`` (pytest-cov) with the
repo's coverage set-up (pyproject.toml's ``[tool.coverage.*]``: ``patch = ["subprocess"]``, one data
file per process), ranks ended by the timeout watchdog included (it saves their data before
``os._exit``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("pytest_cov", reason="the dev extra's pytest-cov")

ROOT = Path(__file__).resolve().parents[2]

#: run only inside the ranks: the plain-pytest parent imports the test module, never this one
RANKS_ONLY = """
def work(rank):
    if rank == 0:
        return "zero"
    return "other"


def never_called():
    return "nobody"


def before_the_hang(rank):
    if rank == 0:
        return "zero hangs"
    return "other hangs"
"""

TESTS = """
import time

import pytest


@pytest.mark.distributed(world_size=2)
def test_on_the_ranks(dist_env):
    import ranks_only

    assert ranks_only.work(dist_env.rank) == ("zero" if dist_env.rank == 0 else "other")


@pytest.mark.distributed(world_size=2, timeout=8)
def test_hangs(dist_env):
    import ranks_only

    ranks_only.before_the_hang(dist_env.rank)
    time.sleep(600)
"""


def coverage_settings() -> str:
    """The repo's coverage configuration, as pyproject.toml has it (from its first
    ``[tool.coverage`` table to the next table that is not coverage's)."""
    lines = (ROOT / "pyproject.toml").read_text().splitlines()
    kept: list[str] = []
    inside = False
    for line in lines:
        if line.startswith("["):
            inside = line.startswith("[tool.coverage")
        if inside:
            kept.append(line)
    assert kept, "pyproject.toml has no [tool.coverage.*] table"
    return "\n".join(kept) + "\n"


def _lines(source: str, text: str) -> list[int]:
    return [n for n, line in enumerate(source.splitlines(), 1) if text in line]


def _measured(pytester: pytest.Pytester, *test_args: str) -> tuple[pytest.RunResult, dict, str]:
    """A session with ``--cov=ranks_only``: its result, ranks_only.py's measurement and source."""
    pytester.makefile(".toml", pyproject=coverage_settings())
    # imported by the parent as well (its def lines run there), so that there is always data to
    # report: what only the ranks ran is then what tells
    pytester.makeconftest("import ranks_only  # noqa: F401")
    pytester.makepyfile(ranks_only=RANKS_ONLY, test_on_ranks=TESTS)
    result = pytester.runpytest_subprocess(
        "-p",
        "no:cacheprovider",
        "--mfsdp-platform=cpu",
        "--cov=ranks_only",
        "--cov-branch",
        "--cov-report=json:cov.json",
        *test_args,
        timeout=300,
    )
    report = json.loads((pytester.path / "cov.json").read_text())
    return result, report["files"]["ranks_only.py"], (pytester.path / "ranks_only.py").read_text()


def test_pytest_cov_counts_the_lines_every_rank_ran(pytester, isolated_tmp):
    result, measured, source = _measured(pytester, "-k", "on_the_ranks")
    result.assert_outcomes(passed=1)
    # both ranks' data, combined: rank 0 took the if, rank 1 fell through to the return after it
    assert _lines(source, 'return "zero"')[0] in measured["executed_lines"]
    assert _lines(source, 'return "other"')[0] in measured["executed_lines"]
    # what no rank ran: never_called's body, before_the_hang's (that test was deselected)
    start = _lines(source, "def before_the_hang")[0]
    assert measured["missing_lines"] == [
        *_lines(source, 'return "nobody"'),
        start + 1,
        start + 2,
        start + 3,
    ]
    assert measured["summary"]["missing_branches"] == 2  # before_the_hang's if: neither way


def test_a_rank_ended_by_the_watchdog_keeps_its_data(pytester, isolated_tmp):
    result, measured, source = _measured(pytester, "-k", "hangs")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*test_hangs exceeded its 8 s timeout*"])
    # each rank ran its own way into the hang, and was then ended by os._exit on its watchdog
    assert _lines(source, 'return "zero hangs"')[0] in measured["executed_lines"]
    assert _lines(source, 'return "other hangs"')[0] in measured["executed_lines"]
