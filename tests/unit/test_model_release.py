"""No model outlives its test: the hooks that would keep it alive are released, and that is checked.

torch's garbage collector cannot follow a tensor's post-accumulate-grad hooks, so a wrapper whose
parameters carry such a hook referring back to it (Megatron-FSDP registers one per parameter) is
never collected (tests/reproductions/test_post_accumulate_grad_hook_cycle.py shows that with torch
alone). Here, in process: the release frees such wrappers, and the run watch names a model kept.
tests/integration/test_model_release_sessions.py runs real runs on 2 CPU ranks.
"""

from __future__ import annotations

import functools
import gc
import sys
import weakref

import pytest
import torch

from pytest_megatron_fsdp.fsdp.release import (
    RunWatch,
    reachable_tensor_bytes,
    release_grad_hooks,
    release_method_caches,
)

# -- torch's garbage collector and post-accumulate-grad hooks ---------------------------------------


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


class _ImportsOnValues(dict):
    """A registry that loads what it maps only when asked for its values (transformers' auto-class
    mappings, which Megatron-Bridge imports), and fails there for an entry it cannot load."""

    def values(self):  # type: ignore[override]
        raise ValueError("Could not find VoxtralRealtimeTextModel")

    def __iter__(self):
        raise ValueError("Could not find VoxtralRealtimeTextModel")


def test_the_search_for_a_kept_models_holder_reads_a_registry_without_loading_it(monkeypatch):
    registries = type(sys)("lazy_registries")
    registries.MAPPING = _ImportsOnValues(llama="LlamaModel")
    registries.LISTED = type("Listing", (list,), {"__iter__": _ImportsOnValues.__iter__})()
    monkeypatch.setitem(sys.modules, "lazy_registries", registries)
    watch = RunWatch("cpu")
    model = torch.nn.Linear(4, 4)
    watch.watch("run 1's model", model)
    registries.LISTED.append(model)  # held in a list subclass that cannot be iterated the usual way
    del model
    found = watch.leftovers()
    assert found is not None
    assert found.holders == ["lazy_registries.LISTED"]
    registries.LISTED.clear()


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
