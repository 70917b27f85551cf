"""The CPU that CPU ranks run on: its bf16-relevant flags, its matmul speed, and whether it runs bf16
natively, which decides how big a bf16 step the tests take there (``--mfsdp-cpu-speed``).

Why: torch runs a bf16 matmul on x86 natively only with AVX-512 BF16 (``avx512_bf16``) or AMX
(``amx_bf16``), on Arm with the BF16 extension (``bf16`` in ``/proc/cpuinfo``'s Features); without
them it converts to fp32 and back around every block, some 300 times slower than with them
(docs/cpu-mode-vs-gpus.md has the figures). The decision is made from the flags (stable, unlike a
timing on a loaded machine), and the measured speeds are printed beside it so that a slow run
explains itself.

Plain data and lazy torch: the flags are read without torch (the plain-mode parent's header), the
speed is measured in rank 0 of a rank session only, on CPU ranks only, and handed to the other
ranks through the rendezvous store (:func:`agreed_cpu_report`), so every rank sizes alike.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

#: ``--mfsdp-cpu-speed``'s choices: decide from the flags, or force the sizing either way
CPU_SPEEDS = ("auto", "native-bf16", "slow-bf16")
NATIVE_BF16, SLOW_BF16 = CPU_SPEEDS[1:]
#: the flags with which torch's bf16 matmuls run natively: x86 AVX-512 BF16, x86 AMX, Arm's BF16
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")
#: the flags the header names (the vector width, then the bf16 ones)
SHOWN_FLAGS = ("avx2", "avx512f", *NATIVE_BF16_FLAGS)
#: the rendezvous-store key under which rank 0 hands its report to the other ranks
STORE_KEY = "cpu_report"


@dataclass(frozen=True)
class CpuFacts:
    """What ``/proc/cpuinfo`` says of the first CPU: its model and which of :data:`SHOWN_FLAGS` it has."""

    model: str
    #: None: unknown (no ``/proc/cpuinfo``: not Linux)
    flags: tuple[str, ...] | None


def read_cpu_facts(cpuinfo: str | None = None) -> CpuFacts:
    """The facts from ``cpuinfo`` (default: ``/proc/cpuinfo``'s text; its first processor's block)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            import platform

            return CpuFacts(platform.processor() or platform.machine() or "unknown CPU", None)
    model, flags = "", None
    for line in cpuinfo.splitlines():
        if not line.strip():
            if flags is not None:
                break  # the first processor's block is enough: every core of one node alike
            continue
        key, _, value = (part.strip() for part in line.partition(":"))
        if key in ("model name", "Model name") and not model:
            model = value
        elif key in ("flags", "Features") and flags is None:  # x86, Arm
            present = set(value.split())
            flags = tuple(f for f in SHOWN_FLAGS if f in present)
    return CpuFacts(model or "unknown CPU", flags)


@dataclass(frozen=True)
class Bf16Verdict:
    """Whether bf16 matmuls run natively on the CPU ranks, and where that was decided: the source
    label of ``--mfsdp-cpu-speed`` when forced, else ``auto: <the flags that decided it>``."""

    native: bool
    source: str

    @property
    def name(self) -> str:
        return NATIVE_BF16 if self.native else SLOW_BF16


def decide_bf16(requested: str, source: str, facts: CpuFacts) -> Bf16Verdict:
    """``--mfsdp-cpu-speed``'s value (``requested``, from ``source``) applied to the CPU's flags.

    Forced (``native-bf16`` / ``slow-bf16``) it wins, so a fast machine can run the slow sizing. On
    ``auto``, a native bf16 flag decides; without ``/proc/cpuinfo`` the flags are unknown and bf16
    is taken as native: the preset's own sizing, as before the probe existed.
    """
    if requested != "auto":
        return Bf16Verdict(requested == NATIVE_BF16, source)
    if facts.flags is None:
        return Bf16Verdict(True, "auto: CPU flags unknown, taken as native")
    native = [f for f in NATIVE_BF16_FLAGS if f in facts.flags]
    if native:
        return Bf16Verdict(True, f"auto: {', '.join(native)}")
    return Bf16Verdict(False, f"auto: no {', '.join(NATIVE_BF16_FLAGS[:-1])} or {NATIVE_BF16_FLAGS[-1]}")


@dataclass(frozen=True)
class MatmulSpeed:
    """One thread's matmul throughput, and torch's CPU capability (``AVX2``, ``AVX512``, ...)."""

    capability: str
    fp32_gflops: float
    bf16_gflops: float


#: square matmul sizes of the probe: bf16's small, since one 256^3 bf16 matmul is ~30 ms at 1 GFLOP/s
PROBE_SIZES = {"fp32": 512, "bf16": 256}


def measure_matmul_speed(budget_s: float = 0.1) -> MatmulSpeed:
    """fp32 and bf16 GFLOP/s of square matmuls on one thread, each dtype time-boxed to ``budget_s``
    after one warm-up matmul: about 0.3 s in all, under 1 s even at 0.1 GFLOP/s in bf16. Every CPU
    rank set pays it once (rank 0; the others wait), so it is kept short: the figures explain a run,
    the flags decide."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one rank's share of a shared machine, comparable across machines
    # a generator of its own: drawing from the default one would leave rank 0's stream apart from
    # its peers' for a test that does not reseed
    generator = torch.Generator().manual_seed(0)
    try:
        speeds = {}
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            n = PROBE_SIZES[name]
            a, b = (torch.randn(n, n, generator=generator).to(dtype) for _ in range(2))
            torch.mm(a, b)  # warm-up: kernel selection, first-touch allocations
            count, start = 0, time.perf_counter()
            while True:
                torch.mm(a, b)
                count += 1
                elapsed = time.perf_counter() - start
                if elapsed >= budget_s:
                    break
            speeds[name] = 2 * n**3 * count / elapsed / 1e9
    finally:
        torch.set_num_threads(threads)
    return MatmulSpeed(torch.backends.cpu.get_cpu_capability(), speeds["fp32"], speeds["bf16"])


@dataclass(frozen=True)
class CpuReport:
    """What the session's CPU ranks run on (rank 0's, agreed by every rank) and the bf16 verdict."""

    facts: CpuFacts
    verdict: Bf16Verdict
    #: None where not measured (the plain-mode parent imports no torch)
    speed: MatmulSpeed | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> CpuReport:
        data = json.loads(text)
        facts = data["facts"]
        flags = None if facts["flags"] is None else tuple(facts["flags"])
        speed = None if data["speed"] is None else MatmulSpeed(**data["speed"])
        return cls(CpuFacts(facts["model"], flags), Bf16Verdict(**data["verdict"]), speed)

    def describe(self) -> str:
        """One line, e.g. ``cpu: AMD EPYC 7B13, AVX2 (no native bf16), fp32 38 GFLOP/s, bf16 1.1
        GFLOP/s; bf16 steps sized for slow-bf16 (auto: no avx512_bf16, amx_bf16 or bf16)``."""
        flags = self.facts.flags
        if flags is None:
            isa = "flags unknown"
        else:
            width = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
            native = [f for f in NATIVE_BF16_FLAGS if f in flags]
            isa = f"{width} ({'native bf16: ' + ', '.join(native) if native else 'no native bf16'})"
        parts = [f"cpu: {self.facts.model}, {isa}"]
        if self.speed is not None:
            parts += [
                f"torch {self.speed.capability}",
                f"fp32 {_figure(self.speed.fp32_gflops)} GFLOP/s",
                f"bf16 {_figure(self.speed.bf16_gflops)} GFLOP/s",
            ]
        return ", ".join(parts) + f"; bf16 steps sized for {self.verdict.name} ({self.verdict.source})"


def _figure(gflops: float) -> str:
    """Two significant digits at least: 1.1, 38, 347."""
    return f"{gflops:.2g}" if gflops < 10 else f"{gflops:.0f}"


def agreed_cpu_report(
    rank: int,
    store: Any,
    requested: str,
    source: str,
    measure: Callable[[], MatmulSpeed] = measure_matmul_speed,
    facts: Callable[[], CpuFacts] = read_cpu_facts,
) -> CpuReport:
    """The session's CPU report: rank 0 reads its flags, measures once and decides; every other
    rank takes rank 0's from the store (``store.get`` waits for it, bounded by the store's timeout),
    so all ranks size bf16 steps alike, also on nodes whose CPUs differ."""
    if rank != 0:
        return CpuReport.from_json(store.get(STORE_KEY).decode())
    found = facts()
    report = CpuReport(found, decide_bf16(requested, source, found), measure())
    store.set(STORE_KEY, report.to_json())
    return report
