"""What a training run reports: plain data, importable without torch (the parent session reads it)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TrainResult:
    """Per-iteration figures of one training run (identical on every rank, but ``local_losses``)."""

    #: data-parallel mean of the iteration's loss
    losses: list[float] = field(default_factory=list)
    #: this rank's own loss per iteration (before the data-parallel reduction)
    local_losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    step_times_s: list[float] = field(default_factory=list)
    #: the learning rate each iteration's optimizer step used
    learning_rates: list[float] = field(default_factory=list)
    #: zeros in the whole model's gradient per iteration (Megatron's ``num-zeros``; every rank's sum)
    num_zeros: list[float] = field(default_factory=list)
    #: this rank's memory after each iteration (see :func:`memory_in_use_bytes`)
    memory_bytes: list[int] = field(default_factory=list)
    #: the run's iteration number of the first entry (a run's second train() continues its count)
    first_iteration: int = 1

    @property
    def last_loss(self) -> float:
        return self.losses[-1]


def memory_in_use_bytes(platform: str) -> int:
    """This rank's memory in use now: CUDA's allocated bytes (Megatron's ``mem-allocated-bytes``),
    or on CPU ranks the process's resident set (0 where ``/proc`` is missing)."""
    if platform == "cuda":
        import torch

        return int(torch.cuda.memory_allocated())
    import os

    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


@dataclass(frozen=True)
class RunFacts:
    """What a run is, as the reports name it."""

    platform: str
    #: the model preset's name (a megatron-core run), or the model's class (fully_shard)
    preset: str
    #: Megatron-FSDP's sharding strategy, or "ddp" / "fsdp2"
    strategy: str
    world_size: int
    data_parallel_size: int
    #: tokens one optimizer step consumes over all data-parallel ranks (0: unknown)
    tokens_per_step: int = 0
