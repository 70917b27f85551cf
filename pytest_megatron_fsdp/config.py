"""The documented import path of the run config (``fsdp.config``). Imports no torch."""

from .fsdp.config import (
    ConfigError,
    ConfigWarning,
    RunConfig,
    apply_perf_harness_overrides,
    disable_megatron_fsdp,
    enable_megatron_fsdp,
    fix_checkpoint_format,
    recipe_fixup,
    validate,
)

__all__ = [
    "ConfigError",
    "ConfigWarning",
    "RunConfig",
    "apply_perf_harness_overrides",
    "disable_megatron_fsdp",
    "enable_megatron_fsdp",
    "fix_checkpoint_format",
    "recipe_fixup",
    "validate",
]
