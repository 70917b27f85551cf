"""A root module that owns parameters besides its sharded children, with V1's
``megatron_fsdp.fully_shard``: a bias applied before the first block and the head, both the root's,
the two blocks FSDP units. Either the root's parameters belong to no unit (``fsdp_unit_modules=
[Block]``), or the root is an FSDP unit itself with the blocks nested in it (``[Net, Block]``: its
unshard must gather its own parameters, not its children's, and its reshard must not free theirs).
(V2's root ``fully_shard``, which takes the parameters no unit claimed: test_v2_fully_shard.py.)

Against torch DDP on the same model and data: losses to the bit on fp32 CPU ranks (see
test_fully_shard.py), grad norms within float64 ulps.
"""

from __future__ import annotations

import math

import pytest
import torch
from small_models import CLASSES, WIDTH, Block, classification_loss, projection_batches

from pytest_megatron_fsdp import assert_last_loss_finite, assert_loss_decreased

ITERS = 4
GPU_RTOL = 1e-5


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bias = torch.nn.Parameter(torch.linspace(-0.1, 0.1, WIDTH))
        self.blocks = torch.nn.ModuleList([Block(), Block()])
        self.head = torch.nn.Linear(WIDTH, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.bias
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _net() -> Net:
    torch.manual_seed(0)  # the same weights on every rank, and for the baseline
    return Net()


def _sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("units", [[Block], [Net, Block]], ids=["root-outside-units", "root-unit-nested"])
@pytest.mark.parametrize("strategy", ["optim", "optim_grads_params"])
def test_root_parameters_match_torch_ddp(fully_shard_run, dist_env, units, strategy):
    """The root's own parameters train as DDP trains them, alongside its sharded children."""
    from pytest_megatron_fsdp.fsdp.fully_shard import train_with_torch_ddp

    baseline_model = _net()
    baseline = train_with_torch_ddp(
        baseline_model,
        _sgd(baseline_model),
        projection_batches(dist_env.rank),
        classification_loss,
        dist_env,
        ITERS,
    )
    model = _net()
    run = fully_shard_run(
        model,
        _sgd(model),
        projection_batches(dist_env.rank),
        classification_loss,
        zero_dp_strategy=strategy,
        fsdp_unit_modules=units,
    )
    result = run.train(ITERS)
    assert_last_loss_finite(result)
    assert_loss_decreased(result)
    assert len(result.losses) == ITERS
    for i, (a, e) in enumerate(zip(result.losses, baseline.losses, strict=True), start=1):
        same = a == e if dist_env.platform == "cpu" else math.isclose(a, e, rel_tol=GPU_RTOL)
        assert same, (
            f"iteration {i}: loss {a!r} != torch DDP's {e!r}; all {result.losses} vs {baseline.losses}"
        )
    for i, (a, e) in enumerate(zip(result.grad_norms, baseline.grad_norms, strict=True), start=1):
        assert math.isclose(a, e, rel_tol=1e-6), f"iteration {i}: grad norm {a} vs torch DDP's {e}"
