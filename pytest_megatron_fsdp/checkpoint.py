"""The documented import path of the checkpoint API (``fsdp.checkpoint``, ``fsdp.snapshots``).

Imports torch (a rank's module); ``pytest_megatron_fsdp`` itself loads these names lazily.
"""

from .fsdp.checkpoint import (
    CheckpointError,
    SavedCheckpoint,
    checkpoint_problems,
    load_checkpoint,
    read_tracker,
    save_checkpoint,
)
from .fsdp.layout import checkpoint_size_bytes, iteration_dir_name, shard_file_name
from .fsdp.snapshots import assert_states_differ, assert_states_equal, state_differences, state_snapshot

__all__ = [
    "CheckpointError",
    "SavedCheckpoint",
    "assert_states_differ",
    "assert_states_equal",
    "checkpoint_problems",
    "checkpoint_size_bytes",
    "iteration_dir_name",
    "load_checkpoint",
    "read_tracker",
    "save_checkpoint",
    "shard_file_name",
    "state_differences",
    "state_snapshot",
]
