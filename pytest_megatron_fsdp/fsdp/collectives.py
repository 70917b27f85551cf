"""The collectives the domain's checks and runs use: gather a value from every rank, agree on
problems, and average a figure over the data-parallel ranks.

Every rank calls them at the same point (they are collectives on the default process group, or the
group given), so every rank sees every rank's value and reaches the same verdict; a check that only
one rank could fail would leave the others passing or waiting.
"""

from __future__ import annotations

from typing import Any


def gather_objects(value: Any) -> list[Any]:
    """``value`` from every rank, in rank order, on every rank (``all_gather_object``)."""
    import torch.distributed as dist

    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def gather_problems(local_problem: str | None) -> list[str]:
    """Every rank's problem (None: none), on every rank; the same problem seen by several ranks once."""
    problems: list[str] = []
    for problem in gather_objects(local_problem):
        if problem is not None and problem not in problems:
            problems.append(problem)
    return problems


def data_parallel_mean(value: float, device: str, group: Any = None) -> float:
    """The mean of ``value`` over the ranks of ``group`` (default: every rank), in float64, on every
    one of them (one ``all_reduce``): a run's loss as Megatron logs it."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, group=group)
    return float(t.item()) / dist.get_world_size(group)
