"""The foreign-suite layer over the CUDA emulation: each addition answers as one GPU per local rank
would, NCCL groups become gloo ones, and everything is undone."""

import datetime

import pytest
import torch
import torch.distributed as dist
from emulation_layers import foreign_layer, forget_megatron_rng

from pytest_megatron_fsdp.emulation import cuda as cuda_emulation
from pytest_megatron_fsdp.emulation import device_limits
from pytest_megatron_fsdp.emulation import foreign as foreign_emulation
from pytest_megatron_fsdp.emulation.made_groups import MadeGroups


@pytest.fixture(autouse=True)
def _megatron_rng_not_bound(monkeypatch):
    forget_megatron_rng(monkeypatch)


@pytest.fixture
def foreign():
    """Local rank 1 of 4, process groups capped at 60 s."""
    with foreign_layer(local_world_size=4, local_rank=1):
        yield


@pytest.fixture
def one_rank_group(tmp_path):
    """After the test: the default group it made, destroyed."""
    yield f"file://{tmp_path / 'store'}"
    if dist.is_initialized():
        dist.destroy_process_group()


def _snapshot() -> dict[str, object]:
    import torch.distributed.device_mesh as dm

    names = ("is_available", "device_count", "current_device", "set_device", "get_device_capability")
    return {
        **{f"cuda.{n}": torch.cuda.__dict__.get(n) for n in names},
        **{f"dist.{n}": getattr(dist, n) for n in ("init_process_group", "new_group", "barrier")},
        "device_mesh.new_group": dm.__dict__.get("new_group"),
        "accelerator.is_available": torch.accelerator.is_available,
    }


def test_disable_restores_every_original_object():
    cuda_emulation.enable()
    before = _snapshot()
    foreign_emulation.enable(2, 0, 60)
    during = _snapshot()
    foreign_emulation.disable()
    after = _snapshot()
    cuda_emulation.disable()
    assert [k for k in before if before[k] is during[k]] == []  # every one was replaced ...
    assert [k for k in before if before[k] is not after[k]] == []  # ... and is the same again
    assert not foreign_emulation.is_enabled()


def test_the_layer_needs_the_emulation_under_it():
    with pytest.raises(RuntimeError, match="enable that first"):
        foreign_emulation.enable(2, 0, 60)


def test_one_device_per_local_rank_the_local_rank_current(foreign):
    assert torch.cuda.is_available()  # torch-wide while the layer is on
    assert torch.accelerator.is_available()
    assert torch.cuda.device_count() == 4
    assert torch.accelerator.device_count() == 4
    assert 5 % torch.cuda.device_count() == 1  # upstream's set_device(local_rank % device_count())
    assert torch.cuda.current_device() == 1
    torch.cuda.set_device(3)
    assert torch.cuda.current_device() == 3
    torch.cuda.set_device(torch.device("cuda", 2))
    assert torch.cuda.current_device() == 2
    assert torch.accelerator.current_device_index() == 2
    assert len(torch.cuda.default_generators) == 4
    assert all(g is torch.default_generator for g in torch.cuda.default_generators)


def test_device_properties_are_an_a100s_capability_named_as_the_emulation(foreign):
    assert torch.cuda.get_device_capability() == (8, 0)  # no FP8/MXFP8 paths
    assert "emulated" in torch.cuda.get_device_name(0)
    properties = torch.cuda.get_device_properties(0)
    assert (properties.major, properties.minor) == (8, 0)
    assert properties.total_memory > 0


def test_a_memory_pool_allocates_as_anything_else(foreign):
    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool):
        tensor = torch.empty(4, device="cuda")
    assert tensor.device.type == "cpu"


def test_nccl_asked_for_is_a_gloo_group(foreign, one_rank_group):
    dist.init_process_group("nccl", init_method=one_rank_group, rank=0, world_size=1)
    assert dist.get_backend() == "gloo"
    options = dist.ProcessGroupNCCL.Options() if hasattr(dist, "ProcessGroupNCCL") else None
    group = dist.new_group([0], backend="nccl", pg_options=options)
    assert dist.get_backend(group) == "gloo"
    dist.barrier(device_ids=[torch.cuda.current_device()])  # a gloo barrier takes no device ids
    tensor = torch.ones(2, device="cuda")
    dist.all_reduce(tensor, group=group)
    assert tensor.tolist() == [1.0, 1.0]


@pytest.mark.skipif(
    not hasattr(dist, "ProcessGroupNCCL"), reason="this torch has no NCCL options to ask with"
)
def test_a_group_asked_with_nccls_zero_cta_policy_is_symmetric_memory(foreign, one_rank_group):
    # NCCL's zero-CTA policy exists for copy-engine collectives over symmetric memory: asked for, the
    # test skips there, before the model it would build for symmetric memory
    dist.init_process_group("nccl", init_method=one_rank_group, rank=0, world_size=1)
    options = dist.ProcessGroupNCCL.Options()
    options.config.cta_policy = dist.ProcessGroupNCCL.NCCL_CTA_POLICY_ZERO
    with pytest.raises(
        device_limits.EmulatedDeviceLacks, match="has no symmetric memory: a process group with NCCL"
    ):
        dist.new_group([0], backend="nccl", pg_options=options)
    options.config.cta_policy = dist.ProcessGroupNCCL.NCCL_CTA_POLICY_EFFICIENCY  # any other policy: dropped
    assert dist.get_backend(dist.new_group([0], backend="nccl", pg_options=options)) == "gloo"


def test_backend_left_to_torch_is_gloo_too(foreign, one_rank_group):
    # with is_available() True torch would pick NCCL for CUDA tensors
    dist.init_process_group(init_method=one_rank_group, rank=0, world_size=1)
    assert dist.get_backend() == "gloo"


def test_the_default_group_serves_the_suites_own_init_for_the_same_world(foreign, one_rank_group):
    dist.init_process_group("gloo", init_method=one_rank_group, rank=0, world_size=1)  # the rank session's
    world = dist.group.WORLD
    dist.init_process_group(backend="nccl")  # the suite's first call, as under torchrun
    dist.init_process_group(backend="nccl", rank=0, world_size=1)
    assert dist.group.WORLD is world
    with pytest.raises(ValueError, match="twice"):  # another world: torch's own refusal
        dist.init_process_group(backend="nccl", rank=0, world_size=2)


def test_each_group_made_is_recorded_and_freed_with_its_test(foreign, one_rank_group):
    dist.init_process_group("gloo", init_method=one_rank_group, rank=0, world_size=1)
    made = foreign_emulation.made_groups()
    assert made is not None
    group = dist.new_group([0], backend="nccl")
    assert made.alive() == 1
    assert made.free_after_test(dist.destroy_process_group) == 1
    with pytest.raises(ValueError, match="Invalid process group"):
        dist.destroy_process_group(group)  # destroyed: torch no longer knows it


def test_group_timeouts_are_capped_and_cuda_device_ids_dropped():
    calls = []

    def new_group(ranks=None, timeout=None, backend=None, pg_options=None, device_id=None):
        calls.append(
            {"timeout": timeout, "backend": backend, "pg_options": pg_options, "device_id": device_id}
        )

    patched = foreign_emulation._on_gloo(new_group, cap_s=60, made=MadeGroups())
    patched([0, 1], backend="nccl", pg_options=object(), device_id=torch.device("cuda", 1))
    patched([0, 1], timeout=datetime.timedelta(seconds=5), backend="gloo")
    patched([0, 1], timeout=datetime.timedelta(minutes=30))
    cap = datetime.timedelta(seconds=60)
    assert calls == [
        {"timeout": cap, "backend": "gloo", "pg_options": None, "device_id": None},
        {"timeout": datetime.timedelta(seconds=5), "backend": "gloo", "pg_options": None, "device_id": None},
        {"timeout": cap, "backend": "gloo", "pg_options": None, "device_id": None},
    ]


def test_the_mixed_precision_optimizers_see_the_devices_type_names(foreign):
    # megatron's optimizers sort parameters by CUDA type name and refuse any other: called from
    # those functions, a CPU tensor names the device's type
    checkers = cuda_emulation.CUDA_TYPE_CHECKERS
    assert ("megatron.core.optimizer.distrib_optimizer", "_build_model_and_main_param_groups") in checkers
    assert ("megatron.core.optimizer.optimizer", "__init__") in checkers
    namespace = {"__name__": "megatron.core.optimizer.distrib_optimizer"}
    exec("def _build_model_and_main_param_groups(p):\n    return p.type()\n", namespace)
    assert namespace["_build_model_and_main_param_groups"](torch.ones(1)) == "torch.cuda.FloatTensor"
    assert torch.ones(1).type() == "torch.FloatTensor"  # anyone else: as usual


def test_torchs_optimizers_step_on_the_emulated_device(foreign):
    # with an accelerator present, torch.optim asks its current stream whether a CUDA graph is being
    # captured before every step: on the emulated device none ever is
    assert torch.accelerator.current_stream().is_capturing() is False
    assert torch.cuda.is_current_stream_capturing() is False
    parameter = torch.nn.Parameter(torch.ones(2, device="cuda"))
    parameter.grad = torch.ones(2)
    torch.optim.Adam([parameter], lr=0.5).step()
    assert parameter.detach().tolist() == pytest.approx([0.5, 0.5])  # Adam's first step: lr * sign
