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
    #: the run's iteration number of the first entry (a run's second train() continues its count)
    first_iteration: int = 1

    @property
    def last_loss(self) -> float:
        return self.losses[-1]


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
