"""Every value a run config takes, checked before anything runs: choices, ranges, and the optimizer
and learning-rate schedule (what Megatron's OptimizerConfig and OptimizerParamScheduler assert).

Plain pytest; nothing here imports torch or megatron.
"""

import dataclasses

import pytest

from pytest_megatron_fsdp.config import ConfigError, RunConfig, enable_megatron_fsdp, validate
from pytest_megatron_fsdp.fsdp.presets import PRESETS, TrainingRecipe

NO_ENV: dict[str, str] = {}


def fsdp(preset: str = "tiny") -> RunConfig:
    cfg = enable_megatron_fsdp(RunConfig())
    cfg.model.preset = preset
    return cfg


def refusal(cfg: RunConfig) -> str:
    with pytest.raises(ConfigError) as failure:
        validate(cfg, 2, NO_ENV)
    message = str(failure.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize(
    ("assignments", "fragments"),
    [
        (["ddp.outer_dp_sharding_strategy=optim_grads"], ["choose one of: no_shard, optim"]),
        (["ddp.bucket_size=0"], ["ddp.bucket_size=0 must be at least 1"]),
        (["ddp.num_distributed_optimizer_instances=0"], ["must be at least 1"]),
        (["ddp.suggested_communication_unit_size=-5"], ["must be at least 1"]),
        (["model.recompute_method=layer"], ["model.recompute_method='layer'", "uniform, block (or None)"]),
        (["model.recompute_num_layers=0"], ["model.recompute_num_layers=0 must be at least 1"]),
        (["model.cpu_offloading_num_layers=-1"], ["must be at least 0"]),
        (
            ["model.recompute_granularity=full", "model.recompute_num_layers=1"],
            ["model.recompute_method=None", "set model.recompute_method='uniform' or 'block'"],
        ),
        (
            ["model.recompute_granularity=full", "model.recompute_method=uniform"],
            ["model.recompute_num_layers=None", "needs a layer count"],
        ),
        (
            ["model.recompute_granularity=selective", "model.recompute_num_layers=2"],
            ["model.recompute_num_layers=2", "set model.recompute_num_layers=None"],
        ),
        (["train.micro_batch_size=0"], ["train.micro_batch_size=0 must be at least 1"]),
        (["train.seq_length=0"], ["train.seq_length=0 must be at least 1"]),
        (["train.global_batch_size=0"], ["train.global_batch_size=0 must be at least 1"]),
        (["train.seed=-1"], ["train.seed=-1 must be at least 0"]),
        (["optimizer.optimizer=lamb"], ["optimizer.optimizer='lamb'", "adam, sgd"]),
        (["optimizer.lr=-0.1"], ["optimizer.lr=-0.1 must be at least 0"]),
        (["optimizer.lr=nan"], ["optimizer.lr=nan must be a finite number"]),
        (["optimizer.clip_grad=-1"], ["optimizer.clip_grad=-1.0 must be at least 0"]),
        (["optimizer.weight_decay=-0.01"], ["optimizer.weight_decay=-0.01 must be at least 0"]),
        (["optimizer.adam_beta1=1"], ["optimizer.adam_beta1=1.0 must be below 1"]),
        (["optimizer.adam_beta2=-0.5"], ["optimizer.adam_beta2=-0.5 must be at least 0"]),
        (["optimizer.adam_eps=0"], ["optimizer.adam_eps=0.0 must be a positive number"]),
        (
            ["optimizer.lr=1e-4", "optimizer.min_lr=1e-3"],
            ["optimizer.min_lr=0.001 is above optimizer.lr=0.0001", "lower optimizer.min_lr"],
        ),
        (["scheduler.lr_decay_style=step"], ["scheduler.lr_decay_style='step'", "constant, linear, cosine"]),
        (["scheduler.weight_decay_incr_style=exp"], ["scheduler.weight_decay_incr_style='exp'", "cosine"]),
        (["scheduler.lr_wsd_decay_style=sqrt"], ["scheduler.lr_wsd_decay_style='sqrt'", "minus_sqrt"]),
        (["scheduler.lr_warmup_iters=-1"], ["scheduler.lr_warmup_iters=-1 must be at least 0"]),
        (["scheduler.lr_decay_iters=0"], ["scheduler.lr_decay_iters=0 must be at least 1"]),
        (
            ["scheduler.lr_warmup_iters=10"],
            [
                "scheduler.lr_warmup_iters=10 is not below train.train_iters=10",
                "set scheduler.lr_decay_iters",
            ],
        ),
        (
            ["scheduler.lr_warmup_iters=5", "scheduler.lr_decay_iters=5", "train.train_iters=20"],
            ["scheduler.lr_warmup_iters=5 is not below scheduler.lr_decay_iters=5"],
        ),
        (["scheduler.lr_warmup_fraction=1.0"], ["scheduler.lr_warmup_fraction=1.0 must be in [0, 1)"]),
        (
            ["scheduler.lr_warmup_fraction=0.1", "scheduler.lr_warmup_iters=2"],
            ["give only one of them", "scheduler.lr_warmup_iters=0 or scheduler.lr_warmup_fraction=None"],
        ),
        (["scheduler.lr_warmup_init=0.5"], ["scheduler.lr_warmup_init=0.5 is above optimizer.lr=0.001"]),
        (["scheduler.lr_decay_style=WSD"], ["needs scheduler.lr_wsd_decay_iters"]),
        (
            ["scheduler.start_weight_decay=0.1", "scheduler.end_weight_decay=0.01"],
            ["scheduler.end_weight_decay=0.01 is below scheduler.start_weight_decay=0.1"],
        ),
        (
            ["scheduler.start_weight_decay=0.0", "scheduler.end_weight_decay=0.1"],
            [
                "scheduler.weight_decay_incr_style='constant'",
                "set scheduler.weight_decay_incr_style='linear'",
            ],
        ),
        (
            [
                "scheduler.override_opt_param_scheduler=true",
                "scheduler.use_checkpoint_opt_param_scheduler=true",
            ],
            ["exclude each other", "set one False"],
        ),
    ],
)
def test_each_bad_value_is_one_line_naming_field_value_and_fix(assignments, fragments):
    cfg = fsdp()
    for assignment in assignments:
        cfg.assign(assignment)
    message = refusal(cfg)
    for fragment in fragments:
        assert fragment in message, message


def test_a_value_the_preset_gave_is_named_as_the_presets():
    cfg = fsdp("bridge-reference")
    cfg.optimizer.lr = 0.0  # below the preset's min_lr
    message = refusal(cfg)
    assert "optimizer.min_lr=1e-06 (the bridge-reference preset's) is above optimizer.lr=0.0" in message


def test_warmup_against_the_runs_length_counts_train_iters_the_test_sets():
    cfg = fsdp("bridge-reference")  # 2 warm-up iterations
    cfg.train.train_iters = 2
    assert "scheduler.lr_warmup_iters=2 (the bridge-reference preset's) is not below train.train_iters=2" in (
        refusal(cfg)
    )
    cfg.train.train_iters = 3
    assert validate(cfg, 2, NO_ENV) == []


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_preset_is_valid_as_it_comes(preset):
    """Valid as it comes; a HybridModel preset on a megatron-core without HybridModel (0.16.1) is
    refused in one line naming the field and the fix."""
    from pytest_megatron_fsdp.fsdp import versions

    cfg = fsdp(preset)
    if PRESETS[preset].hybrid_layer_pattern and versions.hybrid_model_problem():
        refused = r"model\.hybrid_layer_pattern=.*set model\.hybrid_layer_pattern=None"
        with pytest.raises(ConfigError, match=refused):
            validate(cfg, 2, NO_ENV)
        return
    assert validate(cfg, 2, NO_ENV) == []


def test_recipe_fields_left_unset_take_the_presets_and_set_ones_win():
    cfg = fsdp("bridge-reference")
    assert cfg.resolved_recipe() == PRESETS["bridge-reference"].recipe
    cfg.assign("optimizer.clip_grad=0.5")
    cfg.assign("scheduler.lr_decay_style=linear")
    recipe = cfg.resolved_recipe()
    assert (recipe.clip_grad, recipe.lr_decay_style) == (0.5, "linear")
    assert recipe.lr == 3e-3
    assert recipe.lr_warmup_iters == 2  # the rest stays the preset's
    assert cfg.resolved_preset().recipe == recipe


def test_every_recipe_field_is_settable_from_its_section():
    cfg = fsdp()
    for field in dataclasses.fields(TrainingRecipe):
        section = "optimizer" if hasattr(cfg.optimizer, field.name) else "scheduler"
        assert hasattr(getattr(cfg, section), field.name), field.name
        assert getattr(getattr(cfg, section), field.name) is None  # None: the preset's


def test_the_bridge_reference_recipe_is_bridges_functional_test():
    # Megatron-Bridge tests/functional_tests/training/test_megatron_fsdp.py:
    # create_base_optimizer_config / create_base_scheduler_config / create_base_training_config
    recipe = dataclasses.asdict(PRESETS["bridge-reference"].recipe)
    bridge = {
        "lr": 3e-3,
        "min_lr": 1e-6,
        "weight_decay": 0.01,
        "clip_grad": 1.0,
        "adam_beta1": 0.9,
        "adam_beta2": 0.95,
        "adam_eps": 1e-5,
        "lr_decay_style": "cosine",
        "lr_decay_iters": None,  # Bridge: total_iters, i.e. train.train_iters
        "lr_warmup_iters": 2,
        "lr_warmup_init": 0.0,
        "start_weight_decay": 0.033,
        "end_weight_decay": 0.033,
        "weight_decay_incr_style": "constant",
        "override_opt_param_scheduler": True,
    }
    assert {name: recipe[name] for name in bridge} == bridge
    preset = PRESETS["bridge-reference"]
    assert preset.micro_batch_size * preset.num_microbatches * 2 == 8  # global batch 8 on 2 ranks
    assert preset.data == "mock-gpt"


def test_the_tiny_recipe_keeps_a_constant_rate_without_clipping():
    recipe = PRESETS["tiny"].recipe
    assert (recipe.lr, recipe.lr_decay_style, recipe.lr_warmup_iters, recipe.clip_grad) == (
        1e-3,
        "constant",
        0,
        0.0,
    )


def test_a_presets_description_is_made_from_its_fields():
    """Descriptions are generated: a preset changed in a field says so in its one line (and in
    ``--mfsdp-preset``'s help), with no second copy of its shape to update."""
    changed = dataclasses.replace(PRESETS["tiny"], hidden_size=96, num_query_groups=2, swiglu=True, bf16=True)
    assert changed.description == (
        "the CPU default, trains in about a second: 2 layers, hidden 96, ffn 256, 4 heads, 2 query groups, "
        "vocab 128, seq 32, SwiGLU, bf16"
    )
    assert "MoE of 4 experts, top-2" in PRESETS["tiny-hybrid-moe"].description
    from pytest_megatron_fsdp.options import OPTIONS

    assert all(preset.description in OPTIONS["preset"].help for preset in PRESETS.values())
