"""Choosing where the ranks run: CUDA devices over NCCL, or CUDA-emulated CPU ranks over gloo."""

from __future__ import annotations

import glob
import sys
from dataclasses import dataclass

import pytest


# pytest marks UsageError @final in its hints, yet a subclass is what keeps pytest's usage-error exit
class PlatformError(pytest.UsageError):  # type: ignore[misc]
    pass


@dataclass(frozen=True)
class PlatformChoice:
    platform: str  # "cuda" or "cpu"
    backend: str  # "nccl" or "gloo"
    reason: str


#: device nodes a CUDA (NVIDIA) or ROCm (AMD, torch.cuda via HIP) GPU shows up as on Linux
_GPU_DEVICE_NODES = ("/dev/nvidia[0-9]*", "/dev/kfd")


def visible_gpu_count(fast: bool = False) -> int:
    """GPUs torch can use here. ``fast``: first look for GPU device nodes, so that a machine
    without any answers 0 without importing torch (1-2 s in the parent session of plain mode).
    ``--mfsdp-platform=cuda`` always asks torch."""
    if fast and sys.platform.startswith("linux") and not any(glob.glob(p) for p in _GPU_DEVICE_NODES):
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def select_platform(requested: str, local_world_size: int) -> PlatformChoice:
    """``cuda`` when every local rank can have its own GPU, else ``cpu``; ``cuda`` on demand only.

    Asking for ``cuda`` where too few GPUs are visible is an error, never a silent CPU fallback.
    """
    if requested == "cpu":
        return PlatformChoice("cpu", "gloo", "requested")
    gpus = visible_gpu_count(fast=requested == "auto")
    if requested == "cuda":
        if gpus < local_world_size:
            raise PlatformError(
                f"--mfsdp-platform=cuda needs one GPU per local rank: {local_world_size} ranks on "
                f"this node but {gpus} CUDA device(s) visible (CUDA_VISIBLE_DEVICES, driver?); "
                "use --mfsdp-platform=cpu for CPU ranks"
            )
        return PlatformChoice("cuda", "nccl", "requested")
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
