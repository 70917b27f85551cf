"""HybridModel with every layer kind megatron-core builds without CUDA kernels or Transformer
Engine: the ``tiny-hybrid-moe`` preset, pattern ``*-*E`` (self-attention, MLP, self-attention, MoE
of 4 local experts, top-2 routing), under Megatron-FSDP V1 and, where megatron-core has it, V2,
against Megatron DDP on the same data.

Not built (``fsdp.model.hybrid_stack_spec`` says why): Mamba (``M``: mamba_ssm and causal-conv1d
CUDA kernels) and GDN (``G``: flash-linear-attention's Triton kernels); MLA (``+``) and DSA (``D``)
need an ``MLATransformerConfig`` and cannot share a pattern with ``*``. Where megatron-core has no
HybridModel (0.16.1) every case skips in one line.

The MoE layer's expert weights are reduced over the expert-data-parallel group, the other layers'
over the data-parallel group (the same 2 ranks here, expert parallelism 1): a wrapper that put the
experts in the wrong group or dropped their gradient leaves DDP's losses.
"""

import pytest

from pytest_megatron_fsdp import (
    assert_last_loss_finite,
    assert_loss_decreased,
    assert_matches_baseline,
    assert_megatron_fsdp_sharded,
    ddp_baseline,
)
from pytest_megatron_fsdp.fixtures import use_hybrid_model, use_megatron_fsdp_version

ITERS = 4
GPU_RTOL = 1e-4
#: 'optim' all-reduces in Megatron-FSDP's own buffer layout: a few float32 ulps from DDP on CPU
#: ranks (as for the GPT, test_strategies.py); the MoE's token permutation sums each token's two
#: experts in the same order in both runs
CPU_RTOL = {"optim": 1e-6}
#: the global grad norm against DDP's: squares summed shard by shard, then over the ranks (float32
#: order; as test_strategies.py)
GRAD_NORM_RTOL = 1e-5


def _inner_model(run):
    model = run.model
    while hasattr(model, "module"):
        model = model.module
    return model


def _layer_kinds(model) -> list[str]:
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.moe.moe_layer import MoELayer

    kinds = []
    for layer in model.decoder.layers:
        if isinstance(getattr(layer, "mlp", None), MoELayer):
            kinds.append(f"moe-{len(list(layer.mlp.experts.local_experts))}")
        elif isinstance(layer, MLPLayer):
            kinds.append("mlp")
        elif isinstance(getattr(layer, "self_attention", None), SelfAttention):
            kinds.append("attention")
        else:
            kinds.append(type(layer).__name__)
    return kinds


def _use_layer_kinds(run_config):
    use_hybrid_model(run_config)  # skips where megatron-core has no HybridModel
    run_config.model.preset = "tiny-hybrid-moe"


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize(
    ("version", "strategy"),
    [(1, "optim"), (1, "optim_grads_params"), (2, "optim_grads_params")],
    ids=["v1-optim", "v1-optim_grads_params", "v2-optim_grads_params"],
)
def test_hybrid_every_layer_kind_matches_ddp(megatron_fsdp_run, run_config, dist_env, version, strategy):
    """Attention, MLP and MoE layers in one HybridModel, sharded by Megatron-FSDP: the model is
    built in the pattern's order, every layer kind sharded, and the losses are Megatron DDP's (V1:
    the grad norms too; Adam hides most of a gradient's scale from the losses)."""
    _use_layer_kinds(run_config)
    use_megatron_fsdp_version(run_config, version)
    run_config.ddp.data_parallel_sharding_strategy = strategy
    baseline = megatron_fsdp_run(ddp_baseline(run_config))
    assert _layer_kinds(_inner_model(baseline)) == ["attention", "mlp", "attention", "moe-4"]
    expected = baseline.train(ITERS)
    baseline.close()  # one model-parallel state at a time; the next run re-initialises it, same seed
    run = megatron_fsdp_run(run_config)
    assert _layer_kinds(_inner_model(run)) == ["attention", "mlp", "attention", "moe-4"]
    assert_megatron_fsdp_sharded(run.model)
    result = run.train(ITERS)
    assert_last_loss_finite(result)
    assert_loss_decreased(result)
    rel_tol = GPU_RTOL if dist_env.platform != "cpu" else CPU_RTOL.get(strategy, 0.0)
    assert len(result.losses) == ITERS
    what = f"V{version} {strategy}, *-*E"
    assert_matches_baseline(result.losses, expected.losses, rel_tol=rel_tol, what=what)
    if version == 1:  # V2's grad norm is sqrt(dp) times DDP's (known bug v2_grad_norm_over_dp)
        assert_matches_baseline(
            result.grad_norms, expected.grad_norms, rel_tol=GRAD_NORM_RTOL, what=what, metric="grad norm"
        )
