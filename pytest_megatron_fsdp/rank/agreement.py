"""One outcome for a test from every rank's reports: pure, so every rank computes the same one.

A phase fails when it failed on any rank (its tracebacks, captured output and log paths go into the
report); a skip on some ranks and no failure is a skip everywhere; otherwise it passed. Per-test data
that rides on the local report (pytest-style extra attributes, e.g. training-run records) is kept.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from ..wire import rank_dir
from ..wire.explain import headlined_failure
from ..wire.reports import build_report

_OUTCOME_RANK = {"passed": 0, "skipped": 1, "failed": 2}


def summarise(report: pytest.TestReport) -> dict[str, Any]:
    data: dict[str, Any] = {"outcome": report.outcome, "duration": report.duration}
    if report.failed:
        data["text"] = report.longreprtext
        if getattr(report, "mfsdp_in_a_collective", False):
            data["in_a_collective"] = True
    elif report.skipped and isinstance(report.longrepr, tuple):
        data["text"] = report.longrepr[2]
    if report.skipped and hasattr(report, "wasxfail"):
        data["xfailed"] = report.wasxfail
        data["text"] = report.longreprtext
    data["sections"] = [list(s) for s in report.sections]
    return data


def merge_reports(
    item: pytest.Item,
    local: list[pytest.TestReport],
    per_rank: dict[int, dict[str, Any]],
    my_rank: int,
    log_dir: Path,
) -> list[pytest.TestReport]:
    """One consistent set of reports from every rank's phases: failed > skipped > passed.

    A phase fails when it failed on any rank; the failing ranks' tracebacks, captured output and
    log paths go into the report. A skip on some ranks (and no failure) is a skip everywhere.
    """
    local_by_phase = {r.when: r for r in local}
    merged: list[pytest.TestReport] = []
    for when in ("setup", "call", "teardown"):
        phase = {rank: phases[when] for rank, phases in per_rank.items() if when in phases}
        if not phase:
            continue
        if when == "call" and merged and merged[0].outcome != "passed":
            continue  # setup did not pass everywhere: no call phase, as in pytest
        worst = max(phase.values(), key=lambda p: _OUTCOME_RANK[p["outcome"]])["outcome"]
        expected = expected_failure(phase) if worst == "failed" else None
        if expected is not None:
            worst = "skipped"
        if when == "setup" and worst == "skipped":
            # Some rank skipped but another went on and failed its call: that failure must not vanish.
            failed_calls = {
                r: p["call"] for r, p in per_rank.items() if p.get("call", {}).get("outcome") == "failed"
            }
            if failed_calls:
                phase = {**phase, **failed_calls}
                worst = "failed"
        base = local_by_phase.get(when)
        report = build_report(
            item,
            when,
            worst,
            duration=max(p["duration"] for p in phase.values()),
            sections=base.sections if base is not None else (),
        )
        if base is not None:
            # extra attributes (as pytest's report serialisation carries them): kept as they are
            for name, value in vars(base).items():
                if name != "wasxfail":  # an xfail is decided below, from every rank's outcome
                    report.__dict__.setdefault(name, value)
        for rank, p in sorted(phase.items()):
            if rank != my_rank:
                report.sections.extend((f"{title} (rank {rank})", text) for title, text in p["sections"])
        if worst == "failed":
            report.longrepr = headlined_failure(
                item,
                failure_text(
                    {r: p.get("text", "") for r, p in phase.items() if p["outcome"] == "failed"},
                    sorted(r for r, p in phase.items() if p["outcome"] != "failed"),
                    log_dir,
                ),
            )
        elif expected is not None:
            # a strict xfail that failed as expected on some ranks and passed on the others: the
            # distributed test failed as expected (its bug shows on those ranks)
            report.wasxfail, report.longrepr = expected
        elif worst == "skipped" and base is not None and hasattr(base, "wasxfail"):
            # an expected failure (xfail) is reported as pytest reports it: the reason in
            # `wasxfail`, the failure's own traceback as longrepr
            report.wasxfail = base.wasxfail
            report.longrepr = base.longrepr
        elif worst == "skipped":
            skipping = sorted(r for r, p in phase.items() if p["outcome"] == "skipped")
            reason = phase[skipping[0]].get("text", "skipped")
            if len(skipping) < len(phase):
                others = sorted(set(phase) - set(skipping))
                reason += (
                    f" (skipped on rank {', '.join(map(str, skipping))} only; "
                    f"rank {', '.join(map(str, others))} did not skip)"
                )
            _path, lineno, _ = item.location
            if (
                base is not None
                and base.skipped
                and isinstance(base.longrepr, tuple)
                and len(skipping) == len(phase)
            ):
                report.longrepr = base.longrepr
            else:
                report.longrepr = (str(item.path), (lineno or 0) + 1, reason)
        merged.append(report)
    return merged


#: how pytest's failure text of a strict xfail that passed begins
_XPASS_STRICT = "[XPASS(strict)]"


def expected_failure(phase: dict[int, dict[str, Any]]) -> tuple[str, str] | None:
    """(reason, traceback) of a strict xfail whose expected failure came on some ranks while every
    other rank passed (pytest calls that XPASS(strict) there), or failed in a collective (which the
    ranks that failed as expected, outside it, never entered: its failure only echoes theirs): a
    bug that shows on some ranks of a distributed test is the test failing as expected. None when
    any rank failed otherwise, or no rank failed as expected."""
    xfailed = {rank: p for rank, p in phase.items() if "xfailed" in p}
    echoed = sorted(rank for rank, p in phase.items() if rank not in xfailed and p.get("in_a_collective"))
    others = [p for rank, p in phase.items() if rank not in xfailed and rank not in echoed]
    if not xfailed or not all(
        p["outcome"] == "passed" or p.get("text", "").startswith(_XPASS_STRICT) for p in others
    ):
        return None
    first = min(xfailed)
    passed = sorted(set(phase) - set(xfailed) - set(echoed))
    where = (
        f"failed as expected on {_ranks(sorted(xfailed))}"
        + (f", passed on {', '.join(map(str, passed))}" if passed else "")
        + (f", failed in a collective they never entered on {', '.join(map(str, echoed))}" if echoed else "")
    )
    reason = xfailed[first]["xfailed"]
    return (f"{reason} ({where})" if passed or echoed else reason), xfailed[first].get("text", "")


def failure_text(failures: dict[int, str], passing: list[int], log_dir: Path) -> str:
    """The failure report of one phase: each distinct error once, under every rank that raised it.

    Collective assertions raise the same message on every rank; printing it per rank only buries
    what differs. Ranks with the same text share one block, whose header names all their logs.
    A strict xfail that passed on every failing rank alike headlines with its own line.
    """
    by_error: dict[str, list[int]] = {}
    for rank in sorted(failures):
        by_error.setdefault(error_signature(failures[rank]), []).append(rank)
    by_text = {failures[ranks[0]]: ranks for ranks in by_error.values()}  # the lowest rank's text
    failing = sorted(failures)
    summary = f"failed on {_ranks(failing)}"
    if len(failing) > 1 and len(by_text) == 1:
        summary += " (same error)"
    if passing:
        summary += f" (passed on {', '.join(map(str, passing))})"
    parts = [summary]
    if len(by_text) == 1 and next(iter(by_text)).startswith(_XPASS_STRICT):
        # a strict xfail that passed has no traceback, only what it says: that is the headline
        parts = [f"{next(iter(by_text)).splitlines()[0]} ({summary})"]
    for text, ranks in by_text.items():
        logs = ", ".join(str(rank_dir.log_path(log_dir, rank)) for rank in ranks)
        parts.append(f"---------- {_ranks(ranks)} ({'logs' if len(ranks) > 1 else 'log'}: {logs}) ----------")
        parts.append(text)
    return "\n".join(parts)


_ADDRESS = re.compile(r"0x[0-9a-fA-F]{4,}")
#: pytest's long traceback: "E   <exception line>" and "path:line: ExceptionType" per frame
_ERROR_LINE = re.compile(r"^(E\s.*|\S.*:\d+: \w.*)$")


def error_signature(text: str) -> str:
    """What makes two ranks' failures the same error: the exception (the first line of each block
    of pytest's ``E`` lines) and where each frame raised, object addresses masked. The rest of a
    long traceback differs between ranks that fail alike: argument reprs
    (``dist_env = DistEnv(rank=1, ...)``) and pytest's explanation of an assertion
    (``+  where 2 = DistEnv(rank=1, ...).world_size``)."""
    lines, previous_was_error = [], False
    for line in text.splitlines():
        is_error = line.startswith("E ")
        if _ERROR_LINE.match(line) and not (is_error and previous_was_error):
            lines.append(line)
        previous_was_error = is_error
    return _ADDRESS.sub("0x?", "\n".join(lines) if lines else text)


def _ranks(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
