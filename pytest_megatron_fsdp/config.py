"""The documented import path of the run config (``fsdp.config``). Imports no torch."""

from .fsdp.config import (
    RULES,
    ConfigError,
    ConfigWarning,
    Rule,
    RunConfig,
    apply_perf_harness_overrides,
    ddp_baseline,
    disable_megatron_fsdp,
    enable_megatron_fsdp,
    findings,
    fix_checkpoint_format,
    recipe_fixup,
    starting_config,
    use_megatron_ddp,
    validate,
)

__all__ = [
    "RULES",
    "ConfigError",
    "ConfigWarning",
    "Rule",
    "RunConfig",
    "apply_perf_harness_overrides",
    "ddp_baseline",
    "disable_megatron_fsdp",
    "enable_megatron_fsdp",
    "findings",
    "fix_checkpoint_format",
    "recipe_fixup",
    "starting_config",
    "use_megatron_ddp",
    "validate",
]
