"""What the emulated CUDA device does not have, said where a foreign suite reaches for it.

On CPU ranks the "CUDA device" of a suite written for GPUs (``--mfsdp-foreign-suite``) is the CPU.
Some of what such a suite asks for exists only on a GPU; answered quietly, each would fail the test
far from its cause (a memory delta of 0 bytes, a profile without kernels, a pool that allocates
nothing symmetric) or pass a check that cannot fail. Instead, each entry point below raises
:class:`EmulatedDeviceLacks`, naming the feature, where the test asks for it:

* CUDA graphs: ``torch.cuda.CUDAGraph()``, ``torch.cuda.graph(...)``,
  ``torch.cuda.make_graphed_callables``;
* symmetric memory: ``torch.distributed._symmetric_memory``'s ``get_mem_pool``, ``empty`` and
  ``rendezvous`` (its ``is_symm_mem_tensor`` answers as usual: no tensor is one); and a group asked
  for with NCCL's zero-CTA policy (``pg_options.config.cta_policy = NCCL_CTA_POLICY_ZERO``,
  :func:`refuse_zero_cta`): that policy exists for NCCL's copy-engine collectives over
  symmetric-memory windows, and a suite asks for it when it sets up symmetric memory, often long
  before it reaches for the memory itself (Megatron-LM's ``test_overlap.py`` builds a 4 GiB model
  per rank in between: at 8 ranks that is the machine's memory, for a test that then skips);
* CUDA memory accounting: ``torch.cuda.memory_allocated``, ``max_memory_allocated``,
  ``memory_reserved``, ``max_memory_reserved``, ``memory_stats`` and ``mem_get_info``; except to the
  library heuristics and log lines in :data:`IDLE_MEMORY_READERS`, which read an idle device's 0 as
  the plain emulation answers everyone;
* a CUDA kernel trace: ``torch.profiler.profile(activities=[..., ProfilerActivity.CUDA])``; a
  profile that names no activities records the CPU's (what torch records without a GPU);
* a CUDA C++ extension built at run time: ``torch.utils.cpp_extension.load_inline`` and ``load``
  with CUDA (``with_cuda=True``, CUDA sources, ``.cu`` files), as megatron-core's NCCL allocator
  builds one (a C++-only extension builds as usual): its kernels could not run on a CPU rank, and
  the build would fail far from its cause, writing into the checkout;
* Transformer Engine, where megatron-core stands it in (:class:`TransformerEngineStandIns`): the TE
  layer classes its extension module builds on a ``MagicMock`` when TE is missing raise
  ``ModuleNotFoundError`` for ``transformer_engine`` (a ``GPU-only: Transformer Engine`` skip)
  instead of answering with mocks.

The plugin reports a test that fails with this error as skipped, ``GPU-only: <feature>``
(``pytest_megatron_fsdp/foreign/gpu_only.py`` knows it by its class name and the text "has no
<feature>"). The error is raised only where the feature is asked for: what the test did before it
ran, and any failure there stays a failure.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

__all__ = [
    "CUDA_EXTENSION",
    "CUDA_GRAPHS",
    "IDLE_MEMORY_READERS",
    "KERNEL_TRACE",
    "MEMORY_ACCOUNTING",
    "SYMMETRIC_MEMORY",
    "TE_EXTENSION",
    "EmulatedDeviceLacks",
    "TransformerEngineStandIns",
    "apply",
    "refuse_zero_cta",
]

#: the features, as :class:`EmulatedDeviceLacks` names them
CUDA_GRAPHS = "CUDA graphs"
SYMMETRIC_MEMORY = "symmetric memory"
MEMORY_ACCOUNTING = "CUDA memory accounting"
KERNEL_TRACE = "CUDA kernel trace"
CUDA_EXTENSION = "CUDA C++ extension build"


class EmulatedDeviceLacks(RuntimeError):
    """A foreign suite asked the emulated CUDA device (the CPU) for what only a GPU has."""

    def __init__(self, feature: str, entry: str) -> None:
        super().__init__(f"the emulated CUDA device (a CPU rank) has no {feature}: {entry} needs a GPU")
        self.feature = feature


def refuse_zero_cta(pg_options: Any) -> None:
    """Raise :class:`EmulatedDeviceLacks` (symmetric memory) when ``pg_options`` (NCCL's
    ``ProcessGroupNCCL.Options``, given to ``new_group``) asks for NCCL's zero-CTA policy; any other
    options are for the caller to drop. A torch without NCCL has no such options to ask with."""
    nccl = getattr(
        getattr(sys.modules.get("torch.distributed"), "ProcessGroupNCCL", None), "NCCL_CTA_POLICY_ZERO", None
    )
    policy = getattr(getattr(pg_options, "config", None), "cta_policy", None)
    if nccl is not None and policy is not None and policy == nccl:
        raise EmulatedDeviceLacks(
            SYMMETRIC_MEMORY, "a process group with NCCL's zero-CTA policy (its copy-engine collectives)"
        )


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


def _without_cuda_extensions(original: Callable[..., Any], name: str) -> Callable[..., Any]:
    """``torch.utils.cpp_extension.<name>``, refusing a build with CUDA (a C++-only one goes on)."""

    def build(*args: Any, **kwargs: Any) -> Any:
        if name == "load_inline":
            cuda = kwargs.get("cuda_sources", args[2] if len(args) > 2 else None)
        else:
            sources = kwargs.get("sources", args[1] if len(args) > 1 else ())
            cuda = any(
                str(s).endswith((".cu", ".cuh")) for s in ([sources] if isinstance(sources, str) else sources)
            )
        if kwargs.get("with_cuda") or (kwargs.get("with_cuda") is None and cuda):
            raise EmulatedDeviceLacks(CUDA_EXTENSION, f"torch.utils.cpp_extension.{name}(with CUDA)")
        return original(*args, **kwargs)

    build.__name__ = build.__qualname__ = name
    return build


#: megatron-core's Transformer Engine extension: without TE it sets ``te = MagicMock()`` and defines
#: its layer classes on it (``class TEDotProductAttention(te.pytorch.DotProductAttention)``)
TE_EXTENSION = "megatron.core.extensions.transformer_engine"


def _transformer_engine_missing(*args: Any, **kwargs: Any) -> Any:
    raise ModuleNotFoundError(
        "No module named 'transformer_engine': megatron-core's Transformer Engine layers are "
        f"stand-ins without it ({TE_EXTENSION}, HAVE_TE=False)",
        name="transformer_engine",
    )


class TransformerEngineStandIns:
    """The TE layer classes megatron-core defines on its ``MagicMock`` when Transformer Engine is
    missing, made to say so.

    A class statement whose base is a mock makes another mock, called with the class's name, bases
    and namespace (``spec``, ``side_effect``, ``return_value``): "instantiating" it returns its base
    mock the first time in a process and raises ``StopIteration`` after. A test that builds TE layers
    (a TE layer spec) then passes on a rank where the mock answered and fails on another where it was
    already spent, by the order of the tests. :meth:`refuse` sets each such class to raise
    ``ModuleNotFoundError`` for ``transformer_engine`` instead, once megatron-core has imported its
    extension without TE; :meth:`restore` undoes it."""

    def __init__(self) -> None:
        self._refused: list[tuple[Any, Any]] = []
        self._done = False

    def refuse(self) -> int:
        """Refuse the stand-ins if the extension is imported (without TE) and not refused yet;
        returns how many it refused now. Cheap when there is nothing to do: call it before each test."""
        module = sys.modules.get(TE_EXTENSION)
        if self._done or module is None or getattr(module, "HAVE_TE", True):
            return 0
        from unittest.mock import NonCallableMock

        for value in list(vars(module).values()):
            if not isinstance(value, NonCallableMock):
                continue
            namespace = value.return_value
            if isinstance(namespace, dict) and namespace.get("__module__") == TE_EXTENSION:
                self._refused.append((value, value.side_effect))
                value.side_effect = _transformer_engine_missing
        self._done = True
        return len(self._refused)

    def restore(self) -> None:
        for stand_in, side_effect in reversed(self._refused):
            stand_in.side_effect = side_effect
        self._refused.clear()
        self._done = False


def apply(patch: Callable[[Any, str, Any], None]) -> None:
    """Set each stand-in with ``patch(owner, name, value)`` (a :class:`.cuda.PatchSet`'s,
    which undoes them)."""
    import torch.distributed._symmetric_memory as symm_mem
    import torch.profiler
    import torch.profiler.profiler
    import torch.utils.cpp_extension as cpp_extension

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
    for name in ("load_inline", "load"):
        patch(cpp_extension, name, _without_cuda_extensions(getattr(cpp_extension, name), name))
