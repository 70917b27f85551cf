"""pytest-megatron-fsdp: functional smoke tests for Megatron-FSDP on 2 ranks, GPU or CPU.

The public API below is importable without torch or megatron; the assertion helpers and the
training run load them on first use (inside a rank).
"""

from __future__ import annotations

from typing import Any

from .config import ConfigError, RunConfig, enable_megatron_fsdp, validate
from .environment import DistEnv
from .presets import PRESETS, ModelPreset

__version__ = "0.1.0"

_LAZY = {
    "assert_last_loss_finite": "assertions",
    "assert_loss_decreased": "assertions",
    "assert_megatron_fsdp_sharded": "assertions",
    "TrainingRun": "training",
    "record_checkpoint": "metrics",
    "checkpoint_size_bytes": "metrics",
    "CheckpointError": "checkpoint",
    "SavedCheckpoint": "checkpoint",
    "save_checkpoint": "checkpoint",
    "load_checkpoint": "checkpoint",
    "checkpoint_problems": "checkpoint",
    "state_snapshot": "checkpoint",
    "assert_states_equal": "checkpoint",
    "assert_states_differ": "checkpoint",
    "TrainResult": "results",
}

__all__ = [
    "ConfigError",
    "DistEnv",
    "ModelPreset",
    "PRESETS",
    "RunConfig",
    "enable_megatron_fsdp",
    "validate",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
