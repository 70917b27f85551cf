"""Megatron-FSDP V2's standalone API (``megatron_fsdp.experimental``): ``fully_shard`` per unit
inside ``fully_shard_context``, ``fully_shard_optimizer`` and V2's own DCP ``save_checkpoint`` /
``load_checkpoint``, on a plain torch model, as a user of V2 without megatron-core's wrapper runs it
(the ``fully_shard_v2_run`` fixture); and the plugin's verified checkpoints of such a run, which hold
V2's own format.

Where megatron-core has no such API (0.16.1; 0.19.2's ``experimental`` predates it) every case skips
in one line. Exactness: with 2 data-parallel ranks the averaged gradient is (a + b) / 2 under torch
DDP and a / 2 + b / 2 (or (a + b) / 2) under V2; halving is exact in binary floating point, so fp32
CPU ranks agree to the bit (losses compared with ==).
"""

from __future__ import annotations

import math

import pytest
import torch
from small_models import CLASSES, WIDTH, Block, classification_loss, projection_batches

from pytest_megatron_fsdp import assert_last_loss_finite, assert_loss_decreased

ITERS = 4
GPU_RTOL = 1e-5
#: the global grad norm: float64 sums of squares over shards vs whole tensors (a few ulps)
GRAD_NORM_RTOL = 1e-6


class Net(torch.nn.Module):
    """Two blocks (the FSDP units) and a root that owns parameters of its own: a direct bias and
    the head, which no unit claims (the root's ``fully_shard`` takes them)."""

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


def _net(seed: int = 0, dtype: torch.dtype = torch.float32) -> Net:
    torch.manual_seed(seed)  # the same weights on every rank, and for the baseline
    return Net().to(dtype)


def _units(model: Net) -> list[torch.nn.Module]:
    return list(model.blocks)


def _sgd(parameters) -> torch.optim.Optimizer:
    return torch.optim.SGD(parameters, lr=0.05, momentum=0.9)


def _adamw(parameters) -> torch.optim.Optimizer:
    return torch.optim.AdamW(parameters, lr=3e-3, weight_decay=0.1)


def _v2_run(fully_shard_v2_run, dist_env, model, optimizer=_sgd, **kwargs):
    return fully_shard_v2_run(
        model, optimizer, projection_batches(dist_env.rank), classification_loss, units=_units, **kwargs
    )


def _ddp(dist_env, optimizer=_sgd):
    from pytest_megatron_fsdp.fsdp.fully_shard import train_with_torch_ddp

    model = _net()
    return train_with_torch_ddp(
        model,
        optimizer(model.parameters()),
        projection_batches(dist_env.rank),
        classification_loss,
        dist_env,
        ITERS,
    )


def _assert_same(actual, expected, platform: str, what: str) -> None:
    assert len(actual) == len(expected) == ITERS
    for i, (a, e) in enumerate(zip(actual, expected, strict=True), start=1):
        same = a == e if platform == "cpu" else math.isclose(a, e, rel_tol=GPU_RTOL)
        assert same, f"{what}: iteration {i} loss {a!r} != torch DDP's {e!r}; all: {actual} vs {expected}"


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads", "optim_grads_params"])
def test_v2_fully_shard_matches_torch_ddp(fully_shard_v2_run, dist_env, strategy):
    """Each sharding strategy as V2 placements (parameter, gradient, optimizer state: Replicate,
    Partial('avg') or Shard(0)), the root owning parameters besides its two sharded children: the
    losses are torch DDP's, the global grad norm too; the parameters rest as DTensors, and where the
    optimizer state is sharded each rank holds less than the whole model."""
    from torch.distributed.tensor import DTensor

    baseline = _ddp(dist_env)
    run = _v2_run(fully_shard_v2_run, dist_env, _net(), strategy=strategy)
    result = run.train(ITERS)
    assert_last_loss_finite(result)
    assert_loss_decreased(result)
    _assert_same(result.losses, baseline.losses, dist_env.platform, f"V2 fully_shard {strategy}")
    for i, (a, e) in enumerate(zip(result.grad_norms, baseline.grad_norms, strict=True), start=1):
        assert math.isclose(a, e, rel_tol=GRAD_NORM_RTOL), f"iteration {i}: grad norm {a} vs torch DDP's {e}"
    params = list(run.model.parameters())
    assert all(isinstance(p, DTensor) for p in params), [type(p).__name__ for p in params]
    if strategy != "no_shard":
        local = sum(p.to_local().numel() for p in params)
        assert local < sum(p.numel() for p in params)


#: who saves and who loads: V2's own save_checkpoint/load_checkpoint, or the plugin's (verified,
#: atomic, holding V2's state dicts: a V2 user's load_checkpoint reads an iteration it saved)
CHECKPOINT_PATHS = ["v2_saves_v2_loads", "plugin_saves_plugin_loads", "plugin_saves_v2_loads"]


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("path", CHECKPOINT_PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_v2_fully_shard_checkpoint_resumes_exactly(fully_shard_v2_run, dist_env, checkpoint_dir, dtype, path):
    """Model and AdamW state through DCP: a fresh run from another seed loads the checkpoint and
    trains on to exactly the losses the saved run went on to. bf16: the model computes in bf16
    while the optimizer steps fp32 main weights (fully_shard_optimizer casts the bf16 gradients
    around each step), and the load must refresh the bf16 compute weights from the loaded main
    weights."""
    from pytest_megatron_fsdp import load_checkpoint, save_checkpoint

    def build(seed: int):
        return fully_shard_v2_run(
            _net(seed, dtype),
            _adamw,
            projection_batches(dist_env.rank, dtype),
            classification_loss,
            units=_units,
        )

    run = build(0)
    run.train(3)
    stepped = {p.dtype for group in run.optimizer.param_groups for p in group["params"]}
    assert stepped == {torch.float32}, f"V2's optimizer steps {stepped} weights, expected float32"
    if path == "v2_saves_v2_loads":
        run.save_checkpoint(checkpoint_dir)
        saved_iteration = checkpoint_dir
    else:
        saved = save_checkpoint(run, checkpoint_dir)
        assert saved.iteration == 3
        saved_iteration = saved.path
    expected = run.train(3).losses
    run.close()
    fresh = build(1)
    assert fresh.train(1).losses != expected[:1]  # another model: the comparison below means something
    if path == "plugin_saves_plugin_loads":
        load_checkpoint(fresh, checkpoint_dir)
        assert fresh.iteration == 3
    else:
        fresh.load_checkpoint(saved_iteration, iteration=3)
    resumed = fresh.train(3).losses
    if dist_env.platform == "cpu":
        assert resumed == expected
    else:
        assert all(math.isclose(a, e, rel_tol=GPU_RTOL) for a, e in zip(resumed, expected, strict=True))


def _flip_bytes(path) -> None:
    """Invert 64 bytes in the middle of ``path``: the same size, other content."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 64] = bytes(b ^ 0xFF for b in data[middle : middle + 64])
    path.write_bytes(bytes(data))


@pytest.mark.distributed(world_size=2)
def test_v2_fully_shard_refused_load_changes_nothing(fully_shard_v2_run, dist_env, checkpoint_dir):
    """A damaged checkpoint is refused on every rank, and the fresh run it was refused for is as it
    was: the same weights, still no optimizer state (AdamW with weight decay: one step taken to
    allocate the state it would load into would decay the weights), and it trains on as an
    identical run that never tried to load."""
    from pytest_megatron_fsdp import CheckpointError, load_checkpoint, save_checkpoint

    batches = projection_batches(dist_env.rank)
    saved = fully_shard_v2_run(_net(0), _adamw, batches, classification_loss, units=_units)
    saved.train(2)
    path = save_checkpoint(saved, checkpoint_dir).path
    saved.close()
    torch.distributed.barrier()
    if dist_env.rank == 0:
        _flip_bytes(path / "__1_0.distcp")
    torch.distributed.barrier()

    target = fully_shard_v2_run(_net(1), _adamw, batches, classification_loss, units=_units)
    before = {name: p.to_local().clone() for name, p in target.model.named_parameters()}
    with pytest.raises(CheckpointError, match=r"__1_0\.distcp does not match its sha256 digest"):
        load_checkpoint(target, checkpoint_dir)
    assert not target.optimizer.state, "the refused load left optimizer state behind"
    after = {name: p.to_local() for name, p in target.model.named_parameters()}
    changed = [name for name in before if not torch.equal(before[name], after[name])]
    assert not changed, f"the refused load changed {changed}"
    untouched = fully_shard_v2_run(_net(1), _adamw, batches, classification_loss, units=_units)
    assert target.train(3).losses == untouched.train(3).losses


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_v2_fully_shard_a_run_that_never_stepped_loads_exactly(
    fully_shard_v2_run, dist_env, checkpoint_dir, dtype
):
    """The plugin's load into a run whose optimizer has no state yet (the template is built on
    state allocated and given back, the load allocates it for real): it trains on exactly as the
    saved run did."""
    from pytest_megatron_fsdp import load_checkpoint, save_checkpoint

    batches = projection_batches(dist_env.rank, dtype)
    saved = fully_shard_v2_run(_net(0, dtype), _adamw, batches, classification_loss, units=_units)
    saved.train(2)
    save_checkpoint(saved, checkpoint_dir)
    expected = saved.train(3).losses
    saved.close()
    fresh = fully_shard_v2_run(_net(1, dtype), _adamw, batches, classification_loss, units=_units)
    assert not fresh.optimizer.state
    load_checkpoint(fresh, checkpoint_dir)
    resumed = fresh.train(3).losses
    if dist_env.platform == "cpu":
        assert resumed == expected
    else:
        assert all(math.isclose(a, e, rel_tol=GPU_RTOL) for a, e in zip(resumed, expected, strict=True))
