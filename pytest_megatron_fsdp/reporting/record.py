"""One training run's figures: plain data, no torch, no pytest."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RunRecord:
    """One training run's figures, as the summary, the JSON report and JUnit show them.

    Plain JSON-serialisable data (NaN included: Python's json writes and reads it): it rides on
    the test's report as ``dataclasses.asdict(record)`` (to a plain-mode parent, an xdist controller)
    and is rebuilt with ``RunRecord(**data)``. Fields added later must keep defaults, so both sides agree.
    """

    nodeid: str
    platform: str
    preset: str
    strategy: str
    iterations: int
    first_loss: float
    last_loss: float
    #: mean step time without the first (warm-up) step, slowest rank per step
    ms_per_step: float
    world_size: int = 0
    data_parallel_size: int = 0
    #: micro_batch_size x seq_length x num_microbatches x data-parallel size
    tokens_per_step: int = 0
    tokens_per_s: float = 0.0
    #: data-parallel mean loss per iteration
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    #: per iteration, the slowest rank's step time
    step_times_s: list[float] = field(default_factory=list)
    #: max over ranks; see ``peak_memory_kind`` for what was measured
    peak_memory_bytes: int | None = None
    #: "max_rss" (CPU ranks: process peak resident set since start) or "cuda_max_allocated"
    peak_memory_kind: str = ""
    #: the run's iteration number of the first entry (a run's second train() continues its count)
    first_iteration: int = 1
    #: zeros in the model's gradient per iteration (Megatron's ``num-zeros``; max over ranks)
    num_zeros: list[float] = field(default_factory=list)
    #: per iteration, the most memory in use on any rank after the step (CUDA allocated bytes, on
    #: CPU ranks the resident set): Megatron's ``mem-allocated-bytes``
    memory_bytes: list[int] = field(default_factory=list)
    checkpoint_bytes: int | None = None
    checkpoint_save_s: float | None = None
    checkpoint_load_s: float | None = None
