"""Version gates: each known upstream bug is present exactly on the releases that have it, and the
wrapper check survives megatron-core's FullyShardedDataParallel becoming a factory (upstream main)."""

from __future__ import annotations

import sys
import types

import pytest

from pytest_megatron_fsdp.fsdp import versions

# (bug, releases that have it, releases that do not): from the upstream fixes the reasons cite.
EXPECTED = [
    (versions.NO_SHARD_PARAM_SYNC, [(0, 16, 1), (0, 17, 0)], [(0, 18, 0), (0, 19, 2)]),
    (versions.OPTIM_OVERLAP_DOUBLE_COUNT, [(0, 16, 1)], [(0, 17, 0), (0, 19, 2)]),
    (versions.OPTIM_SYNC_DOUBLE_REDUCE, [(0, 19, 0), (0, 19, 2)], [(0, 16, 1), (0, 18, 0)]),
    (versions.FSDP2_FINISH_GRAD_SYNC, [(0, 16, 1), (0, 18, 0)], [(0, 19, 0), (0, 19, 2)]),
]


@pytest.mark.parametrize("bug, present, absent", EXPECTED, ids=lambda v: getattr(v, "reason", "")[:40])
def test_known_bug_ranges(bug, present, absent):
    assert [bug.present(v) for v in present] == [True] * len(present)
    assert [bug.present(v) for v in absent] == [False] * len(absent)
    assert "PR #" in bug.reason or "issue #" in bug.reason  # every reason cites upstream


def test_tensor_parallel_bug_needs_a_missing_transformer_engine(monkeypatch):
    bug = versions.TENSOR_PARALLEL_WITHOUT_TE
    monkeypatch.setattr(versions, "transformer_engine_available", lambda: False)
    assert bug.present((0, 16, 1)) and not bug.present((0, 18, 0))
    monkeypatch.setattr(versions, "transformer_engine_available", lambda: True)
    assert not bug.present((0, 16, 1))


def test_wrapper_types_of_a_class_and_of_a_factory(monkeypatch):
    class FullyShardedDataParallel:  # up to 0.19: a class
        pass

    assert versions.megatron_fsdp_wrapper_types(FullyShardedDataParallel) == (FullyShardedDataParallel,)

    # upstream main: a factory beside the classes it returns
    adapter = types.ModuleType("fake_mcore_fsdp_adapter")

    class FullyShardedDataParallelV1:
        pass

    class FullyShardedDataParallelV2:
        pass

    def factory(*args, **kwargs):
        return FullyShardedDataParallelV2()

    factory.__module__ = adapter.__name__
    adapter.FullyShardedDataParallelV1 = FullyShardedDataParallelV1
    adapter.FullyShardedDataParallelV2 = FullyShardedDataParallelV2
    adapter.FullyShardedDataParallel = factory
    monkeypatch.setitem(sys.modules, adapter.__name__, adapter)
    wrappers = versions.megatron_fsdp_wrapper_types(factory)
    assert wrappers == (FullyShardedDataParallelV1, FullyShardedDataParallelV2)
    assert isinstance(factory(), wrappers)

    lonely = types.ModuleType("fake_lonely")
    monkeypatch.setitem(sys.modules, lonely.__name__, lonely)
    factory.__module__ = lonely.__name__
    with pytest.raises(TypeError, match="wrapper layout is unknown"):
        versions.megatron_fsdp_wrapper_types(factory)
