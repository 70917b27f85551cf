"""Comparing a run's state: snapshots of every model and optimizer shard, exact or within tolerance,
and a fingerprint of the full state that does not depend on the world size or sharding strategy.

The assertions are collective: every rank raises the same message, naming each rank's differences.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .checkpoint import flatten_state
from .collectives import gather_objects
from .megatron_layout import (
    OPTIMIZER_METADATA,
    model_state_dict,
    optimizer_state_dict,
    preprocess_uneven,
    strip_wrappers,
)

if TYPE_CHECKING:
    from .training import TrainingRun


def state_snapshot(run: TrainingRun) -> dict[str, torch.Tensor]:
    """This rank's shards of every model parameter and every optimizer state tensor, copied.

    Keys: ``model.<name>`` and ``optimizer.<param name>.<state>``. Take it before building another
    run (a new run re-initialises Megatron's parallel state).
    """
    snapshot: dict[str, torch.Tensor] = {}
    for name, value in model_state_dict(run).items():
        if isinstance(value, torch.Tensor):
            local = value.to_local() if isinstance(value, DTensor) else value
            snapshot[f"model.{name}"] = local.detach().cpu().clone()
    optimizer = run.optimizer.sharded_state_dict(
        model_state_dict(run), is_loading=False, metadata=OPTIMIZER_METADATA
    )
    for key, value in flatten_state(optimizer["state"], "optimizer."):
        if isinstance(value, torch.Tensor):
            local = value.to_local() if isinstance(value, DTensor) else value
            snapshot[key] = local.detach().cpu().clone()
    return snapshot


def state_differences(
    expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor], rtol: float = 0.0, atol: float = 0.0
) -> list[str]:
    """Keys whose tensors differ (exactly: ``torch.equal``, when both tolerances are 0)."""
    problems = [f"{k}: missing" for k in expected if k not in actual]
    problems += [f"{k}: unexpected" for k in actual if k not in expected]
    for key in expected.keys() & actual.keys():
        a, b = expected[key], actual[key]
        if a.shape != b.shape or a.dtype != b.dtype:
            problems.append(f"{key}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}")
        elif rtol == 0 and atol == 0:
            if not torch.equal(a, b):
                diff = (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
                problems.append(f"{key}: not equal (max abs diff {diff:.3e})")
        elif not torch.allclose(a, b, rtol=rtol, atol=atol):
            diff = (a.double() - b.double()).abs().max().item()
            problems.append(f"{key}: differs beyond rtol={rtol}, atol={atol} (max abs diff {diff:.3e})")
    return sorted(problems)


def assert_states_equal(
    expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor], rtol: float = 0.0, atol: float = 0.0
) -> None:
    """Collective: every rank raises the same AssertionError naming each rank's differing tensors."""
    local = state_differences(expected, actual, rtol, atol)
    gathered = gather_objects(local)
    lines = [f"rank {r}: {p}" for r, problems in enumerate(gathered) for p in (problems or [])]
    if lines:
        shown = lines[:10] + ([f"... {len(lines) - 10} more"] if len(lines) > 10 else [])
        raise AssertionError(f"{len(lines)} state tensors differ:\n  " + "\n  ".join(shown))


def assert_states_differ(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> None:
    """Collective: raise on every rank unless some model tensor differs on some rank."""
    local = any(
        not torch.equal(expected[k], actual[k])
        for k in expected.keys() & actual.keys()
        if k.startswith("model.")
    )
    gathered = gather_objects(local)
    if not any(gathered):
        raise AssertionError("the two runs' model states are identical: the comparison would prove nothing")


def _pieces(key: str, value: torch.Tensor) -> list[tuple[Any, ...]]:
    """(key, global shape, dtype, offsets, local data) for what this rank holds of ``value``."""
    if isinstance(value, DTensor):
        local = value.to_local().detach().cpu()
        if local.numel() == 0:
            return []
        # After preprocess_uneven, Megatron-FSDP's uneven shards report their true offsets here.
        # torch leaves DTensor.__create_chunk_list__ unannotated
        offsets = tuple(value.__create_chunk_list__()[0].offsets)  # type: ignore[no-untyped-call]
        return [(key, tuple(value.shape), value.dtype, offsets, local.clone())]
    full = value.detach().cpu().clone()
    return [(key, tuple(full.shape), full.dtype, (0,) * full.dim(), full)]


def _assemble(pieces: list[tuple[Any, ...]]) -> dict[str, str]:
    """Full tensors from every rank's pieces, each as a SHA-256 of its dtype, shape and bytes."""
    by_key: dict[str, list[tuple[Any, ...]]] = {}
    for piece in pieces:
        by_key.setdefault(piece[0], []).append(piece)
    digests: dict[str, str] = {}
    for key, parts in sorted(by_key.items()):
        _, shape, dtype, _, _ = parts[0]
        full = torch.zeros(shape, dtype=dtype)
        covered = torch.zeros(shape, dtype=torch.bool)
        verdict = None
        for _, _, _, offsets, local in parts:
            index = tuple(slice(o, o + n) for o, n in zip(offsets, local.shape, strict=True))
            seen = covered[index]
            if seen.any() and not torch.equal(full[index][seen], local[seen]):
                verdict = "replicas differ"  # two ranks hold different values for the same elements
            full[index] = local
            covered[index] = True
        if verdict is None and not bool(covered.all()):
            verdict = f"incomplete ({int((~covered).sum())} of {covered.numel()} elements on no rank)"
        digests[key] = verdict if verdict is not None else tensor_digest(full)
    return digests


def tensor_digest(tensor: torch.Tensor) -> str:
    """SHA-256 of a whole tensor's dtype, shape and bytes (what :func:`state_fingerprint` holds)."""
    full = tensor.detach().cpu()
    h = hashlib.sha256(f"{full.dtype}{list(full.shape)}".encode())
    h.update(full.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def state_fingerprint(run: TrainingRun) -> dict[str, str]:
    """Collective: every model tensor and optimizer state tensor of ``run``, whole, as a SHA-256.

    Independent of the world size and the sharding strategy (the shards of every rank are put
    back together first), so a run loaded at another world size compares exactly with the run
    that saved. Keys: ``model.<name>`` and ``optimizer.<param>.<state>``, names below the wrappers.
    An Adam ``step`` counts from the ranks that hold part of that parameter (megatron-core 0.16
    keeps no state for a parameter without a local shard; the harness adds placeholders).
    Gathers every tensor on rank 0: meant for test-sized models.
    """
    model = model_state_dict(run)
    _, optimizer = optimizer_state_dict(run, model)
    state: dict[str, Any] = {
        "model": {strip_wrappers(k): v for k, v in model.items() if isinstance(v, torch.Tensor)},
        "optimizer": {strip_wrappers(k): v for k, v in optimizer["state"].items()},
    }
    preprocess_uneven(state)
    pieces: list[tuple[Any, ...]] = []
    for key, value in flatten_state(state):
        if not isinstance(value, torch.Tensor):
            continue
        if key.startswith("optimizer.") and key.endswith(".step"):
            exp_avg = state["optimizer"][key[len("optimizer.") : -len(".step")]]["exp_avg"]
            holds = exp_avg.to_local().numel() if isinstance(exp_avg, DTensor) else exp_avg.numel()
            if not holds:
                continue
        pieces += _pieces(key, value)
    everyone: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(pieces, everyone, dst=0)
    result = [_assemble([p for theirs in everyone for p in theirs]) if everyone is not None else None]
    dist.broadcast_object_list(result, src=0)
    # rank 0 assembled the dict; after the broadcast every rank holds it
    return cast("dict[str, str]", result[0])


def fingerprint_differences(expected: dict[str, str], actual: dict[str, str]) -> list[str]:
    """Keys whose whole tensors differ between two fingerprints (same on every rank)."""
    problems = [f"{k}: missing" for k in expected if k not in actual]
    problems += [f"{k}: unexpected" for k in actual if k not in expected]
    problems += [
        f"{k}: differs ({expected[k][:16]} vs {actual[k][:16]})"
        for k in expected.keys() & actual.keys()
        if expected[k] != actual[k]
    ]
    return sorted(problems)
