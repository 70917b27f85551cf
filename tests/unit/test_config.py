"""The config surface: every validation rule (Bridge's and Megatron-LM's), the seed's helpers, set/assign.

Plain pytest; nothing here imports torch or megatron.
"""

import dataclasses
import subprocess
import sys

import pytest

from pytest_megatron_fsdp.config import (
    ConfigError,
    RunConfig,
    apply_perf_harness_overrides,
    disable_megatron_fsdp,
    enable_megatron_fsdp,
    fix_checkpoint_format,
    recipe_fixup,
    validate,
)

NO_ENV: dict[str, str] = {}


def flat(cfg: RunConfig) -> dict:
    return {
        f"{section}.{name}": value
        for section, fields in dataclasses.asdict(cfg).items()
        for name, value in fields.items()
    }


def changed(before: RunConfig, after: RunConfig) -> dict:
    a, b = flat(before), flat(after)
    return {key: b[key] for key in a if a[key] != b[key]}


def bridge_recipe() -> RunConfig:
    """A recipe as Bridge ships them: FSDP off, torch_dist, averaging in the collective."""
    cfg = RunConfig()
    cfg.dist.use_megatron_fsdp = False
    cfg.ddp.use_megatron_fsdp = False
    cfg.ddp.data_parallel_sharding_strategy = "no_shard"
    cfg.ddp.average_in_collective = True
    cfg.ddp.keep_fp8_transpose_cache = True
    cfg.checkpoint.ckpt_format = "torch_dist"
    cfg.checkpoint.load = "/ckpt/in"
    return cfg


def fsdp() -> RunConfig:
    return enable_megatron_fsdp(RunConfig())


def rejects(cfg, *fragments, world_size=2, environ=NO_ENV):
    with pytest.raises(ConfigError) as failure:
        validate(cfg, world_size, environ)
    message = str(failure.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, message
    return message


# --- validation rules -------------------------------------------------------------------------


def test_default_fsdp_config_is_valid_without_warnings():
    assert validate(fsdp(), 2, NO_ENV) == []


def test_megatron_fsdp_and_torch_fsdp2_are_exclusive():
    cfg = fsdp()
    cfg.dist.use_torch_fsdp2 = True
    rejects(cfg, "dist.use_megatron_fsdp=True", "dist.use_torch_fsdp2=True", "mutually exclusive", "set one")


def test_ddp_megatron_fsdp_flag_and_torch_fsdp2_are_exclusive():
    cfg = fsdp()
    cfg.dist.use_megatron_fsdp = False
    cfg.dist.use_torch_fsdp2 = True
    rejects(cfg, "ddp.use_megatron_fsdp=True", "dist.use_torch_fsdp2=True", "set ddp.use_megatron_fsdp=False")


def test_average_in_collective_is_switched_off_with_a_message():
    cfg = fsdp()
    cfg.ddp.average_in_collective = True
    assert validate(cfg, 2, NO_ENV) == [
        "ddp.average_in_collective=True is not supported with Megatron-FSDP; "
        "switching it to False (as Megatron does)"
    ]


def test_distributed_optimizer_is_forced_on_with_a_message():
    cfg = fsdp()
    cfg.ddp.use_distributed_optimizer = False
    (message,) = validate(cfg, 2, NO_ENV)
    assert "ddp.use_distributed_optimizer=False" in message
    assert "switching it on" in message


@pytest.mark.parametrize("which", ["save", "load"])
def test_save_or_load_requires_fsdp_dtensor(which):
    cfg = fsdp()
    cfg.checkpoint.ckpt_format = "torch_dist"
    setattr(cfg.checkpoint, which, "/ckpt")
    rejects(
        cfg, "checkpoint.ckpt_format='torch_dist'", "only supports fsdp_dtensor", "ckpt_format='fsdp_dtensor'"
    )


@pytest.mark.parametrize("fmt", ["torch_dist", "torch", "zarr"])
def test_other_formats_are_refused_with_megatron_fsdp_even_without_save_or_load(fmt):
    cfg = fsdp()
    cfg.checkpoint.ckpt_format = fmt
    assert not cfg.checkpoint.save
    assert not cfg.checkpoint.load
    rejects(
        cfg, f"checkpoint.ckpt_format={fmt!r} with Megatron-FSDP", "set checkpoint.ckpt_format='fsdp_dtensor'"
    )


def test_other_formats_are_fine_without_megatron_fsdp_and_without_save_or_load():
    cfg = disable_megatron_fsdp(fsdp())
    cfg.checkpoint.ckpt_format = "torch_dist"
    assert validate(cfg, 2, NO_ENV) == []


def test_cuda_device_max_connections_1_is_rejected_with_fsdp():
    rejects(
        fsdp(), "CUDA_DEVICE_MAX_CONNECTIONS='1'", "unset it", environ={"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    )


def test_cuda_device_max_connections_is_read_from_the_environment(monkeypatch):
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    with pytest.raises(ConfigError, match="CUDA_DEVICE_MAX_CONNECTIONS='1'"):
        validate(fsdp(), 2)
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8")
    assert validate(fsdp(), 2) == []


def test_cuda_device_max_connections_1_is_fine_without_fsdp():
    cfg = disable_megatron_fsdp(fsdp())
    assert validate(cfg, 2, {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}) == []


@pytest.mark.parametrize("field", ["tensor_model_parallel_size", "context_parallel_size"])
def test_tp_or_cp_above_1_with_fsdp_warns_about_cuda_device_max_connections(field):
    cfg = fsdp()
    setattr(cfg.model, field, 2)
    (message,) = validate(cfg, 2, {"CUDA_DEVICE_MAX_CONNECTIONS": "8"})
    assert f"model.{field}=2" in message
    assert "CUDA_DEVICE_MAX_CONNECTIONS" in message
    assert "'8'" in message


def test_tp_pp_dp_mapping_is_unsupported_with_fsdp():
    cfg = fsdp()
    cfg.dist.use_tp_pp_dp_mapping = True
    rejects(cfg, "dist.use_tp_pp_dp_mapping=True", "not supported with Megatron-FSDP", "set it to False")


def test_cpu_offloading_needs_pipeline_parallel_1():
    cfg = fsdp()
    cfg.model.cpu_offloading = True
    cfg.model.pipeline_model_parallel_size = 2
    rejects(
        cfg,
        "model.cpu_offloading=True",
        "model.pipeline_model_parallel_size=2",
        "needs pipeline parallel size 1",
    )


def test_cpu_offloading_excludes_recompute():
    cfg = fsdp()
    cfg.model.cpu_offloading = True
    cfg.model.recompute_granularity = "full"
    rejects(
        cfg, "model.cpu_offloading=True", "model.recompute_granularity='full'", "recompute_granularity=None"
    )


def test_fsdp_dtensor_checkpoints_need_megatron_fsdp():
    cfg = disable_megatron_fsdp(fsdp())
    cfg.checkpoint.save = "/ckpt"
    rejects(cfg, "ckpt_format='fsdp_dtensor'", "dist.use_megatron_fsdp=False", "need Megatron-FSDP")


def test_fsdp_dtensor_checkpoints_reject_fsdp2():
    cfg = disable_megatron_fsdp(fsdp())
    cfg.dist.use_torch_fsdp2 = True
    cfg.checkpoint.load = "/ckpt"
    rejects(cfg, "dist.use_torch_fsdp2=True", "(not FSDP2)", "ckpt_format='torch_dist'")


@pytest.mark.parametrize("fmt", ["torch", "zarr"])
def test_async_save_only_for_torch_dist_or_fsdp_dtensor(fmt):
    cfg = disable_megatron_fsdp(fsdp())
    cfg.ddp.use_distributed_optimizer = False
    cfg.checkpoint.ckpt_format = fmt
    cfg.checkpoint.async_save = True
    rejects(cfg, "checkpoint.async_save=True", f"ckpt_format={fmt!r}", "torch_dist, fsdp_dtensor")


def test_async_save_with_fsdp_dtensor_is_fine():
    cfg = fsdp()
    cfg.checkpoint.async_save = True
    cfg.checkpoint.save = "/ckpt"
    assert validate(cfg, 2, NO_ENV) == []


def test_world_size_must_be_divisible_by_model_parallel_size():
    cfg = fsdp()
    cfg.model.tensor_model_parallel_size = 2
    cfg.model.context_parallel_size = 2
    rejects(cfg, "world size 6 is not divisible by tp*pp*cp=4", world_size=6)
    assert validate(cfg, 8, {"CUDA_DEVICE_MAX_CONNECTIONS": "8"})  # only the TP/CP warning


@pytest.mark.parametrize(
    ("dotted", "value", "fragment"),
    [
        ("ddp.data_parallel_sharding_strategy", "zero3", "choose one of: no_shard, optim"),
        ("checkpoint.ckpt_format", "pickle", "choose one of: fsdp_dtensor"),
        ("dist.backend", "mpi", "choose one of: nccl, gloo"),
        ("model.recompute_granularity", "some", "choose one of: full, selective"),
        ("model.preset", "huge", "choose one of: bridge-reference, tiny"),
        ("model.pipeline_model_parallel_size", 0, "must be a positive integer"),
        ("train.train_iters", 0, "must be at least 1"),
        ("train.num_microbatches", 0, "must be at least 1"),
    ],
)
def test_bad_values_name_field_value_and_fix(dotted, value, fragment):
    cfg = fsdp()
    cfg.set(dotted, value)
    rejects(cfg, f"{dotted}={value!r}" if dotted != "model.preset" else "model.preset='huge'", fragment)


def test_global_batch_size_must_match_micro_batches_and_dp():
    cfg = fsdp()
    cfg.train.num_microbatches = 4
    cfg.train.global_batch_size = 8
    rejects(cfg, "train.global_batch_size=8", "= 16", "num_microbatches")
    cfg.train.global_batch_size = 16  # micro 2 (tiny) x 4 x dp 2
    assert validate(cfg, 2, NO_ENV) == []


def test_flags_set_differently_warn_and_still_mean_megatron_fsdp():
    cfg = fsdp()
    cfg.dist.use_megatron_fsdp = False
    (message,) = validate(cfg, 2, NO_ENV)
    assert "dist.use_megatron_fsdp=False but ddp.use_megatron_fsdp=True" in message
    assert cfg.uses_megatron_fsdp


def test_validate_needs_no_torch():
    code = (
        "import sys\nfrom pytest_megatron_fsdp.config import RunConfig, validate\n"
        "c = RunConfig(); c.assign('model.hidden_dropout=0.1'); c.assign('ddp.bucket_size=100')\n"
        "validate(c, 2)\n"
        # megatron-core's config fields are found with find_spec('megatron.core'), which imports the
        # namespace package `megatron` (no code, no __file__); megatron.core itself must not load
        "loaded = [m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron')\n"
        "          and not (m == 'megatron' and getattr(sys.modules[m], '__file__', None) is None)]\n"
        "assert not loaded, loaded\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


# --- the seed's helpers -----------------------------------------------------------------------


def test_enable_megatron_fsdp_sets_exactly_the_seed_fields():
    before = bridge_recipe()
    after = enable_megatron_fsdp(before.copy())
    assert changed(before, after) == {
        "dist.use_megatron_fsdp": True,
        "ddp.use_megatron_fsdp": True,
        "ddp.data_parallel_sharding_strategy": "optim_grads_params",
        "ddp.average_in_collective": False,
        "checkpoint.ckpt_format": "fsdp_dtensor",
    }


def test_recipe_fixup_is_the_seed_example():
    before = bridge_recipe()
    after = recipe_fixup(before.copy(), save="/tmp/fsdp_ckpts")
    assert changed(before, after) == {
        "dist.use_megatron_fsdp": True,
        "ddp.use_megatron_fsdp": True,
        "ddp.data_parallel_sharding_strategy": "optim_grads_params",
        "ddp.average_in_collective": False,
        "checkpoint.ckpt_format": "fsdp_dtensor",
        "checkpoint.save": "/tmp/fsdp_ckpts",
        "checkpoint.load": None,
    }
    assert validate(after, 2, NO_ENV) == []


def test_perf_harness_overrides_are_the_seed_list():
    before = bridge_recipe()
    after = apply_perf_harness_overrides(before.copy())
    assert changed(before, after) == {
        "ddp.use_megatron_fsdp": True,
        "ddp.data_parallel_sharding_strategy": "optim_grads_params",
        "ddp.keep_fp8_transpose_cache": False,
        "ddp.average_in_collective": False,
        "model.init_model_with_meta_device": True,
        "checkpoint.load": None,
    }


def test_checkpoint_format_fixup_switches_torch_dist_with_a_message():
    cfg = fsdp()
    cfg.checkpoint.ckpt_format = "torch_dist"
    cfg.checkpoint.save = "/ckpt"
    with pytest.raises(ConfigError):
        validate(cfg, 2, NO_ENV)
    before = cfg.copy()
    message = fix_checkpoint_format(cfg)
    assert changed(before, cfg) == {"checkpoint.ckpt_format": "fsdp_dtensor"}
    assert message is not None
    assert "'torch_dist' -> 'fsdp_dtensor'" in message
    assert validate(cfg, 2, NO_ENV) == []


def test_checkpoint_format_fixup_also_switches_a_run_that_does_not_save():
    cfg = fsdp()
    cfg.checkpoint.ckpt_format = "torch_dist"
    before = cfg.copy()
    assert fix_checkpoint_format(cfg) is not None
    assert changed(before, cfg) == {"checkpoint.ckpt_format": "fsdp_dtensor"}
    assert validate(cfg, 2, NO_ENV) == []


@pytest.mark.parametrize("case", ["fsdp off", "zarr chosen"])
def test_checkpoint_format_fixup_leaves_other_configs_alone(case):
    cfg = fsdp()
    cfg.checkpoint.ckpt_format = "zarr" if case == "zarr chosen" else "torch_dist"
    cfg.checkpoint.save = "/ckpt"
    if case == "fsdp off":
        disable_megatron_fsdp(cfg)
    before = cfg.copy()
    assert fix_checkpoint_format(cfg) is None
    assert changed(before, cfg) == {}


# --- set / assign -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("assignment", "dotted", "expected"),
    [
        ("ddp.overlap_grad_reduce=false", "ddp.overlap_grad_reduce", False),
        ("ddp.bucket_size=40000000", "ddp.bucket_size", 40000000),
        ("ddp.bucket_size=none", "ddp.bucket_size", None),
        ("optimizer.lr=3e-3", "optimizer.lr", 3e-3),
        ("optimizer.clip_grad=1", "optimizer.clip_grad", 1.0),
        ("checkpoint.save=/tmp/x=y", "checkpoint.save", "/tmp/x=y"),
        ("train.num_microbatches = 4", "train.num_microbatches", 4),
        ("dist.use_megatron_fsdp=1", "dist.use_megatron_fsdp", True),
    ],
)
def test_assign_parses_by_the_field_type(assignment, dotted, expected):
    cfg = RunConfig()
    cfg.assign(assignment)
    value = flat(cfg)[dotted]
    assert value == expected
    assert type(value) is type(expected)


def test_assign_puts_megatron_fields_in_extra_and_overrides():
    cfg = RunConfig()
    cfg.assign("ddp.delay_wgrad_compute=true")
    cfg.assign("model.hidden_dropout=0.1")
    cfg.assign("model.num_layers=3")
    assert cfg.ddp.extra == {"delay_wgrad_compute": True}
    assert cfg.model.overrides == {"hidden_dropout": 0.1, "num_layers": 3}
    assert cfg.resolved_preset().num_layers == 3


@pytest.mark.parametrize(
    ("assignment", "message"),
    [
        (
            "ddp.overlap_grad_reduce=maybe",
            "ddp.overlap_grad_reduce='maybe' is not of type bool: give bool (true/false)",
        ),
        ("train.train_iters=ten", "train.train_iters='ten' is not of type int"),
        ("ddp.overlap_grad_reducee=true", "unknown config field 'ddp.overlap_grad_reducee'"),
        ("model.hiden_size=3", "unknown config field 'model.hiden_size'"),
        ("train.iters=3", "unknown config field 'train.iters'; train has: global_batch_size"),
        ("trian.train_iters=3", "unknown config field 'trian.train_iters': use <section>.<field>"),
        ("train.train_iters", "'train.train_iters' is not an assignment: write section.field=value"),
    ],
)
def test_assign_rejects_unknown_fields_and_bad_values(assignment, message):
    with pytest.raises(ConfigError) as failure:
        RunConfig().assign(assignment)
    assert message in str(failure.value)


def test_set_checks_python_values_too():
    with pytest.raises(ConfigError, match=r"train.train_iters=True has the wrong type: set it to int"):
        RunConfig().set("train.train_iters", True)
    with pytest.raises(ConfigError, match=r"dist.use_megatron_fsdp='yes please'"):
        RunConfig().set("dist.use_megatron_fsdp", "yes please")
