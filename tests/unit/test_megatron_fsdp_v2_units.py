"""Megatron-FSDP V2 and HybridModel, without ranks: the emulation's device answer to V2's DBuffer,
the config fields that select them, and the feature checks (no megatron import)."""

import subprocess
import sys

import pytest
import torch

from pytest_megatron_fsdp.emulation import cuda as cuda_emulation
from pytest_megatron_fsdp.fsdp import versions
from pytest_megatron_fsdp.fsdp.config import ConfigError, RunConfig, validate


@pytest.fixture
def emulation(monkeypatch):
    # enable() refuses once megatron's RNG module is imported; these tests use no megatron
    monkeypatch.delitem(sys.modules, "megatron.core.tensor_parallel.random", raising=False)
    assert not cuda_emulation.is_enabled()
    cuda_emulation.enable()
    try:
        yield
    finally:
        cuda_emulation.disable()


def _is_cuda_in(module: str, name: str):
    """A function ``name`` as if defined in ``module``, returning ``tensor.is_cuda`` as it sees it."""
    namespace = {"__name__": module}
    exec(f"def {name}(tensor):\n    return tensor.is_cuda\n", namespace)
    return namespace[name]


DBUFFER = "megatron.core.distributed.fsdp.src.megatron_fsdp.experimental.dbuffer"


def test_v2_dbuffer_sees_a_cpu_buffer_on_the_emulated_device(emulation):
    cpu = torch.zeros(2)
    assert _is_cuda_in(DBUFFER, "__init__")(cpu) is True
    # the standalone megatron-fsdp package's copy of V2 too
    assert _is_cuda_in("megatron_fsdp.experimental.dbuffer", "__init__")(cpu) is True
    # nobody else: other functions of that module, other modules, a module merely ending alike
    assert _is_cuda_in(DBUFFER, "allgather")(cpu) is False
    assert _is_cuda_in("megatron.core.distributed.param_and_grad_buffer", "__init__")(cpu) is False
    assert _is_cuda_in("not_megatron_fsdp.experimental.dbuffer", "__init__")(cpu) is False
    assert cpu.is_cuda is False


def test_v2_dbuffer_built_in_a_backward_hook_sees_the_emulated_device(emulation):
    # V2 builds buffers in its gradient hooks; a backward started by loss.backward() runs them, and
    # the stream a buffer records (and later asserts) follows this answer
    weight = torch.ones(2, requires_grad=True)
    seen = []
    weight.register_post_accumulate_grad_hook(lambda p: seen.append(_is_cuda_in(DBUFFER, "__init__")(p.grad)))
    (weight * 2).sum().backward()
    assert seen == [True]


def test_without_the_emulation_v2_dbuffer_sees_a_cpu_buffer():
    assert not cuda_emulation.is_enabled()
    assert _is_cuda_in(DBUFFER, "__init__")(torch.zeros(2)) is False


def test_megatron_fsdp_version_is_checked_before_any_rank():
    cfg = RunConfig()
    cfg.assign("ddp.megatron_fsdp_version=3")
    with pytest.raises(ConfigError) as refused:
        validate(cfg, 2)
    assert str(refused.value).startswith("ddp.megatron_fsdp_version=3: Megatron-FSDP versions are 1 and 2")


def test_v2_is_refused_in_one_line_where_megatron_core_has_none(monkeypatch):
    monkeypatch.setattr(versions, "megatron_fsdp_v2_problem", lambda: "megatron-core 0.19.2 has no V2")
    cfg = RunConfig()
    cfg.assign("ddp.megatron_fsdp_version=2")
    with pytest.raises(ConfigError) as refused:
        validate(cfg, 2)
    message = str(refused.value)
    assert message == (
        "ddp.megatron_fsdp_version=2: megatron-core 0.19.2 has no V2; set ddp.megatron_fsdp_version=1"
    )
    cfg.ddp.megatron_fsdp_version = 1
    validate(cfg, 2)


def test_v2_checkpoint_save_is_refused_before_the_disk(monkeypatch):
    monkeypatch.setattr(versions, "megatron_fsdp_v2_problem", lambda: None)
    cfg = RunConfig()
    cfg.ddp.megatron_fsdp_version = 2
    validate(cfg, 2)  # builds
    for purpose in ("save", "load"):
        with pytest.raises(ConfigError, match=f"^ddp.megatron_fsdp_version=2 with checkpoint {purpose}: "):
            validate(cfg, 2, purpose=purpose)


@pytest.mark.parametrize(
    ("pattern", "layers", "problem"),
    [
        (
            "*-M-",
            4,
            "model.hybrid_layer_pattern='*-M-': the harness builds '*' (self-attention), "
            "'-' (MLP), 'E' (MoE) layers only, not 'M'; write a pattern such as '*-*-'",
        ),
        (
            "*-",
            4,
            "model.hybrid_layer_pattern='*-' has 2 layers but model.num_layers=4: a HybridModel "
            "has one layer per symbol; set model.num_layers=2",
        ),
    ],
)
def test_hybrid_pattern_is_checked_in_one_line(monkeypatch, pattern, layers, problem):
    monkeypatch.setattr(versions, "hybrid_model_problem", lambda: None)
    cfg = RunConfig()
    cfg.model.preset = "tiny-hybrid"
    cfg.assign(f"model.hybrid_layer_pattern={pattern}")
    cfg.model.overrides["num_layers"] = layers
    with pytest.raises(ConfigError) as refused:
        validate(cfg, 2)
    assert str(refused.value) == problem


def test_hybrid_preset_is_refused_where_megatron_core_has_no_hybrid_model(monkeypatch):
    monkeypatch.setattr(versions, "hybrid_model_problem", lambda: "megatron-core 0.16.1 has no HybridModel")
    cfg = RunConfig()
    cfg.model.preset = "tiny-hybrid"
    with pytest.raises(ConfigError) as refused:
        validate(cfg, 2)
    assert str(refused.value) == (
        "model.hybrid_layer_pattern='*-*-': megatron-core 0.16.1 has no HybridModel; set "
        "model.hybrid_layer_pattern=None (a GPTModel)"
    )


def test_feature_checks_import_no_megatron():
    """They run at collection time: reading files only, editable installs included."""
    code = (
        "import sys\n"
        "from pytest_megatron_fsdp.fsdp import versions\n"
        "versions.megatron_fsdp_v2_problem(); versions.hybrid_model_problem()\n"
        "assert 'megatron.core' not in sys.modules and 'torch' not in sys.modules, sorted(sys.modules)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
