"""A data-parallel group of one rank: Megatron-FSDP's gradients keep DDP's scale.

Megatron-LM issue #6660 (fixed on main by PR #6773): gradients over-scaled, per micro-batch, when a
reduction group has a single rank (DP=1, or EP=DP for experts). Adam hides a gradient's scale from
the losses, so this compares the global gradient norm too, step by step, with 4 micro-batches.
tp=2 on 2 ranks gives every rank a data-parallel group of itself.

Measured on CPU ranks (2026-12-01, Python 3.12, torch 2.14.1), megatron-core 0.19.2 and Megatron-LM
main of 2026-08-22 (megatron-core 0.20.0): Megatron-FSDP V1 matches DDP exactly (losses and grad
norms) for all four sharding strategies, with 1 and with 4 micro-batches; the bug does not reproduce
with V1. Main's change for it is in Megatron-FSDP V2 (``megatron_fsdp/experimental/
parameter_group.py``: the divisor scales each backward's contribution before accumulation), which
this file does not build. V1 at dp=1 still pre-scales the whole unsharded bucket, running total
included, on every micro-batch (``gradient_reduce_preprocessing``): harmless with a scaling factor
of 1/dp = 1. With the factor changed to 2/dp in megatron-core's source, this test fails with a grad
norm ratio of 8.67 for optim_grads_params (the factor compounding over the 4 micro-batches) and 2
for optim. Expert parameters with EP=DP (factor 1/dp != 1 on a one-rank expert group) would expose
that path; the harness builds no MoE model.
"""

from __future__ import annotations

import math

import pytest

from pytest_megatron_fsdp.fsdp import versions

ITERS = 3
MICROBATCHES = 4
GPU_RTOL = 1e-4


@pytest.mark.distributed(world_size=2, tp=2)
@pytest.mark.parametrize("strategy", ["optim_grads_params", "optim"])
def test_a_single_rank_data_parallel_group_keeps_ddps_gradient_scale(
    known_bug, megatron_fsdp_run, run_config, dist_env, strategy
):
    """tp=2 x dp=1, 4 micro-batches: Megatron-FSDP's losses and global grad norms equal DDP's
    (exactly on fp32 CPU ranks). A gradient scaled by a wrong factor shows in the grad norm at the
    first step, whatever Adam does to the losses."""
    known_bug(versions.TENSOR_PARALLEL_WITHOUT_TE, raises=TypeError)
    assert run_config.model.tensor_model_parallel_size == 2
    run_config.train.num_microbatches = MICROBATCHES
    run_config.train.global_batch_size = None  # micro-batch x 4 x dp 1, as the run derives it
    baseline_cfg = run_config.copy()
    baseline_cfg.dist.use_megatron_fsdp = False
    baseline_cfg.ddp.use_megatron_fsdp = False
    # On CPU ranks Megatron DDP's distributed optimizer fails a torch.cuda type check.
    baseline_cfg.ddp.use_distributed_optimizer = False
    baseline_cfg.ddp.overlap_param_gather = False
    baseline = megatron_fsdp_run(baseline_cfg)
    expected = baseline.train(ITERS)
    assert type(baseline.model).__name__ == "DistributedDataParallel"
    baseline.close()

    run_config.ddp.data_parallel_sharding_strategy = strategy
    run = megatron_fsdp_run(run_config)
    result = run.train(ITERS)
    assert isinstance(run.model, versions.megatron_fsdp_wrapper_types())
    rel_tol = 0.0 if dist_env.platform == "cpu" else GPU_RTOL
    for what, actual, wanted in (
        ("grad norm", result.grad_norms, expected.grad_norms),
        ("loss", result.losses, expected.losses),
    ):
        assert len(actual) == len(wanted) == ITERS
        same = [
            a == e if rel_tol == 0 else math.isclose(a, e, rel_tol=rel_tol)
            for a, e in zip(actual, wanted, strict=True)
        ]
        assert all(same), (
            f"{strategy}, dp=1, {MICROBATCHES} micro-batches: {what} {actual} != DDP's {wanted} "
            f"(rel_tol {rel_tol}); a ratio of {actual[0] / wanted[0]:.6g} at step 1"
        )
