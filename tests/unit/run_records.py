"""A training-run record with plausible values for the report tests (test_report.py,
test_postmortem_cli.py): only the fields a test names differ."""

from __future__ import annotations

from typing import Any

from pytest_megatron_fsdp.reporting.record import RunRecord


def run_record(losses: list[float], nodeid: str = "t.py::test_a", **changes: Any) -> RunRecord:
    fields: dict[str, Any] = dict(
        nodeid=nodeid,
        platform="cpu",
        preset="tiny",
        strategy="optim_grads_params",
        iterations=len(losses),
        first_loss=losses[0],
        last_loss=losses[-1],
        ms_per_step=40.0,
        world_size=2,
        data_parallel_size=2,
        tokens_per_step=128,
        tokens_per_s=3200.0,
        losses=list(losses),
        grad_norms=[1.5] * len(losses),
        step_times_s=[0.04] * len(losses),
        peak_memory_bytes=400 * 2**20,
        peak_memory_kind="max_rss",
    )
    fields.update(changes)
    return RunRecord(**fields)
