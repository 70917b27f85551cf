"""A foreign suite's module that cannot be collected for want of what only a GPU has is a skip
naming the cause (:mod:`..foreign.gpu_only`), in whichever process collects it: a rank, or the
plain-mode parent, which collects the suite before handing its tests to rank sets."""

from __future__ import annotations

from typing import Any

import pytest

from .. import options
from . import gpu_only


def skip_collect_report(collector: pytest.Collector, report: Any) -> Any:
    """``report``, a skip naming the GPU-only cause where a foreign suite's module failed for one
    (pytest keeps the import error as text)."""
    if report.failed and options.session_values(collector.config).foreign_suite:
        cause = gpu_only.cause_in(report.longreprtext)
        if cause is not None:
            report.outcome = "skipped"
            report.longrepr = (str(collector.path), 1, cause.reason())
    return report
