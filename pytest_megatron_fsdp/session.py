"""The rank session: one process group per pytest session, brought up inside a torchrun rank.

Order matters and lives here: choose the platform, enable the CUDA-on-CPU emulation (CPU ranks
only, before anything imports megatron), init the process group with a short timeout, agree on a
directory every rank sees. :meth:`RankSession.close` undoes all of it, also after failures.
"""

from __future__ import annotations

import datetime
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from . import versions
from .environment import DistEnv
from .platform import PlatformChoice


@dataclass(frozen=True)
class TorchrunEnv:
    """What torchrun told this process (its environment variables)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int

    @classmethod
    def from_environ(cls, environ: dict[str, str] | None = None) -> TorchrunEnv | None:
        environ = dict(os.environ if environ is None else environ)
        if "WORLD_SIZE" not in environ or "RANK" not in environ:
            return None
        world = int(environ["WORLD_SIZE"])
        return cls(
            rank=int(environ["RANK"]),
            world_size=world,
            local_rank=int(environ.get("LOCAL_RANK", environ["RANK"])),
            local_world_size=int(environ.get("LOCAL_WORLD_SIZE", world)),
        )


class RankSession:
    """This rank's part of the distributed session."""

    def __init__(self, env: DistEnv, choice: PlatformChoice, owns_shared_dir: bool) -> None:
        self.env = env
        self.choice = choice
        self._owns_shared_dir = owns_shared_dir

    @classmethod
    def start(
        cls,
        torchrun: TorchrunEnv,
        choice: PlatformChoice,
        pg_timeout_s: float,
        shared_dir: str | None = None,
    ) -> RankSession:
        """Bring up the process group on ``choice``'s platform (CPU emulation already enabled)."""
        import torch
        import torch.distributed as dist

        kwargs = {}
        if choice.platform == "cuda":
            torch.cuda.set_device(torchrun.local_rank)
            device = f"cuda:{torchrun.local_rank}"
            kwargs["device_id"] = torch.device(device)
        else:
            device = "cpu"
        dist.init_process_group(
            backend=choice.backend,
            timeout=datetime.timedelta(seconds=pg_timeout_s),
            **kwargs,
        )
        owns = False
        if shared_dir is None:
            # Rank 0 makes a private (0700) directory and tells the others where it is.
            path = [tempfile.mkdtemp(prefix="mfsdp-session-") if torchrun.rank == 0 else None]
            owns = torchrun.rank == 0
            dist.broadcast_object_list(path, src=0)
            shared_dir = path[0]
        env = DistEnv(
            rank=torchrun.rank,
            world_size=torchrun.world_size,
            local_rank=torchrun.local_rank,
            device=device,
            backend=choice.backend,
            platform=choice.platform,
            shared_dir=Path(shared_dir),
        )
        return cls(env, choice, owns)

    def header(self) -> str:
        return (
            f"megatron-fsdp: platform={self.env.platform} ({self.choice.reason}), "
            f"backend={self.env.backend}, world_size={self.env.world_size}, "
            f"torch {versions.package_version('torch')}, "
            f"megatron-core {versions.package_version('megatron-core')}"
        )

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            try:
                dist.barrier()  # nobody removes the shared dir while another rank still uses it
            finally:
                dist.destroy_process_group()
        if self._owns_shared_dir:
            shutil.rmtree(self.env.shared_dir, ignore_errors=True)
