"""Every megatron-core / torch version difference the harness cares about, in one place.

Reads package metadata only: importing this module imports neither torch nor megatron.
"""

from __future__ import annotations

import functools
from importlib import metadata
from typing import Any


def _version_tuple(text: str) -> tuple[int, ...]:
    parts: list[int] = []
    for piece in text.split("+")[0].split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def package_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def megatron_core_version() -> tuple[int, ...]:
    return _version_tuple(package_version("megatron-core"))


def stack_description() -> str:
    """The packages under test, for the session header: ``torch X, megatron-core Y``."""
    return f"torch {package_version('torch')}, megatron-core {package_version('megatron-core')}"


TENSOR_PARALLEL_FSDP_TE_BUG = (
    "megatron-core < 0.17 without Transformer Engine: FullyShardedDataParallel."
    "_fix_tensor_parallel_attributes does isinstance(m, (TELinear,)) with TELinear None -> TypeError "
    "for tp > 1 (upstream bug, fixed in megatron-core 0.18 by PR #3191)"
)


def live_process_groups() -> list[Any]:
    """This rank's process groups, oldest first (the default group included).

    torch has no public list of them; ``distributed_c10d._world.pg_names`` (a dict in creation
    order) has held it since torch 2.0. Empty if that layout ever changes: nothing is then released
    early, groups just live until the session's process group is destroyed.
    """
    from torch.distributed import distributed_c10d

    names = getattr(getattr(distributed_c10d, "_world", None), "pg_names", None)
    return list(names) if isinstance(names, dict) else []


def transformer_engine_available() -> bool:
    """Whether Transformer Engine imports (it needs CUDA; never on this project's CPU machines)."""
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def tensor_parallel_fsdp_needs_te() -> bool:
    """megatron-core < 0.17 without Transformer Engine: FullyShardedDataParallel's
    ``_fix_tensor_parallel_attributes`` does ``isinstance(m, (TELinear,))`` with ``TELinear`` None,
    a TypeError for any tp > 1 (upstream bug, fixed in megatron-core 0.18 by PR #3191)."""
    return megatron_core_version() < (0, 17) and not transformer_engine_available()


#: megatron-core dataclasses whose field names the config checks: the files defining them and the
#: classes whose fields they inherit
_DDP_SOURCE = "distributed/distributed_data_parallel_config.py"
_MEGATRON_CONFIG_SOURCES = {
    "DistributedDataParallelConfig": ((_DDP_SOURCE,), {"DistributedDataParallelConfig"}),
    "TorchFullyShardedDataParallelConfig": (
        ("distributed/torch_fully_sharded_data_parallel_config.py", _DDP_SOURCE),
        {"TorchFullyShardedDataParallelConfig", "DistributedDataParallelConfig"},
    ),
    "TransformerConfig": (
        ("transformer/transformer_config.py", "model_parallel_config.py"),
        {"TransformerConfig", "ModelParallelConfig"},
    ),
}


@functools.cache
def megatron_config_fields(class_name: str) -> frozenset[str] | None:
    """Field names of the installed megatron-core's ``DistributedDataParallelConfig`` or
    ``TransformerConfig`` (with ``ModelParallelConfig``), read from its source with ``ast``.

    Importing megatron would import torch; the plugin checks ``--mfsdp-set`` at configure time,
    before any rank work, so it reads the dataclass definitions instead. None when megatron-core
    is not installed or its layout is unknown (the run then checks when it builds the configs).
    """
    import ast
    from importlib import util

    try:
        spec = util.find_spec("megatron")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    names: set[str] = set()
    sources, classes = _MEGATRON_CONFIG_SOURCES[class_name]
    for relative in sources:
        for root in spec.submodule_search_locations:
            path = f"{root}/core/{relative}"
            try:
                with open(path, encoding="utf-8") as source:
                    tree = ast.parse(source.read())
            except OSError:
                continue
            for node in tree.body:
                if isinstance(node, ast.ClassDef) and node.name in classes:
                    names.update(
                        item.target.id
                        for item in node.body
                        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
                    )
            break
    return frozenset(names) or None


NO_SHARD_PARAM_SYNC_BUG = (
    "megatron-core 0.16.1 upstream bug: with data_parallel_sharding_strategy='no_shard' and "
    "overlap_param_gather=False, MegatronFSDP.start_param_sync (called by DistributedOptimizer."
    "step_with_ready_grads) runs all_gather_pipeline.async_bucket_gather for every bucket before its "
    "own 'model_weight_buffer is None: continue' check; no_shard has no model weight buffer, so "
    "fetch_bucket is called on None. With overlap_param_gather=True the path is not taken and no_shard "
    "trains. Fixed upstream by NVIDIA/Megatron-LM PR #3754 (start_param_sync returns early for no_shard; "
    "megatron-core 0.18)"
)


def no_shard_param_sync_bug() -> bool:
    """``no_shard`` + ``overlap_param_gather=False`` fails in ``start_param_sync`` (see the message):
    megatron-core before 0.18 (seen on 0.16.1; passes on 0.19.2)."""
    return megatron_core_version() < (0, 18)


META_INIT_LOCAL_SPEC = (
    "init_model_with_meta_device=True needs every module to have reset_parameters: Megatron-FSDP "
    "materialises meta parameters by calling it per module; this megatron-core's local "
    "(non-Transformer-Engine) VocabParallelEmbedding has none, so the wrapper raises ValueError. "
    "Not checked with the Transformer Engine layer spec (no GPU or TE in this session)"
)


def meta_init_unsupported_by_local_spec() -> bool:
    """Feature check, not a version number: does the local embedding lack ``reset_parameters``?
    Imports megatron (call it inside a rank only)."""
    from megatron.core.tensor_parallel import VocabParallelEmbedding

    return not any(
        hasattr(VocabParallelEmbedding, name) for name in ("reset_parameters", "_reset_parameters")
    )


FSDP2_FINISH_GRAD_SYNC_BUG = (
    "upstream API mismatch: megatron's finalize_model_grads calls "
    "model_chunk.finish_grad_sync(force_all_reduce=...), but TorchFullyShardedDataParallel inherits "
    "_BaseDataParallel.finish_grad_sync(self), which takes no such argument -> TypeError after the first "
    "backward. FSDP2 therefore cannot train through Megatron's schedule on this megatron-core"
)


def fsdp2_finish_grad_sync_bug() -> bool:
    """Feature check (imports megatron; call inside a rank): does FSDP2's ``finish_grad_sync`` lack
    the ``force_all_reduce`` argument that ``finalize_model_grads`` passes?"""
    import inspect

    from megatron.core.distributed import TorchFullyShardedDataParallel

    return (
        "force_all_reduce" not in inspect.signature(TorchFullyShardedDataParallel.finish_grad_sync).parameters
    )


NO_MEGATRON_LM_LAYOUT = (
    "this megatron-core has no megatron/core/transformer/fsdp_dtensor_checkpoint.py (it ships from "
    "0.16 on): Megatron-LM's fsdp_dtensor key layout (SwiGLU split into _w/_v) cannot be produced"
)


class MegatronLMHandlers:
    """megatron-core's fsdp_dtensor state-dict handlers, under names saying what each does."""

    def __init__(self, module: Any) -> None:
        self.drop_extra_state = module.handle_fp8_extra_state_case
        self.split_swiglu = module.handle_swiglu_in_state_dict
        self.globalize_experts = module.handle_experts_in_state_dict


def megatron_lm_fsdp_dtensor_handlers() -> MegatronLMHandlers | None:
    """The handlers Megatron-LM's ``preprocess_fsdp_dtensor_state_dict`` calls, from
    ``megatron.core.transformer.fsdp_dtensor_checkpoint``; None where that module is missing
    (megatron-core before 0.16). Imports megatron: call it inside a rank."""
    try:
        from megatron.core.transformer import fsdp_dtensor_checkpoint
    except ImportError:
        return None
    needed = ("handle_fp8_extra_state_case", "handle_swiglu_in_state_dict", "handle_experts_in_state_dict")
    if not all(hasattr(fsdp_dtensor_checkpoint, name) for name in needed):
        return None
    return MegatronLMHandlers(fsdp_dtensor_checkpoint)


SWIGLU_HANDLER_LOOKUP_BUG = (
    "upstream bug: megatron-core's handle_swiglu_in_state_dict (called by Megatron-LM's "
    "preprocess_fsdp_dtensor_state_dict) finds parameters with model.get_parameter(f'module.{key}') for "
    "model keys and key[len('module.'):] for optimizer keys; with Megatron-FSDP's wrapper the optimizer's "
    "names carry one 'module.' per wrapper (AttributeError: MegatronFSDP has no attribute 'decoder'), and "
    "a bf16 model's Float16Module breaks the model-key lookup too. Seen on megatron-core 0.16.1 and 0.19.2; "
    "related open reports: NVIDIA/Megatron-LM#5265, NVIDIA-NeMo/Megatron-Bridge#4236. The harness calls the "
    "handler with a view of the model that resolves names below all wrappers"
)


def swiglu_handler_lookup_bug() -> bool:
    """Megatron-LM's own fsdp_dtensor preprocessing fails on a SwiGLU Megatron-FSDP model (see the
    message); seen on 0.16.1 and 0.19.2, assumed until a newer megatron-core is checked."""
    return megatron_core_version() < (0, 20)


def megatron_lm_training_installed() -> bool:
    """Whether ``megatron.training`` (Megatron-LM's training loop and checkpointing) is installed: the
    megatron-core 0.19 wheel ships it, 0.16's does not. Looks for the file: importing
    ``megatron.training`` would import all of megatron-core (at collection, before any CUDA emulation)."""
    import os
    from importlib import util

    try:
        spec = util.find_spec("megatron")
    except (ImportError, ValueError):
        return False
    roots = spec.submodule_search_locations if spec is not None else None
    return any(os.path.isfile(os.path.join(root, "training", "checkpointing.py")) for root in roots or ())
