"""The checkpoint layout of a ``fully_shard`` run (:class:`FullyShardRun`): the wrapped model's and
the wrapped optimizer's own state dicts, as Megatron-FSDP's DCP support writes them.

``fully_shard`` registers state-dict hooks that turn both into DTensors with the uneven-shard
metadata DCP needs (``preproc_state_dict_for_dcp_ckpt``, its default); loading goes through
``load_state_dict`` of both, whose post-load hook installs the loaded weights for the next forward.
The data position is the iteration: a run's batches are ``batches(iteration)`` when it should
resume where it stopped (an iterable cannot be rewound).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import versions
from .layout import FORMAT

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

    from .run import Run


@dataclass
class LoadState:
    state_dict: dict[str, Any]


def checkpoint_dir(run: Run, purpose: str) -> None:
    """None: a fully_shard run has no config naming a directory (the caller passes one)."""
    return None


def check(run: Run, purpose: str) -> None:
    """Nothing to refuse before the disk: no config (``fully_shard`` checked its arguments)."""
    return None


def local_save_state(run: Run) -> None:
    """Nothing to gather before the collectives: the state dicts are built in save_state_dict."""
    return None


def save_state_dict(run: Run, local: None) -> dict[str, Any]:
    """Collective (the uneven-DTensor hooks exchange shard metadata)."""
    return {"model": run.model.state_dict(), "optimizer": run.optimizer.state_dict()}


def train_state(run: Run) -> dict[str, Any]:
    """Plain data only, so that it loads with ``torch.load(weights_only=True)``."""
    return {
        "iteration": int(run.iteration),
        "ckpt_format": FORMAT,
        "layout": "fully_shard",
        "world_size": int(run.env.world_size),
        "sharding_strategy": run.facts().strategy,
        "saved_by": {
            "torch": versions.package_version("torch"),
            "megatron-fsdp": versions.package_version("megatron-fsdp"),
        },
    }


def train_state_without_file(iter_dir: Path, metadata: Metadata) -> None:
    """No other program writes this layout."""
    return None


def load_state_dict(run: Run, metadata: Metadata) -> LoadState:
    """What DCP loads into: this run's own state dicts (changes nothing until applied). Collective."""
    return LoadState({"model": run.model.state_dict(), "optimizer": run.optimizer.state_dict()})


def apply_loaded(run: Run, loaded: LoadState, metadata: Metadata, train_state: dict[str, Any]) -> None:
    # DCP filled both dicts' tensors in place (the optimizer's state is its own live tensors, so
    # its values are back already); load_state_dict still matters: the model's post-load hook
    # installs the loaded weights for the next forward, the optimizer's restores param_groups.
    run.model.load_state_dict(loaded.state_dict["model"])
    run.optimizer.load_state_dict(loaded.state_dict["optimizer"])
    run.iteration = int(train_state["iteration"])
