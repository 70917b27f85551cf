"""What an fsdp_dtensor checkpoint holds, read back whole from disk and compared with the run that
saved it: a round trip through the same code proves the save and the load agree with each other, not
that the file says what other readers (Megatron-LM, Bridge, an older release) will take it to say."""

from __future__ import annotations

import io

import pytest
import torch

from pytest_megatron_fsdp.checkpoint import save_checkpoint

pytestmark = pytest.mark.distributed(world_size=2)


def _whole_state_on_disk(iter_dir) -> dict:
    """Every tensor of a DCP checkpoint, whole, read in this process alone (DCP's own converter)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    buffer = io.BytesIO()
    dcp_to_torch_save(iter_dir, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)  # written by this test: pickles allowed


def _full(value) -> torch.Tensor:
    """A Megatron-FSDP parameter (a DTensor holding the flat slice ``megatron_fsdp_slice`` of the
    whole tensor on each rank), whole on every rank. Collective; torch's own gathers only."""
    from pytest_megatron_fsdp.fsdp.collectives import gather_objects

    piece = value.megatron_fsdp_slice
    parts = gather_objects((piece.start, piece.stop, value.to_local().detach().cpu().flatten()))
    whole = torch.full((value.numel(),), float("nan"), dtype=value.dtype)
    for start, stop, local in parts:
        whole[start:stop] = local[: stop - start]
    assert not whole.isnan().any(), "the ranks' slices do not cover the tensor"
    return whole.view(value.shape)


def test_swiglu_halves_on_disk_are_the_gate_and_the_linear_half(
    megatron_fsdp_run, run_config, checkpoint_dir
):
    """Megatron-LM's layout splits SwiGLU's linear_fc1 into ``_w`` (the first half of its output rows:
    the gated half, ``chunk(2)[0]``) and ``_v`` (the second); loading merges them again, so a split
    the wrong way round would round-trip exactly and still write a checkpoint every other reader
    misreads. Whole tensors on disk against the run's own weights; likewise an unsplit weight."""
    from pytest_megatron_fsdp.fsdp.megatron_layout import strip_wrappers

    run_config.model.overrides["swiglu"] = True
    run = megatron_fsdp_run(run_config)
    run.train(2)
    saved = save_checkpoint(run, checkpoint_dir)
    # the optimizer's parameters: Megatron-FSDP's sharded DTensors between steps
    params = {strip_wrappers(n): p for n, p in run.model.named_parameters()}
    fc1 = sorted(k for k in params if k.endswith("mlp.linear_fc1.weight"))
    fc2 = sorted(k for k in params if k.endswith("mlp.linear_fc2.weight"))
    assert fc1
    assert fc2
    weights = {k: _full(params[k]) for k in fc1 + fc2}  # every rank: collectives
    model_on_disk = _whole_state_on_disk(saved.path)["model"]
    disk = {strip_wrappers(k): v for k, v in model_on_disk.items()}
    for key in fc1:
        w, v = disk[f"{key}_w"], disk[f"{key}_v"]
        gate, linear = torch.chunk(weights[key], 2, dim=0)
        assert torch.equal(w, gate), f"{key}_w on disk is not the first half of {key}"
        assert torch.equal(v, linear), f"{key}_v on disk is not the second half of {key}"
    for key in fc2:
        assert torch.equal(disk[key], weights[key]), f"{key} on disk differs from the model's"


def test_every_rank_has_optimizer_state_for_the_same_parameters(megatron_fsdp_run, run_config):
    """megatron-core's own fsdp_dtensor optimizer state (what Megatron-LM's and Bridge's saves hand
    to ``preprocess_state_dict_for_uneven_dtensor``, one collective per DTensor) names the same
    parameters on every rank after training, as it does on GPUs (TE's FusedAdam makes state for
    every parameter, also one whose local shard is empty and gets no gradient). With torch's Adam
    on CPU ranks it named 7 parameters on one rank and 24 on the other, and a save hung."""
    from pytest_megatron_fsdp.fsdp import megatron_layout
    from pytest_megatron_fsdp.fsdp.collectives import gather_objects

    run = megatron_fsdp_run(run_config)
    run.train(2)
    model = megatron_layout.model_state_dict(run)
    own = run.optimizer.sharded_state_dict(
        model, is_loading=False, metadata=megatron_layout.OPTIMIZER_METADATA
    )
    names = sorted(own["state"])
    empty = [n for n, p in run.model.named_parameters() if p.requires_grad and p.to_local().numel() == 0]
    per_rank = gather_objects((names, empty))
    assert any(rank_empty for _, rank_empty in per_rank), "no rank has an empty shard: nothing shown"
    assert all(rank_names == per_rank[0][0] for rank_names, _ in per_rank), [len(n) for n, _ in per_rank]
    trainable = sum(1 for p in run.model.parameters() if p.requires_grad)
    assert len(names) == trainable, (len(names), trainable)
