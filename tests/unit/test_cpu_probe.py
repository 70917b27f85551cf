"""The CPU probe (``wire.cpu_probe``) and the bf16 sizing it decides: flags read from
``/proc/cpuinfo`` text, flags and ``--mfsdp-cpu-speed`` to a verdict, rank 0's report handed to the
other ranks through the store (measured once), the header's line, and the verdict to a preset's
step (``train.slow_bf16_step``). In process: sample cpuinfo texts, a dict for the store, no rank.
"""

from __future__ import annotations

import pytest

from pytest_megatron_fsdp import options
from pytest_megatron_fsdp.fsdp.config import starting_config
from pytest_megatron_fsdp.fsdp.presets import PRESETS
from pytest_megatron_fsdp.wire import cpu_probe
from pytest_megatron_fsdp.wire.cpu_probe import (
    Bf16Verdict,
    CpuFacts,
    CpuReport,
    MatmulSpeed,
    agreed_cpu_report,
    decide_bf16,
    read_cpu_facts,
)

#: an AMD EPYC with AVX2 only (the flags line shortened), two processors
EPYC_AVX2 = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse2 avx avx2 fma bmi2 sha_ni

processor\t: 1
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse2 avx avx2 fma bmi2 sha_ni avx512f avx512_bf16
"""
#: a Sapphire Rapids: AVX-512 with AVX-512 BF16 and AMX
SAPPHIRE_RAPIDS = (
    "processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\n"
    "flags\t\t: avx2 avx512f avx512bw avx512_bf16 amx_bf16 amx_tile\n"
)
#: an Arm Neoverse V1 (Graviton 3): the BF16 extension in Features, no model name
NEOVERSE_V1 = "processor\t: 0\nBogoMIPS\t: 2100.00\nFeatures\t: fp asimd sve bf16 i8mm\nCPU part\t: 0xd40\n"
NEOVERSE_N1 = "processor\t: 0\nFeatures\t: fp asimd aes crc32 atomics\n"


def test_the_first_processors_flags_are_read_for_x86_and_arm():
    assert read_cpu_facts(EPYC_AVX2) == CpuFacts("AMD EPYC 7B13", ("avx2",))
    assert read_cpu_facts(SAPPHIRE_RAPIDS) == CpuFacts(
        "Intel(R) Xeon(R) Platinum 8480+", ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
    )
    assert read_cpu_facts(NEOVERSE_V1) == CpuFacts("unknown CPU", ("bf16",))
    assert read_cpu_facts(NEOVERSE_N1).flags == ()
    assert read_cpu_facts("").flags is None  # no flags line: unknown, not "none of them"


@pytest.mark.parametrize(
    ("cpuinfo", "native", "source"),
    [
        (EPYC_AVX2, False, "auto: no avx512_bf16, amx_bf16 or bf16"),
        (SAPPHIRE_RAPIDS, True, "auto: avx512_bf16, amx_bf16"),
        (NEOVERSE_V1, True, "auto: bf16"),
        (NEOVERSE_N1, False, "auto: no avx512_bf16, amx_bf16 or bf16"),
        ("", True, "auto: CPU flags unknown, taken as native"),
    ],
)
def test_on_auto_the_flags_decide(cpuinfo, native, source):
    assert decide_bf16("auto", "default", read_cpu_facts(cpuinfo)) == Bf16Verdict(native, source)


@pytest.mark.parametrize("cpuinfo", [EPYC_AVX2, SAPPHIRE_RAPIDS, ""])
def test_a_forced_sizing_wins_over_the_flags_and_names_its_source(cpuinfo):
    facts = read_cpu_facts(cpuinfo)
    assert decide_bf16("slow-bf16", "--mfsdp-cpu-speed", facts) == Bf16Verdict(False, "--mfsdp-cpu-speed")
    assert decide_bf16("native-bf16", "MFSDP_CPU_SPEED", facts) == Bf16Verdict(True, "MFSDP_CPU_SPEED")


def test_the_option_is_resolved_once_with_its_source_and_checked(pytester, monkeypatch):
    assert options.value_of(pytester.parseconfig(), "cpu-speed") == options.Setting("auto", "default")
    monkeypatch.setenv("MFSDP_CPU_SPEED", "slow-bf16")
    assert options.value_of(pytester.parseconfig(), "cpu-speed") == options.Setting(
        "slow-bf16", "MFSDP_CPU_SPEED"
    )
    config = pytester.parseconfig("--mfsdp-cpu-speed=native-bf16")
    assert options.value_of(config, "cpu-speed") == options.Setting("native-bf16", "--mfsdp-cpu-speed")
    with pytest.raises(options.OptionError, match="choose one of: auto, native-bf16, slow-bf16"):
        options.value_of(pytester.parseconfig("--mfsdp-cpu-speed=fast"), "cpu-speed")


class _Store:
    """The two calls of the rendezvous store the agreement makes (``get`` of a missing key would
    wait in the real store: here it raises, so a rank that reads before rank 0 wrote shows)."""

    def __init__(self) -> None:
        self.keys: dict[str, bytes] = {}

    def set(self, key: str, value: str) -> None:
        self.keys[key] = value.encode()

    def get(self, key: str) -> bytes:
        return self.keys[key]


SPEED = MatmulSpeed("AVX2", 36.5, 0.63)


def test_rank_0_measures_once_and_every_rank_takes_its_report():
    store, measured = _Store(), []

    def measure() -> MatmulSpeed:
        measured.append(1)
        return SPEED

    def facts() -> CpuFacts:
        return read_cpu_facts(EPYC_AVX2)

    reports = [agreed_cpu_report(r, store, "auto", "default", measure, facts) for r in range(3)]
    assert measured == [1]
    assert reports[0] == reports[1] == reports[2]
    slow = Bf16Verdict(False, "auto: no avx512_bf16, amx_bf16 or bf16")
    assert reports[0] == CpuReport(facts(), slow, SPEED)


def test_the_other_ranks_size_as_rank_0_decided_whatever_their_own_cpu():
    store = _Store()
    agreed_cpu_report(0, store, "auto", "default", lambda: SPEED, lambda: read_cpu_facts(SAPPHIRE_RAPIDS))

    def not_here() -> CpuFacts:
        raise AssertionError("a rank other than 0 read its own flags")

    report = agreed_cpu_report(1, store, "auto", "default", lambda: SPEED, not_here)
    assert report.verdict == Bf16Verdict(True, "auto: avx512_bf16, amx_bf16")


def test_the_header_line_names_the_cpu_its_flags_the_speeds_and_the_sizing():
    facts = read_cpu_facts(EPYC_AVX2)
    report = CpuReport(facts, decide_bf16("auto", "default", facts), MatmulSpeed("AVX2", 36.54, 1.1))
    assert report.describe() == (
        "cpu: AMD EPYC 7B13, AVX2 (no native bf16), torch AVX2, fp32 37 GFLOP/s, bf16 1.1 GFLOP/s; "
        "bf16 steps sized for slow-bf16 (auto: no avx512_bf16, amx_bf16 or bf16)"
    )
    fast = read_cpu_facts(SAPPHIRE_RAPIDS)
    unmeasured = CpuReport(fast, decide_bf16("slow-bf16", "--mfsdp-cpu-speed", fast))
    assert unmeasured.describe() == (
        "cpu: Intel(R) Xeon(R) Platinum 8480+, AVX-512 (native bf16: avx512_bf16, amx_bf16); "
        "bf16 steps sized for slow-bf16 (--mfsdp-cpu-speed)"
    )
    assert CpuReport.from_json(report.to_json()) == report
    assert CpuReport.from_json(unmeasured.to_json()) == unmeasured


def test_the_probe_measures_both_dtypes_on_one_thread(monkeypatch):
    """Not a timed test: what runs (each dtype's matmuls, on one thread) and that the figures are
    throughputs, not how fast they are."""
    pytest.importorskip("torch")
    import torch

    original = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _measure_and_check(monkeypatch, torch)
    finally:
        torch.set_num_threads(original)


def _measure_and_check(monkeypatch, torch):
    seen = []
    mm = torch.mm

    def recording_mm(a, b):
        seen.append((a.dtype, torch.get_num_threads()))
        return mm(a, b)

    monkeypatch.setattr(torch, "mm", recording_mm)
    rng = torch.get_rng_state()
    speed = cpu_probe.measure_matmul_speed(budget_s=0.01)
    assert torch.equal(torch.get_rng_state(), rng)  # rank 0's stream stays its peers'

    assert speed.fp32_gflops > 0
    assert speed.bf16_gflops > 0
    assert speed.capability == torch.backends.cpu.get_cpu_capability()
    assert {dtype for dtype, _ in seen} == {torch.float32, torch.bfloat16}
    assert {threads for _, threads in seen} == {1}
    assert torch.get_num_threads() == 2  # the rank's own setting back after the probe


def _preset_step(cfg):
    preset = cfg.resolved_preset()
    return preset.seq_length, preset.micro_batch_size, preset.num_microbatches


def test_slow_bf16_takes_a_bf16_presets_smaller_step():
    slow = starting_config("cpu", preset="bridge-reference", slow_bf16=True)
    assert _preset_step(slow) == (64, 1, 1)
    native = starting_config("cpu", preset="bridge-reference")
    reference = PRESETS["bridge-reference"]
    assert _preset_step(native) == (reference.seq_length, 1, reference.num_microbatches) == (512, 1, 4)


def test_the_smaller_step_is_for_bf16_only_and_what_a_test_sets_wins():
    fp32 = starting_config("cpu", preset="bridge-reference", slow_bf16=True)
    fp32.model.bf16 = False
    assert _preset_step(fp32) == (512, 1, 4)
    mine = starting_config("cpu", preset="bridge-reference", slow_bf16=True)
    mine.train.seq_length = 128
    mine.model.overrides["num_microbatches"] = 2
    assert _preset_step(mine) == (128, 1, 2)
    # tiny has no smaller step (a bf16 step of it takes seconds even at 1 GFLOP/s)
    tiny = starting_config("cpu", slow_bf16=True)
    tiny.model.bf16 = True
    assert _preset_step(tiny) == (32, 2, 1)
