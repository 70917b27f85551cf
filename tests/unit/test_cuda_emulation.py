"""The CUDA-on-CPU emulation: each patched entry point behaves, and everything is undone."""

import sys

import pytest
import torch
from emulation_layers import forget_megatron_rng

from pytest_megatron_fsdp.emulation import cuda as cuda_emulation


@pytest.fixture(autouse=True)
def _megatron_rng_not_bound(monkeypatch):
    forget_megatron_rng(monkeypatch)


@pytest.fixture
def emulation():
    assert not cuda_emulation.is_enabled()
    cuda_emulation.enable()
    try:
        yield
    finally:
        cuda_emulation.disable()


def _snapshot():
    import torch.cuda.random
    import torch.distributed.device_mesh as dm

    return {
        **{f"cuda.{n}": torch.cuda.__dict__.get(n) for n in cuda_emulation.PATCHED_CUDA_ATTRIBUTES},
        **{
            f"random.{n}": torch.cuda.random.__dict__.get(n)
            for n in ("get_rng_state", "set_rng_state", "manual_seed")
        },
        "from_group": dm.DeviceMesh.__dict__["from_group"],
        "init_device_mesh": dm.init_device_mesh,
        **{f"dist.{n}": getattr(torch.distributed, n) for n in COLLECTIVE_ENTRY_POINTS},
        "c10d.ProcessGroupGloo": torch.distributed.distributed_c10d.ProcessGroupGloo,
        "autograd._engine_run_backward": torch.autograd._engine_run_backward,
        "graph._engine_run_backward": torch.autograd.graph._engine_run_backward,
    }


COLLECTIVE_ENTRY_POINTS = ("_make_nccl_premul_sum", "reduce_scatter_tensor", "all_reduce", "all_gather")


def test_disable_restores_every_original_object():
    before = _snapshot()
    cuda_emulation.enable()
    during = _snapshot()
    cuda_emulation.disable()
    after = _snapshot()
    changed = [k for k in before if before[k] is not during[k]]
    # Every attribute in the registry really was replaced while enabled ...
    assert len(changed) >= len(cuda_emulation.PATCHED_CUDA_ATTRIBUTES)
    # ... and each one is the very same object again afterwards.
    assert all(before[k] is after[k] for k in before), [k for k in before if before[k] is not after[k]]
    assert not cuda_emulation.is_enabled()


def test_enable_and_disable_are_idempotent():
    before = _snapshot()
    cuda_emulation.enable()
    cuda_emulation.enable()
    cuda_emulation.disable()
    cuda_emulation.disable()
    assert _snapshot() == before


def test_is_available_still_tells_the_truth(emulation):
    # Code that honestly asks whether a GPU exists must still learn there is none.
    assert torch.cuda.is_available() is False


def test_device_queries_answer_like_one_idle_device(emulation):
    assert torch.cuda.current_device() == 0
    assert torch.cuda.device_count() == 1
    assert torch.cuda.set_device(0) is None
    assert torch.cuda.synchronize() is None
    assert torch.cuda.empty_cache() is None
    assert torch.cuda.memory_allocated() == 0
    assert torch.cuda.max_memory_allocated() == 0


def test_streams_and_events_are_complete_no_ops(emulation):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    event = torch.cuda.Event(enable_timing=True)
    event.record(stream)
    event.wait(stream)
    assert event.query()
    assert stream.query()
    with torch.cuda.stream(stream) as entered:
        assert entered is stream
        x = torch.ones(3) * 2  # work inside the context runs, in order, on the CPU
    assert x.tolist() == [2.0, 2.0, 2.0]
    assert torch.cuda.current_stream() is torch.cuda.default_stream()


def test_cuda_rng_is_the_cpu_generator(emulation):
    torch.cuda.manual_seed(7)
    state = torch.cuda.get_rng_state()
    assert torch.equal(state, torch.get_rng_state())
    first = torch.rand(4)
    torch.cuda.set_rng_state(state)
    assert torch.equal(torch.rand(4), first)  # restoring the "CUDA" state replays the CPU stream
    assert torch.cuda.default_generators[0] is torch.default_generator
    torch.cuda.random.manual_seed(7)
    assert torch.equal(torch.rand(4), first)


def test_lazy_call_runs_at_once(emulation):
    calls = []
    torch.cuda._lazy_call(lambda: calls.append(1))
    assert calls == [1]  # the real one queues until CUDA initialises, i.e. never on CPU


def test_torch_manual_seed_does_not_recurse(emulation):
    torch.manual_seed(3)  # calls torch.cuda.manual_seed_all, which now seeds the CPU generator
    a = torch.rand(2)
    torch.manual_seed(3)
    assert torch.equal(torch.rand(2), a)


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.zeros(2, device="cuda"),
        lambda: torch.empty(2, device="cuda:0"),
        lambda: torch.ones(2, device=torch.device("cuda", 0)),
        lambda: torch.arange(3, device=0),  # torch reads a bare int as a CUDA ordinal
        lambda: torch.ones(2).cuda(),
        lambda: torch.ones(2).to("cuda"),
        lambda: torch.ones(2).to(device="cuda"),
        lambda: torch.ones(2).to(torch.device("cuda")),
        lambda: torch.tensor([1.0], device="cuda"),
    ],
)
def test_cuda_tensor_requests_land_on_cpu(emulation, make):
    assert make().device.type == "cpu"


def test_cpu_and_dtype_arguments_pass_through(emulation):
    t = torch.ones(2).to(torch.float64)
    assert t.dtype == torch.float64
    assert t.device.type == "cpu"
    assert torch.zeros(1, device="cpu").device.type == "cpu"


@pytest.mark.parametrize(
    "make",
    [
        lambda dtype: torch.empty(64, dtype=dtype, device="cuda"),
        lambda dtype: torch.empty(64, dtype=dtype),  # host memory too: the heap hands back leftovers
        lambda dtype: torch.empty_like(torch.zeros(64, dtype=dtype)),
        lambda dtype: torch.empty_strided((8, 8), (8, 1), dtype=dtype, device="cuda"),
        lambda dtype: torch.zeros(1, dtype=dtype).new_empty(64),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.complex64, torch.int64, torch.bool])
def test_uninitialised_memory_reads_as_torch_fills_it(emulation, make, dtype):
    # the leftovers in a fresh heap block are rarely NaN: without the fill this sees them
    for _ in range(3):
        torch.randn(64).mul_(2)  # leave non-NaN values behind in the freed blocks
    values = make(dtype)
    if dtype.is_floating_point or dtype.is_complex:
        assert values.isnan().all()
    elif dtype == torch.bool:
        assert values.all()
    else:
        assert (values == torch.iinfo(dtype).max).all()


def test_without_emulation_cuda_requests_still_fail():
    with pytest.raises((RuntimeError, AssertionError)):
        torch.zeros(1, device="cuda")


def test_device_mesh_for_cuda_becomes_cpu(emulation):
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        assert DeviceMesh.from_group(dist.group.WORLD, "cuda").device_type == "cpu"
        assert init_device_mesh("cuda", (1,)).device_type == "cpu"
    finally:
        dist.destroy_process_group()


def test_enable_after_megatron_import_is_refused(monkeypatch):
    monkeypatch.setitem(sys.modules, "megatron.core.tensor_parallel.random", object())
    with pytest.raises(cuda_emulation.EmulationOrderError, match="before megatron"):
        cuda_emulation.enable()
    assert not cuda_emulation.is_enabled()


# -- megatron's gradient clipping: the one CUDA type check it makes, answered for the emulated device


def _defined_in(module: str, name: str):
    """A function ``name`` as if defined in ``module``, returning ``tensor.type()`` as it sees it."""
    namespace = {"__name__": module}
    exec(f"def {name}(tensor):\n    return tensor.type()\n", namespace)
    return namespace[name]


CLIP_MODULE, CLIP_FUNCTION = "megatron.core.optimizer.clip_grads", "clip_grad_by_total_norm_fp32"


def test_cuda_type_name_is_the_devices_name_for_the_same_dtype():
    assert cuda_emulation.cuda_type_name(torch.zeros(1)) == "torch.cuda.FloatTensor"
    assert cuda_emulation.cuda_type_name(torch.zeros(1, dtype=torch.bfloat16)) == "torch.cuda.BFloat16Tensor"
    assert cuda_emulation.cuda_type_name(torch.zeros(1, dtype=torch.float64)) == "torch.cuda.DoubleTensor"
    assert cuda_emulation.cuda_type_name(torch.zeros(2).to_sparse()) == "torch.cuda.sparse.FloatTensor"


def test_only_megatrons_clip_sees_the_cuda_type_name(emulation):
    fp32 = torch.zeros(2)
    assert _defined_in(CLIP_MODULE, CLIP_FUNCTION)(fp32) == "torch.cuda.FloatTensor"
    # the dtype still counts: megatron's assertion keeps failing for a bf16 gradient, as on a GPU
    assert _defined_in(CLIP_MODULE, CLIP_FUNCTION)(fp32.bfloat16()) == "torch.cuda.BFloat16Tensor"
    # everyone else, megatron's other type checks included, gets the truth
    assert fp32.type() == "torch.FloatTensor"
    assert _defined_in(CLIP_MODULE, "count_zeros_fp32")(fp32) == "torch.FloatTensor"
    assert (
        _defined_in("megatron.core.optimizer.distrib_optimizer", CLIP_FUNCTION)(fp32) == "torch.FloatTensor"
    )
    # type(dtype) converts, as always
    assert fp32.type(torch.float64).dtype == torch.float64


def test_without_the_emulation_the_clip_sees_a_cpu_tensor():
    assert not cuda_emulation.is_enabled()
    assert _defined_in(CLIP_MODULE, CLIP_FUNCTION)(torch.zeros(2)) == "torch.FloatTensor"


# -- backward: hooks and recomputation run under the emulation too
#
# A torch function mode is off while its own handler runs, and ``Tensor.backward``,
# ``torch.autograd.backward`` and ``torch.autograd.grad`` are torch functions: the mode's handler
# forwards them, and the whole backward (every hook, every ``autograd.Function.backward``, an
# activation recompute) would run without the emulation. Megatron's schedule calls the autograd
# engine directly and never saw it; Megatron-FSDP V2's hooks and user code calling
# ``loss.backward()`` do.


def _allocates_on_cuda(seen):
    """A hook that allocates on "cuda" as Megatron-FSDP's do, recording where the tensor landed."""

    def hook(*args):
        seen.append(torch.empty(1, device="cuda").device.type)

    return hook


class _RecomputingFunction(torch.autograd.Function):
    """Megatron's activation recompute in miniature: forward keeps no activations; backward runs
    the forward again (allocating on "cuda", as megatron's causal mask does) and back-propagates
    through it with ``torch.autograd.backward``: a backward inside the backward."""

    @staticmethod
    def forward(ctx, x, seen):
        ctx.save_for_backward(x)
        ctx.seen = seen
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        detached = x.detach().requires_grad_()
        with torch.enable_grad():
            mask = torch.ones(1, device="cuda")
            ctx.seen.append(mask.device.type)
            recomputed = detached * 2 * mask
        torch.autograd.backward(recomputed, grad)
        return detached.grad, None


def _tensor_hook(seen):
    weight = torch.ones(2, requires_grad=True)
    product = weight * 2
    product.register_hook(_allocates_on_cuda(seen))
    return product.sum(), [weight]


def _module_full_backward_hook(seen):
    layer = torch.nn.Linear(2, 2)
    layer.register_full_backward_hook(_allocates_on_cuda(seen))
    inputs = torch.ones(1, 2, requires_grad=True)
    return layer(inputs).sum(), [inputs]  # the hook runs once the gradient of its inputs is computed


def _post_accumulate_grad_hook(seen):
    weight = torch.ones(2, requires_grad=True)
    weight.register_post_accumulate_grad_hook(_allocates_on_cuda(seen))
    return (weight * 2).sum(), [weight]


def _recompute_in_backward(seen):
    weight = torch.ones(2, requires_grad=True)
    return _RecomputingFunction.apply(weight, seen).sum(), [weight]


BACKWARDS = {
    "loss.backward()": lambda loss, inputs: loss.backward(),
    "torch.autograd.backward": lambda loss, inputs: torch.autograd.backward(loss),
    "torch.autograd.grad": lambda loss, inputs: torch.autograd.grad(loss, inputs),
}
HOOKED = {
    "tensor hook": _tensor_hook,
    "module full_backward_hook": _module_full_backward_hook,
    "post-accumulate-grad hook": _post_accumulate_grad_hook,
    "recompute in backward": _recompute_in_backward,
}
# torch.autograd.grad accumulates no .grad, so it runs no post-accumulate-grad hook
BACKWARD_CASES = [
    pytest.param(backward, hooked, id=f"{backward_name}-{hooked_name}")
    for backward_name, backward in BACKWARDS.items()
    for hooked_name, hooked in HOOKED.items()
    if (backward_name, hooked) != ("torch.autograd.grad", _post_accumulate_grad_hook)
]


@pytest.mark.parametrize(("backward", "hooked"), BACKWARD_CASES)
def test_backward_runs_its_hooks_under_the_emulation(emulation, backward, hooked):
    seen: list[str] = []
    loss, inputs = hooked(seen)
    backward(loss, inputs)
    assert seen == ["cpu"]


def test_the_engine_called_directly_runs_hooks_under_the_emulation(emulation):
    # Megatron's schedule (custom_backward) calls the engine itself, never leaving the mode
    seen: list[str] = []
    loss, _ = _recompute_in_backward(seen)
    engine = torch.autograd.Variable._execution_engine  # type: ignore[attr-defined]
    engine.run_backward(
        (loss,), (torch.ones_like(loss),), False, False, (), allow_unreachable=True, accumulate_grad=True
    )
    assert seen == ["cpu"]


def test_stream_and_device_contexts_can_be_entered_again(emulation):
    """As torch's own: Megatron's grad buffer makes ``torch.cuda.stream(s)`` once and enters it for
    every bucket (``param_and_grad_buffer.py``, more than one distributed-optimizer instance with
    overlapped reduction); a single-use context failed the second time with
    ``'_GeneratorContextManager' object has no attribute 'args'``."""
    stream = torch.cuda.Stream()
    stream_context, device_context = torch.cuda.stream(stream), torch.cuda.device(0)
    for _ in range(3):
        with stream_context as entered:
            assert entered is stream
        with device_context:
            pass
