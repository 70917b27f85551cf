"""What the emulated device lacks: under the foreign-suite layer each GPU-only entry point raises
EmulatedDeviceLacks naming its feature, which the GPU-only causes recognise; the library's
heuristics still read an idle device; everything is undone."""

import re
import sys

import pytest
import torch
import torch.distributed._symmetric_memory as symm_mem
import torch.utils.cpp_extension
from emulation_layers import foreign_layer, forget_megatron_rng
from torch.profiler import ProfilerActivity

from pytest_megatron_fsdp.emulation import cuda as cuda_emulation
from pytest_megatron_fsdp.emulation import device_limits
from pytest_megatron_fsdp.emulation import foreign as foreign_emulation
from pytest_megatron_fsdp.emulation.device_limits import EmulatedDeviceLacks
from pytest_megatron_fsdp.foreign import gpu_only


@pytest.fixture(autouse=True)
def _megatron_rng_not_bound(monkeypatch):
    forget_megatron_rng(monkeypatch)


@pytest.fixture
def foreign():
    with foreign_layer():
        yield


def _profile_with(activities):
    # as upstream's tests bind it: from torch.profiler import profile (after the layer is on)
    from torch.profiler import profile

    with profile(activities=activities):
        pass


ASKS = {
    "torch.cuda.CUDAGraph": (device_limits.CUDA_GRAPHS, lambda: torch.cuda.CUDAGraph()),
    "torch.cuda.graph": (device_limits.CUDA_GRAPHS, lambda: torch.cuda.graph(None)),
    "make_graphed_callables": (
        device_limits.CUDA_GRAPHS,
        lambda: torch.cuda.make_graphed_callables(torch.nn.Linear(2, 2), (torch.ones(1, 2),)),
    ),
    "symm_mem.get_mem_pool": (device_limits.SYMMETRIC_MEMORY, lambda: symm_mem.get_mem_pool("cuda:0")),
    "symm_mem.empty": (device_limits.SYMMETRIC_MEMORY, lambda: symm_mem.empty(4, device="cuda")),
    "symm_mem.rendezvous": (device_limits.SYMMETRIC_MEMORY, lambda: symm_mem.rendezvous(torch.ones(2), "0")),
    "memory_allocated": (device_limits.MEMORY_ACCOUNTING, lambda: torch.cuda.memory_allocated("cuda:0")),
    "max_memory_allocated": (device_limits.MEMORY_ACCOUNTING, lambda: torch.cuda.max_memory_allocated()),
    "memory_reserved": (device_limits.MEMORY_ACCOUNTING, lambda: torch.cuda.memory_reserved()),
    "max_memory_reserved": (device_limits.MEMORY_ACCOUNTING, lambda: torch.cuda.max_memory_reserved()),
    "memory_stats": (device_limits.MEMORY_ACCOUNTING, lambda: torch.cuda.memory_stats()),
    "mem_get_info": (device_limits.MEMORY_ACCOUNTING, lambda: torch.cuda.mem_get_info()),
    "profile(CUDA)": (
        device_limits.KERNEL_TRACE,
        lambda: _profile_with([ProfilerActivity.CPU, ProfilerActivity.CUDA]),
    ),
    "profile({CUDA: ...})": (
        device_limits.KERNEL_TRACE,
        lambda: _profile_with([{ProfilerActivity.CUDA: []}]),
    ),
    # megatron-core's NCCL allocator builds its extension so (nccl_allocator.py)
    "load_inline(with_cuda=True)": (
        device_limits.CUDA_EXTENSION,
        lambda: torch.utils.cpp_extension.load_inline("x", "int f();", with_cuda=True),
    ),
    "load_inline(cuda_sources)": (
        device_limits.CUDA_EXTENSION,
        lambda: torch.utils.cpp_extension.load_inline("x", "", cuda_sources="__global__ void k() {}"),
    ),
    "load(.cu)": (device_limits.CUDA_EXTENSION, lambda: torch.utils.cpp_extension.load("x", ["k.cu"])),
}


@pytest.mark.parametrize("entry", list(ASKS))
def test_each_gpu_only_entry_raises_naming_its_feature(foreign, entry):
    feature, ask = ASKS[entry]
    # looked up at call time: the lambdas above read the patched attributes
    with pytest.raises(EmulatedDeviceLacks, match=re.escape(f"has no {feature}")) as raised:
        ask()
    assert raised.value.feature == feature
    cause = gpu_only.cause_of(raised.value)
    assert cause is not None
    assert cause.name.startswith(feature)  # the skip names the feature the test asked for


def test_what_a_cpu_rank_has_still_answers(foreign):
    assert symm_mem.is_symm_mem_tensor(torch.ones(2)) is False
    torch.cuda.reset_peak_memory_stats()
    from torch.profiler import profile

    with profile(activities=[ProfilerActivity.CPU]) as cpu_only:
        torch.ones(4).sum()
    assert any(event.name == "aten::sum" for event in cpu_only.events())
    with profile() as default:  # no activities named: the CPU's, as torch records without a GPU
        torch.ones(4).sum()
    assert any(event.name == "aten::sum" for event in default.events())
    assert isinstance(default, torch.profiler.profiler._KinetoProfile)


def test_the_librarys_memory_heuristic_reads_an_idle_device(foreign):
    assert ("megatron_fsdp.param_and_grad_buffer", "check_gpu_memory") in device_limits.IDLE_MEMORY_READERS
    for module in (
        "megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer",
        "megatron_fsdp.param_and_grad_buffer",
    ):
        namespace = {"__name__": module, "torch": torch}
        exec(
            "def check_gpu_memory():\n"
            "    return torch.cuda.memory_allocated(0), torch.cuda.memory_reserved(0)\n",
            namespace,
        )
        assert namespace["check_gpu_memory"]() == (0, 0)
    namespace = {"__name__": "tests.unit_tests.distributed.mfsdp_v2.test_memory", "torch": torch}
    exec("def check_gpu_memory():\n    return torch.cuda.memory_allocated(0)\n", namespace)
    with pytest.raises(EmulatedDeviceLacks):  # a function of that name elsewhere: no
        namespace["check_gpu_memory"]()


def test_bridges_training_log_reads_an_idle_device(foreign):
    """Megatron-Bridge's training log reads memory_stats() for its memory line: logged, not asserted,
    so it reads an idle device (no figures) and the training goes on; a test asking is refused."""
    body = "def report_memory(memory_keys):\n    return torch.cuda.memory_stats()\n"
    namespace = {"__name__": "megatron.bridge.training.utils.train_utils", "torch": torch}
    exec(body, namespace)
    assert namespace["report_memory"](None) == {}
    namespace = {"__name__": "tests.functional_tests.test_groups.megatron_fsdp.test_memory", "torch": torch}
    exec(body, namespace)
    with pytest.raises(EmulatedDeviceLacks):
        namespace["report_memory"](None)


def test_the_plain_emulation_keeps_its_answers_and_disable_restores():
    graph_class, profile_class = torch.cuda.CUDAGraph, torch.profiler.profile
    get_mem_pool = symm_mem.get_mem_pool
    cuda_emulation.enable()
    try:
        assert torch.cuda.memory_allocated() == 0  # the plugin's own tests: an idle device
        foreign_emulation.enable(2, 0, 60)
        assert torch.cuda.CUDAGraph is not graph_class
        foreign_emulation.disable()
        assert torch.cuda.memory_allocated() == 0
    finally:
        cuda_emulation.disable()
    assert torch.cuda.CUDAGraph is graph_class
    assert torch.profiler.profile is profile_class
    assert torch.profiler.profiler.profile is profile_class
    assert symm_mem.get_mem_pool is get_mem_pool


def test_megatrons_transformer_engine_stand_ins_say_te_is_missing(monkeypatch):
    """megatron-core without TE defines its TE layer classes on a MagicMock: "instantiating" one
    answers a mock once per process and raises StopIteration after (a test's outcome then depends on
    the order of the tests). Refused, each raises ModuleNotFoundError for transformer_engine, the
    GPU-only cause, every time; restore undoes it."""
    import types
    from unittest.mock import MagicMock

    module = types.ModuleType(device_limits.TE_EXTENSION)
    namespace = {"__name__": device_limits.TE_EXTENSION, "MagicMock": MagicMock}
    exec(
        "te = MagicMock()\nHAVE_TE = False\n"
        "class TEDotProductAttention(te.pytorch.DotProductAttention):\n    pass\n"
        "class TELinear(te.pytorch.Linear):\n    pass\n",
        namespace,
    )
    module.__dict__.update(namespace)
    monkeypatch.setitem(sys.modules, device_limits.TE_EXTENSION, module)
    stand_ins = device_limits.TransformerEngineStandIns()
    assert stand_ins.refuse() == 2
    for _ in range(2):
        with pytest.raises(ModuleNotFoundError) as info:
            module.TEDotProductAttention(config=None)
        assert gpu_only.cause_of(info.value).reason() == "GPU-only: Transformer Engine"
    assert stand_ins.refuse() == 0  # once
    stand_ins.restore()
    module.TELinear()  # the mock's own answer again: its base, once
    with pytest.raises(StopIteration):
        module.TELinear()


def test_transformer_engine_stand_ins_left_alone_where_te_is_installed(monkeypatch):
    import types

    module = types.ModuleType(device_limits.TE_EXTENSION)
    module.HAVE_TE = True
    monkeypatch.setitem(sys.modules, device_limits.TE_EXTENSION, module)
    assert device_limits.TransformerEngineStandIns().refuse() == 0
