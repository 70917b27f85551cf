"""The on-disk layout of an fsdp_dtensor checkpoint (Megatron-Bridge's), as names, and the
errors and warnings checkpoints raise: plain Python, no torch.

::

    <dir>/latest_checkpointed_iteration.txt   the last complete iteration, e.g. "5"
    <dir>/latest_train_state.pt               the train state of that iteration (plain data)
    <dir>/iter_0000005/.metadata              torch.distributed.checkpoint (DCP) metadata
    <dir>/iter_0000005/__<rank>_0.distcp      the shards, one file per rank that saved
    <dir>/iter_0000005/train_state.pt         the train state, inside the iteration it belongs to
    <dir>/iter_0000005/digests.json           a digest of every other file of the iteration
    <dir>/iter_0000005/run_config.yaml        Megatron-Bridge's config (Bridge's checkpoints only)
    <dir>/iter_0000006.tmp-<uuid>/            a save in progress (or killed): never loaded
"""

from __future__ import annotations

import os
import re
from pathlib import Path

TRACKER_FILE = "latest_checkpointed_iteration.txt"
LATEST_TRAIN_STATE_FILE = "latest_train_state.pt"
TRAIN_STATE_FILE = "train_state.pt"
METADATA_FILE = ".metadata"
DIGESTS_FILE = "digests.json"
FORMAT = "fsdp_dtensor"
#: the entries of Megatron-Bridge's own ``train_state.pt`` (its ``TrainState.state_dict()``): Megatron-LM's
#: layout writes them beside its own, so that Bridge's loader reads a checkpoint of this plugin, and reads a
#: Bridge checkpoint's train state from them (tests/unit/test_bridge_config.py checks them against Bridge's
#: class)
BRIDGE_TRAIN_STATE_KEYS = frozenset(
    {
        "step",
        "consumed_train_samples",
        "skipped_train_samples",
        "consumed_valid_samples",
        "floating_point_operations_so_far",
        "do_train",
        "do_valid",
        "do_test",
    }
)
#: Megatron-Bridge's copy of its ``ConfigContainer`` in each iteration directory
BRIDGE_RUN_CONFIG_FILE = "run_config.yaml"
#: the directory a save writes into before it is complete: ``iter_0000006.tmp-<uuid>``
_PARTIAL_SAVE = re.compile(r"^iter_\d{7,}\.tmp-[0-9a-f]+$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be saved or loaded; the message names the path and the problem."""


class CheckpointWarning(UserWarning):
    """A checkpoint loaded with less than the usual guarantees (the message says which)."""


def iteration_dir_name(iteration: int) -> str:
    """``iter_0000005``: Megatron's name for an iteration's checkpoint directory."""
    return f"iter_{iteration:07d}"


def partial_save_dir_name(iteration: int, token: str) -> str:
    """Where a save of ``iteration`` writes until every rank is done (``token``: hex, unique)."""
    return f"{iteration_dir_name(iteration)}.tmp-{token}"


def is_partial_save_dir(name: str) -> bool:
    """Whether ``name`` is a save that never completed (or is still in progress)."""
    return _PARTIAL_SAVE.match(name) is not None


def shard_file_name(rank: int) -> str:
    """The first shard file DCP's FileSystemWriter writes for ``rank``."""
    return f"__{rank}_0.distcp"


def checkpoint_size_bytes(path: str | os.PathLike[str]) -> int:
    """Total size of the files under ``path`` (a checkpoint directory, or one file)."""
    root = Path(path)
    if root.is_file():
        return root.stat().st_size
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
