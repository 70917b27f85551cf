"""The one builder of the test reports the plugin makes itself (a failure the controller saw, the
agreed outcome of every rank's reports, a test this rank alone reports, a test not run): whatever
the side, a report names its test as pytest's own do.

Plain pytest: no torch.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal, cast

import pytest

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
    **extra: Any,
) -> pytest.TestReport:
    """``item``'s report of phase ``when``: its node id, location, keywords and user properties as
    pytest gives them; ``extra``: attributes that ride on the report (pytest serialises them)."""
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
        **extra,
    )
