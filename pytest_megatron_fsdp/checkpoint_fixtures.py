"""Checkpoint fixtures. Importing this module imports neither torch nor megatron."""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from .environment import DistEnv


@pytest.fixture
def checkpoint_dir(request: pytest.FixtureRequest, dist_env: DistEnv) -> Iterator[Path]:
    """A fresh private (0700) directory, the same path on every rank, removed after the test.

    It lies in the session's shared directory; its name comes from the test id, so every rank
    computes the same one without a collective.
    """
    import torch.distributed as dist

    digest = hashlib.sha1(request.node.nodeid.encode()).hexdigest()[:12]
    path = dist_env.shared_dir / f"ckpt-{digest}"
    if dist_env.rank == 0:
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(mode=0o700)
        os.chmod(path, 0o700)  # whatever the umask: checkpoints are unpickled on load
    dist.barrier()  # bounded by the process-group timeout
    try:
        yield path
    finally:
        dist.barrier()  # nobody removes it while another rank still reads it
        if dist_env.rank == 0:
            shutil.rmtree(path, ignore_errors=True)
