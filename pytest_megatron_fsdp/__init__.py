"""pytest-megatron-fsdp: functional smoke tests for Megatron-FSDP on 2 ranks, GPU or CPU.

The public API below is importable without torch or megatron; the assertion helpers and the
training run load them on first use (inside a rank).

PYTEST_DONT_REWRITE: a launched rank imports this package before its pytest starts (``python -m
pytest_megatron_fsdp.rank.entry``), too early for assertion rewriting; without this marker
pytest warns that it cannot rewrite it, which ``-W error`` turns into a failed start.
"""

from __future__ import annotations

from typing import Any

from .environment import DistEnv
from .fsdp.config import ConfigError, RunConfig, ddp_baseline, enable_megatron_fsdp, validate
from .fsdp.presets import PRESETS, ModelPreset

__version__ = "0.1.0"

#: name -> the module (below this package) that defines it, imported on first use
_LAZY = {
    "assert_last_loss_finite": "fsdp.assertions",
    "assert_loss_decreased": "fsdp.assertions",
    "assert_megatron_fsdp_sharded": "fsdp.assertions",
    "assert_matches_baseline": "fsdp.parity",
    "assert_reproducible": "fsdp.reproducibility",
    "TrainingRun": "fsdp.training",
    "record_checkpoint": "reporting.metrics",
    "checkpoint_size_bytes": "fsdp.layout",
    "CheckpointError": "fsdp.checkpoint",
    "SavedCheckpoint": "fsdp.checkpoint",
    "save_checkpoint": "fsdp.checkpoint",
    "load_checkpoint": "fsdp.checkpoint",
    "checkpoint_problems": "fsdp.checkpoint",
    "state_snapshot": "fsdp.snapshots",
    "assert_states_equal": "fsdp.snapshots",
    "assert_states_differ": "fsdp.snapshots",
    "TrainResult": "fsdp.results",
}

__all__ = [
    "ConfigError",
    "DistEnv",
    "ModelPreset",
    "PRESETS",
    "RunConfig",
    "ddp_baseline",
    "enable_megatron_fsdp",
    "validate",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
