"""Frozen parameters (``requires_grad=False``) with Megatron-FSDP, as fine-tuning freezes them: an
embedding that is a unit of its own and entirely frozen, and one layer frozen inside a unit whose
other layer trains. With V1's ``megatron_fsdp.fully_shard`` and, where megatron-core has its
standalone API, V2's ``experimental.fully_shard``.

Against torch DDP on the same model, frozen alike: the losses equal DDP's (fp32 CPU ranks: to the
bit, see test_fully_shard.py), and every frozen parameter's shard is what it was when the model was
wrapped, and none of them requires a gradient. V2 trains with AdamW and weight decay: a frozen
parameter handed a zero gradient instead of none would decay, and so move, on every step. V1 trains
with SGD and momentum: megatron-fsdp up to 0.6.1 initialises the optimizer state with one step on
zero gradients (known bug fully_shard_eager_optimizer_step), which AdamW's decoupled weight decay
turns into a move of every weight (test_fully_shard.py gates that bug on its own).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from small_models import CLASSES, WIDTH, Block

from pytest_megatron_fsdp import assert_last_loss_finite, assert_loss_decreased
from pytest_megatron_fsdp.fsdp import versions

ITERS = 6
GPU_RTOL = 1e-5
VOCAB = 64


class FrozenEmbeddingNet(torch.nn.Module):
    """Token embedding (frozen), two blocks (the first one's ``up`` frozen), a trained head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.blocks = torch.nn.ModuleList([Block(), Block()])
        self.head = torch.nn.Linear(WIDTH, CLASSES)
        self.embed.requires_grad_(False)
        self.blocks[0].up.requires_grad_(False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


FROZEN = ("embed.weight", "blocks.0.up.weight", "blocks.0.up.bias")


def _net() -> FrozenEmbeddingNet:
    torch.manual_seed(0)  # the same weights on every rank, and for the baseline
    return FrozenEmbeddingNet()


def _batches(rank: int):
    def batch(iteration: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 * rank + iteration)
        tokens = torch.randint(0, VOCAB, (16,), generator=g)
        return tokens, tokens % CLASSES  # learnable: a class per token

    return batch


def _loss(model: torch.nn.Module, batch) -> torch.Tensor:
    tokens, y = batch
    return F.cross_entropy(model(tokens).float(), y)


def _adamw(parameters) -> torch.optim.Optimizer:
    return torch.optim.AdamW(parameters, lr=1e-2, weight_decay=0.1)


def _sgd(parameters) -> torch.optim.Optimizer:
    return torch.optim.SGD(parameters, lr=0.1, momentum=0.9)


def _ddp_losses(dist_env, optimizer) -> list[float]:
    from pytest_megatron_fsdp.fsdp.fully_shard import train_with_torch_ddp

    model = _net()
    return train_with_torch_ddp(
        model, optimizer(model.parameters()), _batches(dist_env.rank), _loss, dist_env, ITERS
    ).losses


def _full_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole, by its name below the wrappers (collective: gathers the shards)."""
    from megatron_fsdp.uneven_dtensor import uneven_dtensor_to_full_tensor
    from torch.distributed.tensor import DTensor

    full = {}
    for name, param in model.named_parameters():
        whole = uneven_dtensor_to_full_tensor(param) if isinstance(param, DTensor) else param
        full[name.removeprefix("module.")] = whole.detach().clone()
    return full


def _assert_frozen_kept(model: torch.nn.Module) -> None:
    """Every frozen parameter equals its initial value, still does not require a gradient, and
    some trained parameter moved (else the check would mean nothing)."""
    initial = {name: p.detach() for name, p in _net().named_parameters()}
    after = _full_parameters(model)
    assert set(after) == set(initial), f"parameters after wrapping: {sorted(after)}"
    for name in FROZEN:
        assert torch.equal(after[name], initial[name]), f"frozen {name} changed in training"
    moved = [n for n in set(after) - set(FROZEN) if not torch.equal(after[n], initial[n])]
    assert moved, "no trained parameter moved: the check above means nothing"
    requires_grad = {n.removeprefix("module."): p.requires_grad for n, p in model.named_parameters()}
    assert [n for n in FROZEN if requires_grad[n]] == [], f"frozen ones made trainable: {requires_grad}"


def _assert_same(actual, expected, platform: str, what: str) -> None:
    assert len(actual) == len(expected) == ITERS
    for i, (a, e) in enumerate(zip(actual, expected, strict=True), start=1):
        same = a == e if platform == "cpu" else math.isclose(a, e, rel_tol=GPU_RTOL)
        assert same, f"{what}: iteration {i} loss {a!r} != torch DDP's {e!r}; all: {actual} vs {expected}"


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("strategy", ["optim", "optim_grads_params"])
def test_fully_shard_frozen_parameters_match_torch_ddp(fully_shard_run, dist_env, strategy):
    """V1's fully_shard with the embedding a frozen-only unit and a frozen layer in a trained unit
    (Megatron-LM PR #3287 fixed Megatron-FSDP for frozen parameters)."""
    expected = _ddp_losses(dist_env, _sgd)
    model = _net()
    run = fully_shard_run(
        model,
        _sgd(model.parameters()),
        _batches(dist_env.rank),
        _loss,
        zero_dp_strategy=strategy,
        fsdp_unit_modules=[Block, torch.nn.Embedding],
    )
    result = run.train(ITERS)
    assert_last_loss_finite(result)
    assert_loss_decreased(result)
    _assert_same(result.losses, expected, dist_env.platform, f"fully_shard {strategy}, frozen parameters")
    _assert_frozen_kept(run.model)


@pytest.mark.distributed(world_size=2)
def test_v2_fully_shard_frozen_parameters_match_torch_ddp(fully_shard_v2_run, dist_env):
    """V2's standalone fully_shard: the embedding a unit with only frozen parameters (its backward
    hooks must still pair up: Megatron-LM PR #5710), a frozen layer beside a trained one in a block."""
    expected = _ddp_losses(dist_env, _adamw)
    run = fully_shard_v2_run(
        _net(), _adamw, _batches(dist_env.rank), _loss, units=lambda model: [model.embed, *model.blocks]
    )
    result = run.train(ITERS)
    assert_last_loss_finite(result)
    assert_loss_decreased(result)
    _assert_same(result.losses, expected, dist_env.platform, "V2 fully_shard, frozen parameters")
    _assert_frozen_kept(run.model)


# -- through megatron-core's wrapper, as Megatron-Bridge fine-tunes ----------------------------------


def _freeze_embeddings(model: torch.nn.Module) -> None:
    """A pre-wrap hook as PEFT's: the GPT's embeddings (word and position) frozen before the
    data-parallel wrapper sees the model."""
    frozen = [p for name, p in model.named_parameters() if ".embedding." in f".{name}"]
    assert frozen, [name for name, _ in model.named_parameters()]
    for param in frozen:
        param.requires_grad_(False)


def _local(param: torch.Tensor) -> torch.Tensor:
    """This rank's values of a parameter (a DTensor's local shard)."""
    return param.to_local() if hasattr(param, "to_local") else param


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("strategy", ["optim_grads_params", "optim_grads", "optim"])
def test_gpt_with_frozen_embeddings_matches_ddp(known_bug, megatron_fsdp_run, run_config, dist_env, strategy):
    """Megatron-Bridge's fine-tuning path: parameters frozen by a pre-wrap hook, then megatron-core's
    ``FullyShardedDataParallel`` and the distributed optimizer (Adam with weight decay). Against
    Megatron DDP frozen alike: the losses and grad norms (which count only trained parameters) equal
    DDP's, and every frozen parameter's local values are what they were when the model was wrapped,
    with no gradient asked for: a frozen parameter given to the optimizer would decay on each step."""
    from pytest_megatron_fsdp import ddp_baseline
    from pytest_megatron_fsdp.fsdp.parity import assert_matches_baseline

    known_bug(versions.FSDP_FROZEN_PARAMS_HOOK, raises=RuntimeError)
    run_config.ddp.data_parallel_sharding_strategy = strategy
    baseline = megatron_fsdp_run(ddp_baseline(run_config), pre_wrap_hook=_freeze_embeddings)
    expected = baseline.train(ITERS)
    baseline.close()
    run = megatron_fsdp_run(run_config, pre_wrap_hook=_freeze_embeddings)
    frozen_names = [name for name, p in run.model.named_parameters() if not p.requires_grad]
    assert any("embedding" in name for name in frozen_names), frozen_names
    # the wrapper's state dict holds each parameter's persistent shard (a module's parameter may
    # view a gathered bucket that is released and reused after the backward)
    before = _embedding_shards(run.model)
    assert before, sorted(run.model.state_dict())
    result = run.train(ITERS)
    assert_last_loss_finite(result)
    assert_loss_decreased(result)
    # CPU ranks: 'optim' reduces in Megatron-FSDP's own buffer layout, a few float32 ulps from DDP
    rel_tol = GPU_RTOL if dist_env.platform != "cpu" else (1e-6 if strategy == "optim" else 0.0)
    what = f"{strategy}, embeddings frozen"
    assert_matches_baseline(result.losses, expected.losses, rel_tol=rel_tol, what=what)
    assert_matches_baseline(
        result.grad_norms, expected.grad_norms, rel_tol=1e-5, what=what, metric="grad norm"
    )
    params = dict(run.model.named_parameters())
    assert not any(params[name].requires_grad for name in frozen_names), frozen_names
    after = _embedding_shards(run.model)
    moved = [name for name in before if not torch.equal(after[name], before[name])]
    assert not moved, f"frozen, yet moved: {moved}"


def _embedding_shards(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's shard of each embedding weight in the wrapper's state dict, copied."""
    return {
        name: _local(value).detach().clone()
        for name, value in model.state_dict().items()
        if ".embedding." in f".{name}" and isinstance(value, torch.Tensor)
    }
