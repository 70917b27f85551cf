"""Saving a rank's coverage data: nothing imported without a measurement, a running one saved."""

from __future__ import annotations

import os
import subprocess
import sys


def test_save_coverage_imports_nothing_and_saves_a_running_measurement(monkeypatch):
    from pytest_megatron_fsdp.rank.watchdog import save_coverage

    # without a measurement: coverage is not imported to find out (a process of its own, none running)
    env = {k: v for k, v in os.environ.items() if not k.startswith("COVERAGE_")}
    check = (
        "import sys; from pytest_megatron_fsdp.rank.watchdog import save_coverage; "
        "assert save_coverage() is False; assert 'coverage' not in sys.modules, 'imported'"
    )
    subprocess.run([sys.executable, "-c", check], env=env, check=True, timeout=120)
    import coverage

    monkeypatch.setattr(coverage.Coverage, "current", classmethod(lambda cls: None))
    assert save_coverage() is False

    saved: list[str] = []

    class Running:
        def save(self) -> None:
            saved.append("saved")

    monkeypatch.setattr(coverage.Coverage, "current", classmethod(lambda cls: Running()))
    assert save_coverage() is True
    assert saved == ["saved"]
