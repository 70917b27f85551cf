"""The smoke test's checks can fail: each is driven into its failure and the message checked.

Distributed (2 ranks): every rank must raise the same message, naming the iteration and rank.
"""

import math

import pytest

from pytest_megatron_fsdp import (
    TrainResult,
    assert_last_loss_finite,
    assert_loss_decreased,
    assert_megatron_fsdp_sharded,
)

pytestmark = pytest.mark.distributed(world_size=2)


def test_absurd_learning_rate_fails_the_finite_loss_check(megatron_fsdp_run, run_config):
    run_config.optimizer.lr = 1e30
    # Megatron's own NaN-in-grad check would raise first; this test is about the loss check.
    run_config.ddp.check_for_nan_in_grad = False
    result = megatron_fsdp_run(run_config).train(8)
    assert not math.isfinite(result.local_losses[-1])
    first_bad = next(i for i, loss in enumerate(result.local_losses, start=1) if not math.isfinite(loss))
    assert first_bad < 8  # the run went bad before its last iteration: the message must say when
    with pytest.raises(AssertionError) as failure:
        assert_last_loss_finite(result)
    message = str(failure.value)
    assert message.startswith(
        "loss is not finite at the last iteration (8): rank 0: loss=nan, rank 1: loss=nan"
    )
    assert f"first non-finite at iteration {first_bad}: rank 0: loss=nan, rank 1: loss=nan" in message


def test_finite_loss_check_names_the_one_bad_rank(dist_env):
    losses = [4.8, 4.5, 4.2]
    local = [*losses[:-1], float("nan") if dist_env.rank == 1 else 4.2]
    result = TrainResult(losses=losses, local_losses=local)
    with pytest.raises(AssertionError) as failure:
        assert_last_loss_finite(result)
    assert str(failure.value) == (
        "loss is not finite at the last iteration (3): rank 1: loss=nan; first non-finite at iteration 3: "
        "rank 1: loss=nan; finite at the last iteration: rank 0: loss=4.2"
    )


def test_finite_loss_check_says_where_each_rank_went_bad(dist_env):
    """Rank 0 is NaN from iteration 7 on, rank 1 from 9 (a second train() call: iterations 6..10)."""
    start = {0: 1, 1: 3}[dist_env.rank]
    local = [4.0] * start + [float("nan")] * (5 - start)
    result = TrainResult(losses=[4.0] * 5, local_losses=local, first_iteration=6)
    with pytest.raises(AssertionError) as failure:
        assert_last_loss_finite(result)
    assert str(failure.value) == (
        "loss is not finite at the last iteration (10): rank 0: loss=nan, rank 1: loss=nan; "
        "first non-finite at iteration 7: rank 0: loss=nan (rank 1 from iteration 9)"
    )


def test_frozen_model_fails_the_learned_check(megatron_fsdp_run, run_config):
    run_config.optimizer.lr = 0.0
    run_config.optimizer.min_lr = 0.0  # a preset's floor may be above 0 (bridge-reference: 1e-6)
    result = megatron_fsdp_run(run_config).train(10)
    assert all(math.isfinite(x) for x in result.losses)
    with pytest.raises(AssertionError, match=r"did not learn: loss went .* \(iteration 10\)"):
        assert_loss_decreased(result)


def test_plain_ddp_fails_the_sharding_check(megatron_fsdp_run, run_config):
    run_config.dist.use_megatron_fsdp = False
    run_config.ddp.use_megatron_fsdp = False
    # On CPU ranks the DDP + distributed-optimizer path fails a CUDA type check; without the
    # distributed optimizer, parameter gathering cannot overlap (validate() refuses it).
    run_config.ddp.use_distributed_optimizer = False
    run_config.ddp.overlap_param_gather = False
    run = megatron_fsdp_run(run_config)
    result = run.train(3)
    assert_last_loss_finite(result)  # it trains fine: only the sharding check tells it apart
    with pytest.raises(
        AssertionError,
        match=r"DistributedDataParallel, not megatron-core.s FullyShardedDataParallel",
    ):
        assert_megatron_fsdp_sharded(run.model)
