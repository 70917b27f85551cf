"""Shared keys and small records the plugin's modules pass through ``config.stash``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

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


@dataclass(frozen=True)
class RunRecord:
    """What the session summary shows of one training run."""

    nodeid: str
    platform: str
    preset: str
    strategy: str
    iterations: int
    first_loss: float
    last_loss: float
    ms_per_step: float

    @classmethod
    def from_result(cls, nodeid: str, run: TrainingRun, result: TrainResult) -> RunRecord:
        times = result.step_times_s[1:] or result.step_times_s  # the first step warms up
        return cls(
            nodeid=nodeid,
            platform=run.env.platform,
            preset=run.preset.name,
            strategy=run.cfg.ddp.data_parallel_sharding_strategy if run.cfg.dist.use_megatron_fsdp else "ddp",
            iterations=len(result.losses),
            first_loss=result.losses[0],
            last_loss=result.losses[-1],
            ms_per_step=1000 * sum(times) / len(times),
        )
