"""What a test suite written for GPUs needs beyond the CUDA-on-CPU emulation to run on CPU ranks.

The emulation (:mod:`.cuda`) gives the CUDA entry points Megatron-FSDP's own code uses
CPU meanings, and keeps ``torch.cuda.is_available()`` honest (``False``): the plugin's fixtures know
they run on CPU ranks. A suite that knows nothing of the plugin (Megatron-LM's own unit tests)
asks for NCCL, one device per local rank and a CUDA device by name, and picks the CPU where
``is_available()`` says so (then Megatron-FSDP V2 refuses: it needs a CUDA device). This layer,
applied over the emulation in the plugin's foreign-suite mode (``--mfsdp-foreign-suite``), answers
those calls as one GPU per local rank would, each line for the upstream call that needs it:

* ``init_process_group(backend="nccl" | None | "cpu:gloo,cuda:nccl")``, ``new_group(backend="nccl",
  pg_options=<NCCL options>)`` (also the names ``torch.distributed.device_mesh`` binds): gloo, the
  NCCL options dropped (but NCCL's zero-CTA policy, asked for symmetric memory: a
  ``GPU-only: symmetric memory`` skip, :func:`.device_limits.refuse_zero_cta`), a CUDA
  ``device_id`` dropped, the timeout capped (a rank that failed must not leave its peers in gloo's
  30-minute default); each group ``new_group`` makes recorded
  (:func:`made_groups`: the rank session frees it when its test or fixture is over), and
  ``init_process_group`` for the world the default group already spans uses that group (the rank
  session makes it before the tests; the suite's own first call would make it on GPUs);
* ``barrier(device_ids=[...])``: the device ids dropped (a gloo barrier takes none);
* ``torch.cuda.device_count()`` and ``torch.accelerator.device_count()``: the local world size (so
  ``local_rank % device_count()`` is the local rank), ``torch.cuda.default_generators`` one CPU
  generator per device;
* ``set_device``/``current_device`` (and ``torch.accelerator``'s index calls): remembered and
  answered, per process;
* ``torch.cuda.is_available()`` and ``torch.accelerator.is_available()``: ``True``. This is
  torch-wide: every library in the rank process sees a CUDA device;
* ``get_device_capability``/``get_device_name``/``get_device_properties``: an sm 8.0 device (no FP8,
  no MXFP8: the paths that need them stay off, as on an A100), named as the emulation it is;
* ``torch.cuda.MemPool``/``use_mem_pool``: a pool that allocates nothing of its own;
* ``torch.accelerator.current_stream``/``synchronize``: the emulation's null stream;
* a storage that Megatron-FSDP V2 releases and grows back gets its block back, at its address, as
  from CUDA's caching allocator (:mod:`.caching_allocator`);
* what only a GPU has (CUDA graphs, symmetric memory, CUDA memory accounting, a CUDA kernel trace):
  raises :class:`.device_limits.EmulatedDeviceLacks` where asked for (:mod:`.device_limits`).
"""

from __future__ import annotations

import contextlib
import datetime
import inspect
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as _dist
import torch.distributed.device_mesh as _device_mesh
import torch.distributed.distributed_c10d as _c10d

from . import caching_allocator, device_limits
from . import cuda as cuda_emulation
from .made_groups import MadeGroups

__all__ = ["EMULATED_CAPABILITY", "disable", "enable", "is_enabled", "made_groups"]

#: the compute capability the emulated devices report: an A100's (no FP8 or MXFP8 paths)
EMULATED_CAPABILITY = (8, 0)
#: what ``get_device_name`` answers
EMULATED_DEVICE_NAME = "CPU (CUDA emulated by pytest-megatron-fsdp)"


def _is_gloo_able(backend: Any) -> bool:
    """Whether ``backend`` names NCCL (alone or for CUDA devices), or is left to torch's choice."""
    if backend is None:
        return True
    text = str(backend).lower()
    return "nccl" in text or text in {"cuda", "undefined"}


def _capped(timeout: Any, cap_s: float) -> datetime.timedelta:
    cap = datetime.timedelta(seconds=cap_s)
    return cap if timeout is None or timeout > cap else timeout


def _on_gloo(original: Callable[..., Any], cap_s: float, made: MadeGroups) -> Callable[..., Any]:
    """``original`` (``init_process_group`` or ``new_group``) making a gloo group where NCCL was
    asked for (its NCCL options and CUDA device dropped), its timeout at most ``cap_s``; each group
    ``new_group`` makes is recorded in ``made``. ``init_process_group`` for the world the rank
    session's default group already spans (no other rank or world size asked for) uses that group:
    the suite's first call makes its default group under torchrun, where the rank session made one
    before the tests."""
    signature = inspect.signature(original)
    makes_default = original.__name__ == "init_process_group"

    def on_gloo(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        given = bound.arguments
        if makes_default and _dist.is_initialized() and _same_world(given):
            return None
        if _is_gloo_able(given.get("backend")):
            given["backend"] = "gloo"
            device_limits.refuse_zero_cta(given.pop("pg_options", None))
        device_id = given.get("device_id")
        if device_id is not None and cuda_emulation.is_cuda_device(device_id):
            given.pop("device_id")
        if "timeout" in signature.parameters:
            given["timeout"] = _capped(given.get("timeout"), cap_s)
        group = original(*bound.args, **bound.kwargs)
        if not makes_default:
            made.record(group)
        return group

    on_gloo.__name__ = on_gloo.__qualname__ = original.__name__
    on_gloo.__doc__ = original.__doc__
    return on_gloo


def _same_world(given: dict[str, Any]) -> bool:
    """Whether an ``init_process_group`` call asks for the world the default group spans (a rank
    and world size left to the environment, or equal to the group's)."""
    return given.get("rank", -1) in (-1, None, _dist.get_rank()) and given.get("world_size", -1) in (
        -1,
        None,
        _dist.get_world_size(),
    )


def _without_device_ids(original: Callable[..., Any]) -> Callable[..., Any]:
    def barrier(*args: Any, device_ids: Any = None, **kwargs: Any) -> Any:
        return original(*args, **kwargs)

    barrier.__name__ = barrier.__qualname__ = original.__name__
    barrier.__doc__ = original.__doc__
    return barrier


class _Devices:
    """The emulated devices of one rank process: as many as local ranks, one of them current."""

    def __init__(self, count: int, current: int) -> None:
        self.count = count
        self.current = current

    def index(self, device: Any) -> int:
        if device is None:
            return self.current
        if isinstance(device, int):
            return device
        parsed = torch.device(device) if isinstance(device, str) else device
        return parsed.index if getattr(parsed, "index", None) is not None else self.current

    def set_device(self, device: Any) -> None:
        self.current = self.index(device)

    def current_device(self) -> int:
        return self.current

    def device_count(self) -> int:
        return self.count

    def capability(self, device: Any = None) -> tuple[int, int]:
        return EMULATED_CAPABILITY

    def name(self, device: Any = None) -> str:
        return EMULATED_DEVICE_NAME

    def properties(self, device: Any = None) -> SimpleNamespace:
        major, minor = EMULATED_CAPABILITY
        return SimpleNamespace(
            name=EMULATED_DEVICE_NAME,
            major=major,
            minor=minor,
            total_memory=80 * 2**30,
            multi_processor_count=108,
            is_integrated=False,
            is_multi_gpu_board=False,
            L2_cache_size=40 * 2**20,
            gcnArchName="",
            uuid="",
        )


class _NullMemPool:
    """``torch.cuda.MemPool()``: allocations under it come from the CPU allocator as any others."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.id = (0, 0)

    def use_count(self) -> int:
        return 1

    def snapshot(self) -> list[Any]:
        return []


@contextlib.contextmanager
def _use_mem_pool(pool: Any, device: Any = None) -> Iterator[None]:
    yield


def _always(value: Any, name: str) -> Callable[..., Any]:
    def stand_in(*args: Any, **kwargs: Any) -> Any:
        return value

    stand_in.__name__ = stand_in.__qualname__ = name
    return stand_in


def _named(function: Callable[..., Any], name: str) -> Callable[..., Any]:
    """``function`` under a name of its own (torch._dynamo keeps one rule per torch.cuda function
    object and rejects one object under two names)."""

    def stand_in(*args: Any, **kwargs: Any) -> Any:
        return function(*args, **kwargs)

    stand_in.__name__ = stand_in.__qualname__ = name
    return stand_in


class _ForeignLayer:
    """The applied patch set over the emulation; :meth:`restore` undoes it exactly."""

    def __init__(self, devices: _Devices, pg_timeout_s: float) -> None:
        self.devices = devices
        self.pg_timeout_s = pg_timeout_s
        #: the groups the patched group-making functions made (freed by the rank session)
        self.made = MadeGroups()
        self._patches = cuda_emulation.PatchSet()
        self._patch = self._patches.patch
        #: megatron-core's Transformer Engine stand-ins, refused once its extension is imported
        self.te_stand_ins = device_limits.TransformerEngineStandIns()

    def apply(self) -> None:
        import torch.cuda.random as cuda_random

        devices = self.devices
        cuda = {
            "is_available": _always(True, "is_available"),
            "device_count": _named(devices.device_count, "device_count"),
            "current_device": _named(devices.current_device, "current_device"),
            "set_device": _named(devices.set_device, "set_device"),
            "get_device_capability": _named(devices.capability, "get_device_capability"),
            "get_device_name": _named(devices.name, "get_device_name"),
            "get_device_properties": _named(devices.properties, "get_device_properties"),
            "default_generators": (torch.default_generator,) * devices.count,
            "MemPool": _NullMemPool,
            "use_mem_pool": _use_mem_pool,
        }
        for name, value in cuda.items():
            self._patch(torch.cuda, name, value)
            if name in cuda_random.__dict__:
                self._patch(cuda_random, name, value)
        accelerator = getattr(torch, "accelerator", None)
        if accelerator is not None:
            for name, value in {
                "is_available": _always(True, "is_available"),
                "device_count": _named(devices.device_count, "device_count"),
                "current_accelerator": _always(torch.device("cuda"), "current_accelerator"),
                "current_device_index": _named(devices.current_device, "current_device_index"),
                "current_device_idx": _named(devices.current_device, "current_device_idx"),
                "set_device_index": _named(devices.set_device, "set_device_index"),
                "set_device_idx": _named(devices.set_device, "set_device_idx"),
                "current_stream": _always(torch.cuda.current_stream(), "current_stream"),
                "synchronize": _always(None, "synchronize"),
            }.items():
                if hasattr(accelerator, name):
                    self._patch(accelerator, name, value)
        for owner in (_dist, _c10d, _device_mesh):
            for name in ("init_process_group", "new_group"):
                if name in owner.__dict__:
                    self._patch(owner, name, _on_gloo(owner.__dict__[name], self.pg_timeout_s, self.made))
        for owner in (_dist, _c10d):
            self._patch(owner, "barrier", _without_device_ids(owner.__dict__["barrier"]))
        device_limits.apply(self._patch)
        caching_allocator.apply(self._patch)

    def restore(self) -> None:
        self.te_stand_ins.restore()
        self._patches.restore()


_active: _ForeignLayer | None = None


def enable(local_world_size: int, local_rank: int, pg_timeout_s: float) -> None:
    """The layer on, over the emulation (which must be on): ``local_world_size`` emulated devices,
    ``local_rank``'s current; process groups time out after at most ``pg_timeout_s``. Idempotent."""
    global _active
    if _active is not None:
        return
    if not cuda_emulation.is_enabled():
        raise RuntimeError("the foreign-suite layer goes over the CUDA emulation: enable that first")
    layer = _ForeignLayer(_Devices(local_world_size, local_rank), pg_timeout_s)
    layer.apply()
    _active = layer


def disable() -> None:
    """Undo :func:`enable` exactly (before the emulation's own ``disable``); a no-op when off."""
    global _active
    if _active is None:
        return
    _active.restore()
    _active = None


def is_enabled() -> bool:
    return _active is not None


def before_test() -> None:
    """What the layer does before each test: refuse megatron-core's Transformer Engine stand-ins
    once a test or its module has imported them (:class:`.device_limits.TransformerEngineStandIns`)."""
    if _active is not None:
        _active.te_stand_ins.refuse()


def made_groups() -> MadeGroups | None:
    """The process groups made through the layer's functions so far (None while it is off)."""
    return _active.made if _active is not None else None
