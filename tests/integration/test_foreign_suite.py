"""``--mfsdp-foreign-suite``: a suite written for GPUs, knowing nothing of the plugin (NCCL asked
for by name, one device per local rank, CUDA tensors), runs unchanged on CPU ranks under torchrun;
plain pytest refuses the option in one line."""

from __future__ import annotations

import os

from fake_bridge import write_fake_bridge

from pytest_megatron_fsdp.fsdp import foreign_bridge

# A suite as Megatron-LM's unit tests are written: its own process group, NCCL, set_device by
# local rank, barriers with device ids; no marker, no fixture of the plugin.
GPU_SUITE = """
import os

import pytest
import torch
import torch.distributed as dist


@pytest.fixture(scope="module", autouse=True)
def process_group():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank % torch.cuda.device_count())
    dist.init_process_group(backend="nccl")
    yield
    dist.barrier(device_ids=[torch.cuda.current_device()])
    dist.destroy_process_group()


def test_every_local_rank_has_its_device():
    assert torch.cuda.is_available()
    assert torch.cuda.device_count() == int(os.environ["LOCAL_WORLD_SIZE"])
    assert torch.cuda.current_device() == int(os.environ["LOCAL_RANK"])


def test_an_all_reduce_over_a_new_nccl_group():
    group = dist.new_group(backend="nccl")
    tensor = torch.full((3,), float(dist.get_rank() + 1), device="cuda")
    dist.all_reduce(tensor, group=group)
    assert tensor.tolist() == [3.0, 3.0, 3.0]
    dist.barrier(group=group, device_ids=[torch.cuda.current_device()])
    dist.destroy_process_group(group)
"""


def test_a_gpu_suite_runs_unchanged_on_cpu_ranks_under_torchrun(inner_session):
    scenario = inner_session(
        {"test_gpu_suite.py": GPU_SUITE},
        "--mfsdp-platform=cpu",
        "--mfsdp-foreign-suite=true",
        "-p",
        "no:cacheprovider",
        torchrun=True,
        timeout=240,
    )
    assert scenario.result.ret == 0, scenario.out[-3000:]
    scenario.result.assert_outcomes(passed=2)
    assert scenario.leftovers == []
    # the rank logs (kept), and torchrun's own torchelastic_* dir (torchrun leaves it; make's $TMPDIR goes)
    left = {name.split("/")[0] for name in scenario.tmp_left}
    assert {name for name in left if not name.startswith("torchelastic_")} == {"mfsdp-logs"}, left


def test_without_the_option_the_same_suite_fails_for_want_of_a_gpu(inner_session):
    scenario = inner_session(
        {"test_gpu_suite.py": GPU_SUITE},
        "--mfsdp-platform=cpu",
        "-p",
        "no:cacheprovider",
        torchrun=True,
        timeout=240,
    )
    assert scenario.result.ret != 0
    # the first thing it asks for: NCCL (torch's CUDA build has it but no GPU, its CPU wheel none)
    assert (
        "ValueError: ProcessGroupNCCL is only supported with GPUs, no GPUs found!" in scenario.out
        or "RuntimeError: Distributed package doesn't have NCCL built in" in scenario.out
    ), scenario.out[-3000:]


def test_plain_pytest_refuses_it_in_one_line(inner_session):
    result = inner_session({"test_gpu_suite.py": GPU_SUITE}, "--mfsdp-foreign-suite=true", timeout=60).result
    assert result.ret == 4  # usage error, before any test
    result.stderr.fnmatch_lines(
        ["ERROR: --mfsdp-foreign-suite=True: only under torchrun: plain pytest runs a test without the "
         "distributed marker in its own process, not on ranks: launch the suite with python -m "
         "torch.distributed.run --nproc_per_node=N -m pytest"]
    )  # fmt: skip


NEEDS_TE = """
import transformer_engine  # noqa: F401  (a module of upstream's that imports TE at the top)


def test_never_collected():
    pass
"""

NEEDS_A_TE_FUSION = """
def test_a_te_only_fusion():
    raise ValueError("apply_rope_fusion is not available. Please install TE >= 1.4.")


def test_a_real_failure():
    raise ValueError("apply_rope_fusion is not available here")  # not the exact sign: a failure
"""


def test_what_needs_a_gpu_only_cause_is_a_skip_naming_it(inner_session):
    scenario = inner_session(
        {"test_needs_te.py": NEEDS_TE, "test_fusion.py": NEEDS_A_TE_FUSION},
        "--mfsdp-platform=cpu",
        "--mfsdp-foreign-suite=true",
        "-p",
        "no:cacheprovider",
        "-rfs",
        torchrun=True,
        timeout=240,
    )
    scenario.result.assert_outcomes(failed=1, skipped=2)
    lines = scenario.out.splitlines()
    assert "SKIPPED [1] test_fusion.py:2: GPU-only: Transformer Engine" in lines
    assert "SKIPPED [1] test_needs_te.py:1: GPU-only: Transformer Engine" in lines
    assert "FAILED test_fusion.py::test_a_real_failure" in scenario.out


# A test as Megatron-Bridge's test_fsdp_pretrain_basic is written, against stand-ins of the Bridge
# modules the switches act on (tests/fake_bridge.py): imports Bridge, validates a config for GPUs.
BRIDGE_SUITE = """
from types import SimpleNamespace

from megatron.bridge.models import gpt_provider
from megatron.bridge.peft import lora_layers  # imports transformer_engine at its top
from megatron.bridge.training.config import ConfigContainer


def test_bridges_config_is_switched_for_cpu_ranks():
    model = SimpleNamespace(apply_rope_fusion=True, persist_layer_norm=True, masked_softmax_fusion=True,
                            transformer_layer_spec=gpt_provider.default_layer_spec)
    config = ConfigContainer(model, SimpleNamespace(pin_memory=True))
    config.validate()
    assert config.seen["transformer_layer_spec"] is gpt_provider.local_layer_spec
    switched = ("apply_rope_fusion", "pin_memory", "compile_disabled")
    assert [config.seen[k] for k in switched] == [False, False, True]
"""


def test_a_bridge_suite_gets_its_switches_each_printed_once(inner_session, tmp_path):
    fakes = write_fake_bridge(tmp_path / "fake-bridge")
    scenario = inner_session(
        {"test_bridge_suite.py": BRIDGE_SUITE},
        "--mfsdp-platform=cpu",
        "--mfsdp-foreign-suite=true",
        torchrun=True,
        env={"PYTHONPATH": os.pathsep.join(filter(None, [str(fakes), os.environ.get("PYTHONPATH", "")]))},
        timeout=240,
    )
    assert scenario.result.ret == 0, scenario.out[-3000:]
    scenario.result.assert_outcomes(passed=1)
    for line in foreign_bridge.switch_lines():
        assert scenario.out.count(line) == 1, scenario.out[-3000:]  # rank 0's, at the session start


def test_a_suite_without_bridge_prints_no_switch(inner_session):
    scenario = inner_session(
        {"test_gpu_suite.py": GPU_SUITE},
        "--mfsdp-platform=cpu",
        "--mfsdp-foreign-suite=true",
        torchrun=True,
        timeout=240,
    )
    assert scenario.result.ret == 0, scenario.out[-3000:]
    assert "Megatron-Bridge on CPU ranks" not in scenario.out
