"""The checkpoint layout of a V2 ``fully_shard`` run (:class:`.fully_shard_v2.FullyShardV2Run`):
the state dicts V2's own ``save_checkpoint`` writes, so an iteration directory this plugin saved
(verified, published atomically) is a checkpoint V2's ``load_checkpoint`` reads. (Not the other
way: a directory V2 wrote has no tracker or digests, which this plugin's load demands.)

V2's parameters rest as DTensor views over the optimizer's main weights; torch's DCP state-dict
helpers (``get_model_state_dict`` / ``get_optimizer_state_dict``) give them FQN-keyed, and V2's one
addition is the uneven-shard metadata (``preprocess_state_dict_for_uneven_dtensor``: a parameter
group's flat buffer does not tile like ``Shard(0)``). Loading is V2's: DCP fills the dicts, ``set_*``
reinstalls them, and the compute weights are refreshed from the loaded main weights; where the
optimizer has not stepped yet, its state is allocated for the load without moving a weight and
without changing the run before the load is accepted. Imports megatron when called (inside a rank
only)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import fully_shard_layout

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

    from .run import Run

#: Megatron-FSDP inside megatron-core (the standalone ``megatron_fsdp`` of a Megatron-LM checkout is
#: the same directory); V2 is its ``experimental`` package
V2_PACKAGE = "megatron.core.distributed.fsdp.src.megatron_fsdp"

checkpoint_dir = fully_shard_layout.checkpoint_dir
check = fully_shard_layout.check
local_save_state = fully_shard_layout.local_save_state
train_state_without_file = fully_shard_layout.train_state_without_file


@dataclass
class LoadState:
    state_dict: dict[str, Any]


def _state_dicts(run: Run) -> dict[str, Any]:
    """V2's ``save_checkpoint``'s state dicts (collective: the uneven-DTensor pass exchanges metadata)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    uneven = importlib.import_module(f"{V2_PACKAGE}.uneven_dtensor")
    model = get_model_state_dict(run.model)
    optimizer = get_optimizer_state_dict(run.model, run.optimizer)
    uneven.preprocess_state_dict_for_uneven_dtensor(model)
    uneven.preprocess_state_dict_for_uneven_dtensor(optimizer)
    return {"model": model, "optimizer": optimizer}


def save_state_dict(run: Run, local: None) -> dict[str, Any]:
    return _state_dicts(run)


def train_state(run: Run) -> dict[str, Any]:
    """As a V1 ``fully_shard`` run's, named for this layout."""
    return {**fully_shard_layout.train_state(run), "layout": "fully_shard_v2"}


def load_state_dict(run: Run, metadata: Metadata) -> LoadState:
    """What DCP loads into, built without changing the run (the checks before a load use it, and a
    refused load must leave the run as it was). Collective.

    An optimizer that has not stepped has no state to load into: it is allocated for the template
    (:func:`_allocate_state`), the template keeps those tensors, and the optimizer is given back
    with no state, as it was; :func:`apply_loaded` allocates it for real."""
    if run.optimizer.state:
        return LoadState(_state_dicts(run))
    try:
        _allocate_state(run.optimizer)
        return LoadState(_state_dicts(run))
    finally:
        run.optimizer.state.clear()


def _allocate_state(optimizer: Any) -> None:
    """Optimizer state for a load to fill, where there is none: V2's own helper (zero gradients of
    each parameter's ``grad_dtype``, where torch's would take the parameter's dtype, which V2
    refuses under mixed precision; then one step), with every learning rate 0 for that step, as
    torch's own helper does, so that no weight moves (weight decay included): the model's template
    tensors are its parameters, which DCP has filled by the time :func:`apply_loaded` runs."""
    if optimizer.state:
        return
    learning_rates = [group["lr"] for group in optimizer.param_groups]
    try:
        for group in optimizer.param_groups:
            group["lr"] = 0.0 * group["lr"]  # a tensor learning rate stays a tensor
        importlib.import_module(f"{V2_PACKAGE}.experimental.checkpoint")._init_optimizer_state(optimizer)
    finally:
        for group, lr in zip(optimizer.param_groups, learning_rates, strict=True):
            group["lr"] = lr


def apply_loaded(run: Run, loaded: LoadState, metadata: Metadata, train_state: dict[str, Any]) -> None:
    """V2's ``load_checkpoint`` after its ``dcp.load``: state allocated where there is none (its
    values are overwritten below), the state dicts installed, the compute weights refreshed from the
    loaded main weights."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    groups = importlib.import_module(f"{V2_PACKAGE}.experimental.parameter_group")
    _allocate_state(run.optimizer)
    set_model_state_dict(run.model, loaded.state_dict["model"])
    set_optimizer_state_dict(run.model, run.optimizer, loaded.state_dict["optimizer"])
    groups.sync_model_weights_from_main_weights(run.model.parameters())
    run.iteration = int(train_state["iteration"])
