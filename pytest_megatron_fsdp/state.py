"""Shared keys and small records the plugin's modules pass through ``config.stash``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from .training import TrainingRun, TrainResult

PLATFORM = pytest.StashKey["PlatformChoice"]()
SESSION = pytest.StashKey["RankSession | None"]()
RUN_RECORDS = pytest.StashKey["list[RunRecord]"]()
OPTIONS = pytest.StashKey["dict[str, Any]"]()

MARKER = "distributed"
DEFAULT_WORLD_SIZE = 2


@dataclass(frozen=True)
class DistributedMarker:
    world_size: int = DEFAULT_WORLD_SIZE
    tp: int = 1
    pp: int = 1
    cp: int = 1
    timeout: float | None = None


def _marker_kwargs(
    world_size: int = DEFAULT_WORLD_SIZE,
    *,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    timeout: float | None = None,
) -> DistributedMarker:
    for name, value in (("world_size", world_size), ("tp", tp), ("pp", pp), ("cp", cp)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"distributed marker: {name}={value!r} must be a positive integer")
    return DistributedMarker(world_size, tp, pp, cp, timeout)


def distributed_marker(item: pytest.Item) -> DistributedMarker:
    """The test's ``@pytest.mark.distributed(...)`` as data (defaults when unmarked)."""
    marker = item.get_closest_marker(MARKER)
    if marker is None:
        return DistributedMarker()
    try:
        return _marker_kwargs(*marker.args, **marker.kwargs)
    except TypeError as exc:
        raise pytest.UsageError(
            f"{item.nodeid}: bad @pytest.mark.distributed arguments ({exc}); "
            "use distributed(world_size=2, tp=1, pp=1, cp=1, timeout=None)"
        ) from None
    except ValueError as exc:
        raise pytest.UsageError(f"{item.nodeid}: {exc}") from None


#: checkpoint figures a test recorded before its first training run had a record (rank 0 only)
PENDING_CHECKPOINTS = pytest.StashKey["dict[str, dict[str, Any]]"]()


@dataclass(frozen=True)
class RunRecord:
    """One training run's figures, as the summary, the JSON report and JUnit show them.

    Plain JSON-serialisable data (NaN included: Python's json writes and reads it), because a
    launched rank set sends it to the parent session as ``record.__dict__`` and the parent rebuilds
    it with ``RunRecord(**data)``. Fields added later must keep defaults, so both sides agree.
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
    checkpoint_bytes: int | None = None
    checkpoint_save_s: float | None = None
    checkpoint_load_s: float | None = None

    @classmethod
    def from_result(
        cls,
        nodeid: str,
        run: TrainingRun,
        result: TrainResult,
        *,
        step_times_s: list[float] | None = None,
        peak_memory_bytes: int | None = None,
        peak_memory_kind: str = "",
        checkpoint: dict[str, Any] | None = None,
    ) -> RunRecord:
        """``step_times_s``: the per-step times reduced across ranks (default: this rank's)."""
        steps = list(result.step_times_s if step_times_s is None else step_times_s)
        times = steps[1:] or steps  # the first step warms up
        ms_per_step = 1000 * sum(times) / len(times) if times else float("nan")
        dp = run.env.world_size // run.cfg.model_parallel_size
        tokens = run.preset.micro_batch_size * run.preset.seq_length * run.cfg.train.num_microbatches * dp
        return cls(
            nodeid=nodeid,
            platform=run.env.platform,
            preset=run.preset.name,
            strategy=run.cfg.ddp.data_parallel_sharding_strategy if run.cfg.dist.use_megatron_fsdp else "ddp",
            iterations=len(result.losses),
            first_loss=result.losses[0],
            last_loss=result.losses[-1],
            ms_per_step=ms_per_step,
            world_size=run.env.world_size,
            data_parallel_size=dp,
            tokens_per_step=tokens,
            tokens_per_s=tokens / (ms_per_step / 1000) if ms_per_step > 0 else float("nan"),
            losses=list(result.losses),
            grad_norms=list(result.grad_norms),
            step_times_s=steps,
            peak_memory_bytes=peak_memory_bytes,
            peak_memory_kind=peak_memory_kind,
            **{f"checkpoint_{k}": v for k, v in (checkpoint or {}).items()},
        )
