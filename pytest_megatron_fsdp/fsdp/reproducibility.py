"""Determinism: the same run, trained twice in one test, must give the same losses and state.

On CPU ranks every kernel and every gloo reduction is deterministic, so the comparison is
bitwise. On GPUs cuBLAS, attention kernels and NCCL may reduce in another order from one run to
the next, so losses and tensors are compared with a relative tolerance (``GPU_RTOL``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

from .collectives import gather_objects
from .snapshots import state_differences, state_snapshot

if TYPE_CHECKING:
    from .training import TrainingRun

#: relative tolerance for losses and state on GPUs (kernels and NCCL may reorder sums)
GPU_RTOL = 1e-4


def _first_loss_difference(first: list[float], second: list[float], rtol: float) -> str | None:
    if len(first) != len(second):
        return f"the runs trained {len(first)} and {len(second)} iterations"
    for iteration, (a, b) in enumerate(zip(first, second, strict=True), start=1):
        same = (
            (a == b or (math.isnan(a) and math.isnan(b))) if rtol == 0 else math.isclose(a, b, rel_tol=rtol)
        )
        if not same:
            return f"loss differs first at iteration {iteration}: {a!r} then {b!r}"
    return None


def assert_reproducible(
    build_run: Callable[[], TrainingRun], iterations: int, rtol: float | None = None
) -> None:
    """Collective: build and train a run twice (``build_run()`` each time, e.g.
    ``lambda: megatron_fsdp_run(run_config)``) and compare every iteration's loss and the final
    model and optimizer state; raise the same AssertionError on every rank naming the first
    iteration, or the first tensor per rank, that differs.

    ``rtol``: default 0 (bitwise) on CPU ranks, :data:`GPU_RTOL` on GPUs.
    """
    results, snapshots = [], []
    for _ in range(2):
        run = build_run()
        results.append(run.train(iterations))
        snapshots.append(state_snapshot(run))
        platform = run.env.platform
        run.close()
    if rtol is None:
        rtol = 0.0 if platform == "cpu" else GPU_RTOL
    loss_problem = _first_loss_difference(results[0].losses, results[1].losses, rtol)
    if loss_problem is not None:
        raise AssertionError(f"not reproducible: {loss_problem} (rtol={rtol})")
    per_rank = gather_objects(state_differences(snapshots[0], snapshots[1], rtol=rtol))
    first = [f"rank {rank}: {problems[0]}" for rank, problems in enumerate(per_rank) if problems]
    if first:
        raise AssertionError(
            f"not reproducible: equal losses, but the final state differs (rtol={rtol}); first tensor "
            "per rank: " + "; ".join(first)
        )
