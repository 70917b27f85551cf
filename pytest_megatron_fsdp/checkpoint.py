"""The documented import path of the checkpoint API (``fsdp.checkpoint``, ``fsdp.snapshots``).

Imports torch (a rank's module); ``pytest_megatron_fsdp`` itself loads these names lazily.
"""

from .fsdp.checkpoint import (
    CheckpointError,
    CheckpointWarning,
    SavedCheckpoint,
    checkpoint_problems,
    load_checkpoint,
    read_tracker,
    save_checkpoint,
)
from .fsdp.layout import checkpoint_size_bytes, iteration_dir_name, shard_file_name
from .fsdp.snapshots import (
    assert_states_differ,
    assert_states_equal,
    fingerprint_differences,
    state_differences,
    state_fingerprint,
    state_snapshot,
)

__all__ = [
    "CheckpointError",
    "CheckpointWarning",
    "SavedCheckpoint",
    "assert_states_differ",
    "assert_states_equal",
    "checkpoint_problems",
    "checkpoint_size_bytes",
    "fingerprint_differences",
    "iteration_dir_name",
    "load_checkpoint",
    "read_tracker",
    "save_checkpoint",
    "shard_file_name",
    "state_differences",
    "state_fingerprint",
    "state_snapshot",
]
