"""The vocabulary the harness and the Megatron-FSDP domain share: plain data, no torch, no pytest."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

DEFAULT_WORLD_SIZE = 2


@dataclass(frozen=True)
class DistEnv:
    """The rank's view of the running process group (the ``dist_env`` fixture's value)."""

    rank: int
    world_size: int
    local_rank: int
    #: ``"cpu"`` or ``"cuda:<local_rank>"``
    device: str
    #: ``"gloo"`` or ``"nccl"``
    backend: str
    #: ``"cpu"`` (CUDA-emulated CPU ranks) or ``"cuda"``
    platform: str
    #: a directory every rank of this session sees (removed at session end)
    shared_dir: Path


@dataclass(frozen=True)
class DistributedSpec:
    """A test's ``@pytest.mark.distributed(...)``: where and how long it runs."""

    world_size: int = DEFAULT_WORLD_SIZE
    #: Megatron's model-parallel sizes for the test
    tp: int = 1
    pp: int = 1
    cp: int = 1
    #: seconds, looked up once through ``--mfsdp-timeout``'s chain (the marker's ``timeout=`` first)
    timeout_s: float = 300.0
    #: plain mode: attempts after a failure, each in a fresh rank set (``--mfsdp-reruns``' chain:
    #: the marker's ``reruns=``, pytest-rerunfailures' settings count too)
    reruns: int = 0
    #: the kinds of failure that are rerun (``--mfsdp-only-rerun``); empty: every kind
    only_rerun: tuple[str, ...] = ()
    #: where ``timeout_s`` came from, a source label of its chain (e.g. "--mfsdp-timeout"), shown
    #: when the test times out
    timeout_source: str = "default"
    #: seconds without progress on any rank after which the test is reported hung before its
    #: timeout (``--mfsdp-hang-after``; 0: off), and where that came from
    hang_after_s: float = 60.0
    hang_after_source: str = "default"

    def to_json(self) -> dict[str, object]:
        return {**asdict(self), "only_rerun": list(self.only_rerun)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> DistributedSpec:
        return cls(**{**data, "only_rerun": tuple(data.get("only_rerun", ()))})
