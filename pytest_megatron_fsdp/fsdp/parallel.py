"""Megatron's model-parallel state and seeding, as every Megatron test sets them up.

Imports torch and megatron at module level: loaded only inside a rank that runs a distributed test
(after the CPU emulation, when there is one, is in place).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from . import versions
from .dtensor_caches import forget_dtensor_shardings

#: the process groups the last initialize_model_parallel created (torch keeps them until destroyed)
_MODEL_PARALLEL_GROUPS: list[Any] = []
#: the layout they were made for: (tp, pp, cp, distributed-optimizer instances)
_LAYOUT: list[tuple[int, int, int, int]] = []


def initialize_model_parallel(
    tp: int = 1, pp: int = 1, cp: int = 1, seed: int = 1234, optimizer_instances: int = 1
) -> None:
    """Megatron's model-parallel state and seeded RNGs, as every Megatron test sets them up.

    State already up with the same sizes (an earlier test or run made it) is kept, only reseeded:
    building it again costs a store rendezvous per group, and each gloo group holds sockets and
    threads (17 groups, ~70 fds and ~50 threads per rank on 2 CPU ranks) that the models Megatron
    builds on them keep alive after their test. Other sizes replace it; the old groups are destroyed.
    ``optimizer_instances`` > 1 splits the data-parallel group for HSDP (Megatron's
    ``num_distributed_optimizer_instances``: the outer, inter-instance group).
    """
    layout = (tp, pp, cp, optimizer_instances)
    if parallel_state.model_parallel_is_initialized() and [layout] == _LAYOUT:
        seed_everything(seed)
        return
    destroy_model_parallel()
    # DTensor ops cached on the old groups' meshes would hand their meshes to the new groups' DTensors
    forget_dtensor_shardings()
    before = set(versions.live_process_groups())
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        num_distributed_optimizer_instances=optimizer_instances,
    )
    _MODEL_PARALLEL_GROUPS[:] = [g for g in versions.live_process_groups() if g not in before]
    _LAYOUT[:] = [layout]
    seed_everything(seed)


def destroy_model_parallel() -> None:
    """Megatron forgets its model-parallel state; torch destroys the groups made for it.

    Newest first, as torch itself shuts groups down; every rank calls this at the same point, so
    all destroy the same groups in the same order. Groups already gone with the default one
    (a renewed process group) are skipped.
    """
    parallel_state.destroy_model_parallel()
    _LAYOUT.clear()
    groups, _MODEL_PARALLEL_GROUPS[:] = list(_MODEL_PARALLEL_GROUPS), []
    if not dist.is_initialized():
        return
    live = set(versions.live_process_groups())
    for group in reversed(groups):
        if group in live:
            dist.destroy_process_group(group)


def release_scratch_memory() -> int:
    """Free Megatron's process-wide scratch buffer; returns the bytes it held.

    ``parallel_state.get_global_memory_buffer()`` keeps, per (name, dtype), the largest tensor any
    caller asked for (the local attention's score matrix: 8 MiB per rank with the Bridge reference
    model on a GPU) for as long as the model-parallel state lives, which here is many tests. Freed
    after each test, the next one allocates it again when it needs it, and a test's CUDA memory is
    back to where it started. The buffer object stays (megatron looks it up on every call).
    """
    try:
        scratch = parallel_state.get_global_memory_buffer()
    except AssertionError:  # not initialized, or destroyed with the model-parallel state
        return 0
    tensors = getattr(scratch, "buffer", None)
    if not isinstance(tensors, dict):
        return 0
    held = sum(t.untyped_storage().nbytes() for t in tensors.values() if isinstance(t, torch.Tensor))
    tensors.clear()
    return held


def seed_everything(seed: int) -> None:
    """Python's, numpy's, torch's and Megatron's RNG tracker, identically on every rank."""
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    # Megatron's tracker: distinct tensor-parallel streams, identical data-parallel ones.
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
