"""What torchrun (or an srun step mapped to torchrun's variables) told a process: both sides read it,
the parent to remove it from the rank sets it launches, a rank to join its peers."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class TorchrunEnv:
    """What torchrun told this process (its environment variables)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    #: the rendezvous store's address (torchrun's MASTER_ADDR, MASTER_PORT)
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    #: torchrun's agent hosts the store (TORCHELASTIC_USE_AGENT_STORE); otherwise rank 0 does
    agent_store: bool = False
    #: who started the ranks when torchrun did not (an srun step: see :mod:`.slurm`), for messages
    launched_by: str = ""
    #: the torchrun run's id (TORCHELASTIC_RUN_ID; ``--standalone`` makes a new one per run), the
    #: same on every rank
    run_id: str = ""

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
            master_addr=environ.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(environ["MASTER_PORT"]) if "MASTER_PORT" in environ else None,
            agent_store=environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
            run_id=environ.get("TORCHELASTIC_RUN_ID", ""),
        )

    def environ(self) -> dict[str, str]:
        """The variables torchrun gives this rank (what :meth:`from_environ` parses back); the store's
        address where it has a port."""
        variables = {
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.local_rank),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
        }
        if self.master_port is not None:
            variables |= {"MASTER_ADDR": self.master_addr, "MASTER_PORT": str(self.master_port)}
        return variables
