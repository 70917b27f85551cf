"""Megatron-FSDP V2 checkpoints: the model's DTensor weights through torch Distributed Checkpoint
(DCP), as V2's own experimental ``save_checkpoint`` writes them (Megatron-LM PR #6024).

What megatron-core's V2 does not checkpoint, on Megatron-LM main of 2026-08-22:

* its optimizer wrapper, ``FullyShardedOptimizer``: ``state_dict``/``sharded_state_dict`` raise
  NotImplementedError ("MFSDP v2 optimizer checkpointing is not yet supported"), so Megatron-LM's
  fsdp_dtensor format (``fsdp.checkpoint``) does not apply;
* V2's experimental ``save_checkpoint(model, optimizer)`` on the torch optimizer inside it does not
  work either: ``get_megatron_optimizer`` leaves parameters whose local shard is empty out of each
  rank's parameter groups (a Transformer Engine FusedAdam workaround), so the ranks' optimizer
  state dicts hold different DTensors, and ``preprocess_state_dict_for_uneven_dtensor`` runs one
  ``all_gather_object`` per DTensor: the ranks pair different collectives and wait until the
  process-group timeout (measured on 2 CPU ranks with the tiny GPT: 7 and 24 of 28 parameters).

So these functions save and load the model state only, with the steps of V2's experimental
checkpoint (DCP's ``get_model_state_dict``, V2's uneven-DTensor chunk metadata, DCP save/load,
then the compute weights refreshed from the loaded main weights). Imports torch and megatron
(inside a rank only).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint import state_dict_loader, state_dict_saver
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor

if TYPE_CHECKING:
    from .training import TrainingRun


def v2_parts(run: TrainingRun) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The module V2 sharded (``fully_shard`` applied in place; the wrapper's ``module``) and the
    torch optimizer inside megatron-core's ``FullyShardedOptimizer``. The run's config says whether
    it is V2 (megatron-core builds ``FullyShardedDataParallelV2`` exactly then)."""
    cfg = run.cfg
    if not (cfg.uses_megatron_fsdp and cfg.ddp.megatron_fsdp_version == 2):
        raise TypeError(
            f"not a Megatron-FSDP V2 run (use_megatron_fsdp={cfg.uses_megatron_fsdp}, "
            f"ddp.megatron_fsdp_version={cfg.ddp.megatron_fsdp_version}): build it with "
            "ddp.megatron_fsdp_version=2"
        )
    return run.model.module, run.optimizer.optimizer


def _below_float16(module: torch.nn.Module) -> torch.nn.Module:
    """The model inside megatron-core's ``Float16Module`` (bf16 runs): its ``state_dict`` is the
    inner model's, without the ``module.`` prefix, so DCP's ``get_model_state_dict``, which walks
    the names from the module it is given, must be given the inner model (V2 shards the parameters
    in place: they are the inner model's all the same)."""
    from megatron.core.transformer.module import Float16Module

    return module.module if isinstance(module, Float16Module) else module


def _model_state(module: torch.nn.Module) -> dict[str, Any]:
    from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import (
        preprocess_state_dict_for_uneven_dtensor,
    )

    state = get_model_state_dict(_below_float16(module))
    # V2 packs several parameters into one flat buffer with row padding: a parameter's shards do
    # not tile like torch's Shard(0), and DCP must be told each shard's true offsets
    preprocess_state_dict_for_uneven_dtensor(state)
    return state


def save_dcp(run: TrainingRun, checkpoint_dir: str | os.PathLike[str]) -> None:
    """Save the run's V2 model weights as a DCP checkpoint (every rank calls it)."""
    module, _ = v2_parts(run)
    state_dict_saver.save({"model": _model_state(module)}, checkpoint_id=checkpoint_dir)


def load_dcp(run: TrainingRun, checkpoint_dir: str | os.PathLike[str]) -> None:
    """Load a :func:`save_dcp` checkpoint into ``run`` (same model; DCP reshards to this mesh); the
    compute weights are refreshed from the loaded main weights, as V2's own load does."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp.experimental.parameter_group import (
        sync_model_weights_from_main_weights,
    )

    module, _ = v2_parts(run)
    state = _model_state(module)
    state_dict_loader.load({"model": state}, checkpoint_id=checkpoint_dir)
    set_model_state_dict(_below_float16(module), state)
    sync_model_weights_from_main_weights(module.parameters())


def optimizer_checkpoint_problem(run: TrainingRun) -> str | None:
    """Why V2's optimizer state cannot be checkpointed here, in one line (None: its wrapper gives
    a state dict, which this module does not round-trip yet: extend it)."""
    try:
        run.optimizer.state_dict()
    except NotImplementedError as exc:
        return f"{type(run.optimizer).__name__}.state_dict() raises NotImplementedError: {exc}"
    return None


def v2_state_snapshot(run: TrainingRun) -> dict[str, torch.Tensor]:
    """This rank's shards of every V2 parameter (``model.<name>``) and optimizer state tensor
    (``optimizer.<name>.<state>``), copied."""
    module, optimizer = v2_parts(run)
    names = {id(p): n for n, p in module.named_parameters()}
    snapshot: dict[str, torch.Tensor] = {}

    def local(value: torch.Tensor) -> torch.Tensor:
        return (value.to_local() if isinstance(value, DTensor) else value).detach().cpu().clone()

    for name, parameter in module.named_parameters():
        snapshot[f"model.{name}"] = local(parameter)
    for state_key, state in optimizer.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                snapshot[f"optimizer.{names.get(id(state_key), '?')}.{key}"] = local(value)
    return snapshot
