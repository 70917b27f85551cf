"""What only a GPU has: the causes for which a test of a foreign suite (``--mfsdp-foreign-suite``)
cannot run on CPU ranks, each with the exact signs it leaves when it is missing.

A test that fails for one of these reasons is reported as skipped, ``GPU-only: <cause>``, in one
line; a failure for any other reason stays a failure. The signs are exact: a module that cannot be
imported (by its top-level name), an exception of a named class whose message holds a given text,
anywhere in the chain of causes, or a call of a Transformer Engine name that megatron-core bound to
None because TE is missing (:func:`missing_te_call`).
"""

from __future__ import annotations

import importlib.util
import linecache
import re
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class GpuOnlyCause:
    #: how the skip reason names it
    name: str
    #: top-level modules whose absence is this cause (they need CUDA to build or to run)
    modules: tuple[str, ...] = ()
    #: (exception class name, text in its message) that upstream raises when the cause is missing
    raised: tuple[tuple[str, str], ...] = ()

    def reason(self) -> str:
        return f"GPU-only: {self.name}"


#: the class the emulation raises where a foreign suite asks for what only a GPU has
#: (``emulation/device_limits.py``; named, not imported: the domain layer imports no harness)
_LACKS = "EmulatedDeviceLacks"

TRANSFORMER_ENGINE = GpuOnlyCause(
    "Transformer Engine",
    modules=("transformer_engine",),
    raised=(
        # megatron's TransformerConfig for TE-only fusions (fused RoPE needs TE >= 1.4)
        ("ValueError", "is not available. Please install TE"),
        # megatron's TE layer classes (megatron/core/extensions/transformer_engine.py), made
        # without TE, e.g. by an MoE layer spec's grouped GEMM
        ("ImportError", "Transformer Engine is not installed. Please install it with"),
    ),
)

#: the maintained list (docs/upstream-suites.md lists it with the upstream tests each covers)
CAUSES: tuple[GpuOnlyCause, ...] = (
    TRANSFORMER_ENGINE,
    GpuOnlyCause(
        "mamba_ssm (CUDA kernels)",
        modules=("mamba_ssm",),
        raised=(("ImportError", "MambaSSM is not installed"),),
    ),
    GpuOnlyCause("CUDA graphs", raised=((_LACKS, "has no CUDA graphs"),)),
    GpuOnlyCause("symmetric memory", raised=((_LACKS, "has no symmetric memory"),)),
    GpuOnlyCause("CUDA memory accounting", raised=((_LACKS, "has no CUDA memory accounting"),)),
    GpuOnlyCause("CUDA kernel trace (profiler)", raised=((_LACKS, "has no CUDA kernel trace"),)),
    GpuOnlyCause("CUDA C++ extension build", raised=((_LACKS, "has no CUDA C++ extension build"),)),
    GpuOnlyCause(
        "CUDA device placement",
        # pytest's explanation of `assert tensor.device == <a CUDA device>`: on CPU ranks every
        # tensor is on the CPU, whatever the code under test did with it
        raised=(("AssertionError", "assert device(type='cpu') == device(type='cuda'"),),
    ),
)


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


#: what calling a name bound to None says
_NONE_CALLED = "'NoneType' object is not callable"
_CALLED_NAME = re.compile(r"\b([A-Za-z_]\w*)\s*\(")


def missing_te_call(exc: BaseException) -> str | None:
    """``NAME() at file:line`` where ``exc`` is the TypeError of calling a Transformer Engine name
    that megatron-core binds to None where TE is missing (``TESpecProvider = None`` in its GPT layer
    specs, ``TEColumnParallelGroupedLinear`` in its TE extension, ...), None for any other error: the
    called name must be None where it is called, start with ``TE`` and Transformer Engine must be
    missing, so a None called for another reason stays a failure."""
    if not isinstance(exc, TypeError) or _NONE_CALLED not in str(exc):
        return None
    if importlib.util.find_spec("transformer_engine") is not None:
        return None
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None:
        return None
    frame, lineno = tb.tb_frame, tb.tb_lineno
    line = linecache.getline(frame.f_code.co_filename, lineno)
    unset = object()
    for name in _CALLED_NAME.findall(line):
        value = frame.f_locals.get(name, frame.f_globals.get(name, unset))
        if value is None and name.startswith("TE"):
            return f"{name}() at {frame.f_code.co_filename}:{lineno}"
    return None


def cause_of(exc: BaseException) -> GpuOnlyCause | None:
    """The GPU-only cause ``exc`` (or an exception in its chain) is a sign of, None if none."""
    for raised in _chain(exc):
        if missing_te_call(raised) is not None:
            return TRANSFORMER_ENGINE
        for cause in CAUSES:
            missing = getattr(raised, "name", None) if isinstance(raised, ModuleNotFoundError) else None
            if missing and missing.split(".")[0] in cause.modules:
                return cause
            if any(type(raised).__name__ == cls and text in str(raised) for cls, text in cause.raised):
                return cause
    return None


def cause_in(text: str) -> GpuOnlyCause | None:
    """The GPU-only cause a failure's text names (a collection error, which pytest keeps as text
    only): its missing module, or its exception line. None if none."""
    for cause in CAUSES:
        if any(f"ModuleNotFoundError: No module named '{module}" in text for module in cause.modules):
            return cause
        lines = text.splitlines()
        if any(f"{cls}: " in line and message in line for line in lines for cls, message in cause.raised):
            return cause
    return None
