"""A run config with Megatron-Bridge's section and field names, and its validation rules.

Users think in Bridge's terms (``cfg.dist.use_megatron_fsdp``, ``cfg.ddp.data_parallel_sharding_strategy``,
``cfg.checkpoint.ckpt_format``...), so the harness speaks them. Everything here is plain data: no
torch import, so a bad config fails before any process group or model exists.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from . import versions
from .presets import ModelPreset, TrainingRecipe, get_preset

SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
CKPT_FORMATS = ("fsdp_dtensor", "torch_dist", "torch", "zarr")
#: formats Megatron can save asynchronously (Megatron-LM arguments.py)
ASYNC_CKPT_FORMATS = ("torch_dist", "fsdp_dtensor")
BACKENDS = ("nccl", "gloo")
RECOMPUTE_GRANULARITIES = ("full", "selective")
RECOMPUTE_METHODS = ("uniform", "block")
#: HSDP's outer data-parallel strategy (megatron's DistributedDataParallelConfig)
OUTER_SHARDING_STRATEGIES = ("no_shard", "optim")
OPTIMIZERS = ("adam", "sgd")
#: OptimizerParamScheduler's
LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WD_INCR_STYLES = ("constant", "linear", "cosine")
WSD_DECAY_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")


class ConfigError(ValueError):
    """A run config that upstream would reject (or that would waste a GPU hour)."""


class ConfigWarning(UserWarning):
    """A config that upstream accepts with a warning or adjusts itself (the message says how)."""


@dataclass
class DistSection:
    """Bridge's ``cfg.dist``."""

    use_megatron_fsdp: bool = True
    use_torch_fsdp2: bool = False
    use_tp_pp_dp_mapping: bool = False
    #: None: the platform's (nccl on GPUs, gloo on CPU ranks); the session's process group must match
    backend: str | None = None


@dataclass
class DDPSection:
    """Fields of megatron's ``DistributedDataParallelConfig`` (Bridge's ``cfg.ddp``)."""

    use_megatron_fsdp: bool = True
    data_parallel_sharding_strategy: str = "optim_grads_params"
    average_in_collective: bool = False
    use_distributed_optimizer: bool = True
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = True
    align_param_gather: bool = False
    grad_reduce_in_fp32: bool = True
    check_for_nan_in_grad: bool = True
    check_for_large_grads: bool = False
    keep_fp8_transpose_cache: bool = False
    bucket_size: int | None = None
    num_distributed_optimizer_instances: int = 1
    suggested_communication_unit_size: int | None = None
    fsdp_double_buffer: bool = False
    nccl_ub: bool = False
    outer_dp_sharding_strategy: str = "no_shard"
    #: None: megatron's default (True: the average fused into the reduction as NCCL's PREMUL_SUM,
    #: which the CUDA-on-CPU emulation provides over gloo)
    gradient_reduce_div_fusion: bool | None = None
    #: Megatron-FSDP's implementation, where megatron-core's FullyShardedDataParallel is a factory
    #: (Megatron-LM PR #5865): 1, or 2 (V2: its own FullyShardedOptimizer, which refuses the
    #: distributed optimizer, so ``use_distributed_optimizer`` is not used with 2)
    megatron_fsdp_version: int = 1
    #: any other DistributedDataParallelConfig field (checked against megatron's when the run is built)
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class OptimizerSection:
    """Bridge's ``cfg.optimizer`` (megatron's ``OptimizerConfig``). None: the preset's recipe
    (``fsdp.presets.TrainingRecipe``)."""

    optimizer: str = "adam"
    lr: float | None = None
    min_lr: float | None = None
    weight_decay: float | None = None
    #: clip the global gradient norm to this (0: no clipping); applied on every platform
    clip_grad: float | None = None
    adam_beta1: float | None = None
    adam_beta2: float | None = None
    adam_eps: float | None = None


@dataclass
class SchedulerSection:
    """Bridge's ``cfg.scheduler``: Megatron's ``OptimizerParamScheduler``, stepped once per
    iteration by the global batch size (its steps count samples, as in Bridge). None: the preset's
    recipe (``fsdp.presets.TrainingRecipe``)."""

    #: constant, linear, cosine, inverse-square-root or WSD
    lr_decay_style: str | None = None
    #: None: train.train_iters
    lr_decay_iters: int | None = None
    lr_warmup_iters: int | None = None
    lr_warmup_fraction: float | None = None
    lr_warmup_init: float | None = None
    #: None: optimizer.weight_decay
    start_weight_decay: float | None = None
    end_weight_decay: float | None = None
    #: constant, linear or cosine
    weight_decay_incr_style: str | None = None
    #: linear, cosine, exponential or minus_sqrt (the WSD schedule's annealing)
    lr_wsd_decay_style: str | None = None
    lr_wsd_decay_iters: int | None = None
    override_opt_param_scheduler: bool | None = None
    use_checkpoint_opt_param_scheduler: bool | None = None


@dataclass
class CheckpointSection:
    ckpt_format: str = "fsdp_dtensor"
    save: str | None = None
    load: str | None = None
    async_save: bool = False


@dataclass
class ModelSection:
    """The preset plus Bridge's ``cfg.model`` (TransformerConfig) fields the harness knows by name."""

    preset: str = "tiny"
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1
    bf16: bool | None = None  # None: the preset's
    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    cpu_offloading: bool = False
    cpu_offloading_num_layers: int = 0
    init_model_with_meta_device: bool = False
    #: fields of the preset or of megatron's TransformerConfig (checked when the run is built)
    overrides: dict[str, Any] = field(default_factory=dict)


@dataclass
class TrainSection:
    train_iters: int = 10
    micro_batch_size: int | None = None  # None: the preset's
    #: micro-batches per rank per step (gradient accumulation); None: the preset's
    num_microbatches: int | None = None
    #: None: micro_batch_size * num_microbatches * data-parallel size; if set, it must equal that
    global_batch_size: int | None = None
    seq_length: int | None = None  # None: the preset's
    seed: int = 1234


#: TransformerConfig fields ModelSection carries by name (passed through when the model is built)
TRANSFORMER_FIELDS = (
    "recompute_granularity",
    "recompute_method",
    "recompute_num_layers",
    "cpu_offloading",
    "cpu_offloading_num_layers",
    "init_model_with_meta_device",
)


def _annotation_types(annotation: str) -> tuple[type, ...]:
    """Types named by a (string) annotation like ``int | None`` (``from __future__ import annotations``)."""
    names = {"bool": bool, "int": int, "float": float, "str": str, "None": type(None)}
    parts = [p.strip() for p in annotation.split("|")]
    if any(p not in names for p in parts):
        return ()  # dicts and the like: not settable by value
    return tuple(names[p] for p in parts)


_TRUE = ("true", "yes", "on")
_FALSE = ("false", "no", "off")


def parse_value(text: str, types: tuple[type, ...] = ()) -> Any:
    """A command-line value as Python: ``true``/``false``, ``none``, numbers, else the string.

    ``types`` (from the field's annotation) narrows it; empty means "guess" (free-form fields).
    """
    raw = text.strip()
    low = raw.lower()
    guess = not types
    if low in ("none", "null") and (guess or type(None) in types):
        return None
    if bool in types or guess:
        if low in _TRUE or (bool in types and low == "1"):
            return True
        if low in _FALSE or (bool in types and low == "0"):
            return False
    for number in (int, float):
        if number in types or guess:
            try:
                return number(raw)
            except ValueError:
                pass  # not this kind of number; the next type may fit
    if str in types or guess:
        return raw
    raise ValueError(" or ".join("none" if t is type(None) else t.__name__ for t in types))


def _check_type(dotted: str, value: Any, types: tuple[type, ...]) -> Any:
    if not types:
        return value
    if isinstance(value, bool) and bool not in types:
        ok = False
    elif isinstance(value, int) and not isinstance(value, bool) and float in types and int not in types:
        return float(value)
    else:
        ok = isinstance(value, types) and not (isinstance(value, bool) and bool not in types)
    if not ok:
        expected = " or ".join("None" if t is type(None) else t.__name__ for t in types)
        raise ConfigError(f"{dotted}={value!r} has the wrong type: set it to {expected}")
    return value


@dataclass
class RunConfig:
    """Bridge-shaped configuration of one Megatron-FSDP training run."""

    dist: DistSection = field(default_factory=DistSection)
    ddp: DDPSection = field(default_factory=DDPSection)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    scheduler: SchedulerSection = field(default_factory=SchedulerSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    model: ModelSection = field(default_factory=ModelSection)
    train: TrainSection = field(default_factory=TrainSection)

    def copy(self) -> RunConfig:
        return copy.deepcopy(self)

    def resolved_preset(self) -> ModelPreset:
        """The model preset with this config's overrides applied."""
        preset = get_preset(self.model.preset)
        preset_fields = _PRESET_OVERRIDABLE
        changes = {k: v for k, v in self.model.overrides.items() if k in preset_fields}
        extra = {k: v for k, v in self.model.overrides.items() if k not in preset_fields}
        if self.model.bf16 is not None:
            changes["bf16"] = self.model.bf16
        for name in ("seq_length", "micro_batch_size", "num_microbatches"):
            if getattr(self.train, name) is not None:
                changes[name] = getattr(self.train, name)
        if extra:
            changes["transformer_overrides"] = {**preset.transformer_overrides, **extra}
        changes["recipe"] = self.resolved_recipe(preset.recipe)
        return preset.with_overrides(**changes)

    def resolved_recipe(self, base: TrainingRecipe | None = None) -> TrainingRecipe:
        """The optimizer and schedule this config trains with: the preset's recipe (or ``base``)
        with every ``optimizer.*`` / ``scheduler.*`` field this config sets."""
        recipe = get_preset(self.model.preset).recipe if base is None else base
        changes = {
            name: getattr(getattr(self, section), name)
            for name, section in RECIPE_FIELDS.items()
            if getattr(getattr(self, section), name) is not None
        }
        return dataclasses.replace(recipe, **changes)

    @property
    def model_parallel_size(self) -> int:
        m = self.model
        return m.tensor_model_parallel_size * m.pipeline_model_parallel_size * m.context_parallel_size

    @property
    def uses_megatron_fsdp(self) -> bool:
        """Megatron-FSDP is on when either flag says so (Bridge's perf harness sets only ``ddp``'s)."""
        return self.dist.use_megatron_fsdp or self.ddp.use_megatron_fsdp

    def set(self, dotted: str, value: Any) -> None:
        """Set ``section.field`` to ``value``, checking the name and the value's type.

        ``ddp.<name>`` of a ``DistributedDataParallelConfig`` field and ``model.<name>`` of a
        ``TransformerConfig`` field the sections do not spell out go to ``ddp.extra`` and
        ``model.overrides``; names are checked against the installed megatron-core's dataclasses.
        """
        section_name, _, name = dotted.partition(".")
        section = getattr(self, section_name, None) if section_name in _SECTIONS else None
        if section is None or not name:
            raise ConfigError(
                f"unknown config field {dotted!r}: use <section>.<field> with a section among "
                f"{', '.join(_SECTIONS)}"
            )
        fields = {f.name: f for f in dataclasses.fields(section)}
        if name in fields and name not in ("extra", "overrides"):
            types = _annotation_types(str(fields[name].type))
            if isinstance(value, str) and str not in types and types:
                try:
                    value = parse_value(value, types)
                except ValueError as exc:
                    hint = " (true/false)" if bool in types else ""
                    raise ConfigError(f"{dotted}={value!r} is not of type {exc}: give {exc}{hint}") from None
            setattr(section, name, _check_type(dotted, value, types))
            return
        free_form = {
            "ddp": ("extra", "DistributedDataParallelConfig"),
            "model": ("overrides", "TransformerConfig"),
        }
        if section_name in free_form:
            bucket, megatron_class = free_form[section_name]
            allowed = set(versions.megatron_config_fields(megatron_class) or ())
            if section_name == "model":
                allowed |= _PRESET_OVERRIDABLE
            if allowed and name not in allowed:
                raise ConfigError(
                    f"unknown config field {dotted!r}: not a field of {section_name} nor of megatron-core "
                    f"{versions.package_version('megatron-core')}'s {megatron_class}; check the spelling"
                )
            getattr(section, bucket)[name] = parse_value(value) if isinstance(value, str) else value
            return
        raise ConfigError(
            f"unknown config field {dotted!r}; {section_name} has: "
            f"{', '.join(sorted(n for n in fields if n not in ('extra', 'overrides')))}"
        )

    def assign(self, assignment: str) -> None:
        """Apply one ``section.field=value`` (the ``--mfsdp-set`` syntax)."""
        dotted, sep, value = assignment.partition("=")
        if not sep or not dotted.strip():
            raise ConfigError(f"{assignment!r} is not an assignment: write section.field=value")
        self.set(dotted.strip(), value.strip())


_SECTIONS = ("dist", "ddp", "optimizer", "scheduler", "checkpoint", "model", "train")
#: preset fields a ``model.<name>`` override may change (the recipe has its own sections)
_PRESET_OVERRIDABLE = frozenset(
    f.name
    for f in dataclasses.fields(ModelPreset)
    if f.name not in ("recipe", "transformer_overrides", "name")
)
#: recipe field -> the config section that carries it
RECIPE_FIELDS: dict[str, str] = {
    f.name: ("optimizer" if f.name in {g.name for g in dataclasses.fields(OptimizerSection)} else "scheduler")
    for f in dataclasses.fields(TrainingRecipe)
}


PURPOSES = ("build", "save", "load")


def validate(
    cfg: RunConfig,
    world_size: int | None = None,
    environ: Mapping[str, str] | None = None,
    *,
    purpose: str = "build",
    platform: str | None = None,
    backend: str | None = None,
) -> list[str]:
    """Every config rule, in one place: upstream's (Bridge ``training/config.py``, Megatron-LM
    ``arguments.py``, MCore's ``TransformerConfig``) and this harness's; raise :class:`ConfigError`
    on the first violation.

    ``purpose``: ``build`` (a run is about to be built), ``save`` or ``load`` (a checkpoint is about
    to be written or read: the checkpoint rules apply whatever ``checkpoint.save/load`` say).
    ``platform``/``backend``: the session's (``cpu``/``cuda``, ``gloo``/``nccl``), where known.
    Returns warnings (rules where upstream only warns, or adjusts the config itself). Pure and
    deterministic: every rank runs it, before any model is built, and reaches the same verdict.
    ``environ`` defaults to ``os.environ`` (read for ``CUDA_DEVICE_MAX_CONNECTIONS``).
    """
    if purpose not in PURPOSES:
        raise ValueError(f"purpose={purpose!r}: choose one of {', '.join(PURPOSES)}")
    env = os.environ if environ is None else environ
    warnings: list[str] = []
    fsdp = cfg.uses_megatron_fsdp
    if cfg.dist.use_megatron_fsdp and cfg.dist.use_torch_fsdp2:
        raise ConfigError(
            "dist.use_megatron_fsdp=True and dist.use_torch_fsdp2=True are mutually exclusive: "
            "set one of them to False"
        )
    if cfg.ddp.use_megatron_fsdp and cfg.dist.use_torch_fsdp2:
        raise ConfigError(
            "ddp.use_megatron_fsdp=True and dist.use_torch_fsdp2=True are mutually exclusive: "
            "set ddp.use_megatron_fsdp=False for FSDP2, or dist.use_torch_fsdp2=False"
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
    if cfg.dist.backend is not None and cfg.dist.backend not in BACKENDS:
        raise ConfigError(
            f"dist.backend={cfg.dist.backend!r} is unknown; choose one of: {', '.join(BACKENDS)} "
            "(or None: the platform's)"
        )
    if fsdp and cfg.dist.use_tp_pp_dp_mapping:
        raise ConfigError(
            "dist.use_tp_pp_dp_mapping=True is not supported with Megatron-FSDP: set it to False"
        )
    if cfg.dist.use_megatron_fsdp != cfg.ddp.use_megatron_fsdp:
        warnings.append(
            f"dist.use_megatron_fsdp={cfg.dist.use_megatron_fsdp} but "
            f"ddp.use_megatron_fsdp={cfg.ddp.use_megatron_fsdp}: running Megatron-FSDP; set both "
            "alike (enable_megatron_fsdp(cfg) sets them together)"
        )
    saving = purpose != "build" or bool(cfg.checkpoint.save or cfg.checkpoint.load)
    if fsdp and cfg.checkpoint.ckpt_format != "fsdp_dtensor":
        # Megatron-LM's arguments.py refuses it whether or not anything is saved (Bridge only when
        # checkpoint.save/load is set): a run that cannot checkpoint is not the run being gated.
        raise ConfigError(
            f"checkpoint.ckpt_format={cfg.checkpoint.ckpt_format!r} with Megatron-FSDP: "
            "Megatron FSDP only supports fsdp_dtensor checkpoint format (refused even when nothing is "
            "saved, as Megatron-LM does); set checkpoint.ckpt_format='fsdp_dtensor' "
            "(fix_checkpoint_format(cfg) does it for torch_dist)"
        )
    if saving and cfg.checkpoint.ckpt_format == "fsdp_dtensor" and (not fsdp or cfg.dist.use_torch_fsdp2):
        which = "dist.use_torch_fsdp2=True" if cfg.dist.use_torch_fsdp2 else "dist.use_megatron_fsdp=False"
        raise ConfigError(
            f"checkpoint.ckpt_format='fsdp_dtensor' with checkpoint.save/load set and {which}: "
            "fsdp_dtensor checkpoints need Megatron-FSDP (not FSDP2); set dist.use_megatron_fsdp=True "
            "and ddp.use_megatron_fsdp=True, or choose checkpoint.ckpt_format='torch_dist'"
        )
    if cfg.checkpoint.async_save and cfg.checkpoint.ckpt_format not in ASYNC_CKPT_FORMATS:
        raise ConfigError(
            f"checkpoint.async_save=True with checkpoint.ckpt_format={cfg.checkpoint.ckpt_format!r}: "
            f"async save supports only {', '.join(ASYNC_CKPT_FORMATS)}; change the format or set "
            "checkpoint.async_save=False"
        )
    connections = env.get("CUDA_DEVICE_MAX_CONNECTIONS")
    if fsdp and connections == "1":
        raise ConfigError(
            "CUDA_DEVICE_MAX_CONNECTIONS='1' (environment) with Megatron-FSDP: FSDP needs several "
            "CUDA connections to overlap communication; unset it or set it above 1 "
            "(before CUDA is initialised: later changes have no effect)"
        )
    model = cfg.model
    try:
        get_preset(model.preset)
    except ValueError as exc:
        raise ConfigError(f"model.preset={model.preset!r}: {exc}") from None
    for name in (
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
        "context_parallel_size",
    ):
        size = getattr(model, name)
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ConfigError(f"model.{name}={size!r} must be a positive integer")
    if fsdp and (model.tensor_model_parallel_size > 1 or model.context_parallel_size > 1):
        warnings.append(
            f"Megatron-FSDP with model.tensor_model_parallel_size={model.tensor_model_parallel_size}, "
            f"model.context_parallel_size={model.context_parallel_size}: before Blackwell, FSDP "
            "wants CUDA_DEVICE_MAX_CONNECTIONS > 1 while TP/CP overlap wants 1 (environment: "
            f"{connections!r}); measure both settings"
        )
    if model.recompute_granularity is not None and model.recompute_granularity not in RECOMPUTE_GRANULARITIES:
        raise ConfigError(
            f"model.recompute_granularity={model.recompute_granularity!r} is unknown; choose one of: "
            f"{', '.join(RECOMPUTE_GRANULARITIES)} (or None)"
        )
    if model.cpu_offloading and model.pipeline_model_parallel_size > 1:
        raise ConfigError(
            f"model.cpu_offloading=True with model.pipeline_model_parallel_size="
            f"{model.pipeline_model_parallel_size}: CPU offloading needs pipeline parallel size 1; "
            "set model.pipeline_model_parallel_size=1 or model.cpu_offloading=False"
        )
    if model.cpu_offloading and model.recompute_granularity is not None:
        raise ConfigError(
            f"model.cpu_offloading=True with model.recompute_granularity={model.recompute_granularity!r}: "
            "CPU offloading does not work with activation recomputation; set "
            "model.recompute_granularity=None or model.cpu_offloading=False"
        )
    if world_size is not None and world_size % cfg.model_parallel_size:
        raise ConfigError(
            f"world size {world_size} is not divisible by tp*pp*cp={cfg.model_parallel_size} "
            f"(model.tensor_model_parallel_size={model.tensor_model_parallel_size}, "
            f"pipeline={model.pipeline_model_parallel_size}, context={model.context_parallel_size}): "
            "choose sizes whose product divides the world size"
        )
    _check_values(cfg)
    preset = cfg.resolved_preset()
    _check_recipe(cfg, preset)
    _check_hybrid_pattern(preset)
    if world_size is not None and cfg.train.global_batch_size is not None:
        micro, micro_batches = preset.micro_batch_size, preset.num_microbatches
        dp = world_size // cfg.model_parallel_size
        expected = micro * micro_batches * dp
        if cfg.train.global_batch_size != expected:
            raise ConfigError(
                f"train.global_batch_size={cfg.train.global_batch_size} != micro_batch_size {micro} * "
                f"num_microbatches {micro_batches} * data-parallel size {dp} = {expected}: "
                "set train.global_batch_size=None or adjust train.num_microbatches"
            )
    if fsdp and cfg.ddp.average_in_collective:
        warnings.append(
            "ddp.average_in_collective=True is not supported with Megatron-FSDP; "
            "switching it to False (as Megatron does)"
        )
    if fsdp and cfg.ddp.megatron_fsdp_version == 2 and (problem := versions.megatron_fsdp_v2_problem()):
        raise ConfigError(f"ddp.megatron_fsdp_version=2: {problem}; set ddp.megatron_fsdp_version=1")
    if fsdp and cfg.ddp.megatron_fsdp_version == 1 and not cfg.ddp.use_distributed_optimizer:
        warnings.append(
            "ddp.use_distributed_optimizer=False: Megatron-FSDP requires the distributed optimizer; "
            "switching it on (as Megatron does)"
        )
    if cfg.ddp.overlap_param_gather and not (fsdp or cfg.ddp.use_distributed_optimizer):
        # Megatron-LM's arguments.py asserts it; megatron-core 0.19's DDP otherwise takes its
        # layer-wise-optimizer path and fails in start_param_sync (layerwise_param_flat_sizes is None).
        raise ConfigError(
            "ddp.overlap_param_gather=True with Megatron DDP and ddp.use_distributed_optimizer=False: "
            "overlapped parameter gathering needs the distributed optimizer or Megatron-FSDP; set "
            "ddp.overlap_param_gather=False (or ddp.use_distributed_optimizer=True)"
        )
    if cfg.ddp.overlap_param_gather and not cfg.ddp.overlap_grad_reduce:
        raise ConfigError(
            "ddp.overlap_param_gather=True with ddp.overlap_grad_reduce=False: Megatron-LM requires "
            "overlap_grad_reduce whenever parameter gathering overlaps; set ddp.overlap_grad_reduce=True "
            "or ddp.overlap_param_gather=False"
        )
    _check_megatron_field_names(cfg)
    if purpose != "build" and not fsdp:
        raise ConfigError(
            f"checkpoint.ckpt_format={cfg.checkpoint.ckpt_format!r} save/load here needs Megatron-FSDP "
            "(dist.use_megatron_fsdp=True): fsdp_dtensor checkpoints hold Megatron-FSDP's DTensors"
        )
    if purpose != "build" and cfg.ddp.megatron_fsdp_version == 2:
        raise ConfigError(
            f"ddp.megatron_fsdp_version=2 with checkpoint {purpose}: this harness's fsdp_dtensor "
            "checkpoints hold V1's distributed-optimizer state, and V2's FullyShardedOptimizer has no "
            "state dict; save V2 with fsdp.checkpoint_v2.save_dcp / load_dcp (DCP), or set "
            "ddp.megatron_fsdp_version=1"
        )
    if purpose != "build" and cfg.checkpoint.ckpt_format != "fsdp_dtensor":
        raise ConfigError(
            f"checkpoint.ckpt_format={cfg.checkpoint.ckpt_format!r}: only 'fsdp_dtensor' is implemented "
            "by this harness; set checkpoint.ckpt_format='fsdp_dtensor'"
        )
    if backend is not None and cfg.dist.backend is not None and cfg.dist.backend != backend:
        raise ConfigError(
            f"dist.backend={cfg.dist.backend!r} but this session's process group uses {backend!r} "
            f"(platform {platform}): set dist.backend=None or switch platform"
        )
    plain_ddp = not fsdp and not cfg.dist.use_torch_fsdp2
    if platform == "cpu" and plain_ddp and cfg.ddp.use_distributed_optimizer:
        raise ConfigError(
            "ddp.use_distributed_optimizer=True with Megatron DDP on CPU ranks: megatron-core's "
            "DDP + DistributedOptimizer path fails a torch.cuda type check on CPU; set "
            "ddp.use_distributed_optimizer=False"
        )
    return warnings


#: the HybridModel layer symbols the harness builds (local, non-Transformer-Engine specs)
HYBRID_SYMBOLS = {"*": "self-attention", "-": "MLP"}


def _check_hybrid_pattern(preset: ModelPreset) -> None:
    pattern = preset.hybrid_layer_pattern
    if pattern is None:
        return
    shown = f"model.hybrid_layer_pattern={pattern!r}"
    if problem := versions.hybrid_model_problem():
        raise ConfigError(f"{shown}: {problem}; set model.hybrid_layer_pattern=None (a GPTModel)")
    unknown = sorted(set(pattern) - set(HYBRID_SYMBOLS))
    if not pattern or unknown:
        raise ConfigError(
            f"{shown}: the harness builds "
            f"{' and '.join(f'{k!r} ({v})' for k, v in HYBRID_SYMBOLS.items())} layers only"
            + (f", not {unknown[0]!r}" if unknown else "")
            + "; write a pattern such as '*-*-'"
        )
    if preset.num_layers != len(pattern):
        raise ConfigError(
            f"{shown} has {len(pattern)} layers but model.num_layers={preset.num_layers}: a HybridModel "
            f"has one layer per symbol; set model.num_layers={len(pattern)}"
        )


def _choice(dotted: str, value: Any, choices: tuple[str, ...], none_ok: bool = False) -> None:
    if value is None and none_ok:
        return
    if value not in choices:
        raise ConfigError(
            f"{dotted}={value!r} is unknown; choose one of: {', '.join(choices)}"
            + (" (or None)" if none_ok else "")
        )


def _at_least(dotted: str, value: Any, minimum: float, none_ok: bool = False) -> None:
    if value is None and none_ok:
        return
    _at_least_shown(f"{dotted}={value!r}", value, minimum)


def _check_values(cfg: RunConfig) -> None:
    """Each field on its own: choices and ranges (no rank, no other field needed)."""
    ddp, model, train = cfg.ddp, cfg.model, cfg.train
    _choice("ddp.outer_dp_sharding_strategy", ddp.outer_dp_sharding_strategy, OUTER_SHARDING_STRATEGIES)
    if ddp.megatron_fsdp_version not in (1, 2):
        raise ConfigError(
            f"ddp.megatron_fsdp_version={ddp.megatron_fsdp_version!r}: Megatron-FSDP versions are 1 and 2; "
            "set ddp.megatron_fsdp_version=1 (or 2 where megatron-core has V2)"
        )
    _at_least("ddp.bucket_size", ddp.bucket_size, 1, none_ok=True)
    _at_least("ddp.num_distributed_optimizer_instances", ddp.num_distributed_optimizer_instances, 1)
    _at_least("ddp.suggested_communication_unit_size", ddp.suggested_communication_unit_size, 1, none_ok=True)
    _choice("model.recompute_method", model.recompute_method, RECOMPUTE_METHODS, none_ok=True)
    _at_least("model.recompute_num_layers", model.recompute_num_layers, 1, none_ok=True)
    _at_least("model.cpu_offloading_num_layers", model.cpu_offloading_num_layers, 0)
    # megatron's TransformerConfig asserts these when the model is built
    if model.recompute_granularity == "full" and model.recompute_method is None:
        raise ConfigError(
            "model.recompute_granularity='full' with model.recompute_method=None: full recomputation "
            "needs a method; set model.recompute_method='uniform' or 'block'"
        )
    if model.recompute_granularity == "full" and model.recompute_num_layers is None:
        raise ConfigError(
            "model.recompute_granularity='full' with model.recompute_num_layers=None: full recomputation "
            "needs a layer count; set model.recompute_num_layers (1 up to the layers per pipeline rank)"
        )
    if model.recompute_granularity == "selective" and model.recompute_num_layers is not None:
        raise ConfigError(
            f"model.recompute_granularity='selective' with model.recompute_num_layers="
            f"{model.recompute_num_layers!r}: selective recomputation takes no layer count; set "
            "model.recompute_num_layers=None"
        )
    for name in ("train_iters", "num_microbatches", "micro_batch_size", "seq_length", "global_batch_size"):
        _at_least(f"train.{name}", getattr(train, name), 1, none_ok=name != "train_iters")
    _at_least("train.seed", train.seed, 0)
    _choice("optimizer.optimizer", cfg.optimizer.optimizer, OPTIMIZERS)


def _check_recipe(cfg: RunConfig, preset: ModelPreset) -> None:
    """The optimizer and schedule (what Megatron's OptimizerConfig and OptimizerParamScheduler
    assert, and Bridge's SchedulerConfig), on the values the run will use: set here or the preset's."""
    r = preset.recipe

    def show(field_name: str, value: Any = None) -> str:
        """``section.field=value``, saying when the value is the preset's rather than the config's."""
        section = RECIPE_FIELDS[field_name]
        given = getattr(getattr(cfg, section), field_name) is not None
        value = getattr(r, field_name) if value is None else value
        return f"{section}.{field_name}={value!r}" + ("" if given else f" (the {preset.name} preset's)")

    def fail(problem: str) -> None:
        raise ConfigError(problem)

    for field_name in ("lr", "min_lr", "weight_decay", "clip_grad", "lr_warmup_init", "lr_warmup_iters"):
        _at_least_shown(show(field_name), getattr(r, field_name), 0)
    for field_name in ("start_weight_decay", "end_weight_decay"):
        if getattr(r, field_name) is not None:
            _at_least_shown(show(field_name), getattr(r, field_name), 0)
    for field_name in ("lr_decay_iters", "lr_wsd_decay_iters"):
        if getattr(r, field_name) is not None:
            _at_least_shown(show(field_name), getattr(r, field_name), 1)
    for field_name in ("adam_beta1", "adam_beta2"):
        _at_least_shown(show(field_name), getattr(r, field_name), 0)
        if getattr(r, field_name) >= 1:
            fail(f"{show(field_name)} must be below 1 (a decay rate in [0, 1))")
    if not (_is_number(r.adam_eps) and r.adam_eps > 0):
        fail(f"{show('adam_eps')} must be a positive number")
    for field_name, choices in (
        ("lr_decay_style", LR_DECAY_STYLES),
        ("weight_decay_incr_style", WD_INCR_STYLES),
        ("lr_wsd_decay_style", WSD_DECAY_STYLES),
    ):
        if getattr(r, field_name) not in choices:
            fail(f"{show(field_name)} is unknown; choose one of: {', '.join(choices)}")
    if r.min_lr > r.lr:
        fail(
            f"{show('min_lr')} is above {show('lr')}: the schedule decays from lr down to min_lr; "
            "lower optimizer.min_lr (e.g. to 0)"
        )
    if r.lr_warmup_init > r.lr:
        fail(
            f"{show('lr_warmup_init')} is above {show('lr')}: warm-up rises from lr_warmup_init to lr; "
            "lower scheduler.lr_warmup_init"
        )
    if r.lr_warmup_fraction is not None:
        if not (_is_number(r.lr_warmup_fraction) and 0 <= r.lr_warmup_fraction < 1):
            fail(f"{show('lr_warmup_fraction')} must be in [0, 1), or None")
        if r.lr_warmup_iters:
            fail(
                f"{show('lr_warmup_fraction')} and {show('lr_warmup_iters')}: give only one of them; "
                "set scheduler.lr_warmup_iters=0 or scheduler.lr_warmup_fraction=None"
            )
    elif r.lr_decay_iters is not None and r.lr_warmup_iters >= r.lr_decay_iters:
        fail(
            f"{show('lr_warmup_iters')} is not below {show('lr_decay_iters')}: Megatron's scheduler warms "
            "up before it decays; lower scheduler.lr_warmup_iters or raise scheduler.lr_decay_iters"
        )
    elif r.lr_decay_iters is None and r.lr_warmup_iters >= cfg.train.train_iters:
        fail(
            f"{show('lr_warmup_iters')} is not below train.train_iters={cfg.train.train_iters} (the decay "
            "iterations when scheduler.lr_decay_iters is None): Megatron's scheduler warms up before it "
            "decays; lower scheduler.lr_warmup_iters or set scheduler.lr_decay_iters"
        )
    if r.lr_decay_style == "WSD" and r.lr_wsd_decay_iters is None:
        fail(
            f"{show('lr_decay_style')} needs scheduler.lr_wsd_decay_iters (the annealing iterations): "
            "set it, or choose another scheduler.lr_decay_style"
        )
    start_wd = r.weight_decay if r.start_weight_decay is None else r.start_weight_decay
    end_wd = r.weight_decay if r.end_weight_decay is None else r.end_weight_decay
    if end_wd < start_wd:
        fail(
            f"{show('end_weight_decay', end_wd)} is below {show('start_weight_decay', start_wd)}: weight "
            "decay only increases over a run; swap them or make them equal"
        )
    if r.weight_decay_incr_style == "constant" and start_wd != end_wd:
        fail(
            f"{show('weight_decay_incr_style')} with {show('start_weight_decay', start_wd)} != "
            f"{show('end_weight_decay', end_wd)}: make them equal or set "
            "scheduler.weight_decay_incr_style='linear' or 'cosine'"
        )
    if r.override_opt_param_scheduler and r.use_checkpoint_opt_param_scheduler:
        fail(
            f"{show('override_opt_param_scheduler')} and {show('use_checkpoint_opt_param_scheduler')} "
            "exclude each other (the schedule comes from the config or from the checkpoint): set one False"
        )


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _at_least_shown(shown: str, value: Any, minimum: float) -> None:
    """``shown`` is ``section.field=value`` already."""
    if not _is_number(value):
        raise ConfigError(f"{shown} must be a finite number")
    if value < minimum:
        raise ConfigError(f"{shown} must be at least {minimum:g}")


def _check_megatron_field_names(cfg: RunConfig) -> None:
    """Free-form fields (``ddp.extra``, ``model.overrides``, the preset's transformer overrides)
    must exist on the installed megatron-core's dataclasses: a typo must not pass silently."""
    ddp_class = (
        "TorchFullyShardedDataParallelConfig" if cfg.dist.use_torch_fsdp2 else "DistributedDataParallelConfig"
    )
    transformer = {k for k in cfg.model.overrides if k not in _PRESET_OVERRIDABLE}
    transformer |= set(get_preset(cfg.model.preset).transformer_overrides)
    for section, given, class_name in (
        ("ddp", set(cfg.ddp.extra), ddp_class),
        ("model", transformer, "TransformerConfig"),
    ):
        known = versions.megatron_config_fields(class_name)
        unknown = sorted(given - known) if known else []
        if unknown:
            raise ConfigError(
                f"unknown config field {section}.{unknown[0]}: megatron-core "
                f"{versions.package_version('megatron-core')}'s {class_name} has no such field; "
                "check the spelling"
            )


def enable_megatron_fsdp(cfg: RunConfig) -> RunConfig:
    """The seed's minimal override: what Bridge users set to turn Megatron-FSDP on."""
    cfg.dist.use_megatron_fsdp = True
    cfg.ddp.use_megatron_fsdp = True
    cfg.ddp.data_parallel_sharding_strategy = "optim_grads_params"
    cfg.ddp.average_in_collective = False
    cfg.checkpoint.ckpt_format = "fsdp_dtensor"
    return cfg


def disable_megatron_fsdp(cfg: RunConfig) -> RunConfig:
    """``--mfsdp-use-megatron-fsdp=false``: both flags off (Megatron's DDP wrapper is used)."""
    cfg.dist.use_megatron_fsdp = False
    cfg.ddp.use_megatron_fsdp = False
    return cfg


def fix_checkpoint_format(cfg: RunConfig) -> str | None:
    """The seed's recipe pitfall: with Megatron-FSDP on, a recipe that still says ``torch_dist`` is
    switched to ``fsdp_dtensor`` (validate() refuses any other format with Megatron-FSDP, whether or
    not checkpoint.save/load is set). Returns the message (None: nothing changed)."""
    if cfg.uses_megatron_fsdp and cfg.checkpoint.ckpt_format == "torch_dist":
        cfg.checkpoint.ckpt_format = "fsdp_dtensor"
        return (
            "checkpoint.ckpt_format='torch_dist' -> 'fsdp_dtensor': Megatron FSDP only supports "
            "fsdp_dtensor checkpoints (recipes default to torch_dist)"
        )
    return None


def recipe_fixup(cfg: RunConfig, save: str | None) -> RunConfig:
    """The seed's example recipe fixup: Megatron-FSDP on, fsdp_dtensor, save to ``save``, no load."""
    enable_megatron_fsdp(cfg)
    cfg.checkpoint.save = save
    cfg.checkpoint.load = None
    return cfg


def apply_perf_harness_overrides(cfg: RunConfig) -> RunConfig:
    """Bridge's performance harness (``launch.py --use_megatron_fsdp true``): its Megatron-FSDP
    overrides, as the seed lists them (``keep_fp8_transpose_cache=False``,
    ``init_model_with_meta_device=True``, ``checkpoint.load=None``)."""
    cfg.ddp.use_megatron_fsdp = True
    cfg.ddp.data_parallel_sharding_strategy = "optim_grads_params"
    cfg.ddp.keep_fp8_transpose_cache = False
    cfg.ddp.average_in_collective = False
    cfg.model.init_model_with_meta_device = True
    cfg.checkpoint.load = None
    return cfg
