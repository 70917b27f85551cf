"""No model outlives its test, on real ranks: Megatron-FSDP, Megatron DDP, FSDP2 and fully_shard runs
on 2 CPU ranks, each rank looked at after every test (wrappers left, tensor bytes, memory); a
model a test keeps is an error naming its bytes and holder.
"""

from __future__ import annotations

import json

import pytest

from pytest_megatron_fsdp.fsdp import versions

#: what each rank writes after every test, once the harness's check ran (what the next test inherits)
AFTER_EACH_TEST = """
import gc, json, os, sys, torch

WRAPPERS = {"MegatronFSDP", "FullyShardedDataParallel", "DistributedDataParallel",
            "TorchFullyShardedDataParallel", "GPTModel", "DistributedOptimizer", "ChainedOptimizer"}

def pytest_runtest_logfinish(nodeid):
    if "RANK" not in os.environ:
        return
    objects = gc.get_objects()
    wrappers = sorted(type(o).__name__ for o in objects if type(o).__name__ in WRAPPERS)
    storages = {}
    for o in objects:
        if isinstance(o, torch.Tensor) and not o.is_meta:
            try:
                storage = o.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
            except RuntimeError:  # a storage Megatron-FSDP freed (leaked runs only)
                pass
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    # megatron's process-wide scratch buffer (parallel_state.get_global_memory_buffer())
    scratch = getattr(sys.modules.get("megatron.core.parallel_state"), "_GLOBAL_MEMORY_BUFFER", None)
    scratch_bytes = sum(t.untyped_storage().nbytes() for t in getattr(scratch, "buffer", {}).values())
    with open(f"after-rank{os.environ['RANK']}.jsonl", "a") as f:
        f.write(json.dumps({"test": nodeid.split("::")[-1], "wrappers": wrappers,
                            "tensor_bytes": sum(storages.values()), "rss": rss,
                            "scratch_bytes": scratch_bytes}) + "\\n")
"""


TEN_RUNS = """
import pytest

from pytest_megatron_fsdp.fsdp import versions

two_ranks = pytest.mark.distributed(world_size=2)
STRATEGIES = ["optim_grads_params", "optim_grads", "optim", "optim_grads_params"]


@two_ranks
@pytest.mark.parametrize("i", range(7))
def test_megatron_fsdp(megatron_fsdp_run, run_config, i):
    run_config.ddp.data_parallel_sharding_strategy = STRATEGIES[i % 4]
    run = megatron_fsdp_run(run_config)
    result = run.train(2)
    assert result.losses[-1] < result.losses[0]


@two_ranks
@pytest.mark.mfsdp_config(use_megatron_fsdp=False)
def test_megatron_ddp(megatron_fsdp_run, run_config):
    megatron_fsdp_run(run_config).train(2)


@two_ranks
def test_torch_fsdp2(megatron_fsdp_run, run_config):
    run_config.dist.use_megatron_fsdp = run_config.ddp.use_megatron_fsdp = False
    run_config.dist.use_torch_fsdp2 = True
    run_config.model.overrides["untie_embeddings_and_output_weights"] = True
    run = megatron_fsdp_run(run_config)
    if not versions.FSDP2_FINISH_GRAD_SYNC.present():  # where it trains at all
        run.train(2)


@two_ranks
def test_two_runs_in_one_test(megatron_fsdp_run, run_config):
    first = megatron_fsdp_run(run_config)
    first.train(1)
    first.close()  # a test may close its own run; the fixture closes it again
    megatron_fsdp_run(run_config).train(1)
"""


FULLY_SHARD_RUNS = """
import pytest
import torch


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("i", range(3))
def test_fully_shard(fully_shard_run, dist_env, i):
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    batches = [(torch.randn(8, 16), torch.randint(0, 4, (8,))) for _ in range(2)]

    def loss(model, batch):
        return torch.nn.functional.cross_entropy(model(batch[0]), batch[1])

    run = fully_shard_run(model, torch.optim.SGD(model.parameters(), lr=0.1), batches, loss,
                          fsdp_unit_modules=[torch.nn.Linear])
    run.train(2)
"""

#: fully_shard runs join the session where megatron-fsdp can run them (after the ten runs: the
#: file names order them)
FULLY_SHARD_AVAILABLE = versions.fully_shard_problem() is None


@pytest.fixture(scope="module")
def runs_in_a_row(run_scenario):
    """One session: ten Megatron-FSDP/DDP/FSDP2 runs in a row, then three fully_shard runs where
    megatron-fsdp is installed; each rank records what is left after every test."""
    files = {"conftest.py": AFTER_EACH_TEST, "test_ten.py": TEN_RUNS}
    if FULLY_SHARD_AVAILABLE:
        files["test_z_fully_shard.py"] = FULLY_SHARD_RUNS
    session = run_scenario("runs-in-a-row", files, "--mfsdp-platform=cpu", timeout=420)
    session.result.assert_outcomes(passed=13 if FULLY_SHARD_AVAILABLE else 10)
    return session


def _after_each_test(path, rank: int, test_file: str) -> list[dict]:
    """What rank ``rank`` recorded after each test of ``test_file`` (its ``test`` names that file's
    functions)."""
    records = [json.loads(line) for line in (path / f"after-rank{rank}.jsonl").read_text().splitlines()]
    fully_shard = [r for r in records if r["test"].startswith("test_fully_shard[")]
    return fully_shard if test_file == "fully_shard" else [r for r in records if r not in fully_shard]


def test_ten_runs_in_a_row_leave_no_wrapper_and_flat_memory(runs_in_a_row):
    for rank in (0, 1):
        after = _after_each_test(runs_in_a_row.path, rank, "ten")
        assert len(after) == 10
        assert [a["wrappers"] for a in after] == [[]] * 10, after
        # Megatron's scratch (32 KiB per rank here, 8 MiB with the Bridge reference model on a GPU)
        # would stay from the first attention forward on: freed after each test.
        assert [a["scratch_bytes"] for a in after] == [0] * 10, after
        # Live tensors stay where the first test left them (Megatron's model-parallel state, RNG
        # states: ~0.05 MiB); a leaked tiny run would add ~1.5 MiB of tensors per test.
        first = after[0]
        assert all(a["tensor_bytes"] <= first["tensor_bytes"] + 64 * 1024 for a in after), after
        # RSS: the allocator's own growth, ~0.2-0.5 MiB per test (measured); a leaked run adds
        # ~2.5 MiB per test, which over the 9 tests after the first would exceed this bound twice over.
        growth = after[-1]["rss"] - first["rss"]
        assert growth <= 10 * 2**20, f"rank {rank}: RSS grew {growth / 2**20:.1f} MiB over 9 tests"


KEEPS_ITS_MODEL = """
import pytest

KEPT = []


@pytest.mark.distributed(world_size=2)
def test_keeps_its_model(megatron_fsdp_run, run_config):
    run = megatron_fsdp_run(run_config)
    run.train(1)
    KEPT.append(run.model)


@pytest.mark.distributed(world_size=2)
def test_fails_after_training(megatron_fsdp_run, run_config):
    run = megatron_fsdp_run(run_config)
    model = run.model  # in the failed test's frame, which pytest keeps for post-mortem debugging
    run.train(1)
    assert model is None, "fails on purpose"


@pytest.mark.distributed(world_size=2)
def test_next_test_is_clean(megatron_fsdp_run, run_config):
    KEPT.clear()
    megatron_fsdp_run(run_config).train(1)
"""


def test_a_model_kept_after_its_test_is_an_error_naming_bytes_and_holder(pytester):
    pytester.makepyfile(test_keep=KEEPS_ITS_MODEL)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--mfsdp-platform=cpu", timeout=300)
    # the first test passes its call and errors at teardown; a failed test's frames do not count
    result.assert_outcomes(passed=2, failed=1, errors=1)
    result.stdout.fnmatch_lines(
        [
            "*ERROR at teardown of test_keeps_its_model*",
            "*megatron-fsdp: the test's runs outlived the test: FullyShardedDataParallel (run 1's model)*"
            "still reachable after the test*holding * MiB (*bytes) of tensors",
            "held by the module global(s): test_keep.KEPT",
        ]
    )
    assert "ERROR at teardown of test_fails_after_training" not in result.stdout.str()
    assert "ERROR at teardown of test_next_test_is_clean" not in result.stdout.str()


@pytest.mark.skipif(not FULLY_SHARD_AVAILABLE, reason=str(versions.fully_shard_problem()))
def test_fully_shard_runs_leave_no_wrapper(runs_in_a_row):
    for rank in (0, 1):
        after = _after_each_test(runs_in_a_row.path, rank, "fully_shard")
        assert [a["wrappers"] for a in after] == [[]] * 3, after
