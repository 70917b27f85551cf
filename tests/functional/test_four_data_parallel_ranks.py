"""Megatron-FSDP on 4 data-parallel ranks (``fully_shard``, every strategy) against torch DDP.

Two ranks hide shard arithmetic: with 2 ranks, rank 1's shard starts at exactly half the bucket, so
an offset counted twice (2 x start) lands on the bucket's size, and Python's negative slicing of a
flat buffer wraps it back onto the right elements; ranks 0 and 1 are also each other's mirror. On 4
ranks every such slip lands on another rank's data. Same model, data and exactness argument as
``test_fully_shard.py`` (quarters are exact in binary floating point; the order of the additions is
not, so a few ulps).
"""

from __future__ import annotations

import math

import pytest
from small_models import Block, classification_loss, projection_batches
from test_fully_shard import ITERS, STRATEGIES, _ddp_result, _model, _sgd

from pytest_megatron_fsdp import assert_last_loss_finite, assert_loss_decreased

RTOL = 1e-6


@pytest.mark.distributed(world_size=4)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_fully_shard_on_four_ranks_matches_torch_ddp(fully_shard_run, dist_env, strategy):
    baseline = _ddp_result(dist_env)
    model = _model()
    run = fully_shard_run(
        model,
        _sgd(model),
        projection_batches(dist_env.rank),
        classification_loss,
        zero_dp_strategy=strategy,
        fsdp_unit_modules=[Block],
    )
    result = run.train(ITERS)
    assert_last_loss_finite(result)
    assert_loss_decreased(result)
    for i in range(ITERS):
        a, e = result.losses[i], baseline.losses[i]
        assert math.isclose(a, e, rel_tol=RTOL), f"{strategy}, iteration {i + 1}: loss {a} vs torch DDP {e}"
        a, e = result.grad_norms[i], baseline.grad_norms[i]
        assert math.isclose(a, e, rel_tol=RTOL), f"{strategy}, iteration {i + 1}: grad norm {a} vs DDP {e}"
