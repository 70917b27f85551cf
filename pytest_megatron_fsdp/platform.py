"""Choosing where the ranks run: CUDA devices over NCCL, or CUDA-emulated CPU ranks over gloo."""

from __future__ import annotations

from dataclasses import dataclass

import pytest


class PlatformError(pytest.UsageError):
    pass


@dataclass(frozen=True)
class PlatformChoice:
    platform: str  # "cuda" or "cpu"
    backend: str  # "nccl" or "gloo"
    reason: str


def select_platform(requested: str, local_world_size: int) -> PlatformChoice:
    """``cuda`` when every local rank can have its own GPU, else ``cpu``; ``cuda`` on demand only.

    Asking for ``cuda`` where too few GPUs are visible is an error, never a silent CPU fallback.
    """
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if requested == "cuda":
        if gpus < local_world_size:
            raise PlatformError(
                f"--mfsdp-platform=cuda needs one GPU per local rank: {local_world_size} ranks on "
                f"this node but {gpus} CUDA device(s) visible (CUDA_VISIBLE_DEVICES, driver?); "
                "use --mfsdp-platform=cpu for CPU ranks"
            )
        return PlatformChoice("cuda", "nccl", "requested")
    if requested == "cpu":
        return PlatformChoice("cpu", "gloo", "requested")
    if gpus >= local_world_size:
        return PlatformChoice("cuda", "nccl", f"auto: {gpus} GPU(s) for {local_world_size} local rank(s)")
    if gpus:
        return PlatformChoice(
            "cpu",
            "gloo",
            f"auto: only {gpus} GPU(s) for {local_world_size} local ranks, so CPU ranks; "
            "--mfsdp-platform=cuda makes that an error",
        )
    return PlatformChoice("cpu", "gloo", "auto: no CUDA device")
