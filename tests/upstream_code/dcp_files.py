"""What both modules here read or damage in a DCP checkpoint directory (Megatron-Bridge's and
Megatron-LM's ``iter_<n>`` folders): every tensor, whole; tensors that differ; a shard truncated or
removed, the metadata removed, a layer's entries removed from the metadata."""

from __future__ import annotations

import io
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def iteration_dir(save: Path, iteration: int) -> Path:
    return save / f"iter_{iteration:07d}"


def tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint directory, whole, read in this process alone (DCP's own
    converter), keyed by its dotted path."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    buffer = io.BytesIO()
    dcp_to_torch_save(checkpoint, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)  # written by the test itself: pickles allowed
    out: dict[str, torch.Tensor] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            out[prefix] = value
        elif isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), item)
        elif isinstance(value, list):
            for index, item in enumerate(value):
                walk(f"{prefix}.{index}", item)

    walk("", loaded)
    return out


def differences(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> list[str]:
    """Each key whose tensor is missing, extra or not bit-for-bit equal."""
    found = [f"missing: {key}" for key in expected.keys() - got.keys()]
    found += [f"extra: {key}" for key in got.keys() - expected.keys()]
    for key in sorted(expected.keys() & got.keys()):
        a, b = expected[key], got[key]
        if a.shape != b.shape or a.dtype != b.dtype or not torch.equal(a, b):
            found.append(f"differs: {key}")
    return found


def copied(source: Path, target: Path) -> Path:
    """A copy of the checkpoint directory ``source``, made on rank 0, every rank waiting for it."""
    return damaged(source, target, 0, lambda _: None)


def damaged(source: Path, target: Path, iteration: int, damage: Callable[[Path], None]) -> Path:
    """A copy of the checkpoint directory ``source`` with its iteration ``iteration`` damaged by
    ``damage`` on rank 0, every rank waiting for it."""
    if dist.get_rank() == 0:
        shutil.copytree(source, target)
        damage(iteration_dir(target, iteration))
    dist.barrier()
    return target


def truncate_a_shard(checkpoint: Path) -> None:
    shard = sorted(checkpoint.glob("*.distcp"))[-1]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])


def remove_a_shard(checkpoint: Path) -> None:
    sorted(checkpoint.glob("*.distcp"))[-1].unlink()


def remove_the_metadata(checkpoint: Path) -> None:
    (checkpoint / ".metadata").unlink()


#: the entries :func:`drop_the_second_layer` removes: model weights and their optimizer state
SECOND_LAYER = "decoder.layers.1."


def drop_the_second_layer(checkpoint: Path) -> None:
    """A checkpoint lacking model weights, as a writer that left some out makes: every entry of the
    second transformer layer gone from ``.metadata`` (the shards keep their bytes, unnamed)."""
    path = checkpoint / ".metadata"
    with path.open("rb") as f:
        metadata = pickle.load(f)  # written by the test itself
    kept = {k: v for k, v in metadata.state_dict_metadata.items() if SECOND_LAYER not in k}
    assert len(kept) < len(metadata.state_dict_metadata), "no second layer to drop"
    metadata.state_dict_metadata = kept
    with path.open("wb") as f:
        pickle.dump(metadata, f)
