"""A parameter of three dimensions through megatron-core's Megatron-FSDP: a convolution's weight, as
hybrid models have (Mamba's ``conv1d``: channels x 1 x kernel, depthwise, causal over the sequence).

Mamba's own layer needs ``mamba_ssm``'s CUDA kernels, so the tiny GPT is given the same convolution
by a pre-wrap hook (as Megatron-Bridge's pre-wrap hooks change a model before the wrapper sees it):
after the embedding, each channel convolved over the sequence and added back. Megatron-FSDP flattens
every parameter into its buckets; its state dict views each rank's shard of this weight as whole rows
(``(-1, 1, kernel)``, none on a rank whose shard holds none of it), and a checkpoint stores the weight
from those rows.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from pytest_megatron_fsdp import assert_last_loss_finite, assert_loss_decreased, ddp_baseline
from pytest_megatron_fsdp.checkpoint import (
    assert_states_equal,
    load_checkpoint,
    save_checkpoint,
    state_snapshot,
)
from pytest_megatron_fsdp.fsdp import versions
from pytest_megatron_fsdp.fsdp.parity import assert_matches_baseline

ITERS = 4
#: Mamba's default d_conv
KERNEL = 4
#: the convolution's parameter names, as the GPT holds them
CONV_WEIGHT, CONV_BIAS = "sequence_conv.weight", "sequence_conv.bias"

pytestmark = pytest.mark.distributed(world_size=2)


class SequenceConvolution(torch.nn.Conv1d):
    """Mamba's ``conv1d``: depthwise, causal (padded by ``kernel - 1``, cut back to the sequence),
    on Megatron's ``[sequence, batch, hidden]`` activations; added back to its input."""

    def __init__(self, channels: int, kernel: int) -> None:
        super().__init__(channels, channels, kernel, groups=channels, padding=kernel - 1)
        with torch.no_grad():  # the same values on every rank and in every run, whatever the RNG
            values = torch.linspace(-0.5, 0.5, self.weight.numel(), dtype=torch.float64)
            self.weight.copy_(values.reshape(self.weight.shape))
            self.bias.zero_()

    def residual(self, hidden: torch.Tensor) -> torch.Tensor:
        convolved = self.forward(hidden.permute(1, 2, 0))[..., : hidden.shape[0]]
        return hidden + convolved.permute(2, 0, 1)


def add_sequence_convolution(model: torch.nn.Module) -> None:
    """Pre-wrap hook: the GPT's embedding output goes through a :class:`SequenceConvolution`."""
    first = next(model.parameters())
    conv = SequenceConvolution(model.config.hidden_size, KERNEL).to(device=first.device, dtype=first.dtype)
    model.sequence_conv = conv
    model.embedding.register_forward_hook(lambda module, args, output: conv.residual(output))


def _conv_entries(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: value for name, value in state.items() if "sequence_conv." in name}


@pytest.mark.parametrize("strategy", ["optim_grads_params", "optim_grads", "optim", "no_shard"])
def test_a_convolution_weight_trains_as_under_ddp(
    known_bug, megatron_fsdp_run, run_config, dist_env, strategy
):
    """Every strategy's losses equal Megatron DDP's (bit for bit on CPU ranks; 'optim' within float32
    ulps: it reduces in Megatron-FSDP's own buffer layout), and the convolution's weight moved."""
    if strategy == "optim":
        known_bug(versions.OPTIM_OVERLAP_DOUBLE_COUNT)  # overlap_grad_reduce=True, the default
    run_config.ddp.data_parallel_sharding_strategy = strategy
    baseline = megatron_fsdp_run(ddp_baseline(run_config), pre_wrap_hook=add_sequence_convolution)
    expected = baseline.train(ITERS)
    baseline.close()
    run = megatron_fsdp_run(run_config, pre_wrap_hook=add_sequence_convolution)
    names = {name.removeprefix("module.").removeprefix("module.") for name, _ in run.model.named_parameters()}
    assert {CONV_WEIGHT, CONV_BIAS} <= names, sorted(names)
    before = {k: v.detach().clone() for k, v in _conv_entries(state_snapshot(run)).items()}
    result = run.train(ITERS)
    assert_last_loss_finite(result)
    assert_loss_decreased(result)
    rel_tol = 1e-5 if dist_env.platform != "cpu" else (1e-6 if strategy == "optim" else 0.0)
    assert_matches_baseline(result.losses, expected.losses, rel_tol=rel_tol, what=f"{strategy}, 3-D weight")
    after = _conv_entries(state_snapshot(run))
    weight = next(name for name in after if name.endswith(CONV_WEIGHT))
    assert after[weight].dim() == 3, after[weight].shape  # this rank's rows (none, where its shard is empty)
    # a shard may be empty on a rank: the weight moved on some rank
    moved = torch.tensor([float(not torch.equal(after[weight], before[weight]))])
    dist.all_reduce(moved, op=dist.ReduceOp.MAX)
    assert moved.item() == 1.0, "the convolution's weight did not train on any rank"


@pytest.mark.parametrize(
    "tp",
    [
        pytest.param(1, marks=pytest.mark.distributed(world_size=2)),
        # each layer split over both ranks, the convolution replicated on them (a data-parallel group of one)
        pytest.param(2, marks=pytest.mark.distributed(world_size=2, tp=2)),
        # both: Megatron-FSDP shards over the data-parallel pair of each tensor-parallel rank
        pytest.param(2, marks=pytest.mark.distributed(world_size=4, tp=2)),
    ],
    ids=["tp1", "tp2", "tp2-dp2"],
)
def test_a_convolution_weight_round_trips_through_a_checkpoint(
    known_bug, megatron_fsdp_run, run_config, checkpoint_dir, tp
):
    """Saved after training and loaded into a fresh run: every weight (the 3-D one whole) and the
    next loss as saved; also at tensor-parallel size 2."""
    if tp == 2:
        known_bug(versions.TENSOR_PARALLEL_WITHOUT_TE, raises=TypeError)
    assert run_config.model.tensor_model_parallel_size == tp
    run = megatron_fsdp_run(run_config, pre_wrap_hook=add_sequence_convolution)
    run.train(ITERS)
    save_checkpoint(run, checkpoint_dir)
    expected, before = state_snapshot(run), run.forward_loss()
    other = run_config.copy()
    other.train.seed = run_config.train.seed + 1
    fresh = megatron_fsdp_run(other, pre_wrap_hook=add_sequence_convolution)
    assert load_checkpoint(fresh, checkpoint_dir) == ITERS
    assert_states_equal(expected, state_snapshot(fresh))
    assert _conv_entries(expected), sorted(expected)
    assert fresh.forward_loss() == before
