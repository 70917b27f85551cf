"""The one builder of the test reports the plugin makes itself (a failure the controller saw, the
agreed outcome of every rank's reports, a test this rank alone reports, a test not run): whatever
the side, a report names its test as pytest's own do.

Plain pytest: no torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal, cast

import pytest

from .explain import headlined_failure

#: the attribute on the reports of a test the session never ran (a rank never came back, or a signal
#: ended the session): its terminal status is ``NOT RUN``, its JUnit entry an error
NOT_RUN = "mfsdp_not_run"

Phase = Literal["setup", "call", "teardown"]
Outcome = Literal["passed", "failed", "skipped"]


def build_report(
    item: pytest.Item,
    when: str,
    outcome: str,
    longrepr: Any = None,
    *,
    duration: float = 0.0,
    sections: Iterable[tuple[str, str]] = (),
    attributes: Mapping[str, Any] | None = None,
) -> pytest.TestReport:
    """``item``'s report of phase ``when``: its node id, location, keywords and user properties as
    pytest gives them; ``attributes``: what rides on the report besides (pytest serialises them)."""
    return pytest.TestReport(
        nodeid=item.nodeid,
        location=item.location,
        keywords={k: 1 for k in item.keywords},
        outcome=cast(Outcome, outcome),
        longrepr=longrepr,
        when=cast(Phase, when),
        sections=list(sections),
        duration=max(duration, 0.0),
        user_properties=list(item.user_properties),
        **(attributes or {}),
    )


def not_run_status(report: pytest.TestReport) -> tuple[str, str, str] | None:
    """The terminal status of a test not run (its own category in pytest's final line), else None."""
    if getattr(report, NOT_RUN, False) and report.when == "setup":
        return "not run", "N", "NOT RUN"
    return None


def log_not_run(items: Sequence[pytest.Item], reason: str) -> list[str]:
    """Report each of ``items`` not run, with ``reason`` (the session ends before them), through
    pytest's report hooks: an error in its setup (a JUnit ``error``, a failed session), never a skip,
    which would count a test nobody ran as an accepted outcome; its terminal status is ``NOT RUN``
    (:data:`NOT_RUN`). Returns their node ids."""
    for item in items:
        item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
        for when, outcome, longrepr in (
            ("setup", "failed", headlined_failure(item, reason)),
            ("teardown", "passed", None),
        ):
            report = build_report(item, when, outcome, longrepr, attributes={NOT_RUN: True})
            item.ihook.pytest_runtest_logreport(report=report)
        item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    return [item.nodeid for item in items]
