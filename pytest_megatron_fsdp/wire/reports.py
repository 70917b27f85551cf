"""The one builder of the test reports the plugin makes itself (a failure the controller saw, the
agreed outcome of every rank's reports, a test this rank alone reports, a test not run): whatever
the side, a report names its test as pytest's own do.

Plain pytest: no torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Literal, cast

import pytest

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
