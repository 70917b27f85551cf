"""DTensor's caches that outlive the process groups their meshes name.

Imports nothing at module level (it reads torch from ``sys.modules``): the rank's session calls it
before any test has imported torch's DTensor.
"""

from __future__ import annotations


def forget_dtensor_shardings() -> None:
    """Empty DTensor's sharding-propagation caches (this thread's): after every test, whenever the
    process group is rebuilt, and whenever Megatron's model-parallel groups are made again, so that
    no spec outlives the groups its meshes name.

    The cache keys on DTensor specs, and a ``DeviceMesh`` compares equal to another of the same
    shape, dimension names and device whatever its process groups are; a hit returns the spec the
    cached op produced, with that op's mesh. After the process group is rebuilt, a new model's
    DTensors (a mesh equal to an earlier test's) then came out of some ops on the earlier mesh,
    whose group names are unregistered or now name another group: one rank raised "Could not
    resolve the process group registered under the name 3" in the middle of a checkpoint's
    collectives while the other went on (measured: torch 2.14.1, megatron-core 0.19.2, after a
    standalone fully_shard test and a failed test; and within one test, after Megatron-Bridge's
    ``pretrain()`` had run on the plugin's model-parallel groups and the plugin made them again).
    """
    import sys

    dtensor = sys.modules.get("torch.distributed.tensor")
    propagator = getattr(
        getattr(getattr(dtensor, "DTensor", None), "_op_dispatcher", None), "sharding_propagator", None
    )
    for cache in (
        getattr(propagator, "propagate_op_sharding", None),
        getattr(propagator, "_propagate_tensor_meta_cached", None),
    ):
        if hasattr(cache, "cache_clear"):
            cache.cache_clear()  # type: ignore[union-attr]
    torch = sys.modules.get("torch")
    native = getattr(getattr(torch, "_C", None), "_clear_DTensor_sharding_propagator_cache", None)
    if native is not None:
        native()  # the C++ dispatch fast path's own copy of the cache
