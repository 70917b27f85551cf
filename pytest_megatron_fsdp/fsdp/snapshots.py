"""Comparing a run's state: snapshots of every model and optimizer shard, exact or within tolerance.

The assertions are collective: every rank raises the same message, naming each rank's differences.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.distributed.tensor import DTensor

from .checkpoint import OPTIMIZER_METADATA, flatten_state, model_state_dict
from .collectives import gather_objects

if TYPE_CHECKING:
    from .training import TrainingRun


def state_snapshot(run: TrainingRun) -> dict[str, torch.Tensor]:
    """This rank's shards of every model parameter and every optimizer state tensor, copied.

    Keys: ``model.<name>`` and ``optimizer.<param name>.<state>``. Take it before building another
    run (a new run re-initialises Megatron's parallel state).
    """
    snapshot: dict[str, torch.Tensor] = {}
    for name, value in model_state_dict(run).items():
        if isinstance(value, torch.Tensor):
            local = value.to_local() if isinstance(value, DTensor) else value
            snapshot[f"model.{name}"] = local.detach().cpu().clone()
    optimizer = run.optimizer.sharded_state_dict(
        model_state_dict(run), is_loading=False, metadata=OPTIMIZER_METADATA
    )
    for key, value in flatten_state(optimizer["state"], "optimizer."):
        if isinstance(value, torch.Tensor):
            local = value.to_local() if isinstance(value, DTensor) else value
            snapshot[key] = local.detach().cpu().clone()
    return snapshot


def state_differences(
    expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor], rtol: float = 0.0, atol: float = 0.0
) -> list[str]:
    """Keys whose tensors differ (exactly: ``torch.equal``, when both tolerances are 0)."""
    problems = [f"{k}: missing" for k in expected if k not in actual]
    problems += [f"{k}: unexpected" for k in actual if k not in expected]
    for key in expected.keys() & actual.keys():
        a, b = expected[key], actual[key]
        if a.shape != b.shape or a.dtype != b.dtype:
            problems.append(f"{key}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}")
        elif rtol == 0 and atol == 0:
            if not torch.equal(a, b):
                diff = (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
                problems.append(f"{key}: not equal (max abs diff {diff:.3e})")
        elif not torch.allclose(a, b, rtol=rtol, atol=atol):
            diff = (a.double() - b.double()).abs().max().item()
            problems.append(f"{key}: differs beyond rtol={rtol}, atol={atol} (max abs diff {diff:.3e})")
    return sorted(problems)


def assert_states_equal(
    expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor], rtol: float = 0.0, atol: float = 0.0
) -> None:
    """Collective: every rank raises the same AssertionError naming each rank's differing tensors."""
    local = state_differences(expected, actual, rtol, atol)
    gathered = gather_objects(local)
    lines = [f"rank {r}: {p}" for r, problems in enumerate(gathered) for p in (problems or [])]
    if lines:
        shown = lines[:10] + ([f"... {len(lines) - 10} more"] if len(lines) > 10 else [])
        raise AssertionError(f"{len(lines)} state tensors differ:\n  " + "\n  ".join(shown))


def assert_states_differ(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> None:
    """Collective: raise on every rank unless some model tensor differs on some rank."""
    local = any(
        not torch.equal(expected[k], actual[k])
        for k in expected.keys() & actual.keys()
        if k.startswith("model.")
    )
    gathered = gather_objects(local)
    if not any(gathered):
        raise AssertionError("the two runs' model states are identical: the comparison would prove nothing")
