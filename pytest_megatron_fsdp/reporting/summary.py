"""The session summary a reporting role (the parent, a torchrun-mode rank 0) shows at its end."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from .. import options
from . import metrics


def show_summary(terminalreporter: Any, config: pytest.Config, mode: str) -> None:
    from . import report  # plain Python, no torch

    values = options.session_values(config)
    reports = [r for category in terminalreporter.stats.values() for r in category]
    json_path, plot_path = (_in_invocation_dir(config, path) for path in (values.report_json, values.plot))
    report.terminal_summary(
        terminalreporter, metrics.records_from_reports(reports), mode, json_path, plot_path
    )


def _in_invocation_dir(config: pytest.Config, raw: str | None) -> Path | None:
    if not raw:
        return None
    path = Path(raw)
    return path if path.is_absolute() else Path(config.invocation_params.dir) / path
