"""GPUs for pytest-xdist workers: each worker's rank sets get a disjoint slice of the node's GPUs.

Under ``-n K`` on a GPU node every worker launches rank sets of its own, at the same time as the
others; without partitioning all of them would put their rank 0 on the first GPU. Worker ``gw<i>``
takes slice ``i`` of the GPUs this session sees (the caller's ``CUDA_VISIBLE_DEVICES`` in its order,
else devices ``0..n-1``), each slice as large as the biggest world size the session runs on CUDA, and
its rank sets are launched with ``CUDA_VISIBLE_DEVICES`` set to that slice. Every worker collects
the same tests, so all compute the same partition without talking to each other.

Plain data and pytest only: no torch here (the device count comes from :mod:`..wire.platform`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import pytest

from ..wire import platform


# pytest marks UsageError @final in its hints, yet a subclass is what keeps pytest's usage-error exit
class GpuSliceError(pytest.UsageError):  # type: ignore[misc]
    pass


def device_ids(environ: Mapping[str, str] = os.environ) -> list[str]:
    """The GPUs this process may hand out: the caller's ``CUDA_VISIBLE_DEVICES`` entries (ids, UUIDs
    or MIG ids, as given; no more than CUDA sees), else ``0 .. count-1``."""
    count = platform.visible_gpu_count()
    given = environ.get("CUDA_VISIBLE_DEVICES")
    if given is None:
        return [str(i) for i in range(count)]
    return [d.strip() for d in given.split(",") if d.strip()][:count]


def worker_index(worker_id: str, workers: int) -> int:
    """``gw3`` -> 3. A worker pytest-xdist restarted (``--max-worker-restart``) has a new, higher id:
    it takes the slice of ``id mod workers``, which may be a live worker's."""
    return int(worker_id.removeprefix("gw")) % workers


def worker_slice(devices: list[str], workers: int, index: int, world_size: int) -> list[str]:
    """Worker ``index``'s ``world_size`` devices out of ``devices`` (one slice per worker)."""
    if workers * world_size > len(devices):
        fit = len(devices) // world_size
        fix = f"use -n {fit} or fewer" if fit else "use fewer workers or a smaller world_size"
        raise GpuSliceError(
            f"-n {workers} workers x world_size={world_size} need {workers * world_size} GPUs, "
            f"{len(devices)} visible ({_source()}); {fix}, or --mfsdp-platform=cpu"
        )
    return devices[index * world_size : (index + 1) * world_size]


def _source() -> str:
    given = os.environ.get("CUDA_VISIBLE_DEVICES")
    return f"CUDA_VISIBLE_DEVICES={given}" if given is not None else "all devices"
