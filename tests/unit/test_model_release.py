"""No model outlives its test: the hooks that would keep it alive are released, and that is checked.

torch's garbage collector cannot follow a tensor's post-accumulate-grad hooks, so a wrapper whose
parameters carry such a hook referring back to it (Megatron-FSDP registers one per parameter) is
never collected; the first tests show that with torch alone. The distributed ones run real
Megatron-FSDP runs on 2 CPU ranks and look at each rank after every test.
"""

from __future__ import annotations

import functools
import gc
import json
import sys
import weakref
from collections.abc import Callable

import pytest
import torch

from pytest_megatron_fsdp.fsdp import versions
from pytest_megatron_fsdp.fsdp.release import (
    RunWatch,
    reachable_tensor_bytes,
    release_grad_hooks,
    release_method_caches,
)

# -- torch's garbage collector and post-accumulate-grad hooks ---------------------------------------


class _Owner:
    """Holds a parameter whose hook refers back to the owner: the cycle Megatron-FSDP makes."""

    def __init__(self, register: str) -> None:
        self.param = torch.nn.Parameter(torch.zeros(1024))
        if register == "register_post_accumulate_grad_hook":
            self.handle = self.param.register_post_accumulate_grad_hook(lambda p: self.on_grad(p))
        else:
            self.handle = self.param.register_hook(lambda grad: self.on_grad(grad))

    def on_grad(self, tensor: torch.Tensor) -> None:
        pass


def _survives_gc(register: str, then: Callable[[_Owner], None] | None = None) -> bool:
    """Whether an owner built (and then changed by ``then``) survives ``gc.collect()`` once dropped.

    Built here, not by the caller: pytest's assertion rewriting would keep an argument alive."""
    owner = _Owner(register)
    if then is not None:
        then(owner)
    ref = weakref.ref(owner)
    del owner
    gc.collect()
    return ref() is not None


def test_torch_gc_cannot_collect_a_cycle_through_a_post_accumulate_grad_hook():
    """The upstream behaviour the release works around (torch 2.13 and 2.14): should a torch
    release collect this cycle, this test fails, and ``release_grad_hooks`` is no longer needed there."""
    assert _survives_gc("register_post_accumulate_grad_hook")
    assert not _survives_gc("register_hook")  # the same cycle through a tensor hook: collected


def _unset(owner: _Owner) -> None:
    owner.param._post_accumulate_grad_hooks = None  # torch still holds the old dict


def test_removing_or_clearing_the_hooks_frees_the_cycle_and_setting_none_does_not():
    post = "register_post_accumulate_grad_hook"
    assert not _survives_gc(post, lambda owner: owner.handle.remove())
    assert not _survives_gc(post, lambda owner: owner.param._post_accumulate_grad_hooks.clear())
    assert _survives_gc(post, _unset)


class _Wrapper(torch.nn.Module):
    """Megatron-FSDP's shape: handles in ``grad_acc_hooks``, some on parameters the module no
    longer shows (it swaps them for DTensors around ``state_dict``), others on its parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Linear(64, 64)
        self.swapped_out = [torch.nn.Parameter(torch.zeros(64))]
        self.grad_acc_hooks = {
            "hidden": self.swapped_out[0].register_post_accumulate_grad_hook(lambda p: self.forward(p))
        }
        self.inner.weight.register_post_accumulate_grad_hook(lambda p: self.forward(p))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def test_release_grad_hooks_frees_a_wrapper_through_its_handles_and_its_parameters():
    wrapper = _Wrapper()
    ref = weakref.ref(wrapper)
    assert release_grad_hooks(wrapper, None) == 2
    assert release_grad_hooks(wrapper) == 0  # a second close finds nothing left
    del wrapper
    gc.collect()
    assert ref() is None


@pytest.mark.parametrize("keep", ["handles", "parameter hooks"])
def test_a_wrapper_half_released_stays_alive(keep):
    """Each of the two places alone keeps the wrapper: both must be released."""
    wrapper = _Wrapper()
    ref = weakref.ref(wrapper)
    if keep == "handles":
        wrapper.inner.weight._post_accumulate_grad_hooks.clear()
    else:
        wrapper.grad_acc_hooks["hidden"].remove()
    del wrapper
    gc.collect()
    assert ref() is not None
    release_grad_hooks(ref())
    gc.collect()
    assert ref() is None


# -- the check: what is still alive, and how many bytes it holds ------------------------------------

KEPT: list = []


def test_run_watch_names_a_kept_model_its_bytes_and_the_global_holding_it():
    watch = RunWatch("cpu")
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 4))
    gone = torch.nn.Linear(8, 8)
    watch.watch("run 1's model", model)
    watch.watch("run 2's model", gone)
    watch.watch("nothing", None)
    KEPT.append(model)
    del model, gone
    try:
        found = watch.leftovers()
    finally:
        KEPT.clear()
    assert found is not None
    assert found.alive == ["Sequential (run 1's model)"]
    assert found.tensor_bytes == (256 * 256 + 256 + 256 * 4 + 4) * 4
    assert found.holders == [f"{__name__}.KEPT"]
    assert found.cuda_bytes is None  # a CPU rank
    text = found.describe()
    assert "Sequential (run 1's model) still reachable" in text
    assert f"{found.tensor_bytes:,} bytes" in text
    assert f"{__name__}.KEPT" in text
    assert watch.leftovers() is None  # the global let go


class _ReleasesOnFinalize:
    """Garbage whose finalizer lets go of a model: only a second collection can free that model
    (the shape measured with an FSDP2 run whose backward raised)."""

    def __init__(self) -> None:
        self.cycle = self

    def __del__(self) -> None:
        KEPT.clear()


def test_run_watch_collects_again_while_a_collection_releases_more():
    watch = RunWatch("cpu")
    model = torch.nn.Linear(16, 16)
    model.cycle = [model]  # freed by a collection, not by its reference count
    watch.watch("run 1's model", model)
    KEPT.append(model)
    del model
    _ReleasesOnFinalize()
    assert watch.leftovers() is None


def test_reachable_tensor_bytes_counts_each_storage_once_and_follows_grads_and_closures():
    base = torch.zeros(1000)
    views = [base[:10], base[10:]]  # one storage
    param = torch.nn.Parameter(torch.zeros(100))
    param.grad = torch.zeros(100)
    param.main_grad = torch.zeros(50)  # an attribute, as Megatron keeps its main_grad
    closure_tensor = torch.zeros(30)

    def hook() -> torch.Tensor:
        return closure_tensor

    assert reachable_tensor_bytes([views]) == 4000
    assert reachable_tensor_bytes([param]) == (100 + 100 + 50) * 4
    assert reachable_tensor_bytes([hook]) == 120
    assert reachable_tensor_bytes([sys.modules[__name__]]) == 0  # modules are not followed


# -- real runs on 2 CPU ranks -----------------------------------------------------------------------

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


def _after_each_test(pytester, rank: int) -> list[dict]:
    return [json.loads(line) for line in (pytester.path / f"after-rank{rank}.jsonl").read_text().splitlines()]


def test_ten_runs_in_a_row_leave_no_wrapper_and_flat_memory(pytester):
    pytester.makeconftest(AFTER_EACH_TEST)
    pytester.makepyfile(test_ten=TEN_RUNS)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--mfsdp-platform=cpu", timeout=420)
    result.assert_outcomes(passed=10)
    for rank in (0, 1):
        after = _after_each_test(pytester, rank)
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


@pytest.mark.skipif(versions.fully_shard_problem() is not None, reason=str(versions.fully_shard_problem()))
def test_fully_shard_runs_leave_no_wrapper(pytester):
    pytester.makeconftest(AFTER_EACH_TEST)
    pytester.makepyfile(test_fs=FULLY_SHARD_RUNS)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--mfsdp-platform=cpu", timeout=300)
    result.assert_outcomes(passed=3)
    for rank in (0, 1):
        after = _after_each_test(pytester, rank)
        assert [a["wrappers"] for a in after] == [[]] * 3, after


class _CachedEmbedding(torch.nn.Module):
    """A module whose method is cached per class, keyed on ``self``, as megatron-core's
    ``RotaryEmbedding.forward`` is (``@functools.lru_cache(maxsize=32)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(4))

    @functools.lru_cache(maxsize=32)  # noqa: B019 - the pattern under test
    def forward(self, n: int) -> torch.Tensor:
        return self.weight[:n]


def test_a_method_cache_keeps_its_module_until_release_clears_it():
    embedding = _CachedEmbedding()
    embedding(2)
    ref = weakref.ref(embedding)
    del embedding
    gc.collect()
    assert ref() is not None  # the class's cache holds the module (and all it refers to)
    assert release_method_caches(ref()) == 1
    assert release_method_caches(ref()) == 0  # nothing left to clear
    gc.collect()
    assert ref() is None
