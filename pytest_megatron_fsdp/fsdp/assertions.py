"""Assertions a distributed test makes about a training run.

Each one is collective: every rank calls it, every rank sees every rank's figures, and every rank
raises the same message, which names the iteration, the rank and the value. (A check that only
rank 0 could fail would leave rank 1 passing the same test.)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

from .collectives import gather_objects
from .results import TrainResult


def assert_last_loss_finite(result: TrainResult) -> None:
    """The last iteration's loss is finite on every rank (each rank's own loss, before reduction).

    The failure names the last iteration's bad ranks and values, and where it went wrong first:
    the first iteration whose loss was not finite, on which ranks (a NaN at iteration 2 is
    what to debug, not the NaN it is still at iteration 10).
    """
    _check_is_result(result, "assert_last_loss_finite")
    per_rank = gather_objects(result.local_losses)
    last = result.first_iteration + len(result.local_losses) - 1
    bad = [(rank, losses[-1]) for rank, losses in enumerate(per_rank) if not math.isfinite(losses[-1])]
    if not bad:
        return
    first = {rank: first_non_finite(losses) for rank, losses in enumerate(per_rank)}
    start = min(i for i in first.values() if i is not None)
    at_start = [(rank, per_rank[rank][start]) for rank, i in first.items() if i == start]
    later = [
        f"rank {rank} from iteration {result.first_iteration + i}"
        for rank, i in first.items()
        if i not in (None, start)
    ]
    fine = [(rank, losses[-1]) for rank, losses in enumerate(per_rank) if math.isfinite(losses[-1])]
    raise AssertionError(
        f"loss is not finite at the last iteration ({last}): "
        + ", ".join(f"rank {rank}: loss={value}" for rank, value in bad)
        + f"; first non-finite at iteration {result.first_iteration + start}: "
        + ", ".join(f"rank {rank}: loss={value}" for rank, value in at_start)
        + (f" ({', '.join(later)})" if later else "")
        + (
            "; finite at the last iteration: "
            + ", ".join(f"rank {rank}: loss={value:.6g}" for rank, value in fine)
            if fine
            else ""
        )
    )


def _check_is_result(result: object, assertion: str) -> None:
    """One clear line where a test passes the run (or anything else) instead of what its
    ``train()`` returned: every rank passes the same kind of object, so every rank raises alike."""
    if not isinstance(result, TrainResult):
        raise TypeError(
            f"{assertion} takes the TrainResult that train() returns, not {type(result).__name__}: "
            f"result = run.train(); {assertion}(result)"
        )


def first_non_finite(values: list[float]) -> int | None:
    """Index of the first value that is NaN or infinite (None: all finite)."""
    return next((i for i, value in enumerate(values) if not math.isfinite(value)), None)


def assert_loss_decreased(result: TrainResult, min_relative_drop: float = 0.02) -> None:
    """The model learned: the last iteration's loss is below the first by ``min_relative_drop``.

    Uses the data-parallel mean loss, identical on every rank. The margin keeps noise (a frozen
    model's loss still moves a little from batch to batch) from passing as learning.
    """
    _check_is_result(result, "assert_loss_decreased")
    first, last = result.losses[0], result.losses[-1]
    target = first * (1.0 - min_relative_drop)
    last_iteration = result.first_iteration + len(result.losses) - 1
    if not (math.isfinite(last) and last <= target):
        raise AssertionError(
            f"the model did not learn: loss went {first:.4f} (iteration {result.first_iteration}) -> "
            f"{last:.4f} (iteration {last_iteration}); required <= {target:.4f} "
            f"(a {min_relative_drop:.0%} drop). Loss per iteration: "
            + ", ".join(f"{x:.4f}" for x in result.losses)
        )


def sharded_fraction(model: Any) -> tuple[Fraction, int]:
    """(elements this rank holds, elements of the whole model) over the model's DTensor state.

    Copies count once: a shard replicated along a mesh dimension counts on the ranks at
    coordinate 0 of it only, and a DTensor whose mesh spans part of the world (a norm's weight,
    sharded over the data-parallel ranks of one tensor-parallel rank, exists once per
    tensor-parallel rank) counts as mesh size / world of its elements. So the ranks' counts add
    up to the model's size exactly when no element is held twice.
    """
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Replicate

    world = dist.get_world_size()
    local, total = Fraction(0), 0
    for value in model.state_dict().values():
        if isinstance(value, DTensor):
            total += value.numel()
            mesh = value.device_mesh
            coordinate: Sequence[int] = mesh.get_coordinate() or []
            if all(coordinate[i] == 0 for i, p in enumerate(value.placements) if isinstance(p, Replicate)):
                local += Fraction(value.to_local().numel() * mesh.size(), world)
    return local, total


def assert_megatron_fsdp_sharded(model: Any, tolerance: float = 0.1) -> None:
    """``model`` is Megatron-FSDP's wrapper and each rank holds ~1/world of it, no element twice.

    Plain DDP fails this: it keeps whole tensors on every rank and no DTensors.
    """
    import torch.distributed as dist

    from .versions import megatron_fsdp_wrapper_types

    wrappers = megatron_fsdp_wrapper_types()
    if not isinstance(model, wrappers):
        raise AssertionError(
            f"model is {type(model).__module__}.{type(model).__name__}, not megatron-core's "
            f"FullyShardedDataParallel ({', '.join(w.__name__ for w in wrappers)})"
        )
    local, total = sharded_fraction(model)
    per_rank = gather_objects(local)
    world = dist.get_world_size()
    if total == 0:
        raise AssertionError("the Megatron-FSDP model's state_dict holds no DTensor shards")
    if sum(per_rank) != total:
        raise AssertionError(
            f"shards do not partition the model: ranks hold {[f'{float(c):g}' for c in per_rank]} "
            f"elements, sum {float(sum(per_rank)):g} != {total} in the model"
        )
    for rank, count in enumerate(per_rank):
        fraction = count / total
        if abs(fraction - 1 / world) > tolerance / world:
            raise AssertionError(
                f"rank {rank} holds {float(count):g} of {total} elements ({fraction:.1%}); "
                f"expected about {1 / world:.1%} with {world} ranks"
            )
