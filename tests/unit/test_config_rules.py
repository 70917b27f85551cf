"""The table of config rules (``fsdp.config.RULES``): every rule named, documented, and seen to fire.

Plain pytest; nothing here imports torch or megatron. Each rule has a config that breaks it (and
the rules before it hold): ``validate()`` names that rule in its error (``ConfigError.rule``), or,
for a rule where upstream only warns, returns its warning. A new rule without an entry in ``BAD``
fails :func:`test_every_rule_fires_on_its_bad_config`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from pytest_megatron_fsdp.fsdp import versions
from pytest_megatron_fsdp.fsdp.config import (
    RULES,
    ConfigError,
    RunConfig,
    disable_megatron_fsdp,
    enable_megatron_fsdp,
    findings,
    validate,
)


@dataclass
class Bad:
    """A config that breaks one rule: fields set on Megatron-FSDP's config (``plain``: on Megatron
    DDP's), what validate() is told, and the stack facts it depends on (patched, so the rule fires
    on every stack)."""

    fields: dict[str, Any] = field(default_factory=dict)
    plain: bool = False
    world_size: int | None = 2
    environ: dict[str, str] = field(default_factory=dict)
    purpose: str = "build"
    platform: str | None = None
    backend: str | None = None
    #: versions.<function> -> what it returns here
    stack: dict[str, Any] = field(default_factory=dict)

    def config(self) -> RunConfig:
        cfg = RunConfig()
        disable_megatron_fsdp(cfg) if self.plain else enable_megatron_fsdp(cfg)
        for dotted, value in self.fields.items():
            if dotted == "ddp.extra":  # free-form: set() would check the names first
                cfg.ddp.extra.update(value)
            else:
                cfg.set(dotted, value)
        return cfg


HYBRID_HERE = {"hybrid_model_problem": None}
V2_HERE = {"megatron_fsdp_v2_problem": None}

#: each breaks its rule just (where the rule has a bound): tiny's lr is 0.001, train_iters 10
BAD: dict[str, Bad] = {
    "megatron-fsdp-excludes-fsdp2": Bad({"dist.use_torch_fsdp2": True}),
    "ddp-megatron-fsdp-excludes-fsdp2": Bad({"dist.use_megatron_fsdp": False, "dist.use_torch_fsdp2": True}),
    "sharding-strategy": Bad({"ddp.data_parallel_sharding_strategy": "zero3"}),
    "checkpoint-format": Bad({"checkpoint.ckpt_format": "pickle"}),
    "backend": Bad({"dist.backend": "mpi"}),
    "tp-pp-dp-mapping": Bad({"dist.use_tp_pp_dp_mapping": True}),
    "megatron-fsdp-flags-differ": Bad({"ddp.use_megatron_fsdp": False}),
    "megatron-fsdp-needs-fsdp-dtensor": Bad({"checkpoint.ckpt_format": "torch_dist"}),
    "fsdp-dtensor-needs-megatron-fsdp": Bad({"checkpoint.save": "/ckpt"}, plain=True),
    "async-save-format": Bad({"checkpoint.ckpt_format": "torch", "checkpoint.async_save": True}, plain=True),
    "cuda-device-max-connections": Bad(environ={"CUDA_DEVICE_MAX_CONNECTIONS": "1"}),
    "model-preset": Bad({"model.preset": "huge"}),
    "parallel-sizes": Bad({"model.pipeline_model_parallel_size": 0}),
    "tp-cp-connections": Bad({"model.context_parallel_size": 2}),
    "recompute-granularity": Bad({"model.recompute_granularity": "some"}),
    "cpu-offloading-pipeline": Bad({"model.cpu_offloading": True, "model.pipeline_model_parallel_size": 2}),
    "cpu-offloading-recompute": Bad(
        {"model.cpu_offloading": True, "model.recompute_granularity": "selective"}
    ),
    "world-size-divisible": Bad({"model.pipeline_model_parallel_size": 2}, world_size=3),
    "outer-sharding-strategy": Bad({"ddp.outer_dp_sharding_strategy": "bogus"}),
    "megatron-fsdp-version": Bad({"ddp.megatron_fsdp_version": 3}),
    "ddp-sizes": Bad({"ddp.bucket_size": 0}),
    "recompute-method": Bad({"model.recompute_method": "weird"}),
    "layer-counts": Bad({"model.cpu_offloading_num_layers": -1}),
    "full-recompute-method": Bad({"model.recompute_granularity": "full"}),
    "full-recompute-layers": Bad(
        {"model.recompute_granularity": "full", "model.recompute_method": "uniform"}
    ),
    "selective-recompute-layers": Bad(
        {"model.recompute_granularity": "selective", "model.recompute_num_layers": 1}
    ),
    "train-sizes": Bad({"train.train_iters": 0}),
    "seed": Bad({"train.seed": -1}),
    "optimizer": Bad({"optimizer.optimizer": "lamb"}),
    "recipe-ranges": Bad({"optimizer.lr": -1.0}),
    "adam-betas": Bad({"optimizer.adam_beta1": 1.0}),
    "adam-eps": Bad({"optimizer.adam_eps": 0.0}),
    "schedule-styles": Bad({"scheduler.lr_decay_style": "bogus"}),
    "min-lr-below-lr": Bad({"optimizer.min_lr": 0.0011}),
    "warmup-init-below-lr": Bad({"scheduler.lr_warmup_init": 0.0011}),
    "warmup-fraction": Bad({"scheduler.lr_warmup_fraction": 1.0}),
    "warmup-before-decay": Bad({"scheduler.lr_warmup_iters": 10}),
    "wsd-decay-iters": Bad({"scheduler.lr_decay_style": "WSD"}),
    "weight-decay-increases": Bad({"scheduler.start_weight_decay": 0.2, "scheduler.end_weight_decay": 0.0}),
    "constant-weight-decay": Bad({"scheduler.start_weight_decay": 0.0, "scheduler.end_weight_decay": 0.3}),
    "schedule-source": Bad(
        {"scheduler.override_opt_param_scheduler": True, "scheduler.use_checkpoint_opt_param_scheduler": True}
    ),
    "hybrid-model-available": Bad(
        {"model.preset": "tiny-hybrid"}, stack={"hybrid_model_problem": "megatron-core has no HybridModel"}
    ),
    "hybrid-pattern-symbols": Bad(
        {"model.preset": "tiny-hybrid", "model.hybrid_layer_pattern": "*-x-"}, stack=HYBRID_HERE
    ),
    "hybrid-moe-experts": Bad(
        {"model.preset": "tiny-hybrid", "model.hybrid_layer_pattern": "*-*E"}, stack=HYBRID_HERE
    ),
    "hybrid-pattern-layers": Bad(
        {"model.preset": "tiny-hybrid", "model.hybrid_layer_pattern": "*-*"}, stack=HYBRID_HERE
    ),
    "global-batch-size": Bad({"train.global_batch_size": 3}),
    "average-in-collective": Bad({"ddp.average_in_collective": True}),
    "megatron-fsdp-v2-available": Bad(
        {"ddp.megatron_fsdp_version": 2}, stack={"megatron_fsdp_v2_problem": "megatron-core has no V2"}
    ),
    "distributed-optimizer-forced": Bad({"ddp.use_distributed_optimizer": False}),
    "overlap-param-gather-optimizer": Bad({"ddp.use_distributed_optimizer": False}, plain=True),
    "overlap-param-gather-grad-reduce": Bad({"ddp.overlap_grad_reduce": False}),
    "megatron-field-names": Bad(
        {"ddp.extra": {"no_such_field": 1}}, stack={"megatron_config_fields": frozenset({"bucket_size"})}
    ),
    "checkpoint-needs-megatron-fsdp": Bad(
        {"checkpoint.ckpt_format": "torch_dist"}, plain=True, purpose="save"
    ),
    "checkpoint-megatron-fsdp-v2": Bad({"ddp.megatron_fsdp_version": 2}, purpose="load", stack=V2_HERE),
    "backend-matches-session": Bad({"dist.backend": "nccl"}, platform="cpu", backend="gloo"),
    "cpu-ddp-distributed-optimizer": Bad(plain=True, platform="cpu"),
}


def _patch_stack(monkeypatch: pytest.MonkeyPatch, bad: Bad) -> None:
    for name, value in bad.stack.items():
        monkeypatch.setattr(versions, name, lambda *args, value=value: value)


def test_every_rule_has_a_unique_name_and_a_docstring():
    names = [rule.name for rule in RULES]
    assert len(names) == len(set(names))
    assert [rule.name for rule in RULES if len(rule.doc) < 20] == []


def test_every_bad_config_belongs_to_a_rule():
    assert sorted(set(BAD) - {rule.name for rule in RULES}) == []


@pytest.mark.parametrize("rule", RULES, ids=[rule.name for rule in RULES])
def test_every_rule_fires_on_its_bad_config(rule, monkeypatch):
    assert rule.name in BAD, f"add a config that breaks {rule.name} to BAD"
    bad = BAD[rule.name]
    _patch_stack(monkeypatch, bad)
    cfg = bad.config()
    kwargs = dict(purpose=bad.purpose, platform=bad.platform, backend=bad.backend)
    found = findings(cfg, bad.world_size, bad.environ, **kwargs)
    assert rule.name in [r.name for r, _ in found]
    message = dict((r.name, m) for r, m in found)[rule.name]
    assert "\n" not in message
    if rule.warns:
        assert message in validate(cfg, bad.world_size, bad.environ, **kwargs)
        return
    with pytest.raises(ConfigError) as refused:
        validate(cfg, bad.world_size, bad.environ, **kwargs)
    assert (refused.value.rule, str(refused.value)) == (rule.name, message)


def test_a_good_config_passes_every_rule():
    assert findings(enable_megatron_fsdp(RunConfig()), 2, {}) == []


def test_warnings_are_gathered_and_validation_goes_on_past_them():
    cfg = enable_megatron_fsdp(RunConfig())
    cfg.ddp.use_megatron_fsdp = False
    cfg.ddp.average_in_collective = True
    found = findings(cfg, 2, {})
    assert [rule.name for rule, _ in found] == ["megatron-fsdp-flags-differ", "average-in-collective"]
    assert validate(cfg, 2, {}) == [message for _, message in found]


def test_the_first_violation_ends_validation():
    cfg = enable_megatron_fsdp(RunConfig())
    cfg.ddp.use_megatron_fsdp = False
    cfg.ddp.average_in_collective = True
    cfg.train.seed = -1  # "seed" comes before "average-in-collective"
    cfg.optimizer.lr = -1.0  # "recipe-ranges" too: never reached
    assert [rule.name for rule, _ in findings(cfg, 2, {})] == ["megatron-fsdp-flags-differ", "seed"]
