"""A run config with Megatron-Bridge's section and field names, and its validation rules.

Users think in Bridge's terms (``cfg.dist.use_megatron_fsdp``, ``cfg.ddp.data_parallel_sharding_strategy``,
``cfg.checkpoint.ckpt_format``...), so the harness speaks them. Everything here is plain data: no
torch import, so a bad config fails before any process group or model exists.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import math
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from . import versions
from .presets import DEFAULT_PRESET, ModelPreset, TrainingRecipe, get_preset

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
    """A run config that upstream would reject (or that would waste a GPU hour); ``rule``: the name
    of the :data:`RULES` entry that refused it (None: not a rule of ``validate()``, e.g. a bad
    field name given to ``RunConfig.set``)."""

    def __init__(self, message: str, rule: str | None = None) -> None:
        super().__init__(message)
        self.rule = rule


def upstream_line(error: BaseException) -> str:
    """An upstream check's exception in one line: its type and the first line of its message."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else '(no message)'}"


def upstream_refusal(source: str, error: BaseException) -> str:
    """The line of a refusal only upstream makes (``source``: e.g. ``Megatron-Bridge 0.6.2``): no rule of
    :data:`RULES` refuses the config, so upstream's message is all there is to name the field."""
    return f"{source} refuses the config: {upstream_line(error)}; change the field it names"


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
    #: where bf16 matmuls are slow (CPU ranks without native bf16, ``--mfsdp-cpu-speed``): a bf16 run
    #: of a preset with a ``slow_bf16_step`` takes that step's sizes for the fields left None above
    slow_bf16_step: bool = False


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
        bf16 = changes.get("bf16", preset.bf16)
        slow_step = preset.slow_bf16_step if self.train.slow_bf16_step and bf16 else None
        for name in ("seq_length", "micro_batch_size", "num_microbatches"):
            if getattr(self.train, name) is not None:
                changes[name] = getattr(self.train, name)
            elif slow_step is not None and name not in changes:  # a model override of it wins too
                changes[name] = getattr(slow_step, name)
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


@dataclass(frozen=True)
class Validation:
    """What a rule looks at: the config, and what is known of the session it is checked for."""

    cfg: RunConfig
    #: None: not known yet (checked again on every rank, where it is)
    world_size: int | None
    #: the environment (``CUDA_DEVICE_MAX_CONNECTIONS``)
    environ: Mapping[str, str]
    #: ``build``, ``save`` or ``load``
    purpose: str
    #: the session's ``cpu``/``cuda`` and ``gloo``/``nccl``, where known
    platform: str | None
    backend: str | None

    @property
    def fsdp(self) -> bool:
        return self.cfg.uses_megatron_fsdp

    @property
    def saving(self) -> bool:
        """A checkpoint is (or may be) written or read."""
        return self.purpose != "build" or bool(self.cfg.checkpoint.save or self.cfg.checkpoint.load)

    @property
    def connections(self) -> str | None:
        return self.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")

    @functools.cached_property
    def preset(self) -> ModelPreset:
        """The preset with the config's overrides (computed once, by the first rule that needs it)."""
        return self.cfg.resolved_preset()


@dataclass(frozen=True)
class Rule:
    """One named config rule: ``check`` returns its one-line message when the config breaks it
    (naming the field, the value and the fix), else None."""

    name: str
    check: Callable[[Validation], str | None]
    #: upstream only warns, or adjusts the config itself: the message is a warning, checking goes on
    warns: bool = False

    @property
    def doc(self) -> str:
        return inspect.getdoc(self.check) or ""


_RULES: list[Rule] = []


def _rule(name: str, *, warns: bool = False) -> Callable[[Callable[[Validation], str | None]], Rule]:
    """Register the decorated check as the next rule of :data:`RULES` (definition order is check order)."""

    def register(check: Callable[[Validation], str | None]) -> Rule:
        registered = Rule(name, check, warns)
        _RULES.append(registered)
        return registered

    return register


def validate(
    cfg: RunConfig,
    world_size: int | None = None,
    environ: Mapping[str, str] | None = None,
    *,
    purpose: str = "build",
    platform: str | None = None,
    backend: str | None = None,
) -> list[str]:
    """Every config rule (:data:`RULES`, in order): upstream's (Bridge ``training/config.py``,
    Megatron-LM ``arguments.py``, MCore's ``TransformerConfig``) and this harness's; raise
    :class:`ConfigError` (its ``rule`` names the rule) on the first violation.

    ``purpose``: ``build`` (a run is about to be built), ``save`` or ``load`` (a checkpoint is about
    to be written or read: the checkpoint rules apply whatever ``checkpoint.save/load`` say).
    ``platform``/``backend``: the session's (``cpu``/``cuda``, ``gloo``/``nccl``), where known.
    Returns warnings (rules where upstream only warns, or adjusts the config itself). Pure and
    deterministic: every rank runs it, before any model is built, and reaches the same verdict.
    ``environ`` defaults to ``os.environ`` (read for ``CUDA_DEVICE_MAX_CONNECTIONS``).
    """
    warnings: list[str] = []
    for rule, message in findings(
        cfg, world_size, environ, purpose=purpose, platform=platform, backend=backend
    ):
        if not rule.warns:
            raise ConfigError(message, rule=rule.name)
        warnings.append(message)
    return warnings


def findings(
    cfg: RunConfig,
    world_size: int | None = None,
    environ: Mapping[str, str] | None = None,
    *,
    purpose: str = "build",
    platform: str | None = None,
    backend: str | None = None,
) -> list[tuple[Rule, str]]:
    """What :func:`validate` finds, rule by rule: every warning, up to and including the first
    violation (the rules after it assume the ones before it hold, so they do not run)."""
    if purpose not in PURPOSES:
        raise ValueError(f"purpose={purpose!r}: choose one of {', '.join(PURPOSES)}")
    subject = Validation(
        cfg, world_size, os.environ if environ is None else environ, purpose, platform, backend
    )
    found: list[tuple[Rule, str]] = []
    for rule in RULES:
        message = rule.check(subject)
        if message is not None:
            found.append((rule, message))
            if not rule.warns:
                break
    return found


# --------------------------------------------------------------------------------------------
# the rules, in the order they are checked


@_rule("megatron-fsdp-excludes-fsdp2")
def _megatron_fsdp_excludes_fsdp2(v: Validation) -> str | None:
    """``dist.use_megatron_fsdp`` and ``dist.use_torch_fsdp2`` are mutually exclusive (Bridge)."""
    if v.cfg.dist.use_megatron_fsdp and v.cfg.dist.use_torch_fsdp2:
        return (
            "dist.use_megatron_fsdp=True and dist.use_torch_fsdp2=True are mutually exclusive: "
            "set one of them to False"
        )
    return None


@_rule("ddp-megatron-fsdp-excludes-fsdp2")
def _ddp_megatron_fsdp_excludes_fsdp2(v: Validation) -> str | None:
    """``ddp.use_megatron_fsdp`` (Bridge's perf harness sets only this one) excludes FSDP2 too."""
    if v.cfg.ddp.use_megatron_fsdp and v.cfg.dist.use_torch_fsdp2:
        return (
            "ddp.use_megatron_fsdp=True and dist.use_torch_fsdp2=True are mutually exclusive: "
            "set ddp.use_megatron_fsdp=False for FSDP2, or dist.use_torch_fsdp2=False"
        )
    return None


@_rule("sharding-strategy")
def _sharding_strategy(v: Validation) -> str | None:
    """``ddp.data_parallel_sharding_strategy`` is one of Megatron-FSDP's four."""
    strategy = v.cfg.ddp.data_parallel_sharding_strategy
    if strategy not in SHARDING_STRATEGIES:
        return (
            f"ddp.data_parallel_sharding_strategy={strategy!r} is not a sharding strategy; "
            f"choose one of: {', '.join(SHARDING_STRATEGIES)}"
        )
    return None


@_rule("checkpoint-format")
def _checkpoint_format(v: Validation) -> str | None:
    """``checkpoint.ckpt_format`` is a format Megatron knows."""
    return _choice("checkpoint.ckpt_format", v.cfg.checkpoint.ckpt_format, CKPT_FORMATS)


@_rule("backend")
def _backend(v: Validation) -> str | None:
    """``dist.backend`` is nccl, gloo or None (the platform's)."""
    return _choice("dist.backend", v.cfg.dist.backend, BACKENDS, none_ok=True, none_means="the platform's")


@_rule("tp-pp-dp-mapping")
def _tp_pp_dp_mapping(v: Validation) -> str | None:
    """``dist.use_tp_pp_dp_mapping`` is not supported with Megatron-FSDP (Bridge)."""
    if v.fsdp and v.cfg.dist.use_tp_pp_dp_mapping:
        return "dist.use_tp_pp_dp_mapping=True is not supported with Megatron-FSDP: set it to False"
    return None


@_rule("megatron-fsdp-flags-differ", warns=True)
def _megatron_fsdp_flags_differ(v: Validation) -> str | None:
    """``dist.use_megatron_fsdp`` and ``ddp.use_megatron_fsdp`` differ: either one turns it on."""
    if v.cfg.dist.use_megatron_fsdp != v.cfg.ddp.use_megatron_fsdp:
        return (
            f"dist.use_megatron_fsdp={v.cfg.dist.use_megatron_fsdp} but "
            f"ddp.use_megatron_fsdp={v.cfg.ddp.use_megatron_fsdp}: running Megatron-FSDP; set both "
            "alike (enable_megatron_fsdp(cfg) sets them together)"
        )
    return None


@_rule("megatron-fsdp-needs-fsdp-dtensor")
def _megatron_fsdp_needs_fsdp_dtensor(v: Validation) -> str | None:
    """Megatron-FSDP needs ``checkpoint.ckpt_format='fsdp_dtensor'``, even when nothing is saved."""
    fmt = v.cfg.checkpoint.ckpt_format
    if v.fsdp and fmt != "fsdp_dtensor":
        # Megatron-LM's arguments.py refuses it whether or not anything is saved (Bridge only when
        # checkpoint.save/load is set): a run that cannot checkpoint is not the run being gated.
        return (
            f"checkpoint.ckpt_format={fmt!r} with Megatron-FSDP: "
            "Megatron FSDP only supports fsdp_dtensor checkpoint format (refused even when nothing is "
            "saved, as Megatron-LM does); set checkpoint.ckpt_format='fsdp_dtensor' "
            "(fix_checkpoint_format(cfg) does it for torch_dist)"
        )
    return None


@_rule("fsdp-dtensor-needs-megatron-fsdp")
def _fsdp_dtensor_needs_megatron_fsdp(v: Validation) -> str | None:
    """Saving or loading fsdp_dtensor checkpoints needs Megatron-FSDP, not FSDP2 (Bridge)."""
    cfg = v.cfg
    if v.saving and cfg.checkpoint.ckpt_format == "fsdp_dtensor" and (not v.fsdp or cfg.dist.use_torch_fsdp2):
        which = "dist.use_torch_fsdp2=True" if cfg.dist.use_torch_fsdp2 else "dist.use_megatron_fsdp=False"
        return (
            f"checkpoint.ckpt_format='fsdp_dtensor' with checkpoint.save/load set and {which}: "
            "fsdp_dtensor checkpoints need Megatron-FSDP (not FSDP2); set dist.use_megatron_fsdp=True "
            "and ddp.use_megatron_fsdp=True, or choose checkpoint.ckpt_format='torch_dist'"
        )
    return None


@_rule("async-save-format")
def _async_save_format(v: Validation) -> str | None:
    """``checkpoint.async_save`` only with a format Megatron saves asynchronously."""
    fmt = v.cfg.checkpoint.ckpt_format
    if v.cfg.checkpoint.async_save and fmt not in ASYNC_CKPT_FORMATS:
        return (
            f"checkpoint.async_save=True with checkpoint.ckpt_format={fmt!r}: "
            f"async save supports only {', '.join(ASYNC_CKPT_FORMATS)}; change the format or set "
            "checkpoint.async_save=False"
        )
    return None


@_rule("cuda-device-max-connections")
def _cuda_device_max_connections(v: Validation) -> str | None:
    """Megatron-FSDP refuses ``CUDA_DEVICE_MAX_CONNECTIONS=1`` (no communication overlap)."""
    if v.fsdp and v.connections == "1":
        return (
            "CUDA_DEVICE_MAX_CONNECTIONS='1' (environment) with Megatron-FSDP: FSDP needs several "
            "CUDA connections to overlap communication; unset it or set it above 1 "
            "(before CUDA is initialised: later changes have no effect)"
        )
    return None


@_rule("model-preset")
def _model_preset(v: Validation) -> str | None:
    """``model.preset`` names a preset."""
    try:
        get_preset(v.cfg.model.preset)
    except ValueError as exc:
        return f"model.preset={v.cfg.model.preset!r}: {exc}"
    return None


@_rule("parallel-sizes")
def _parallel_sizes(v: Validation) -> str | None:
    """Tensor, pipeline and context parallel sizes are positive integers."""
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"):
        size = getattr(v.cfg.model, name)
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            return f"model.{name}={size!r} must be a positive integer"
    return None


@_rule("tp-cp-connections", warns=True)
def _tp_cp_connections(v: Validation) -> str | None:
    """Megatron-FSDP with TP or CP: FSDP and TP/CP overlap want different CUDA connection counts."""
    model = v.cfg.model
    if v.fsdp and (model.tensor_model_parallel_size > 1 or model.context_parallel_size > 1):
        return (
            f"Megatron-FSDP with model.tensor_model_parallel_size={model.tensor_model_parallel_size}, "
            f"model.context_parallel_size={model.context_parallel_size}: before Blackwell, FSDP "
            "wants CUDA_DEVICE_MAX_CONNECTIONS > 1 while TP/CP overlap wants 1 (environment: "
            f"{v.connections!r}); measure both settings"
        )
    return None


@_rule("recompute-granularity")
def _recompute_granularity(v: Validation) -> str | None:
    """``model.recompute_granularity`` is full, selective or None."""
    return _choice(
        "model.recompute_granularity",
        v.cfg.model.recompute_granularity,
        RECOMPUTE_GRANULARITIES,
        none_ok=True,
    )


@_rule("cpu-offloading-pipeline")
def _cpu_offloading_pipeline(v: Validation) -> str | None:
    """CPU offloading needs pipeline parallel size 1 (TransformerConfig)."""
    model = v.cfg.model
    if model.cpu_offloading and model.pipeline_model_parallel_size > 1:
        return (
            f"model.cpu_offloading=True with model.pipeline_model_parallel_size="
            f"{model.pipeline_model_parallel_size}: CPU offloading needs pipeline parallel size 1; "
            "set model.pipeline_model_parallel_size=1 or model.cpu_offloading=False"
        )
    return None


@_rule("cpu-offloading-recompute")
def _cpu_offloading_recompute(v: Validation) -> str | None:
    """CPU offloading does not work with activation recomputation (TransformerConfig)."""
    model = v.cfg.model
    if model.cpu_offloading and model.recompute_granularity is not None:
        return (
            f"model.cpu_offloading=True with model.recompute_granularity={model.recompute_granularity!r}: "
            "CPU offloading does not work with activation recomputation; set "
            "model.recompute_granularity=None or model.cpu_offloading=False"
        )
    return None


@_rule("world-size-divisible")
def _world_size_divisible(v: Validation) -> str | None:
    """The world size is a multiple of tp*pp*cp (where the world size is known)."""
    cfg, model = v.cfg, v.cfg.model
    if v.world_size is not None and v.world_size % cfg.model_parallel_size:
        return (
            f"world size {v.world_size} is not divisible by tp*pp*cp={cfg.model_parallel_size} "
            f"(model.tensor_model_parallel_size={model.tensor_model_parallel_size}, "
            f"pipeline={model.pipeline_model_parallel_size}, context={model.context_parallel_size}): "
            "choose sizes whose product divides the world size"
        )
    return None


# Each field on its own: choices and ranges (no rank, no other field needed).


@_rule("outer-sharding-strategy")
def _outer_sharding_strategy(v: Validation) -> str | None:
    """``ddp.outer_dp_sharding_strategy`` (HSDP's outer dimension) is no_shard or optim."""
    return _choice(
        "ddp.outer_dp_sharding_strategy", v.cfg.ddp.outer_dp_sharding_strategy, OUTER_SHARDING_STRATEGIES
    )


@_rule("megatron-fsdp-version")
def _megatron_fsdp_version(v: Validation) -> str | None:
    """``ddp.megatron_fsdp_version`` is 1 or 2."""
    version = v.cfg.ddp.megatron_fsdp_version
    if version not in (1, 2):
        return (
            f"ddp.megatron_fsdp_version={version!r}: Megatron-FSDP versions are 1 and 2; "
            "set ddp.megatron_fsdp_version=1 (or 2 where megatron-core has V2)"
        )
    return None


@_rule("ddp-sizes")
def _ddp_sizes(v: Validation) -> str | None:
    """Bucket size, distributed-optimizer instances and communication unit size are at least 1."""
    ddp = v.cfg.ddp
    return (
        _at_least("ddp.bucket_size", ddp.bucket_size, 1, none_ok=True)
        or _at_least("ddp.num_distributed_optimizer_instances", ddp.num_distributed_optimizer_instances, 1)
        or _at_least(
            "ddp.suggested_communication_unit_size", ddp.suggested_communication_unit_size, 1, none_ok=True
        )
    )


@_rule("recompute-method")
def _recompute_method(v: Validation) -> str | None:
    """``model.recompute_method`` is uniform, block or None."""
    return _choice("model.recompute_method", v.cfg.model.recompute_method, RECOMPUTE_METHODS, none_ok=True)


@_rule("layer-counts")
def _layer_counts(v: Validation) -> str | None:
    """``model.recompute_num_layers`` is at least 1 (or None); ``model.cpu_offloading_num_layers``
    at least 0."""
    model = v.cfg.model
    return _at_least("model.recompute_num_layers", model.recompute_num_layers, 1, none_ok=True) or _at_least(
        "model.cpu_offloading_num_layers", model.cpu_offloading_num_layers, 0
    )


# megatron's TransformerConfig asserts these when the model is built


@_rule("full-recompute-method")
def _full_recompute_method(v: Validation) -> str | None:
    """Full recomputation needs ``model.recompute_method``."""
    model = v.cfg.model
    if model.recompute_granularity == "full" and model.recompute_method is None:
        return (
            "model.recompute_granularity='full' with model.recompute_method=None: full recomputation "
            "needs a method; set model.recompute_method='uniform' or 'block'"
        )
    return None


@_rule("full-recompute-layers")
def _full_recompute_layers(v: Validation) -> str | None:
    """Full recomputation needs ``model.recompute_num_layers``."""
    model = v.cfg.model
    if model.recompute_granularity == "full" and model.recompute_num_layers is None:
        return (
            "model.recompute_granularity='full' with model.recompute_num_layers=None: full recomputation "
            "needs a layer count; set model.recompute_num_layers (1 up to the layers per pipeline rank)"
        )
    return None


@_rule("selective-recompute-layers")
def _selective_recompute_layers(v: Validation) -> str | None:
    """Selective recomputation takes no ``model.recompute_num_layers``."""
    model = v.cfg.model
    if model.recompute_granularity == "selective" and model.recompute_num_layers is not None:
        return (
            f"model.recompute_granularity='selective' with model.recompute_num_layers="
            f"{model.recompute_num_layers!r}: selective recomputation takes no layer count; set "
            "model.recompute_num_layers=None"
        )
    return None


@_rule("train-sizes")
def _train_sizes(v: Validation) -> str | None:
    """Iterations, micro-batches, batch sizes and sequence length are at least 1 (None: the preset's)."""
    train = v.cfg.train
    for name in ("train_iters", "num_microbatches", "micro_batch_size", "seq_length", "global_batch_size"):
        if problem := _at_least(f"train.{name}", getattr(train, name), 1, none_ok=name != "train_iters"):
            return problem
    return None


@_rule("seed")
def _seed(v: Validation) -> str | None:
    """``train.seed`` is at least 0."""
    return _at_least("train.seed", v.cfg.train.seed, 0)


@_rule("optimizer")
def _optimizer(v: Validation) -> str | None:
    """``optimizer.optimizer`` is adam or sgd."""
    return _choice("optimizer.optimizer", v.cfg.optimizer.optimizer, OPTIMIZERS)


# The optimizer and schedule (what Megatron's OptimizerConfig and OptimizerParamScheduler assert, and
# Bridge's SchedulerConfig), on the values the run will use: set in the config or the preset's.


def _shown(v: Validation, field_name: str, value: Any = None) -> str:
    """``section.field=value`` of a recipe field, saying when the value is the preset's rather than
    the config's."""
    preset = v.preset
    section = RECIPE_FIELDS[field_name]
    given = getattr(getattr(v.cfg, section), field_name) is not None
    value = getattr(preset.recipe, field_name) if value is None else value
    return f"{section}.{field_name}={value!r}" + ("" if given else f" (the {preset.name} preset's)")


@_rule("recipe-ranges")
def _recipe_ranges(v: Validation) -> str | None:
    """Rates, weight decay, clipping and warm-up are finite and at least 0; decay lengths at least 1."""
    r = v.preset.recipe
    for field_name in ("lr", "min_lr", "weight_decay", "clip_grad", "lr_warmup_init", "lr_warmup_iters"):
        if problem := _at_least_shown(_shown(v, field_name), getattr(r, field_name), 0):
            return problem
    for field_name in ("start_weight_decay", "end_weight_decay"):
        if getattr(r, field_name) is not None and (
            problem := _at_least_shown(_shown(v, field_name), getattr(r, field_name), 0)
        ):
            return problem
    for field_name in ("lr_decay_iters", "lr_wsd_decay_iters"):
        if getattr(r, field_name) is not None and (
            problem := _at_least_shown(_shown(v, field_name), getattr(r, field_name), 1)
        ):
            return problem
    return None


@_rule("adam-betas")
def _adam_betas(v: Validation) -> str | None:
    """``optimizer.adam_beta1`` and ``adam_beta2`` are decay rates in [0, 1)."""
    r = v.preset.recipe
    for field_name in ("adam_beta1", "adam_beta2"):
        if problem := _at_least_shown(_shown(v, field_name), getattr(r, field_name), 0):
            return problem
        if getattr(r, field_name) >= 1:
            return f"{_shown(v, field_name)} must be below 1 (a decay rate in [0, 1))"
    return None


@_rule("adam-eps")
def _adam_eps(v: Validation) -> str | None:
    """``optimizer.adam_eps`` is a positive number."""
    eps = v.preset.recipe.adam_eps
    if not (_is_number(eps) and eps > 0):
        return f"{_shown(v, 'adam_eps')} must be a positive number"
    return None


@_rule("schedule-styles")
def _schedule_styles(v: Validation) -> str | None:
    """The decay, weight-decay increment and WSD annealing styles are OptimizerParamScheduler's."""
    r = v.preset.recipe
    for field_name, choices in (
        ("lr_decay_style", LR_DECAY_STYLES),
        ("weight_decay_incr_style", WD_INCR_STYLES),
        ("lr_wsd_decay_style", WSD_DECAY_STYLES),
    ):
        if getattr(r, field_name) not in choices:
            return f"{_shown(v, field_name)} is unknown; choose one of: {', '.join(choices)}"
    return None


@_rule("min-lr-below-lr")
def _min_lr_below_lr(v: Validation) -> str | None:
    """The schedule decays from ``lr`` down to ``min_lr``."""
    r = v.preset.recipe
    if r.min_lr > r.lr:
        return (
            f"{_shown(v, 'min_lr')} is above {_shown(v, 'lr')}: the schedule decays from lr down to min_lr; "
            "lower optimizer.min_lr (e.g. to 0)"
        )
    return None


@_rule("warmup-init-below-lr")
def _warmup_init_below_lr(v: Validation) -> str | None:
    """Warm-up rises from ``lr_warmup_init`` to ``lr``."""
    r = v.preset.recipe
    if r.lr_warmup_init > r.lr:
        return (
            f"{_shown(v, 'lr_warmup_init')} is above {_shown(v, 'lr')}: warm-up rises from lr_warmup_init "
            "to lr; lower scheduler.lr_warmup_init"
        )
    return None


@_rule("warmup-fraction")
def _warmup_fraction(v: Validation) -> str | None:
    """``scheduler.lr_warmup_fraction`` is in [0, 1), and excludes ``lr_warmup_iters``."""
    r = v.preset.recipe
    if r.lr_warmup_fraction is None:
        return None
    if not (_is_number(r.lr_warmup_fraction) and 0 <= r.lr_warmup_fraction < 1):
        return f"{_shown(v, 'lr_warmup_fraction')} must be in [0, 1), or None"
    if r.lr_warmup_iters:
        return (
            f"{_shown(v, 'lr_warmup_fraction')} and {_shown(v, 'lr_warmup_iters')}: give only one of them; "
            "set scheduler.lr_warmup_iters=0 or scheduler.lr_warmup_fraction=None"
        )
    return None


@_rule("warmup-before-decay")
def _warmup_before_decay(v: Validation) -> str | None:
    """Warm-up iterations end before the decay ones (``lr_decay_iters``, else ``train.train_iters``)."""
    r = v.preset.recipe
    if r.lr_warmup_fraction is not None:
        return None
    if r.lr_decay_iters is not None and r.lr_warmup_iters >= r.lr_decay_iters:
        return (
            f"{_shown(v, 'lr_warmup_iters')} is not below {_shown(v, 'lr_decay_iters')}: Megatron's "
            "scheduler warms up before it decays; lower scheduler.lr_warmup_iters or raise "
            "scheduler.lr_decay_iters"
        )
    if r.lr_decay_iters is None and r.lr_warmup_iters >= v.cfg.train.train_iters:
        return (
            f"{_shown(v, 'lr_warmup_iters')} is not below train.train_iters={v.cfg.train.train_iters} (the "
            "decay iterations when scheduler.lr_decay_iters is None): Megatron's scheduler warms up before "
            "it decays; lower scheduler.lr_warmup_iters or set scheduler.lr_decay_iters"
        )
    return None


@_rule("wsd-decay-iters")
def _wsd_decay_iters(v: Validation) -> str | None:
    """The WSD schedule needs ``scheduler.lr_wsd_decay_iters``."""
    r = v.preset.recipe
    if r.lr_decay_style == "WSD" and r.lr_wsd_decay_iters is None:
        return (
            f"{_shown(v, 'lr_decay_style')} needs scheduler.lr_wsd_decay_iters (the annealing iterations): "
            "set it, or choose another scheduler.lr_decay_style"
        )
    return None


def _weight_decay_ends(v: Validation) -> tuple[float, float]:
    r = v.preset.recipe
    start = r.weight_decay if r.start_weight_decay is None else r.start_weight_decay
    end = r.weight_decay if r.end_weight_decay is None else r.end_weight_decay
    return start, end


@_rule("weight-decay-increases")
def _weight_decay_increases(v: Validation) -> str | None:
    """Weight decay only increases over a run (end at least start)."""
    start, end = _weight_decay_ends(v)
    if end < start:
        return (
            f"{_shown(v, 'end_weight_decay', end)} is below {_shown(v, 'start_weight_decay', start)}: weight "
            "decay only increases over a run; swap them or make them equal"
        )
    return None


@_rule("constant-weight-decay")
def _constant_weight_decay(v: Validation) -> str | None:
    """A constant weight-decay style has equal start and end."""
    start, end = _weight_decay_ends(v)
    if v.preset.recipe.weight_decay_incr_style == "constant" and start != end:
        return (
            f"{_shown(v, 'weight_decay_incr_style')} with {_shown(v, 'start_weight_decay', start)} != "
            f"{_shown(v, 'end_weight_decay', end)}: make them equal or set "
            "scheduler.weight_decay_incr_style='linear' or 'cosine'"
        )
    return None


@_rule("schedule-source")
def _schedule_source(v: Validation) -> str | None:
    """The schedule comes from the config or from the checkpoint, not both."""
    r = v.preset.recipe
    if r.override_opt_param_scheduler and r.use_checkpoint_opt_param_scheduler:
        return (
            f"{_shown(v, 'override_opt_param_scheduler')} and "
            f"{_shown(v, 'use_checkpoint_opt_param_scheduler')} exclude each other (the schedule comes "
            "from the config or from the checkpoint): set one False"
        )
    return None


#: the HybridModel layer symbols the harness builds (local, non-Transformer-Engine specs)
HYBRID_SYMBOLS = {"*": "self-attention", "-": "MLP", "E": "MoE"}


@_rule("hybrid-model-available")
def _hybrid_model_available(v: Validation) -> str | None:
    """A hybrid layer pattern needs a megatron-core with HybridModel."""
    pattern = v.preset.hybrid_layer_pattern
    if pattern is not None and (problem := versions.hybrid_model_problem()):
        return (
            f"model.hybrid_layer_pattern={pattern!r}: {problem}; "
            "set model.hybrid_layer_pattern=None (a GPTModel)"
        )
    return None


@_rule("hybrid-pattern-symbols")
def _hybrid_pattern_symbols(v: Validation) -> str | None:
    """A hybrid layer pattern uses only the layer symbols the harness builds."""
    pattern = v.preset.hybrid_layer_pattern
    if pattern is None:
        return None
    unknown = sorted(set(pattern) - set(HYBRID_SYMBOLS))
    if not pattern or unknown:
        return (
            f"model.hybrid_layer_pattern={pattern!r}: the harness builds "
            f"{', '.join(f'{k!r} ({what})' for k, what in HYBRID_SYMBOLS.items())} layers only"
            + (f", not {unknown[0]!r}" if unknown else "")
            + "; write a pattern such as '*-*-'"
        )
    return None


@_rule("hybrid-moe-experts")
def _hybrid_moe_experts(v: Validation) -> str | None:
    """A MoE layer (``E``) needs its experts counted (megatron-core's ``num_moe_experts``)."""
    pattern = v.preset.hybrid_layer_pattern
    if pattern is not None and "E" in pattern and not v.preset.transformer_overrides.get("num_moe_experts"):
        return (
            f"model.hybrid_layer_pattern={pattern!r} has a MoE layer ('E') but "
            "model.num_moe_experts is not set: set it, e.g. model.num_moe_experts=4 "
            "(or use the tiny-hybrid-moe preset)"
        )
    return None


@_rule("hybrid-pattern-layers")
def _hybrid_pattern_layers(v: Validation) -> str | None:
    """A HybridModel has one layer per pattern symbol."""
    preset = v.preset
    pattern = preset.hybrid_layer_pattern
    if pattern is not None and preset.num_layers != len(pattern):
        return (
            f"model.hybrid_layer_pattern={pattern!r} has {len(pattern)} layers but "
            f"model.num_layers={preset.num_layers}: a HybridModel has one layer per symbol; "
            f"set model.num_layers={len(pattern)}"
        )
    return None


@_rule("global-batch-size")
def _global_batch_size(v: Validation) -> str | None:
    """``train.global_batch_size``, when set, is micro batch * micro-batches * data-parallel size."""
    cfg = v.cfg
    if v.world_size is None or cfg.train.global_batch_size is None:
        return None
    micro, micro_batches = v.preset.micro_batch_size, v.preset.num_microbatches
    dp = v.world_size // cfg.model_parallel_size
    expected = micro * micro_batches * dp
    if cfg.train.global_batch_size != expected:
        return (
            f"train.global_batch_size={cfg.train.global_batch_size} != micro_batch_size {micro} * "
            f"num_microbatches {micro_batches} * data-parallel size {dp} = {expected}: "
            "set train.global_batch_size=None or adjust train.num_microbatches"
        )
    return None


@_rule("average-in-collective", warns=True)
def _average_in_collective(v: Validation) -> str | None:
    """Megatron-FSDP switches ``ddp.average_in_collective`` off (as Megatron does)."""
    if v.fsdp and v.cfg.ddp.average_in_collective:
        return (
            "ddp.average_in_collective=True is not supported with Megatron-FSDP; "
            "switching it to False (as Megatron does)"
        )
    return None


@_rule("megatron-fsdp-v2-available")
def _megatron_fsdp_v2_available(v: Validation) -> str | None:
    """``ddp.megatron_fsdp_version=2`` needs a megatron-core with Megatron-FSDP V2."""
    if v.fsdp and v.cfg.ddp.megatron_fsdp_version == 2 and (problem := versions.megatron_fsdp_v2_problem()):
        return f"ddp.megatron_fsdp_version=2: {problem}; set ddp.megatron_fsdp_version=1"
    return None


@_rule("distributed-optimizer-forced", warns=True)
def _distributed_optimizer_forced(v: Validation) -> str | None:
    """Megatron-FSDP V1 switches the distributed optimizer on (as Megatron does)."""
    if v.fsdp and v.cfg.ddp.megatron_fsdp_version == 1 and not v.cfg.ddp.use_distributed_optimizer:
        return (
            "ddp.use_distributed_optimizer=False: Megatron-FSDP requires the distributed optimizer; "
            "switching it on (as Megatron does)"
        )
    return None


@_rule("overlap-param-gather-optimizer")
def _overlap_param_gather_optimizer(v: Validation) -> str | None:
    """Overlapped parameter gathering needs the distributed optimizer or Megatron-FSDP."""
    ddp = v.cfg.ddp
    if ddp.overlap_param_gather and not (v.fsdp or ddp.use_distributed_optimizer):
        # Megatron-LM's arguments.py asserts it; megatron-core 0.19's DDP otherwise takes its
        # layer-wise-optimizer path and fails in start_param_sync (layerwise_param_flat_sizes is None).
        return (
            "ddp.overlap_param_gather=True with Megatron DDP and ddp.use_distributed_optimizer=False: "
            "overlapped parameter gathering needs the distributed optimizer or Megatron-FSDP; set "
            "ddp.overlap_param_gather=False (or ddp.use_distributed_optimizer=True)"
        )
    return None


@_rule("overlap-param-gather-grad-reduce")
def _overlap_param_gather_grad_reduce(v: Validation) -> str | None:
    """Overlapped parameter gathering needs overlapped gradient reduction (Megatron-LM)."""
    ddp = v.cfg.ddp
    if ddp.overlap_param_gather and not ddp.overlap_grad_reduce:
        return (
            "ddp.overlap_param_gather=True with ddp.overlap_grad_reduce=False: Megatron-LM requires "
            "overlap_grad_reduce whenever parameter gathering overlaps; set ddp.overlap_grad_reduce=True "
            "or ddp.overlap_param_gather=False"
        )
    return None


@_rule("megatron-field-names")
def _megatron_field_names(v: Validation) -> str | None:
    """Free-form fields (``ddp.extra``, ``model.overrides``, the preset's transformer overrides)
    exist on the installed megatron-core's dataclasses: a typo must not pass silently."""
    cfg = v.cfg
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
            return (
                f"unknown config field {section}.{unknown[0]}: megatron-core "
                f"{versions.package_version('megatron-core')}'s {class_name} has no such field; "
                "check the spelling"
            )
    return None


@_rule("checkpoint-needs-megatron-fsdp")
def _checkpoint_needs_megatron_fsdp(v: Validation) -> str | None:
    """A save or load here needs Megatron-FSDP: fsdp_dtensor checkpoints hold its DTensors."""
    if v.purpose != "build" and not v.fsdp:
        return (
            f"checkpoint.ckpt_format={v.cfg.checkpoint.ckpt_format!r} save/load here needs Megatron-FSDP "
            "(dist.use_megatron_fsdp=True): fsdp_dtensor checkpoints hold Megatron-FSDP's DTensors"
        )
    return None


@_rule("checkpoint-megatron-fsdp-v2")
def _checkpoint_megatron_fsdp_v2(v: Validation) -> str | None:
    """This harness's fsdp_dtensor checkpoints are V1's (V2 saves through ``fsdp.checkpoint_v2``)."""
    if v.purpose != "build" and v.cfg.ddp.megatron_fsdp_version == 2:
        return (
            f"ddp.megatron_fsdp_version=2 with checkpoint {v.purpose}: this harness's fsdp_dtensor "
            "checkpoints hold V1's distributed-optimizer state, and V2's FullyShardedOptimizer has no "
            "state dict; save V2 with fsdp.checkpoint_v2.save_dcp / load_dcp (DCP), or set "
            "ddp.megatron_fsdp_version=1"
        )
    return None


@_rule("backend-matches-session")
def _backend_matches_session(v: Validation) -> str | None:
    """``dist.backend``, when set, is the session's process-group backend."""
    if v.backend is not None and v.cfg.dist.backend is not None and v.cfg.dist.backend != v.backend:
        return (
            f"dist.backend={v.cfg.dist.backend!r} but this session's process group uses {v.backend!r} "
            f"(platform {v.platform}): set dist.backend=None or switch platform"
        )
    return None


@_rule("cpu-ddp-distributed-optimizer")
def _cpu_ddp_distributed_optimizer(v: Validation) -> str | None:
    """Megatron DDP with the distributed optimizer fails on CPU ranks (a torch.cuda type check)."""
    plain_ddp = not v.fsdp and not v.cfg.dist.use_torch_fsdp2
    if v.platform == "cpu" and plain_ddp and v.cfg.ddp.use_distributed_optimizer:
        return (
            "ddp.use_distributed_optimizer=True with Megatron DDP on CPU ranks: megatron-core's "
            "DDP + DistributedOptimizer path fails a torch.cuda type check on CPU; set "
            "ddp.use_distributed_optimizer=False"
        )
    return None


#: every config rule, in the order :func:`validate` checks them
RULES: tuple[Rule, ...] = tuple(_RULES)


def _choice(
    dotted: str, value: Any, choices: tuple[str, ...], none_ok: bool = False, none_means: str = ""
) -> str | None:
    """``value`` is one of ``choices`` (or None, with ``none_ok``; ``none_means`` says what None means)."""
    if value is None and none_ok:
        return None
    if value not in choices:
        return f"{dotted}={value!r} is unknown; choose one of: {', '.join(choices)}" + (
            f" (or None{': ' + none_means if none_means else ''})" if none_ok else ""
        )
    return None


def _at_least(dotted: str, value: Any, minimum: float, none_ok: bool = False) -> str | None:
    if value is None and none_ok:
        return None
    return _at_least_shown(f"{dotted}={value!r}", value, minimum)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _at_least_shown(shown: str, value: Any, minimum: float) -> str | None:
    """``shown`` is ``section.field=value`` already."""
    if not _is_number(value):
        return f"{shown} must be a finite number"
    if value < minimum:
        return f"{shown} must be at least {minimum:g}"
    return None


def enable_megatron_fsdp(cfg: RunConfig) -> RunConfig:
    """Megatron-Bridge's minimal override: what Bridge users set to turn Megatron-FSDP on."""
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


def use_megatron_ddp(cfg: RunConfig, *, distributed_optimizer: bool) -> RunConfig:
    """``cfg`` switched to Megatron's DDP wrapper. Without the distributed optimizer (Megatron DDP's
    fails a torch.cuda type check on CPU ranks) parameter gathering cannot overlap either
    (Megatron-LM's rule, which validate() enforces)."""
    disable_megatron_fsdp(cfg)
    if not distributed_optimizer:
        cfg.ddp.use_distributed_optimizer = False
        cfg.ddp.overlap_param_gather = False
    return cfg


def starting_config(
    platform: str,
    *,
    preset: str | None = None,
    use_megatron_fsdp: bool = True,
    assignments: Iterable[str] = (),
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    slow_bf16: bool = False,
) -> RunConfig:
    """The config a test's ``run_config`` starts from on ``platform`` ("cpu" or "cuda"), the one
    builder of it: Megatron-Bridge's Megatron-FSDP override, the model ``preset`` (None: the
    platform's default), the model-parallel sizes, Megatron DDP instead where ``use_megatron_fsdp``
    is off (``--mfsdp-use-megatron-fsdp=false``; without the distributed optimizer on CPU ranks),
    then the ``section.field=value`` ``assignments`` in order (``--mfsdp-set``; a bad one raises
    ConfigError). ``slow_bf16``: bf16 matmuls are slow here (``train.slow_bf16_step``). Not
    validated: the rules that need a rank run when the run is built."""
    cfg = enable_megatron_fsdp(RunConfig())
    cfg.model.preset = preset or DEFAULT_PRESET[platform]
    cfg.train.slow_bf16_step = slow_bf16
    cfg.model.tensor_model_parallel_size = tp
    cfg.model.pipeline_model_parallel_size = pp
    cfg.model.context_parallel_size = cp
    if not use_megatron_fsdp:
        use_megatron_ddp(cfg, distributed_optimizer=platform != "cpu")
    for assignment in assignments:
        cfg.assign(assignment)
    return cfg


def ddp_baseline(cfg: RunConfig) -> RunConfig:
    """A copy of ``cfg`` that trains with Megatron's DDP instead of Megatron-FSDP: the baseline the
    parity tests compare with (same seed, same data), without the distributed optimizer on every
    platform (see :func:`use_megatron_ddp`)."""
    return use_megatron_ddp(cfg.copy(), distributed_optimizer=False)


def fix_checkpoint_format(cfg: RunConfig) -> str | None:
    """Megatron-Bridge's recipe pitfall: with Megatron-FSDP on, a recipe that still says ``torch_dist`` is
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
    """Megatron-Bridge's example recipe fixup: Megatron-FSDP on, fsdp_dtensor, save to ``save``, no load."""
    enable_megatron_fsdp(cfg)
    cfg.checkpoint.save = save
    cfg.checkpoint.load = None
    return cfg


def apply_perf_harness_overrides(cfg: RunConfig) -> RunConfig:
    """Bridge's performance harness (``launch.py --use_megatron_fsdp true``): its Megatron-FSDP
    overrides, as Bridge's Megatron-FSDP guide lists them (``keep_fp8_transpose_cache=False``,
    ``init_model_with_meta_device=True``, ``checkpoint.load=None``)."""
    cfg.ddp.use_megatron_fsdp = True
    cfg.ddp.data_parallel_sharding_strategy = "optim_grads_params"
    cfg.ddp.keep_fp8_transpose_cache = False
    cfg.ddp.average_in_collective = False
    cfg.model.init_model_with_meta_device = True
    cfg.checkpoint.load = None
    return cfg
