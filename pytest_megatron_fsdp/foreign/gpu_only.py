"""What only a GPU has: the causes for which a test of a foreign suite (``--mfsdp-foreign-suite``)
cannot run on CPU ranks, each with the exact signs it leaves when it is missing.

A test that fails for one of these reasons is reported as skipped, ``GPU-only: <cause>``, in one
line; a failure for any other reason stays a failure. The signs are exact: a module that cannot be
imported (by its top-level name), or an exception of a named class whose message holds a given text,
anywhere in the chain of causes.
"""

from __future__ import annotations

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

#: the maintained list (docs/upstream-suites.md lists it with the upstream tests each covers)
CAUSES: tuple[GpuOnlyCause, ...] = (
    GpuOnlyCause(
        "Transformer Engine",
        modules=("transformer_engine",),
        raised=(
            # megatron's TransformerConfig for TE-only fusions (fused RoPE needs TE >= 1.4)
            ("ValueError", "is not available. Please install TE"),
            # megatron's TE layer classes (megatron/core/extensions/transformer_engine.py), made
            # without TE, e.g. by an MoE layer spec's grouped GEMM
            ("ImportError", "Transformer Engine is not installed. Please install it with"),
        ),
    ),
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


def cause_of(exc: BaseException) -> GpuOnlyCause | None:
    """The GPU-only cause ``exc`` (or an exception in its chain) is a sign of, None if none."""
    for raised in _chain(exc):
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
