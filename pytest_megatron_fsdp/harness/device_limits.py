"""What the emulated CUDA device does not have, said where a foreign suite reaches for it.

On CPU ranks the "CUDA device" of a suite written for GPUs (``--mfsdp-foreign-suite``) is the CPU.
Some of what such a suite asks for exists only on a GPU; answered quietly, each would fail the test
far from its cause (a memory delta of 0 bytes, a profile without kernels, a pool that allocates
nothing symmetric) or pass a check that cannot fail. Instead, each entry point below raises
:class:`EmulatedDeviceLacks`, naming the feature, where the test asks for it:

* CUDA graphs: ``torch.cuda.CUDAGraph()``, ``torch.cuda.graph(...)``,
  ``torch.cuda.make_graphed_callables``;
* symmetric memory: ``torch.distributed._symmetric_memory``'s ``get_mem_pool``, ``empty`` and
  ``rendezvous`` (its ``is_symm_mem_tensor`` answers as usual: no tensor is one);
* CUDA memory accounting: ``torch.cuda.memory_allocated``, ``max_memory_allocated``,
  ``memory_reserved``, ``max_memory_reserved``, ``memory_stats`` and ``mem_get_info``; except to the
  library heuristics and log lines in :data:`IDLE_MEMORY_READERS`, which read an idle device's 0 as
  the plain emulation answers everyone;
* a CUDA kernel trace: ``torch.profiler.profile(activities=[..., ProfilerActivity.CUDA])``; a
  profile that names no activities records the CPU's (what torch records without a GPU).

The plugin reports a test that fails with this error as skipped, ``GPU-only: <feature>``
(``pytest_megatron_fsdp/fsdp/gpu_only.py`` knows it by its class name and the text "has no
<feature>"). The error is raised only where the feature is asked for: what the test did before it
ran, and any failure there stays a failure.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

__all__ = [
    "CUDA_GRAPHS",
    "IDLE_MEMORY_READERS",
    "KERNEL_TRACE",
    "MEMORY_ACCOUNTING",
    "SYMMETRIC_MEMORY",
    "EmulatedDeviceLacks",
    "apply",
]

#: the features, as :class:`EmulatedDeviceLacks` names them
CUDA_GRAPHS = "CUDA graphs"
SYMMETRIC_MEMORY = "symmetric memory"
MEMORY_ACCOUNTING = "CUDA memory accounting"
KERNEL_TRACE = "CUDA kernel trace"


class EmulatedDeviceLacks(RuntimeError):
    """A foreign suite asked the emulated CUDA device (the CPU) for what only a GPU has."""

    def __init__(self, feature: str, entry: str) -> None:
        super().__init__(f"the emulated CUDA device (a CPU rank) has no {feature}: {entry} needs a GPU")
        self.feature = feature


def _refusing(feature: str, entry: str) -> Callable[..., Any]:
    def stand_in(*args: Any, **kwargs: Any) -> Any:
        raise EmulatedDeviceLacks(feature, entry)

    stand_in.__name__ = stand_in.__qualname__ = entry.rsplit(".", 1)[-1]
    return stand_in


class _NoCUDAGraph:
    """``torch.cuda.CUDAGraph``: refuses to be made."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise EmulatedDeviceLacks(CUDA_GRAPHS, "torch.cuda.CUDAGraph")


#: (module, function) that read the memory accounting for a heuristic or a log line, never for what
#: a test asserts, and take an idle device's 0: Megatron-FSDP's ``check_gpu_memory`` (empty the
#: cache before a meta-device initialisation when the device is over half full) and Megatron-Bridge's
#: ``report_memory`` (its training log's memory figures, every ``tensorboard_log_interval``: with
#: ``memory_stats()`` empty it reports none). ``module`` matches the caller's module name or its
#: tail after a dot (Megatron-FSDP ships as ``megatron_fsdp`` and inside megatron-core).
IDLE_MEMORY_READERS: frozenset[tuple[str, str]] = frozenset(
    {
        ("megatron_fsdp.param_and_grad_buffer", "check_gpu_memory"),
        ("megatron.bridge.training.utils.train_utils", "report_memory"),
    }
)

_MEMORY_QUERIES: dict[str, Any] = {
    "memory_allocated": 0,
    "max_memory_allocated": 0,
    "memory_reserved": 0,
    "max_memory_reserved": 0,
    "memory_stats": {},
    "mem_get_info": (0, 0),
}


def _read_by_an_idle_memory_reader() -> bool:
    caller = sys._getframe(2)
    module = caller.f_globals.get("__name__") or ""
    return any(
        caller.f_code.co_name == function and (module == owner or module.endswith("." + owner))
        for owner, function in IDLE_MEMORY_READERS
    )


def _memory_query(name: str, idle: Any) -> Callable[..., Any]:
    def query(*args: Any, **kwargs: Any) -> Any:
        if _read_by_an_idle_memory_reader():
            return idle
        raise EmulatedDeviceLacks(MEMORY_ACCOUNTING, f"torch.cuda.{name}")

    query.__name__ = query.__qualname__ = name
    return query


def _profile_without_kernel_trace(original: type) -> type:
    from torch.profiler import ProfilerActivity

    class profile(original):  # type: ignore[misc]  # a class given as a value, subclassed
        """``torch.profiler.profile``: refuses the CUDA activity, records the CPU's by default."""

        def __init__(self, *, activities: Any = None, **kwargs: Any) -> None:
            wanted = [ProfilerActivity.CPU] if activities is None else list(activities)
            # an activity, or (torch 2.14) a dict of an activity to its options
            if any(
                a == ProfilerActivity.CUDA or (isinstance(a, dict) and ProfilerActivity.CUDA in a)
                for a in wanted
            ):
                raise EmulatedDeviceLacks(KERNEL_TRACE, "torch.profiler.profile(ProfilerActivity.CUDA)")
            super().__init__(activities=wanted, **kwargs)

    profile.__module__ = original.__module__
    return profile


def apply(patch: Callable[[Any, str, Any], None]) -> None:
    """Set each stand-in with ``patch(owner, name, value)`` (a :class:`.cuda_emulation.PatchSet`'s,
    which undoes them)."""
    import torch.distributed._symmetric_memory as symm_mem
    import torch.profiler
    import torch.profiler.profiler

    patch(torch.cuda, "CUDAGraph", _NoCUDAGraph)
    patch(torch.cuda, "graph", _refusing(CUDA_GRAPHS, "torch.cuda.graph"))
    patch(torch.cuda, "make_graphed_callables", _refusing(CUDA_GRAPHS, "torch.cuda.make_graphed_callables"))
    for name in ("get_mem_pool", "empty", "rendezvous"):
        patch(symm_mem, name, _refusing(SYMMETRIC_MEMORY, f"torch.distributed._symmetric_memory.{name}"))
    for name, idle in _MEMORY_QUERIES.items():
        patch(torch.cuda, name, _memory_query(name, idle))
    profile = _profile_without_kernel_trace(torch.profiler.profiler.profile)
    patch(torch.profiler, "profile", profile)
    patch(torch.profiler.profiler, "profile", profile)
