"""``--mfsdp-foreign-suite``: a suite written for GPUs, knowing nothing of the plugin (NCCL asked
for by name, one device per local rank, CUDA tensors), runs unchanged on CPU ranks, under torchrun
or in the rank sets plain pytest launches, each test with one outcome on every rank."""

from __future__ import annotations

import os

import pytest
from fake_bridge import write_fake_bridge

from pytest_megatron_fsdp.foreign import bridge as foreign_bridge

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


def test_plain_pytest_runs_it_in_rank_sets_of_the_chosen_world_size(inner_session):
    scenario = inner_session(
        {"test_gpu_suite.py": GPU_SUITE.replace("== [3.0, 3.0, 3.0]", "== [6.0, 6.0, 6.0]")},
        "--mfsdp-platform=cpu",
        "--mfsdp-foreign-suite=true",
        "--mfsdp-foreign-world-size=3",
        timeout=240,
    )
    assert scenario.result.ret == 0, scenario.out[-3000:]
    scenario.result.assert_outcomes(passed=2)  # 1 + 2 + 3 on three ranks
    assert scenario.leftovers == []


def test_a_bad_world_size_is_one_line_before_any_rank(inner_session):
    result = inner_session(
        {"test_gpu_suite.py": GPU_SUITE},
        "--mfsdp-foreign-suite=true",
        "--mfsdp-foreign-world-size=0",
        timeout=60,
    ).result
    assert result.ret == 4  # usage error, before any test
    result.stderr.fnmatch_lines(
        ["ERROR: --mfsdp-foreign-world-size: invalid value '0' for --mfsdp-foreign-world-size: "
         "must be a whole number, 1 or more"]
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


@pytest.mark.parametrize("torchrun", [True, False], ids=["torchrun", "plain"])
def test_what_needs_a_gpu_only_cause_is_a_skip_naming_it(inner_session, torchrun):
    scenario = inner_session(
        {"test_needs_te.py": NEEDS_TE, "test_fusion.py": NEEDS_A_TE_FUSION},
        "--mfsdp-platform=cpu",
        "--mfsdp-foreign-suite=true",
        "-p",
        "no:cacheprovider",
        "-rfs",
        torchrun=torchrun,
        timeout=240,
    )
    scenario.result.assert_outcomes(failed=1, skipped=2)
    lines = scenario.out.splitlines()
    assert "SKIPPED [1] test_fusion.py:2: GPU-only: Transformer Engine" in lines
    assert "SKIPPED [1] test_needs_te.py:1: GPU-only: Transformer Engine" in lines
    assert "FAILED test_fusion.py::test_a_real_failure" in scenario.out


# -- one outcome per test, the groups a test makes freed -------------------------------------------

# A GPU-written suite as Megatron-LM's: a function-scoped fixture that makes the default group where
# there is none and ends with a barrier, groups made by tests and by setup_class, groups nobody frees.
AGREEING_SUITE = """
import os
import time

import pytest
import torch
import torch.distributed as dist

STATE = {}  # as Megatron's model-parallel state: each test's groups replace the last test's


@pytest.fixture(autouse=True)
def distributed_setup():
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
    STATE["found_a_default_group"] = dist.is_initialized()
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl")
    yield
    if dist.is_initialized():
        dist.barrier(device_ids=[torch.cuda.current_device()])


def note(name, value):
    with open(f"{name}-rank{dist.get_rank()}.txt", "a") as notes:
        notes.write(f"{value}\\n")


def test_rank1_fails_while_rank0_waits_on_a_group_the_test_made():
    group = dist.new_group(backend="nccl")
    tensor = torch.ones(2, device="cuda")
    if dist.get_rank() == 1:
        time.sleep(1)
        raise AssertionError("rank 1 found a wrong value")
    started = time.monotonic()
    try:
        dist.all_reduce(tensor, group=group)
    finally:
        note("waited", f"{time.monotonic() - started:.1f}")


def test_rank1_fails_while_rank0_goes_on_to_a_default_group_barrier():
    # as Megatron-LM's tests end: asserts, then Utils.destroy_model_parallel()'s barrier; here the
    # fixture's teardown barrier is the one rank 1 never enters
    if dist.get_rank() == 1:
        raise AssertionError("rank 1 found a wrong offset")
    try:
        dist.barrier()
    except RuntimeError:  # as Utils.destroy_model_parallel, which swallows its barrier's error
        pass


@pytest.mark.xfail(strict=True, reason="the suite's own bug, which shows on rank 1")
def test_a_strict_xfail_whose_bug_shows_on_rank1_only():
    assert dist.get_rank() == 0, "rank 1 computes the wrong offset"
    try:  # rank 0 goes on to a barrier as upstream's tests end; rank 1's expected failure frees it
        dist.barrier()
    except RuntimeError:
        pass


def test_the_next_test_runs_with_every_rank():
    group = dist.new_group(backend="nccl")
    tensor = torch.ones(2, device="cuda")
    dist.all_reduce(tensor, group=group)
    assert tensor.tolist() == [2.0, 2.0]


@pytest.mark.parametrize("n", range(6))
def test_makes_groups_and_never_frees_them(n):
    note("threads", len(os.listdir("/proc/self/task")))
    STATE["groups"] = [dist.new_group(backend="nccl") for _ in range(4)]
    for group in STATE["groups"]:
        dist.barrier(group=group)


class TestAClassScopedGroup:
    @classmethod
    def setup_class(cls):
        if not dist.is_initialized():
            dist.init_process_group(backend="nccl")
        cls.group = dist.new_group(backend="nccl")

    def test_rank1_fails_outside_a_collective(self):
        dist.barrier(group=self.group)
        assert dist.get_rank() == 0, "rank 1 disagrees"

    def test_the_class_group_outlives_that_failure(self):
        assert dist.get_rank(group=self.group) == dist.get_rank()  # as Megatron asks its groups
        tensor = torch.ones(2, device="cuda")
        dist.all_reduce(tensor, group=self.group)
        assert tensor.tolist() == [2.0, 2.0]


def test_the_class_group_went_with_its_class():
    from torch.distributed.distributed_c10d import _world

    assert TestAClassScopedGroup.group not in _world.pg_map


@pytest.mark.timeout(4)
def test_rank1_sleeps_past_its_timeout_while_rank0_waits_on_the_default_group():
    if dist.get_rank() == 1:
        time.sleep(60)
    dist.all_reduce(torch.ones(2, device="cuda"))


def test_after_the_timeout():
    tensor = torch.ones(2, device="cuda")
    dist.all_reduce(tensor)
    assert tensor.tolist() == [2.0, 2.0]


@pytest.mark.flaky(reruns=2)  # the suite's own mark: the test runs once, the session is not refused
def test_marked_flaky():
    pass


def test_destroys_the_default_group():
    dist.barrier()
    dist.destroy_process_group()


def test_finds_a_default_group_again():
    assert STATE["found_a_default_group"]  # its fixture had none to make
    tensor = torch.ones(2, device="cuda")
    dist.all_reduce(tensor)
    assert tensor.tolist() == [2.0, 2.0]
"""


@pytest.fixture(scope="module", params=["torchrun", "plain"])
def agreeing(request, run_scenario):
    """The suite under torchrun, and in the rank sets plain pytest launches (a rank that times out
    ends there: the parent goes on in a fresh rank set)."""
    return run_scenario(
        f"agreeing-{request.param}",
        {"test_agreeing.py": AGREEING_SUITE},
        "--mfsdp-platform=cpu",
        "--mfsdp-foreign-suite=true",
        "-p",
        "no:randomly",
        "-rA",
        "--mfsdp-log-dir=logs",
        torchrun=request.param == "torchrun",
        timeout=240,
    )


def _notes(scenario, name, rank):
    return (scenario.path / f"{name}-rank{rank}.txt").read_text().split()


def test_each_test_has_one_outcome_on_every_rank(agreeing):
    outcomes = {
        line.split(" ", 1)[1].split(" - ")[0]
        for line in agreeing.out.splitlines()
        if line.startswith("FAILED ")
    }
    assert outcomes == {
        "test_agreeing.py::test_rank1_fails_while_rank0_waits_on_a_group_the_test_made",
        "test_agreeing.py::test_rank1_fails_while_rank0_goes_on_to_a_default_group_barrier",
        "test_agreeing.py::TestAClassScopedGroup::test_rank1_fails_outside_a_collective",
        "test_agreeing.py::test_rank1_sleeps_past_its_timeout_while_rank0_waits_on_the_default_group",
    }, agreeing.out[-3000:]
    agreeing.result.assert_outcomes(failed=4, passed=13, xfailed=1)
    # rank 0 passed the class test on its own: the agreed failure is rank 1's, with its own text
    assert "failed on rank 1 (passed on 0)" in agreeing.out
    assert "AssertionError: rank 1 disagrees" in agreeing.out
    assert agreeing.leftovers == []


def test_a_failure_on_one_rank_releases_the_peer_waiting_on_a_group_the_test_made(agreeing):
    (waited,) = _notes(agreeing, "waited", 0)
    assert float(waited) < 20  # not the process-group timeout (120 s): rank 1's release ended it
    section = agreeing.out.split("test_rank1_fails_while_rank0_waits_on_a_group_the_test_made ___")[1]
    assert "failed on ranks 0, 1" in section.split("\n", 2)[1], section[:300]
    assert "AssertionError: rank 1 found a wrong value" in section.split("\n_____")[0]


def test_a_failure_outside_a_collective_frees_a_peer_left_in_a_default_group_collective(agreeing):
    # rank 0 passed the test's body and waits in the fixture's teardown barrier, which rank 1 (done
    # with its teardown) never enters: rank 1 closes the default group's connections under it, the
    # test fails alone (rank 1's failure, rank 0's teardown echo of it counted as done), and the
    # session goes on in a renewed default group
    name = "test_rank1_fails_while_rank0_goes_on_to_a_default_group_barrier"
    section = agreeing.out.split(f"{name} ___")[1].split("\n_____")[0]
    assert "failed on rank 1 (passed on 0)" in section.split("\n", 2)[1], section[:300]
    assert "AssertionError: rank 1 found a wrong offset" in section
    assert "PASSED test_agreeing.py::test_the_next_test_runs_with_every_rank" in agreeing.out.splitlines()


def test_a_strict_xfail_whose_bug_shows_on_some_ranks_failed_as_expected(agreeing):
    assert (
        "XFAIL test_agreeing.py::test_a_strict_xfail_whose_bug_shows_on_rank1_only - the suite's own bug, "
        "which shows on rank 1 (failed as expected on rank 1, passed on 0)"
    ) in agreeing.out.splitlines()


def test_groups_nobody_frees_are_freed_after_their_test(agreeing):
    for rank in (0, 1):
        threads = [int(n) for n in _notes(agreeing, "threads", rank)]
        assert len(threads) == 6
        # the first counts no groups of the test before; unfreed, each test's 4 groups add 8 threads
        assert max(threads[1:]) <= threads[1] + 3, threads


def test_a_timeout_fails_the_test_on_every_rank_and_the_session_goes_on(agreeing):
    name = "test_rank1_sleeps_past_its_timeout_while_rank0_waits_on_the_default_group"
    section = agreeing.out.split(f"{name} ___")[1]
    if agreeing.path.name.startswith("agreeing-torchrun"):  # the ranks interrupt the test and go on
        assert "failed on ranks 0, 1" in section.split("\n", 2)[1], section[:300]
        assert f"MFSDP-TIMEOUT: test_agreeing.py::{name} exceeded its 4 s timeout" in section
    else:  # the parent ends the rank set and goes on in a fresh one
        assert "timed out: the test exceeded its 4 s timeout" in section.split("\n", 2)[1], section[:300]
    assert "PASSED test_agreeing.py::test_after_the_timeout" in agreeing.out.splitlines()


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
