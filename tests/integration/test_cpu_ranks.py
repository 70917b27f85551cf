"""Inside CPU ranks (the CUDA-on-CPU emulation on, gloo): what the emulation answers for, checked
against values computed by hand, and gloo groups that survive Megatron-FSDP's concurrent
all-gathers. One rank set runs every test of this file.
"""

import sys
from pathlib import Path

import pytest
import torch

from pytest_megatron_fsdp.emulation import cuda as cuda_emulation

#: the torch-only reproduction of the gloo crash (its own tier); its all-gather loop runs here in CPU ranks
REPRODUCTION = Path(__file__).parents[1] / "reproductions" / "gloo_concurrent_all_gathers.py"


@pytest.mark.distributed(world_size=2)
def test_premul_sum_is_the_pre_multiplied_sum_over_gloo(dist_env):
    """In a CPU rank (emulation on): NCCL's PREMUL_SUM, as Megatron-FSDP builds it, over gloo."""
    import torch.distributed as dist

    assert dist_env.backend == "gloo"
    assert cuda_emulation.is_enabled()
    factor = 1.0 / dist_env.world_size
    per_rank = [torch.arange(8, dtype=torch.float32) * (r + 1) + r for r in range(dist_env.world_size)]
    expected = sum(factor * x for x in per_rank)  # computed here, from every rank's input
    mine = per_rank[dist_env.rank].clone()

    shard = torch.empty(8 // dist_env.world_size)
    dist.reduce_scatter_tensor(output=shard, input=mine, op=dist._make_nccl_premul_sum(factor))
    assert torch.allclose(shard, expected.chunk(dist_env.world_size)[dist_env.rank])
    # the input is scaled in place (Megatron-FSDP's unfused path does the same before its SUM)
    assert torch.equal(mine, factor * per_rank[dist_env.rank])

    mine = per_rank[dist_env.rank].clone()
    work = dist.all_reduce(mine, dist._make_nccl_premul_sum(torch.tensor(factor)), async_op=True)
    work.wait()
    assert torch.allclose(mine, expected)

    # inside a coalescing manager (as Megatron-FSDP's bucketed reduce-scatter runs), asynchronous
    inputs = [per_rank[dist_env.rank].clone() for _ in range(3)]
    shards = [torch.empty(8 // dist_env.world_size) for _ in inputs]
    with dist._coalescing_manager(async_ops=True) as manager:
        for shard, tensor in zip(shards, inputs, strict=True):
            dist.reduce_scatter_tensor(shard, tensor, op=dist._make_nccl_premul_sum(factor))
    manager.wait()
    for shard in shards:
        assert torch.allclose(shard, expected.chunk(dist_env.world_size)[dist_env.rank])
    # a plain op passes through untouched
    total = per_rank[dist_env.rank].clone()
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    assert torch.equal(total, sum(per_rank))


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("async_op", [False, True])
def test_all_gather_into_outputs_of_different_shapes_over_gloo(dist_env, async_op):
    """NCCL gathers outputs of different shapes (Megatron-FSDP's uneven DTensor shards); gloo's
    allgather refuses them: in a CPU rank each rank's input lands in every rank's output of its index."""
    import torch.distributed as dist

    sizes = [3 + 2 * r for r in range(dist_env.world_size)]  # rank r holds r's own rows, 3 + 2r of them
    per_rank = [torch.arange(n * 2, dtype=torch.float32).reshape(n, 2) + 100 * r for r, n in enumerate(sizes)]
    outputs = [torch.full((n, 2), -1.0) for n in sizes]
    outputs[-1] = torch.full((2, sizes[-1]), -1.0).t()  # a strided output is filled in place too
    work = dist.all_gather(outputs, per_rank[dist_env.rank].clone(), async_op=async_op)
    if async_op:
        assert work.wait()
    for output, expected in zip(outputs, per_rank, strict=True):
        assert torch.equal(output, expected)
    # one shape: gloo's own allgather, as before
    even = [torch.empty(2) for _ in sizes]
    dist.all_gather(even, torch.full((2,), float(dist_env.rank)))
    assert [e.tolist() for e in even] == [[float(r)] * 2 for r in range(dist_env.world_size)]


@pytest.mark.distributed(world_size=2)
def test_megatrons_clip_on_cpu_ranks_matches_a_hand_computed_clip(dist_env):
    """In a CPU rank (emulation on): megatron's clip_grad_by_total_norm_fp32 itself, against the
    clip computed by hand: every gradient times max_norm / (total_norm + 1e-6) when that is < 1."""
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    assert cuda_emulation.is_enabled()
    grads = [torch.tensor([3.0, 4.0]), torch.tensor([[0.0, 12.0]])]  # total norm 13
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    clip_grad_by_total_norm_fp32(params, max_norm=1.0, total_norm=13.0)
    coefficient = 1.0 / (13.0 + 1e-6)
    for p, g in zip(params, grads, strict=True):
        assert torch.allclose(p.grad, g * coefficient, rtol=1e-6, atol=0), (p.grad, g * coefficient)
    assert abs(float(torch.cat([p.grad.flatten() for p in params]).norm()) - 1.0) < 1e-5

    # below the threshold nothing changes
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    clip_grad_by_total_norm_fp32(params, max_norm=20.0, total_norm=13.0)
    assert all(torch.equal(p.grad, g) for p, g in zip(params, grads, strict=True))

    # a bf16 gradient is refused, as megatron refuses it on a GPU
    bf16 = torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))
    bf16.grad = torch.ones(2, dtype=torch.bfloat16)
    with pytest.raises(AssertionError):
        clip_grad_by_total_norm_fp32([bf16], max_norm=1.0, total_norm=2.0)


@pytest.mark.distributed(world_size=2)
def test_cpu_ranks_gloo_groups_survive_concurrent_coalesced_all_gathers(dist_env):
    import torch.distributed as dist

    sys.path.insert(0, str(REPRODUCTION.parent))
    try:
        from gloo_concurrent_all_gathers import all_gather_concurrently
    finally:
        sys.path.remove(str(REPRODUCTION.parent))

    assert dist_env.backend == "gloo"
    group = dist.new_group()
    threads = {
        "default group": dist.group.WORLD._get_backend(torch.device("cpu")).options._threads,
        "new group": group._get_backend(torch.device("cpu")).options._threads,
    }
    assert threads == {"default group": 1, "new group": 1}
    # torch's own groups crashed within 250 to 3750 iterations in each of 5 measured runs
    all_gather_concurrently(group, iterations=6000)
    dist.destroy_process_group(group)
