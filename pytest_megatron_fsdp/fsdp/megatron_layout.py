"""The fsdp_dtensor state dict in Megatron-LM's layout, and the run's state going in and out of it.

Megatron-LM (``megatron/training/checkpointing.py``) and Megatron-Bridge save, for
``ckpt_format="fsdp_dtensor"``::

    checkpoint_version   3.0
    iteration            the iteration
    model                the wrapped model's DTensor state dict, then megatron-core's handlers
                         (``megatron/core/transformer/fsdp_dtensor_checkpoint.py``): Transformer
                         Engine's ``_extra_state`` dropped, SwiGLU ``linear_fc1`` split into ``_w``/``_v``,
                         expert indices made global
    optimizer            ``DistributedOptimizer.sharded_state_dict(metadata={"distrib_optim_sharding_type":
                         "fsdp_dtensor"})``, through the same handlers
    rng_state            ``{"(<pp rank>, <tp rank>)": [<rng state>]}``: Python's, NumPy's, torch's, CUDA's
                         RNG and Megatron's RNG tracker; one entry when the data-parallel ranks agree, one
                         per data-parallel rank when they do not (Megatron-LM's data_parallel_random_init)

then ``preprocess_state_dict_for_uneven_dtensor``. This module builds exactly that by calling
megatron-core's handlers, and adds one key of its own that Megatron-LM's partial loads ignore:
``data_stream.dp_rank_<d>``, each data-parallel rank's data-generator state.

What the layout means for a change of data-parallel size: see :func:`restore_run_state`.

Imports torch and megatron-core (loaded only inside a rank).
"""

from __future__ import annotations

import argparse
import hashlib
import random
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import state_dict_loader
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.tensor import DTensor

from . import versions
from .config import validate
from .layout import BRIDGE_RUN_CONFIG_FILE, FORMAT, CheckpointError, CheckpointWarning

if TYPE_CHECKING:
    from .run import MegatronCoreRun

OPTIMIZER_METADATA = {"distrib_optim_sharding_type": FORMAT}
#: Megatron-LM's and Bridge's ``state_dict["checkpoint_version"]``
CHECKPOINT_VERSION = 3.0
#: the layouts a checkpoint on disk may have
MEGATRON_LM = "megatron-lm"
#: this harness's layout before checkpoint digests existed: RNG and data stream per global rank
#: under ``rng_state.rank_<r>``, Transformer Engine's ``_extra_state`` kept, SwiGLU not split
LEGACY = "legacy"


def strip_wrappers(name: str) -> str:
    """A parameter's or state-dict key's name below every wrapper: ``module.module.decoder...`` ->
    ``decoder...`` (the data-parallel wrapper, Megatron-FSDP and Float16Module each add ``module.``)."""
    while name.startswith("module."):
        name = name[len("module.") :]
    return name


def model_state_dict(run: MegatronCoreRun) -> dict[str, Any]:
    """The wrapped model's DTensor state dict, as Megatron-LM takes it for fsdp_dtensor."""
    state: dict[str, Any] = run.model.state_dict_for_save_checkpoint()
    return state


def optimizer_state_dict(
    run: MegatronCoreRun, model: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The optimizer's fsdp_dtensor state dict, and the same with one key space on every rank.

    A run that has not stepped yet has no optimizer state at all, and an optimizer that keeps
    state only for parameters with a gradient (torch's Adam; CPU ranks install one that keeps it
    for all, as Transformer Engine's FusedAdam does: ``emulation/fused_adam.py``) has none for a
    parameter whose local shard is empty, so each rank's ``state`` may name different parameters.
    DCP and ``preprocess_state_dict_for_uneven_dtensor`` need every rank to present the same
    DTensor keys in the same order (they run collectives per key); ranks add a zero placeholder,
    sharded like the parameter, for every parameter without state. Returns (the optimizer's own
    dict, the dict to hand to DCP);
    their per-parameter entries are shared.

    Megatron-LM asks with ``is_loading=True`` before a load, which takes a dummy optimizer step so
    that Adam's state exists to load into; that step changes the run (weight decay, Adam's
    moments) before the checkpoint is even checked. The placeholders are loaded into instead and
    handed to the optimizer afterwards (:func:`install_optimizer_state`), so a refused load
    changes nothing.
    """
    own = run.optimizer.sharded_state_dict(model, is_loading=False, metadata=OPTIMIZER_METADATA)
    state = own["state"]
    template = next((v for v in state.values() if isinstance(v, dict) and "exp_avg" in v), None)
    shards = {strip_wrappers(k): v for k, v in model.items() if isinstance(v, DTensor)}
    uniform: dict[str, Any] = {}
    for name, param in run.model.named_parameters():
        if not param.requires_grad:
            continue
        if name in state:
            uniform[name] = state[name]
            continue
        shard = shards.get(strip_wrappers(name))
        if shard is None:
            raise CheckpointError(f"parameter {name} has no DTensor in the model state dict")
        step = template["step"].clone() if template is not None else torch.zeros((), dtype=torch.float32)
        dtype = template["exp_avg"].dtype if template is not None else torch.float32
        uniform[name] = {
            "step": step,
            "exp_avg": torch.zeros_like(shard, dtype=dtype),
            "exp_avg_sq": torch.zeros_like(shard, dtype=dtype),
        }
    for name in state.keys() - uniform.keys():
        uniform[name] = state[name]
    return own, {"state": uniform, "param_to_group_meta": own["param_to_group_meta"]}


# --------------------------------------------------------------------------------------------
# RNG and data stream


def parallel_ranks() -> tuple[int, int, int, int]:
    """(pipeline rank, tensor rank, data-parallel rank, data-parallel size) of this rank."""
    from megatron.core import parallel_state

    return (
        parallel_state.get_pipeline_model_parallel_rank(),
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_data_parallel_rank(),
        parallel_state.get_data_parallel_world_size(),
    )


def rng_key(pp_rank: int, tp_rank: int) -> str:
    """Megatron-LM's key for a model-parallel rank's RNG states: ``"(0, 1)"``."""
    return f"({pp_rank}, {tp_rank})"


def local_rng_state() -> dict[str, Any]:
    """This process's RNG states, as Megatron-LM's ``get_rng_state`` collects them.

    On CPU ranks the CUDA emulation's ``torch.cuda.get_rng_state`` is the CPU generator's, so the
    layout (and the key set) is the same as on GPUs.
    """
    from megatron.core import tensor_parallel

    return {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "cuda_rng_state": torch.cuda.get_rng_state(),
        "rng_tracker_states": {
            name: state.cpu() for name, state in tensor_parallel.get_cuda_rng_tracker().get_states().items()
        },
    }


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return bool(np.array_equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def gathered_rng_states(state: dict[str, Any]) -> list[dict[str, Any]]:
    """Collective over the data-parallel group: ``[state]`` when every data-parallel rank's RNG
    states are the same (Megatron-LM's default layout), else every data-parallel rank's, in order."""
    from megatron.core import parallel_state

    group = parallel_state.get_data_parallel_group()
    states: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(states, state, group=group)
    return [state] if all(_same(states[0], s) for s in states[1:]) else states


def data_stream_reseed(seed: int, iteration: int, dp_rank: int) -> int:
    """The data-generator seed of ``dp_rank`` after a load at another data-parallel size."""
    text = f"mfsdp-data-stream:{seed}:{iteration}:{dp_rank}".encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "little") >> 1


# --------------------------------------------------------------------------------------------
# the layout


def _resolving_model(model: torch.nn.Module) -> Any:
    """The wrapped model as megatron-core's state-dict handlers expect to see it.

    The handlers look parameters up with ``model.get_parameter`` by adding or removing one
    ``module.`` to a state-dict key; that fits only one nesting of wrappers. Here (as in
    Megatron-LM and Bridge) the optimizer's names carry one ``module.`` per wrapper and the model's
    keys one, and a bf16 model has a Float16Module in between, so the lookups miss on megatron-core
    0.16.1 and 0.19.2 (AttributeError: ``MegatronFSDP has no attribute decoder``). This view resolves
    a name below all wrappers; everything else is the model's. Build it after ``state_dict()``:
    Megatron-FSDP swaps the distributed parameters in there.
    """

    class _Resolving:
        def __init__(self) -> None:
            self.config = model.config
            self.module = model
            self._params: dict[str, torch.nn.Parameter] = {}
            for name, param in model.named_parameters():
                self._params.setdefault(strip_wrappers(name), param)

        def named_modules(self, *args: Any, **kwargs: Any) -> Any:
            return model.named_modules(*args, **kwargs)

        def get_parameter(self, target: str) -> torch.nn.Parameter:
            try:
                return self._params[strip_wrappers(target)]
            except KeyError:
                raise AttributeError(f"{type(model).__name__} has no parameter {target!r}") from None

    return _Resolving()


def apply_megatron_lm_handlers(run: MegatronCoreRun, state_dict: dict[str, Any]) -> None:
    """Megatron-LM's ``preprocess_fsdp_dtensor_state_dict`` on ``state_dict`` (in place), without the
    final ``preprocess_state_dict_for_uneven_dtensor``. Collective (the handlers build DTensors)."""
    handlers = versions.megatron_lm_fsdp_dtensor_handlers()
    if handlers is None:
        raise CheckpointError(versions.NO_MEGATRON_LM_LAYOUT)
    handlers.drop_extra_state(state_dict["model"])
    config = run.model.config
    if getattr(config, "gated_linear_unit", False):
        model, optimizer = handlers.split_swiglu(
            _resolving_model(run.model), state_dict["model"], state_dict.get("optimizer")
        )
        state_dict["model"] = model
        if "optimizer" in state_dict:
            state_dict["optimizer"] = optimizer
    num_experts = getattr(config, "num_moe_experts", None)
    if num_experts:
        state_dict["model"] = handlers.globalize_experts(state_dict["model"], num_experts)


def preprocess_uneven(state_dict: dict[str, Any]) -> None:
    """Megatron-FSDP's chunk metadata for unevenly sharded DTensors (a collective per DTensor)."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import (
        preprocess_state_dict_for_uneven_dtensor,
    )

    preprocess_state_dict_for_uneven_dtensor(state_dict)


@dataclass
class SaveState:
    """What a rank saves, gathered before any collective (so a failure there leaves nobody waiting)."""

    model: dict[str, Any]
    optimizer: dict[str, Any]
    rng: dict[str, Any]
    data_stream: torch.Tensor


def local_save_state(run: MegatronCoreRun) -> SaveState:
    """No collectives, no changes to the run."""
    model = model_state_dict(run)
    _, optimizer = optimizer_state_dict(run, model)
    return SaveState(model, optimizer, local_rng_state(), run.data_stream_state())


def save_state_dict(run: MegatronCoreRun, local: SaveState) -> dict[str, Any]:
    """The DCP state dict to save, in Megatron-LM's layout, preprocessed. Collective."""
    pp_rank, tp_rank, dp_rank, _ = parallel_ranks()
    state_dict = {
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": int(run.iteration),
        "model": dict(local.model),
        "optimizer": local.optimizer,
        "rng_state": {rng_key(pp_rank, tp_rank): gathered_rng_states(local.rng)},
        "data_stream": {f"dp_rank_{dp_rank}": local.data_stream},
        # what Megatron-LM's load_checkpoint reads besides the state (it refuses a checkpoint
        # without "args"); this plugin's own loader reads its train_state.pt instead
        "args": megatron_lm_arguments(run),
        "num_floating_point_operations_so_far": 0,
    }
    if run.scheduler is not None:
        state_dict["opt_param_scheduler"] = run.scheduler.state_dict()
    apply_megatron_lm_handlers(run, state_dict)
    preprocess_uneven(state_dict)
    return state_dict


def checkpoint_dir(run: MegatronCoreRun, purpose: str) -> str | None:
    """``checkpoint.save`` or ``checkpoint.load`` of the run's config."""
    return run.cfg.checkpoint.save if purpose == "save" else run.cfg.checkpoint.load


def check(run: MegatronCoreRun, purpose: str) -> None:
    """The config's checkpoint rules (``validate(purpose=...)``): ConfigError before the disk is touched."""
    validate(run.cfg, run.env.world_size, purpose=purpose)


def bridge_train_state(step: int, consumed_train_samples: int) -> dict[str, torch.Tensor]:
    """Megatron-Bridge's ``TrainState.state_dict()`` after ``step`` training iterations, for Bridge's
    loader (it reads ``train_state.pt`` with ``TrainState.load_state_dict``, which takes these
    entries and ignores the others)."""
    return {
        "step": torch.tensor(step, dtype=torch.int64),
        "consumed_train_samples": torch.tensor(consumed_train_samples, dtype=torch.int64),
        "skipped_train_samples": torch.tensor(0, dtype=torch.int64),
        "consumed_valid_samples": torch.tensor(0, dtype=torch.int64),
        "floating_point_operations_so_far": torch.tensor(0.0, dtype=torch.float64),
        "do_train": torch.tensor(True),
        "do_valid": torch.tensor(False),
        "do_test": torch.tensor(False),
    }


def train_state(run: MegatronCoreRun) -> dict[str, Any]:
    """Plain data only, so that it loads with ``torch.load(weights_only=True)``; Bridge's entries too."""
    from megatron.core import parallel_state

    return {
        **bridge_train_state(int(run.iteration), int(run.iteration) * int(run.global_batch_size)),
        "iteration": int(run.iteration),
        "ckpt_format": FORMAT,
        "world_size": int(run.env.world_size),
        "data_parallel_size": int(parallel_state.get_data_parallel_world_size()),
        "global_batch_size": int(run.global_batch_size),
        "tensor_model_parallel_size": int(run.cfg.model.tensor_model_parallel_size),
        "pipeline_model_parallel_size": int(run.cfg.model.pipeline_model_parallel_size),
        "context_parallel_size": int(run.cfg.model.context_parallel_size),
        "sharding_strategy": run.cfg.ddp.data_parallel_sharding_strategy,
        "seed": int(run.cfg.train.seed),
        "saved_by": {
            "torch": versions.package_version("torch"),
            "megatron-core": versions.package_version("megatron-core"),
        },
        # Megatron's OptimizerParamScheduler, as Bridge checkpoints it
        "scheduler": None if run.scheduler is None else run.scheduler.state_dict(),
    }


def megatron_lm_arguments(run: MegatronCoreRun) -> argparse.Namespace:
    """The run as Megatron-LM's arguments (``pretrain_gpt.py``'s, for the same model and batch): what
    its ``load_checkpoint`` reads from a checkpoint's ``args`` entry (``check_checkpoint_args``: the
    model's shape; the consumed-samples counters) and what :func:`train_state_without_file`
    reads back."""
    from megatron.core import parallel_state

    p, cfg = run.preset, run.cfg
    return argparse.Namespace(
        num_layers=p.num_layers,
        hidden_size=p.hidden_size,
        ffn_hidden_size=p.ffn_hidden_size,
        num_attention_heads=p.num_attention_heads,
        group_query_attention=p.num_query_groups != p.num_attention_heads,
        num_query_groups=p.num_query_groups,
        seq_length=p.seq_length,
        max_position_embeddings=p.seq_length,
        add_position_embedding=p.position_embedding_type == "learned_absolute",
        position_embedding_type=p.position_embedding_type,
        swiglu=p.swiglu,
        untie_embeddings_and_output_weights=p.untie_embeddings_and_output_weights,
        vocab_size=p.vocab_size,
        vocab_file=None,
        bf16=bool(run.model.config.bf16),
        tensor_model_parallel_size=cfg.model.tensor_model_parallel_size,
        pipeline_model_parallel_size=cfg.model.pipeline_model_parallel_size,
        context_parallel_size=cfg.model.context_parallel_size,
        data_parallel_size=parallel_state.get_data_parallel_world_size(),
        world_size=run.env.world_size,
        micro_batch_size=p.micro_batch_size,
        global_batch_size=int(run.global_batch_size),
        consumed_train_samples=int(run.iteration) * int(run.global_batch_size),
        skipped_train_samples=0,
        consumed_valid_samples=0,
        use_megatron_fsdp=cfg.uses_megatron_fsdp,
        data_parallel_sharding_strategy=cfg.ddp.data_parallel_sharding_strategy,
        data_parallel_random_init=False,
        ckpt_format=FORMAT,
        seed=cfg.train.seed,
    )


def train_state_without_file(iter_dir: Path, metadata: Metadata) -> dict[str, Any] | None:
    """The train state of a checkpoint Megatron-LM or Megatron-Bridge wrote (Megatron-LM's has no
    ``train_state.pt``; Bridge's holds only Bridge's counters): from its own DCP entries
    ``iteration``, ``opt_param_scheduler`` and Megatron-LM's ``args`` or Bridge's config file
    (``run_config.yaml``), read in this process alone. None for a checkpoint with neither. Unpickles
    ``args`` (DCP unpickles every non-tensor entry): the caller has warned that such a checkpoint is
    not verified."""
    saved = metadata.state_dict_metadata
    bridge_config = iter_dir / BRIDGE_RUN_CONFIG_FILE
    if "iteration" not in saved or ("args" not in saved and not bridge_config.is_file()):
        return None
    entries: dict[str, Any] = {"iteration": None}
    if "args" in saved:
        entries["args"] = None
    scheduler = _template(metadata, "opt_param_scheduler.")
    if scheduler:
        entries["opt_param_scheduler"] = scheduler
    state_dict_loader.load(entries, storage_reader=FileSystemReader(iter_dir), no_dist=True)
    if "args" not in entries:
        return _bridge_train_state_of(
            bridge_config, int(entries["iteration"]), entries.get("opt_param_scheduler")
        )
    args = entries["args"]
    return {
        "iteration": int(entries["iteration"]),
        "ckpt_format": FORMAT,
        "world_size": int(args.world_size),
        "data_parallel_size": int(args.data_parallel_size),
        "global_batch_size": int(args.global_batch_size),
        "tensor_model_parallel_size": int(args.tensor_model_parallel_size),
        "pipeline_model_parallel_size": int(args.pipeline_model_parallel_size),
        "context_parallel_size": int(getattr(args, "context_parallel_size", 1)),
        "sharding_strategy": getattr(args, "data_parallel_sharding_strategy", None),
        "seed": int(args.seed),
        "saved_by": {"megatron-lm": "save_checkpoint"},
        "scheduler": entries.get("opt_param_scheduler"),
    }


def layout_of(metadata: Metadata) -> str:
    """Which layout a checkpoint on disk has, from its keys."""
    return (
        LEGACY if any(k.startswith("rng_state.rank_") for k in metadata.state_dict_metadata) else MEGATRON_LM
    )


def _empty_like_saved(meta: Any) -> Any:
    if isinstance(meta, TensorStorageMetadata):
        return torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
    return None


def _template(metadata: Metadata, prefix: str) -> dict[str, Any]:
    """A nested dict to load the keys under ``prefix`` into: empty tensors of the saved shape and
    dtype, None for pickled objects (DCP replaces those). Key segments here never hold a '.'."""
    template: dict[str, Any] = {}
    for key, meta in metadata.state_dict_metadata.items():
        if not key.startswith(prefix):
            continue
        *parents, leaf = key[len(prefix) :].split(".")
        node = template
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = _empty_like_saved(meta)
    return template


@dataclass
class LoadState:
    """The state dict DCP loads into, and what the load needs afterwards."""

    state_dict: dict[str, Any]
    #: the model dict before the handlers: the run's own tensors (SwiGLU halves are views of them)
    raw_model: dict[str, Any]
    #: the optimizer's per-parameter state to load into (placeholders included) and its group metadata
    optimizer: dict[str, Any]
    #: parameters the optimizer had state for before the load
    had_state: frozenset[str]
    layout: str


def load_state_dict(run: MegatronCoreRun, metadata: Metadata) -> LoadState:
    """What DCP loads this checkpoint into, preprocessed. Changes nothing in the run (the checks
    before a load use it too). Collective."""
    layout = layout_of(metadata)
    pp_rank, tp_rank, dp_rank, _ = parallel_ranks()
    model = model_state_dict(run)
    own, optimizer = optimizer_state_dict(run, model)
    state_dict: dict[str, Any] = {"model": dict(model), "optimizer": optimizer}
    if layout == MEGATRON_LM:
        rng = _template(metadata, f"rng_state.{rng_key(pp_rank, tp_rank)}.")
        if not rng:  # another tensor/pipeline-parallel layout: the first one, as Megatron-LM does
            first = next((k for k in metadata.state_dict_metadata if k.startswith("rng_state.")), None)
            if first is not None:
                saved_key = first.split(".")[1]
                rng = _template(metadata, f"rng_state.{saved_key}.")
                state_dict["rng_state"] = {saved_key: rng}
        else:
            state_dict["rng_state"] = {rng_key(pp_rank, tp_rank): rng}
        stream = metadata.state_dict_metadata.get(f"data_stream.dp_rank_{dp_rank}")
        if stream is not None:
            state_dict["data_stream"] = {f"dp_rank_{dp_rank}": _empty_like_saved(stream)}
        apply_megatron_lm_handlers(run, state_dict)
    else:
        # Saved before digests existed: Transformer Engine's _extra_state was kept (not loaded
        # here, as before) and nothing was split.
        state_dict["model"] = {
            k: v for k, v in state_dict["model"].items() if not k.endswith("._extra_state")
        }
        rank_state = _template(metadata, f"rng_state.rank_{run.env.rank}.")
        if rank_state:
            state_dict["rng_state"] = {f"rank_{run.env.rank}": rank_state}
    preprocess_uneven(state_dict)
    return LoadState(state_dict, model, optimizer, frozenset(own["state"]), layout)


def install_optimizer_state(run: MegatronCoreRun, loaded: LoadState) -> None:
    """Hand the loaded optimizer state to the optimizer (after ``dcp.load``).

    Parameters get state where the optimizer keeps state: every parameter where its step makes
    state for all of them, else those it had state for and those whose local shard is not empty
    (an optimizer that keeps state only for parameters with a gradient has none for an empty
    shard; megatron-core's dummy step skips empty shards too).
    """

    def holds(entry: dict[str, Any]) -> bool:
        exp_avg = entry["exp_avg"]
        return (exp_avg.to_local() if isinstance(exp_avg, DTensor) else exp_avg).numel() > 0

    every = _keeps_state_for_every_parameter(run.optimizer)
    state = {
        name: entry
        for name, entry in loaded.optimizer["state"].items()
        if every or name in loaded.had_state or holds(entry)
    }
    run.optimizer.load_state_dict(
        {"state": state, "param_to_group_meta": loaded.optimizer["param_to_group_meta"]}
    )


def _keeps_state_for_every_parameter(optimizer: Any) -> bool:
    """Whether the torch optimizer inside megatron-core's makes state for every parameter of its
    groups at a step, also one without a gradient: Transformer Engine's FusedAdam, and the stand-in
    CPU ranks give megatron-core in its place (which says so); torch's and Apex's do not."""
    inner = type(getattr(optimizer, "optimizer", None))
    return bool(getattr(inner, "keeps_state_for_every_parameter", False)) or inner.__module__.startswith(
        "transformer_engine."
    )


def _saved_data_parallel_size(metadata: Metadata, layout: str) -> int:
    if layout == LEGACY:  # one entry per global rank; every rank was its own data-parallel rank
        prefix = "rng_state.rank_"
        return len(
            {k[len(prefix) :].split(".")[0] for k in metadata.state_dict_metadata if k.startswith(prefix)}
        )
    prefix = "data_stream.dp_rank_"
    return len({k for k in metadata.state_dict_metadata if k.startswith(prefix)})


def restore_run_state(
    run: MegatronCoreRun, loaded: LoadState, metadata: Metadata, train_state: dict[str, Any]
) -> None:
    """Set this rank's RNGs and data stream from a loaded checkpoint.

    Same data-parallel size as at save: every rank continues exactly where it stood (RNGs and its
    own data stream). Another data-parallel size: the RNGs come from the saved entry Megatron-LM
    would use (this rank's, else the first), and each rank's data stream restarts at a position
    derived from (seed, iteration, data-parallel rank) -- the data-parallel ranks draw independent
    streams, so there is no position to carry over; a :class:`CheckpointWarning` says so. The global
    batch changes with the data-parallel size, as it would in Megatron.
    """
    _, _, dp_rank, dp_size = parallel_ranks()
    saved_dp = _saved_data_parallel_size(metadata, loaded.layout)
    state = loaded.state_dict
    if loaded.layout == MEGATRON_LM:
        entries_by_key = state.get("rng_state", {})
        if entries_by_key:
            entries = next(iter(entries_by_key.values()))
            ordered = [entries[k] for k in sorted(entries, key=int)]
            chosen = ordered[dp_rank] if len(ordered) == dp_size and len(ordered) > 1 else ordered[0]
            _set_megatron_rng_state(chosen)
        stream = state.get("data_stream", {}).get(f"dp_rank_{dp_rank}")
    else:
        legacy = state.get("rng_state", {}).get(f"rank_{run.env.rank}")
        stream = None
        if legacy is not None:
            _set_legacy_rng_state(legacy)
            stream = legacy["data_stream"]
    if stream is not None and saved_dp == dp_size:
        run.load_data_stream_state(stream)
        return
    seed = int(train_state.get("seed", run.cfg.train.seed))
    iteration = int(train_state["iteration"])
    generator = torch.Generator().manual_seed(data_stream_reseed(seed, iteration, dp_rank))
    run.load_data_stream_state(generator.get_state())
    why = (
        f"loaded at data-parallel size {dp_size}, saved at {saved_dp}"
        if saved_dp
        # Megatron-LM's and Bridge's loops put their data iterators back from the consumed-samples count
        else "the checkpoint holds no data stream of this plugin (Megatron-LM or Megatron-Bridge wrote it)"
    )
    warnings.warn(
        CheckpointWarning(
            f"{why}: each rank's data stream restarts from a position derived from (seed {seed}, "
            f"iteration {iteration}, data-parallel rank); the samples differ from those of an "
            "uninterrupted run"
        ),
        stacklevel=3,
    )


def _set_megatron_rng_state(state: dict[str, Any]) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    torch.cuda.set_rng_state(state["cuda_rng_state"])
    tracker = state.get("rng_tracker_states") or {}
    if tracker:
        tensor_parallel.get_cuda_rng_tracker().set_states(tracker)


def _set_legacy_rng_state(state: dict[str, Any]) -> None:
    """This harness's pre-digest encoding: RNG states as tensors (see ``LEGACY``)."""
    torch.set_rng_state(state["torch_cpu"])
    version, has_gauss, gauss = state["python_meta"].tolist()
    random.setstate(
        (int(version), tuple(int(x) for x in state["python"].tolist()), gauss if has_gauss else None)
    )
    pos, np_has_gauss, np_gauss = state["numpy_meta"].tolist()
    np.random.set_state(
        ("MT19937", state["numpy_keys"].numpy().astype(np.uint32), int(pos), int(np_has_gauss), np_gauss)
    )
    if "torch_cuda" in state:
        torch.cuda.set_rng_state(state["torch_cuda"])
    tracker = state.get("tracker") or {}  # saved as "tracker.<name>", loaded back nested
    if tracker:
        from megatron.core import tensor_parallel

        tensor_parallel.get_cuda_rng_tracker().set_states(tracker)


def apply_loaded(
    run: MegatronCoreRun, loaded: LoadState, metadata: Metadata, train_state: dict[str, Any]
) -> None:
    """After DCP filled ``loaded``: make it the run's state (megatron-core's wrapper and optimizer)."""
    # DCP wrote into the DTensors in place (SwiGLU's _w/_v halves are views of the raw
    # tensors); load_state_dict runs Megatron-FSDP's post-load hook, which copies the loaded
    # main weights into the weights the forward pass uses (without it they stay inactive
    # until the first optimizer step: Bridge bug #3397).
    run.model.load_state_dict(_as_loaded_by_the_wrapper(run.model, loaded.raw_model))
    if run.cfg.ddp.data_parallel_sharding_strategy != "no_shard":
        # Drop parameter buckets all-gathered before the load (the optimizer step prefetches
        # the next forward's): else a run that trained before loading computes its next
        # forward with the old weights. no_shard gathers nothing (it has no weight buffer).
        run.model.module.synchronize_param_gather()
    install_optimizer_state(run, loaded)
    restore_run_state(run, loaded, metadata, train_state)
    run.iteration = int(train_state["iteration"])
    if run.scheduler is not None and train_state.get("scheduler") is not None:
        # The saving run's global batch: recorded, or (older train states) the same micro-batches
        # per data-parallel rank at the saved data-parallel size.
        here = int(run.global_batch_size)
        saved = train_state.get("global_batch_size") or (
            here
            * int(train_state["data_parallel_size"])
            // (run.env.world_size // run.cfg.model_parallel_size)
        )
        run.scheduler.load_state_dict(train_state["scheduler"], samples_ratio=here / int(saved))


def _as_loaded_by_the_wrapper(model: torch.nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` (the wrapper's ``state_dict()``) keyed as ``FullyShardedDataParallel.load_state_dict``
    takes it: it prefixes one ``module.`` and hands the dict to Megatron-FSDP, which matches keys by
    its module tree. The keys ``state_dict()`` gives are not that tree's where a Float16Module (bf16)
    sits in between: its ``state_dict`` drops its own ``module.``, its tree keeps it, and a strict load
    then refuses every key (a SwiGLU or FP8 model hides this: the wrapper loads those non-strictly).
    Each key is named by the tree's name of the module that holds it, found below all wrappers."""
    modules: dict[str, str] = {}
    tree = cast(torch.nn.Module, model.module)
    for name, _ in tree.named_modules():
        modules.setdefault(strip_wrappers(name), name)
    keyed = {}
    for key, value in state.items():
        owner, _, leaf = key.rpartition(".")
        tree_owner = modules.get(strip_wrappers(owner))
        keyed[f"{tree_owner}.{leaf}"[len("module.") :] if tree_owner else _strip_one_module(key)] = value
    return keyed


def _strip_one_module(key: str) -> str:
    return key[len("module.") :] if key.startswith("module.") else key


def _bridge_train_state_of(run_config: Path, iteration: int, scheduler: Any) -> dict[str, Any]:
    """The train state of a Megatron-Bridge checkpoint, its sizes and seed from Bridge's config file
    (the world size is not recorded there: a load at another data-parallel size says what it found)."""
    try:
        import yaml  # type: ignore[import-untyped]  # Bridge's dependency; no stubs here
    except ModuleNotFoundError as missing:
        raise CheckpointError(
            f"{run_config} (Megatron-Bridge's config) needs PyYAML to be read: pip install pyyaml"
        ) from missing
    config = yaml.safe_load(run_config.read_text())
    model, train = config["model"], config["train"]
    return {
        "iteration": iteration,
        "ckpt_format": FORMAT,
        "global_batch_size": int(train["global_batch_size"]),
        "tensor_model_parallel_size": int(model["tensor_model_parallel_size"]),
        "pipeline_model_parallel_size": int(model["pipeline_model_parallel_size"]),
        "context_parallel_size": int(model.get("context_parallel_size") or 1),
        "sharding_strategy": config["ddp"].get("data_parallel_sharding_strategy"),
        "seed": int(config["rng"]["seed"]),
        "saved_by": {"megatron-bridge": "save_checkpoint"},
        "scheduler": scheduler,
    }
