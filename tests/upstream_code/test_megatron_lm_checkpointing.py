"""Megatron-LM's own fsdp_dtensor checkpointing (``megatron/training/checkpointing.py``:
``save_checkpoint``, ``load_checkpoint``) on CPU ranks, wherever ``megatron.training`` is importable
(megatron-core's wheels from 0.19 on; a Megatron-LM checkout).

The run is the plugin's own (``megatron_fsdp_run``: the GPT wrapped with Megatron-FSDP as Bridge wraps
it, megatron-core's optimizer and scheduler); Megatron-LM's global arguments come from Megatron-LM's own
parser and ``validate_args``, given the command line a Megatron-LM user passes for that same model
(``mlm_args.command_line``). It runs in the foreign-suite mode as the Bridge module beside it does:
``validate_args`` asks the CUDA device for its architecture, a question only the foreign layer answers
on CPU ranks (as an A100 would).

Megatron-LM's loop puts its data iterator back from the checkpoint's consumed-samples count; the
plugin's data stream is its own, so a run that loads takes the saving run's data-stream state by hand,
as Megatron-LM's loop would take its position. Everything else (weights, optimizer state, scheduler,
RNG) comes from the checkpoint.
"""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from dcp_files import (
    SECOND_LAYER,
    damaged,
    differences,
    drop_the_second_layer,
    iteration_dir,
    remove_a_shard,
    remove_the_metadata,
    tensors,
    truncate_a_shard,
)
from torch.distributed.checkpoint.api import CheckpointException

from pytest_megatron_fsdp.checkpoint import (
    CheckpointWarning,
    fingerprint_differences,
    load_checkpoint,
    save_checkpoint,
    state_fingerprint,
)
from pytest_megatron_fsdp.fixtures import use_megatron_fsdp_version
from pytest_megatron_fsdp.fsdp import versions

if not versions.megatron_lm_training_installed():
    pytest.skip(
        "megatron.training (Megatron-LM's checkpointing) is not importable: megatron-core 0.16's wheel does "
        "not ship it (0.19's does, and a Megatron-LM checkout: MEGATRON_CORE='-e PATH')",
        allow_module_level=True,
    )

from mlm_args import load, save

pytestmark = pytest.mark.distributed(world_size=2)

STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
SAVED_AT = 3
MORE = 2


def rngs() -> tuple[Any, ...]:
    """This process's global RNG states (torch, Python, NumPy), comparable with ==."""
    return torch.get_rng_state().tolist(), random.getstate(), np.random.get_state()[1].tolist()


def other_seed(cfg: Any) -> Any:
    other = cfg.copy()
    other.train.seed = cfg.train.seed + 1
    return other


#: (strategy, bf16, Megatron-FSDP version): every strategy in fp32, bf16 once, V2 where megatron-core has it
CASES = [(strategy, False, 1) for strategy in STRATEGIES] + [
    ("optim_grads_params", True, 1),
    ("optim_grads_params", False, 2),
]


@pytest.mark.parametrize(
    ("strategy", "bf16", "version"),
    CASES,
    ids=[f"{s}-{'bf16' if b else 'fp32'}{'-v2' if v == 2 else ''}" for s, b, v in CASES],
)
def test_resume_through_megatron_lms_checkpointing_is_exact(
    megatron_fsdp_run, run_config, megatron_lm_args, checkpoint_dir, strategy, bf16, version, request
):
    """Train 3 iterations, ``save_checkpoint``, train 2 more and save again; a fresh run (another seed)
    ``load_checkpoint``s iteration 3: the whole state as saved, the RNG as saved, then the same 2
    losses and an iteration-5 checkpoint equal to the uninterrupted run's in every tensor."""
    use_megatron_fsdp_version(run_config, version)
    bug = versions.MLM_V2_OPTIMIZER_CHECKPOINT
    if version == 2 and bug.present():
        request.applymarker(
            pytest.mark.xfail(strict=True, raises=NotImplementedError, reason=versions.xfail_reason(bug))
        )
    run_config.ddp.data_parallel_sharding_strategy = strategy
    run_config.model.bf16 = bf16
    whole = megatron_fsdp_run(run_config)
    whole.train(SAVED_AT)
    megatron_lm_args(whole, checkpoint_dir / "whole")
    save(whole)
    expected, expected_rngs, stream = state_fingerprint(whole), rngs(), whole.data_stream_state().clone()
    scheduler = whole.scheduler.state_dict()
    rest = whole.train(MORE).losses
    save(whole)

    fresh = megatron_fsdp_run(other_seed(run_config))
    assert fingerprint_differences(expected, state_fingerprint(fresh)) != []  # it starts elsewhere
    assert rngs() != expected_rngs
    megatron_lm_args(
        fresh, checkpoint_dir / "resumed", checkpoint_dir / "whole", "--ckpt-step", str(SAVED_AT)
    )
    assert load(fresh) == SAVED_AT
    assert fingerprint_differences(expected, state_fingerprint(fresh)) == []
    assert rngs() == expected_rngs
    assert fresh.scheduler.state_dict() == scheduler
    fresh.iteration = SAVED_AT
    fresh.load_data_stream_state(stream)
    assert fresh.train(MORE).losses == rest
    save(fresh)
    whole_files = tensors(iteration_dir(checkpoint_dir / "whole", SAVED_AT + MORE))
    assert any(".exp_avg" in key for key in whole_files), sorted(whole_files)
    assert differences(whole_files, tensors(iteration_dir(checkpoint_dir / "resumed", SAVED_AT + MORE))) == []


#: model shapes users train, each on the tiny GPT: (id, preset fields changed)
SHAPES = {
    # grouped-query attention, untied embeddings, RMSNorm, RoPE, no biases: a Llama without its SwiGLU
    "gqa-untied-rope": {
        "num_query_groups": 2,
        "untie_embeddings_and_output_weights": True,
        "normalization": "RMSNorm",
        "position_embedding_type": "rope",
        "add_bias_linear": False,
    },
    "swiglu": {"swiglu": True},
    # routed experts (local, no Transformer Engine) in a HybridModel: attention, MLP, attention, MoE
    "moe": {"preset": "tiny-hybrid-moe"},
}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_resume_of_the_model_shapes_users_train_is_exact(
    megatron_fsdp_run, run_config, megatron_lm_args, checkpoint_dir, shape, request
):
    """The resume above (optim_grads_params, fp32) for other shapes: Megatron-LM's checkpoint handlers
    split SwiGLU's ``linear_fc1`` (a strict xfail where megatron-core's handler cannot find a
    Megatron-FSDP model's parameters: :data:`versions.SWIGLU_HANDLER_LOOKUP`)."""
    bug = versions.SWIGLU_HANDLER_LOOKUP
    if SHAPES[shape].get("swiglu") and bug.present():
        request.applymarker(
            pytest.mark.xfail(strict=True, raises=AttributeError, reason=versions.xfail_reason(bug))
        )
    _assert_resume_is_exact(megatron_fsdp_run, run_config, megatron_lm_args, checkpoint_dir, SHAPES[shape])


@pytest.mark.distributed(world_size=2, tp=2)
@pytest.mark.parametrize("shape", ["tiny", "gqa-untied-rope"])
def test_resume_at_tensor_parallel_2_is_exact(
    megatron_fsdp_run, run_config, megatron_lm_args, checkpoint_dir, shape, request
):
    """The same resume with each layer split over 2 tensor-parallel ranks (a data-parallel group of
    one: Megatron-FSDP shards nothing, its buffers and Megatron-LM's checkpoint carry the TP shards)."""
    bug = versions.TENSOR_PARALLEL_WITHOUT_TE
    if bug.present():
        request.applymarker(
            pytest.mark.xfail(strict=True, raises=TypeError, reason=versions.xfail_reason(bug))
        )
    assert run_config.model.tensor_model_parallel_size == 2
    _assert_resume_is_exact(
        megatron_fsdp_run, run_config, megatron_lm_args, checkpoint_dir, SHAPES.get(shape, {})
    )


def _assert_resume_is_exact(
    megatron_fsdp_run: Any,
    run_config: Any,
    megatron_lm_args: Any,
    checkpoint_dir: Path,
    shape: dict[str, Any],
) -> None:
    """Train, ``save_checkpoint``, train on; a fresh run (another seed) loads: the saved state, then the
    same losses."""
    fields = dict(shape)
    if "preset" in fields:
        run_config.model.preset = fields.pop("preset")
    run_config.model.overrides.update(fields)
    whole = megatron_fsdp_run(run_config)
    whole.train(SAVED_AT)
    megatron_lm_args(whole, checkpoint_dir)
    save(whole)
    expected, stream = state_fingerprint(whole), whole.data_stream_state().clone()
    rest = whole.train(MORE).losses

    fresh = megatron_fsdp_run(other_seed(run_config))
    megatron_lm_args(fresh, None, checkpoint_dir, "--ckpt-step", str(SAVED_AT))
    assert load(fresh) == SAVED_AT
    assert fingerprint_differences(expected, state_fingerprint(fresh)) == []
    fresh.iteration = SAVED_AT
    fresh.load_data_stream_state(stream)
    assert fresh.train(MORE).losses == rest


@pytest.mark.parametrize("loaded_into", ["optim_grads", "optim", "no_shard"])
def test_megatron_lms_checkpoint_loads_into_another_sharding_strategy(
    megatron_fsdp_run, run_config, megatron_lm_args, checkpoint_dir, loaded_into
):
    whole = megatron_fsdp_run(run_config)
    whole.train(SAVED_AT)
    megatron_lm_args(whole, checkpoint_dir)
    save(whole)
    expected = state_fingerprint(whole)

    target = other_seed(run_config)
    target.ddp.data_parallel_sharding_strategy = loaded_into
    fresh = megatron_fsdp_run(target)
    megatron_lm_args(fresh, None, checkpoint_dir)
    assert load(fresh) == SAVED_AT
    assert fingerprint_differences(expected, state_fingerprint(fresh)) == []


def test_a_fine_tune_load_gives_the_saved_weights_from_the_first_step(
    megatron_fsdp_run, run_config, megatron_lm_args, checkpoint_dir
):
    """``--finetune --no-load-optim --no-load-rng``: the saved weights, neither optimizer state nor RNG
    nor iteration. The first forward pass already sees them (Megatron-Bridge #3397: an FSDP load took
    effect only from step 2)."""
    whole = megatron_fsdp_run(run_config)
    whole.train(SAVED_AT)
    megatron_lm_args(whole, checkpoint_dir)
    save(whole)
    expected = state_fingerprint(whole)
    stream = whole.data_stream_state().clone()
    before = whole.forward_loss()

    fresh = megatron_fsdp_run(other_seed(run_config))
    own_rngs = rngs()
    megatron_lm_args(fresh, None, checkpoint_dir, "--finetune", "--no-load-optim", "--no-load-rng")
    assert load(fresh) == 0
    assert rngs() == own_rngs
    found = fingerprint_differences(expected, state_fingerprint(fresh))
    assert found, "the optimizer state was loaded too"
    assert all(key.startswith("optimizer.") for key in found), found
    fresh.load_data_stream_state(stream)
    assert fresh.forward_loss() == before


def test_megatron_lm_loads_the_plugins_checkpoint(
    megatron_fsdp_run, run_config, megatron_lm_args, checkpoint_dir
):
    """The plugin's verified save (``pytest_megatron_fsdp.checkpoint``), read by Megatron-LM's loader:
    the same layout, so the same state and the same next losses."""
    whole = megatron_fsdp_run(run_config)
    whole.train(SAVED_AT)
    save_checkpoint(whole, checkpoint_dir)
    expected = state_fingerprint(whole)
    rest = whole.train(MORE).losses

    fresh = megatron_fsdp_run(other_seed(run_config))
    megatron_lm_args(fresh, None, checkpoint_dir)
    assert load(fresh) == SAVED_AT
    assert fingerprint_differences(expected, state_fingerprint(fresh)) == []
    fresh.iteration = SAVED_AT
    fresh.load_data_stream_state(load_checkpoint_stream(checkpoint_dir))
    assert fresh.train(MORE).losses == rest


def load_checkpoint_stream(root: Path) -> torch.Tensor:
    """This rank's data-stream state from the plugin's checkpoint under ``root`` (its own key,
    ``data_stream.dp_rank_<d>``, which Megatron-LM's loader leaves alone)."""
    keys = tensors(iteration_dir(root, SAVED_AT))
    return keys[f"data_stream.dp_rank_{dist.get_rank()}"]


def test_the_plugin_loads_megatron_lms_checkpoint(
    megatron_fsdp_run, run_config, megatron_lm_args, checkpoint_dir
):
    """Megatron-LM's ``save_checkpoint``, read by the plugin's loader: the same state."""
    whole = megatron_fsdp_run(run_config)
    whole.train(SAVED_AT)
    megatron_lm_args(whole, checkpoint_dir)
    save(whole)
    expected, expected_rngs, stream = state_fingerprint(whole), rngs(), whole.data_stream_state().clone()

    rest = whole.train(MORE).losses

    fresh = megatron_fsdp_run(other_seed(run_config))
    with pytest.warns(CheckpointWarning, match=r"iter_0000003 has no digests\.json .* not verified"):
        assert load_checkpoint(fresh, checkpoint_dir) == SAVED_AT
    assert fingerprint_differences(expected, state_fingerprint(fresh)) == []
    assert rngs() == expected_rngs
    fresh.load_data_stream_state(stream)
    assert fresh.train(MORE).losses == rest


# -- refusals ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("damage", "refusal", "says"),
    [
        (truncate_a_shard, CheckpointException, "EOFError|failed reading zip archive"),
        (remove_a_shard, CheckpointException, "No such file or directory"),
        # Megatron-LM's own refusal of a directory without DCP metadata (its format detection)
        (remove_the_metadata, NotImplementedError, "unknown checkpoint format"),
    ],
    ids=["truncated-shard", "missing-shard", "missing-metadata"],
)
def test_a_damaged_checkpoint_is_refused_by_megatron_lms_loader(
    megatron_fsdp_run, run_config, megatron_lm_args, checkpoint_dir, damage, refusal, says
):
    """Every rank refuses it, naming the damage (DCP's CheckpointException is a BaseException)."""
    whole = megatron_fsdp_run(run_config)
    whole.train(SAVED_AT)
    megatron_lm_args(whole, checkpoint_dir / "whole")
    save(whole)
    broken = damaged(checkpoint_dir / "whole", checkpoint_dir / "damaged", SAVED_AT, damage)

    fresh = megatron_fsdp_run(other_seed(run_config))
    megatron_lm_args(fresh, None, broken)
    with pytest.raises(refusal) as refused:
        load(fresh)
    assert re.search(says, str(refused.value)), refused.value


@pytest.fixture
def partial_checkpoint(megatron_fsdp_run, run_config, megatron_lm_args, checkpoint_dir) -> Path:
    """Megatron-LM's checkpoint of a run, with the second layer's entries dropped from its metadata."""
    whole = megatron_fsdp_run(run_config)
    whole.train(SAVED_AT)
    megatron_lm_args(whole, checkpoint_dir / "whole")
    save(whole)
    return damaged(checkpoint_dir / "whole", checkpoint_dir / "partial", SAVED_AT, drop_the_second_layer)


def test_a_checkpoint_lacking_model_weights_is_refused(
    megatron_fsdp_run, run_config, megatron_lm_args, partial_checkpoint
):
    """Megatron-LM's default (``strict_fsdp_dtensor_load``): DCP refuses a checkpoint that lacks a
    weight the model has (a BaseException, on every rank)."""
    fresh = megatron_fsdp_run(other_seed(run_config))
    megatron_lm_args(fresh, None, partial_checkpoint)
    with pytest.raises(CheckpointException) as refused:
        load(fresh)
    assert SECOND_LAYER in str(refused.value), refused.value


def test_a_checkpoint_lacking_model_weights_is_refused_without_strict_loading(
    megatron_fsdp_run, run_config, megatron_lm_args, partial_checkpoint, request
):
    """``--no-strict-fsdp-dtensor-load`` allows a partial load, but a resume (not a fine-tune) from a
    checkpoint lacking model weights must not go on with them at their initial values."""
    bug = versions.MLM_PARTIAL_FSDP_DTENSOR_LOAD
    if bug.present():
        request.applymarker(pytest.mark.xfail(strict=True, reason=versions.xfail_reason(bug)))
    fresh = megatron_fsdp_run(other_seed(run_config))
    megatron_lm_args(fresh, None, partial_checkpoint, "--no-strict-fsdp-dtensor-load")
    with pytest.raises((Exception, CheckpointException)) as refused:
        load(fresh)
    assert SECOND_LAYER in str(refused.value), refused.value


def test_a_checkpoint_of_another_model_shape_is_refused(
    megatron_fsdp_run, run_config, megatron_lm_args, checkpoint_dir
):
    """A 1-layer model's checkpoint into a 2-layer model: refused before anything is loaded, naming
    the first weight the checkpoint lacks."""
    one_layer = run_config.copy()
    one_layer.model.overrides["num_layers"] = 1
    saved = megatron_fsdp_run(one_layer)
    saved.train(SAVED_AT)
    megatron_lm_args(saved, checkpoint_dir)
    save(saved)
    fresh = megatron_fsdp_run(other_seed(run_config))
    megatron_lm_args(fresh, None, checkpoint_dir)
    with pytest.raises(CheckpointException) as refused:
        load(fresh)
    assert SECOND_LAYER in str(refused.value), refused.value
