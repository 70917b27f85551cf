"""CUDA-on-CPU emulation: lets the real Megatron-FSDP code run on CPU ranks over gloo.

Megatron-FSDP is written for CUDA, but its logic is device-neutral once the CUDA entry points it
touches get CPU meanings (measured on 2 gloo ranks: streams, events, RNG, device meshes and
device arguments were all it took). This module gives them those meanings and nothing more:

* streams, events and ``synchronize`` become no-ops (CPU work is already ordered); no stream is
  ever capturing a CUDA graph;
* memory queries answer 0, ``current_device`` answers 0, ``set_device`` does nothing;
* the "CUDA" RNG *is* the CPU generator, so Megatron's RNG tracker forks the generator that the
  CPU kernels really draw from (dropout stays reproducible and rank-consistent);
* ``DeviceMesh`` requests for ``cuda`` become ``cpu`` meshes;
* a torch function mode rewrites ``device="cuda"`` / ``device=<int>`` arguments of tensor
  factories and ``Tensor.to``/``Tensor.cuda`` to the CPU, in the forward and in the backward: a
  backward started with ``loss.backward()``, ``torch.autograd.backward`` or ``torch.autograd.grad``
  runs its hooks and recomputations under the mode too (see :func:`_backward_under`);
* V2's ``DBuffer`` learns that a CPU buffer is on the device (its ``is_cuda`` read; see
  :data:`CUDA_DEVICE_CHECKERS`), so it records the stream it was allocated on as V2 asserts later;
* the one CUDA type check megatron's gradient clipping makes (``clip_grad_by_total_norm_fp32``
  asserts ``param.grad.type() == 'torch.cuda.FloatTensor'``, i.e. an fp32 gradient on the device)
  is answered for the device the emulation provides: to that function's own ``Tensor.type()``
  calls, and no one else's, a CPU tensor names its CUDA type (``torch.cuda.FloatTensor`` for fp32,
  ``torch.cuda.BFloat16Tensor`` for bf16, so the dtype check keeps its teeth); everywhere else
  ``type()`` answers as usual (see :data:`CUDA_TYPE_CHECKERS`);
* NCCL's pre-multiplied sum (``torch.distributed._make_nccl_premul_sum(f)``, which Megatron-FSDP
  uses to fuse the gradient average into the reduction; gloo has no ``ReduceOp.PREMUL_SUM``) becomes
  a marker that ``reduce_scatter_tensor`` and ``all_reduce`` honour by scaling their input by ``f``
  (in place, as Megatron-FSDP's unfused path does) and summing, so Megatron's default
  ``gradient_reduce_div_fusion=True`` path runs on CPU ranks too;
* ``all_gather`` into outputs of different shapes (NCCL takes them, gloo refuses them) is done as
  one broadcast from each rank in turn (:func:`_uneven_aware_all_gather`);
* memory a rank allocates without writing (``torch.empty``, ``empty_like``, ``empty_strided``,
  ``Tensor.new_empty``) reads as NaN (integers: their largest value, bools: True), as torch's own
  ``torch.utils.deterministic.fill_uninitialized_memory`` fills it: a GPU's caching allocator hands
  back whatever the last tensor left there, and the CPU heap does too, so a read of memory nobody
  wrote fails every time instead of whenever the leftovers happen to be NaN (torch's switch comes
  only with ``torch.use_deterministic_algorithms``, which also changes the code paths megatron
  takes, so the emulation fills these results itself; see :func:`_filled_as_uninitialised`);
* every gloo process group gets one worker thread (:class:`InOrderProcessGroupGloo`), so a group's
  collectives run one at a time in issue order, as NCCL runs a communicator's. With torch's two
  threads per group, torch's gloo corrupts the heap when several asynchronous coalesced all-gathers
  are in flight on one group, as Megatron-FSDP's parameter prefetch issues them (torch 2.13 and 2.14;
  torch-only reproduction: tests/reproductions/gloo_concurrent_all_gathers.py).

It is applied only in CPU ranks (the plugin calls :func:`enable` when the platform is ``cpu``),
must be applied before ``megatron`` is imported (megatron binds ``torch.cuda._lazy_call`` by name at
import time), and is fully reversible with :func:`disable`. ``torch.cuda.is_available()`` keeps
answering ``False``: code that asks honestly still learns there is no GPU.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as _dist
import torch.distributed.device_mesh as _device_mesh
import torch.distributed.distributed_c10d as _c10d
from torch.overrides import TorchFunctionMode

__all__ = [
    "CUDA_DEVICE_CHECKERS",
    "CUDA_TYPE_CHECKERS",
    "PATCHED_CUDA_ATTRIBUTES",
    "PatchSet",
    "disable",
    "emulated",
    "enable",
    "is_enabled",
]


class _NullStream:
    """A stream on which all work is already complete: CPU ops run in program order."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.device = torch.device("cpu")

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: _NullEvent | None = None) -> _NullEvent:
        recorded = event or _NullEvent()
        recorded.record(self)
        return recorded

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def is_capturing(self) -> bool:
        # no CUDA graph is ever captured on the emulated device (torch's optimizers ask before a step)
        return False

    def __enter__(self) -> _NullStream:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


class _NullEvent:
    """An event that is complete the moment it is recorded."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end_event: Any) -> float:
        return 0.0


_DEFAULT_STREAM = _NullStream()


class _StreamContext:
    """``torch.cuda.stream(s)``: a context that can be entered again and again, as torch's
    ``StreamContext`` is (Megatron's grad buffer makes one and enters it once per bucket); a
    generator-based context manager could be entered once only."""

    def __init__(self, stream: Any = None) -> None:
        self.stream = stream

    def __enter__(self) -> Any:
        return self.stream

    def __exit__(self, *exc_info: object) -> None:
        return None


class _DeviceContext:
    """``torch.cuda.device(d)``: re-enterable, as torch's own."""

    def __init__(self, device: Any = None) -> None:
        self.idx = device

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc_info: object) -> None:
        return None


def _lazy_call(callable: Callable[[], Any], **kwargs: Any) -> None:
    # The real one queues the call until CUDA initialises, which never happens on CPU ranks:
    # Megatron's RNG set-up would silently do nothing. Run it now instead.
    callable()


def _get_rng_state(device: Any = "cuda") -> torch.Tensor:
    return torch.get_rng_state()


def _set_rng_state(new_state: torch.Tensor, device: Any = "cuda") -> None:
    torch.set_rng_state(new_state)


def _manual_seed(seed: int) -> None:
    # Not torch.manual_seed: that calls torch.cuda.manual_seed_all, i.e. back into this.
    torch.default_generator.manual_seed(int(seed))


def _manual_seed_all(seed: int) -> None:
    torch.default_generator.manual_seed(int(seed))


def _returning(value: Any, name: str) -> Callable[..., Any]:
    # One function object per patched name: torch._dynamo keeps a rule per torch.cuda function and
    # rejects one object registered under two names.
    def stand_in(*args: Any, **kwargs: Any) -> Any:
        return value

    stand_in.__name__ = stand_in.__qualname__ = name
    return stand_in


def _cuda_attribute_replacements() -> dict[str, Any]:
    return {
        "current_device": _returning(0, "current_device"),
        "device_count": _returning(1, "device_count"),
        "set_device": _returning(None, "set_device"),
        "synchronize": _returning(None, "synchronize"),
        "empty_cache": _returning(None, "empty_cache"),
        "memory_allocated": _returning(0, "memory_allocated"),
        "max_memory_allocated": _returning(0, "max_memory_allocated"),
        "memory_reserved": _returning(0, "memory_reserved"),
        "max_memory_reserved": _returning(0, "max_memory_reserved"),
        "reset_peak_memory_stats": _returning(None, "reset_peak_memory_stats"),
        "reset_max_memory_allocated": _returning(None, "reset_max_memory_allocated"),
        "is_current_stream_capturing": _returning(False, "is_current_stream_capturing"),
        "Stream": _NullStream,
        "Event": _NullEvent,
        "current_stream": lambda device=None: _DEFAULT_STREAM,
        "default_stream": lambda device=None: _DEFAULT_STREAM,
        "stream": _StreamContext,
        "device": _DeviceContext,
        "get_rng_state": _get_rng_state,
        "set_rng_state": _set_rng_state,
        "manual_seed": _manual_seed,
        "manual_seed_all": _manual_seed_all,
        "default_generators": (torch.default_generator,),
        "_lazy_call": _lazy_call,
        "_lazy_init": _returning(None, "_lazy_init"),
    }


#: The ``torch.cuda`` attributes given CPU meanings (also patched in ``torch.cuda.random``).
PATCHED_CUDA_ATTRIBUTES: tuple[str, ...] = tuple(_cuda_attribute_replacements())

_CPU = torch.device("cpu")


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, bool):
        return False
    if isinstance(device, int):  # torch reads a bare int as a CUDA ordinal
        return True
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False


#: whether a device argument names a CUDA device (a bare int is a CUDA ordinal to torch)
is_cuda_device = _is_cuda_device


#: (module, function) whose own ``Tensor.type()`` calls get the CUDA type name of a CPU tensor.
#: megatron's clip asserts its gradients are ``torch.cuda.FloatTensor`` before scaling them in place;
#: on an emulated rank the device *is* the CPU, so an fp32 CPU gradient is what that check asks for.
CUDA_TYPE_CHECKERS: frozenset[tuple[str, str]] = frozenset(
    {
        ("megatron.core.optimizer.clip_grads", "clip_grad_by_total_norm_fp32"),
        # the mixed-precision optimizers sort their parameters by CUDA type (fp16/bf16 get fp32 main
        # copies, fp32 are used as they are) and refuse any other type
        ("megatron.core.optimizer.distrib_optimizer", "_build_model_and_main_param_groups"),
        ("megatron.core.optimizer.distrib_optimizer", "__init__"),
        ("megatron.core.optimizer.optimizer", "__init__"),
    }
)


#: (module, function) that read a CPU tensor's ``is_cuda`` as True. ``module`` matches the caller's
#: module name or its tail after a dot (Megatron-FSDP V2 ships both as ``megatron_fsdp`` and inside
#: megatron-core as ``megatron.core.distributed.fsdp.src.megatron_fsdp``). V2's ``DBuffer`` records the
#: stream a buffer was allocated on only for a CUDA buffer (``None`` for a CPU one) and later asserts
#: that it is the current stream; on an emulated rank the buffer *is* on the device, so it records
#: the emulated (null) stream, which the assertion then finds.
CUDA_DEVICE_CHECKERS: frozenset[tuple[str, str]] = frozenset(
    {("megatron_fsdp.experimental.dbuffer", "__init__")}
)


def _asked_by(checkers: frozenset[tuple[str, str]], depth: int = 2) -> bool:
    caller = sys._getframe(depth)
    module = caller.f_globals.get("__name__") or ""
    name = caller.f_code.co_name
    return any(
        name == function and (module == owner or module.endswith("." + owner)) for owner, function in checkers
    )


# torch's hints declare is_cuda a bool attribute; on the class it is a getset descriptor
_IS_CUDA_GETTER = torch.Tensor.is_cuda.__get__  # type: ignore[attr-defined]


def cuda_type_name(tensor: torch.Tensor) -> str:
    """``tensor.type()`` as it reads on the emulated device: ``torch.FloatTensor`` ->
    ``torch.cuda.FloatTensor`` (``torch.sparse.X`` -> ``torch.cuda.sparse.X``) for CPU tensors."""
    name = tensor.type()
    if tensor.device.type == "cpu" and name.startswith("torch.") and not name.startswith("torch.cuda."):
        return "torch.cuda." + name[len("torch.") :]
    return name


def _asked_by_a_cuda_type_checker(depth: int = 2) -> bool:
    caller = sys._getframe(depth)
    return (caller.f_globals.get("__name__"), caller.f_code.co_name) in CUDA_TYPE_CHECKERS


#: torch's factories of uninitialised memory, as seen by a torch function mode
_UNINITIALISED_FACTORIES = frozenset(
    {torch.empty, torch.empty_like, torch.empty_strided, torch.Tensor.new_empty}
)


def _filled_as_uninitialised(tensor: Any) -> Any:
    """``tensor`` (fresh from an uninitialised factory) filled as torch fills uninitialised memory
    under ``fill_uninitialized_memory``: NaN for floating and complex dtypes, the largest value for
    integers, True for bools."""
    if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta" or tensor.numel() == 0:
        return tensor
    if tensor.is_floating_point() or tensor.is_complex():
        value: float | int | bool = float("nan")
    elif tensor.dtype == torch.bool:
        value = True
    else:
        value = torch.iinfo(tensor.dtype).max
    with torch.no_grad():
        tensor.fill_(value)
    return tensor


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA device arguments to the CPU for every torch call made under it."""

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs and _asked_by_a_cuda_type_checker():
            return cuda_type_name(args[0])
        if func == _IS_CUDA_GETTER and len(args) == 1 and _asked_by(CUDA_DEVICE_CHECKERS):
            return args[0].device.type == "cpu" or func(*args)
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs = {**kwargs, "device": _CPU}
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], _CPU, *args[2:])
        if func in _UNINITIALISED_FACTORIES:
            return _filled_as_uninitialised(func(*args, **kwargs))
        return func(*args, **kwargs)


def _backward_under(mode: TorchFunctionMode, original: Callable[..., Any]) -> Callable[..., Any]:
    """torch's ``_engine_run_backward`` (what ``Tensor.backward``, ``torch.autograd.backward`` and
    ``torch.autograd.grad`` call the autograd engine through), run with ``mode`` on the stack.

    A torch function mode is off while its own handler runs, and those three are torch functions:
    the mode's handler forwards them, so without this the engine would start with the mode off and
    every hook and ``autograd.Function.backward`` of the backward (Megatron-FSDP's gradient hooks,
    an activation recompute) would run un-emulated (the engine gives its nodes the thread-local state
    of the caller that started it). Megatron's schedule calls the engine itself and never saw it.
    Where ``mode`` is already on the stack (the engine called from under it), it is not pushed twice:
    a mode on the stack twice would dispatch its own forwarded calls back to itself without end.
    """

    def _engine_run_backward(*args: Any, **kwargs: Any) -> Any:
        if any(entry is mode for entry in _function_mode_stack()):
            return original(*args, **kwargs)
        with mode:
            return original(*args, **kwargs)

    _engine_run_backward.__wrapped__ = original  # type: ignore[attr-defined]  # as functools.wraps sets it
    return _engine_run_backward


def _function_mode_stack() -> list[Any]:
    from torch.overrides import _get_current_function_mode_stack

    return list(_get_current_function_mode_stack())  # type: ignore[no-untyped-call]  # unannotated in torch


def _from_group_on_cpu(original: Callable[..., Any]) -> Callable[..., Any]:
    def from_group(group: Any, device_type: str = "cpu", *args: Any, **kwargs: Any) -> Any:
        if device_type == "cuda":
            device_type = "cpu"
        return original(group, device_type, *args, **kwargs)

    return from_group


def _init_device_mesh_on_cpu(original: Callable[..., Any]) -> Callable[..., Any]:
    def init_device_mesh(device_type: str, *args: Any, **kwargs: Any) -> Any:
        if device_type == "cuda":
            device_type = "cpu"
        return original(device_type, *args, **kwargs)

    return init_device_mesh


class PremulSum:
    """What ``torch.distributed._make_nccl_premul_sum(factor)`` returns under the emulation."""

    def __init__(self, factor: Any) -> None:
        self.factor = factor

    def __repr__(self) -> str:
        return f"PremulSum({self.factor!r})"


def _make_premul_sum(factor: Any) -> PremulSum:
    return PremulSum(factor)


def _premul_aware(original: Callable[..., Any], tensor_arg: str) -> Callable[..., Any]:
    """``original`` (a collective taking ``op=``), with a :class:`PremulSum` op done as scale + SUM.

    NCCL's PREMUL_SUM is ``sum_r(factor * x_r)``: scaling each rank's input before a SUM is the
    same sum. The input is scaled in place, as Megatron-FSDP's own unfused path does
    (``grad_data.mul_(scaling_factor)``, then SUM): a scaled copy would be freed while an
    asynchronous or coalesced collective still reads it (measured: a segfault in gloo's coalesced
    reduce-scatter on torch 2.14).
    """
    signature = inspect.signature(original)

    def collective(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        op = bound.arguments.get("op")
        if isinstance(op, PremulSum):
            bound.arguments[tensor_arg].mul_(op.factor)
            bound.arguments["op"] = _dist.ReduceOp.SUM
        return original(*bound.args, **bound.kwargs)

    collective.__name__ = collective.__qualname__ = original.__name__
    collective.__doc__ = original.__doc__
    return collective


class _CompletedWork:
    """What an ``async_op=True`` collective returns when the emulation ran it to completion."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True


def _uneven_aware_all_gather(original: Callable[..., Any]) -> Callable[..., Any]:
    """``all_gather`` (``original``) that also takes outputs of different shapes, as NCCL does (torch's
    NCCL backend then broadcasts from each rank in turn, in one group call); gloo's allgather refuses
    them ("invalid tensor size"). Megatron-FSDP gathers uneven DTensor shards this way
    (``uneven_dtensor.gather_uneven_dtensor_to_full_tensor``). Here each rank broadcasts its input in
    turn into the others' output of its index; outputs of one shape go to gloo's allgather as before.
    """
    signature = inspect.signature(original)

    def all_gather(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        outputs, tensor = bound.arguments["tensor_list"], bound.arguments["tensor"]
        if all(output.shape == tensor.shape for output in outputs):
            return original(*bound.args, **bound.kwargs)
        group = bound.arguments.get("group")
        me = _dist.get_rank(group)
        for index, output in enumerate(outputs):
            source = _dist.get_global_rank(group, index) if group is not None else index
            if index == me:
                _dist.broadcast(tensor.detach().contiguous(), src=source, group=group)
                output.copy_(tensor)
                continue
            staged = output.detach().contiguous()  # the output itself where it is dense
            _dist.broadcast(staged, src=source, group=group)
            if staged.data_ptr() != output.data_ptr():
                output.copy_(staged)
        return _CompletedWork() if bound.arguments.get("async_op") else None

    all_gather.__name__ = all_gather.__qualname__ = original.__name__
    all_gather.__doc__ = original.__doc__
    return all_gather


def _gloo_devices() -> list[Any]:
    """The devices torch's own gloo constructor picks: one per ``GLOO_SOCKET_IFNAME`` entry, or the
    host's default."""
    from torch.distributed import ProcessGroupGloo

    interfaces = [name for name in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if name]
    if interfaces:
        return [ProcessGroupGloo.create_device(interface=name) for name in interfaces]
    return [ProcessGroupGloo.create_default_device()]


def _in_order_gloo_class() -> type:
    from torch.distributed import ProcessGroupGloo
    from torch.distributed.constants import default_pg_timeout

    class InOrderProcessGroupGloo(ProcessGroupGloo):
        """A gloo process group with one worker thread: its collectives run in issue order.

        torch builds gloo groups as ``ProcessGroupGloo(store, rank, size, timeout=..., **flags)``;
        this builds the same options torch would, with ``_threads = 1``. A caller passing its own
        ``_Options`` keeps them as given.
        """

        def __init__(self, store: Any, rank: int, size: int, *args: Any, **kwargs: Any) -> None:
            # _Options: the private options class torch's own gloo constructor uses; not in its hints
            if args and isinstance(args[0], ProcessGroupGloo._Options):  # type: ignore[attr-defined]
                super().__init__(store, rank, size, *args, **kwargs)
                return
            options = ProcessGroupGloo._Options()  # type: ignore[attr-defined]
            options._timeout = args[0] if args else kwargs.pop("timeout", default_pg_timeout)
            options._devices = _gloo_devices()
            options._threads = 1
            for name, value in kwargs.items():  # e.g. enable_reconfigure; unknown names raise
                setattr(options, name, value)
            super().__init__(store, rank, size, options)

    return InOrderProcessGroupGloo


class PatchSet:
    """Attributes set on torch's modules and classes, each original remembered so :meth:`restore`
    undoes them exactly, last first (the emulation's and the foreign-suite layer's)."""

    _MISSING = object()

    def __init__(self) -> None:
        self._originals: list[tuple[Any, str, Any]] = []

    def patch(self, owner: Any, name: str, value: Any) -> None:
        self._originals.append((owner, name, owner.__dict__.get(name, self._MISSING)))
        setattr(owner, name, value)

    def restore(self) -> None:
        for owner, name, original in reversed(self._originals):
            if original is self._MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        self._originals.clear()


class _Emulation:
    """The applied patch set: remembers every original so :meth:`restore` undoes it exactly."""

    def __init__(self) -> None:
        self._patches = PatchSet()
        self._patch = self._patches.patch
        self._mode: _CudaToCpuMode | None = None

    def apply(self) -> None:
        import torch.cuda.random as cuda_random

        for name, value in _cuda_attribute_replacements().items():
            self._patch(torch.cuda, name, value)
            if name in cuda_random.__dict__:
                self._patch(cuda_random, name, value)
        mesh_cls = _device_mesh.DeviceMesh
        self._patch(mesh_cls, "from_group", staticmethod(_from_group_on_cpu(mesh_cls.from_group)))
        self._patch(
            _device_mesh,
            "init_device_mesh",
            _init_device_mesh_on_cpu(_device_mesh.init_device_mesh),
        )
        self._patch(_dist, "_make_nccl_premul_sum", _make_premul_sum)
        self._patch(_dist, "reduce_scatter_tensor", _premul_aware(_dist.reduce_scatter_tensor, "input"))
        self._patch(_dist, "all_reduce", _premul_aware(_dist.all_reduce, "tensor"))
        self._patch(_dist, "all_gather", _uneven_aware_all_gather(_dist.all_gather))
        # torch's group constructors look the class up in distributed_c10d at call time
        self._patch(_c10d, "ProcessGroupGloo", _in_order_gloo_class())
        self._mode = _CudaToCpuMode()
        # torch.autograd binds the engine entry by name (from .graph import _engine_run_backward)
        for module in (torch.autograd, torch.autograd.graph):
            engine_entry = module._engine_run_backward
            self._patch(module, "_engine_run_backward", _backward_under(self._mode, engine_entry))
        self._mode.__enter__()  # type: ignore[no-untyped-call]  # torch leaves TorchFunctionMode's unannotated

    def restore(self) -> None:
        if self._mode is not None:
            self._mode.__exit__(None, None, None)  # type: ignore[no-untyped-call]  # unannotated in torch
            self._mode = None
        self._patches.restore()


_active: _Emulation | None = None


class EmulationOrderError(RuntimeError):
    """CPU emulation was requested after megatron had already bound the real CUDA entry points."""


def enable() -> None:
    """Give the CUDA entry points Megatron-FSDP uses CPU meanings. Idempotent.

    Raises :class:`EmulationOrderError` if megatron's RNG module was imported first: it holds the real
    ``_lazy_call`` by then, and its RNG set-up would silently do nothing.
    """
    global _active
    if _active is not None:
        return
    if "megatron.core.tensor_parallel.random" in sys.modules:
        raise EmulationOrderError(
            "CUDA-on-CPU emulation must be enabled before megatron.core is imported; "
            "something imported megatron first (import it inside the test, not at module level "
            "of a conftest or plugin)."
        )
    emulation = _Emulation()
    emulation.apply()
    _active = emulation


def disable() -> None:
    """Undo :func:`enable` exactly; a no-op when emulation is not active."""
    global _active
    if _active is None:
        return
    _active.restore()
    _active = None


def is_enabled() -> bool:
    return _active is not None


@contextlib.contextmanager
def emulated() -> Iterator[None]:
    """Context manager form of :func:`enable` / :func:`disable`."""
    enable()
    try:
        yield
    finally:
        disable()
