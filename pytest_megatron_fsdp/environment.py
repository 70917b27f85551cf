"""What a distributed test sees of its rank: plain data, importable without torch."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class DistEnv:
    """The rank's view of the running process group (the ``dist_env`` fixture's value)."""

    rank: int
    world_size: int
    local_rank: int
    #: ``"cpu"`` or ``"cuda:<local_rank>"``
    device: str
    #: ``"gloo"`` or ``"nccl"``
    backend: str
    #: ``"cpu"`` (CUDA-emulated CPU ranks) or ``"cuda"``
    platform: str
    #: a directory every rank of this session sees (removed at session end)
    shared_dir: Path
