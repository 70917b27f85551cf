"""A run config with Megatron-Bridge's section and field names, and its validation rules.

Users think in Bridge's terms (``cfg.dist.use_megatron_fsdp``, ``cfg.ddp.data_parallel_sharding_strategy``,
``cfg.checkpoint.ckpt_format``...), so the harness speaks them. Everything here is plain data: no
torch import, so a bad config fails before any process group or model exists.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from .presets import ModelPreset, get_preset

SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
CKPT_FORMATS = ("fsdp_dtensor", "torch_dist", "torch", "zarr")


class ConfigError(ValueError):
    """A run config that upstream would reject (or that would waste a GPU hour)."""


@dataclass
class DistSection:
    use_megatron_fsdp: bool = True
    use_torch_fsdp2: bool = False
    use_tp_pp_dp_mapping: bool = False


@dataclass
class DDPSection:
    """Fields of megatron's ``DistributedDataParallelConfig`` (Bridge's ``cfg.ddp``)."""

    use_megatron_fsdp: bool = True
    data_parallel_sharding_strategy: str = "optim_grads_params"
    average_in_collective: bool = False
    use_distributed_optimizer: bool = True
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = True
    grad_reduce_in_fp32: bool = True
    check_for_nan_in_grad: bool = True
    keep_fp8_transpose_cache: bool = False
    #: any other DistributedDataParallelConfig field
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class OptimizerSection:
    optimizer: str = "adam"
    lr: float | None = None  # None: the preset's
    min_lr: float = 0.0
    weight_decay: float = 0.01
    clip_grad: float = 1.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8


@dataclass
class CheckpointSection:
    ckpt_format: str = "fsdp_dtensor"
    save: str | None = None
    load: str | None = None


@dataclass
class ModelSection:
    preset: str = "tiny"
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1
    bf16: bool | None = None  # None: the preset's
    #: fields of the preset or of megatron's TransformerConfig
    overrides: dict[str, Any] = field(default_factory=dict)


@dataclass
class TrainSection:
    train_iters: int = 10
    micro_batch_size: int | None = None  # None: the preset's
    num_microbatches: int = 1
    seq_length: int | None = None  # None: the preset's
    seed: int = 1234


@dataclass
class RunConfig:
    """Bridge-shaped configuration of one Megatron-FSDP training run."""

    dist: DistSection = field(default_factory=DistSection)
    ddp: DDPSection = field(default_factory=DDPSection)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    model: ModelSection = field(default_factory=ModelSection)
    train: TrainSection = field(default_factory=TrainSection)

    def copy(self) -> RunConfig:
        return copy.deepcopy(self)

    def resolved_preset(self) -> ModelPreset:
        """The model preset with this config's overrides applied."""
        preset = get_preset(self.model.preset)
        preset_fields = {f.name for f in dataclasses.fields(ModelPreset)}
        changes = {k: v for k, v in self.model.overrides.items() if k in preset_fields}
        extra = {k: v for k, v in self.model.overrides.items() if k not in preset_fields}
        if self.model.bf16 is not None:
            changes["bf16"] = self.model.bf16
        if self.train.seq_length is not None:
            changes["seq_length"] = self.train.seq_length
        if self.train.micro_batch_size is not None:
            changes["micro_batch_size"] = self.train.micro_batch_size
        if self.optimizer.lr is not None:
            changes["lr"] = self.optimizer.lr
        if extra:
            changes["transformer_overrides"] = {**preset.transformer_overrides, **extra}
        return preset.with_overrides(**changes)

    @property
    def model_parallel_size(self) -> int:
        m = self.model
        return m.tensor_model_parallel_size * m.pipeline_model_parallel_size * m.context_parallel_size

    def set(self, dotted: str, value: Any) -> None:
        """Set ``section.field`` (``ddp.extra`` and ``model.overrides`` take unknown fields)."""
        section_name, _, name = dotted.partition(".")
        section = getattr(self, section_name, None)
        if section is None or not dataclasses.is_dataclass(section) or not name:
            raise ConfigError(
                f"unknown config field {dotted!r}: use <section>.<field> with a section among "
                f"{', '.join(f.name for f in dataclasses.fields(self))}"
            )
        known = {f.name for f in dataclasses.fields(section)}
        if name in known:
            setattr(section, name, value)
        elif isinstance(section, DDPSection):
            section.extra[name] = value
        elif isinstance(section, ModelSection):
            section.overrides[name] = value
        else:
            raise ConfigError(
                f"unknown config field {dotted!r}; {section_name} has: {', '.join(sorted(known))}"
            )


def validate(cfg: RunConfig, world_size: int | None = None) -> list[str]:
    """Apply upstream's rules (Bridge ``training/config.py``, MCore); raise on the first violation.

    Returns warnings (rules where upstream only warns). Pure: safe to run before any process group.
    """
    warnings: list[str] = []
    if cfg.dist.use_megatron_fsdp and cfg.dist.use_torch_fsdp2:
        raise ConfigError(
            "dist.use_megatron_fsdp=True and dist.use_torch_fsdp2=True are mutually exclusive: "
            "set one of them to False"
        )
    strategy = cfg.ddp.data_parallel_sharding_strategy
    if strategy not in SHARDING_STRATEGIES:
        raise ConfigError(
            f"ddp.data_parallel_sharding_strategy={strategy!r} is not a sharding strategy; "
            f"choose one of: {', '.join(SHARDING_STRATEGIES)}"
        )
    if cfg.checkpoint.ckpt_format not in CKPT_FORMATS:
        raise ConfigError(
            f"checkpoint.ckpt_format={cfg.checkpoint.ckpt_format!r} is unknown; "
            f"choose one of: {', '.join(CKPT_FORMATS)}"
        )
    fsdp = cfg.dist.use_megatron_fsdp or cfg.ddp.use_megatron_fsdp
    if fsdp and cfg.dist.use_tp_pp_dp_mapping:
        raise ConfigError(
            "dist.use_tp_pp_dp_mapping=True is not supported with Megatron-FSDP: set it to False"
        )
    if cfg.dist.use_megatron_fsdp != cfg.ddp.use_megatron_fsdp:
        raise ConfigError(
            f"dist.use_megatron_fsdp={cfg.dist.use_megatron_fsdp} but "
            f"ddp.use_megatron_fsdp={cfg.ddp.use_megatron_fsdp}: Bridge needs both set alike "
            "(use enable_megatron_fsdp(cfg) to set them together)"
        )
    if fsdp and (cfg.checkpoint.save or cfg.checkpoint.load) and cfg.checkpoint.ckpt_format != "fsdp_dtensor":
        raise ConfigError(
            f"checkpoint.ckpt_format={cfg.checkpoint.ckpt_format!r} with checkpoint.save/load set: "
            "Megatron FSDP only supports fsdp_dtensor checkpoint format; "
            "set checkpoint.ckpt_format='fsdp_dtensor'"
        )
    get_preset(cfg.model.preset)  # raises with the choices
    for name in (
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
        "context_parallel_size",
    ):
        size = getattr(cfg.model, name)
        if not isinstance(size, int) or size < 1:
            raise ConfigError(f"model.{name}={size!r} must be a positive integer")
    if world_size is not None and world_size % cfg.model_parallel_size:
        raise ConfigError(
            f"world size {world_size} is not divisible by tp*pp*cp={cfg.model_parallel_size} "
            f"(model.tensor_model_parallel_size={cfg.model.tensor_model_parallel_size}, "
            f"pipeline={cfg.model.pipeline_model_parallel_size}, context={cfg.model.context_parallel_size})"
        )
    if cfg.train.train_iters < 1:
        raise ConfigError(f"train.train_iters={cfg.train.train_iters} must be at least 1")
    if cfg.train.num_microbatches < 1:
        raise ConfigError(f"train.num_microbatches={cfg.train.num_microbatches} must be at least 1")
    if fsdp and cfg.ddp.average_in_collective:
        warnings.append(
            "ddp.average_in_collective=True is not supported with Megatron-FSDP; "
            "switching it to False (as Megatron does)"
        )
    if fsdp and not cfg.ddp.use_distributed_optimizer:
        warnings.append(
            "ddp.use_distributed_optimizer=False: Megatron-FSDP requires the distributed optimizer; "
            "switching it on (as Megatron does)"
        )
    return warnings


def enable_megatron_fsdp(cfg: RunConfig) -> RunConfig:
    """The seed's minimal override: what Bridge users set to turn Megatron-FSDP on."""
    cfg.dist.use_megatron_fsdp = True
    cfg.ddp.use_megatron_fsdp = True
    cfg.ddp.data_parallel_sharding_strategy = "optim_grads_params"
    cfg.ddp.average_in_collective = False
    cfg.checkpoint.ckpt_format = "fsdp_dtensor"
    return cfg
