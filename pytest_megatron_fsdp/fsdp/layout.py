"""The on-disk layout of an fsdp_dtensor checkpoint (Megatron-Bridge's), as names: no torch.

::

    <dir>/latest_checkpointed_iteration.txt   the last complete iteration, e.g. "5"
    <dir>/latest_train_state.pt               the train state of that iteration (plain data)
    <dir>/iter_0000005/.metadata              torch.distributed.checkpoint (DCP) metadata
    <dir>/iter_0000005/__<rank>_0.distcp      one shard file per rank
    <dir>/iter_0000005/train_state.pt         the train state, inside the iteration it belongs to
"""

from __future__ import annotations

import os
from pathlib import Path

TRACKER_FILE = "latest_checkpointed_iteration.txt"
LATEST_TRAIN_STATE_FILE = "latest_train_state.pt"
TRAIN_STATE_FILE = "train_state.pt"
METADATA_FILE = ".metadata"
FORMAT = "fsdp_dtensor"


def iteration_dir_name(iteration: int) -> str:
    """``iter_0000005``: Megatron's name for an iteration's checkpoint directory."""
    return f"iter_{iteration:07d}"


def shard_file_name(rank: int) -> str:
    """The shard file DCP's FileSystemWriter writes for ``rank`` (one file per rank)."""
    return f"__{rank}_0.distcp"


def checkpoint_size_bytes(path: str | os.PathLike[str]) -> int:
    """Total size of the files under ``path`` (a checkpoint directory, or one file)."""
    root = Path(path)
    if root.is_file():
        return root.stat().st_size
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
